"""The fused RMSNorm kernel against the fp64 torch reference (T5LayerNorm's math): outputs, input and weight
gradients, in every input/weight dtype pairing FAT5 meets (fp32 residual stream with half-precision weights).

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py); outputs are poisoned with NaN first.
"""

import pytest
import torch

from fat5.kernels import rms_norm as kernel_module
from fat5.kernels.rms_norm import rms_norm
from fat5.modeling_fat5 import FAT5LayerNorm
from fat5.reference_fat5 import t5_rms_norm as rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON_OUTPUTS", True)


def close(actual, expected, dtype, name):
    """Within two units of the compared dtype's rounding, relative to the largest reference magnitude."""
    tolerance = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    error = (actual.double() - expected).abs().max().item()
    assert error <= tolerance * expected.abs().max().item(), (name, error)


@pytest.mark.parametrize("input_dtype, weight_dtype", [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),  # FAT5 in fp16: fp32 residual, fp16 norm weights
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32),
])
@pytest.mark.parametrize("shape", [(3, 7, 37), (1, 64), (130, 24)])
def test_outputs_and_gradients_match_fp64_reference(input_dtype, weight_dtype, shape):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 3).to(DEVICE, input_dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=generator)).to(DEVICE, weight_dtype).requires_grad_()
    y = rms_norm(x, weight, EPS)
    expected_dtype = rms_norm_reference(x.detach(), weight.detach(), EPS).dtype
    assert y.dtype == expected_dtype and y.shape == x.shape
    grad_y = torch.randn(y.shape, generator=generator).to(DEVICE, y.dtype)
    grad_x, grad_weight = torch.autograd.grad(y, (x, weight), grad_y)

    x64 = x.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    # fp64 reference that rounds where T5 rounds: the normalised input to a half-precision weight's dtype.
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    if weight_dtype != torch.float32:
        normed = normed + (normed.detach().to(weight_dtype).double() - normed.detach())
    y64 = weight64 * normed
    grad_x64, grad_weight64 = torch.autograd.grad(y64, (x64, weight64), grad_y.double())
    close(y, y64, y.dtype, "output")
    close(grad_x, grad_x64, min(input_dtype, y.dtype, key=lambda d: torch.finfo(d).bits), "input grad")
    close(grad_weight, grad_weight64, weight_dtype, "weight grad")


def test_module_matches_kernel_and_reference_on_non_contiguous_input():
    norm = FAT5LayerNorm(40).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(6, 3, 40, device=DEVICE).transpose(0, 1)  # rows not contiguous
    expected = rms_norm_reference(x, norm.weight, norm.variance_epsilon)
    close(rms_norm(x, norm.weight, norm.variance_epsilon), expected.double(), torch.float32, "kernel")
    close(norm(x), expected.double(), torch.float32, "module")


def test_op_compiles_in_one_graph():
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    weight = torch.ones(16, device=DEVICE, requires_grad=True)
    compiled = torch.compile(rms_norm, fullgraph=True, backend="aot_eager")
    compiled(x, weight, EPS).sum().backward()
    close(x.grad, torch.autograd.grad(rms_norm_reference(x, weight, EPS).sum(), x)[0].double(), torch.float32,
          "grad")
