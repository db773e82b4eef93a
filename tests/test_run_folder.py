"""The run folder (fat5/training/run_folder.py): one run per output folder, a lock for the run's lifetime (tested
across two processes), atomic checkpoints marked with the run's id, `latest` resuming only a complete checkpoint
of this run, interrupted saves cleaned by the next run, and --save_total_limit left to Trainer's own rotation.
A tiny torch module stands in for the model: the machinery is Trainer's, whatever the model."""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from fat5.cli import CommandError, TrainingDiverged
from fat5.training.run_folder import (
    LOCK_NAME,
    RECORD_NAME,
    RunFolder,
    RunFolderArguments,
    RunFolderTrainerMixin,
    RunInput,
    complete_checkpoints,
    read_record,
)

REPO = Path(__file__).resolve().parent.parent


class TinyRegression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


class Examples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(4, generator=generator)
        return {"x": x, "y": x.sum()}


class RunTrainer(RunFolderTrainerMixin, Trainer):
    pass


@dataclass
class RunArguments(TrainingArguments, RunFolderArguments):
    pass


def train(folder, steps, resume=None, save_total_limit=None, trainer_class=RunTrainer, model=None, callbacks=(),
          **more):
    torch.manual_seed(0)
    args = RunArguments(output_dir=str(folder), max_steps=steps, save_steps=2, per_device_train_batch_size=4,
                        report_to="none", disable_tqdm=True, use_cpu=True, save_total_limit=save_total_limit,
                        learning_rate=0.1, lr_scheduler_type="constant", logging_steps=1, dataloader_pin_memory=False,
                        **more)
    trainer = trainer_class(model=model or TinyRegression(), args=args, train_dataset=Examples(),
                            eval_dataset=Examples() if args.eval_strategy != "no" else None)
    for callback in callbacks:  # after the run folder's
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(checkpoint):
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def test_checkpoints_are_marked_rotated_and_resumed(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out).opened() as run_folder:
        train(out, 6, save_total_limit=2)
    run_id = read_record(out)["run"]
    assert [path.name for path in complete_checkpoints(out, run_id)] == ["checkpoint-4", "checkpoint-6"]
    assert read_record(out / "checkpoint-6") == {"run": run_id, "step": 6, "saved": 3}
    assert not [path.name for path in out.iterdir() if path.name.startswith(".checkpoint")]
    assert "checkpoint-6, this run's last complete checkpoint" in run_folder.describe()
    # The same run continues: `latest` picks its last complete checkpoint, and training goes on exactly.
    with RunFolder(out, "latest").opened() as run_folder:
        assert run_folder.run_id == run_id and run_folder.resume_checkpoint == str(out / "checkpoint-6")
        train(out, 8, resume=run_folder.resume_checkpoint)
    uninterrupted = tmp_path / "uninterrupted"
    with RunFolder(uninterrupted).opened():
        train(uninterrupted, 8)
    resumed, reference = losses(out / "checkpoint-8"), losses(uninterrupted / "checkpoint-8")
    assert resumed.keys() == reference.keys()
    for step in (7, 8):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5)


def test_a_folder_holding_another_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out).opened():
        train(out, 2)
    first = read_record(out)["run"]
    with pytest.raises(CommandError, match=r"holds another run's results .*last complete checkpoint: checkpoint-2\)"
                                           r"; continue it with --resume_from_checkpoint latest, or pass "
                                           r"--overwrite_output_dir"):
        RunFolder(out).open()
    with pytest.raises(CommandError, match="holds another run's results"):
        RunFolder(out, tmp_path / "elsewhere").open()  # a checkpoint of another folder does not continue this run
    assert read_record(out)["run"] == first and (out / "checkpoint-2").is_dir()
    with RunFolder(out, overwrite=True).opened() as run_folder:
        assert run_folder.run_id != first and sorted(path.name for path in out.iterdir()) == [LOCK_NAME,
                                                                                               RECORD_NAME]
    # Files that are not a run's are refused as well; an empty folder (or one left with only a record) is taken.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CommandError, match="holds files that are not a FAT5 run's"):
        RunFolder(tmp_path / "mine").open()
    with pytest.raises(CommandError, match="holds no record of a run to continue"):
        RunFolder(tmp_path / "mine", "last").open()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with RunFolder(out).opened():
        pass


