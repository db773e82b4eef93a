"""Pretraining runs are never lost, mixed up or silently wrong: exact resume after several passes over the
corpus, one run per output folder (two processes at once, a finished run, --overwrite_output_dir), interrupted
checkpoint saves (SIGKILL, Ctrl-C), and every bad input as one `error:` line with exit status 2."""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_pretrain import REPO, TINY, log_history, run_pretrain, write_corpus

from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.training.pretrain import main as pretrain_main
from fat5.training.run_folder import RECORD_NAME, read_record

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model config, a small corpus and the demo tokenizer (no tokenizer training: fast)."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "tiny.json").write_text(json.dumps(TINY))
    return folder, write_corpus(folder / "corpus.txt", 40)


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny model is latency-bound, and several test processes share the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_flags(tiny, output_dir, steps, *more, corpus=None):
    folder, default_corpus = tiny
    return [str(arg) for arg in (
        "--config", folder / "tiny.json", "--train_files", corpus or default_corpus, "--tokenizer", DEMO_CHECKPOINT,
        "--output_dir", output_dir, "--max_steps", steps, "--per_device_train_batch_size", 4, "--max_input_length",
        32, "--max_target_length", 32, "--logging_steps", 1, "--save_steps", 2, "--disable_tqdm", "true",
        "--dataloader_pin_memory", "false", "--learning_rate", 1e-2, "--mixture", "t5", *more)]


def one_error_line(capsys, argv):
    capsys.readouterr()
    assert pretrain_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# -- exact resume -------------------------------------------------------------------------------------------------

def test_resume_is_exact_after_several_passes_over_the_corpus(tmp_path, capsys):
    """A corpus of a few batches: the run crosses it several times, and a run resumed from a checkpoint taken
    after the second pass logs the same losses and epochs as the uninterrupted run."""
    folder = tmp_path
    (folder / "tiny.json").write_text(json.dumps(TINY))
    corpus = folder / "small.txt"
    corpus.write_text("the red cat sees the old dog .\nthe quiet bird finds the green river .\n"
                      "the happy farmer paints the small house .\n")
    flags = ["--config", folder / "tiny.json", "--train_files", corpus, "--tokenizer", DEMO_CHECKPOINT,
             "--learning_rate", 1e-2, "--per_device_train_batch_size", 4, "--max_input_length", 32,
             "--max_target_length", 32, "--logging_steps", 1, "--save_steps", 12, "--max_steps", 24,
             "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--mixture", "t5"]
    whole, resumed = folder / "whole", folder / "resumed"
    assert pretrain_main([str(arg) for arg in (*flags, "--output_dir", whole)]) == 0
    from transformers import AutoTokenizer

    from fat5.training.data import DenoisingDataset, Documents
    from fat5.training.denoising import DenoisingMixture, sentinel_token_ids

    tokenizer = AutoTokenizer.from_pretrained(whole)
    mixture = DenoisingMixture("t5", sentinel_token_ids(tokenizer), tokenizer.eos_token_id, 32, 32)
    examples_a_pass = sum(1 for _ in DenoisingDataset(Documents([str(corpus)]), tokenizer, mixture).pass_examples(0))
    assert 12 * 4 >= 2 * examples_a_pass  # the checkpoint at step 12 lies beyond the second pass
    assert 24 * 4 >= 4 * examples_a_pass
    assert pretrain_main([str(arg) for arg in (*flags, "--output_dir", resumed, "--resume_from_checkpoint",
                                               whole / "checkpoint-12")]) == 0
    original, again = log_history(whole / "checkpoint-24"), log_history(resumed / "checkpoint-24")
    assert [entry["step"] for entry in again] == list(range(1, 25))
    for first, second in zip(original[12:], again[12:], strict=True):
        assert second["epoch"] == first["epoch"]
        assert second["loss"] == pytest.approx(first["loss"], rel=1e-4)


# -- one run per folder -------------------------------------------------------------------------------------------

