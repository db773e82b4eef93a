"""An output folder that belongs to one training run: never mixed with another run, never written by two
processes, and resumable only from its own complete checkpoints.

How a command (pretraining, a recipe) uses it::

    from fat5.training.run_folder import (RunFolder, RunFolderArguments, RunFolderTrainerMixin, RunInput,
                                          training_settings)

    @dataclass
    class MyTrainingArguments(Seq2SeqTrainingArguments, RunFolderArguments):  # --overwrite_output_dir, ...
        pass

    class MyTrainer(RunFolderTrainerMixin, Seq2SeqTrainer):  # checkpoints marked with the run's id
        pass

    def command(argv, progress):  # run by fat5.cli.run(command, argv)
        ...parse, check inputs...
        run_folder = RunFolder(training_args.output_dir, training_args.resume_from_checkpoint,
                               overwrite=training_args.overwrite_output_dir, resume_flag="last",
                               inputs=[RunInput("--train_file", path)],  # every path the run reads
                               settings={**training_settings(training_args), "train_file": path},
                               accept_changed_settings=training_args.resume_with_changed_settings)
        with run_folder.opened(training_args):  # lock, ownership check, clean-up; raises CommandError
            progress.describe = run_folder.describe  # Ctrl-C: "interrupted: OUT holds checkpoint-40, ..."
            if run_folder.already_finished:  # resuming a run that ended: nothing to do
                return
            trainer = MyTrainer(...)  # adds CheckpointMarks and NonFiniteStop
            trainer.train(resume_from_checkpoint=run_folder.resume_checkpoint)
            trainer.save_model()
            run_folder.finish()

What it guarantees:
- Nothing the run reads is inside the folder, is the folder, or (a folder read recursively, such as a corpus
  folder) holds it: checked before anything is written, one line naming both paths.
- The folder records its run (`fat5_run.json`: a run id, the start time, the command, the settings that shape the
  training, and every entry of the folder the run wrote). A folder that holds anything else (another run's results,
  any files) is refused with one line, unless the user resumes that run (`--resume_from_checkpoint latest`/`last`,
  or a checkpoint inside the folder) or passes --overwrite_output_dir, which removes what the earlier run recorded
  as its own and refuses when anything else is there: a file FAT5 did not write is never deleted.
- A resume is exact or refused: a setting that changes what is trained on or how (batch size, accumulation,
  steps, learning rate, seed, data, sequence lengths...) differing from the run's is refused in one line naming it,
  unless the command passes `accept_changed_settings` (the user's --resume_with_changed_settings) and its
  `check_changes` accepts them; the run then records the new settings. A run that finished is resumed as a no-op
  (`already_finished`); `RunFolderTrainerMixin.load_without_training` finishes one whose last checkpoint already
  reached its last step (Trainer would train one step past it).
- A lock on `.fat5_run.lock` in the folder is held by the main process for the whole run: a second run on the same
  folder is refused at start-up, never interleaved. It is `flock` where the platform has `fcntl` (the kernel releases
  it when the process dies); elsewhere (Windows) the lock file itself, created exclusively with the process id,
  removed when the run ends, and taken over when the process it names no longer exists (fat5/safe_files.py
  `LockFile`).
- Checkpoints are whole or do not count: Trainer writes checkpoint-N, and `CheckpointMarks` (a callback) marks it
  complete once written and flushed (`fat5_run.json` inside it, with the run id, the step and the save's order). A
  checkpoint-N without this run's mark (a save cut short, a foreign copy) is never resumed from and is removed by the
  next run on the folder. A save that fails (a full disk) ends the run with one line naming the checkpoint, and
  what Trainer wrote of it is removed.
- `--save_total_limit` is Trainer's own rotation (the newest checkpoint and the best kept), as the user gives it.
- A resume from an earlier checkpoint replaces the later ones as it reaches their steps, each removed whole before
  the new one is written; `latest` is the checkpoint saved last.
- With --overwrite_output_dir, a resume from the folder (`latest`, one of its checkpoints) is refused in one line,
  before anything is deleted. Paths are compared by device and inode: another path to the output folder (a
  symlink, a bind mount) is the output folder.
- `latest`/`last` resumes this run's last complete checkpoint; a run stopped before its first checkpoint was
  complete (`kill -9` during the save) trains again from its first step, with its settings. A folder with no run
  to continue is refused with one line.
- What FAT5's own writers leave when killed (staging folders, folders being deleted, temporary record files:
  `LEFTOVER`) is never taken for the user's files and is cleaned at start-up; the checkpoint a run is about to
  write is recorded as the run's before Trainer writes it, so that --overwrite_output_dir deletes one cut short.

Trainer is used through its public API only: callbacks (`CheckpointMarks`, `NonFiniteStop`), its arguments and
`train`.
"""

