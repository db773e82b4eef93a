"""The kernel never loses a run: a chip it cannot serve sends that attention to SDPA ("auto") or names itself
("triton"), and the first use of each variant is checked against SDPA.

The failures are simulated on CPU, where the kernels run in Triton's interpreter: a kernel launch that raises what
Triton raises on a GPU (OutOfResources for shared memory, a CompilationError), or a kernel that returns wrong
values. `GUARDED_DEVICES` gains "cpu" here (on a GPU machine the guard already covers CUDA).
"""

import logging

import pytest
import torch

pytest.importorskip("triton")
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from fat5 import attention_guard_fat5 as guard  # noqa: E402
from fat5.attention_fat5 import sdpa_attention_forward  # noqa: E402
from fat5.attention_guard_fat5 import KernelError, guarded_triton_attention_forward  # noqa: E402
from fat5.kernels import flash_attention_t5 as kernel_module  # noqa: E402

CHIP = "cpu (Triton's interpreter)"


@pytest.fixture(autouse=True)
def guarded_cpu(monkeypatch):
    """A fresh process's state: nothing checked, nothing fallen back, the interpreter's CPU guarded."""
    monkeypatch.setattr(guard, "GUARDED_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(guard, "KERNEL_FALLBACKS", {})
    monkeypatch.setattr(guard, "KERNEL_CHECKED", set())


class _Launch:
    """Stands in for a jitted kernel: `kernel[grid](...)` raises `error` (or runs the real kernel when None), and
    counts its launches."""

    def __init__(self, real, error=None):
        self.real, self.error, self.launches = real, error, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            if self.error is not None:
                raise self.error
            return self.real[grid](*args, **kwargs)
        return launch


def attention_inputs(requires_grad=False, causal=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 21, 32, generator=generator).requires_grad_(requires_grad) for _ in range(3))
    table = torch.randn(8, 2, generator=generator).requires_grad_(requires_grad)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, 15:] = False
    options = dict(bias_table=table, bidirectional=not causal, num_buckets=8, max_distance=12, alibi_slopes=None,
                   position_bias=None, key_padding_mask=mask, causal=causal, q_offset=0, scale=1.0, dropout_p=0.0)
    return (q, k, v), options


def sdpa_result(states, options, backward=False):
    leaves = [t.detach().clone().requires_grad_(backward) for t in (*states, options["bias_table"])]
    output, _ = sdpa_attention_forward(*leaves[:3], **{**options, "bias_table": leaves[3]})
    if backward:
        output.sum().backward()
    return output, leaves


def warnings_of(caplog):
    return [record.getMessage() for record in caplog.records if record.name == "fat5.attention_guard_fat5"]


def test_out_of_shared_memory_falls_back_to_sdpa_with_one_warning(monkeypatch, caplog):
    """What an A10 gave at d = 128 before per-chip tiles: the launch needs more shared memory than the chip has."""
    launch = _Launch(kernel_module._forward_kernel, OutOfResources(106624, 101376, "shared memory"))
    monkeypatch.setattr(kernel_module, "_forward_kernel", launch)
    states, options = attention_inputs()
    expected, _ = sdpa_result(states, options)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            output, _ = guarded_triton_attention_forward(*states, fallback=True, **options)
            assert torch.equal(output, expected)
    (warning,) = warnings_of(caplog)
    assert "\n" not in warning and CHIP in warning
    assert "OutOfResources: out of resource: shared memory, Required: 106624, Hardware limit: 101376" in warning
    assert "SDPA" in warning and "float32, head dim 32, T5 bias" in warning
    assert launch.launches == 1  # the variant is known from then on: the kernel is not tried again
    # Another variant (causal) is tried on its own.
    _, causal = attention_inputs(causal=True)
    with caplog.at_level(logging.WARNING):
        guarded_triton_attention_forward(*states, fallback=True, **causal)
    assert launch.launches == 2 and len(warnings_of(caplog)) == 2


def test_forced_triton_raises_the_failure_naming_the_chip(monkeypatch, caplog):
    monkeypatch.setattr(kernel_module, "_forward_kernel",
                        _Launch(None, OutOfResources(106624, 101376, "shared memory")))
    states, options = attention_inputs()
    with pytest.raises(KernelError, match=r"cannot run float32, head dim 32, T5 bias, forward on cpu \(Triton's "
                                          r"interpreter\): OutOfResources: out of resource: shared memory") as raised:
        guarded_triton_attention_forward(*states, fallback=False, **options)
    assert isinstance(raised.value.__cause__, OutOfResources)
    assert not warnings_of(caplog) and not guard.KERNEL_FALLBACKS


