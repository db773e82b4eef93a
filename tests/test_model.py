"""FAT5 as a PreTrainedModel: position encodings, backends, caches, loading, heads, loss, fp16, PEFT."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSeq2SeqLM, AutoModelForTokenClassification

import fat5
from conftest import tiny_config
from fat5 import FAT5ForConditionalGeneration  # a package name's first use registers the Auto classes
from fat5.configuration_fat5 import FAT5Config
from fat5.loss_fat5 import seq2seq_lm_loss
from t5_checkpoints import padded_batch

POSITION_TYPES = ["t5", "rope", "alibi", "fire", "none"]
# flashT5's variants (convert/flasht5.py): RoPE also rotating values and cross-attention, partial and interleaved;
# asymmetric ALiBi (a dense bias); FIRE's 0-based normaliser.
POSITION_VARIANTS = {
    "rope-flasht5": dict(position_encoding_type="rope", partial_rotary_factor=0.5, rope_interleaved=True,
                         rope_cross_attention=True, rope_rotates_values=True),
    "alibi-asymmetric": dict(position_encoding_type="alibi", alibi_mode="asymmetric"),
    "fire-flasht5": dict(position_encoding_type="fire", fire_normalizer_offset=0, fire_normalizer_eps=1e-6),
}


def tiny_model(**overrides):
    torch.manual_seed(0)
    return FAT5ForConditionalGeneration(tiny_config(**overrides)).eval()


@pytest.mark.parametrize("field, value", [
    ("position_encoding_type", "learned"),
    ("feed_forward_proj", "gated-gelu-x"),
    ("feed_forward_proj", "nonsense"),
    ("attention_backend", "flash"),
    ("relative_attention_num_buckets", 7),
    ("relative_bias_per_layer", True),  # with position_encoding_type="rope" below
    ("partial_rotary_factor", 0.3),  # 64 * 0.3 = 19 channels: not pairs
    ("alibi_mode", "asymmetric"),  # with 7 heads: no two halves
    ("dropout_rate", 1.5),
    ("z_loss", -1.0),
    ("d_model", 0),
])
def test_inconsistent_config_names_the_field(field, value):
    extra = {"relative_bias_per_layer": {"position_encoding_type": "rope"},
             "partial_rotary_factor": {"position_encoding_type": "rope"},
             "alibi_mode": {"position_encoding_type": "alibi", "num_heads": 7}}.get(field, {})
    with pytest.raises(ValueError, match=f"FAT5Config.{field}"):
        FAT5Config(**{field: value}, **extra)


@pytest.mark.parametrize("position", POSITION_TYPES + list(POSITION_VARIANTS))
def test_backends_agree_and_cache_matches_full_forward(position):
    model = tiny_model(**POSITION_VARIANTS.get(position, {"position_encoding_type": position}))
    batch = padded_batch(101)
    real = batch["decoder_attention_mask"].bool()
    logits = {}
    for backend in ("eager", "sdpa"):
        model.config.attention_backend = backend
        logits[backend] = model(**batch).logits
    assert (logits["eager"] - logits["sdpa"])[real].abs().max() <= 1e-5 * logits["eager"][real].abs().max()

    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8)
    cached = model.generate(**inputs, do_sample=False)
    assert torch.equal(model.generate(**inputs, do_sample=False, use_cache=False), cached)
    assert torch.equal(model.generate(**inputs, num_beams=2, use_cache=True),
                       model.generate(**inputs, num_beams=2, use_cache=False))


@pytest.mark.parametrize("position", POSITION_TYPES)
def test_save_and_from_pretrained_round_trip(position, tmp_path):
    model = tiny_model(position_encoding_type=position)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is FAT5ForConditionalGeneration
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    batch = padded_batch(101)
    assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def test_tied_model_saves_the_embedding_once(tmp_path):
    model = tiny_model(tie_word_embeddings=True, feed_forward_proj="relu")
    assert model.lm_head.weight is model.shared.weight
    assert model.config.scale_decoder_outputs
    model.save_pretrained(tmp_path)
    loaded = FAT5ForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.shared.weight
    assert torch.equal(loaded.shared.weight, model.shared.weight)


def test_gradient_checkpointing_gives_the_same_gradients():
    batch = padded_batch(101)
    gradients = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(**batch).loss.backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in gradients[0].items():
        assert (gradients[1][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_loss_ignores_padding_and_adds_smoothing_and_z_loss():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 3:] = -100
    real = labels != -100
    expected = F.cross_entropy(logits[real], labels[real])
    assert torch.allclose(seq2seq_lm_loss(logits, labels), expected)
    smoothed = F.cross_entropy(logits[real], labels[real], label_smoothing=0.1)
    assert torch.allclose(seq2seq_lm_loss(logits, labels, label_smoothing=0.1), smoothed)
    z = torch.logsumexp(logits[real], dim=-1).pow(2).mean()
    assert torch.allclose(seq2seq_lm_loss(logits, labels, z_loss=1e-3), expected + 1e-3 * z)
    summed = F.cross_entropy(logits[real], labels[real], reduction="sum")
    assert torch.allclose(seq2seq_lm_loss(logits, labels, num_items_in_batch=20), summed / 20)


def test_model_loss_uses_config_terms():
    model = tiny_model(z_loss=1e-2, label_smoothing=0.1)
    batch = padded_batch(101)
    output = model(**batch)
    assert torch.allclose(output.loss, seq2seq_lm_loss(output.logits, batch["labels"], 0.1, 1e-2))


def test_fp16_does_not_overflow_on_large_ffn_activations(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        # FLAN-T5-like: FFN outputs far beyond fp16's 65504.
        for block in list(model.encoder.block) + list(model.decoder.block):
            block.layer[-1].DenseReluDense.wo.weight.mul_(3e4)
    batch = padded_batch(101)
    reference = model(**batch).logits
    model.save_pretrained(tmp_path)
    half = FAT5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float16).eval()
    assert half.encoder.block[0].layer[-1].DenseReluDense.wo.weight.dtype == torch.float32
    assert half.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float16
    logits = half(**batch).logits
    assert torch.isfinite(logits).all()
    real = batch["decoder_attention_mask"].bool()
    assert (logits.float() - reference)[real].abs().max() / reference.abs().max() < 2e-2


def test_auto_classes_and_encoder_heads_load_a_seq2seq_checkpoint(tmp_path):
    model = tiny_model(num_labels=3)
    model.save_pretrained(tmp_path)
    batch = padded_batch(101)
    encoder_inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    encoder_states = model.encoder(**encoder_inputs).last_hidden_state

    base = AutoModel.from_pretrained(tmp_path).eval()
    assert type(base) is fat5.FAT5Model
    encoder = fat5.FAT5EncoderModel.from_pretrained(tmp_path).eval()
    assert torch.equal(encoder(**encoder_inputs).last_hidden_state, encoder_states)

    token = AutoModelForTokenClassification.from_pretrained(tmp_path)
    assert type(token) is fat5.FAT5ForTokenClassification
    labels = torch.randint(0, 3, batch["input_ids"].shape).masked_fill(batch["attention_mask"] == 0, -100)
    output = token(**encoder_inputs, labels=labels)
    assert output.logits.shape == (3, 29, 3) and torch.isfinite(output.loss)
    output.loss.backward()

    sequence = fat5.FAT5ForSequenceClassification.from_pretrained(tmp_path)
    output = sequence(**encoder_inputs, labels=torch.tensor([0, 2, 1]))
    assert output.logits.shape == (3, 3) and torch.isfinite(output.loss)

    qa = fat5.FAT5ForQuestionAnswering.from_pretrained(tmp_path)
    output = qa(**encoder_inputs, start_positions=torch.tensor([1, 2, 40]), end_positions=torch.tensor([3, 4, 5]))
    assert output.start_logits.shape == (3, 29) and torch.isfinite(output.loss)
    assert torch.equal(qa.shared.weight, model.shared.weight)


def test_padding_does_not_change_real_tokens():
    """Masks act on keys: padding a sequence (left or right) leaves its real positions' outputs unchanged."""
    model = tiny_model()
    ids = torch.randint(2, 101, (1, 9))
    alone = model.encoder(input_ids=ids).last_hidden_state
    for left in (True, False):
        pad = torch.zeros(1, 4, dtype=torch.long)
        padded = torch.cat([pad, ids] if left else [ids, pad], 1)
        mask = (torch.arange(13) >= 4) if left else (torch.arange(13) < 9)
        states = model.encoder(input_ids=padded, attention_mask=mask[None].long()).last_hidden_state
        real = states[:, 4:] if left else states[:, :9]
        # T5's bucket of a pair depends on relative positions only, so left padding is harmless too.
        assert (real - alone).abs().max() <= 1e-5 * alone.abs().max()


