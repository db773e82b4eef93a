"""Warnings a user of FAT5's Trainer commands cannot act on, kept off the console: each one by its message and where
it comes from (never a whole category, logger or library), or by not doing what triggers it."""

import logging


class DeepSpeedFoundNoGpu(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    (deepspeed/accelerator/real_accelerator.py), which Trainer's set-up triggers on every run on a machine without
    CUDA once DeepSpeed is installed, whether the run uses DeepSpeed or not."""

    def filter(self, record):
        return not (record.module == "real_accelerator"
                    and record.getMessage().startswith("Setting accelerator to CPU"))


def quiet_trainer_run(training_args, given):
    """Before a Trainer is built: on a CPU, no pinned memory unless asked for (`given`: the flags the user gave), as
    torch only warns, once a data loader, that it has no accelerator to pin for; DeepSpeed's accelerator notice is
    hidden unless the run uses DeepSpeed (--deepspeed), whose users may want to know it found no GPU."""
    if training_args.device.type == "cpu" and "dataloader_pin_memory" not in given:
        training_args.dataloader_pin_memory = False
    deepspeed_logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed makes (deepspeed/utils/logging.py)
    for earlier in [each for each in deepspeed_logger.filters if isinstance(each, DeepSpeedFoundNoGpu)]:
        deepspeed_logger.removeFilter(earlier)
    if not training_args.deepspeed:
        deepspeed_logger.addFilter(DeepSpeedFoundNoGpu())
