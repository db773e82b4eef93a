"""FAT5 behaves as a transformers user expects: output_attentions, return_dict=False, set_attn_implementation, the
text2text pipeline of an in-memory model, and one clear error for each misuse."""

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

import fat5
from conftest import tiny_config
from fat5 import FAT5ForConditionalGeneration, text2text_pipeline
from fat5.convert.checkpoint import convert_checkpoint
from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS
from t5_checkpoints import padded_batch

VOCAB = 101


def tiny(model_class=FAT5ForConditionalGeneration, **overrides):
    torch.manual_seed(0)
    return model_class(tiny_config(**{"num_decoder_layers": 3, **overrides})).eval()


def seq2seq_batch():
    batch = padded_batch(VOCAB)
    batch["decoder_input_ids"] = FAT5ForConditionalGeneration._shift_right(tiny(), batch.pop("labels"))
    return batch


def test_output_attentions_returns_the_eager_attention_weights():
    model = tiny()
    batch = seq2seq_batch()
    with torch.no_grad():
        output = model(**batch, output_attentions=True)
        plain = model(**batch)
    # "auto" runs SDPA on CPU and the eager reference for output_attentions: equal up to fp32 rounding.
    scale = plain.logits.abs().max()
    assert torch.allclose(output.logits, plain.logits, rtol=0, atol=1e-5 * scale.item())
    assert len(output.encoder_attentions) == 2
    assert len(output.decoder_attentions) == len(output.cross_attentions) == 3
    encoder_keys = batch["attention_mask"].bool()[:, None, None, :]
    for weights in output.encoder_attentions + output.cross_attentions:
        assert weights.shape[-1] == 29
        assert torch.all(weights.masked_select(~encoder_keys.expand_as(weights)) == 0)  # padded keys get nothing
        assert torch.allclose(weights.sum(-1), torch.ones(()), rtol=1e-5)
    for weights in output.decoder_attentions:
        assert weights.shape == (3, 4, 23, 23)
        assert torch.all(weights.triu(1) == 0)  # causal
    # The weights are the ones the model used: its first encoder layer's output recomputed from them.
    attention = model.encoder.block[0].layer[0]
    hidden = attention.layer_norm(model.shared(batch["input_ids"]))
    value = attention.SelfAttention._project(attention.SelfAttention.v, hidden)
    mixed = (output.encoder_attentions[0] @ value).transpose(1, 2).reshape(3, 29, 32)
    expected, _ = attention.SelfAttention(hidden, key_padding_mask=batch["attention_mask"].bool(),
                                          position=model.encoder._position_inputs(29, 29, 0, "cpu"))
    tolerance = 1e-5 * expected.abs().max().item()
    assert torch.allclose(attention.SelfAttention.o(mixed), expected, rtol=1e-4, atol=tolerance)


def test_attention_layers_and_blocks_return_weights_only_when_asked():
    model = tiny()
    block = model.decoder.block[1]
    hidden, encoder_hidden = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        output, weights = block.layer[0].SelfAttention(hidden)
        assert weights is None and output.shape == hidden.shape
        output_with_weights, weights = block.layer[0].SelfAttention(hidden, output_attentions=True)
        assert weights.shape == (2, 4, 5, 5)
        assert torch.allclose(output_with_weights, output, rtol=0, atol=1e-5 * output.abs().max().item())
        plain = block(hidden, encoder_hidden_states=encoder_hidden)
        with_weights = block(hidden, encoder_hidden_states=encoder_hidden, output_attentions=True)
    assert plain[1] is None and plain[2] is None
    assert with_weights[1].shape == (2, 4, 5, 5) and with_weights[2].shape == (2, 4, 5, 7)
    # Only the block that owns the stack's relative-bias table hands it on.
    assert plain[3] is None
    assert model.decoder.block[0](hidden, encoder_hidden_states=encoder_hidden)[3].shape == (8, 4)