def test_latest_without_a_checkpoint_and_bad_checkpoint_paths(tmp_path):
    with pytest.raises(CommandError, match="holds no checkpoint of a run to continue"):
        RunFolder(tmp_path / "new", "latest").open()
    assert not (tmp_path / "new").exists()  # the refused run leaves no folder behind
    out = tmp_path / "run"
    with RunFolder(out).opened():
        pass
    with RunFolder(out, "last").opened() as run_folder:  # a run with no checkpoint yet starts again, the same run
        assert run_folder.resume_checkpoint is None and run_folder.run_id == read_record(out)["run"]
    with pytest.raises(CommandError, match="no checkpoint folder at --resume_from_checkpoint"):
        RunFolder(tmp_path / "other", tmp_path / "nope").open()
    (tmp_path / "plain").mkdir()
    with pytest.raises(CommandError, match="is not a Trainer checkpoint"):
        RunFolder(tmp_path / "other", tmp_path / "plain").open()


def test_an_interrupted_checkpoint_is_never_resumed_and_is_cleaned(tmp_path, monkeypatch):
    out = tmp_path / "run"
    original = Trainer._save_rng_state

    def interrupted_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise KeyboardInterrupt
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", interrupted_at_step_4)
    with pytest.raises(KeyboardInterrupt), RunFolder(out).opened() as run_folder:
        train(out, 6)
    assert "holds checkpoint-2, this run's last complete checkpoint" in run_folder.describe()
    assert not (out / "checkpoint-4").exists()  # what the interrupted save wrote is gone
    monkeypatch.undo()
    # A checkpoint-N without this run's mark (a killed save, an older version's) is not resumed either.
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "config.json").write_text("{}")
    with pytest.raises(CommandError, match="is not a complete checkpoint of the run"):
        RunFolder(out, out / "checkpoint-5").open()
    with RunFolder(out, "latest").opened() as run_folder:
        assert run_folder.resume_checkpoint == str(out / "checkpoint-2")
        assert sorted(path.name for path in out.iterdir() if "checkpoint" in path.name) == ["checkpoint-2"]


def test_save_total_limit_is_trainers_and_another_runs_checkpoint_is_never_resumed(tmp_path):
    """Trainer rotates with the limit the user gives (every checkpoint-* folder counts, as transformers documents);
    the newest is kept and marked, and a checkpoint with another run's mark is never this run's to resume."""
    out = tmp_path / "run"
    foreign = out / "checkpoint-1"
    with RunFolder(out).opened() as run_folder:
        foreign.mkdir()
        (foreign / RECORD_NAME).write_text(json.dumps({"run": "another", "step": 1}))
        trainer = train(out, 6, save_total_limit=1)
    assert trainer.args.save_total_limit == 1
    assert sorted(path.name for path in out.iterdir() if path.name.startswith("checkpoint")) == ["checkpoint-6"]
    assert [path.name for path in complete_checkpoints(out, run_folder.run_id)] == ["checkpoint-6"]
    foreign.mkdir()
    (foreign / RECORD_NAME).write_text(json.dumps({"run": "another", "step": 1}))
    with pytest.raises(CommandError, match="is not a complete checkpoint of the run"):
        RunFolder(out, foreign).open()


