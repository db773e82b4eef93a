"""FAT5 converted from every T5 family reproduces transformers' model: logits, loss and gradients, on every backend.
(Generation against transformers' tokens, in every decoding mode, is the drift check's: test_drift.py.)"""

import pytest
import torch

from convert.checkpoint import convert_checkpoint
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
