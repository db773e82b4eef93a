"""A run never trains on, nor saves, non-finite values unless told to (--allow_non_finite): a starting model with a
NaN or infinite weight is refused naming the tensor, and a gradient, loss or weight that turns non-finite during
training stops the run before anything of it is saved (`NonFiniteStop`, a Trainer callback)."""

import math

import torch
from transformers import TrainerCallback

from fat5.cli import CommandError, TrainingDiverged

ALLOW = "--allow_non_finite"


def non_finite_weight(model):
    """(name, tensor) of the first floating-point parameter or buffer of `model` that holds a NaN or an infinity, or
    None. Each tensor is summed in fp32 (a NaN or an infinity makes the sum non-finite; finite weights cannot
    overflow it), so no mask the size of the tensor is made."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or tensor.device.type == "meta" or not tensor.numel():
                continue
            total = tensor.sum(dtype=torch.float32)
            total = total.full_tensor() if hasattr(total, "full_tensor") else total  # a sharded (FSDP2) weight
            if not torch.isfinite(total):
                return name, tensor
    return None


def describe_non_finite(name, tensor):
    with torch.no_grad():
        nan = int(torch.isnan(tensor).sum())
        inf = int(torch.isinf(tensor).sum())
    kinds = ", ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "infinite")) if count)
    return f"{name} holds {kinds or 'non-finite'} value{'s' if nan + inf > 1 else ''}"


def check_finite_weights(model, what, advice=f"pass {ALLOW} to use it anyway"):
    """Refuse, in one line naming the tensor, a model with a NaN or infinite weight. `what` names the model ("
    --model_name_or_path out/model")."""
    found = non_finite_weight(model)
    if found is not None:
        raise CommandError(f"{what}: {describe_non_finite(*found)}, so it computes nothing useful; {advice}")


def _finite(value):
    return not isinstance(value, (int, float)) or math.isfinite(value)


class NonFiniteStop(TrainerCallback):
    """Stops a run, with one `TrainingDiverged` line (exit status 1), as soon as it would train on or save non-finite
    values: the model holds one when training begins (a resumed checkpoint's too); a gradient is non-finite before
    the optimizer step (checked every step, so no such step is ever taken; not under --fp16, whose loss scaler skips
    those steps itself); a logged loss or gradient norm is; a weight is when a checkpoint or the final model is
    about to be saved. Nothing is saved after it: the run's last complete checkpoint is its last good one. Off with
    --allow_non_finite (`args.allow_non_finite`)."""

    def __init__(self, args):
        self.off = bool(getattr(args, "allow_non_finite", False))

    def stop(self, step, what):
        raise TrainingDiverged(f"training stopped at step {step}: {what}; nothing from this step on was saved (pass "
                               f"{ALLOW} to train on non-finite values)")

    def check_weights(self, model, step, when):
        found = None if self.off or model is None else non_finite_weight(model)
        if found is not None:
            self.stop(step, f"{describe_non_finite(*found)} {when}")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.check_weights(model, state.global_step, "when training begins")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.off or args.fp16 or model is None:
            return
        gradients = [param.grad for param in model.parameters() if param.grad is not None]
        if gradients:
            norm = torch.nn.utils.get_total_norm(gradients)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a sharded (FSDP2) norm
            if not torch.isfinite(norm):
                self.stop(state.global_step + 1, f"the gradient norm is {norm.item()}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.off or not logs:
            return
        for key in ("loss",) if args.fp16 else ("loss", "grad_norm"):
            if not _finite(logs.get(key)):
                self.stop(state.global_step, f"the logged {key} is {logs[key]}")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if control.should_save or (args.save_strategy == "best" and control.should_evaluate):
            self.check_weights(model, state.global_step, f"before checkpoint-{state.global_step} is saved")

    on_epoch_end = on_step_end

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.check_weights(model, state.global_step, "at the end of training")


__all__ = ["check_finite_weights", "non_finite_weight", "NonFiniteStop"]