LOCK_HOLDER = """
import sys, time
from fat5.training.run_folder import RunFolder
with RunFolder(sys.argv[1]).opened():
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_a_second_process_on_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(out)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CommandError, match=rf"is in use by another run \(process {holder.pid}\)"):
            RunFolder(out, "latest").open()
        with pytest.raises(CommandError, match="is in use by another run"):
            RunFolder(out, overwrite=True).open()  # not even --overwrite_output_dir takes a folder in use
    finally:
        holder.communicate("done\n", timeout=60)
    assert holder.returncode == 0
    # Once the first run ends (or dies: the kernel drops the lock), the folder is free again.
    with RunFolder(out).opened():
        pass
    assert sorted(os.listdir(out)) == [LOCK_NAME, RECORD_NAME]


HOLDER_WITHOUT_FCNTL = """
import sys, time
sys.modules["fcntl"] = None  # its import fails, as on Windows
from fat5 import safe_files
from fat5.training.run_folder import RunFolder
assert safe_files.fcntl is None
with RunFolder(sys.argv[1]).opened():
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_where_fcntl_is_missing_the_lock_is_a_file_created_exclusively(tmp_path, monkeypatch):
    """Without fcntl (Windows) two runs into one folder both ran: the lock is then the lock file itself, created
    exclusively with the process id; a second run is refused, and a lock file a killed run left (its process gone)
    is taken over."""
    from fat5 import safe_files

    monkeypatch.setattr(safe_files, "fcntl", None)
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_WITHOUT_FCNTL, str(out)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert (out / LOCK_NAME).read_text().split()[0] == str(holder.pid)
        with pytest.raises(CommandError, match=rf"is in use by another run \(process {holder.pid}\)"):
            RunFolder(out, "latest").open()
        with pytest.raises(CommandError, match="is in use by another run"):
            RunFolder(out, overwrite=True).open()
        assert holder.poll() is None
        holder.kill()  # kill -9: the lock file stays, naming a process that no longer exists
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (out / LOCK_NAME).read_text().split()[0] == str(holder.pid)
    with RunFolder(out, "latest").opened() as run_folder:  # the stale lock is taken over
        assert (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
        with pytest.raises(CommandError, match=rf"is in use by another run \(process {os.getpid()}\)"):
            RunFolder(out, "latest").open()
        assert run_folder.resume_checkpoint is None
    assert sorted(os.listdir(out)) == [RECORD_NAME]  # the lock file goes when the run ends
    # An empty lock file (its process killed between creating and writing it) is stale once old.
    (out / LOCK_NAME).write_text("")
    with pytest.raises(CommandError, match=r"is in use by another run \(process \?\)"):
        RunFolder(out, "latest").open()
    os.utime(out / LOCK_NAME, (0, 0))
    with RunFolder(out, "latest").opened():
        pass


KILLED_IN_THE_FIRST_CHECKPOINT = """
import os, signal, sys
from pathlib import Path
from transformers import Trainer
sys.path.insert(0, sys.argv[2])
from test_run_folder import RunFolder, train

def killed(self, output_dir):  # kill -9 while Trainer writes checkpoint-2, the run's first
    (Path(sys.argv[1]) / ".checkpoint-2.partial-12345-x7k2").mkdir()  # and a save_pretrained staging folder
    (Path(sys.argv[1]) / ".fat5_run.json.12345.tmp").write_text("{")  # a record being written
    os.kill(os.getpid(), signal.SIGKILL)

Trainer._save_rng_state = killed
with RunFolder(sys.argv[1]).opened():
    train(sys.argv[1], 4)
"""


@pytest.mark.parametrize("how", ["resume", "overwrite"])
def test_a_run_killed_in_its_first_checkpoint_is_resumed_or_replaced(tmp_path, how):
    """`kill -9` while the first checkpoint was written: resuming said "no complete checkpoint", and
    --overwrite_output_dir "holds what no FAT5 run wrote" about FAT5's own leftovers. The checkpoint is recorded as
    the run's before Trainer writes it, and staging folders and temporary files are FAT5's: a resume trains the run
    again from its first step, --overwrite_output_dir replaces it; a file of the user's is still never deleted."""
    out = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_THE_FIRST_CHECKPOINT, str(out),
                             str(Path(__file__).parent)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    left = sorted(os.listdir(out))
    assert left == sorted([".checkpoint-2.partial-12345-x7k2", ".fat5_run.json.12345.tmp", LOCK_NAME, "checkpoint-2",
                           RECORD_NAME]), left
    assert not (out / "checkpoint-2" / RECORD_NAME).exists()  # incomplete
    with pytest.raises(CommandError, match=r"last complete checkpoint: none\); continue it with "
                                           r"--resume_from_checkpoint latest \(it trains again from its first step\), "
                                           r"or pass --overwrite_output_dir"):
        RunFolder(out).open()
    if how == "overwrite":
        (out / "notes.txt").write_text("mine")
        with pytest.raises(CommandError, match=r"also holds what no FAT5 run wrote \(notes.txt\)"):
            RunFolder(out, overwrite=True).open()
        (out / "notes.txt").unlink()
    with RunFolder(out, *(["latest"] if how == "resume" else []), overwrite=how == "overwrite").opened() as run_folder:
        assert run_folder.resume_checkpoint is None
        assert sorted(os.listdir(out)) == [LOCK_NAME, RECORD_NAME]  # every leftover cleaned
        train(out, 4)
    assert [path.name for path in complete_checkpoints(out, read_record(out)["run"])] == ["checkpoint-2",
                                                                                          "checkpoint-4"]


def test_inputs_are_checked_against_the_folder_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.csv").write_text("source,target\na,b\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for inputs, says in [([RunInput("--model_name_or_path", out)], "is --output_dir"),
                         ([RunInput("--train_file", out / "train.csv")], "lies inside --output_dir"),
                         ([RunInput("--train_files", tmp_path, recursive=True)], "lies inside --train_files")]:
        with pytest.raises(CommandError, match=says):
            RunFolder(out, overwrite=True, inputs=inputs).open()
    assert sorted(path.name for path in out.iterdir()) == ["train.csv"]  # no lock, no record
    # A folder read without what lies below it (a model folder) may hold the output folder; a Hub id is no path.
    with RunFolder(corpus / "run", inputs=[RunInput("--model_name_or_path", corpus),
                                           RunInput("--model_name_or_path", "google/flan-t5-small")]).opened():
        pass


def test_overwrite_removes_only_the_recorded_run_and_a_refusal_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out).opened():
        train(out, 2)
    assert {"checkpoint-2"} <= set(read_record(out)["wrote"])
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CommandError, match=r"also holds what no FAT5 run wrote \(notes.txt\)"):
        RunFolder(out, overwrite=True).open()
    assert (out / "checkpoint-2").is_dir() and (out / "notes.txt").is_file()
    (out / "notes.txt").unlink()
    with RunFolder(out, overwrite=True).opened():
        assert sorted(os.listdir(out)) == [LOCK_NAME, RECORD_NAME]
    # A record of an earlier FAT5 (no list of what it wrote) is not emptied either.
    record = read_record(out)
    del record["wrote"]
    (out / RECORD_NAME).write_text(json.dumps(record))
    (out / "model.bin").write_bytes(b"x")
    with pytest.raises(CommandError, match="did not record which files are its own"):
        RunFolder(out, overwrite=True).open()
    assert (out / "model.bin").is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("a")
    with pytest.raises(CommandError, match="holds files that are not a FAT5 run's"):
        RunFolder(mine, overwrite=True).open()
    assert sorted(os.listdir(mine)) == ["a.txt"]  # not even the lock file stays