import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

from fat5.cli import CommandError, WriteFailed, raise_if_interrupted, write_failure
from fat5.safe_files import LockFile, fsync_tree, remove_folder, remove_stale_staging, write_atomically

from .finite import NonFiniteStop
from .flags import RunFolderArguments  # the run folder's flags, read before transformers loads

RECORD_NAME = "fat5_run.json"
LOCK_NAME = ".fat5_run.lock"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# What FAT5's own writers leave in a run folder when killed (`kill -9`, a crash): staging folders of saves
# (fat5/safe_files.py: `.NAME.partial-PID-XXXX`, and `...-old`; `.checkpoint-N.partial` of earlier FAT5 versions),
# folders being deleted (`.NAME.removed`) and temporary files of records (`.NAME.PID.tmp`). Never read, never
# taken for the user's files, cleaned at start-up.
LEFTOVER = re.compile(r"\..+\.(partial(-old)?|partial-\d+-.+|removed|\d+\.tmp)")
STAGING = re.compile(r"\.(.+)\.partial-\d+-.+")
RESUME_LAST = ("latest", "last", "true", "True")
TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name, in every version


# TrainingArguments fields that change what a run trains on or how (with the world size): a resume must keep them.
TRAINING_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "num_train_epochs",
                     "seed", "data_seed", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
                     "warmup_ratio", "weight_decay", "optim", "optim_args", "adam_beta1", "adam_beta2", "adam_epsilon",
                     "max_grad_norm", "label_smoothing_factor", "bf16", "fp16", "group_by_length",
                     "dataloader_drop_last", "neftune_noise_alpha")


@dataclass(frozen=True)
class RunInput:
    """A path a run reads, named by its flag. `recursive`: a folder read with everything below it (a corpus)."""

    flag: str
    path: object
    recursive: bool = False


def training_settings(training_args, names=TRAINING_SETTINGS):
    """The settings of `training_args` that shape training, as JSON values, with the world size."""
    settings = {name: getattr(training_args, name) for name in names if hasattr(training_args, name)}
    settings["world_size"] = training_args.world_size
    return json.loads(json.dumps(settings, default=str))


def changed_settings(recorded, current):
    """{name: (recorded value, current value)} for the settings both name with different values (a setting one
    of them lacks, such as a field a newer transformers added, is no change)."""
    return {name: (recorded[name], current[name]) for name in recorded.keys() & current.keys()
            if recorded[name] != current[name]}


