"""The guard: the Triton kernel where it cannot fail a run. "auto" falls back to SDPA, "triton" names the chip.

The first use of each (device, variant) in the process runs the kernel on a small input of that variant against SDPA
(`guarded_triton_attention_forward`); what fails or disagrees there, or fails later, runs on SDPA from then on.
"""

import contextlib
import io
import logging

import torch

from .attention_fat5 import PackedSegments, is_decode_step, sdpa_attention_forward, triton_attention_forward

logger = logging.getLogger(__name__)

# Device types whose kernels are checked and guarded: the GPUs (Triton's CPU interpreter is for tests, which add "cpu").
GUARDED_DEVICES = {"cuda"}
# (device, variant) -> why the kernel does not serve it: "auto" runs SDPA there for the rest of the process.
KERNEL_FALLBACKS = {}
# (device, variant) whose first use ran the kernel and matched SDPA.
KERNEL_CHECKED = set()
# |kernel - SDPA| <= tolerance * max |SDPA| on the first use's small input, output and every gradient. Far above
# rounding (half precision, TF32 for float32), far below what a miscompiled or misconfigured kernel gives.
CHECK_TOLERANCE = {torch.float32: 2e-2, torch.float16: 2e-2, torch.bfloat16: 6e-2}


class KernelError(RuntimeError):
    """The kernel cannot run (or gives wrong values) on this chip: what attention_backend='triton' raises."""


def chip_name(device):
    if device.type != "cuda":
        return f"{device.type} (Triton's interpreter)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def _kernel_failure(error):
    """The cause in one line if `error` is the kernel failing here (a Triton error: out of resources, compilation,
    ptxas, launch; or a dtype the chip lacks), else None: a mistake in the inputs is raised as it is."""
    names = [cls.__name__ for cls in type(error).__mro__]
    from_triton = any(cls.__module__.split(".")[0] == "triton" for cls in type(error).__mro__)
    if not (from_triton or "UnsupportedChip" in names or str(error).startswith("Triton Error")):
        return None
    # A compilation error's message starts with the source excerpt; what went wrong is its last line.
    text = (getattr(error, "error_message", None) or "") if "CompilationError" in names else str(error)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = (lines[-1] if "CompilationError" in names else lines[0]) if lines else ""
    return f"{type(error).__name__}: {line[:240]}" if line else type(error).__name__


def kernel_variant(query, key, value, *, segments=None, **kwargs):
    """What decides which kernels run and how they compile: (device, dtype, head dim, bias, causal, key mask,
    packed, dropout, backward, decode step: the decode kernel's)."""
    table = kwargs.get("bias_table") if kwargs.get("bias_lut") is None else kwargs["bias_lut"]
    bias = "t5" if table is not None else "alibi" if kwargs.get("alibi_slopes") is not None else "none"
    backward = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                            or bias == "t5" and table.requires_grad)
    return (query.device, query.dtype, query.shape[-1], bias, bool(kwargs.get("causal")),
            kwargs.get("key_padding_mask") is not None, segments is not None, kwargs.get("dropout_p", 0.0) > 0,
            backward, segments is None and is_decode_step(query, key, value, kwargs))


def _describe(variant):
    _, dtype, head_dim, bias, causal, _, packed, dropout, backward, decode = variant
    words = [str(dtype).removeprefix("torch."), f"head dim {head_dim}", {"t5": "T5 bias", "alibi": "ALiBi"}.get(
        bias, "no bias"), "causal" if causal else "", "packed" if packed else "", "dropout" if dropout else "",
        "forward and backward" if backward else "decode step" if decode else "forward"]
    return ", ".join(word for word in words if word)


