"""PEFT's prompt-learning methods on FAT5, called as a T5 user calls them: `get_peft_model` with prefix tuning (with
and without its projection) or prompt tuning, then `generate` and a training forward. transformers' T5 converted
into the FAT5 model is the spec where it answers the same question. Prefix tuning's generation is checked against
what it computes by definition: greedy decoding by T5's whole forwards, each given the virtual tokens afresh."""

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from fat5 import FAT5ForConditionalGeneration
from fat5.compat_fat5 import cache_field, output_cache
from fat5.convert.flan_to_fat5 import main as convert_main
from t5_checkpoints import make_t5_checkpoint, padded_batch

peft = pytest.importorskip("peft")

STEPS = 6
METHODS = {
    "prefix": lambda: peft.PrefixTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=5),
    "prefix-projection": lambda: peft.PrefixTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=5,
                                                         prefix_projection=True, encoder_hidden_size=16),
    "prompt": lambda: peft.PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=5),
}


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(T5, FAT5) with the same weights: a FLAN-T5-shaped checkpoint whose weights give clear, varied greedy
    choices, and its conversion."""
    root = tmp_path_factory.mktemp("peft")
    source = make_t5_checkpoint("flan-t5", root / "t5", weight_std=0.6)
    assert convert_main([str(source), str(root / "fat5"), "--no-verify"]) == 0
    return AutoModelForSeq2SeqLM.from_pretrained(source).eval(), FAT5ForConditionalGeneration.from_pretrained(
        root / "fat5").eval()


def adapted(model, method):
    """A copy of `model` under PEFT's `method`, its virtual tokens drawn from one seed (the same for every model)."""
    torch.manual_seed(0)
    return peft.get_peft_model(copy.deepcopy(model), METHODS[method]()).eval()


def encoder_inputs(model):
    batch = padded_batch(model.config.vocab_size, length=9)
    return {name: batch[name] for name in ("input_ids", "attention_mask")}


def generate(model, use_cache=True, **options):
    """Greedy tokens of `model` (a PEFT model, or a plain one)."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    with torch.no_grad(), warnings.catch_warnings():
        # transformers 5.24's T5 and FAT5 alike say that PEFT passes its cache under the deprecated name.
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(**encoder_inputs(base), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                              use_cache=use_cache, **options)


def prefix_greedy(peft_model):
    """Greedy decoding as prefix tuning defines it: every step a whole forward of the decoded tokens after the
    virtual tokens (a fresh prefix cache; end-of-sequence barred, as min_new_tokens bars it)."""
    model = peft_model.get_base_model()
    inputs = encoder_inputs(model)
    batch = inputs["input_ids"].shape[0]
    tokens = torch.full((batch, 1), model.config.decoder_start_token_id)
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(**inputs, decoder_input_ids=tokens, **cache_field(peft_model.get_prompt(batch))).logits
            logits[:, -1, model.config.eos_token_id] = -torch.inf
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("method", ["prefix", "prefix-projection"])
def test_prefix_tuning_generates_the_tokens_of_its_prefix(twins, method):
    """With a dynamic cache, a static one or none, FAT5 generates what prefix tuning computes by definition (T5's
    forward, step by step, the decoder's tokens placed after the virtual tokens, as PEFT's training forward places
    them) on every release. T5's own generate does not: transformers 5.24's passes the empty cache it made as
    `cache` beside PEFT's virtual tokens under the old name, and T5 drops them; 4.57's places the decoder's tokens by
    the positions generate counts (`cache_position`), which leave the virtual tokens out (its first step then sees
    the first virtual token only), so 4.57's T5 generates other tokens than its own forward under the same prefix."""
    t5, fat5 = (adapted(model, method) for model in twins)
    expected = prefix_greedy(t5)
    assert expected[:, 1:].unique().numel() >= 4, expected
    assert not torch.equal(expected, generate(twins[0]))  # the prefix changes the tokens: a dropped one would show
    assert torch.equal(prefix_greedy(fat5), expected)
    assert torch.equal(generate(fat5, use_cache=True), expected)
    assert torch.equal(generate(fat5, cache_implementation="static"), expected)
    # Without a cache, generate hands the model every token again with the cache the last forward returned (PEFT
    # passes its virtual tokens at the first step only). FAT5 reads a cache given with use_cache=False and leaves it
    # as it was, so every step is a whole forward after the virtual tokens. (Written into, as T5 does, it grew by
    # each step's tokens, which the next step placed after a copy of themselves.)
    assert torch.equal(generate(fat5, use_cache=False), expected)


def test_a_forward_without_a_cache_reads_the_cache_it_is_given_and_leaves_it(twins):
    """use_cache=False with a cache (PEFT's virtual tokens): the forward attends to them, returns the cache as it
    was given, and a prefix's gradient reaches the virtual tokens."""
    fat5 = adapted(twins[1], "prefix")
    model, batch = fat5.get_base_model(), encoder_inputs(twins[1])
    rows = batch["input_ids"].shape[0]
    decoder = torch.full((rows, 3), model.config.decoder_start_token_id)
    prompt = fat5.get_prompt(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        output = model(**batch, decoder_input_ids=decoder, use_cache=False, **cache_field(prompt))
        with torch.no_grad():
            cached = model(**batch, decoder_input_ids=decoder, use_cache=True, **cache_field(fat5.get_prompt(rows)))
            without_prefix = model(**batch, decoder_input_ids=decoder, use_cache=False)
    assert output_cache(output) is prompt and prompt.get_seq_length() == 5
    assert torch.allclose(output.logits, cached.logits, rtol=1e-5, atol=1e-5 * cached.logits.abs().max().item())
    assert not torch.allclose(output.logits, without_prefix.logits, atol=1e-3)
    output.logits.sum().backward()
    assert all(parameter.grad is not None for parameter in fat5.parameters() if parameter.requires_grad)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_prompt_tuning_generates_t5s_tokens(twins, use_cache):
    t5, fat5 = (adapted(model, "prompt") for model in twins)
    expected = generate(t5, use_cache)
    assert expected[:, 1:].unique().numel() >= 4, expected
    assert torch.equal(generate(fat5, use_cache), expected)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_training_step_gives_t5s_loss_and_reaches_only_the_virtual_tokens(twins, method):
    losses = []
    for model in twins:
        peft_model = adapted(model, method)
        peft_model.train()
        batch = padded_batch(model.config.vocab_size, length=9, decoder_length=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            loss = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"]).loss
        loss.backward()
        trainable = [parameter for parameter in peft_model.parameters() if parameter.requires_grad]
        assert trainable and all(parameter.grad is not None for parameter in trainable)
        assert all(parameter.grad is None for parameter in peft_model.get_base_model().parameters())
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
