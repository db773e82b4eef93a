"""The residual add, its dropout and the next RMSNorm as one op each way: hidden = residual + dropout(update),
normed = T5's RMSNorm of hidden (T5LayerNorm's casting, as fat5/kernels/rms_norm.py).

Inside a T5 block each sub-layer ends with `hidden + dropout(output)` and the next one starts with its layer norm
of that sum: three memory-bound passes over [tokens, d_model] forward (more backward) that one kernel does in one.
The forward reads the residual and the update once and writes the new residual stream and its normed copy; the
backward takes both gradients (the stream's own, and the norm's) and gives the residual's, the update's and the
norm weight's. The dropout mask is never stored: each element is kept or dropped by Philox4x32-7 (`tl.randint`) on
its index, keyed by a seed tensor drawn from torch's generator, so the backward regenerates it. Autograd keeps the
new stream, the weight, each row's fp32 rstd and the seed.

One op to torch on every device (`fat5::residual_rms_norm` and its backward); on CUDA the Triton kernel, elsewhere
(and on CUDA without triton) the same computation in torch (`reference`), which is also the tests' reference.
"""

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch computation below
    triton = None

from ..custom_ops_fat5 import custom_op

DROPOUT_BITS = 32
# Tests set this to fill outputs with NaN before the kernels run, so an element left unwritten fails loudly.
POISON_OUTPUTS = False


def _norm_dtype(weight):
    return weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float32


