"""Every config field crosses the conversion both ways, or the converter refuses in one line naming it."""

import inspect
import json

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.convert.checkpoint import (
    DERIVED_FIELDS,
    FAT5_SETTINGS,
    ConversionError,
    plan_conversion,
    t5_computes,
    t5_config_from_fat5,
)
from fat5.convert.fat5_to_t5 import main as back
from fat5.convert.flan_to_fat5 import main
from t5_checkpoints import COMMON, make_t5_checkpoint

# Fields that size tensors: a new value would not match the weights, so they keep the checkpoint's value.
SHAPE_FIELDS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                "relative_attention_num_buckets")
# A valid non-default value where "the default, changed" would not be one.
OTHER_VALUES = {"feed_forward_proj": "gated-silu", "id2label": {"0": "neg", "1": "pos"},
                "label2id": {"neg": 0, "pos": 1}, "problem_type": "regression", "prefix": "summarize: ",
                "task_specific_params": {"summarization": {"prefix": "summarize: ", "num_beams": 4}},
                "pruned_heads": {"0": [1]}, "n_positions": 512, "attention_dropout_rate": 0.25}
# transformers' T5 config fields, the two generic ones pipelines read, and a key no config class knows.
T5_FIELDS = sorted((set(T5Config().to_dict()) | {"prefix", "task_specific_params", "n_positions"})
                   - set(DERIVED_FIELDS))


def other_value(name, value):
    if name in OTHER_VALUES:
        return OTHER_VALUES[name]
    if name in SHAPE_FIELDS:
        return value
    return changed(value)


