"""The converter maps every tensor or refuses, naming the culprit."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fat5.convert.checkpoint import ConversionError, convert_checkpoint, plan_conversion
from t5_checkpoints import make_t5_checkpoint


def rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_plan_accounts_for_every_tensor(tmp_path):
    folder = make_t5_checkpoint("t5-v1.0", tmp_path / "v10", safe_serialization=False)
    plan = plan_conversion(folder)
    source_names = set(plan.source.names())
    assert source_names == set(plan.mapping.values()) | set(plan.redundant) | set(plan.ignored)
    assert plan.config.tie_word_embeddings and plan.config.scale_decoder_outputs
    assert set(plan.redundant) == {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}


def test_untied_checkpoint_keeps_its_head(tmp_path):
    config, state_dict = convert_checkpoint(make_t5_checkpoint("flan-t5", tmp_path / "flan"))
    assert not config.tie_word_embeddings and not config.scale_decoder_outputs
    assert not torch.equal(state_dict["lm_head.weight"], state_dict["shared.weight"])


def test_umt5_gets_a_bias_table_per_layer(tmp_path):
    config, state_dict = convert_checkpoint(make_t5_checkpoint("umt5", tmp_path / "umt5"))
    assert config.relative_bias_per_layer
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" in state_dict


def test_dtype_casts_floating_tensors(tmp_path):
    _, state_dict = convert_checkpoint(make_t5_checkpoint("flan-t5", tmp_path / "flan"), dtype=torch.bfloat16)
    assert {tensor.dtype for tensor in state_dict.values()} == {torch.bfloat16}


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("encoder.block.1.layer.1.DenseReluDense.wo.weight"), "lacks"),
    (lambda t: t.update({"encoder.block.9.extra.weight": torch.zeros(2)}), "encoder.block.9.extra.weight"),
    (lambda t: t.update({"shared.weight": torch.zeros(7, 32)}), "shared.weight has shape"),
    (lambda t: t.update({"encoder.embed_tokens.weight": t["shared.weight"] + 1}), "differs from shared.weight"),
])
def test_bad_tensors_are_named(tmp_path, edit, message):
    folder = make_t5_checkpoint("flan-t5", tmp_path / "bad")
    rewrite_weights(folder, edit)
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(folder)


def test_unsupported_model_type_lists_supported_ones(tmp_path):
    folder = make_t5_checkpoint("flan-t5", tmp_path / "bart")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "bart"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="unsupported model_type 'bart'.*t5, mt5, umt5"):
        plan_conversion(folder)


def test_truncated_weights_are_reported(tmp_path):
    folder = make_t5_checkpoint("flan-t5", tmp_path / "cut")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConversionError, match="corrupt or truncated"):
        convert_checkpoint(folder)


def test_missing_weights_and_config(tmp_path):
    with pytest.raises(ConversionError, match="not a directory"):
        plan_conversion(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        plan_conversion(tmp_path / "empty")
    folder = make_t5_checkpoint("flan-t5", tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="no weights"):
        plan_conversion(folder)