def read_record(folder):
    """The run record of a run folder or a checkpoint (a dict), or None when there is none or it is unreadable."""
    try:
        record = json.loads((Path(folder) / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_json_atomically(path, value):
    write_atomically(path, json.dumps(value, indent=1) + "\n")


def folder_entries(folder):
    """The entries of a run folder that are not the run folder's own bookkeeping (lock, record, leftovers of
    interrupted saves)."""
    return [path for path in Path(folder).iterdir() if path.name not in (LOCK_NAME, RECORD_NAME)
            and not LEFTOVER.fullmatch(path.name)]


def update_record(folder, finished=False, writing=()):
    """Add every entry of the folder, and `writing` (the entries the run is about to write), to its record's `wrote`
    (what a later --overwrite_output_dir may delete), and mark the run finished when its final save is complete.
    Called when training begins, before and after each checkpoint and when the run ends, so that what a killed run
    leaves (a checkpoint cut short) is known as the run's."""
    record = read_record(folder)
    if record is None:
        return
    record["wrote"] = sorted({*record.get("wrote", ()), *(path.name for path in folder_entries(folder)), *writing})
    record["finished"] = bool(record.get("finished")) or finished
    _write_json_atomically(Path(folder) / RECORD_NAME, record)


def same_folder(first, second):
    """Whether two paths name the same file or folder: by device and inode, so a symlink, a bind mount or any
    other path to it counts (never by the paths' text)."""
    try:
        return os.path.samestat(os.stat(first), os.stat(second))
    except OSError:
        return False


def lies_inside(path, folder):
    """Whether `path` lies below `folder` (at any depth, under any of its names): some folder above `path` is
    `folder` by device and inode."""
    try:
        folder_stat = os.stat(folder)
    except OSError:
        return False
    for parent in Path(os.path.realpath(path)).parents:
        try:
            if os.path.samestat(os.stat(parent), folder_stat):
                return True
        except OSError:
            continue
    return False


def checkpoint_step(path):
    match = CHECKPOINT_NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def complete_checkpoints(folder, run_id):
    """This run's complete checkpoints in `folder` (marked by `CheckpointMarks`), in the order they were saved
    (the step orders the marks of earlier FAT5 versions, which recorded no order, before the others)."""
    folder = Path(folder)
    if run_id is None or not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        step = checkpoint_step(path)
        record = read_record(path) if step is not None and path.is_dir() else None
        if record is not None and record.get("run") == run_id and record.get("step") == step:
            saved = record.get("saved", 0)
            found.append((saved if isinstance(saved, int) else 0, step, path))
    return [path for *_, path in sorted(found)]


class RunFolder:
    """The output folder of one training run (see the module docstring). `resume_from_checkpoint` is the flag's
    value (None, `latest`/`last`/`true`, or a checkpoint folder); `resume_flag` is the word the messages suggest."""

    def __init__(self, output_dir, resume_from_checkpoint=None, overwrite=False, resume_flag="latest",
                 command=None, inputs=(), settings=None, accept_changed_settings=False, check_changes=None):
        self.path = Path(output_dir)
        self.resume = resume_from_checkpoint
        self.overwrite = overwrite
        self.resume_flag = resume_flag
        self.command = list(sys.argv if command is None else command)
        self.inputs = [item if isinstance(item, RunInput) else RunInput(*item) for item in inputs]
        self.settings = dict(settings or {})
        self.accept_changed_settings = accept_changed_settings
        # Called with the accepted changes, before anything is recorded: raises CommandError for those the command
        # cannot continue the run exactly with.
        self.check_changes = check_changes
        self.run_id = None
        self.resume_checkpoint = None
        # Settings that differ from the run's, accepted with accept_changed_settings: {name: (then, now)}.
        self.changed = {}
        self.already_finished = False  # resumed a run whose final save completed: nothing to do
        self.finished = False
        self._lock = None

    # -- start-up ------------------------------------------------------------------------------------------------

    @contextmanager
    def opened(self, training_args=None):
        """Open for the run's lifetime. With `training_args` in a multi-process launch, the main process opens the
        folder (lock, checks, clean-up) before the others only read which checkpoint to resume."""
        main_process = training_args is None or training_args.process_index == 0
        created = main_process and not self.path.exists()
        with _main_process_first(training_args):
            if main_process:
                self.open()
            else:
                self._read_only_resume()
        try:
            yield self
        except BaseException:
            if created and not self._contents():
                shutil.rmtree(self.path, ignore_errors=True)  # a run that failed before writing anything
            raise
        finally:
            self.close()

    def open(self):
        """Check the run's inputs against the folder, lock it, check that this run may use it, clean what
        interrupted saves left, record the run, and resolve the checkpoint to resume from
        (`self.resume_checkpoint`). Raises CommandError, leaving no folder behind when it created it."""
        self.check_inputs()
        if self.path.exists() and not self.path.is_dir():
            raise CommandError(f"--output_dir {self.path} exists and is not a folder")
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        lock_existed = (self.path / LOCK_NAME).exists()
        self._acquire_lock()
        try:
            self._claim()
        except BaseException:
            self._lock.release()  # (not close(): a refused run records nothing)
            self._lock = None
            if created and not self._contents():  # (another run may have made the folder since)
                shutil.rmtree(self.path, ignore_errors=True)
            elif not lock_existed:
                (self.path / LOCK_NAME).unlink(missing_ok=True)  # nothing of ours stays in a folder we refused
            raise
        return self.resume_checkpoint

    def _acquire_lock(self):
        self._lock = LockFile.acquire(self.path / LOCK_NAME)
        if self._lock is None:
            pid, host = LockFile.holder(self.path / LOCK_NAME)
            where = f" on {host}" if host and host != socket.gethostname() else ""
            raise CommandError(f"--output_dir {self.path} is in use by another run (process {pid or '?'}{where}); "
                               f"wait for it to finish or choose another folder")

    def close(self):
        if self._lock is not None:
            try:
                update_record(self.path)
            finally:
                self._lock.release()
                self._lock = None

    def check_inputs(self):
        """Refuse an input that is the output folder or lies inside it (the run would write over, or
        --overwrite_output_dir delete, what it reads), and an output folder inside an input read recursively (the
        run's own files would become its data). Folders are told apart by device and inode, so another path to the
        same folder (a symlink, a bind mount) is the same folder; nothing is written before this."""
        out = self.path
        for item in self.inputs:
            if item.path is None or not Path(item.path).exists():  # a Hub id, or a path the command reports itself
                continue
            path = Path(item.path)
            if same_folder(path, out):
                raise CommandError(f"{item.flag} {item.path} is --output_dir {self.path} itself: the run would write "
                                   f"over what it reads; choose another --output_dir")
            if lies_inside(path, out):
                raise CommandError(f"{item.flag} {item.path} lies inside --output_dir {self.path}: the run would "
                                   f"write over what it reads; move it out or choose another --output_dir")
            if item.recursive and lies_inside(out, path):
                raise CommandError(f"--output_dir {self.path} lies inside {item.flag} {item.path}, which is read with "
                                   f"everything below it: the run's own files would become its data; choose an "
                                   f"--output_dir outside it")

    def _contents(self):
        return folder_entries(self.path)

    def _inside(self, checkpoint):
        """Whether a --resume_from_checkpoint path is in this folder, or is the folder (under any name)."""
        return lies_inside(checkpoint, self.path) or same_folder(checkpoint, self.path)

    def _claim(self):
        record = read_record(self.path)
        resume_last = self.resume is True or self.resume in RESUME_LAST
        resume_here = resume_last or (bool(self.resume) and self._inside(self.resume))
        contents = self._contents()
        if self.overwrite and resume_here:
            raise CommandError(f"--overwrite_output_dir would delete what --resume_from_checkpoint {self.resume} "
                               f"continues from in {self.path}: pass only one (--resume_from_checkpoint continues the "
                               f"run; --overwrite_output_dir starts a new one); nothing was deleted")
        if self.overwrite and contents:
            self._remove_earlier_run(record)
        elif record is not None and resume_here:
            self.run_id = record.get("run")
            self._check_settings(record)
        elif contents:
            raise CommandError(self._refusal(record, resume_here))
        if self.run_id is None:
            if resume_last:
                raise CommandError(f"--resume_from_checkpoint {self.resume}: {self.path} holds no checkpoint of a "
                                   f"run to continue")
            self.run_id = uuid.uuid4().hex
            record = {"run": self.run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": self.command,
                      "settings": self.settings, "wrote": [], "finished": False}
        elif self.changed:
            record = {**record, "settings": {**record.get("settings", {}), **self.settings}}
        self.already_finished = bool(record.get("finished")) and resume_here and not self.changed
        self.resume_checkpoint = self._resolve_resume()  # before anything is written or cleaned
        if resume_last and self.resume_checkpoint is None and not self.already_finished:
            print(f"--resume_from_checkpoint {self.resume}: {self.path} holds no complete checkpoint of its run (it "
                  f"stopped before its first save was complete): training it again from its first step")
        _write_json_atomically(self.path / RECORD_NAME, record)
        self._clean()

    def _check_settings(self, record):
        """A resumed run keeps the settings it was started with, or the user accepts the change explicitly."""
        changed = changed_settings(record.get("settings", {}), self.settings)
        if not changed:
            return
        described = ", ".join(f"--{name} {now!r} (the run's: {then!r})"
                              for name, (then, now) in sorted(changed.items()))
        if not self.accept_changed_settings:
            raise CommandError(f"--resume_from_checkpoint {self.resume}: this run was started with other settings: "
                               f"{described}; resume with the run's settings, or pass --resume_with_changed_settings "
                               f"to continue with these")
        if self.check_changes is not None:
            self.check_changes(changed)
        print(f"--resume_with_changed_settings: continuing {self.path} with {described}")
        self.changed = changed

    def _refusal(self, record, resume_here):
        if record is None and resume_here:
            return f"--output_dir {self.path} holds no record of a run to continue (written by another program or " \
                   f"an older FAT5?); resume from one of its checkpoints into a new --output_dir"
        if record is None:
            what, how = "files that are not a FAT5 run's", ""
        else:
            last = complete_checkpoints(self.path, record.get("run"))
            what = f"another run's results (started {record.get('started', '?')}; last complete checkpoint: " \
                   f"{last[-1].name if last else 'none'})"
            how = f"continue it with --resume_from_checkpoint {self.resume_flag}" + \
                  ("" if last else " (it trains again from its first step)") + ", or "
        return f"--output_dir {self.path} holds {what}; {how}pass --overwrite_output_dir to replace it, or " \
               f"choose another folder"

    def _remove_earlier_run(self, record):
        """--overwrite_output_dir: delete what the earlier run recorded as its own, after checking that nothing
        else is there (a file FAT5 did not write is never deleted)."""
        if record is None or "wrote" not in record:
            whose = "holds files that are not a FAT5 run's" if record is None else \
                "was written by an earlier FAT5 that did not record which files are its own"
            raise CommandError(f"--output_dir {self.path} {whose}: --overwrite_output_dir deletes only what a FAT5 run "
                               f"wrote; move them out or choose another folder")
        ours = set(record["wrote"]) | {path.name for path in complete_checkpoints(self.path, record.get("run"))}
        others = sorted(path.name for path in self._contents() if path.name not in ours)
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise CommandError(f"--output_dir {self.path} also holds what no FAT5 run wrote ({shown}): "
                               f"--overwrite_output_dir deletes only the earlier run's; move them out or choose "
                               f"another folder")
        print(f"--overwrite_output_dir: deleting what the earlier run wrote in {self.path}")
        for path in self._contents():
            if path.is_dir() and not path.is_symlink():
                remove_folder(path)  # never a half-deleted checkpoint
            else:
                path.unlink()
        (self.path / RECORD_NAME).unlink(missing_ok=True)

    def finish(self):
        """The run's final save is complete: a later resume of this run is a no-op."""
        self.finished = True
        update_record(self.path, finished=True)

    def _clean(self):
        """Remove what interrupted saves left (LEFTOVER): staging folders (through fat5/safe_files.py, which puts
        back an old folder a killed replacement had moved aside), and checkpoints without this run's mark."""
        remove_stale_staging(self.path)  # a killed final save_pretrained of the whole folder
        complete = complete_checkpoints(self.path, self.run_id)
        for path in self.path.iterdir():
            if STAGING.fullmatch(path.name):
                remove_stale_staging(self.path / STAGING.fullmatch(path.name).group(1).removesuffix("-old"))
            elif LEFTOVER.fullmatch(path.name):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            elif checkpoint_step(path) is not None and path.is_dir() and path not in complete:
                print(f"removing {path}: an incomplete checkpoint (its save was interrupted)")
                shutil.rmtree(path)

    def _resolve_resume(self):
        if not self.resume:
            return None
        if self.resume is True or self.resume in RESUME_LAST:
            last = self.last_checkpoint()
            if last is None:  # stopped before its first checkpoint was complete: the run starts again, exactly
                return None
            return str(last)
        checkpoint = Path(self.resume)
        if not checkpoint.is_dir():
            raise CommandError(f"no checkpoint folder at --resume_from_checkpoint {self.resume}")
        if self._inside(checkpoint):
            ours = [path for path in complete_checkpoints(self.path, self.run_id) if same_folder(path, checkpoint)]
            if not ours:
                raise CommandError(f"--resume_from_checkpoint {self.resume} is not a complete checkpoint of the run "
                                   f"in {self.path}")
            return str(ours[0])
        elif read_record(checkpoint.parent) is not None and read_record(checkpoint) is None:
            raise CommandError(f"--resume_from_checkpoint {self.resume} is an incomplete checkpoint (its save was "
                               f"interrupted)")
        elif not (checkpoint / TRAINER_STATE_NAME).is_file():
            raise CommandError(f"--resume_from_checkpoint {self.resume} is not a Trainer checkpoint (no "
                               f"{TRAINER_STATE_NAME})")
        return str(checkpoint)

    def _read_only_resume(self):
        record = read_record(self.path)
        self.run_id = record.get("run") if record else None
        self.resume_checkpoint = self._resolve_resume()

    # -- during and after the run --------------------------------------------------------------------------------

    def resume_state(self):
        """The Trainer state (trainer_state.json) of the checkpoint to resume from, or None."""
        if not self.resume_checkpoint:
            return None
        try:
            return json.loads((Path(self.resume_checkpoint) / TRAINER_STATE_NAME).read_text())
        except (OSError, ValueError):
            return None

    def last_checkpoint(self):
        """This run's last complete checkpoint folder, or None."""
        checkpoints = complete_checkpoints(self.path, self.run_id)
        return checkpoints[-1] if checkpoints else None

    def describe(self):
        """What the folder holds, in one phrase (for the Ctrl-C line)."""
        if not self.path.is_dir():
            return f"nothing was written to {self.path}"
        last = self.last_checkpoint() if self.run_id else None
        final = "the final model and " if self.finished else ""
        if last is None:
            return f"{self.path} holds {final}no complete checkpoint of this run"
        return f"{self.path} holds {final}{last.name}, this run's last complete checkpoint (continue with " \
               f"--resume_from_checkpoint {self.resume_flag})"


@contextmanager
def _main_process_first(training_args):
    if training_args is None:
        yield
        return
    with training_args.main_process_first(desc="run folder"):
        yield


class RunFolderTrainerMixin:
    """Mixin for transformers' Trainer (``class MyTrainer(RunFolderTrainerMixin, Trainer)``): adds the run folder's
    `CheckpointMarks` callback (checkpoints marked complete, a failed save named) and
    `NonFiniteStop` (a run never trains on, nor saves, non-finite values unless --allow_non_finite). Overrides no
    Trainer method but the public `train`, which it wraps to name a checkpoint that cannot be written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(NonFiniteStop(self.args))  # first: a non-finite model stops the run before a save begins
        self.checkpoint_marks = CheckpointMarks(self)
        self.add_callback(self.checkpoint_marks)

    def checkpoint_mark(self):
        """Fields a checkpoint's mark (its fat5_run.json) records besides the run, the step and the save's order."""
        return {}

    def train(self, *args, **kwargs):
        with self.checkpoint_marks.failed_save_reported():
            return super().train(*args, **kwargs)

    def load_without_training(self, checkpoint):
        """Load `checkpoint` (model weights and Trainer state, as a resume does) and train nothing: for a run whose
        last checkpoint already reached its last step, which Trainer would train one step past."""
        self.add_callback(_StopBeforeTheFirstStep)
        try:
            self.train(resume_from_checkpoint=checkpoint)
        except _CheckpointLoaded:
            pass
        finally:
            self.remove_callback(_StopBeforeTheFirstStep)


class CheckpointMarks(TrainerCallback):
    """A checkpoint is whole or it does not count, with Trainer's own saving (public callbacks only): Trainer
    writes checkpoint-N into the run folder; `on_save`, which Trainer calls once the checkpoint is written, flushes
    it to the disk and marks it complete (`fat5_run.json` inside it: the run's id, the step and the save's order).
    A checkpoint without this run's mark (a save cut short by a crash, a kill, a full disk) is never resumed from
    and is removed by the next run on the folder (`RunFolder._clean`).

    Resuming from an earlier checkpoint than the last, the run saves again at steps it had saved before: the old
    checkpoint-N is removed just before Trainer writes the new one (whole, never mixed with the new files), and
    `latest` is the last checkpoint saved, not the highest step. --save_total_limit is Trainer's own rotation.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.saving = None  # the checkpoint Trainer is about to write, or writing (its name)

    def run_dir(self, args):
        return Path(args.output_dir)

    def before_a_save(self, args, state, control):
        """Trainer will (or may, with --save_strategy best) write checkpoint-N after this event: an old checkpoint-N
        of the run (saved before a resume from an earlier one) goes first, so the new one never mixes with it."""
        if not (control.should_save or (args.save_strategy == "best" and control.should_evaluate)):
            return
        self.saving = f"checkpoint-{state.global_step}"
        old = self.run_dir(args) / self.saving
        if args.should_save:
            if old.is_dir():
                remove_folder(old)
            update_record(self.run_dir(args), writing=[self.saving])  # what a kill during the save leaves is ours
        self.trainer.accelerator.wait_for_everyone()  # no process writes into checkpoint-N before it is gone

    def on_train_begin(self, args, state, control, **kwargs):
        if args.should_save:
            update_record(self.run_dir(args))  # what the run wrote before training (a tokenizer, the loggers' files)

    def on_step_begin(self, args, state, control, **kwargs):
        raise_if_interrupted()  # a Ctrl-C that Python dropped (see fat5.cli) stops the run here
        self.saving = None

    def on_prediction_step(self, args, state, control, **kwargs):
        raise_if_interrupted()

    def on_step_end(self, args, state, control, **kwargs):
        self.before_a_save(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.before_a_save(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        self.trainer.accelerator.wait_for_everyone()  # every process has written its part
        self.saving = None
        if not args.should_save:
            return
        run_dir = self.run_dir(args)
        checkpoint = run_dir / f"checkpoint-{state.global_step}"
        if not checkpoint.is_dir():  # Trainer's rotation removed it (a limit below the later steps of a resume)
            return
        run_id = (read_record(run_dir) or {}).get("run")
        marked = complete_checkpoints(run_dir, run_id)
        order = 1 + max((read_record(path).get("saved", 0) for path in marked), default=0)
        fsync_tree(checkpoint)
        _write_json_atomically(checkpoint / RECORD_NAME, {"run": run_id, "step": state.global_step, "saved": order,
                                                          **self.trainer.checkpoint_mark()})
        update_record(run_dir)  # what this run wrote so far, should it be killed

    @contextmanager
    def failed_save_reported(self):
        """A save cut short (an error, Ctrl-C) leaves nothing: what Trainer wrote of the checkpoint is removed,
        freeing its room; one that cannot be written (a full disk) ends the run with one WriteFailed line naming it
        (the command adds what the folder holds)."""
        try:
            yield
        except BaseException as error:
            if not self.saving:
                raise
            partial = self.run_dir(self.trainer.args) / self.saving
            if self.trainer.args.should_save and partial.is_dir() and read_record(partial) is None:
                remove_folder(partial)  # a save cut short (a full disk, Ctrl-C) leaves nothing
            reason = write_failure(error, self.trainer.args.output_dir) if isinstance(error, Exception) else None
            if reason is None:
                raise
            raise WriteFailed(f"writing {self.saving} failed ({reason})") from error


@contextmanager
def progress_bars_closed(trainer):
    """A run that stops (an error, Ctrl-C) closes the Trainer's progress bars first: left open, a bar is drawn again
    as Python exits, and the command's one `error:` or `interrupted:` line would land on the bar's line."""
    try:
        yield
    except BaseException:
        for callback in trainer.callback_handler.callbacks:
            for bar in (getattr(callback, "training_bar", None), getattr(callback, "prediction_bar", None)):
                if bar is not None:
                    bar.leave = False
                    bar.close()
        raise


class _CheckpointLoaded(Exception):
    pass


class _StopBeforeTheFirstStep(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        raise _CheckpointLoaded


__all__ = ["RunFolderArguments", "RunFolder", "RunInput", "RunFolderTrainerMixin", "CheckpointMarks",
           "complete_checkpoints", "progress_bars_closed", "training_settings", "read_record"]