def test_generate_returns_attentions_of_every_step():
    model = tiny()
    batch = padded_batch(VOCAB)
    output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=4,
                            min_new_tokens=4, output_attentions=True, return_dict_in_generate=True)
    assert len(output.cross_attentions) == len(output.decoder_attentions) == 4
    for step, (cross, self_attention) in enumerate(zip(output.cross_attentions, output.decoder_attentions)):
        assert len(cross) == 3 and cross[0].shape == (3, 4, 1, 29)
        assert self_attention[0].shape == (3, 4, 1, step + 1)
    assert output.encoder_attentions[0].shape == (3, 4, 29, 29)


def test_output_attentions_with_a_backend_that_cannot_give_them_says_so():
    model = tiny(attention_backend="sdpa")
    with pytest.raises(ValueError, match="output_attentions=True needs the eager attention backend"):
        model(**seq2seq_batch(), output_attentions=True)


@pytest.mark.parametrize("model_class", [FAT5ForConditionalGeneration, fat5.FAT5Model, fat5.FAT5EncoderModel,
                                         fat5.FAT5ForSequenceClassification, fat5.FAT5ForTokenClassification,
                                         fat5.FAT5ForQuestionAnswering])
def test_return_dict_false_returns_the_tuple_of_set_fields(model_class):
    model = tiny(model_class)
    batch = seq2seq_batch()
    if not model.config.is_encoder_decoder or model_class not in (FAT5ForConditionalGeneration, fat5.FAT5Model):
        batch = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        as_dict = model(**batch)
        as_tuple = model(**batch, return_dict=False)
    assert isinstance(as_tuple, tuple)
    assert len(as_tuple) == len(as_dict.to_tuple())
    for expected, actual in zip(as_dict.to_tuple(), as_tuple):
        if isinstance(expected, torch.Tensor):
            assert torch.equal(expected, actual)
    model.config.return_dict = False
    assert isinstance(model(**batch), tuple)


def test_set_attn_implementation_maps_onto_fat5_backends():
    model = tiny()
    batch = seq2seq_batch()
    with torch.no_grad():
        logits = {}
        for name in ("eager", "sdpa"):
            model.set_attn_implementation(name)
            assert model.config.attention_backend == name
            logits[name] = model(**batch).logits
    assert torch.allclose(logits["eager"], logits["sdpa"], rtol=1e-4, atol=1e-5 * logits["eager"].abs().max().item())
    with pytest.raises(ValueError, match="attention_backend = 'triton'"):
        model.set_attn_implementation("flash_attention_2")


def test_missing_decoder_inputs_say_what_to_pass():
    batch = padded_batch(VOCAB)
    for model in (tiny(fat5.FAT5Model), tiny()):
        with pytest.raises(ValueError, match="decoder_input_ids or decoder_inputs_embeds"):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_unknown_backend_fails_at_load_time(tmp_path):
    tiny().save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="FAT5Config.attention_backend: 'bogus'"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "model", attention_backend="bogus")
    config = tiny_config(num_decoder_layers=3)
    with pytest.raises(ValueError, match="FAT5Config.attention_backend: 'flash'"):
        config.attention_backend = "flash"


def test_triton_backend_on_a_cpu_tensor_says_what_to_use(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny(attention_backend="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors; got a cpu tensor. Use attention_backend='auto'"):
        model(**seq2seq_batch())


def test_in_memory_model_gets_the_text2text_pipeline():
    """Right after fine-tuning: no folder, transformers 4.57 or 5.x."""
    config, state_dict = convert_checkpoint(DEMO_CHECKPOINT)
    model = FAT5ForConditionalGeneration(config).eval()
    model.load_state_dict(state_dict, strict=not config.tie_word_embeddings)
    model.generation_config = GenerationConfig.from_pretrained(DEMO_CHECKPOINT)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_CHECKPOINT)
    prompts = [prompt for prompt, _ in DEMO_PROMPTS]
    answers = [answer for _, answer in DEMO_PROMPTS]
    for generator in (text2text_pipeline(model, tokenizer), model.text2text_pipeline(tokenizer)):
        assert [record["generated_text"] for record in generator(prompts, num_beams=1, do_sample=False)] == answers
        assert generator(prompts[0], num_beams=1)[0]["generated_text"] == answers[0]
