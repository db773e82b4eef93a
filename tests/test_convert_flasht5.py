"""flashT5's layout (github.com/catie-aq/flashT5, CATIE-AQ's FAT5 models) converts to FAT5 with parity against
flashT5's own outputs: tests/fixtures/flasht5 holds tiny checkpoints and what flashT5's code computed on them (its
README says how they were made). Every config.json field and every tensor is carried, translated or refused by
name; FAT5 masks padding, so a padded row equals flashT5 run on that row alone."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_convert_fields import changed

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.convert.checkpoint import ConversionError, iter_converted_tensors
from fat5.convert.flan_to_fat5 import main
from fat5.convert.flasht5 import DEFAULTS, fat5_config_fields, load_reference, plan_flasht5_conversion
from fat5.convert.parity import ROUNDING_FACTOR, rounding_spread
from t5_twins import close

FIXTURES = Path(__file__).parent / "fixtures" / "flasht5"
CASES = sorted(path.name for path in FIXTURES.iterdir() if path.is_dir())
# Relative to the largest logit: the eager backend runs flashT5's operations in its order (equal in practice), SDPA
# sums in another order through layers of peaked attention (the fixtures' weights are large on purpose).
TOLERANCE = {"eager": 1e-5, "sdpa": 1e-4}


def assert_within_rounding(actual, expected, tensors, compute, relative=1e-5):
    """`actual` (what `compute()` gives) equals `expected` (flashT5's numbers, computed elsewhere) up to `relative`
    of its largest value, or up to what rounding moves `compute()` by (the parity proof's measure: the fixtures'
    large weights amplify rounding, more on some CPUs than others). Changes `tensors` in place: call it last."""
    spread = rounding_spread(tensors, compute, actual)
    tolerance = max(relative * expected.abs().max().item(), ROUNDING_FACTOR * spread)
    assert (actual - expected).abs().max().item() <= tolerance


def expected(case):
    return load_file(FIXTURES / case / "expected.safetensors")


def converted(folder, backend="eager"):
    plan = plan_flasht5_conversion(folder)
    model = FAT5ForConditionalGeneration(plan.config).eval()
    model.load_state_dict(dict(iter_converted_tensors(plan)))
    model.config.attention_backend = backend
    return model


def flasht5_loss(case, logits):
    """flashT5's loss where the fixture has none (z_loss null, with which flashT5's loss fails): its cross-entropy
    with label smoothing, the z-loss left out as the conversion leaves it out."""
    config = json.loads((FIXTURES / case / "config.json").read_text())
    labels = expected(case)["labels"]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=config["label_smoothing"])


def test_fixtures_say_where_they_come_from_and_hold_no_flasht5_code():
    provenance = json.loads((FIXTURES / "provenance.json").read_text())
    assert len(provenance["flashT5_commit"]) == 40 and provenance["transformers"] and provenance["torch"]
    assert set(provenance["cases"]) == set(CASES)
    assert not list(FIXTURES.rglob("*.py"))
    formats = {next(path.name for path in (FIXTURES / case).iterdir() if path.name.startswith(("model", "pytorch")))
               for case in CASES}
    assert formats == {"model.safetensors", "pytorch_model.bin"}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("case", CASES)
def test_converted_model_computes_flasht5s_logits_and_loss(case, backend):
    fixture = expected(case)
    model = converted(FIXTURES / case, backend)

    def run():
        with torch.no_grad():
            return model(input_ids=fixture["input_ids"], labels=fixture["labels"])

    output = run()
    loss = fixture["loss"][0] if "loss" in fixture else flasht5_loss(case, fixture["logits"])
    assert close(output.loss, loss, TOLERANCE[backend])
    assert_within_rounding(output.logits, fixture["logits"], model.parameters(), lambda: run().logits,
                           TOLERANCE[backend])


@pytest.mark.parametrize("case", CASES)
def test_padded_rows_equal_flasht5_run_on_each_row_alone(case):
    fixture = expected(case)
    model = converted(FIXTURES / case)
    real = fixture["decoder_attention_mask"].bool()

    def run():
        with torch.no_grad():
            return model(input_ids=fixture["input_ids"], attention_mask=fixture["attention_mask"],
                         decoder_input_ids=fixture["decoder_input_ids"],
                         decoder_attention_mask=fixture["decoder_attention_mask"]).logits[real]

    assert_within_rounding(run(), fixture["row_logits"][real], model.parameters(), run)


@pytest.mark.parametrize("case", CASES)
def test_the_parity_proofs_reference_computes_what_flasht5_computes(case):
    """convert/flasht5_reference.py, which the converter proves each conversion against, equals flashT5's code."""
    fixture = expected(case)
    reference = load_reference(FIXTURES / case)
    output = reference(input_ids=fixture["input_ids"], labels=fixture["labels"])
    if "loss" in fixture:
        assert close(output.loss, fixture["loss"][0])

    def rows():
        return reference(input_ids=fixture["input_ids"], attention_mask=fixture["attention_mask"],
                         decoder_input_ids=fixture["decoder_input_ids"],
                         decoder_attention_mask=fixture["decoder_attention_mask"]).logits

    logits, padded = output.logits, rows()
    moved = load_reference(FIXTURES / case)  # a second copy, since measuring the rounding spread changes the weights
    assert_within_rounding(padded, fixture["row_logits"], reference.parameters(), rows)
    assert_within_rounding(logits, fixture["logits"], moved.parameters(),
                           lambda: moved(input_ids=fixture["input_ids"], labels=fixture["labels"]).logits)


