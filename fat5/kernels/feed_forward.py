"""The feed-forward layer's elementwise middle as one op each way: act(h) * gate, then dropout (T5 v1.1's gated
GELU, gated SiLU), or act(h) then dropout (T5 v1.0's ReLU, ungated GELU).

Between its matmuls a T5 feed-forward spends its time in memory-bound elementwise work on [tokens, d_ff] tensors:
transformers' `gelu_new` alone is about 8 kernels forward and 10 backward, saving about 6 such tensors for the
backward. Here the forward reads h and gate once and writes the output once, and the backward reads them again and
recomputes the activation and its derivative instead of saving anything: autograd keeps only the op's two inputs
(and the output, which the next matmul keeps anyway). The dropout mask is never stored either: each element is kept
or dropped by a counter-based generator (Philox4x32, `tl.randint4x`, one call for 4 elements) keyed by a seed
tensor drawn from torch's generator, so the backward regenerates it, as the attention kernel does.

One op to torch on every device (`fat5::feed_forward_act` and its backward, custom ops), so dispatch, torch.compile,
FSDP/ZeRO-3 and activation checkpointing see one op each way. On CUDA it is the Triton kernel; elsewhere (and on
CUDA without triton) the same computation in torch (`reference`), which is also the tests' reference. The
activations are the functions transformers' names stand for (`ACTIVATIONS`); `gelu_new` is the tanh GELU, computed
in fp32 (one rounding to the inputs' dtype at the end).
"""

import math
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch computation below
    triton = None

from ..custom_ops_fat5 import custom_op

# transformers' activation names (ACT2FN) -> the function computed (gelu_new, gelu_fast and gelu_pytorch_tanh are one
# function, the tanh approximation of GELU, in different formulas).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "silu": "silu", "swish": "silu"}
KINDS = ("relu", "gelu", "gelu_tanh", "silu")
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TORCH_ACTIVATIONS = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
                      "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}
# Each element is dropped when its 32 random bits are below round(p * 2**32).
DROPOUT_BITS = 32
PHILOX_ROUNDS = 7  # as the attention kernel's generator (Salmon et al.'s BigCrush floor for Philox4x32)
BLOCK = 1024
# Tests set this to fill outputs with NaN before the kernels run, so an element left unwritten fails loudly.
POISON_OUTPUTS = False


def reference(hidden, gate, kind, keep=None, scale=1.0):
    """act(hidden) * gate (gate None: act(hidden)), times `keep * scale` when a keep mask is given; computed in
    fp32, returned in hidden's dtype. The torch body of the op, and the tests' reference."""
    x = hidden.float()
    y = _activation(x, kind)[0] if gate is None else _activation(x, kind)[0] * gate.float()
    if keep is not None:
        y = y * keep * scale
    return y.to(hidden.dtype)


def _activation(x, kind, derivative=False):
    """(act(x), act'(x) or None) in torch, x in fp32. Without the derivative, torch's own fused function (one op,
    where the formulas below take up to 8: on CPU the tanh GELU alone is 3-4x faster so, and as exact)."""
    if not derivative:
        return _TORCH_ACTIVATIONS[kind](x), None
    if kind == "relu":
        return x.clamp_min(0), ((x > 0).float() if derivative else None)
    if kind == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(x * math.sqrt(0.5)))
        return x * cdf, (cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if derivative else None)
    if kind == "gelu_tanh":
        t = torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        y = 0.5 * x * (1.0 + t)
        if not derivative:
            return y, None
        return y, 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    s = torch.sigmoid(x)  # silu
    return x * s, (s * (1.0 + x * (1.0 - s)) if derivative else None)


def _reference_backward(grad, hidden, gate, kind, keep, scale):
    x = hidden.float()
    act, derivative = _activation(x, kind, derivative=True)
    grad = grad.float() if keep is None else grad.float() * keep * scale
    if gate is None:
        return (grad * derivative).to(hidden.dtype), None
    return (grad * gate.float() * derivative).to(hidden.dtype), (grad * act).to(gate.dtype)