def test_a_resume_keeps_the_runs_settings_or_records_an_accepted_change(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out, settings={"batch": 4, "lr": 0.1}).opened() as run_folder:
        train(out, 2)
        run_folder.finish()
    with RunFolder(out, "latest", settings={"batch": 4, "lr": 0.1}).opened() as run_folder:
        assert run_folder.already_finished  # nothing to do
    with pytest.raises(CommandError, match=r"other settings: --lr 0.2 \(the run's: 0.1\); resume with the run's"):
        RunFolder(out, "latest", settings={"batch": 4, "lr": 0.2}).open()

    def refuse_batch(changed):
        if "batch" in changed:
            raise CommandError("not the batch")

    with pytest.raises(CommandError, match="not the batch"):
        RunFolder(out, "latest", settings={"batch": 8, "lr": 0.2}, accept_changed_settings=True,
                  check_changes=refuse_batch).open()
    assert read_record(out)["settings"] == {"batch": 4, "lr": 0.1}  # a refused resume changes nothing
    with RunFolder(out, "latest", settings={"batch": 4, "lr": 0.2, "new": 1}, accept_changed_settings=True,
                   check_changes=refuse_batch).opened() as run_folder:
        assert run_folder.changed == {"lr": (0.1, 0.2)} and not run_folder.already_finished
    assert read_record(out)["settings"] == {"batch": 4, "lr": 0.2, "new": 1}