# (fixture, FAT5 field, the value FAT5 computes with without flashT5's semantics): each changes the logits far
# beyond rounding, so the fixtures pin every option down.
SEMANTICS = [
    ("t5-default-scale-gelu", "attention_scale", 1.0),
    ("rope", "rope_rotates_values", False),
    ("rope", "rope_cross_attention", False),
    ("rope-interleaved", "rope_interleaved", False),
    ("rope-partial", "partial_rotary_factor", 1.0),
    ("rope-partial-interleaved", "rope_theta", 10000.0),
    ("alibi-asymmetric", "alibi_mode", "symmetric"),
    ("fire", "fire_normalizer_offset", 1),
]


@pytest.mark.parametrize("case, name, value", SEMANTICS)
def test_each_flasht5_semantic_moves_the_logits(case, name, value):
    fixture = expected(case)
    plan = plan_flasht5_conversion(FIXTURES / case)
    model = FAT5ForConditionalGeneration(FAT5Config.from_dict({**plan.config.to_dict(), name: value})).eval()
    model.load_state_dict(dict(iter_converted_tensors(plan)))
    with torch.no_grad():
        logits = model(input_ids=fixture["input_ids"], decoder_input_ids=fixture["decoder_input_ids"]).logits
    assert (logits - fixture["logits"]).abs().max() > 0.05 * fixture["logits"].abs().max()


@pytest.mark.parametrize("case", CASES)
def test_command_converts_a_flasht5_folder_with_its_parity_proof(case, tmp_path, capsys):
    """Every fixture, although their large weights make rounding differ by more than 1e-5 of the largest logit on
    the proof's padded batch (the proof's tolerance follows the rounding spread: convert/parity.py)."""
    out = tmp_path / "out"
    assert main([str(FIXTURES / case), str(out)]) == 0
    assert "Parity: max |logits difference|" in capsys.readouterr().out
    fixture = expected(case)
    model = FAT5ForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=fixture["input_ids"], decoder_input_ids=fixture["decoder_input_ids"]).logits
    assert close(logits, fixture["logits"], TOLERANCE["sdpa"])  # the folder's backend: "auto", SDPA on CPU
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fat5" and config["is_encoder_decoder"] and not config["tie_word_embeddings"]
    assert not {"use_glu_mlp", "attention_type", "max_sequence_length", "use_masking"} & set(config)