def _check_inputs(query, key, *, segments=None, key_mask=None, **kwargs):
    """A small input of the same variant as this call on its device, drawn from a generator of its own (the user's
    random streams stay where they were): on CUDA long enough for T5's far tiles, short in the interpreter."""
    device, dtype = query.device, query.dtype
    heads, head_dim = query.shape[1], query.shape[-1]
    longest = 320 if device.type == "cuda" else 40
    query_length, key_length = min(query.shape[-2], longest), min(key.shape[-2], longest)
    generator = torch.Generator(device=device).manual_seed(0)

    def states(length):
        return (torch.randn(2, heads, length, head_dim, device=device, generator=generator)
                * head_dim**-0.25).to(dtype)

    options = dict(kwargs, q_offset=0)
    if kwargs["causal"] and query.shape[-2] < key.shape[-2]:
        options["q_offset"] = key_length - query_length  # a decoding step: the queries are the last positions
    if isinstance(kwargs["q_offset"], torch.Tensor):  # a static cache's counter: the decode kernel's own build
        options["q_offset"] = kwargs["q_offset"].new_full(kwargs["q_offset"].shape, options["q_offset"])
    for name in ("bias_table", "bias_lut"):  # the T5 table, or the kernel's lookup table made of it
        if kwargs.get(name) is not None:
            options[name] = kwargs[name].detach().clone()
    if kwargs.get("key_padding_mask") is not None:
        options["key_padding_mask"] = torch.ones(2, key_length, dtype=torch.bool, device=device)
        options["key_padding_mask"][1, key_length // 2:] = False
    if segments is not None:
        def ids(length):  # two examples in each row, padding at the end of the second row
            row = torch.arange(length, device=device) * 2 // length + 1
            return torch.stack([row, row.masked_fill(torch.arange(length, device=device) >= length - 3, 0)])

        options["segments"] = PackedSegments(ids(query_length), ids(key_length))
    gradient = torch.randn(2, heads, query_length, head_dim, device=device, generator=generator)
    return (states(query_length), states(key_length), states(key_length)), gradient, options


def _check_against_sdpa(query, key, backward, kwargs):
    """None when the kernel gives SDPA's output (and gradients, for a variant with a backward) on a small input of
    the variant, else what differs. With dropout, the kernel without dropout is compared, and the kernel with it
    only run (with a fixed seed: its mask is its own)."""
    states, gradient, options = _check_inputs(query, key, **kwargs)
    table_name = next((name for name in ("bias_table", "bias_lut") if options.get(name) is not None), None)
    leaves = [*states] + ([options.pop(table_name)] if table_name else [])

    def run(function, float32=False, **overrides):
        inputs = [(leaf.float() if float32 else leaf).detach().requires_grad_(backward) for leaf in leaves]
        table = {table_name: inputs[3]} if len(inputs) > 3 else {}
        with torch.enable_grad() if backward else contextlib.nullcontext():
            output, _ = function(*inputs[:3], **{**options, **table, **overrides})
            if not backward:
                return [output]
            return [output, *torch.autograd.grad(output, inputs, gradient.to(output.dtype))]

    ours = run(triton_attention_forward, dropout_p=0.0)
    expected = run(sdpa_attention_forward, float32=True, dropout_p=0.0)
    for name, actual, reference in zip(("output", "dq", "dk", "dv", "d bias table"), ours, expected):
        error = (actual.float() - reference).abs().max().item()
        scale = reference.abs().max().item()
        if not error <= CHECK_TOLERANCE[query.dtype] * scale:  # NaN fails too
            return f"its {name} differs from SDPA's by {error:.3g} (max |SDPA| {scale:.3g}) on a small input"
    if options["dropout_p"]:
        run(triton_attention_forward, dropout_seed=torch.zeros(2, dtype=torch.int64, device=query.device))
    return None


def guarded_triton_attention_forward(query, key, value, *, fallback=True, **kwargs):
    """`triton_attention_forward` where it cannot fail a run. The first use of each (device, variant) in the
    process runs the kernel on a small input of that variant against SDPA (forward, and backward when this call
    will need it); a Triton failure (out of resources, compilation, ptxas, launch, a dtype the chip lacks), there
    or in a later forward, or a disagreement sends that variant to SDPA with one warning naming the chip and the
    cause (`fallback`: the "auto" backend), or raises KernelError naming them ("triton"). Nothing is checked while
    torch.compile traces or a CUDA graph captures: an eager first step checks."""
    if query.device.type not in GUARDED_DEVICES:
        return triton_attention_forward(query, key, value, **kwargs)
    if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
        fallen = KERNEL_FALLBACKS and kernel_variant(query, key, value, **kwargs) in KERNEL_FALLBACKS
        return (sdpa_attention_forward if fallen else triton_attention_forward)(query, key, value, **kwargs)
    variant = kernel_variant(query, key, value, **kwargs)
    if variant not in KERNEL_FALLBACKS:
        error = None
        try:
            if variant in KERNEL_CHECKED:
                return triton_attention_forward(query, key, value, **kwargs)
            with contextlib.redirect_stdout(io.StringIO()):  # triton prints a failing build's whole PTX
                cause = _check_against_sdpa(query, key, variant[-2], kwargs)
            if cause is None:
                KERNEL_CHECKED.add(variant)
                return triton_attention_forward(query, key, value, **kwargs)
        except Exception as failure:  # noqa: BLE001 (only the kernel's failures are caught: _kernel_failure)
            cause = _kernel_failure(failure)
            if cause is None:
                raise
            error = failure
        chip = chip_name(query.device)
        if not fallback:
            raise KernelError(f"FAT5's Triton attention kernel cannot run {_describe(variant)} on {chip}: {cause} "
                              "(attention_backend='auto' runs SDPA there instead)") from error
        KERNEL_FALLBACKS[variant] = cause
        logger.warning("FAT5's Triton attention kernel cannot run %s on %s (%s): that attention runs on SDPA",
                       _describe(variant), chip, cause)
    return sdpa_attention_forward(query, key, value, **kwargs)
