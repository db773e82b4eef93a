"""An output folder that belongs to one training run: never mixed with another run, never written by two
processes, and resumable only from its own complete checkpoints.

How a command (pretraining, a recipe) uses it::

    from fat5.training.run_folder import (RunFolder, RunFolderArguments, RunFolderTrainerMixin, RunInput,
                                          training_settings)

    @dataclass
    class MyTrainingArguments(Seq2SeqTrainingArguments, RunFolderArguments):  # --overwrite_output_dir, ...
        pass

    class MyTrainer(RunFolderTrainerMixin, Seq2SeqTrainer):  # atomic checkpoints, marked with the run's id
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
            trainer = MyTrainer(...)
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
- A lock (`flock` on `.fat5_run.lock` in the folder) is held by the main process for the whole run: a second run on
  the same folder is refused at start-up, never interleaved. The kernel releases it when the process dies.
- Checkpoints are atomic: `RunFolderTrainerMixin` lets Trainer write checkpoint-N into a staging folder beside it
  (`.checkpoint-N.partial/`), marks it complete (`fat5_run.json` inside it, with the run id and step), and moves it
  into place in one rename (or exchange, when re-saving step N after resuming from an earlier checkpoint). A
  checkpoint-N in the folder is therefore complete; one without this run's mark (a crash of an older version, a
  foreign copy) is never resumed from and is removed by the next run on the folder, as are staging folders.
- `--save_total_limit` rotates only this run's complete checkpoints (oldest step first, the best one kept), after
  the new one is in place.
- `latest`/`last` resumes this run's last complete checkpoint, or is refused with one line when it has none.

Only the standard library and transformers are imported (`fat5.cli` for its error class; the flags, in
`fat5.training.flags`, need only the standard library).
"""

import fcntl
import json
import os
import re
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

from fat5.cli import CommandError, raise_if_interrupted, write_failures_reported
from fat5.safe_files import put_in_place, remove_stale_staging

from .flags import RunFolderArguments  # the run folder's flags, read before transformers loads

RECORD_NAME = "fat5_run.json"
LOCK_NAME = ".fat5_run.lock"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# Hidden folders of checkpoints being written (.partial) or deleted (.removed); never read, cleaned at start-up.
CHECKPOINT_LEFTOVER = re.compile(r"\.checkpoint-\d+\.(partial|removed)(-old)?|\..+\.removed")
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
    from fat5.safe_files import write_atomically

    write_atomically(path, json.dumps(value, indent=1) + "\n")


def folder_entries(folder):
    """The entries of a run folder that are not the run folder's own bookkeeping (lock, record, leftovers of
    interrupted saves)."""
    return [path for path in Path(folder).iterdir() if path.name not in (LOCK_NAME, RECORD_NAME)
            and not CHECKPOINT_LEFTOVER.fullmatch(path.name)]


def update_record(folder, finished=False):
    """Add every entry of the folder to its record's `wrote` (what a later --overwrite_output_dir may delete), and
    mark the run finished when its final save is complete. Called at each checkpoint and when the run ends."""
    record = read_record(folder)
    if record is None:
        return
    record["wrote"] = sorted({*record.get("wrote", ()), *(path.name for path in folder_entries(folder))})
    record["finished"] = bool(record.get("finished")) or finished
    _write_json_atomically(Path(folder) / RECORD_NAME, record)