def changed(value):
    """Another value of `value`'s type (2 where it is unset: a token id or a count)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.25
    return 2


def t5_refuses(config):
    try:
        with torch.device("meta"):
            T5ForConditionalGeneration(T5Config.from_dict(config))
    except ValueError:
        return True
    return False


def as_json(value):
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module")
def flan(tmp_path_factory):
    return make_t5_checkpoint("flan-t5", tmp_path_factory.mktemp("src") / "flan")


@pytest.mark.parametrize("name", T5_FIELDS)
def test_every_t5_config_field_is_carried_or_refused_by_name(flan, tmp_path, name):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(flan / "model.safetensors")
    config = json.loads((flan / "config.json").read_text())
    config[name] = other_value(name, config.get(name, T5Config().to_dict().get(name)))
    if name == "label2id":  # transformers derives it from id2label unless both are given
        config["id2label"] = OTHER_VALUES["id2label"]
    (folder / "config.json").write_text(json.dumps(config))
    # Refused: head pruning, which FAT5 lacks, and what transformers' own T5 refuses (transformers 4 validates the
    # generation fields of config.json, e.g. num_return_sequences > 1 without beams).
    if name == "pruned_heads" or t5_refuses(config):
        with pytest.raises(ConversionError, match=name):
            plan_conversion(folder)
        return
    carried = json.loads(plan_conversion(folder).config.to_json_string(use_diff=False))
    # What transformers' T5 makes of the field, as it reads it (e.g. id2label's keys become integers).
    t5 = json.loads(T5Config.from_dict(config).to_json_string(use_diff=False))
    assert carried[name] == t5[name] and (name in SHAPE_FIELDS or t5[name] != T5Config().to_dict().get(name))


def fat5_folder(path, **fields):
    config = FAT5Config(**{**COMMON, "feed_forward_proj": "gated-gelu", **fields})
    FAT5ForConditionalGeneration(config).save_pretrained(path)
    return path


FAT5_FIELDS = sorted(set(FAT5Config().to_dict()) - set(DERIVED_FIELDS))


@pytest.mark.parametrize("name", FAT5_FIELDS)
def test_every_fat5_config_field_goes_back_or_is_refused_by_name(name):
    config = FAT5Config(**COMMON, feed_forward_proj="gated-gelu").to_dict()
    value = {"position_encoding_type": "rope", "relative_bias_per_layer": True, "attention_backend": "sdpa",
             "lm_loss_implementation": "liger", "alibi_mode": "asymmetric"}.get(name) or other_value(name, config[name])
    config[name] = value
    if name in ("position_encoding_type", "attention_scale"):  # change the logits; no T5 computes them
        with pytest.raises(ConversionError, match=f"^{name} {value!r} has no transformers T5 counterpart"):
            t5_config_from_fat5(config, None, tied=True)
        return
    if name == "pruned_heads":  # a transformers 4 config field; FAT5 has no head pruning
        with pytest.raises(ConversionError, match=f"^{name} "):
            t5_config_from_fat5(config, None, tied=True)
        return
    written = t5_config_from_fat5(config, None, tied=True)
    if name in t5_computes("t5"):  # represented by the family: a bias table per layer is umT5
        assert written["model_type"] == "umt5" and name not in written
    else:
        assert as_json(written[name]) == as_json(value), name


def test_every_fat5_only_field_is_classified():
    """A FAT5 field T5 lacks either changes the logits (the way back checks its value) or is a setting T5
    ignores (carried as an extra key): a new field must be put in one of the two lists."""
    parameters = set(inspect.signature(FAT5Config.__init__).parameters) - {"self", "kwargs"}
    fat5_only = parameters - set(T5Config().to_dict()) - set(DERIVED_FIELDS) - {"decoder_start_token_id"}
    assert fat5_only == set(t5_computes("t5")) | set(FAT5_SETTINGS)


def test_fat5_settings_at_their_defaults_stay_out_of_the_t5_config():
    written = t5_config_from_fat5(FAT5Config(**COMMON).to_dict(), None, tied=True)
    assert not set(FAT5_SETTINGS) & set(written)
    assert not set(t5_computes("t5")) & set(written)


def test_pipeline_fields_survive_the_round_trip(tmp_path, capsys):
    source = make_t5_checkpoint("flan-t5", tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    config.update(prefix="summarize: ", task_specific_params=OTHER_VALUES["task_specific_params"], n_positions=512)
    (source / "config.json").write_text(json.dumps(config))
    assert main([str(source), str(tmp_path / "fat5"), "--no-verify"]) == 0
    fat5_config = json.loads((tmp_path / "fat5" / "config.json").read_text())
    assert fat5_config["prefix"] == "summarize: " and fat5_config["n_positions"] == 512
    assert fat5_config["task_specific_params"] == OTHER_VALUES["task_specific_params"]
    assert back([str(tmp_path / "fat5"), str(tmp_path / "t5")]) == 0
    t5_config = json.loads((tmp_path / "t5" / "config.json").read_text())
    unchanged = {name for name in config if name not in DERIVED_FIELDS}
    assert {name: t5_config[name] for name in unchanged} == {name: config[name] for name in unchanged}


def test_way_back_refuses_attention_scale_even_unverified(tmp_path, capsys):
    src = fat5_folder(tmp_path / "scaled", attention_scale=0.5)
    capsys.readouterr()
    assert back([str(src), str(tmp_path / "out"), "--no-verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attention_scale 0.5 has no transformers T5 counterpart" in err[0]
    assert not (tmp_path / "out").exists()


def test_way_back_carries_fat5_settings_and_the_forward_restores_them(tmp_path, capsys):
    src = fat5_folder(tmp_path / "fat5", z_loss=1e-4, attention_dropout_rate=0.0, dropout_rate=0.1)
    assert back([str(src), str(tmp_path / "t5"), "--no-verify"]) == 0
    t5_config = json.loads((tmp_path / "t5" / "config.json").read_text())
    assert t5_config["z_loss"] == 1e-4 and t5_config["attention_dropout_rate"] == 0.0
    assert main([str(tmp_path / "t5"), str(tmp_path / "again"), "--no-verify"]) == 0
    again = FAT5Config.from_pretrained(tmp_path / "again")
    assert again.z_loss == 1e-4 and again.attention_dropout_rate == 0.0 and again.dropout_rate == 0.1


def test_way_back_needs_no_generation_config(tmp_path, capsys):
    src = fat5_folder(tmp_path / "fat5")
    (src / "generation_config.json").unlink(missing_ok=True)
    assert back([str(src), str(tmp_path / "t5")]) == 0
    generation = json.loads((tmp_path / "t5" / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 0 and generation["eos_token_id"] == 1
