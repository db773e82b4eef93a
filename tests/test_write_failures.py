"""A write that fails (a full disk) ends a command with one line saying what could not be written and what the
output folder holds, exit status 2, never the writer's traceback: a pretraining checkpoint, whichever of its
writers fails, a recipe's checkpoint, and the converters' output. Checkpoints and outputs stay atomic: the folder
holds what it held, and a run resumes from its last complete checkpoint.

The failures are injected by replacing the writer with one that raises what it raises on a full disk, as seen on a
full tmpfs (torch 2.13, safetensors 0.8): open/write an OSError(ENOSPC); safetensors.torch.save_file a
SafetensorError; torch.save a RuntimeError from its zip writer naming no cause, raised while handling another."""

import errno
import json
import os
import re

import pytest
import torch
from safetensors import SafetensorError
from test_pretrain import TINY, log_history, write_corpus

import fat5.convert.export
from fat5.convert import fat5_to_t5, flan_to_fat5
from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.recipes import train
from fat5.training import pretrain


def disk_full_in_open_or_write():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def disk_full_in_safetensors():
    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def disk_full_in_torch_save():
    try:
        raise RuntimeError("basic_ios::clear: iostream error")
    except RuntimeError:
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 338368 vs 338256")
        except RuntimeError as error:
            return error


def failing(writer, full_disk, where):
    """`writer`, raising `full_disk()` when the file it writes lies in a folder named `where`."""
    def write(obj, path, *args, **kwargs):
        if where in str(path):
            raise full_disk()
        return writer(obj, path, *args, **kwargs)
    return write


def one_error_line(capsys, main, argv):
    capsys.readouterr()
    assert main([str(arg) for arg in argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]  # no bars
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# -- pretraining --------------------------------------------------------------------------------------------------

def replace_torch_save(monkeypatch, where):
    monkeypatch.setattr(torch, "save", failing(torch.save, disk_full_in_torch_save, where))


def replace_safetensors(monkeypatch, where):
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        failing(transformers.modeling_utils.safe_save_file, disk_full_in_safetensors, where))


def replace_json_writes(monkeypatch, where):
    from transformers import TrainerState

    save_to_json = TrainerState.save_to_json
    monkeypatch.setattr(TrainerState, "save_to_json", lambda self, path: failing(
        lambda state, path: save_to_json(state, path), disk_full_in_open_or_write, where)(self, path))


@pytest.mark.parametrize("writer, reason", [
    (replace_torch_save, r"torch could not write a file, [\d.]+ MiB free on its disk"),
    (replace_safetensors, re.escape("I/O error: No space left on device (os error 28)")),
    (replace_json_writes, "No space left on device"),
], ids=["torch.save", "safetensors", "open-write"])
def test_a_pretraining_checkpoint_on_a_full_disk(tmp_path, capsys, monkeypatch, writer, reason):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    flags = ["--config", tmp_path / "tiny.json", "--train_files", write_corpus(tmp_path / "corpus.txt", 40),
             "--tokenizer", DEMO_CHECKPOINT, "--output_dir", tmp_path / "run", "--per_device_train_batch_size", 4,
             "--max_input_length", 32, "--max_target_length", 32, "--save_steps", 2, "--logging_steps", 1,
             "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--mixture", "t5", "--max_steps", 6]
    with monkeypatch.context() as patches:
        writer(patches, "checkpoint-4")
        line = one_error_line(capsys, pretrain.main, flags)
    out = tmp_path / "run"
    assert re.fullmatch(rf"error: writing checkpoint-4 failed \({reason}\); {re.escape(str(out))} holds "
                        r"checkpoint-2, this run's last complete checkpoint \(continue with --resume_from_checkpoint "
                        r"latest\)", line), line
    assert not (out / "checkpoint-4").exists()
    if writer is replace_torch_save:  # the run goes on from its last complete checkpoint once there is room
        assert pretrain.main([str(arg) for arg in (*flags, "--resume_from_checkpoint", "latest")]) == 0
        assert [entry["step"] for entry in log_history(out / "checkpoint-6")] == [1, 2, 3, 4, 5, 6]