def test_a_finished_run_is_never_replaced_or_continued_by_another(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert pretrain_main(tiny_flags(tiny, out, 4)) == 0
    record = read_record(out)
    weights = (out / "model.safetensors").read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    for path in (out, out / "checkpoint-4", out / "model.safetensors", out / "checkpoint-4" / "model.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o777 if path.is_dir() else 0o666) & ~umask, path
    line = one_error_line(capsys, tiny_flags(tiny, out, 4))
    assert "holds another run's results" in line and "checkpoint-4" in line and "--overwrite_output_dir" in line
    assert (out / "model.safetensors").read_bytes() == weights and read_record(out) == record
    # Resumed with its own settings, the finished run is a no-op that says so.
    capsys.readouterr()
    assert pretrain_main(tiny_flags(tiny, out, 4, "--resume_from_checkpoint", "latest")) == 0
    assert "this run finished (its final model is there); nothing to do" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == weights and not (out / "checkpoint-5").exists()
    # More steps change the learning-rate schedule: refused, naming the setting, unless asked for explicitly; latest
    # then continues this run from its own last complete checkpoint.
    line = one_error_line(capsys, tiny_flags(tiny, out, 6, "--resume_from_checkpoint", "latest"))
    assert "this run was started with other settings: --max_steps 6 (the run's: 4)" in line
    assert "--resume_with_changed_settings" in line
    assert pretrain_main(tiny_flags(tiny, out, 6, "--resume_from_checkpoint", "latest",
                                    "--resume_with_changed_settings")) == 0
    assert read_record(out)["run"] == record["run"] and read_record(out / "checkpoint-6")["run"] == record["run"]
    assert [entry["step"] for entry in log_history(out / "checkpoint-6")] == [1, 2, 3, 4, 5, 6]
    # --overwrite_output_dir starts a new run in the folder, whose old checkpoints are gone.
    assert pretrain_main(tiny_flags(tiny, out, 2, "--overwrite_output_dir")) == 0
    assert read_record(out)["run"] != record["run"]
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.slow
def test_two_runs_started_on_one_folder_at_once(tiny, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "fat5.training.pretrain", *tiny_flags(tiny, out, 4)]
    first, second = (subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for _ in range(2))
    results = [(process.wait(timeout=600), process.stderr.read()) for process in (first, second)]
    for process in (first, second):
        process.stdout.close()
        process.stderr.close()
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(stderr for code, stderr in results if code == 2).strip().splitlines()
    # transformers 4.57 may warn while the tokenizer loads (before the folder is claimed): the error is still the one
    # `error:` line, and the last.
    assert [line for line in refused if line.startswith("error:")] == refused[-1:], refused
    assert re.match(r"error: --output_dir .* (is in use by another run|holds another run's results)",
                    refused[-1]), refused
    assert read_record(out / "checkpoint-4")["run"] == read_record(out)["run"]


# -- interrupted saves --------------------------------------------------------------------------------------------

KILLED_DURING_SAVE = """
import os, signal, sys
from transformers import Trainer
save_rng_state = Trainer._save_rng_state

def killed(self, output_dir):
    if self.state.global_step == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # after the weights and optimizer, before the trainer state
    return save_rng_state(self, output_dir)

Trainer._save_rng_state = killed
from fat5.cli import exit_with
from fat5.training.pretrain import main
exit_with(lambda: main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_checkpoint_killed_while_saved_is_never_resumed(tiny, tmp_path):
    out = tmp_path / "run"
    flags = tiny_flags(tiny, out, 6)
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_DURING_SAVE), *flags], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=600, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert read_record(out / "checkpoint-2") is not None
    assert (out / "checkpoint-4").is_dir() and read_record(out / "checkpoint-4") is None  # what the killed save left
    resumed = run_pretrain(*flags, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir() if "checkpoint" in path.name) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [entry["step"] for entry in log_history(out / "checkpoint-6")] == [1, 2, 3, 4, 5, 6]
    assert not [path.name for path in tmp_path.iterdir() if ".partial" in path.name]


@pytest.mark.slow
def test_ctrl_c_says_what_the_folder_holds(tiny, tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "fat5.training.pretrain",
                                *tiny_flags(tiny, out, 100000)],
                               cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while read_record(out / "checkpoint-2") is None and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"interrupted: {re.escape(str(out))} holds checkpoint-(\d+), this run's last complete "
                        r"checkpoint \(continue with --resume_from_checkpoint latest\)", last), last


@pytest.mark.slow
@pytest.mark.parametrize("to_the_group", [True, False], ids=["process-group", "main-process"])
def test_sigterm_says_what_the_folder_holds(tiny, tmp_path, to_the_group):
    """SIGTERM to the whole process group (a job scheduler, a container stopping), DataLoader workers included, or to
    the main process alone (`kill PID`): one `terminated:` line, exit status 143. torch's workers end on it at once,
    quietly; the main process says nothing of them (not even when a finaliser meets a dead worker as Python exits),
    nor do they of the connection it closed."""
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "fat5.training.pretrain",
                                *tiny_flags(tiny, out, 100000, "--dataloader_num_workers", 2)],
                               cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while read_record(out / "checkpoint-2") is None and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process.poll() is None, process.stderr.read()[-3000:]
        (os.killpg if to_the_group else os.kill)(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"terminated: {re.escape(str(out))} holds checkpoint-(\d+), this run's last complete "
                        r"checkpoint \(continue with --resume_from_checkpoint latest\)", last), last


def test_ctrl_c_while_a_checkpoint_is_saved(tiny, tmp_path, capsys, monkeypatch):
    from transformers import Trainer

    save_rng_state = Trainer._save_rng_state

    def interrupted(self, output_dir):
        if self.state.global_step == 4:
            raise KeyboardInterrupt
        return save_rng_state(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", interrupted)
    out = tmp_path / "run"
    capsys.readouterr()
    assert pretrain_main(tiny_flags(tiny, out, 6)) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        f"interrupted: {out} holds checkpoint-2, this run's last complete checkpoint (continue with "
        f"--resume_from_checkpoint latest)"]
    assert not (out / "checkpoint-4").exists()


# -- bad input: one line, exit 2 ----------------------------------------------------------------------------------

def test_corpus_errors_name_the_file_and_line(tiny, tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("the cat sees the dog .\nle café est fermé .\n".encode("latin-1"))
    line = one_error_line(capsys, tiny_flags(tiny, tmp_path / "o", 5, corpus=bad))
    assert line == f"error: {bad}:2 is not UTF-8 text (byte 0xe9 at column 7); convert the file to UTF-8"
    for value, shown in ((5, "int 5"), (["a", "b"], 'list ["a", "b"]')):
        jsonl = tmp_path / "bad.jsonl"
        jsonl.write_text(json.dumps({"text": "fine text here"}) + "\n" + json.dumps({"text": value}) + "\n")
        line = one_error_line(capsys, tiny_flags(tiny, tmp_path / "o", 5, corpus=jsonl))
        assert line == f"error: {jsonl}:2: the 'text' field is {shown}, not text"
    assert not (tmp_path / "o").exists()


def test_a_bad_line_deep_in_the_corpus_stops_training_with_one_line(tiny, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"the red cat sees the old dog .\n" * 3 + b"caf\xe9\n")
    for workers in (0, 1):  # read in the main process, then in a DataLoader worker
        out = tmp_path / f"o{workers}"
        line = one_error_line(capsys, tiny_flags(tiny, out, 100, "--dataloader_num_workers", workers,
                                                 corpus=corpus))
        assert line == f"error: {corpus}:4 is not UTF-8 text (byte 0xe9 at column 4); convert the file to UTF-8"


@pytest.mark.slow
def test_a_corpus_too_small_for_one_example(tiny, tmp_path, capsys):
    corpus = tmp_path / "words.txt"
    corpus.write_text("cat\ndog\n")  # one token a document with the demo tokenizer
    line = one_error_line(capsys, tiny_flags(tiny, tmp_path / "o", 5, corpus=corpus))
    assert line == "error: the corpus is too small to make one training example: every document has fewer than " \
                   "2 tokens"
    assert not (tmp_path / "o").exists()


def test_resume_errors(tiny, tmp_path, capsys):
    line = one_error_line(capsys, tiny_flags(tiny, tmp_path / "new", 5, "--resume_from_checkpoint", "latest"))
    assert "holds no checkpoint of a run to continue" in line
    assert not (tmp_path / "new").exists()
    out = tmp_path / "run"
    assert pretrain_main(tiny_flags(tiny, out, 2)) == 0
    wider = dict(TINY, d_ff=2 * TINY["d_ff"])
    (tmp_path / "wider.json").write_text(json.dumps(wider))
    flags = tiny_flags(tiny, out, 2, "--resume_from_checkpoint", "latest")
    flags[flags.index("--config") + 1] = str(tmp_path / "wider.json")
    line = one_error_line(capsys, flags)
    assert f"this run was started with other settings: --config {str(tmp_path / 'wider.json')!r}" in line
    line = one_error_line(capsys, [*flags, "--resume_with_changed_settings"])
    assert "holds a model of another shape" in line and "resume with the flags it was trained with" in line
    assert json.loads((out / RECORD_NAME).read_text())["run"] == read_record(out / "checkpoint-2")["run"]


# -- a run's inputs, settings and end ------------------------------------------------------------------------------

def test_no_input_is_inside_the_output_folder_or_holds_it(tiny, tmp_path, capsys):
    """Nothing the run reads can be written over, deleted by --overwrite_output_dir, or read back as data."""
    corpus_folder = tmp_path / "corpus"
    corpus_folder.mkdir()
    write_corpus(corpus_folder / "a.txt", 10)
    line = one_error_line(capsys, tiny_flags(tiny, corpus_folder / "run", 2, corpus=corpus_folder))
    assert line == (f"error: --output_dir {corpus_folder / 'run'} lies inside --train_files {corpus_folder}, which is "
                    f"read with everything below it: the run's own files would become its data; choose an "
                    f"--output_dir outside it")
    assert not (corpus_folder / "run").exists()
    # A config kept in the output folder of a finished run, replaced with --overwrite_output_dir: refused, kept.
    out = tmp_path / "run"
    assert pretrain_main(tiny_flags(tiny, out, 2)) == 0
    config = out / "tiny.json"
    config.write_text((tiny[0] / "tiny.json").read_text())
    flags = tiny_flags(tiny, out, 2, "--overwrite_output_dir")
    flags[flags.index("--config") + 1] = str(config)
    line = one_error_line(capsys, flags)
    assert line.startswith(f"error: --config {config} lies inside --output_dir {out}: the run would write over")
    assert config.is_file() and (out / "checkpoint-2").is_dir()
    line = one_error_line(capsys, tiny_flags(tiny, out, 2, "--overwrite_output_dir", "--model_name_or_path", out))
    assert f"--model_name_or_path {out} is --output_dir {out} itself" in line


def test_overwrite_deletes_only_what_the_earlier_run_wrote(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert pretrain_main(tiny_flags(tiny, out, 2)) == 0
    wrote = read_record(out)["wrote"]
    assert {"checkpoint-2", "model.safetensors", "config.json"} <= set(wrote)
    (out / "notes.txt").write_text("mine")
    line = one_error_line(capsys, tiny_flags(tiny, out, 2, "--overwrite_output_dir"))
    assert "also holds what no FAT5 run wrote (notes.txt)" in line and "move them out" in line
    assert (out / "notes.txt").read_text() == "mine" and sorted(path.name for path in out.iterdir() if
                                                               path.name in wrote) == sorted(wrote)
    (out / "notes.txt").unlink()
    assert pretrain_main(tiny_flags(tiny, out, 2, "--overwrite_output_dir")) == 0
    # A folder no FAT5 run recorded is never emptied, with or without the flag.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"x")
    line = one_error_line(capsys, tiny_flags(tiny, mine, 2, "--overwrite_output_dir"))
    assert "holds files that are not a FAT5 run's: --overwrite_output_dir deletes only what a FAT5 run wrote" in line
    assert sorted(path.name for path in mine.iterdir()) == ["data.bin"]


def test_overwrite_never_deletes_what_the_run_would_resume_or_start_from(tiny, tmp_path, capsys):
    """--overwrite_output_dir with --resume_from_checkpoint latest, last or a checkpoint of the folder (under any
    path to it), or with another path to the folder as --model_name_or_path: one line, every file kept."""
    out = tmp_path / "run"
    assert pretrain_main(tiny_flags(tiny, out, 2)) == 0
    files = sorted(str(path.relative_to(out)) for path in out.rglob("*"))
    alias = tmp_path / "alias"
    alias.symlink_to(out)
    for resume in ("latest", "last", str(out / "checkpoint-2"), str(alias / "checkpoint-2")):
        line = one_error_line(capsys, tiny_flags(tiny, out, 2, "--overwrite_output_dir", "--resume_from_checkpoint",
                                                 resume))
        assert line.startswith(f"error: --overwrite_output_dir would delete what --resume_from_checkpoint {resume} "
                               f"continues from in {out}: pass only one"), line
    line = one_error_line(capsys, tiny_flags(tiny, out, 2, "--overwrite_output_dir", "--model_name_or_path", alias))
    assert f"--model_name_or_path {alias} is --output_dir {out} itself" in line
    assert sorted(str(path.relative_to(out)) for path in out.rglob("*")) == files


def test_a_start_with_a_nan_weight_is_refused_and_a_nan_gradient_stops_the_run(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    assert pretrain_main(tiny_flags(tiny, out, 2)) == 0
    start = tmp_path / "start"
    shutil.copytree(out, start, ignore=shutil.ignore_patterns("checkpoint-*", RECORD_NAME, ".fat5_run.lock"))
    weights = load_file(start / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[1] = float("inf")
    save_file(weights, start / "model.safetensors", metadata={"format": "pt"})
    flags = tiny_flags(tiny, tmp_path / "continued", 2, "--model_name_or_path", start)
    line = one_error_line(capsys, flags)
    assert line == f"error: --model_name_or_path {start}: {name} holds 1 infinite value, so it computes nothing " \
                   f"useful; pass --allow_non_finite to use it anyway"
    assert not (tmp_path / "continued").exists()
    # Weights that overflow after the first step: the second step's gradient is NaN, the run stops before it.
    diverged = tmp_path / "diverged"
    capsys.readouterr()
    assert pretrain_main(tiny_flags(tiny, diverged, 6, "--save_steps", 1, "--learning_rate", 1e30)) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: training stopped at step 2: the gradient norm is nan; nothing from this step on was saved (pass "
        f"--allow_non_finite to train on non-finite values); {diverged} holds checkpoint-1, this run's last complete "
        f"checkpoint (continue with --resume_from_checkpoint latest)")
    assert sorted(path.name for path in diverged.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (diverged / "model.safetensors").exists()


def test_a_pipe_is_no_corpus_file(tiny, tmp_path, capsys):
    """/dev/stdin or a FIFO cannot be read pass after pass: one true line, not "no corpus file"."""
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    for corpus in (fifo, "/dev/stdin"):
        if not os.path.exists(corpus) or Path(corpus).is_file():
            continue  # a test run whose standard input is a file
        line = one_error_line(capsys, tiny_flags(tiny, tmp_path / "o", 2, corpus=corpus))
        assert line.startswith(f"error: --train_files {corpus} is not a regular file (a pipe, a device or a socket, "
                               f"such as /dev/stdin): the corpus is read again for each pass"), line


def test_another_batch_shape_continues_the_stream_by_examples(tiny, tmp_path, capsys, monkeypatch):
    """Resumed from step 2 (8 examples of a 4-example batch) with another batch shape
    (--resume_with_changed_settings), the run trains on exactly the next examples of the uninterrupted stream."""
    from fat5.training.packing import PackedSeq2SeqCollator

    collated = []
    collate = PackedSeq2SeqCollator.__call__

    def recording(self, examples, *args, **kwargs):
        collated.extend(tuple(example["input_ids"]) for example in examples)
        return collate(self, examples, *args, **kwargs)

    monkeypatch.setattr(PackedSeq2SeqCollator, "__call__", recording)
    whole = tmp_path / "whole"
    assert pretrain_main(tiny_flags(tiny, whole, 4)) == 0
    stream = list(collated)

    def resumed_with(batch, accumulation):
        out = tmp_path / f"b{batch}a{accumulation}"
        # The run as if killed after checkpoint-2: no checkpoint-4, no final model.
        shutil.copytree(whole, out, ignore=lambda folder, names: [
            name for name in names if folder == str(whole) and name in ("checkpoint-4", "model.safetensors")])
        record = read_record(out)
        (out / RECORD_NAME).write_text(json.dumps({**record, "finished": False}))
        flags = tiny_flags(tiny, out, 4, "--resume_from_checkpoint", "latest", "--gradient_accumulation_steps",
                           accumulation)
        flags[flags.index("--per_device_train_batch_size") + 1] = str(batch)
        line = one_error_line(capsys, flags)
        assert f"--per_device_train_batch_size {batch} (the run's: 4)" in line
        collated.clear()
        assert pretrain_main([*flags, "--resume_with_changed_settings"]) == 0
        return out, list(collated)

    # 2 x 2: Trainer's own skip of 4 batches of 2 lands after example 8 (the collator sees those skipped batches).
    out, seen = resumed_with(2, 2)
    assert seen[8:16] == stream[8:16]
    assert read_record(out / "checkpoint-4")["examples_per_shard"] == [16]
    # 2 x 1: Trainer's skip would land after example 4; the dataset skips the 8 examples trained on itself.
    out, seen = resumed_with(2, 1)
    assert seen[:4] == stream[8:12]
    assert read_record(out / "checkpoint-4")["examples_per_shard"] == [12]


def test_a_run_killed_in_its_final_save_is_finished_without_training_past_its_end(tiny, tmp_path, capsys,
                                                                                  monkeypatch):
    from transformers import Trainer

    save_model = Trainer.save_model

    def killed(self, output_dir=None, _internal_call=False):
        if not _internal_call:  # the final save of the model, after the checkpoint of the last step
            raise KeyboardInterrupt
        return save_model(self, output_dir, _internal_call)

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "save_model", killed)
        assert pretrain_main(tiny_flags(tiny, out, 4)) == 130
    assert (out / "checkpoint-4").is_dir() and not (out / "model.safetensors").exists()
    capsys.readouterr()
    assert pretrain_main(tiny_flags(tiny, out, 4, "--resume_from_checkpoint", "latest")) == 0
    assert "checkpoint-4 is the run's last step (4): saving it as the final model" in capsys.readouterr().out
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "model.safetensors").read_bytes() == (out / "checkpoint-4" / "model.safetensors").read_bytes()
    assert read_record(out)["finished"] is True
