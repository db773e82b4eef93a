"""T5's RMSNorm (T5LayerNorm) as one Triton kernel forward and one backward, with T5's casting.

T5: statistics in fp32, ``x * rsqrt(mean(x**2) + eps)`` in fp32, cast to the weight's dtype when the weight is
half precision, then times the weight. In FAT5 under fp16 the residual stream is fp32 (the FFN's `wo` stays in
fp32) while the norm weights are fp16, so input and weight dtypes differ: the output is then fp16, as in T5.
(liger-kernel's "llama" casting casts to the *input's* dtype, which is T5's only when both dtypes agree.)

The forward saves the fp32 rstd of each row; the backward recomputes the normalised row from it, accumulates the
weight gradient per program in fp32 and sums the programs' partials in torch.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # the model imports this module only for CUDA tensors with triton installed
    raise ImportError("FAT5's fused RMSNorm needs triton: pip install triton") from error

from ..custom_ops_fat5 import custom_op
from ..reference_fat5 import t5_rms_norm as rms_norm_reference

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tests set this to fill outputs with NaN before the kernels run, so an element left unwritten fails loudly.
POISON_OUTPUTS = False


@triton.jit
def _rms_norm_forward_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, HALF_WEIGHT: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0)
    normed = x * rstd
    if HALF_WEIGHT:
        # Rounded to the weight's dtype as T5 does; a product of two halves is exact in fp32, so rounding it
        # once when storing gives torch's half-precision product.
        normed = normed.to(w.dtype).to(tl.float32)
    y = w.to(tl.float32) * normed
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, n_cols,
                              rows_per_program, HALF_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        in_row = mask & (row + 0 * cols < n_rows)  # the last program's rows may run past the end
        x = tl.load(X + row * stride_x + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        normed = x * rstd
        if HALF_WEIGHT:
            normed = normed.to(w.dtype).to(tl.float32)  # the value the weight multiplied
        dw += dy * normed
        # The cast is the identity for gradients: d normed = dy * w, then through x * rstd(x).
        dnormed = dy * w.to(tl.float32)
        dx = rstd * dnormed - x * (rstd * rstd * rstd) * (tl.sum(dnormed * x, axis=0) / n_cols)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=in_row)
    tl.store(DW_PARTIAL + program * n_cols + cols, dw, mask=mask)


def _new_output(shape, dtype, device):
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _output_dtype(weight):
    return weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float32


def _num_programs(n_rows, device):
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)


@custom_op("fat5::rms_norm_forward", mutates_args=())
def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x.shape
    y = _new_output((n_rows, n_cols), _output_dtype(weight), x.device)
    rstd = _new_output((n_rows,), torch.float32, x.device)
    if n_rows:
        _rms_norm_forward_kernel[(n_rows,)](
            x, weight, y, rstd, x.stride(0), y.stride(0), n_cols, eps,
            HALF_WEIGHT=weight.dtype in (torch.float16, torch.bfloat16), BLOCK=triton.next_power_of_2(n_cols))
    return y, rstd


@_rms_norm_forward.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=_output_dtype(weight)), x.new_empty(x.shape[:1], dtype=torch.float32)


@custom_op("fat5::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x.shape
    grad_y = grad_y.contiguous()  # the gradient of a sum() arrives with stride 0
    grad_x = _new_output((n_rows, n_cols), x.dtype, x.device)
    programs = _num_programs(n_rows, x.device)
    if programs == 0:
        return grad_x, torch.zeros_like(weight)
    partial = _new_output((programs, n_cols), torch.float32, x.device)
    _rms_norm_backward_kernel[(programs,)](
        grad_y, x, weight, rstd, grad_x, partial, grad_y.stride(0), x.stride(0), grad_x.stride(0), n_rows, n_cols,
        triton.cdiv(n_rows, programs), HALF_WEIGHT=weight.dtype in (torch.float16, torch.bfloat16),
        BLOCK=triton.next_power_of_2(n_cols))
    return grad_x, partial.sum(0).to(weight.dtype)


@_rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_weight = _rms_norm_backward(grad_y, x, weight, rstd)
    return grad_x, grad_weight, None


_rms_norm_forward.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(hidden_states, weight, eps):
    """`rms_norm_reference` (T5LayerNorm) fused: hidden (..., D) in fp32/fp16/bf16, weight (D,).

    Output in the weight's dtype when it is half precision, else fp32. Differentiable w.r.t. both.
    """
    if hidden_states.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        return rms_norm_reference(hidden_states, weight, eps)
    if weight.shape != hidden_states.shape[-1:]:
        raise ValueError(f"rms_norm: weight must have shape ({hidden_states.shape[-1]},), got {tuple(weight.shape)}")
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    y, _ = _rms_norm_forward(x, weight.contiguous(), float(eps))
    return y.view(shape)