def _torch_keep(seed, shape, p, device):
    """The torch path's keep mask of a seed: the same mask every time the seed is given (the backward redraws it)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed[0]) ^ int(seed[1]))  # a host read: the torch path runs eagerly off the GPU
    return (torch.rand(shape, generator=generator, device=device) >= p).float()


if triton is not None:
    @triton.jit
    def _act(x, KIND: tl.constexpr):
        """act(x) and act'(x) in fp32 (tanh and the sigmoid from exp(-|.|), which cannot overflow: the same on every
        chip, no libdevice)."""
        if KIND == 0:  # relu
            return tl.maximum(x, 0.0), (x > 0).to(tl.float32)
        elif KIND == 1:  # gelu (erf)
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        elif KIND == 2:  # gelu_tanh
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            e = tl.exp(-2.0 * tl.abs(u))
            t = tl.where(u >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
            return (0.5 * x * (1.0 + t),
                    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x))
        else:  # silu
            e = tl.exp(-tl.abs(x))
            s = tl.where(x >= 0, 1.0, e) / (1.0 + e)
            return x * s, s * (1.0 + x * (1.0 - s))

    @triton.jit
    def _keep(SEED, pid, threshold, BLOCK: tl.constexpr):
        """Keep (1.0) or drop (0.0) of BLOCK elements from pid * BLOCK on: word j of Philox4x32-7 on counter
        (group, 0, 0, 0) keyed by the seed decides element 4 * group + j."""
        groups = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
        seed = tl.load(SEED) ^ tl.load(SEED + 1)
        r0, r1, r2, r3 = tl.randint4x(seed, groups, 7)
        words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK,))
        return (words.to(tl.uint32, bitcast=True) >= threshold).to(tl.float32)

    @triton.jit(do_not_specialize=["threshold"])
    def _forward_kernel(H, G, OUT, SEED, n, threshold, scale, KIND: tl.constexpr, GATED: tl.constexpr,
                        DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        y, _ = _act(tl.load(H + offsets, mask=inside, other=0.0).to(tl.float32), KIND)
        if GATED:
            y = y * tl.load(G + offsets, mask=inside, other=0.0).to(tl.float32)
        if DROPOUT:
            y = y * _keep(SEED, pid, threshold.to(tl.uint32), BLOCK) * scale
        tl.store(OUT + offsets, y.to(OUT.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["threshold"])
    def _backward_kernel(GRAD, H, G, DH, DG, SEED, n, threshold, scale, KIND: tl.constexpr, GATED: tl.constexpr,
                         DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        grad = tl.load(GRAD + offsets, mask=inside, other=0.0).to(tl.float32)
        if DROPOUT:
            grad = grad * _keep(SEED, pid, threshold.to(tl.uint32), BLOCK) * scale
        act, derivative = _act(tl.load(H + offsets, mask=inside, other=0.0).to(tl.float32), KIND)
        if GATED:
            gate = tl.load(G + offsets, mask=inside, other=0.0).to(tl.float32)
            tl.store(DG + offsets, (grad * act).to(DG.dtype.element_ty), mask=inside)
            grad = grad * gate
        tl.store(DH + offsets, (grad * derivative).to(DH.dtype.element_ty), mask=inside)


def _threshold(dropout_p):
    return min(round(dropout_p * 2**DROPOUT_BITS), 2**DROPOUT_BITS - 1)


def _launch(kernel, outputs, inputs, kind, gated, dropout_p, seed):
    n = inputs[1].numel()
    dropout = dropout_p > 0.0
    seed = seed if dropout else inputs[1].new_zeros(2, dtype=torch.int64)
    if POISON_OUTPUTS:
        for output in outputs:
            output.fill_(float("nan"))
    kernel[(triton.cdiv(n, BLOCK),)](*inputs, *outputs, seed, n, _threshold(dropout_p) if dropout else 0,
                                     1.0 / (1.0 - dropout_p), KIND=KINDS.index(kind), GATED=gated, DROPOUT=dropout,
                                     BLOCK=BLOCK)


def _forward(hidden: torch.Tensor, gate: Optional[torch.Tensor], kind: str, dropout_p: float,
             seed: Optional[torch.Tensor], kernel: bool) -> torch.Tensor:
    if not kernel:
        keep = _torch_keep(seed, hidden.shape, dropout_p, hidden.device) if dropout_p > 0.0 else None
        return reference(hidden, gate, kind, keep, 1.0 / (1.0 - dropout_p))
    out = torch.empty_like(hidden)
    _launch(_forward_kernel, (out,), (hidden, hidden if gate is None else gate), kind, gate is not None, dropout_p,
            seed)
    return out


_feed_forward_act = custom_op("fat5::feed_forward_act", _forward, mutates_args=())


@_feed_forward_act.register_fake
def _(hidden, gate, kind, dropout_p, seed, kernel):
    return torch.empty_like(hidden)


@custom_op("fat5::feed_forward_act_backward", mutates_args=())
def _feed_forward_act_backward(grad: torch.Tensor, hidden: torch.Tensor, gate: Optional[torch.Tensor], kind: str,
                               dropout_p: float, seed: Optional[torch.Tensor], kernel: bool
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    if not kernel:
        keep = _torch_keep(seed, hidden.shape, dropout_p, hidden.device) if dropout_p > 0.0 else None
        grad_hidden, grad_gate = _reference_backward(grad, hidden, gate, kind, keep, 1.0 / (1.0 - dropout_p))
        return grad_hidden, (grad_gate if gate is not None else hidden.new_empty(0))
    grad = grad if grad.is_contiguous() else grad.contiguous()  # a sum()'s gradient arrives expanded
    grad_hidden = torch.empty_like(hidden)
    grad_gate = torch.empty_like(gate) if gate is not None else hidden.new_empty(0)
    _launch(_backward_kernel, (grad_hidden, grad_gate if gate is not None else grad_hidden),
            (grad, hidden, hidden if gate is None else gate), kind, gate is not None, dropout_p, seed)
    return grad_hidden, grad_gate


@_feed_forward_act_backward.register_fake
def _(grad, hidden, gate, kind, dropout_p, seed, kernel):
    return torch.empty_like(hidden), (torch.empty_like(gate) if gate is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, gate, kind, dropout_p, seed, kernel = inputs
    ctx.save_for_backward(hidden, gate, seed)  # the seed, not the mask: the backward regenerates it
    ctx.options = (kind, dropout_p)
    ctx.kernel = kernel


def _backward(ctx, grad):
    hidden, gate, seed = ctx.saved_tensors
    grad_hidden, grad_gate = _feed_forward_act_backward(grad, hidden, gate, *ctx.options, seed, ctx.kernel)
    return grad_hidden, (grad_gate if gate is not None else None), None, None, None, None


_feed_forward_act.register_autograd(_backward, setup_context=_setup_context)


def feed_forward_act(hidden, gate=None, *, activation="gelu_new", dropout_p=0.0, dropout_seed=None, kernel=None):
    """act(hidden) * gate (or act(hidden) when gate is None), then dropout with probability `dropout_p` (scaled by
    1 / (1 - p) as `nn.functional.dropout` does): one op forward and one backward. `activation`: a transformers
    activation name of `ACTIVATIONS`. The mask is a function of `dropout_seed`, a (2,) int64 tensor on the inputs'
    device, drawn from torch's generator when None (so torch.manual_seed reproduces it and activation checkpointing
    redraws the same). `kernel`: run the Triton kernel (None: on CUDA where triton is installed; True elsewhere runs
    it in Triton's interpreter, as the tests do). Differentiable w.r.t. hidden and gate."""
    kind = ACTIVATIONS.get(activation)
    if kind is None:
        raise ValueError(f"feed_forward_act computes {sorted(ACTIVATIONS)}, not {activation!r}")
    if gate is not None and (gate.shape != hidden.shape or gate.dtype != hidden.dtype or gate.device != hidden.device):
        raise ValueError(f"gate must match hidden's shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
                         f"{gate.device} for {tuple(hidden.shape)} {hidden.dtype} {hidden.device}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        dropout_seed = None  # no draw: p = 0 leaves torch's generator where it was
    elif dropout_seed is None:
        dropout_seed = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=hidden.device)
    hidden = hidden if hidden.is_contiguous() else hidden.contiguous()
    gate = gate if gate is None or gate.is_contiguous() else gate.contiguous()
    if kernel and triton is None:
        raise ValueError("feed_forward_act(kernel=True) needs triton: pip install triton")
    # TorchScript tracing and its ONNX export record the torch body's plain ops (ONNX has no custom op).
    exporting = torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
    kernel = False if exporting else (triton is not None and hidden.is_cuda) if kernel is None else kernel
    # Where no gradient is asked for, run eagerly on plain tensors (inference: generation's decode steps), the body:
    # the custom op's own dispatch would cost as much as the body on a small batch. Under torch.compile or
    # torch.export, or on fake or meta tensors, the op.
    eager = exporting or not (
        torch.compiler.is_compiling() or hidden.is_meta or type(hidden) is not torch.Tensor
        or (torch.is_grad_enabled() and (hidden.requires_grad or (gate is not None and gate.requires_grad))))
    return (_forward if eager else _feed_forward_act)(hidden, gate, kind, dropout_p, dropout_seed, bool(kernel))


__all__ = ["ACTIVATIONS", "feed_forward_act", "reference"]