def test_a_checkpoint_at_the_last_step_loads_without_training_past_it(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out).opened():
        train(out, 4)

    def load_only(folder, steps, resume=None, **kwargs):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=str(folder), max_steps=steps, save_steps=2, per_device_train_batch_size=4,
                                 report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
        trainer = RunTrainer(model=TinyRegression(), args=args, train_dataset=Examples())
        trainer.load_without_training(resume)
        return trainer

    trainer = load_only(out, 4, resume=str(out / "checkpoint-4"))
    assert trainer.state.global_step == 4 and not (out / "checkpoint-5").exists()
    saved = torch.load(out / "checkpoint-4" / "pytorch_model.bin", weights_only=True) if (
        out / "checkpoint-4" / "pytorch_model.bin").exists() else None
    from safetensors.torch import load_file

    saved = saved or load_file(out / "checkpoint-4" / "model.safetensors")
    assert torch.equal(trainer.model.linear.weight, saved["linear.weight"])


# -- another path to the same folder --------------------------------------------------------------------------------

@pytest.fixture
def bind_mounted(tmp_path):
    """`bind_mounted(folder)`: a second path to `folder` (the same device and inode, another path text), by a bind
    mount; skipped where mounting is not allowed (not root)."""
    mounts = []

    def mount(folder):
        alias = tmp_path / f"mount-{len(mounts)}"
        alias.mkdir()
        result = subprocess.run(["mount", "--bind", str(folder), str(alias)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"no bind mount here: {result.stderr.strip()}")
        mounts.append(alias)
        return alias

    yield mount
    for alias in mounts:
        subprocess.run(["umount", str(alias)], check=True)


def test_another_path_to_the_output_folder_is_the_output_folder(tmp_path, bind_mounted):
    """A symlink or a bind mount of the output folder, given as an input or as the checkpoint to resume, is the
    output folder: told by device and inode, never by the path's text; --overwrite_output_dir deletes nothing."""
    out = tmp_path / "run"
    with RunFolder(out).opened():
        train(out, 2)
    before = sorted(os.listdir(out))
    link = tmp_path / "link"
    link.symlink_to(out)
    for alias in (link, bind_mounted(out)):
        assert os.path.realpath(alias) != os.path.realpath(out) or alias == link
        with pytest.raises(CommandError, match=rf"--model_name_or_path {alias} is --output_dir {out} itself"):
            RunFolder(out, overwrite=True, inputs=[RunInput("--model_name_or_path", alias)]).open()
        with pytest.raises(CommandError, match=rf"--model_name_or_path {alias}/checkpoint-2 lies inside --output_dir"):
            RunFolder(out, overwrite=True, inputs=[RunInput("--model_name_or_path", alias / "checkpoint-2")]).open()
        with pytest.raises(CommandError, match="lies inside --train_files"):
            RunFolder(out / "sub", inputs=[RunInput("--train_files", alias, recursive=True)]).open()
        with pytest.raises(CommandError, match="--overwrite_output_dir would delete what --resume_from_checkpoint"):
            RunFolder(out, alias / "checkpoint-2", overwrite=True).open()
        assert sorted(os.listdir(out)) == before
        # Resumed through the other path, the checkpoint is this run's.
        with RunFolder(out, alias / "checkpoint-2").opened() as run_folder:
            assert run_folder.resume_checkpoint == str(out / "checkpoint-2")


def test_overwrite_never_deletes_what_a_resume_continues_from(tmp_path):
    """--overwrite_output_dir with --resume_from_checkpoint latest, last, true, a checkpoint of the folder or the
    folder itself: one line, and the folder keeps every file."""
    out = tmp_path / "run"
    with RunFolder(out).opened() as run_folder:
        train(out, 4)
        run_folder.finish()
    def files():
        return {path.name: path.stat().st_mtime_ns for path in out.rglob("*") if path.name != LOCK_NAME}

    before = files()
    for resume in ("latest", "last", "true", True, out / "checkpoint-2", out / "checkpoint-4", out,
                   out / "checkpoint-9"):
        with pytest.raises(CommandError, match=r"^--overwrite_output_dir would delete what --resume_from_checkpoint .*"
                                               r"pass only one .*; nothing was deleted$"):
            RunFolder(out, resume, overwrite=True).open()
        assert files() == before


class StopAfterSaving(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_a_run_resumed_from_an_earlier_checkpoint_replaces_the_later_ones_whole(tmp_path):
    """Resumed from checkpoint-2 while checkpoint-4 and -6 exist, the run removes the old checkpoint-4 before
    writing its own (never a mix of the two), and `latest` is then the checkpoint saved last, not the highest step:
    killed after re-saving step 4, the run continues from its new checkpoint-4, not from the old checkpoint-6."""
    out = tmp_path / "run"
    with RunFolder(out).opened():
        train(out, 6)
    old_six = read_record(out / "checkpoint-6")
    with pytest.raises(KeyboardInterrupt), RunFolder(out, out / "checkpoint-2").opened():
        train(out, 6, resume=str(out / "checkpoint-2"), callbacks=[StopAfterSaving(4)])
    assert read_record(out / "checkpoint-4")["saved"] > old_six["saved"]
    assert read_record(out / "checkpoint-6") == old_six
    with RunFolder(out, "latest").opened() as run_folder:
        assert run_folder.resume_checkpoint == str(out / "checkpoint-4")
        train(out, 6, resume=run_folder.resume_checkpoint)
    assert read_record(out / "checkpoint-6")["saved"] > read_record(out / "checkpoint-4")["saved"]
    uninterrupted = tmp_path / "uninterrupted"
    with RunFolder(uninterrupted).opened():
        train(uninterrupted, 6)
    assert losses(out / "checkpoint-6") == pytest.approx(losses(uninterrupted / "checkpoint-6"), rel=1e-5)


def test_save_total_limit_keeps_the_checkpoint_just_saved_and_the_best(tmp_path):
    """--load_best_model_at_end with a limit of 2: Trainer keeps the best checkpoint (the first: the largest loss
    is asked for) and the one just saved, not checkpoint-4, and both are this run's complete checkpoints."""
    out = tmp_path / "run"
    with RunFolder(out).opened() as run_folder:
        train(out, 6, save_total_limit=2, eval_strategy="steps", eval_steps=2, label_names=["y"],
              load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    assert sorted(os.listdir(out)) == [LOCK_NAME, "checkpoint-2", "checkpoint-6", RECORD_NAME]
    assert [path.name for path in complete_checkpoints(out, run_folder.run_id)] == ["checkpoint-2", "checkpoint-6"]


# -- non-finite values ------------------------------------------------------------------------------------------------

class TurnsNaN(TinyRegression):
    """Its loss is NaN from the `at`-th forward on."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x, y):
        self.calls += 1
        loss = super().forward(x, y)["loss"]
        return {"loss": loss * float("nan") if self.calls >= self.at else loss}


def test_a_loss_that_turns_nan_stops_the_run_before_anything_of_it_is_saved(tmp_path):
    out = tmp_path / "run"
    says = r"^training stopped at step 3: the gradient norm is nan; nothing from this step on was saved \(pass --allow"
    with pytest.raises(TrainingDiverged, match=says), RunFolder(out).opened() as run_folder:
        train(out, 6, model=TurnsNaN(at=3))
    assert "holds checkpoint-2, this run's last complete checkpoint" in run_folder.describe()
    assert sorted(path.name for path in out.iterdir() if "checkpoint" in path.name) == ["checkpoint-2"]
    with RunFolder(out, "latest").opened():  # resumed, the model is finite again: it trains on
        train(out, 4, resume=str(out / "checkpoint-2"))
    # Asked for, the run goes on (and saves what it trains).
    other = tmp_path / "allowed"
    with RunFolder(other).opened():
        trainer = train(other, 4, model=TurnsNaN(at=3), allow_non_finite=True)
    assert not torch.isfinite(trainer.model.linear.weight).all() and (other / "checkpoint-4").is_dir()


def test_a_starting_model_with_a_nan_weight_is_refused_naming_it(tmp_path):
    model = TinyRegression()
    with torch.no_grad():
        model.linear.bias[0] = float("nan")
    out = tmp_path / "run"
    says = r"^training stopped at step 0: linear.bias holds 1 NaN value when training begins; nothing from this step"
    with pytest.raises(TrainingDiverged, match=says), RunFolder(out).opened():
        train(out, 4, model=model)
    assert not out.exists()  # nothing was written
