"""Every JSON or text file a FAT5 command reads (a model folder's config, tokenizer, generation and index files, a
--config file, a recipe's flags file, a model card) that is not UTF-8, not JSON, not a JSON object, a folder or
unreadable ends the command with one `error:` line naming the file (and the line and column where there is one),
exit status 2, before anything is written; so do truncated safetensors weights. Before, transformers, safetensors
or the tokenizer raised on them with a traceback, or skipped them silently (a bad generation_config.json). A pickle
that holds more than tensors is refused in one line that says why and how to convert it safely, never with torch's
advice to load it with weights_only=False."""

import json
import os
import shutil
from pathlib import Path

import pytest
from test_pretrain import TINY, write_corpus

from fat5.convert import fat5_to_t5, flan_to_fat5, onnx_fat5, refresh_code
from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.recipes import predict, train
from fat5.training import pretrain

# What each breakage writes, and what the one line then says about the file.
BREAKAGES = {
    "not UTF-8": (b'{\n  "a": "caf\xe9"\n}\n', "{path}:2: not UTF-8 text (byte 0xe9 at column 12); save it as UTF-8"),
    "not JSON": (b'{\n  "a": 1\n  "b": 2\n}\n', "{path}:3:3: not JSON (Expecting ',' delimiter)"),
    "not an object": (b"[1, 2]\n", "{path} is not a JSON object"),
    "a folder": (None, "{path}: it is a folder, not a file"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, demo_fat5):
    """The demo T5, its FAT5 conversion, a small corpus and a tiny model config, made once."""
    root = tmp_path_factory.mktemp("good")
    fat5_folder = Path(demo_fat5)
    (root / "tiny.json").write_text(json.dumps(TINY))
    write_corpus(root / "corpus.txt", 10)
    (root / "pairs.csv").write_text("source,target\nthe cat,le chat\nthe dog,le chien\n")
    return {"t5": DEMO_CHECKPOINT, "fat5": fat5_folder, "root": root}


def command_with(name, folders, tmp_path):
    """(main, argv, the file the case breaks) for one command reading one file; its folder is a fresh copy."""
    target, kind = name.split(":")
    if target in ("flags", "tiny"):
        copy = tmp_path
    else:
        copy = tmp_path / "model"
        shutil.copytree(folders["t5" if target in ("flan", "pretrain-tokenizer") else "fat5"], copy)
    out, root = tmp_path / "out", folders["root"]
    corpus = ["--train_files", root / "corpus.txt", "--output_dir", out, "--max_steps", 1]
    commands = {
        "flan": (flan_to_fat5.main, [copy, out]),
        "back": (fat5_to_t5.main, [copy, out]),
        "refresh": (refresh_code.main, [copy]),
        "onnx": (onnx_fat5.main, [copy, out]),
        "tiny": (pretrain.main, ["--config", copy / "tiny.json", *corpus]),
        "pretrain-checkpoint": (pretrain.main, ["--model_name_or_path", copy, *corpus]),
        "pretrain-tokenizer": (pretrain.main, ["--config", root / "tiny.json", "--tokenizer", copy, *corpus]),
        "flags": (train.main, [copy / "flags.json"]),
        "recipe": (train.main, ["--model_name_or_path", copy, "--output_dir", out, "--do_train", "--train_file",
                                root / "pairs.csv", "--report_to", "none"]),
        "predict": (predict.main, ["--model", copy, "--input_file", root / "pairs.csv", "--output_file",
                                   tmp_path / "predictions.csv"]),
    }
    main, argv = commands[target]
    return main, [str(arg) for arg in argv], copy / kind


CASES = [
    "flan:config.json", "flan:tokenizer_config.json", "flan:tokenizer.json", "flan:generation_config.json",
    "flan:special_tokens_map.json", "flan:model.safetensors.index.json",
    "back:config.json", "back:tokenizer_config.json",
    "refresh:generation_config.json", "refresh:tokenizer.json",
    "onnx:config.json", "onnx:tokenizer_config.json",
    "tiny:tiny.json", "pretrain-checkpoint:tokenizer_config.json", "pretrain-checkpoint:config.json",
    "pretrain-tokenizer:tokenizer.json",
    "flags:flags.json", "recipe:tokenizer_config.json",
    "predict:config.json", "predict:generation_config.json",
]


def one_error_line(capsys, main, argv):
    capsys.readouterr()
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "%|" not in line]  # tqdm's bars
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("breakage", BREAKAGES)
@pytest.mark.parametrize("case", CASES)
def test_a_bad_file_is_one_line_naming_it(folders, tmp_path, capsys, case, breakage):
    main, argv, path = command_with(case, folders, tmp_path)
    if case.startswith("tiny:") and breakage == "a folder":
        pytest.skip("--config may name a folder: its config.json is read")
    content, says = BREAKAGES[breakage]
    if path.exists():
        path.unlink()
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    line = one_error_line(capsys, main, argv)
    assert says.format(path=path) in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "predictions.csv").exists()


