"""Rescale and tying follow the transformers version that wrote the checkpoint; the card names the source; the
way back (FAT5 -> transformers T5) reproduces the original tensors."""

import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.compat_fat5 import release
from fat5.convert.checkpoint import (
    RESCALE_BY_WRITER,
    ConversionError,
    convert_checkpoint,
    scales_decoder_output,
)
from fat5.convert.fat5_to_t5 import main as back
from fat5.convert.flan_to_fat5 import main
from t5_checkpoints import COMMON, make_t5_checkpoint

# (model_type, config.json keys as written, does the writer scale the decoder output): every row of
# RESCALE_BY_WRITER has cases here (test_every_rescale_rule_has_a_case).
WRITTEN_BY = [
    # transformers 4.x: every family scales exactly when tie_word_embeddings (family default when absent).
    ("t5", {"transformers_version": "4.57.6"}, True),  # T5 v1.0
    ("t5", {"transformers_version": "4.30.0", "tie_word_embeddings": False}, False),  # FLAN-T5, T5 v1.1
    ("mt5", {"transformers_version": "4.57.6"}, False),
    ("mt5", {"transformers_version": "4.57.6", "tie_word_embeddings": True}, True),
    ("umt5", {"transformers_version": "4.57.6"}, True),
    ("umt5", {"transformers_version": "4.57.6", "tie_word_embeddings": False}, False),  # google/umt5-*
    ("t5", {}, True),  # no version recorded: an old 4.x checkpoint
    # transformers 5.x: config.json always says tie_word_embeddings=true.
    ("t5", {"transformers_version": "5.0.0", "tie_word_embeddings": True, "scale_decoder_outputs": True}, True),
    ("t5", {"transformers_version": "5.23.0", "tie_word_embeddings": True, "scale_decoder_outputs": False}, False),
    ("t5", {"transformers_version": "5.24.0", "tie_word_embeddings": False}, False),  # as 5.x reads a 4.x FLAN-T5
    ("mt5", {"transformers_version": "5.23.0", "tie_word_embeddings": True}, False),  # mT5 never scales in 5.x
    ("mt5", {"transformers_version": "5.24.0", "tie_word_embeddings": True, "scale_decoder_outputs": False}, False),
    ("umt5", {"transformers_version": "5.0.0", "tie_word_embeddings": True}, True),  # forced tie: always scales
    ("umt5", {"transformers_version": "5.23.0", "tie_word_embeddings": True, "scale_decoder_outputs": True}, True),
    # transformers 5.24's umT5 records the rescale as T5 does: untied umT5s (google/umt5-*) no longer rescale.
    ("umt5", {"transformers_version": "5.24.0", "tie_word_embeddings": True, "scale_decoder_outputs": False}, False),
    ("umt5", {"transformers_version": "5.24.0", "tie_word_embeddings": True, "scale_decoder_outputs": True}, True),
    ("umt5", {"transformers_version": "5.30.1", "tie_word_embeddings": False}, False),  # a later 5.x reads it so
]
# A scale_decoder_outputs that the writing release ignored, disagreeing with what it computed: ambiguous, refused.
CONTRADICTIONS = [
    ("mt5", {"transformers_version": "5.24.0", "tie_word_embeddings": True, "scale_decoder_outputs": True}),
    ("umt5", {"transformers_version": "5.23.0", "tie_word_embeddings": True, "scale_decoder_outputs": False}),
    ("t5", {"transformers_version": "4.57.6", "tie_word_embeddings": False, "scale_decoder_outputs": True}),
]


@pytest.mark.parametrize("model_type, written, scales", WRITTEN_BY)
def test_rescale_follows_the_writing_transformers_version(model_type, written, scales):
    assert scales_decoder_output({"model_type": model_type, **written}) is scales


@pytest.mark.parametrize("model_type, written", CONTRADICTIONS)
def test_a_rescale_field_the_writer_ignored_and_contradicts_is_refused(model_type, written):
    with pytest.raises(ConversionError, match="ignores that field"):
        scales_decoder_output({"model_type": model_type, **written})


