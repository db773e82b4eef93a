"""The feed-forward's fused middle (fat5/kernels/feed_forward.py): act(h) * gate and dropout as one op each way.

The Triton kernel (in the interpreter on CPU) and the torch body against fp64 autograd of torch's own activations,
every activation, gated or not, ragged sizes, outputs poisoned before the kernel writes them; dropout's mask kept
by its seed from the forward to the backward; and, in a model's training step, what the op saves: the op counts
and saved tensors of one feed-forward layer pinned (item 6 of issue 44), and no module left for transformers'
`kernelize` to replace.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import KERNEL_DEVICE, tiny_config
from fat5 import FAT5ForConditionalGeneration
from fat5.kernels import feed_forward
from fat5.kernels.feed_forward import ACTIVATIONS, feed_forward_act

TORCH_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                     "silu": F.silu}
# Relative to the largest value compared: the kernel computes in fp32 (fp16 rounds its inputs and output once).
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(feed_forward, "POISON_OUTPUTS", True)


def close(actual, expected, dtype):
    return (actual.double() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()


def expected_and_gradients(function, hidden, gate, grad):
    """function(hidden) * gate (or without gate) in fp64 by autograd: (output, d hidden, d gate)."""
    hidden = hidden.double().requires_grad_()
    gate = gate.double().requires_grad_() if gate is not None else None
    output = function(hidden) if gate is None else function(hidden) * gate
    output.backward(grad.double())
    return output.detach(), hidden.grad, (gate.grad if gate is not None else None)


# bf16 on a GPU only: the interpreter rounds bf16 its own way.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_forward_and_gradients_equal_fp64_autograd(activation, gated, dtype, kernel):
    if kernel and feed_forward.triton is None:
        pytest.skip("triton is not installed")
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("bf16 kernels are checked on a GPU")
    torch.manual_seed(0)
    shape = (3, 37, 53)  # 5,883 elements: several blocks, the last one ragged
    hidden = (torch.randn(shape) * 3).to(dtype)  # well into both tails of every activation
    gate = torch.randn(shape).to(dtype) if gated else None
    grad = torch.randn(shape).to(dtype)
    expected, d_hidden, d_gate = expected_and_gradients(TORCH_ACTIVATIONS[ACTIVATIONS[activation]], hidden, gate, grad)
    device = KERNEL_DEVICE if kernel else torch.device("cpu")
    hidden = hidden.to(device).requires_grad_()
    gate = gate.to(device).requires_grad_() if gated else None
    output = feed_forward_act(hidden, gate, activation=activation, kernel=kernel)
    output.backward(grad.to(device))
    assert output.dtype == dtype and close(output, expected, dtype)
    assert hidden.grad.dtype == dtype and close(hidden.grad, d_hidden, dtype)
    if gated:
        assert gate.grad.dtype == dtype and close(gate.grad, d_gate, dtype)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_dropout_keeps_one_mask_per_seed_from_forward_to_backward(kernel):
    """The mask is a function of the seed: the same seed drops the same elements in the forward and the backward
    (the gradients are those of the dropped output), another seed drops others, about p of them; kept values are
    scaled by 1 / (1 - p)."""
    if kernel and feed_forward.triton is None:
        pytest.skip("triton is not installed")
    device = KERNEL_DEVICE if kernel else torch.device("cpu")
    torch.manual_seed(0)
    p, shape = 0.25, (64, 129)
    hidden = torch.randn(shape, device=device, requires_grad=True)
    gate = torch.randn(shape, device=device, requires_grad=True)
    seed = torch.tensor([123456789, 42], device=device)
    output = feed_forward_act(hidden, gate, activation="gelu_new", dropout_p=p, dropout_seed=seed, kernel=kernel)
    keep = (output != 0).float()
    assert abs(keep.mean().item() - (1 - p)) < 0.02
    dense = F.gelu(hidden.detach(), approximate="tanh") * gate.detach()
    assert close(output.detach(), (dense * keep / (1 - p)).double(), torch.float32)
    output.backward(torch.ones_like(output))
    reference_hidden, reference_gate = hidden.detach().requires_grad_(), gate.detach().requires_grad_()
    (F.gelu(reference_hidden, approximate="tanh") * reference_gate * keep / (1 - p)).sum().backward()
    assert close(hidden.grad, reference_hidden.grad.double(), torch.float32)
    assert close(gate.grad, reference_gate.grad.double(), torch.float32)
    again = feed_forward_act(hidden, gate, activation="gelu_new", dropout_p=p, dropout_seed=seed, kernel=kernel)
    assert torch.equal(again != 0, output != 0)
    other = feed_forward_act(hidden, gate, activation="gelu_new", dropout_p=p, dropout_seed=seed + 1, kernel=kernel)
    assert not torch.equal(other != 0, output != 0)


def test_bad_arguments_are_refused_in_one_line():
    hidden = torch.randn(4, 8)
    with pytest.raises(ValueError, match="not 'quick_gelu'"):
        feed_forward_act(hidden, activation="quick_gelu")
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0"):
        feed_forward_act(hidden, dropout_p=1.0)
    with pytest.raises(ValueError, match="gate must match hidden's shape"):
        feed_forward_act(hidden, torch.randn(4, 9))


def test_p_zero_draws_no_seed():
    """No dropout leaves torch's generator where it was (eval and dropout_rate 0 reproduce transformers' streams)."""
    torch.manual_seed(5)
    feed_forward_act(torch.randn(4, 8), torch.randn(4, 8), dropout_p=0.0)
    drawn = torch.rand(3)
    torch.manual_seed(5)
    torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(drawn, torch.rand(3))


# -- in a model ----------------------------------------------------------------------------------------------------

D_FF = 56  # no other dimension of the model has this size
VIEWS = ("aten.view", "aten._unsafe_view", "aten.t.", "aten.transpose", "aten.expand", "aten.as_strided",
         "aten.alias", "aten.detach", "aten.permute", "aten.reshape", "aten.unsqueeze", "aten.squeeze",
         "aten.slice", "aten.select")


class DffOps(TorchDispatchMode):
    """Counts the ops (views aside) whose output is activation-shaped and ends in d_ff: [..tokens.., D_FF]."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens, self.ops = tokens, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        if not str(func).startswith(VIEWS) and any(_activation_shaped(t, self.tokens) for t in outputs):
            self.ops[str(func)] += 1
        return result