def test_a_model_card_that_is_not_utf8_is_one_line(folders, tmp_path, capsys):
    main, argv, _ = command_with("flan:README.md", folders, tmp_path)
    card = tmp_path / "model" / "README.md"
    card.write_bytes(b"---\nlicense: apache-2.0\n---\n# caf\xe9\n")
    line = one_error_line(capsys, main, argv)
    assert f"{card}:4: not UTF-8 text (byte 0xe9 at column 6)" in line, line


@pytest.mark.parametrize("weights, says", [
    ("model.safetensors", "model.safetensors: corrupt or truncated weights (Error while deserializing header: "),
    ("pytorch_model.bin", "pytorch_model.bin: corrupt or truncated weights (PytorchStreamReader failed reading zip "
                          "archive"),
])
@pytest.mark.parametrize("case", ["back", "refresh", "onnx", "pretrain-checkpoint", "recipe", "predict"])
def test_truncated_weights_are_one_line_naming_them(folders, tmp_path, capsys, case, weights, says):
    main, argv, path = command_with(f"{case}:{weights}", folders, tmp_path)
    if weights == "pytorch_model.bin":
        with_pickled_weights(tmp_path / "model", extra={})
    path.write_bytes(path.read_bytes()[:-100])
    line = one_error_line(capsys, main, argv)
    assert says in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file whatever its permissions")
@pytest.mark.parametrize("case", ["flan:tokenizer_config.json", "tiny:tiny.json", "flags:flags.json",
                                  "predict:config.json"])
def test_an_unreadable_file_is_one_line_naming_it(folders, tmp_path, capsys, case):
    main, argv, path = command_with(case, folders, tmp_path)
    if not path.exists():
        path.write_text("{}")
    path.chmod(0)
    line = one_error_line(capsys, main, argv)
    assert "cannot read" in line and f"{path}: Permission denied" in line, line


# -- pickles -----------------------------------------------------------------------------------------------------

def with_pickled_weights(folder, extra=None):
    """`folder`'s weights as a pytorch_model.bin that also pickles `extra` (default: a date, which
    torch.load(weights_only=True) refuses, its message then offering weights_only=False, which must never reach a
    user of a file from elsewhere)."""
    import datetime

    import torch
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, **({"made": datetime.date(2020, 1, 1)} if extra is None else extra)},
               folder / "pytorch_model.bin")


@pytest.mark.parametrize("case", ["flan", "pretrain-checkpoint", "recipe", "predict"])
def test_a_pickle_beyond_tensors_is_refused_with_safe_advice(folders, tmp_path, capsys, case):
    main, argv, _ = command_with(f"{case}:pytorch_model.bin", folders, tmp_path)
    with_pickled_weights(tmp_path / "model")
    line = one_error_line(capsys, main, argv)
    assert "holds pickled Python objects beyond tensors (such as datetime.date), which can run code when loaded, " \
           "so it is refused; to convert it safely, load it once in an environment you trust and save its state " \
           "dict with safetensors (safetensors.torch.save_file), or use the Hub's safetensors conversion" in line, line
    assert "weights_only" not in line


def test_a_checkpoint_to_resume_that_pickles_more_than_tensors_is_refused(folders, tmp_path, capsys):
    import datetime

    import torch

    root = folders["root"]
    flags = ["--config", root / "tiny.json", "--train_files", root / "corpus.txt", "--tokenizer", DEMO_CHECKPOINT,
             "--per_device_train_batch_size", 2, "--max_input_length", 32, "--max_target_length", 32,
             "--save_steps", 1, "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--mixture", "t5"]
    first = tmp_path / "first"
    assert pretrain.main([str(arg) for arg in (*flags, "--output_dir", first, "--max_steps", 1)]) == 0
    checkpoint = first / "checkpoint-1"
    state = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    torch.save({**state, "made": datetime.date(2020, 1, 1)}, checkpoint / "scheduler.pt")
    line = one_error_line(capsys, pretrain.main, [str(arg) for arg in (
        *flags, "--output_dir", tmp_path / "second", "--max_steps", 2, "--resume_from_checkpoint", checkpoint)])
    assert line.startswith(f"error: --resume_from_checkpoint {checkpoint} holds pickled Python objects beyond "
                           f"tensors (such as datetime.date), which can run code when loaded, so it is refused; resume "
                           f"from a checkpoint FAT5 wrote instead"), line
    assert "weights_only" not in line


@pytest.mark.parametrize("case", ["predict:spiece.model", "recipe:spiece.model", "flan:spiece.model"])
def test_a_corrupt_sentencepiece_model_is_one_line(folders, tmp_path, capsys, case):
    """transformers 4.57 let sentencepiece's parse error through with its traceback."""
    main, argv, path = command_with(case, folders, tmp_path)
    path.write_bytes(b"not a sentencepiece model")
    line = one_error_line(capsys, main, argv)
    assert f"cannot read {path}: not a sentencepiece model" in line, line


