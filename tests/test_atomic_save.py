"""Saving a FAT5 over an existing folder replaces it in one step (fat5/safe_files.py): at every instant the
folder holds the complete old save or the complete new one, an interrupted save leaves it as it was and its
staging folder is removed by the next save, no stale weight file survives, and permissions follow the umask."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fat5 import FAT5Config, FAT5ForConditionalGeneration, safe_files
from fat5.safe_files import StagedFolder, remove_stale_staging

REPO = Path(__file__).resolve().parent.parent
TINY = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=1)


def tiny_model(seed):
    torch.manual_seed(seed)
    return FAT5ForConditionalGeneration(FAT5Config(**TINY))


def weights(folder):
    tensors = {}
    for file in sorted(Path(folder).glob("model*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def same_weights(folder, model):
    saved = weights(folder)
    return all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items() if name in saved)


@pytest.mark.parametrize("exchange_available", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_resaving_replaces_the_folder_in_one_step(tmp_path, monkeypatch, exchange_available):
    if not exchange_available:
        monkeypatch.setattr(safe_files, "exchange", lambda first, second: False)
    target = tmp_path / "model"
    old, new = tiny_model(0), tiny_model(1)
    old.save_pretrained(target)
    (target / "notes.txt").write_text("mine")
    (target / "tokenizer").mkdir()
    (target / "tokenizer" / "spiece.model").write_bytes(b"kept")
    inode_before = target.stat().st_ino
    new.save_pretrained(target, max_shard_size="20KB")  # sharded over unsharded
    assert target.stat().st_ino != inode_before  # a new folder was put in place, not files moved one by one
    names = {path.name for path in target.iterdir()}
    assert "model.safetensors" not in names  # the stale unsharded file would load instead of the shards
    assert "model.safetensors.index.json" in names and (target / "notes.txt").read_text() == "mine"
    assert (target / "tokenizer" / "spiece.model").read_bytes() == b"kept"
    assert same_weights(target, new)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no staging folder left
    reloaded = FAT5ForConditionalGeneration.from_pretrained(target)
    assert all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in new.state_dict().items())


KILLED_BEFORE_THE_SWAP = """
import os, signal, sys, torch
from fat5 import FAT5Config, FAT5ForConditionalGeneration, safe_files

def killed(source, target, replace):  # the moment after the new save is complete, before it is put in place
    os.kill(os.getpid(), signal.SIGKILL)

safe_files.put_in_place = killed
torch.manual_seed(1)
FAT5ForConditionalGeneration(FAT5Config(**eval(sys.argv[2]))).save_pretrained(sys.argv[1])
"""


def test_a_killed_save_leaves_the_old_folder_and_its_staging_is_removed_next_time(tmp_path):
    target = tmp_path / "model"
    old = tiny_model(0)
    old.save_pretrained(target)
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_BEFORE_THE_SWAP), str(target), repr(TINY)],
                            cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    staging = [path for path in tmp_path.iterdir() if path.name.startswith(".model.partial-")]
    assert len(staging) == 1 and (staging[0] / "model.safetensors").is_file()  # a complete, model-sized leftover
    tiny_model(2).save_pretrained(target)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


def test_the_staging_folder_of_a_save_in_progress_is_never_removed(tmp_path):
    target = tmp_path / "model"
    with StagedFolder(target) as staging:
        (staging.path / "config.json").write_text("{}")
        remove_stale_staging(target)  # another process's save, now: this staging folder is locked
        assert staging.path.is_dir()
        staging.commit()
    assert (target / "config.json").read_text() == "{}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


def test_an_error_or_ctrl_c_during_a_save_leaves_the_folder_as_it_was(tmp_path):
    target = tmp_path / "model"
    tiny_model(0).save_pretrained(target)
    before = {path.name: path.read_bytes() for path in target.iterdir()}
    for interruption in (KeyboardInterrupt(), OSError(28, "No space left on device")):
        with pytest.raises(type(interruption)), StagedFolder(target) as staging:
            (staging.path / "config.json").write_text("{}")
            raise interruption
        assert {path.name: path.read_bytes() for path in target.iterdir()} == before
        assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saves_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        target = tmp_path / "model"
        tiny_model(0).save_pretrained(target)
        tiny_model(1).save_pretrained(target)  # over an existing folder too
    finally:
        os.umask(previous)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask
    for path in target.iterdir():
        # model.safetensors included, which safetensors writes 0600 whatever the umask
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


def test_a_symlinked_folder_is_saved_where_it_points(tmp_path):
    real = tmp_path / "real"
    tiny_model(0).save_pretrained(real)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    new = tiny_model(1)
    new.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and same_weights(real, new)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "real"]


def test_a_replacement_killed_between_its_two_renames_is_undone_by_the_next_save(tmp_path):
    """Without an atomic exchange, the old folder is moved aside before the new one takes its place: a save killed
    between the two renames leaves it at `...-old`, which the next save puts back (and keeps its files)."""
    target = tmp_path / "model"
    tiny_model(0).save_pretrained(target)
    (target / "notes.txt").write_text("mine")
    target.rename(tmp_path / ".model.partial-1234-abcd-old")
    new = tiny_model(1)
    new.save_pretrained(target)
    assert (target / "notes.txt").read_text() == "mine" and same_weights(target, new)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