def _activation_shaped(tensor, tokens):
    return (isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == D_FF
            and tensor.numel() == tokens * D_FF)


def ffn_layers(model):
    return sum(1 for module in model.modules() if type(module).__name__ == "FAT5LayerFF")


@pytest.mark.parametrize("feed_forward_proj", ["gated-gelu", "relu"])
def test_a_training_step_touches_and_keeps_few_d_ff_wide_tensors_per_feed_forward_layer(feed_forward_proj):
    """A bf16-autocast training step of a small model with dropout: per feed-forward layer, the ops whose output is
    a [tokens, d_ff] tensor forward and backward (the matmuls in, the op, the matmul out's input gradient, the op's
    backward: 5 gated; 34 before the op, with transformers' `gelu_new` and the fp32 round trip to wo; issue 44 asks
    for at most 12), and the such tensors kept for the backward (the op's inputs and its output: 3 gated; 8 before)."""
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(tiny_config(d_ff=D_FF, dropout_rate=0.1, num_layers=2, num_decoder_layers=2,
                                                     feed_forward_proj=feed_forward_proj)).train()
    batch, length = 2, 7  # encoder and decoder alike
    tokens = batch * length
    ids = torch.randint(2, 100, (batch, length))
    saved = set()

    def pack(tensor):
        if _activation_shaped(tensor, tokens):
            saved.add((tensor.untyped_storage().data_ptr(), tensor.storage_offset()))
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), DffOps(tokens) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    layers = ffn_layers(model)
    gated = feed_forward_proj.startswith("gated-")
    assert sum(counter.ops.values()) <= (5 if gated else 4) * layers, counter.ops
    assert len(saved) <= (3 if gated else 2) * layers, len(saved)


@pytest.mark.parametrize("feed_forward_proj", ["gated-gelu", "gated-silu", "relu", "gelu", "gated-quick_gelu"])
def test_no_module_is_left_for_kernelize_to_replace(feed_forward_proj):
    """transformers 5.25 runs `kernelize` in every from_pretrained, replacing the forward of modules that carry a
    Hub-kernel layer name (its activation classes do): a FAT5 model has none, whatever its activation."""
    model = FAT5ForConditionalGeneration(tiny_config(feed_forward_proj=feed_forward_proj))
    assert [name for name, module in model.named_modules() if hasattr(module, "kernel_layer_name")] == []
