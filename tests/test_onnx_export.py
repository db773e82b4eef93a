"""ONNX export through optimum (`python -m convert.onnx_fat5`): onnxruntime generates PyTorch's tokens.

optimum's exporter requires transformers < 4.58, so these tests run where `fat5[onnx]` is installed (transformers
4.57) and are skipped elsewhere.
"""

import json

import pytest
import torch

pytest.importorskip("optimum.exporters.onnx")
pytest.importorskip("onnxruntime")

from convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS  # noqa: E402
from convert.flan_to_fat5 import main as flan_to_fat5  # noqa: E402
from convert.onnx_fat5 import main as onnx_fat5  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The demo T5 converted to FAT5, and its ONNX export."""
    root = tmp_path_factory.mktemp("onnx")
    folder, out = root / "fat5", root / "onnx"
    assert flan_to_fat5([str(DEMO_CHECKPOINT), str(folder), "--no-verify"]) == 0
    assert onnx_fat5([str(folder), str(out)]) == 0
    return folder, out


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam"])
def test_onnxruntime_generates_the_tokens_of_pytorch(exported, num_beams):
    from optimum.onnxruntime import ORTModelForSeq2SeqLM
    from transformers import AutoTokenizer

    from fat5 import FAT5ForConditionalGeneration

    folder, out = exported
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # Prompts of different lengths: a padded batch.
    batch = tokenizer([prompt for prompt, _ in DEMO_PROMPTS], return_tensors="pt", padding=True)
    assert not batch["attention_mask"].all()
    expected = FAT5ForConditionalGeneration.from_pretrained(folder).generate(**batch, max_new_tokens=12,
                                                                             num_beams=num_beams)
    onnx_model = ORTModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True)
    tokens = onnx_model.generate(**batch, max_new_tokens=12, num_beams=num_beams)
    assert torch.equal(tokens, expected)
    # The trained demo answers its prompts, so the comparison is between meaningful outputs.
    assert tokenizer.batch_decode(tokens, skip_special_tokens=True) == [answer for _, answer in DEMO_PROMPTS]


def test_a_position_type_without_onnx_config_is_refused_in_one_line(tmp_path, capsys, tiny_config):
    from fat5 import FAT5ForConditionalGeneration

    folder = tmp_path / "fire"
    FAT5ForConditionalGeneration(tiny_config(position_encoding_type="fire")).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["position_encoding_type"] == "fire"
    assert onnx_fat5([str(folder), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error == ("error: position_encoding_type 'fire' has no ONNX config: only 't5' (T5's relative bias) "
                     "exports to ONNX\n")
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_fat5_is_refused_in_one_line(tmp_path, capsys):
    assert onnx_fat5([str(DEMO_CHECKPOINT), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {DEMO_CHECKPOINT} is a 't5' model, not a FAT5 one\n"
    assert not (tmp_path / "out").exists()


def test_out_inside_the_folder_is_refused_and_a_failed_export_leaves_nothing(exported, tmp_path, capsys,
                                                                            monkeypatch):
    """OUT is the converters' atomic output: never inside the folder it reads, never half written."""
    import errno

    import optimum.exporters.onnx

    folder, _ = exported
    assert onnx_fat5([str(folder), str(folder / "onnx")]) == 2
    assert capsys.readouterr().err == (f"error: OUT {folder / 'onnx'} overlaps SRC {folder}: choose an output "
                                       "folder outside the source\n")
    assert not (folder / "onnx").exists()

    def full_disk(model, output, **options):  # optimum writes some files, then the disk is full
        (output / "encoder_model.onnx").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(optimum.exporters.onnx, "main_export", full_disk)
    out = tmp_path / "onnx"
    assert onnx_fat5([str(folder), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: writing {out} failed (No space left on device); nothing was "
                                       f"written to {out}\n")
    assert list(tmp_path.iterdir()) == []  # neither OUT nor a staging folder