# -- a recipe ------------------------------------------------------------------------------------------------------

def test_a_recipe_checkpoint_on_a_full_disk(demo_fat5, tmp_path, capsys, monkeypatch):
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("source,target\n" + "".join(f"count {i},{i}\n" for i in range(16)))
    out = tmp_path / "out"
    replace_torch_save(monkeypatch, "checkpoint-2")
    line = one_error_line(capsys, train.main, [
        "--model_name_or_path", demo_fat5, "--output_dir", out, "--train_file", pairs, "--do_train", "--report_to",
        "none", "--per_device_train_batch_size", 4, "--max_steps", 3, "--save_steps", 1, "--dataloader_pin_memory",
        "false", "--disable_tqdm", "true"])
    assert re.fullmatch(r"error: writing checkpoint-2 failed \(torch could not write a file, [\d.]+ MiB free on its "
                        rf"disk\); {re.escape(str(out))} holds checkpoint-1, this run's last complete checkpoint "
                        r"\(continue with --resume_from_checkpoint last\)", line), line


# -- the converters ------------------------------------------------------------------------------------------------

def test_the_converters_output_on_a_full_disk(demo_fat5, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise disk_full_in_open_or_write()

    out = tmp_path / "out"
    monkeypatch.setattr(fat5.convert.export, "write_remote_code", full)
    line = one_error_line(capsys, flan_to_fat5.main, [DEMO_CHECKPOINT, out])
    assert line == f"error: writing {out} failed (No space left on device); nothing was written to {out}"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    line = one_error_line(capsys, flan_to_fat5.main, [DEMO_CHECKPOINT, out, "--overwrite"])
    assert line == f"error: writing {out} failed (No space left on device); {out} is unchanged (the old folder is " \
                   f"intact)"
    assert [path.name for path in out.iterdir()] == ["mine.txt"]

    monkeypatch.setattr(fat5.convert.export, "copy_side_files", full)
    back = tmp_path / "back"
    line = one_error_line(capsys, fat5_to_t5.main, [demo_fat5, back])
    assert line == f"error: writing {back} failed (No space left on device); nothing was written to {back}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # no staging folder left


# -- fat5 sample-data ----------------------------------------------------------------------------------------------

def test_sample_data_on_a_full_disk_writes_nothing(tmp_path, capsys, monkeypatch):
    """A disk that fills while the files are written: one line naming the folder, and none of the files (they are
    written into a staging folder, then renamed into place); a disk that has not the room they need is refused
    before anything is written. A file of the user's in the folder is kept as it was."""
    from pathlib import Path

    from fat5.recipes import sample_data

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    write_text = Path.write_text

    def fill_the_disk(path, *args, **kwargs):
        if path.name == "pairs_train.csv":  # the sixth of the fifteen files
            raise disk_full_in_open_or_write()
        return write_text(path, *args, **kwargs)

    with monkeypatch.context() as patches:
        patches.setattr(Path, "write_text", fill_the_disk)
        line = one_error_line(capsys, sample_data.main, [folder, "--rows", "24"])
    assert line == f"error: writing the sample files into {folder} failed (No space left on device); nothing was " \
                   f"written"
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["data", "notes.txt"]  # no staging folder left
    assert (folder / "notes.txt").read_text() == "mine\n"
    usage = shutil_usage(free=1000)
    with monkeypatch.context() as patches:
        patches.setattr(sample_data.shutil, "disk_usage", lambda path: usage)
        line = one_error_line(capsys, sample_data.main, [folder, "--rows", "24"])
    assert re.fullmatch(rf"error: the sample files need 0\.\d MiB and the disk of {re.escape(str(folder))} has "
                        r"0\.0 MiB free: choose fewer --rows or another folder", line), line
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["data", "notes.txt"]
    assert sample_data.main([str(folder), "--rows", "24"]) == 0  # once there is room
    assert len(list(folder.rglob("*.*"))) == 16


def shutil_usage(free):
    import shutil

    return shutil._ntuple_diskusage(10**9, 10**9 - free, free)
