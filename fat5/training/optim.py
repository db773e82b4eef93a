"""AdamW whose step is scaled by each parameter's root-mean-square, as Adafactor scales its updates.

nanoT5 found this (with a cosine schedule) trains T5 from scratch better than Adafactor with inverse-square-root
decay (held-out C4 loss 1.953 vs 1.995 on T5-v1.1-base), and FAT5 pretrained with it. The scale makes one learning
rate fit matrices of any size: a step moves a parameter by about lr times its own typical magnitude.
"""

import torch


class AdamWScale(torch.optim.Optimizer):
    """AdamW (bias-corrected moments, decoupled weight decay) with the update multiplied by
    max(`min_scale`, RMS(parameter)). Parameters as `torch.optim.AdamW`; moments are kept in fp32."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, min_scale=1e-3):
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"AdamWScale needs lr > 0, eps > 0, weight_decay >= 0 and betas in [0, 1), got "
                             f"lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_scale=min_scale))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamWScale does not support sparse gradients")
                grad = param.grad.float()
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                update = (exp_avg / bias1) / ((exp_avg_sq / bias2).sqrt() + group["eps"])
                weight = param.float()
                scale = weight.pow(2).mean().sqrt().clamp(min=group["min_scale"])
                if group["weight_decay"]:
                    weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.add_(update * scale, alpha=-group["lr"])
                param.copy_(weight)
        return loss


__all__ = ["AdamWScale"]
