"""`Trainer` for pretraining: atomic checkpoints in a run folder, and the logs' real tokens per second and padding
fraction."""

import time

from transformers import Trainer

from .packing import PaddingFractionLoggingMixin
from .run_folder import RunFolderTrainerMixin


class PretrainTrainer(PaddingFractionLoggingMixin, RunFolderTrainerMixin, Trainer):
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