def test_every_rescale_rule_has_a_case():
    def row_of(model_type, written):
        writer = release(written.get("transformers_version", "4"))[:3]
        return next(index for index, (model_types, first, after, _) in enumerate(RESCALE_BY_WRITER)
                    if model_type in model_types and release(first)[:3] <= writer
                    and (after is None or writer < release(after)[:3]))

    cases = [(model_type, written) for model_type, written, _ in WRITTEN_BY] + CONTRADICTIONS
    assert {row_of(*case) for case in cases} == set(range(len(RESCALE_BY_WRITER)))


@pytest.mark.parametrize("version", ["4.57.6", "5.23.0"])
@pytest.mark.parametrize("family", ["t5-v1.0", "mt5"])
def test_tied_checkpoint_of_either_version_converts_with_its_writers_rescale(tmp_path, family, version):
    folder = make_t5_checkpoint(family, tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    config.update(transformers_version=version, tie_word_embeddings=True)
    config.pop("scale_decoder_outputs", None)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    if "lm_head.weight" in tensors:  # make it a tied checkpoint: the head is the embedding
        from safetensors.torch import save_file

        tensors.pop("lm_head.weight")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    fat5_config, _ = convert_checkpoint(folder)
    assert fat5_config.tie_word_embeddings
    # A tied mT5 written by transformers 5 is not rescaled (its mT5 never is); every 4.x tied checkpoint is.
    assert fat5_config.scale_decoder_outputs is not (family == "mt5" and version == "5.23.0")


def test_card_names_the_base_model_and_the_source(tmp_path, capsys):
    folder = make_t5_checkpoint("flan-t5", tmp_path / "my-flan")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "google/flan-t5-small"}))
    assert main([str(folder), str(tmp_path / "from-config"), "--no-verify"]) == 0
    card = ModelCard.load(tmp_path / "from-config" / "README.md")
    assert card.data.base_model == "google/flan-t5-small"
    assert "# FAT5 conversion of google/flan-t5-small" in card.text

    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "/home/me/ckpt"}))
    assert main([str(folder), str(tmp_path / "local"), "--no-verify"]) == 0
    card = ModelCard.load(tmp_path / "local" / "README.md")
    assert card.data.base_model is None and "# FAT5 conversion of my-flan" in card.text
    assert main([str(folder), str(tmp_path / "flag"), "--no-verify", "--base-model", "me/flan-ft"]) == 0
    assert ModelCard.load(tmp_path / "flag" / "README.md").data.base_model == "me/flan-ft"


@pytest.mark.parametrize("family", ["t5-v1.0", "flan-t5", "mt5", "umt5"])
def test_round_trip_t5_fat5_t5_gives_equal_tensors(tmp_path, family, capsys):
    source = make_t5_checkpoint(family, tmp_path / "src")
    assert main([str(source), str(tmp_path / "fat5"), "--no-verify"]) == 0
    capsys.readouterr()
    assert back([str(tmp_path / "fat5"), str(tmp_path / "t5")]) == 0
    assert "Parity: max |logits difference|" in capsys.readouterr().out
    original, written = load_file(source / "model.safetensors"), load_file(tmp_path / "t5" / "model.safetensors")
    assert written.keys() <= original.keys()
    assert all(torch.equal(written[name], original[name]) for name in written)
    # What is not written is what transformers re-creates: the tied copies of the embedding.
    for name in original.keys() - written.keys():
        assert torch.equal(original[name], original["shared.weight"]), name
    assert (tmp_path / "t5" / "tokenizer_config.json").exists() == (source / "tokenizer_config.json").exists()


def test_way_back_refuses_other_position_encodings_and_overlaps(tmp_path, capsys):
    config = FAT5Config(**COMMON, position_encoding_type="rope")
    FAT5ForConditionalGeneration(config).save_pretrained(tmp_path / "rope")
    capsys.readouterr()
    assert back([str(tmp_path / "rope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "position_encoding_type 'rope' has no transformers T5 counterpart" in err[0]
    assert back([str(tmp_path / "rope"), str(tmp_path / "rope" / "inside"), "--overwrite"]) == 2
    assert "overlaps SRC" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