def checkpoint_step(path):
    match = CHECKPOINT_NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def complete_checkpoints(folder, run_id):
    """This run's complete checkpoints in `folder`, oldest step first."""
    folder = Path(folder)
    if run_id is None or not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        step = checkpoint_step(path)
        record = read_record(path) if step is not None and path.is_dir() else None
        if record is not None and record.get("run") == run_id and record.get("step") == step:
            found.append((step, path))
    return [path for _, path in sorted(found)]


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
            os.close(self._lock)  # (not close(): a refused run records nothing)
            self._lock = None
            if created and not self._contents():  # (another run may have made the folder since)
                shutil.rmtree(self.path, ignore_errors=True)
            elif not lock_existed:
                (self.path / LOCK_NAME).unlink(missing_ok=True)  # nothing of ours stays in a folder we refused
            raise
        return self.resume_checkpoint

    def _acquire_lock(self):
        descriptor = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(descriptor, 64, 0).decode(errors="replace").strip()
            os.close(descriptor)
            raise CommandError(f"--output_dir {self.path} is in use by another run (process {owner or '?'}); wait "
                               f"for it to finish or choose another folder") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        self._lock = descriptor

    def close(self):
        if self._lock is not None:
            try:
                update_record(self.path)
            finally:
                os.close(self._lock)
                self._lock = None

    def check_inputs(self):
        """Refuse an input that is the output folder or lies inside it (the run would write over, or
        --overwrite_output_dir delete, what it reads), and an output folder inside an input read recursively (the
        run's own files would become its data). Symlinks are resolved; nothing is written before this."""
        out = self.path.resolve()
        for item in self.inputs:
            if item.path is None or not Path(item.path).exists():  # a Hub id, or a path the command reports itself
                continue
            path = Path(item.path).resolve()
            if path == out:
                raise CommandError(f"{item.flag} {item.path} is --output_dir {self.path} itself: the run would write "
                                   f"over what it reads; choose another --output_dir")
            if out in path.parents:
                raise CommandError(f"{item.flag} {item.path} lies inside --output_dir {self.path}: the run would "
                                   f"write over what it reads; move it out or choose another --output_dir")
            if item.recursive and path in out.parents:
                raise CommandError(f"--output_dir {self.path} lies inside {item.flag} {item.path}, which is read with "
                                   f"everything below it: the run's own files would become its data; choose an "
                                   f"--output_dir outside it")

    def _contents(self):
        return folder_entries(self.path)

    def _inside(self, checkpoint):
        return Path(checkpoint).resolve().parent == self.path.resolve()

    def _claim(self):
        record = read_record(self.path)
        resume_last = self.resume is True or self.resume in RESUME_LAST
        resume_here = resume_last or (bool(self.resume) and self._inside(self.resume))
        contents = self._contents()
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
        _write_json_atomically(self.path / RECORD_NAME, record)
        self._clean()
        self.resume_checkpoint = self._resolve_resume()

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
            how = f"continue it with --resume_from_checkpoint {self.resume_flag}, or "
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
            doomed = path.with_name(f".{path.name}.removed") if path.is_dir() and not path.is_symlink() else path
            if doomed is not path:
                os.rename(path, doomed)  # never a half-deleted checkpoint
                shutil.rmtree(doomed)
            else:
                path.unlink()
        (self.path / RECORD_NAME).unlink(missing_ok=True)

    def finish(self):
        """The run's final save is complete: a later resume of this run is a no-op."""
        self.finished = True
        update_record(self.path, finished=True)

    def _clean(self):
        """Remove what interrupted saves left: staging folders and checkpoints without this run's mark."""
        remove_stale_staging(self.path)  # a killed final save_pretrained of the whole folder
        complete = complete_checkpoints(self.path, self.run_id)
        for path in self.path.iterdir():
            if CHECKPOINT_LEFTOVER.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)
            elif checkpoint_step(path) is not None and path.is_dir() and path not in complete:
                print(f"removing {path}: an incomplete checkpoint (its save was interrupted)")
                shutil.rmtree(path)

    def _resolve_resume(self):
        if not self.resume:
            return None
        if self.resume is True or self.resume in RESUME_LAST:
            last = self.last_checkpoint()
            if last is None:
                raise CommandError(f"--resume_from_checkpoint {self.resume}: {self.path} holds no complete "
                                   f"checkpoint of its run")
            return str(last)
        checkpoint = Path(self.resume)
        if not checkpoint.is_dir():
            raise CommandError(f"no checkpoint folder at --resume_from_checkpoint {self.resume}")
        if self._inside(checkpoint):
            if checkpoint.resolve() not in [path.resolve() for path in complete_checkpoints(self.path, self.run_id)]:
                raise CommandError(f"--resume_from_checkpoint {self.resume} is not a complete checkpoint of the run "
                                   f"in {self.path}")
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
    """Mixin for transformers' Trainer (``class MyTrainer(RunFolderTrainerMixin, Trainer)``): checkpoints written
    in a staging folder, marked with the run's id and moved into place in one step, then rotated by
    --save_total_limit among this run's complete checkpoints only. A Ctrl-C that Python dropped (see
    `fat5.cli`) stops the run at the next step."""

    def training_step(self, *args, **kwargs):
        raise_if_interrupted()
        return super().training_step(*args, **kwargs)

    def checkpoint_mark(self):
        """Fields a checkpoint's mark (its fat5_run.json) records besides the run and the step."""
        return {}

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

    def prediction_step(self, *args, **kwargs):
        raise_if_interrupted()
        return super().prediction_step(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        # A checkpoint that cannot be written (a full disk) ends the run with one line naming it and what the
        # folder holds, not torch's or safetensors' traceback; its staging folder is never resumed from.
        with write_failures_reported(f"checkpoint-{self.state.global_step}", self.args.output_dir):
            self._save_checkpoint_atomically(model, trial)

    def _save_checkpoint_atomically(self, model, trial):
        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"checkpoint-{self.state.global_step}"
        staging_dir = run_dir / f".{name}.partial"
        limit = self.args.save_total_limit
        # Trainer saves into staging_dir/checkpoint-N and rotates nothing (the rotation runs once N is in place).
        self._get_output_dir = lambda trial=None: str(staging_dir)
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
            self.args.save_total_limit = limit
        staged, final = staging_dir / name, run_dir / name
        if self.state.best_model_checkpoint == str(staged):
            self.state.best_model_checkpoint = str(final)
            if self.args.should_save:
                self.state.save_to_json(str(staged / TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every process has written its part
        if not self.args.should_save:
            return
        record = read_record(run_dir) or {}
        _write_json_atomically(staged / RECORD_NAME, {"run": record.get("run"), "step": self.state.global_step,
                                                      **self.checkpoint_mark()})
        old = put_in_place(staged, final)
        shutil.rmtree(staging_dir, ignore_errors=True)  # with the replaced checkpoint-N, if any
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._rotate_run_checkpoints(run_dir, record.get("run"), limit)
        update_record(run_dir)  # what this run wrote so far, should it be killed

    def _rotate_run_checkpoints(self, run_dir, run_id, limit):
        if not limit or limit <= 0:
            return
        checkpoints = [str(path) for path in complete_checkpoints(run_dir, run_id)]
        best = self.state.best_model_checkpoint
        if best in checkpoints and checkpoints[-1] != best:
            # As Trainer: the best checkpoint is kept, and so is the newest (to resume from).
            checkpoints.remove(best)
            checkpoints.insert(-1, best)
            limit = max(limit, 2)
        for path in checkpoints[:max(len(checkpoints) - limit, 0)]:
            doomed = Path(path).with_name(f".{Path(path).name}.removed")
            os.rename(path, doomed)  # never a half-deleted checkpoint-N
            shutil.rmtree(doomed, ignore_errors=True)


class _CheckpointLoaded(Exception):
    pass


class _StopBeforeTheFirstStep(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        raise _CheckpointLoaded


__all__ = ["RunFolderArguments", "RunFolder", "RunInput", "RunFolderTrainerMixin", "complete_checkpoints",
           "training_settings",
           "read_record"]