def test_triton_backend_trains_with_attention_dropout(monkeypatch):
    """attention_dropout_rate 0.1 in training runs the kernel with its in-kernel dropout (it used to refuse), and
    torch.manual_seed reproduces the step; eval runs it without dropout."""
    from fat5.kernels import flash_attention_t5 as kernel_module

    calls = []
    kernel = kernel_module.flash_attention_t5
    monkeypatch.setattr(kernel_module, "flash_attention_t5",
                        lambda *args, **kwargs: calls.append(kwargs["dropout_p"]) or kernel(*args, **kwargs))
    model = tiny_model(dropout_rate=0.1, num_heads=1, d_kv=32, num_layers=1, num_decoder_layers=1,
                       attention_backend="triton").train()
    batch = padded_batch(101, length=12, decoder_length=5)
    losses = []
    for _ in range(2):
        torch.manual_seed(3)
        losses.append(model(**batch).loss)
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])
    assert calls == [0.1] * 3 * 2  # encoder self, decoder self and cross-attention, in both steps
    calls.clear()
    model.eval()(**batch)
    assert calls == [0.0] * 3


@pytest.mark.parametrize("position", ["fire", "alibi-asymmetric"])
def test_triton_backend_still_refuses_a_dense_bias(position):
    model = tiny_model(**POSITION_VARIANTS.get(position, {"position_encoding_type": position}),
                       attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend='triton' has no dense bias"):
        model(**padded_batch(101))


def test_auto_backend_runs_the_kernel_on_cuda():
    """On CUDA, "auto" picks the kernel (with or without dropout: dropout does not decide); SDPA only for a dense
    bias (FIRE, asymmetric ALiBi) or a head dim the kernel has no tiles for. It decides on the device, the head dim
    and the bias kind alone: no tensor is needed to ask it."""
    from fat5.attention_fat5 import triton_installed
    from fat5.attention_select_fat5 import needs_dense_bias, select_attention_backend

    if not triton_installed():
        pytest.skip("needs triton")
    config = tiny_config(dropout_rate=0.1)
    assert select_attention_backend(config, torch.device("cuda"), 64) == "triton"
    assert select_attention_backend(config, "cuda:0", 128, dense_bias=False) == "triton"
    assert select_attention_backend(config, torch.device("cuda"), 64, dense_bias=True) == "sdpa"
    assert select_attention_backend(config, torch.device("cuda"), 48) == "sdpa"
    assert not needs_dense_bias(config)
    assert needs_dense_bias(tiny_config(position_encoding_type="fire"))
    assert needs_dense_bias(tiny_config(**POSITION_VARIANTS["alibi-asymmetric"]))
    assert not needs_dense_bias(tiny_config(position_encoding_type="alibi"))


def test_auto_backend_is_sdpa_on_cpu():
    from fat5.attention_select_fat5 import select_attention_backend

    assert select_attention_backend(tiny_config(), torch.device("cpu"), 8) == "sdpa"
    assert select_attention_backend(tiny_config(attention_backend="eager"), "cpu", 8) == "eager"


def test_peft_lora_on_t5_module_names():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    lora = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q", "v"], r=4))
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert any(".SelfAttention.q.lora_A" in name for name in trainable)
    assert any(".EncDecAttention.v.lora_B" in name for name in trainable)
    lora.train()
    lora(**padded_batch(101)).loss.backward()


def test_fresh_model_uses_t5_initialisation():
    config = tiny_config(d_model=64, d_kv=16, d_ff=256, vocab_size=500)
    model = FAT5ForConditionalGeneration(config)
    attention = model.encoder.block[0].layer[0].SelfAttention
    expected = {
        attention.q.weight: (64 * 16) ** -0.5,
        attention.k.weight: 64**-0.5,
        attention.o.weight: (4 * 16) ** -0.5,
        model.encoder.block[0].layer[-1].DenseReluDense.wo.weight: 256**-0.5,
        model.shared.weight: 1.0,
        model.lm_head.weight: 1.0,
    }
    for weight, std in expected.items():
        assert weight.std().item() == pytest.approx(std, rel=0.15)
    assert torch.equal(model.encoder.final_layer_norm.weight, torch.ones(64))


@pytest.mark.parametrize("position", ["t5", *(pytest.param(position, marks=pytest.mark.slow)
                                            for position in ("alibi", "rope", "rope-flasht5"))])
def test_triton_backend_matches_eager_inside_the_model(position, kernel_device):
    """The kernel as the model's backend (interpreted on CPU): logits, gradients and cached generation."""
    model = tiny_model(**POSITION_VARIANTS.get(position, {"position_encoding_type": position}), d_model=64, d_kv=32,
                       num_heads=2).to(kernel_device)
    batch = {name: tensor.to(kernel_device) for name, tensor in padded_batch(101).items()}
    real = batch["decoder_attention_mask"].bool()
    results = {}
    for backend in ("eager", "triton"):
        model.zero_grad()
        model.config.attention_backend = backend
        output = model(**batch)
        output.loss.backward()
        results[backend] = (output.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    eager_logits, triton_logits = results["eager"][0][real], results["triton"][0][real]
    assert (eager_logits - triton_logits).abs().max() <= 1e-5 * eager_logits.abs().max()
    for name, grad in results["eager"][1].items():
        assert (results["triton"][1][name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name
    inputs = dict(input_ids=batch["input_ids"][:2], attention_mask=batch["attention_mask"][:2], max_new_tokens=6,
                  do_sample=False)
    model.config.attention_backend = "eager"
    expected = model.generate(**inputs)
    model.config.attention_backend = "triton"
    assert torch.equal(model.generate(**inputs), expected)


@pytest.mark.parametrize("per_layer", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kernel_inputs_are_built_once_per_stack_forward(monkeypatch, per_layer, kernel_device):
    """The kernel's bias lookup table (gathered from the bucket table) and additive key mask are built once per
    stack forward and shared by its layers; umT5-style per-layer tables (relative_bias_per_layer) get one each. The
    shared table's gradient, the sum over the layers, is eager's."""
    from collections import Counter

    from fat5 import attention_guard_fat5 as guard
    from fat5.kernels import flash_attention_t5 as kernel_module

    monkeypatch.setattr(guard, "GUARDED_DEVICES", set())  # no first-use check on a GPU: count the model's
    built = Counter()
    for name in ("relative_bias_lut", "additive_key_mask"):
        real = getattr(kernel_module, name)
        monkeypatch.setattr(kernel_module, name, lambda *args, _real=real, _name=name: built.update([_name])
                            or _real(*args))
    model = tiny_model(d_model=64, d_kv=32, num_heads=2, num_layers=3, num_decoder_layers=2,
                       relative_bias_per_layer=per_layer).to(kernel_device).train()
    batch = {name: tensor.to(kernel_device) for name, tensor in padded_batch(101, length=21, decoder_length=9).items()}
    grads = {}
    for backend in ("eager", "triton"):
        model.zero_grad()
        model.config.attention_backend = backend
        model(**batch).loss.backward()
        grads[backend] = {name: p.grad.clone() for name, p in model.named_parameters() if "relative" in name}
    tables = 3 + 2 if per_layer else 2  # one per stack, or one per layer
    # Key masks: the encoder's self-attention, the decoder's self- and cross-attention.
    assert built == {"relative_bias_lut": tables, "additive_key_mask": 3}
    assert len(grads["eager"]) == tables
    for name, grad in grads["eager"].items():
        assert (grads["triton"][name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name


@pytest.mark.parametrize("use_reentrant", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_shared_kernel_inputs_under_gradient_checkpointing(use_reentrant, kernel_device):
    """Recomputed blocks get the lookup table of the table they recompute (a shared one computed under no_grad
    would lose the table's gradient): every gradient equals the eager model's without checkpointing."""
    model = tiny_model(d_model=64, d_kv=32, num_heads=2, num_layers=2, num_decoder_layers=2,
                       attention_backend="eager").to(kernel_device).train()
    batch = {name: tensor.to(kernel_device) for name, tensor in padded_batch(101, length=21, decoder_length=9).items()}
    model(**batch).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.config.attention_backend = "triton"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model(**batch).loss.backward()
    for name, grad in expected.items():
        actual = model.get_parameter(name).grad
        assert actual is not None and (actual - grad).abs().max() <= 1e-4 * grad.abs().max(), name
