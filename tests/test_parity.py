"""FAT5 converted from every T5 family reproduces transformers' model: logits, loss and gradients, on every backend.
(Generation against transformers' tokens, in every decoding mode, is the drift check's: test_drift.py.) The
converter's parity proof (convert/parity.py) passes every correct conversion, large weights included, and refuses
a wrong one."""

from pathlib import Path

import pytest
import torch

import fat5.convert.export
from fat5.convert.checkpoint import convert_checkpoint
from fat5.convert.flan_to_fat5 import main
from fat5.modeling_fat5 import FAT5ForConditionalGeneration
from t5_checkpoints import FAMILIES, load_hf_reference, make_t5_checkpoint, padded_batch

LOGITS_RTOL = 1e-5  # relative to the largest reference logit
GRAD_RTOL = 1e-4  # relative to the largest gradient entry of the parameter


def converted(family, tmp_path, backend="eager"):
    folder = make_t5_checkpoint(family, tmp_path / family)
    reference = load_hf_reference(family, folder)
    config, state_dict = convert_checkpoint(folder)
    config.attention_backend = backend
    model = FAT5ForConditionalGeneration(config).eval()
    model.load_state_dict(state_dict, strict=not config.tie_word_embeddings)
    return reference, model


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_loss_and_gradients_match_transformers(family, backend, tmp_path):
    reference, model = converted(family, tmp_path, backend)
    batch = padded_batch(reference.config.vocab_size)
    expected = reference(**batch)
    actual = model(**batch)
    real = batch["decoder_attention_mask"].bool()
    assert (expected.logits - actual.logits)[real].abs().max() <= LOGITS_RTOL * expected.logits[real].abs().max()
    assert actual.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)

    expected.loss.backward()
    actual.loss.backward()
    reference_parameters = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        expected_grad = reference_parameters[name].grad
        scale = expected_grad.abs().max().item()
        assert (parameter.grad - expected_grad).abs().max().item() <= GRAD_RTOL * scale, name


def test_pytorch_bin_and_sharded_checkpoints_convert_identically(tmp_path):
    safetensors_folder = make_t5_checkpoint("flan-t5", tmp_path / "st")
    bin_folder = make_t5_checkpoint("flan-t5", tmp_path / "bin", safe_serialization=False)
    sharded = tmp_path / "sharded"
    load_hf_reference("flan-t5", safetensors_folder).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    _, expected = convert_checkpoint(safetensors_folder)
    for folder in (bin_folder, sharded):
        _, actual = convert_checkpoint(folder)
        assert actual.keys() == expected.keys()
        for name in expected:
            assert torch.equal(actual[name], expected[name]), name


def test_loading_an_untied_source_prints_no_tie_warning(tmp_path):
    """transformers 5 warns that FLAN-T5's untied head "will NOT tie" (it forces tie_word_embeddings=True on T5
    configs); the converter's verification loads such sources, so the demo must not print it."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        folder = make_t5_checkpoint("flan-t5", tmp_path / "flan")
        model = load_hf_reference("flan-t5", folder)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "NOT tie" in r.getMessage()]
    assert not torch.equal(model.lm_head.weight, model.shared.weight)  # and it is really untied


FLASHT5_LARGE_WEIGHTS = Path(__file__).parent / "fixtures" / "flasht5" / "t5-gated-gelu"  # weights of std 0.5
LAYER = "decoder.block.1.layer.0.SelfAttention"


def swap_q_and_k(tensors):
    q, k = f"{LAYER}.q.weight", f"{LAYER}.k.weight"
    tensors[q], tensors[k] = tensors[k], tensors[q]


WRONG = {
    "perturbed": lambda tensors: tensors[f"{LAYER}.v.weight"].mul_(1 + 1e-3),
    "swapped": swap_q_and_k,
    "nan": lambda tensors: tensors[f"{LAYER}.o.weight"].view(-1).__setitem__(0, torch.nan),
}


def source(kind, tmp_path):
    return FLASHT5_LARGE_WEIGHTS if kind == "flasht5" else make_t5_checkpoint("flan-t5", tmp_path / "flan")


@pytest.mark.parametrize("kind", ["flan-t5", "flasht5"])
def test_the_parity_proof_passes_a_correct_conversion_with_large_weights(kind, tmp_path, capsys):
    """flashT5's fixture (gated GELU, weights of std 0.5) differs by rounding on a padded batch by more than 1e-5
    of its largest logit: its tolerance follows its rounding spread, so the correct conversion passes."""
    assert main([str(source(kind, tmp_path)), str(tmp_path / "out")]) == 0
    assert "Parity: max |logits difference|" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", list(WRONG))
@pytest.mark.parametrize("kind", ["flan-t5", "flasht5"])
def test_the_parity_proof_refuses_a_wrong_conversion(kind, wrong, tmp_path, capsys, monkeypatch):
    """One tensor written wrongly (off by 1e-3 of its values, swapped with another, a NaN) fails the proof: exit
    status 1, one line, nothing written."""
    convert_tensors = fat5.convert.export.iter_converted_tensors

    def wrongly(plan, *args):
        tensors = dict(convert_tensors(plan, *args))
        WRONG[wrong](tensors)
        yield from tensors.items()

    monkeypatch.setattr(fat5.convert.export, "iter_converted_tensors", wrongly)
    assert main([str(source(kind, tmp_path)), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    if wrong == "nan":
        assert error.startswith("error: parity check failed: 0 of the source model's logits and "), error
        assert error.endswith("of the written model's are NaN or infinite, not the same ones (2 random padded "
                              "sequences, float32)"), error
    else:
        assert error.startswith("error: parity check failed: max |logits difference|"), error
    assert not (tmp_path / "out").exists()


def test_the_proof_holds_one_model_at_a_time(tmp_path, capsys, monkeypatch):
    """The source model is freed before the written one loads, so verification peaks near one model's memory
    (benchmarks/convert_memory.py measures it); the caller used to keep the source alive through the check."""
    import gc
    import weakref

    from fat5.convert import parity
    from fat5.convert.checkpoint import load_source_model

    src = make_t5_checkpoint("flan-t5", tmp_path / "flan")
    assert main([str(src), str(tmp_path / "out"), "--no-verify"]) == 0
    sources, load_written = [], parity.load_fat5

    def load_reference(folder, dtype=None):
        model = load_source_model(folder, dtype)
        sources.append(weakref.ref(model))
        return model

    def load_fat5(folder, dtype=None):
        gc.collect()
        assert sources and sources[0]() is None, "the source model is still in memory"
        return load_written(folder, dtype)

    monkeypatch.setattr(parity, "load_fat5", load_fat5)
    difference, _ = parity.verify_parity(src, tmp_path / "out", None, load_reference)
    assert difference < 1e-4