@pytest.mark.parametrize("case", ["predict", "recipe", "pretrain-checkpoint", "pretrain-tokenizer"])
def test_a_model_folder_without_a_tokenizer_is_one_line(folders, tmp_path, capsys, case):
    """AutoTokenizer's own error for it is a multi-line ValueError asking to install sentencepiece (installed)."""
    main, argv, _ = command_with(f"{case}:config.json", folders, tmp_path)
    for name in ("tokenizer_config.json", "tokenizer.json"):
        (tmp_path / "model" / name).unlink(missing_ok=True)
    line = one_error_line(capsys, main, argv)
    assert f"{tmp_path / 'model'} holds no tokenizer (tokenizer_config.json or tokenizer.json)" in line, line
    assert "sentencepiece" not in line


@pytest.mark.parametrize("flag", ["--deepspeed", "--fsdp_config"])
@pytest.mark.parametrize("case", ["recipe", "tiny"])
def test_a_bad_trainer_config_file_is_one_line_naming_it(folders, tmp_path, capsys, case, flag):
    """TrainingArguments reads these files itself and its errors named neither the file nor the flag."""
    main, argv, _ = command_with(f"{case}:tiny.json", folders, tmp_path)
    if case == "tiny":
        (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    path = tmp_path / "trainer.json"
    for breakage, (content, expected) in BREAKAGES.items():
        if content is None:
            continue
        path.write_bytes(content)
        line = one_error_line(capsys, main, [*argv, flag, str(path)])
        assert f"the {flag} file {path}" in line and line.endswith(expected.format(path=path)), (breakage, line)
    line = one_error_line(capsys, main, [*argv, f"{flag}={tmp_path / 'missing.json'}"])
    assert line == f"error: cannot read the {flag} file {tmp_path / 'missing.json'}: no such file"
    assert not (tmp_path / "out").exists()


# -- a config.json that contradicts its weights ------------------------------------------------------------------

EDITS = {
    # transformers stopped with a 116-line traceback (a size mismatch), deep in loading.
    "d_model": ({"d_model": 64}, "does not describe the weights beside it: tensor shared.weight is [136, 128] there, "
                                 "the config makes it [136, 64]; use the config.json the weights were saved with"),
    # The T5 bias tables became unexpected keys (one line of transformers' load report) and the model predicted
    # wrongly, with exit status 0.
    "rope": ({"position_encoding_type": "rope"}, "the weights hold 2 tensor(s) a FAT5ForConditionalGeneration of "
                                                 "this config has no place for, first "),
    # The fourth layer would be initialised at random.
    "layers": ({"num_layers": 4}, "the weights lack 9 tensor(s) a FAT5ForConditionalGeneration of this config "
                                  "needs, first encoder.block.3."),
    # A 38-line traceback ending in FAT5Config's own message.
    "backend": ({"attention_backend": "bogus"}, "config.json: FAT5Config.attention_backend: 'bogus' is not one of "
                                                "('auto', 'eager', 'sdpa', 'triton')"),
}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("case", ["predict", "recipe", "pretrain-checkpoint", "refresh", "back"])
def test_a_config_that_contradicts_its_weights_is_one_line(folders, tmp_path, capsys, case, edit):
    main, argv, path = command_with(f"{case}:config.json", folders, tmp_path)
    fields, says = EDITS[edit]
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    line = one_error_line(capsys, main, argv)
    if case == "back":  # the converter's own proof of the tensors names them first
        says = BACK_CONVERSION_SAYS[edit]
    assert (case == "back" or f"error: {path}" in line) and says in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "predictions.csv").exists()


BACK_CONVERSION_SAYS = {"d_model": "tensor shared.weight has shape (136, 128), the config implies (136, 64)",
                        "rope": "position_encoding_type 'rope' has no transformers T5 counterpart",
                        "layers": "checkpoint lacks 9 tensor(s) t5 needs",
                        "backend": "FAT5Config.attention_backend: 'bogus' is not one of"}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the Triton kernel runs on this machine")
@pytest.mark.parametrize("case", ["predict", "recipe", "pretrain-checkpoint", "tiny"])
def test_the_triton_backend_where_there_is_no_cuda_is_one_line(folders, tmp_path, capsys, case):
    """A folder saved with attention_backend "triton" on a machine without CUDA: a 96-line traceback at the first
    forward, FAT5's own ValueError at its end."""
    main, argv, path = command_with(f"{case}:{'tiny.json' if case == 'tiny' else 'config.json'}", folders, tmp_path)
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.exists() else TINY),
                                "attention_backend": "triton"}))
    line = one_error_line(capsys, main, argv)
    flag = {"predict": "--model", "tiny": "--config"}.get(case, "--model_name_or_path")
    assert line == f"error: {flag} {path if case == 'tiny' else path.parent}: its config sets attention_backend " \
                   f"'triton', FAT5's Triton kernel, which needs CUDA, and this command runs on cpu: set " \
                   f"attention_backend to 'auto' (the kernel on CUDA, SDPA elsewhere) or 'sdpa' in its config.json"
    assert not (tmp_path / "out").exists()
