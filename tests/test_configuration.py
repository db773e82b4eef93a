"""FAT5Config refuses a value of the wrong type or out of range at load, in one line naming the field."""

import json

import pytest

from fat5 import FAT5Config
from fat5.configuration_fat5 import FIELD_RULES

TEXT_FIELDS = ("position_encoding_type", "attention_backend", "lm_loss_implementation", "feed_forward_proj",
               "alibi_mode")
FLAG_FIELDS = ("tie_word_embeddings", "scale_decoder_outputs", "relative_bias_per_layer",
               "return_logits_in_training", "use_cache", "is_encoder_decoder", "rope_interleaved",
               "rope_cross_attention", "rope_rotates_values")
# None means "the default" for these (e.g. attention dropout defaults to dropout_rate).
NONE_MEANS_DEFAULT = ("attention_dropout_rate", "num_decoder_layers", "decoder_start_token_id",
                      "scale_decoder_outputs")
# None is a value T5Config accepts for these (a model without a pad token).
NONE_ACCEPTED = ("pad_token_id",)
# Values of the right type but out of range, per field.
OUT_OF_RANGE = {
    "layer_norm_epsilon": [-1e-6, 0.0, float("nan"), float("inf")], "dropout_rate": [1.0, -0.1],
    "attention_dropout_rate": [1.5], "classifier_dropout": [-0.5], "label_smoothing": [1.0],
    "initializer_factor": [0.0], "attention_scale": [-1.0], "rope_theta": [0], "fire_init_c": [-0.1],
    "fire_init_threshold": [0.0], "z_loss": [-1e-4], "d_model": [0, -8], "vocab_size": [0], "num_heads": [-1],
    "num_layers": [-1], "relative_attention_max_distance": [0], "pad_token_id": [-1], "eos_token_id": [-1, [1, -2]],
    "position_encoding_type": ["learned"], "feed_forward_proj": ["gated-gelu-x", "swish-gated"],
    "alibi_mode": ["symetric"], "partial_rotary_factor": [0.0, 1.5], "fire_normalizer_offset": [-1, 0.5],
    "fire_normalizer_eps": [-1e-6, float("inf")],
}


def wrong_types(field):
    if field in TEXT_FIELDS:
        values = [3, None, ["relu"]]
    elif field in FLAG_FIELDS:
        values = ["yes", 1, None]
    else:
        values = ["0.1", None, True, [1]] if field != "eos_token_id" else ["1", True, [1, "2"]]
    return [value for value in values if not (value is None and field in NONE_MEANS_DEFAULT + NONE_ACCEPTED)]


BAD_VALUES = [(field, value) for field in sorted(FIELD_RULES)
              for value in wrong_types(field) + OUT_OF_RANGE.get(field, [])]


def test_every_checked_field_is_a_config_field():
    assert set(FIELD_RULES) <= set(FAT5Config().to_dict())


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_bad_value_in_config_json_fails_at_load_naming_the_field(tmp_path, field, value):
    FAT5Config().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^FAT5Config.{field}: ") as error:
        FAT5Config.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("field, value", [("dropout_rate", "0.1"), ("layer_norm_epsilon", -1.0),
                                          ("feed_forward_proj", 3), ("hidden_size", "512")])
def test_bad_value_given_to_from_pretrained_or_set_later_names_the_field(tmp_path, field, value):
    FAT5Config().save_pretrained(tmp_path)
    name = {"hidden_size": "d_model"}.get(field, field)  # attribute_map aliases are checked as their field
    with pytest.raises(ValueError, match=f"^FAT5Config.{name}: "):
        FAT5Config.from_pretrained(tmp_path, **{field: value})
    config = FAT5Config()
    with pytest.raises(ValueError, match=f"^FAT5Config.{name}: "):
        setattr(config, field, value)


def test_token_ids_must_lie_in_the_vocabulary():
    with pytest.raises(ValueError, match="^FAT5Config.pad_token_id: 200 is not below vocab_size 100"):
        FAT5Config(vocab_size=100, pad_token_id=200)


@pytest.mark.parametrize("fields", [dict(dropout_rate=0, layer_norm_epsilon=1), dict(eos_token_id=[1, 2]),
                                    dict(eos_token_id=None), dict(feed_forward_proj="gated-silu"),
                                    dict(num_decoder_layers=None, attention_dropout_rate=None)])
def test_valid_values_of_every_accepted_type_load(tmp_path, fields):
    FAT5Config(**fields).save_pretrained(tmp_path)
    FAT5Config.from_pretrained(tmp_path)


# -- dropout_rate overrides reach attention, as in T5 ----------------------------------------------------------------


def training_outputs_differ(model):
    """Whether two forwards in training mode give different logits (some dropout is on)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(2, 100, (2, 7), generator=generator),
              "decoder_input_ids": torch.randint(2, 100, (2, 5), generator=generator)}
    model.train()
    with torch.no_grad():
        return not torch.equal(model(**inputs).logits, model(**inputs).logits)


@pytest.fixture(scope="module")
def flan_with_dropout(tmp_path_factory):
    """A FLAN-T5-shaped checkpoint with Google's dropout_rate 0.1, and its FAT5 conversion."""
    from fat5.convert.flan_to_fat5 import main as convert_main
    from t5_checkpoints import make_t5_checkpoint

    root = tmp_path_factory.mktemp("dropout")
    source = make_t5_checkpoint("flan-t5", root / "flan", dropout_rate=0.1)
    assert convert_main([str(source), str(root / "fat5"), "--no-verify"]) == 0
    return source, root / "fat5"


def test_the_converter_writes_attention_dropout_only_where_it_differs_from_dropout_rate(flan_with_dropout):
    config = json.loads((flan_with_dropout[1] / "config.json").read_text())
    assert config["dropout_rate"] == 0.1 and "attention_dropout_rate" not in config


@pytest.mark.parametrize("written", [None, 0.1], ids=["converted-now", "converted-before"])
def test_a_dropout_rate_override_at_load_turns_attention_dropout_off_as_in_t5(flan_with_dropout, tmp_path, written):
    """`from_pretrained(folder, dropout_rate=0.0)` makes training deterministic, as it does for T5, also for a
    folder whose config.json spells out the attention dropout equal to dropout_rate (as converters before wrote
    it); an explicit attention_dropout_rate is kept."""
    from transformers import AutoModelForSeq2SeqLM, T5ForConditionalGeneration

    source, folder = flan_with_dropout
    if written is not None:
        (tmp_path / "legacy").mkdir()
        for file in folder.iterdir():
            (tmp_path / "legacy" / file.name).symlink_to(file)
        config = json.loads((folder / "config.json").read_text())
        (tmp_path / "legacy" / "config.json").unlink()
        (tmp_path / "legacy" / "config.json").write_text(json.dumps({**config, "attention_dropout_rate": written}))
        folder = tmp_path / "legacy"
    assert training_outputs_differ(T5ForConditionalGeneration.from_pretrained(source))
    assert not training_outputs_differ(T5ForConditionalGeneration.from_pretrained(source, dropout_rate=0.0))

    def load(**fields):
        return AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, attention_backend="sdpa",
                                                     **fields)

    assert load().config.attention_dropout_rate == 0.1 and training_outputs_differ(load())
    off = load(dropout_rate=0.0)
    assert off.config.attention_dropout_rate == 0.0 and not training_outputs_differ(off)
    attention_only = load(dropout_rate=0.0, attention_dropout_rate=0.1)
    assert attention_only.config.attention_dropout_rate == 0.1 and training_outputs_differ(attention_only)
