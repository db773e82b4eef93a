"""ONNX export through optimum (`python -m convert.onnx_fat5`, `optimum-cli export onnx --trust-remote-code`,
`ORTModelForSeq2SeqLM.from_pretrained(..., export=True)`): onnxruntime generates PyTorch's tokens.

optimum's exporter requires transformers < 4.58, so these tests run where `fat5[onnx]` is installed (transformers
4.57) and are skipped elsewhere.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("optimum.exporters.onnx")
pytest.importorskip("onnxruntime")

from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS  # noqa: E402
from fat5.convert.onnx_fat5 import main as onnx_fat5  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory, demo_fat5):
    """The demo T5 converted to FAT5, and its ONNX export."""
    folder, out = Path(demo_fat5), tmp_path_factory.mktemp("onnx") / "onnx"
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


ONNX_TAKES = ("the ONNX export takes a FAT5ForConditionalGeneration or a FAT5Model with --task feature-extraction or "
              "feature-extraction-with-past")


@pytest.mark.parametrize("head, task", [("FAT5ForSequenceClassification", None), ("FAT5ForTokenClassification", None),
                                        ("FAT5ForQuestionAnswering", None), ("FAT5EncoderModel", None),
                                        ("FAT5Model", None), ("FAT5ForSequenceClassification", "feature-extraction")])
def test_a_folder_whose_head_optimum_does_not_export_is_refused_in_one_line(tmp_path, capsys, tiny_config, head,
                                                                             task):
    """optimum exported a classifier's folder as a seq2seq model with a random decoder and LM head, exit 0."""
    import fat5

    folder = tmp_path / "model"
    getattr(fat5, head)(tiny_config()).save_pretrained(folder)
    assert onnx_fat5([str(folder), str(tmp_path / "out"), *(["--task", task] if task else [])]) == 2
    assert capsys.readouterr().err == f"error: {folder} holds a {head} (config.json architectures): {ONNX_TAKES}\n"
    assert not (tmp_path / "out").exists()


def test_a_fat5_model_folder_exports_for_feature_extraction(tmp_path, tiny_config):
    import onnxruntime

    from fat5 import FAT5Model

    FAT5Model(tiny_config()).save_pretrained(tmp_path / "model")
    assert onnx_fat5([str(tmp_path / "model"), str(tmp_path / "out"), "--task", "feature-extraction"]) == 0
    session = onnxruntime.InferenceSession(str(tmp_path / "out" / "model.onnx"))
    assert [output.name for output in session.get_outputs()] == ["last_hidden_state"]


def test_a_folder_with_non_finite_weights_is_refused_in_one_line(tmp_path, capsys, tiny_config):
    """optimum exported it and its check reported `max diff = nan`, exit 0."""
    from fat5 import FAT5ForConditionalGeneration

    model = FAT5ForConditionalGeneration(tiny_config())
    with torch.no_grad():
        model.lm_head.weight[3, 1] = torch.nan
    model.save_pretrained(tmp_path / "model")
    assert onnx_fat5([str(tmp_path / "model"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: tensor lm_head.weight of {tmp_path / 'model' / 'model.safetensors'} "
                                       "holds NaN or infinite values: the ONNX export refuses a model with "
                                       "non-finite weights\n")
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


# optimum's own routes, in a process that cannot import this repository (a Hub user's): loading the folder's config
# registers optimum's T5 ONNX config for model type "fat5" (fat5/integrations_fat5.py). As for a local T5 folder,
# optimum-cli needs --task (it infers tasks only for Hub models).
OPTIMUM_CLI = """
import json, sys
from optimum.commands.optimum_cli import main

folder, out, result = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = ["optimum-cli", "export", "onnx", "--model", folder, "--trust-remote-code", "--task",
            "text2text-generation-with-past", out]
try:
    main()
except Exception as error:
    json.dump({"error": f"{type(error).__name__}: {error}"}, open(result, "w"))
else:
    json.dump({"error": None}, open(result, "w"))
"""
ORT_EXPORT_AT_LOAD = """
import json, sys
from optimum.onnxruntime import ORTModelForSeq2SeqLM
from transformers import AutoTokenizer

folder, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = ORTModelForSeq2SeqLM.from_pretrained(folder, export=True, trust_remote_code=True)
tokens = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=12)
json.dump({"tokens": tokens.tolist()}, open(out, "w"))
"""


def pytorch_tokens(folder):
    from transformers import AutoTokenizer

    from fat5 import FAT5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer([prompt for prompt, _ in DEMO_PROMPTS], return_tensors="pt", padding=True)
    return batch, FAT5ForConditionalGeneration.from_pretrained(folder).generate(**batch, max_new_tokens=12)


def test_optimum_cli_exports_a_fat5_folder(exported, tmp_path):
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    from isolated import run_isolated

    folder, _ = exported
    result = run_isolated(OPTIMUM_CLI, [folder, tmp_path / "onnx"], tmp_path)
    assert result["error"] is None
    batch, expected = pytorch_tokens(folder)
    onnx_model = ORTModelForSeq2SeqLM.from_pretrained(tmp_path / "onnx", trust_remote_code=True)
    assert torch.equal(onnx_model.generate(**batch, max_new_tokens=12), expected)


def test_ort_model_exports_a_fat5_folder_at_load(exported, tmp_path):
    from isolated import run_isolated

    folder, _ = exported
    result = run_isolated(ORT_EXPORT_AT_LOAD, [folder, json.dumps([prompt for prompt, _ in DEMO_PROMPTS])], tmp_path)
    assert torch.equal(torch.tensor(result["tokens"]), pytorch_tokens(folder)[1])


def test_optimum_cli_refuses_a_position_type_without_onnx_config(tmp_path, tiny_config):
    from fat5 import FAT5ForConditionalGeneration
    from isolated import run_isolated

    FAT5ForConditionalGeneration(tiny_config(position_encoding_type="rope")).save_pretrained(tmp_path / "rope")
    result = run_isolated(OPTIMUM_CLI, [tmp_path / "rope", tmp_path / "onnx"], tmp_path)
    assert result["error"] == ("ValueError: position_encoding_type 'rope' has no ONNX config: only 't5' (T5's "
                               "relative bias) exports to ONNX")
