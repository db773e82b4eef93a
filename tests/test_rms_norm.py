"""The fused RMSNorm kernel against the fp64 torch reference (T5LayerNorm's math): outputs, input and weight
gradients, in every input/weight dtype pairing FAT5 meets (fp32 residual stream with half-precision weights).

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py); outputs are poisoned with NaN first.
"""

import pytest
import torch

from conftest import KERNEL_DEVICE
from fat5.kernels import rms_norm as kernel_module
from fat5.kernels.rms_norm import rms_norm
from fat5.modeling_fat5 import FAT5LayerNorm
from fat5.reference_fat5 import t5_rms_norm as rms_norm_reference

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
    x = (torch.randn(shape, generator=generator) * 3).to(KERNEL_DEVICE, input_dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=generator)).to(KERNEL_DEVICE, weight_dtype).requires_grad_()
    y = rms_norm(x, weight, EPS)
    expected_dtype = rms_norm_reference(x.detach(), weight.detach(), EPS).dtype
    assert y.dtype == expected_dtype and y.shape == x.shape
    grad_y = torch.randn(y.shape, generator=generator).to(KERNEL_DEVICE, y.dtype)
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
    norm = FAT5LayerNorm(40).to(KERNEL_DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(6, 3, 40, device=KERNEL_DEVICE).transpose(0, 1)  # rows not contiguous
    expected = rms_norm_reference(x, norm.weight, norm.variance_epsilon)
    close(rms_norm(x, norm.weight, norm.variance_epsilon), expected.double(), torch.float32, "kernel")
    close(norm(x), expected.double(), torch.float32, "module")


def test_op_compiles_in_one_graph():
    x = torch.randn(5, 16, device=KERNEL_DEVICE, requires_grad=True)
    weight = torch.ones(16, device=KERNEL_DEVICE, requires_grad=True)
    compiled = torch.compile(rms_norm, fullgraph=True, backend="aot_eager")
    compiled(x, weight, EPS).sum().backward()
    close(x.grad, torch.autograd.grad(rms_norm_reference(x, weight, EPS).sum(), x)[0].double(), torch.float32,
          "grad")


# -- the residual add, its dropout and the norm as one op (fat5/kernels/residual_rms_norm.py) ----------------------

@pytest.fixture
def poisoned_residual_outputs(monkeypatch):
    from fat5.kernels import residual_rms_norm as residual_module

    monkeypatch.setattr(residual_module, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("residual_dtype, update_dtype, weight_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.float32, torch.bfloat16, torch.float32),  # bf16 autocast: fp32 stream, bf16 sub-layer outputs
    (torch.float16, torch.float16, torch.float16),
    (torch.float32, torch.float16, torch.float16),  # FAT5 in fp16: fp32 stream, fp16 weights
    pytest.param(torch.bfloat16, torch.bfloat16, torch.bfloat16, marks=pytest.mark.gpu),  # interpreter's bf16 rounds
])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_residual_norm_equals_the_sum_then_the_norm_in_fp64(poisoned_residual_outputs, residual_dtype, update_dtype,
                                                             weight_dtype, dropout_p, kernel):
    """hidden = residual + dropout(update) and T5's norm of it, with every gradient (the stream's own and the
    norm's), against fp64 autograd of the same sum with the op's own mask (read back from a second call with the
    seed, which must drop the same elements), ragged rows (37 wide)."""
    from fat5.kernels.residual_rms_norm import residual_rms_norm

    if residual_dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("bf16 kernels are checked on a GPU")
    device = KERNEL_DEVICE if kernel else torch.device("cpu")
    generator = torch.Generator().manual_seed(1)
    shape = (3, 11, 37)
    residual = (torch.randn(shape, generator=generator) * 2).to(device, residual_dtype).requires_grad_()
    update = torch.randn(shape, generator=generator).to(device, update_dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(37, generator=generator)).to(device, weight_dtype).requires_grad_()
    seed = torch.tensor([11, 12], device=device)
    hidden, normed = residual_rms_norm(residual, update, weight, EPS, dropout_p=dropout_p, dropout_seed=seed,
                                       kernel=kernel)
    ones = torch.ones(shape, device=device, dtype=update_dtype)
    with torch.no_grad():  # the mask: what the same seed keeps of an update of ones
        kept = residual_rms_norm(torch.zeros_like(residual), ones, weight, EPS, dropout_p=dropout_p,
                                 dropout_seed=seed, kernel=kernel)[0] != 0
    if dropout_p:
        assert abs(kept.float().mean().item() - (1 - dropout_p)) < 0.05
    grad_hidden = torch.randn(shape, generator=generator).to(device, hidden.dtype)
    grad_normed = torch.randn(shape, generator=generator).to(device, normed.dtype)
    grads = torch.autograd.grad((hidden, normed), (residual, update, weight), (grad_hidden, grad_normed))

    r64, u64, w64 = (t.detach().double().requires_grad_() for t in (residual, update, weight))
    h64 = r64 + u64 * kept.double() / (1 - dropout_p)
    n64 = rms_norm_reference(h64, w64, EPS)
    expected = torch.autograd.grad((h64, n64), (r64, u64, w64), (grad_hidden.double(), grad_normed.double()))
    assert hidden.dtype == torch.promote_types(residual_dtype, update_dtype)
    assert normed.dtype == rms_norm_reference(hidden.detach(), weight.detach(), EPS).dtype
    close(hidden, h64, hidden.dtype, "hidden")
    close(normed, n64, normed.dtype, "normed")
    for name, actual, reference, dtype in zip(("residual", "update", "weight"), grads, expected,
                                              (residual_dtype, update_dtype, weight_dtype)):
        assert actual.dtype == dtype
        close(actual, reference, dtype, name)


def test_a_block_computes_what_its_sub_layers_compute(tiny_config):
    """FAT5Block's fused residual norms give what calling each sub-layer's own forward (sum, then norm) gives."""
    from fat5.modeling_fat5 import FAT5Block

    torch.manual_seed(0)
    block = FAT5Block(tiny_config(), is_decoder=True, has_relative_attention_bias=True, layer_idx=0).eval()
    hidden, encoder = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        fused = block(hidden, encoder_hidden_states=encoder)[0]
        table = block.layer[0].SelfAttention.relative_attention_bias.weight
        step = block.layer[0](hidden, None, None, None, table)[0]
        step = block.layer[1](step, encoder, None, None)[0]
        step = block.layer[2](step)
    assert (fused - step).abs().max() <= 1e-6 * step.abs().max()
