"""`Trainer` for pretraining: atomic checkpoints in a run folder, and the logs' real tokens per second and padding
fraction."""

import time

from transformers import Trainer, TrainerCallback

from .model_card import ModelCardTrainerMixin
from .packing import PaddingFractionLoggingMixin
from .run_folder import RunFolderTrainerMixin


def shard_examples(batches, workers, batch_size):
    """Examples each shard of the stream (one a DataLoader worker, or one in all) gives for `batches` batches: the
    DataLoader takes its batches from the workers in turn (worker w gives batches w, w + W, ...)."""
    return [max(0, (batches - w + workers - 1) // workers) * batch_size for w in range(workers)]


class TrainingClock(TrainerCallback):
    """Starts the trainer's first throughput interval when training begins (after Trainer's set-up: model
    placement, optimizer, a resumed checkpoint's states), not when the trainer was built."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.since = time.perf_counter()


class PretrainTrainer(ModelCardTrainerMixin, PaddingFractionLoggingMixin, RunFolderTrainerMixin, Trainer):
    """Adds to every training log `tokens_seen` (real encoder plus decoder tokens, padding excluded, this process
    has trained on since training began), `tokens_per_second` (those of the batches trained on since the previous
    log, over the wall time since it: the first interval starts when training begins, data loading always
    included) and `padding_fraction`, all from the one count of the batches the mixin keeps in the training loop
    (callbacks never see the batches, and the collator may run in DataLoader workers). Checkpoints are written as
    `RunFolderTrainerMixin` says, and record how many examples of each shard of the stream (one a DataLoader
    worker) the run has trained on: a resume skips exactly those (`stream_start`), whatever batch size or
    accumulation it continues with. Its pushes carry the run's model card (`ModelCardTrainerMixin`)."""

    def __init__(self, *args, stream_start=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.since = None  # set by TrainingClock when training begins
        self.tokens_seen = 0
        self.add_callback(TrainingClock(self))
        # (step, examples of each shard trained on at that step) where this process started reading the stream.
        self.stream_start = stream_start or (0, [0] * max(1, self.args.dataloader_num_workers))

    def examples_per_shard(self):
        """Examples of each shard trained on at the current step."""
        start_step, start = self.stream_start
        batches = (self.state.global_step - start_step) * self.args.gradient_accumulation_steps
        read = shard_examples(batches, len(start), self.args.per_device_train_batch_size)
        return [before + after for before, after in zip(start, read, strict=True)]

    def checkpoint_mark(self):
        # One process reads the whole stream; with several, accelerate shares its batches among them.
        return {"examples_per_shard": self.examples_per_shard()} if self.args.world_size == 1 else {}

    def log(self, logs, *args, **kwargs):
        tracker = getattr(self, "padding_tracker", None)
        if "loss" in logs and tracker is not None and self.since is not None:
            now = time.perf_counter()
            self.tokens_seen += tracker.real_tokens
            logs["tokens_seen"] = self.tokens_seen
            logs["tokens_per_second"] = round(tracker.real_tokens / max(now - self.since, 1e-9), 1)
            self.since = now
        super().log(logs, *args, **kwargs)  # the mixin adds padding_fraction and resets the count
