"""`Trainer` for pretraining: atomic checkpoints in a run folder, and the logs' real tokens per second and padding
fraction; and the mixin both pretraining and the recipes use for checkpoints that cannot be written."""

import time

from transformers import Trainer

from convert.safety import write_failures_reported

from .packing import PaddingFractionLoggingMixin
from .run_folder import RunFolderTrainerMixin


class CheckpointWriteFailuresMixin:
    """Mixin for a Trainer (before `RunFolderTrainerMixin`): a checkpoint that cannot be written (a full disk) ends
    the run with one line naming it, followed by what the output folder holds (convert/cli.py's `WriteFailed`),
    instead of torch's or safetensors' traceback. The checkpoint itself stays atomic: its staging folder is never
    resumed from, and the next run on the folder removes it."""

    def _save_checkpoint(self, model, trial):
        with write_failures_reported(f"checkpoint-{self.state.global_step}", self.args.output_dir):
            return super()._save_checkpoint(model, trial)


class PretrainTrainer(PaddingFractionLoggingMixin, CheckpointWriteFailuresMixin, RunFolderTrainerMixin, Trainer):
    """Adds `tokens_per_second` (real encoder plus decoder tokens of this process since the previous log) and
    `padding_fraction` to every training log, both from the one count of the batches the mixin keeps in the
    training loop (callbacks never see the batches, and the collator may run in DataLoader workers). Checkpoints
    are written as `RunFolderTrainerMixin` says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.since = time.perf_counter()

    def log(self, logs, *args, **kwargs):
        tracker = getattr(self, "padding_tracker", None)
        if "loss" in logs and tracker is not None:
            now = time.perf_counter()
            logs["tokens_per_second"] = round(tracker.real_tokens / max(now - self.since, 1e-9), 1)
            self.since = now
        super().log(logs, *args, **kwargs)  # the mixin adds padding_fraction and resets the count
