"""`python -m convert.refresh_code`: a folder written by an earlier FAT5 gets this FAT5's code in place, atomically,
with every other file kept as it was, and then generates right for a Hub user."""

import json
from unittest import mock

import pytest

import fat5.convert.refresh_code
from fat5.cli import CheckFailed
from fat5.compat_fat5 import TESTED_TRANSFORMERS
from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS
from fat5.convert.flan_to_fat5 import main as convert_main
from fat5.convert.refresh_code import main
from fat5.remote_code_fat5 import flatten_imports, remote_code_files
from isolated import run_isolated

CHILD = """
import json, sys
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
folder, prompts, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
tokens = model.generate(**tokenizer(prompts, padding=True, return_tensors="pt"), max_new_tokens=32)
with open(out_path, "w") as f:
    json.dump(tokenizer.batch_decode(tokens, skip_special_tokens=True), f)
"""
PROMPTS = [prompt for prompt, _ in DEMO_PROMPTS]
ANSWERS = [answer for _, answer in DEMO_PROMPTS]


def answers(folder, cwd):
    cwd.mkdir(exist_ok=True)
    return run_isolated(CHILD, [folder, json.dumps(PROMPTS)], cwd=cwd)


@pytest.fixture
def old_folder(tmp_path):
    """A demo folder whose code drops the cache generate passes (what a folder exported before FAT5 followed
    transformers 5.24's rename does under 5.24), with an older tested list and files of its owner's."""
    folder = tmp_path / "old"
    assert convert_main([str(DEMO_CHECKPOINT), str(folder), "--no-verify"]) == 0
    compat = folder / "compat_fat5.py"
    source = compat.read_text()
    forgetful = source.replace("    return past_key_values if cache is None else cache", "    return None")
    assert forgetful != source
    compat.write_text(forgetful)
    config = json.loads((folder / "config.json").read_text())
    config["tested_transformers"] = ["4.57.6"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "notes.txt").write_text("mine")
    (folder / "handler.py").write_text("# an inference endpoint's handler\n")
    return folder


def test_refresh_gives_the_folder_this_code_and_keeps_everything_else(old_folder, tmp_path, capsys):
    assert answers(old_folder, tmp_path / "before") != ANSWERS  # the old code generates wrongly
    weights = (old_folder / "model.safetensors").stat().st_ino
    card = (old_folder / "README.md").read_text()
    assert main([str(old_folder)]) == 0
    assert "cached generation checked" in capsys.readouterr().out
    assert answers(old_folder, tmp_path / "after") == ANSWERS
    for name, path in remote_code_files().items():
        assert (old_folder / name).read_text() == flatten_imports(path.read_text()), name
    config = json.loads((old_folder / "config.json").read_text())
    assert config["tested_transformers"] == list(TESTED_TRANSFORMERS)
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_fat5.FAT5ForConditionalGeneration"
    assert "text2text-generation" in config["custom_pipelines"] and config["d_model"] == 128
    assert (old_folder / "model.safetensors").stat().st_ino == weights  # a hard link: nothing copied
    assert (old_folder / "notes.txt").read_text() == "mine" and (old_folder / "handler.py").is_file()
    assert (old_folder / "README.md").read_text() == card
    assert sorted(path.name for path in tmp_path.iterdir()) == ["after", "before", "old"]  # no staging left


def test_a_folder_that_fails_its_check_is_left_as_it_was(old_folder):
    before = {path.name: path.read_bytes() for path in old_folder.iterdir()}
    with mock.patch.object(fat5.convert.refresh_code, "check_folder",
                           side_effect=CheckFailed("generation check failed: x")):
        assert main([str(old_folder)]) == 1
    assert {path.name: path.read_bytes() for path in old_folder.iterdir()} == before


@pytest.mark.parametrize("case, message", [("missing", "does not exist"), ("file", "is not a directory"),
                                           ("t5", "is not a FAT5 folder"), ("no-config", "has no config.json")])
def test_what_is_not_a_fat5_folder_is_one_line(tmp_path, capsys, case, message):
    (tmp_path / "file").write_text("mine")
    folder = {"missing": tmp_path / "missing", "file": tmp_path / "file", "t5": DEMO_CHECKPOINT,
              "no-config": tmp_path}[case]
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_a_symlinked_folder_is_refreshed_where_it_points(old_folder, tmp_path):
    (tmp_path / "link").symlink_to(old_folder, target_is_directory=True)
    assert main([str(tmp_path / "link"), "--no-verify"]) == 0
    assert (tmp_path / "link").is_symlink() and (old_folder / "notes.txt").read_text() == "mine"
    assert (old_folder / "compat_fat5.py").read_text() == flatten_imports(remote_code_files()["compat_fat5.py"]
                                                                          .read_text())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "old"]