def test_a_backward_that_cannot_compile_falls_back_before_the_step(monkeypatch, caplog):
    """The first use in training runs the backward too, so a dQ kernel that cannot build (the A10's d = 128 dQ)
    is found in the forward, where SDPA can still take over: the step's gradients are SDPA's."""
    failure = CompilationError("def _backward_dq_kernel(...):", None, "out of registers (simulated)")
    dq = _Launch(kernel_module._backward_dq_kernel, failure)
    monkeypatch.setattr(kernel_module, "_backward_dq_kernel", dq)
    states, options = attention_inputs(requires_grad=True)
    leaves = [t.detach().clone().requires_grad_() for t in (*states, options["bias_table"])]
    with caplog.at_level(logging.WARNING):
        output, _ = guarded_triton_attention_forward(*leaves[:3], fallback=True,
                                                     **{**options, "bias_table": leaves[3]})
    output.sum().backward()
    expected, reference = sdpa_result(states, options, backward=True)
    assert torch.equal(output, expected)
    for leaf, ref in zip(leaves, reference):
        assert torch.allclose(leaf.grad, ref.grad, rtol=1e-5, atol=1e-5 * ref.grad.abs().max().item())
    (warning,) = warnings_of(caplog)
    assert "CompilationError: out of registers (simulated)" in warning and "forward and backward" in warning
    # Inference needs no backward: that variant still runs the kernel, checked against SDPA.
    with torch.no_grad():
        output, _ = guarded_triton_attention_forward(*states, fallback=True, **options)
    assert len(warnings_of(caplog)) == 1 and dq.launches == 1
    assert torch.allclose(output, sdpa_result(states, options)[0], atol=1e-4)


def test_a_kernel_that_disagrees_with_sdpa_on_first_use_falls_back(monkeypatch, caplog):
    kernel = kernel_module.flash_attention_t5
    monkeypatch.setattr(kernel_module, "flash_attention_t5", lambda *args, **kwargs: 1.5 * kernel(*args, **kwargs))
    states, options = attention_inputs()
    with caplog.at_level(logging.WARNING):
        output, _ = guarded_triton_attention_forward(*states, fallback=True, **options)
    assert torch.equal(output, sdpa_result(states, options)[0])
    (warning,) = warnings_of(caplog)
    assert CHIP in warning and "its output differs from SDPA's by" in warning
    guard.KERNEL_FALLBACKS.clear()
    with pytest.raises(KernelError, match="its output differs from SDPA's"):
        guarded_triton_attention_forward(*states, fallback=False, **options)


def test_a_checked_variant_runs_the_kernel_and_a_later_launch_failure_still_falls_back(monkeypatch, caplog):
    states, options = attention_inputs()
    output, _ = guarded_triton_attention_forward(*states, fallback=True, **options)
    assert torch.allclose(output, sdpa_result(states, options)[0], atol=1e-4)
    assert len(guard.KERNEL_CHECKED) == 1 and not warnings_of(caplog)
    # The same variant at another shape fails at launch (another specialisation): SDPA takes over from there.
    monkeypatch.setattr(kernel_module, "_forward_kernel", _Launch(None, RuntimeError("Triton Error [CUDA]: invalid "
                                                                                     "argument")))
    with caplog.at_level(logging.WARNING):
        output, _ = guarded_triton_attention_forward(*states, fallback=True, **options)
    assert torch.equal(output, sdpa_result(states, options)[0])
    assert "RuntimeError: Triton Error [CUDA]: invalid argument" in warnings_of(caplog)[0]


def test_mistakes_in_the_inputs_are_raised_not_hidden(monkeypatch):
    """Only the kernel's own failures fall back: a wrong input raises as it would without the guard."""
    states, options = attention_inputs()
    with pytest.raises(ValueError, match=r"key_mask must be .* got \(2, 133\)"):
        guarded_triton_attention_forward(*states, fallback=True,
                                         **{**options, "key_padding_mask": torch.ones(2, 5, dtype=torch.bool)})
    assert not guard.KERNEL_FALLBACKS


def test_a_chip_without_bf16_is_a_kernel_failure_in_one_line():
    error = kernel_module.UnsupportedChip("Tesla T4 (sm_75) has no bfloat16: the kernel takes float16 or float32 "
                                          "there")
    assert guard._kernel_failure(error) == (
        "UnsupportedChip: Tesla T4 (sm_75) has no bfloat16: the kernel takes float16 or float32 there")
    assert guard._kernel_failure(ValueError("flash_attention_t5 supports head dims")) is None
    assert guard._kernel_failure(CompilationError("src", None, "bad layout")) == \
        "CompilationError: bad layout"