def _torch_keep(seed, shape, p, device):
    """The torch path's keep mask of a seed (the backward redraws the same)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed[0]) ^ int(seed[1]))  # a host read: the torch path runs eagerly off the GPU
    return (torch.rand(shape, generator=generator, device=device) >= p).float()


def reference(residual, update, weight, eps, keep=None, scale=1.0):
    """(residual + update * keep * scale, T5's RMSNorm of it): the torch body of the op and the tests' reference.
    The sum is in the dtype torch promotes the two to (fp32 for an fp32 stream and a bf16 update under autocast),
    the dropped update too (nn.Dropout would round it to the update's dtype first: within that rounding)."""
    return _reference(residual, update, weight, eps, keep, scale)[:2]


def _reference(residual, update, weight, eps, keep, scale):
    """`reference` and each row's rstd (B, 1): t5_rms_norm's operations, its statistics kept."""
    dropped = update if keep is None else (update.float() * keep * scale).to(torch.promote_types(residual.dtype,
                                                                                                  update.dtype))
    hidden = residual + dropped
    rstd = torch.rsqrt(hidden.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    normed = hidden * rstd
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return hidden, weight * normed, rstd


if triton is not None:
    @triton.jit
    def _keep(SEED, offsets, threshold):
        seed = tl.load(SEED) ^ tl.load(SEED + 1)
        return (tl.randint(seed, offsets, 7).to(tl.uint32, bitcast=True) >= threshold).to(tl.float32)

    @triton.jit(do_not_specialize=["threshold"])
    def _forward_kernel(RESIDUAL, UPDATE, W, HIDDEN, NORMED, RSTD, SEED, n_cols, eps, threshold, scale,
                        HALF_WEIGHT: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        offsets = row * n_cols + cols
        update = tl.load(UPDATE + offsets, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            update = update * _keep(SEED, offsets, threshold.to(tl.uint32)) * scale
        # The sum rounded once to the stream's dtype, as torch's add.
        x = (tl.load(RESIDUAL + offsets, mask=mask, other=0.0).to(tl.float32) + update).to(HIDDEN.dtype.element_ty)
        tl.store(HIDDEN + offsets, x, mask=mask)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(RSTD + row, rstd)
        w = tl.load(W + cols, mask=mask, other=0.0)
        normed = x * rstd
        if HALF_WEIGHT:
            normed = normed.to(w.dtype).to(tl.float32)  # rounded to the weight's dtype, as T5 does
        tl.store(NORMED + offsets, (w.to(tl.float32) * normed).to(NORMED.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["threshold"])
    def _backward_kernel(D_HIDDEN, D_NORMED, HIDDEN, W, RSTD, SEED, D_RESIDUAL, D_UPDATE, DW_PARTIAL, n_rows, n_cols,
                         rows_per_program, threshold, scale, HAS_D_HIDDEN: tl.constexpr, HALF_WEIGHT: tl.constexpr,
                         DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first + i
            in_row = mask & (row + 0 * cols < n_rows)  # the last program's rows may run past the end
            offsets = row * n_cols + cols
            x = tl.load(HIDDEN + offsets, mask=in_row, other=0.0).to(tl.float32)
            dy = tl.load(D_NORMED + offsets, mask=in_row, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
            normed = x * rstd
            if HALF_WEIGHT:
                normed = normed.to(w.dtype).to(tl.float32)  # the value the weight multiplied
            dw += dy * normed
            dnormed = dy * w.to(tl.float32)
            dx = rstd * dnormed - x * (rstd * rstd * rstd) * (tl.sum(dnormed * x, axis=0) / n_cols)
            if HAS_D_HIDDEN:
                dx += tl.load(D_HIDDEN + offsets, mask=in_row, other=0.0).to(tl.float32)
            tl.store(D_RESIDUAL + offsets, dx.to(D_RESIDUAL.dtype.element_ty), mask=in_row)
            if DROPOUT:
                dx = dx * _keep(SEED, offsets, threshold.to(tl.uint32)) * scale
            tl.store(D_UPDATE + offsets, dx.to(D_UPDATE.dtype.element_ty), mask=in_row)
        tl.store(DW_PARTIAL + program * n_cols + cols, dw, mask=mask)


def _threshold(dropout_p):
    return min(round(dropout_p * 2**DROPOUT_BITS), 2**DROPOUT_BITS - 1) if dropout_p > 0.0 else 0


def _new(shape, dtype, device):
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _warps(cols):
    """Warps of a row's program: 4 up to d_model 1024 (8 elements a thread), more for wider rows (mT5-XXL's 4096)."""
    return min(max(triton.next_power_of_2(cols) // 256, 4), 16)


def _seed_pointer(seed, device):
    return seed if seed is not None else torch.zeros(2, dtype=torch.int64, device=device)


def _forward(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, dropout_p: float,
             seed: Optional[torch.Tensor], kernel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not kernel:
        keep = _torch_keep(seed, update.shape, dropout_p, update.device) if dropout_p > 0.0 else None
        hidden, normed, rstd = _reference(residual, update, weight, eps, keep, 1.0 / (1.0 - dropout_p))
        return hidden, normed, rstd.squeeze(-1)
    rows, cols = residual.shape
    hidden = _new((rows, cols), torch.promote_types(residual.dtype, update.dtype), residual.device)
    normed = _new((rows, cols), _norm_dtype(weight), residual.device)
    rstd = _new((rows,), torch.float32, residual.device)
    if rows:
        _forward_kernel[(rows,)](residual, update, weight, hidden, normed, rstd, _seed_pointer(seed, residual.device),
                                 cols, eps, _threshold(dropout_p), 1.0 / (1.0 - dropout_p),
                                 HALF_WEIGHT=weight.dtype in (torch.float16, torch.bfloat16),
                                 DROPOUT=dropout_p > 0.0, BLOCK=triton.next_power_of_2(cols),
                                 num_warps=_warps(cols))
    return hidden, normed, rstd


_residual_rms_norm = custom_op("fat5::residual_rms_norm", _forward, mutates_args=())


@_residual_rms_norm.register_fake
def _(residual, update, weight, eps, dropout_p, seed, kernel):
    dtype = torch.promote_types(residual.dtype, update.dtype)
    return (residual.new_empty(residual.shape, dtype=dtype), residual.new_empty(residual.shape,
                                                                                 dtype=_norm_dtype(weight)),
            residual.new_empty(residual.shape[:1], dtype=torch.float32))


@custom_op("fat5::residual_rms_norm_backward", mutates_args=())
def _residual_rms_norm_backward(grad_hidden: Optional[torch.Tensor], grad_normed: torch.Tensor, hidden: torch.Tensor,
                                weight: torch.Tensor, rstd: torch.Tensor, residual_dtype: torch.dtype,
                                update_dtype: torch.dtype, dropout_p: float, seed: Optional[torch.Tensor],
                                kernel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = 1.0 / (1.0 - dropout_p)
    if not kernel:
        grad_x, grad_weight = _norm_backward(grad_normed, hidden, weight, rstd)
        if grad_hidden is not None:
            grad_x = grad_x + grad_hidden.float()
        keep = _torch_keep(seed, hidden.shape, dropout_p, hidden.device) if dropout_p > 0.0 else None
        grad_update = grad_x.to(update_dtype, copy=True) if keep is None else (grad_x * keep * scale).to(update_dtype)
        return grad_x.to(residual_dtype), grad_update, grad_weight
    rows, cols = hidden.shape
    grad_normed = grad_normed.contiguous()
    grad_residual = _new((rows, cols), residual_dtype, hidden.device)
    grad_update = _new((rows, cols), update_dtype, hidden.device)
    programs = min(rows, 4 * torch.cuda.get_device_properties(hidden.device).multi_processor_count
                   if hidden.is_cuda else 4)
    if programs == 0:
        return grad_residual, grad_update, torch.zeros_like(weight)
    partial = _new((programs, cols), torch.float32, hidden.device)
    _backward_kernel[(programs,)](
        grad_hidden.contiguous() if grad_hidden is not None else grad_normed, grad_normed, hidden, weight, rstd,
        _seed_pointer(seed, hidden.device), grad_residual, grad_update, partial, rows, cols,
        triton.cdiv(rows, programs), _threshold(dropout_p), scale, HAS_D_HIDDEN=grad_hidden is not None,
        HALF_WEIGHT=weight.dtype in (torch.float16, torch.bfloat16), DROPOUT=dropout_p > 0.0,
        BLOCK=triton.next_power_of_2(cols), num_warps=_warps(cols))
    return grad_residual, grad_update, partial.sum(0).to(weight.dtype)


def _norm_backward(grad_normed, hidden, weight, rstd):
    """(d hidden, d weight) in fp32 of T5's RMSNorm, given each row's rstd: the kernel's arithmetic in torch."""
    x, dy = hidden.float(), grad_normed.float()
    normed = x * rstd[:, None]
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype).float()  # the value the weight multiplied
    dnormed = dy * weight.float()
    grad_x = rstd[:, None] * dnormed - x * rstd[:, None] ** 3 * (dnormed * x).mean(-1, keepdim=True)
    return grad_x, (dy * normed).sum(0).to(weight.dtype)


@_residual_rms_norm_backward.register_fake
def _(grad_hidden, grad_normed, hidden, weight, rstd, residual_dtype, update_dtype, dropout_p, seed, kernel):
    return (hidden.new_empty(hidden.shape, dtype=residual_dtype), hidden.new_empty(hidden.shape, dtype=update_dtype),
            torch.empty_like(weight))


def _setup_context(ctx, inputs, output):
    residual, update, weight, eps, dropout_p, seed, kernel = inputs
    hidden, _, rstd = output
    ctx.save_for_backward(hidden, weight, rstd, seed)  # the seed, not the mask: the backward regenerates it
    ctx.options = (residual.dtype, update.dtype, dropout_p)
    ctx.kernel = kernel


def _backward(ctx, grad_hidden, grad_normed, grad_rstd):
    hidden, weight, rstd, seed = ctx.saved_tensors
    if grad_normed is None:
        grad_normed = torch.zeros_like(hidden)
    grad_residual, grad_update, grad_weight = _residual_rms_norm_backward(grad_hidden, grad_normed, hidden, weight,
                                                                          rstd, *ctx.options, seed, ctx.kernel)
    return grad_residual, grad_update, grad_weight, None, None, None, None


_residual_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def residual_rms_norm(residual, update, weight, eps, *, dropout_p=0.0, dropout_seed=None, kernel=None):
    """(residual + dropout(update), T5's RMSNorm of that sum with `weight`): residual and update (..., D) of any
    float dtypes (the sum takes torch's promotion of the two), weight (D,). Dropout with probability `dropout_p`
    (scaled by 1 / (1 - p)); its mask is a function of `dropout_seed`, a (2,) int64 tensor on the inputs' device,
    drawn from torch's generator when None. `kernel`: the Triton kernel (None: on CUDA where triton is installed;
    True elsewhere runs it in Triton's interpreter, as the tests do). Differentiable w.r.t. residual, update and
    weight."""
    if residual.shape != update.shape or weight.shape != residual.shape[-1:]:
        raise ValueError(f"residual_rms_norm: residual and update must share a shape (..., D) and weight be (D,), got "
                         f"{tuple(residual.shape)}, {tuple(update.shape)}, {tuple(weight.shape)}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        dropout_seed = None  # no draw: p = 0 leaves torch's generator where it was
    elif dropout_seed is None:
        dropout_seed = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=residual.device)
    # TorchScript tracing and its ONNX export record the torch body's plain ops (ONNX has no custom op).
    exporting = torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
    kernel = False if exporting else (triton is not None and residual.is_cuda) if kernel is None else kernel
    shape = residual.shape
    # Where no gradient is asked for, run eagerly on plain tensors (inference), the body: the custom op's dispatch
    # would cost as much as the body on a small batch. Under torch.compile or torch.export, or on fake or meta
    # tensors, the op.
    eager = exporting or not (
        torch.compiler.is_compiling() or residual.is_meta or type(residual) is not torch.Tensor
        or (torch.is_grad_enabled() and (residual.requires_grad or update.requires_grad or weight.requires_grad)))
    hidden, normed, _ = (_forward if eager else _residual_rms_norm)(
        residual.reshape(-1, shape[-1]).contiguous(), update.reshape(-1, shape[-1]).contiguous(),
        weight.contiguous(), float(eps), dropout_p, dropout_seed, bool(kernel))
    return hidden.view(shape), normed.view(shape)


__all__ = ["reference", "residual_rms_norm"]
