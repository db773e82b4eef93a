"""An output folder that belongs to one training run: never mixed with another run, never written by two
processes, and resumable only from its own complete checkpoints.

How a command (pretraining, a recipe) uses it::

    from fat5.training.run_folder import OverwriteOutputDirArgument, RunFolder, RunFolderTrainerMixin

    @dataclass
    class MyTrainingArguments(Seq2SeqTrainingArguments, OverwriteOutputDirArgument):  # --overwrite_output_dir
        pass

    class MyTrainer(RunFolderTrainerMixin, Seq2SeqTrainer):  # atomic checkpoints, marked with the run's id
        pass

    def command(argv, progress):  # run by convert.cli.run(command, argv)
        ...parse, check inputs...
        run_folder = RunFolder(training_args.output_dir, training_args.resume_from_checkpoint,
                               overwrite=training_args.overwrite_output_dir, resume_flag="last")
        with run_folder.opened(training_args):  # lock, ownership check, clean-up; raises CommandError
            progress.describe = run_folder.describe  # Ctrl-C: "interrupted: OUT holds checkpoint-40, ..."
            trainer = MyTrainer(...)
            trainer.train(resume_from_checkpoint=run_folder.resume_checkpoint)
            trainer.save_model()
            run_folder.finished = True

What it guarantees:
- The folder records its run (`fat5_run.json`: a run id, the start time, the command). A folder that holds anything
  else (another run's results, any files) is refused with one line, unless the user resumes that run
  (`--resume_from_checkpoint latest`/`last`, or a checkpoint inside the folder) or passes --overwrite_output_dir,
  which empties it first.
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

Only the standard library and transformers are imported (`convert.cli` for its error class).
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
from dataclasses import dataclass, field
from pathlib import Path

from convert.cli import CommandError, raise_if_interrupted
from fat5.remote_code_fat5 import put_in_place, remove_stale_staging

RECORD_NAME = "fat5_run.json"
LOCK_NAME = ".fat5_run.lock"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# Hidden folders of checkpoints being written (.partial) or deleted (.removed); never read, cleaned at start-up.
CHECKPOINT_LEFTOVER = re.compile(r"\.checkpoint-\d+\.(partial|removed)(-old)?")
RESUME_LAST = ("latest", "last", "true", "True")
TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name, in every version


@dataclass
class OverwriteOutputDirArgument:
    """`--overwrite_output_dir` (transformers 5 removed it from TrainingArguments; 4.x has the same flag): mix into
    a TrainingArguments subclass, ``class Options(TrainingArguments, OverwriteOutputDirArgument)``."""

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "replace the results of another run in --output_dir (its checkpoints and model are deleted when "
                "this run starts); without it such a folder is refused"})


def read_record(folder):
    """The run record of a run folder or a checkpoint (a dict), or None when there is none or it is unreadable."""
    try:
        record = json.loads((Path(folder) / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_json_atomically(path, value):
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(temporary, path)


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
                 command=None):
        self.path = Path(output_dir)
        self.resume = resume_from_checkpoint
        self.overwrite = overwrite
        self.resume_flag = resume_flag
        self.command = list(sys.argv if command is None else command)
        self.run_id = None
        self.resume_checkpoint = None
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
        """Lock the folder, check that this run may use it, clean what interrupted saves left, record the run,
        and resolve the checkpoint to resume from (`self.resume_checkpoint`). Raises CommandError, leaving no
        folder behind when it created it."""
        if self.path.exists() and not self.path.is_dir():
            raise CommandError(f"--output_dir {self.path} exists and is not a folder")
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        try:
            self._claim()
        except BaseException:
            if created and not self._contents():  # (another run may have made the folder since)
                shutil.rmtree(self.path, ignore_errors=True)
            self.close()
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
            os.close(self._lock)
            self._lock = None

    def _contents(self):
        return [path for path in self.path.iterdir() if path.name not in (LOCK_NAME, RECORD_NAME)
                and not CHECKPOINT_LEFTOVER.fullmatch(path.name)]

    def _inside(self, checkpoint):
        return Path(checkpoint).resolve().parent == self.path.resolve()

    def _claim(self):
        record = read_record(self.path)
        resume_last = self.resume is True or self.resume in RESUME_LAST
        resume_here = resume_last or (bool(self.resume) and self._inside(self.resume))
        contents = self._contents()
        if self.overwrite and contents:
            self._empty()
        elif record is not None and resume_here:
            self.run_id = record.get("run")
        elif contents:
            raise CommandError(self._refusal(record, resume_here))
        if self.run_id is None:
            if resume_last:
                raise CommandError(f"--resume_from_checkpoint {self.resume}: {self.path} holds no checkpoint of a "
                                   f"run to continue")
            self.run_id = uuid.uuid4().hex
            _write_json_atomically(self.path / RECORD_NAME, {
                "run": self.run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": self.command})
        self._clean()
        self.resume_checkpoint = self._resolve_resume()

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

    def _empty(self):
        print(f"--overwrite_output_dir: deleting the previous contents of {self.path}")
        for path in self.path.iterdir():
            if path.name == LOCK_NAME:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

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
    `convert.cli`) stops the run at the next step."""

    def training_step(self, *args, **kwargs):
        raise_if_interrupted()
        return super().training_step(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        raise_if_interrupted()
        return super().prediction_step(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
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
        _write_json_atomically(staged / RECORD_NAME, {"run": record.get("run"), "step": self.state.global_step})
        old = put_in_place(staged, final)
        shutil.rmtree(staging_dir, ignore_errors=True)  # with the replaced checkpoint-N, if any
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._rotate_run_checkpoints(run_dir, record.get("run"), limit)

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


__all__ = ["OverwriteOutputDirArgument", "RunFolder", "RunFolderTrainerMixin", "complete_checkpoints",
           "read_record"]
