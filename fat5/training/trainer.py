"""`Trainer` plus the pretraining logs: real (non-padding) tokens per second and the padding fraction."""

import time

from transformers import Trainer

from .packing import PaddingFractionLoggingMixin


class PretrainTrainer(PaddingFractionLoggingMixin, Trainer):
    """Adds `tokens_per_second` (real encoder plus decoder tokens of this process since the previous log) and
    `padding_fraction` (from the mixin) to every training log. Counted in the training loop rather than in a
    TrainerCallback, since callbacks never see the batches (and the collator may run in DataLoader workers)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.real_tokens = 0
        self.since = time.perf_counter()

    def training_step(self, model, inputs, *args, **kwargs):
        for name in ("attention_mask", "decoder_attention_mask"):
            if inputs.get(name) is not None:
                self.real_tokens += int(inputs[name].sum())
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            now = time.perf_counter()
            logs["tokens_per_second"] = round(self.real_tokens / max(now - self.since, 1e-9), 1)
            self.real_tokens, self.since = 0, now
        super().log(logs, *args, **kwargs)