def test_the_check_leaves_the_users_random_streams_alone():
    states, options = attention_inputs()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    guarded_triton_attention_forward(*states, fallback=True, **{**options, "dropout_p": 0.0})
    assert torch.equal(torch.rand(3), expected)


def test_torch_compile_traces_the_guarded_kernel_in_one_graph(monkeypatch):
    """While torch.compile traces, nothing is checked (a first eager step does): the kernel's op is traced as it
    is, or SDPA for a variant known to fail."""
    states, options = attention_inputs()

    def attention(q, k, v):
        return guarded_triton_attention_forward(q, k, v, fallback=True, **options)[0]

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(*states), sdpa_result(states, options)[0], atol=1e-4)
    assert not guard.KERNEL_CHECKED
    monkeypatch.setattr(kernel_module, "_forward_kernel", _Launch(None, OutOfResources(1, 0, "shared memory")))
    guarded_triton_attention_forward(*states, fallback=True, **options)  # an eager step: falls back
    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*states), sdpa_result(states, options)[0])


def test_a_decode_step_is_a_variant_of_its_own(monkeypatch, caplog):
    """Generation's decode steps run the decode kernel (fat5/kernels/decode_attention_t5.py): its failure on the chip
    sends the decode steps to SDPA, named as such, while the training kernel keeps the longer forwards."""
    from fat5.kernels import decode_attention_t5 as decode_module

    chunk = _Launch(decode_module._decode_chunk_kernel, OutOfResources(262144, 232448, "shared memory"))
    monkeypatch.setattr(decode_module, "_decode_chunk_kernel", chunk)
    forward = _Launch(kernel_module._forward_kernel)
    monkeypatch.setattr(kernel_module, "_forward_kernel", forward)
    (q, k, v), options = attention_inputs(causal=True)
    step = dict(options, q_offset=torch.tensor([20]))  # the last position, as a static cache gives it
    expected, _ = sdpa_attention_forward(q[:, :, -1:], k, v, **step)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for _ in range(2):
            output, _ = guarded_triton_attention_forward(q[:, :, -1:], k, v, fallback=True, **step)
            assert torch.equal(output, expected)
        (warning,) = warnings_of(caplog)
        assert f"float32, head dim 32, T5 bias, causal, decode step on {CHIP}" in warning
        assert "OutOfResources" in warning
        assert chunk.launches == 1
        full, _ = guarded_triton_attention_forward(q, k, v, fallback=True, **options)
    assert forward.launches >= 2 and len(warnings_of(caplog)) == 1  # checked, then run: the kernel's own output
    torch.testing.assert_close(full, sdpa_result((q, k, v), options)[0])


def test_a_model_whose_kernel_falls_back_computes_sdpas_values_from_the_shared_inputs(monkeypatch, caplog):
    """In a model the layers hand the guarded kernel the stack's shared inputs (the T5 table's lookup table, the
    additive key mask): where the kernel fails, SDPA computes from them what the SDPA backend computes, the tables'
    gradients included."""
    from conftest import tiny_config
    from fat5 import attention_select_fat5
    from fat5.modeling_fat5 import FAT5ForConditionalGeneration

    monkeypatch.setattr(kernel_module, "_forward_kernel", _Launch(None, OutOfResources(106624, 101376, "shared")))
    monkeypatch.setattr(attention_select_fat5, "select_attention_backend",  # "auto" as on CUDA
                        lambda config, *args: "triton" if config.attention_backend == "auto" else "sdpa")
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(tiny_config(d_kv=32, num_heads=2, attention_backend="auto")).train()
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, 15:] = 0
    batch = dict(input_ids=torch.randint(2, 101, (2, 21)), attention_mask=mask, labels=torch.randint(2, 101, (2, 9)))
    results = []
    for backend in ("auto", "sdpa"):
        model.config.attention_backend = backend
        model.zero_grad()
        with caplog.at_level(logging.WARNING):
            loss = model(**batch).loss
        loss.backward()
        results.append((loss, [p.grad.clone() for name, p in model.named_parameters() if "relative" in name]))
    assert warnings_of(caplog) and all("SDPA" in warning for warning in warnings_of(caplog))
    (loss, grads), (expected, expected_grads) = results
    torch.testing.assert_close(loss, expected)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference)