@pytest.mark.parametrize("case", ["alibi-asymmetric", "fire"])
def test_bfloat16_conversion_keeps_parity(case, tmp_path, capsys):
    """--dtype bfloat16: the proof runs the reference in bf16 too (flashT5's own FIRE fails in bf16; FAT5's runs)."""
    assert main([str(FIXTURES / case), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert "bfloat16" in capsys.readouterr().out


def copy_fixture(case, folder, edit_tensors=None, **fields):
    """A copy of fixture `case` in `folder`, its config.json updated with `fields` (None removes a key) and its
    safetensors weights edited by `edit_tensors(dict)`."""
    shutil.copytree(FIXTURES / case, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    config = {name: value for name, value in config.items() if not (name in fields and fields[name] is None)}
    (folder / "config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(folder / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_plan_accounts_for_every_flasht5_tensor():
    for case in CASES:
        plan = plan_flasht5_conversion(FIXTURES / case)
        origins = {name for target in plan.mapping for name in plan.source.origin(target)}
        assert origins | set(plan.redundant) | set(plan.ignored) == set(plan.source.source.names()), case
    assert set(plan_flasht5_conversion(FIXTURES / "t5-default-scale-gelu").redundant) == {
        "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}  # pytorch_model.bin keeps the aliases
    assert not plan_flasht5_conversion(FIXTURES / "t5-gated-gelu").redundant


FIRE_ENCODING = "encoder.block.0.self_attention_layer.self_attention.pe_encoding."
T5_TABLE = "encoder.block.0.self_attention_layer.self_attention.pe_encoding.relative_attention_bias.weight"


@pytest.mark.parametrize("case, edit, message", [
    ("t5-gated-gelu", lambda t: t.update({"encoder.block.0.extra.weight": torch.zeros(2)}),
     r"^flashT5 tensor encoder\.block\.0\.extra\.weight has no FAT5 counterpart"),
    ("t5-gated-gelu", lambda t: t.update({T5_TABLE.replace("block.0", "block.1"): t[T5_TABLE].clone()}),
     r"^flashT5 tensor encoder\.block\.1\.self_attention_layer\.self_attention\.pe_encoding\.relative_attention_bias"
     r"\.weight has no counterpart"),
    ("t5-gated-gelu", lambda t: t.pop("decoder.block.1.ff_layer.wo.weight"),
     r"^flashT5 checkpoint lacks 1 tensor\(s\) FAT5 needs, e\.g\. decoder\.block\.1\.layer\.2\.DenseReluDense\.wo"),
    ("t5-gated-gelu", lambda t: t.pop("lm_head.weight"), r"lacks 1 tensor\(s\) FAT5 needs, e\.g\. lm_head\.weight"),
    ("t5-default-scale-gated-relu", lambda t: t.update({"encoder.embed_tokens.weight": t["shared.weight"] + 1}),
     "encoder.embed_tokens.weight differs from shared.weight"),
    ("fire", lambda t: t.pop(FIRE_ENCODING + "L_multiplier"), r"init_L and .*L_multiplier come together"),
    ("t5-gated-gelu", lambda t: [t.pop(name) for name in list(t) if name.startswith(("decoder.", "lm_head"))],
     "has no decoder: an encoder-only one"),
    ("t5-gated-gelu", lambda t: t.update({"shared.weight": torch.zeros(7, 16)}), "shared.weight has shape"),
])
def test_bad_tensors_are_refused_by_name(case, edit, message, tmp_path):
    folder = copy_fixture(case, tmp_path / "src", edit)
    with pytest.raises(ConversionError, match=message):
        list(iter_converted_tensors(plan_flasht5_conversion(folder)))


def test_a_gated_weight_in_a_non_gated_config_is_refused(tmp_path):
    folder = copy_fixture("t5-gated-gelu", tmp_path / "src", use_glu_mlp=False)
    with pytest.raises(ConversionError, match=r"^flashT5 tensor \S+ff_layer\.act\.wi_0\.weight has no counterpart"):
        plan_flasht5_conversion(folder)


# Every key of the fixtures' config.json and every FlashT5Config field, changed: refused in one line naming it,
# translated into FAT5's fields, carried under its name, or without effect on what FAT5 computes (with the reason).
BASE_CASE = {"rotary_base": "rope", "rotary_emb_fraction": "rope", "rotary_interleaved": "rope",
             "rotary_scale_base": "rope", "alibi_mode": "alibi-asymmetric", "fire_mlp_width": "fire"}
REFUSED = {
    "tie_word_embeddings": True,  # flashT5's model asserts untied embeddings
    "pad_token_id": -100,  # FlashT5Config's default; its _shift_right feeds it to the embedding
    "position_encoding_type": "rope",  # flashT5 knows t5, RoPE, ALiBi, FIRE (other values: no encoding)
    "use_randomized_position_encoding": True,  # with t5: random positions on every forward
    "rotary_scale_base": 512,  # xPos
    "alibi_mode": "symmetric",  # flashT5 spells its modes "symetric" and "asymetric"
    "rotary_emb_fraction": 0.375,  # 3 of 8 channels: not pairs
    "rotary_base": "10000",  # not a number
}
# name -> (new value, the FAT5 fields it must give)
TRANSLATED = {
    "tie_word_embeddings": (False, {"tie_word_embeddings": False, "scale_decoder_outputs": False}),
    "pad_token_id": (5, {"pad_token_id": 5}),
    "position_encoding_type": ("FIRE", {"position_encoding_type": "fire", "fire_normalizer_offset": 0,
                                        "fire_normalizer_eps": 1e-6}),
    "use_randomized_position_encoding": (False, {"position_encoding_type": "t5"}),
    "use_glu_mlp": (False, {"feed_forward_proj": "gelu_pytorch_tanh"}),
    "use_gelu_act": (False, {"feed_forward_proj": "gated-relu"}),
    "attention_scale": (None, {"attention_scale": 1 / math.sqrt(4)}),
    "z_loss": (None, {"z_loss": 0.0}),
    "rotary_base": (500, {"rope_theta": 500.0}),
    "rotary_emb_fraction": (0.5, {"partial_rotary_factor": 0.5}),
    "rotary_interleaved": (True, {"rope_interleaved": True}),
    "rotary_scale_base": (None, {"rope_cross_attention": True, "rope_rotates_values": True}),
    "alibi_mode": ("symetric", {"alibi_mode": "symmetric"}),
    "decoder_start_token_id": (3, {"decoder_start_token_id": 3}),
    "attention_dropout_rate": (0.25, {"attention_dropout_rate": 0.25}),
}
NO_EFFECT = {
    # implementation choices: kernels and bias layouts of the same values
    "attention_type": "triton", "use_triton_layernorm": True, "use_triton_crossentropy": True,
    "crossentropy_inplace_backward": True, "use_full_bias_size": True, "use_triton_gated_mlp": True,
    # flashT5's length limit (FAT5 has none); its padding semantics (FAT5 masks padding keys)
    "max_sequence_length": 4096, "use_masking": True,
    # T5Config leftovers flashT5's model never reads; what the converter writes itself (plan_flasht5_conversion
    # checks model_type)
    "feed_forward_proj": "gated-silu", "dense_act_fn": "silu", "is_gated_act": False, "is_encoder_decoder": True,
    "is_decoder": True, "scale_decoder_outputs": True, "architectures": ["T5ForConditionalGeneration"],
    "auto_map": {}, "transformers_version": "4.46.3", "dtype": "bfloat16", "model_type": "t5",
}
FIXTURE_KEYS = {name for case in CASES for name in json.loads((FIXTURES / case / "config.json").read_text())}
FIELDS = sorted(set(DEFAULTS) | set(NO_EFFECT) | FIXTURE_KEYS)


@pytest.mark.parametrize("name", FIELDS)
def test_every_flasht5_config_field_is_carried_translated_or_refused_by_name(name):
    base = {**DEFAULTS, **json.loads((FIXTURES / BASE_CASE.get(name, "t5-gated-gelu") / "config.json").read_text())}
    baseline = fat5_config_fields(base)
    if name in REFUSED:
        with pytest.raises(ConversionError, match=f"^{name} "):
            fat5_config_fields({**base, name: REFUSED[name]})
    if name in TRANSLATED:
        value, fields = TRANSLATED[name]
        result = fat5_config_fields({**base, name: value})
        assert {key: result[key] for key in fields} == fields
    elif name in NO_EFFECT:
        assert fat5_config_fields({**base, name: NO_EFFECT[name]}) == baseline
    elif name not in REFUSED:  # carried under its own name
        value = changed(base.get(name))
        assert fat5_config_fields({**base, name: value})[name] == value


@pytest.mark.parametrize("name, value", [("rotary_interleaved", True), ("alibi_mode", "asymetric"),
                                         ("rotary_scale_base", 512), ("use_randomized_position_encoding", True)])
def test_another_encodings_parameters_change_nothing(name, value):
    """RoPE's and ALiBi's parameters in a FIRE model are nothing flashT5 computes with (random positions are
    ignored by its FIRE and RoPE)."""
    base = {**DEFAULTS, **json.loads((FIXTURES / "fire" / "config.json").read_text())}
    assert fat5_config_fields({**base, name: value}) == fat5_config_fields(base)


def test_omitted_keys_take_flasht5s_defaults_not_fat5s():
    config = json.loads((FIXTURES / "t5-gated-gelu" / "config.json").read_text())
    for name in ("attention_scale", "z_loss", "attention_dropout_rate", "decoder_start_token_id", "use_glu_mlp"):
        del config[name]
    fields = fat5_config_fields({**config, "dropout_rate": 0.1, "pad_token_id": 5})
    assert fields["attention_scale"] == 0.5 and fields["z_loss"] == 0.0 and fields["attention_dropout_rate"] == 0.0
    assert fields["decoder_start_token_id"] == 0 and fields["feed_forward_proj"] == "gelu_pytorch_tanh"
    with pytest.raises(ConversionError, match="^pad_token_id -100: not a token id"):
        fat5_config_fields({key: value for key, value in config.items() if key != "pad_token_id"})
    with pytest.raises(ConversionError, match="^tie_word_embeddings True: "):
        fat5_config_fields({key: value for key, value in config.items() if key != "tie_word_embeddings"})


@pytest.mark.parametrize("name", ["relative_bias_per_layer", "rope_theta", "fire_normalizer_offset"])
def test_a_fat5_field_in_a_flasht5_config_is_refused(name):
    config = json.loads((FIXTURES / "rope" / "config.json").read_text())
    with pytest.raises(ConversionError, match=f"^{name} .*a FAT5 field, not one of flashT5's"):
        fat5_config_fields({**config, name: FAT5Config().to_dict()[name]})


def test_the_command_refuses_a_bad_flasht5_folder_in_one_line(tmp_path, capsys):
    folder = copy_fixture("t5-gated-gelu", tmp_path / "src", use_randomized_position_encoding=True)
    assert main([str(folder), str(tmp_path / "out")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: use_randomized_position_encoding True: flashT5 draws")
    assert not (tmp_path / "out").exists()
