"""`Trainer` plus the pretraining logs: real (non-padding) tokens per second and the padding fraction."""

import time

from transformers import Trainer


class ThroughputMeter:
    """Counts real and padded encoder + decoder positions of the batches seen since the last `pop`."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.real = self.total = 0
        self.start = time.perf_counter()

    def update(self, batch):
        if batch.get("attention_mask") is not None:
            self.real += int(batch["attention_mask"].sum())
            self.total += batch["attention_mask"].numel()
        if batch.get("labels") is not None:
            self.real += int((batch["labels"] != -100).sum())
            self.total += batch["labels"].numel()

    def pop(self):
        elapsed = time.perf_counter() - self.start
        stats = {"tokens_per_second": round(self.real / elapsed, 1) if elapsed > 0 else 0.0,
                 "padding_fraction": round(1.0 - self.real / self.total, 4) if self.total else 0.0}
        self.reset()
        return stats


class PretrainTrainer(Trainer):
    """Adds `tokens_per_second` (real tokens of this process, encoder plus decoder) and `padding_fraction` to every
    training log. Done here rather than in a TrainerCallback because callbacks never see the batches, and the
    collator runs in DataLoader workers when there are any."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.throughput = ThroughputMeter()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.throughput.update(inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            logs.update(self.throughput.pop())
        super().log(logs, *args, **kwargs)
