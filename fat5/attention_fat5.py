"""The attention seam of FAT5: everything between a layer's q, k, v and the attention's output.

A layer hands q, k, v, the stack's `PositionInputs` and its bias table to the function `attention_function` picks
(the configured backend, or for "auto" the fastest that is exact here) and gets `(output, weights)` back, weights
None unless output_attentions asks for them. Backends: "eager" (the plain-torch reference of `reference_fat5`,
the only one that gives weights), "sdpa" (torch's scaled_dot_product_attention) and "triton" (the flash-attention
kernel of `kernels/flash_attention_t5.py`, padded or packed; this is the only model module that imports it).

Every backend receives q, k, v and the *small* position-encoding parameters (the T5 bucket table,
ALiBi slopes) instead of a dense (L, L) bias, so a kernel can compute the bias on the fly.

Shared contract (all backends; `ATTENTION_FUNCTIONS` take the segment ids as one `segments`, a PackedSegments):
    query (B, H, Lq, D), key / value (B, H, Lk, D) -> output (B, H, Lq, D)
    query position i is ``i + q_offset``, key position j is ``j``; relative position is ``j - (i + q_offset)``
    bias_table      (num_buckets, H): T5 relative bias, bucketed as T5 does (``bidirectional`` for encoders)
    alibi_slopes    (H,): bias ``-slope * |relative position|``
    position_bias   (B | 1, H, Lq, Lk): an already dense bias (FIRE, asymmetric ALiBi); eager/sdpa only
    key_padding_mask (B, Lk) bool, True = attend; masks keys, never queries
    causal          key j is visible to query i only if ``j <= i + q_offset``
    scale           T5 uses 1.0 (no 1/sqrt(d)); other position encodings usually use D**-0.5
    query_segment_ids (B, Lq), key_segment_ids (B, Lk): packed rows (both or neither); key j is visible to query
                    i only if both carry the same segment id and it is not 0 (padding). Segments are contiguous,
                    so within one segment ``j - i`` already is the relative position counted from the segment's
                    start: T5 buckets and ALiBi restart at every segment with no extra input (RoPE and FIRE take
                    `segment_positions` from the model)
    Rows that see no key at all return zeros.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import io
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from .reference_fat5 import dense_bias, eager_attention, relative_positions, visibility_mask

logger = logging.getLogger(__name__)


def alibi_slopes(num_heads, device=None):
    """ALiBi head slopes (Press et al.), geometric in 2**(-8/n), with the paper's rule for non powers of two. On a
    `device`, a tensor kept per (heads, device) and built in eager mode: a forward copies nothing from the host (a
    copy a CUDA graph could not capture)."""
    if device is not None:
        key = (num_heads, torch.device(device))
        slopes = _ALIBI_SLOPES.get(key)
        if slopes is None:
            with torch.inference_mode(False):
                slopes = alibi_slopes(num_heads).to(device)
            if not torch.compiler.is_compiling():
                _ALIBI_SLOPES[key] = slopes
        return slopes
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


_ALIBI_SLOPES = {}  # (heads, device) -> alibi_slopes on that device


def asymmetric_alibi_bias(num_heads, query_length, key_length, q_offset, device):
    """(1, H, Lq, Lk) dense bias of asymmetric (bidirectional) ALiBi: the heads of the first half see only keys at
    or before their query, those of the second half only keys at or after it (-inf elsewhere), each half with the
    slopes of num_heads / 2 heads. Every query sees its own key, so no row is all -inf."""
    half = num_heads // 2
    slopes = alibi_slopes(half, device).repeat(2)
    relative = relative_positions(query_length, key_length, q_offset, device)
    bias = -slopes[:, None, None] * relative.abs().to(slopes.dtype)
    looks_back = (torch.arange(num_heads, device=device) < half)[:, None, None]
    hidden = torch.where(looks_back, relative > 0, relative < 0)
    return bias.masked_fill(hidden, float("-inf"))[None]


def segment_positions(segment_ids):
    """(B, L) position of every token counted from the start of its segment (a contiguous run of one id)."""
    index = torch.arange(segment_ids.shape[-1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


class PackedSegments:
    """Segment ids of one attention's queries and keys (one per model forward, shared by its layers), and the
    packed "varlen" layout a kernel needs, built on first use: segment s of row b becomes one sequence."""

    def __init__(self, query_segment_ids, key_segment_ids):
        self.query_segment_ids = query_segment_ids
        self.key_segment_ids = key_segment_ids

    @functools.cached_property
    def varlen(self):
        """Row indices of non-padding tokens in (B * L) order, cu_seqlens and max lengths for queries and keys.
        Needs ids that increase along each row with padding last (the model checks this)."""
        query_ids, key_ids = self.query_segment_ids, self.key_segment_ids
        batch = query_ids.shape[0]
        num_ids = int(max(query_ids.max(), key_ids.max())) + 1
        row_offset = torch.arange(batch, device=query_ids.device)[:, None] * num_ids

        def lengths(ids):
            counts = torch.bincount((ids + row_offset).flatten(), minlength=batch * num_ids)
            return counts.view(batch, num_ids)[:, 1:].flatten()

        query_lengths, key_lengths = lengths(query_ids), lengths(key_ids)
        if bool(((query_lengths > 0) & (key_lengths == 0)).any()):
            raise ValueError("a query segment has no key with its segment id (e.g. a decoder segment whose "
                             "example has no encoder tokens)")
        kept = (query_lengths > 0) | (key_lengths > 0)
        query_lengths, key_lengths = query_lengths[kept], key_lengths[kept]

        def cumulative(lengths):
            return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)

        return {
            "query_index": query_ids.flatten().nonzero().squeeze(1),
            "key_index": key_ids.flatten().nonzero().squeeze(1),
            "cu_seqlens_q": cumulative(query_lengths),
            "cu_seqlens_k": cumulative(key_lengths),
            "max_seqlen_q": int(query_lengths.max()),
            "max_seqlen_k": int(key_lengths.max()),
        }


def forward_cached(forward_cache, build, tensor, *options):
    """build(tensor, *options), computed once per stack forward: `forward_cache` (`PositionInputs.forward_cache`, a
    list) keeps it for the other layers, keyed by the tensor's identity. What is cached is what all the layers share
    (the kernel's bias lookup table from a shared T5 table, its additive key mask); a table recomputed under
    gradient checkpointing is another tensor, and gets its own lookup table, with its own gradient path."""
    for entry_build, entry_tensor, entry_options, value in forward_cache:
        if entry_build is build and entry_tensor is tensor and entry_options == options:
            return value
    value = build(tensor, *options)
    forward_cache.append((build, tensor, options, value))
    return value


@dataclasses.dataclass(frozen=True)
class PositionInputs:
    """The position parameters of one stack forward, built once and shared by its layers (never an (L, L) T5 bias:
    the T5 table is handed to each attention by its block). Unset fields do not apply to this model or this batch."""

    q_offset: int | torch.Tensor = 0  # position of the first query (a static cache's counter is a tensor)
    cache_position: torch.Tensor | None = None  # (Lq,) cache slots of the queries
    alibi_slopes: torch.Tensor | None = None  # (H,)
    position_bias: torch.Tensor | None = None  # dense FIRE or asymmetric ALiBi bias (1 | B, H, Lq, Lk)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE cos, sin: (Lq, D), or (B, 1, L, D) when packed
    cross_rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE of the encoder keys (rope_cross_attention)
    segments: PackedSegments | None = None  # packed rows: self-attention's segments
    cross_segments: PackedSegments | None = None  # packed rows: cross-attention's (decoder queries, encoder keys)
    # What the backends derive from the shared inputs, built on first use and shared by the layers (forward_cached).
    forward_cache: list = dataclasses.field(default_factory=list, compare=False)


def sdpa_attention(query, key, value, *, bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                   alibi_slopes=None, position_bias=None, key_padding_mask=None, causal=False, q_offset=0,
                   scale=1.0, dropout_p=0.0, query_segment_ids=None, key_segment_ids=None, forward_cache=None):
    """torch SDPA. Without a bias it keeps a boolean mask (or is_causal), so flash/efficient kernels apply.
    `forward_cache`: the stack forward's list (`PositionInputs.forward_cache`) where its layers share their masks."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    # q_offset is a tensor when it comes from a static cache: no is_causal shortcut then.
    use_is_causal = causal and bias_table is None and alibi_slopes is None and position_bias is None \
        and key_padding_mask is None and isinstance(q_offset, int) and q_offset == 0 \
        and query_length == key_length and key_segment_ids is None
    options = dict(bias_table=bias_table, bidirectional=bidirectional, num_buckets=num_buckets,
                   max_distance=max_distance, alibi_slopes=alibi_slopes, position_bias=position_bias,
                   key_padding_mask=key_padding_mask, causal=causal, q_offset=q_offset,
                   query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids)
    mask, seen = (None, None) if use_is_causal else _shared_sdpa_mask(query, query_length, key_length, options,
                                                                        forward_cache)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                            is_causal=use_is_causal, scale=scale)
    return output if seen is None else output * seen


# SDPA masks shared by the layers of one forward, as transformers' T5 layers share their position_bias: keyed by
# the tensor that is new every forward (the stack's T5 table or ALiBi slopes; for the cross-attention, which has
# neither, its key mask), and gone with it.
_SDPA_MASKS = WeakTensorKeyDictionary()


def _shared_sdpa_mask(query, query_length, key_length, options, forward_cache=None):
    """`_sdpa_mask`, built once per (owner, arguments) where that is exact: outside autograd and compilation, never
    keyed by a weight (which lives on), without a dense bias or segments. Within a stack forward (`forward_cache`)
    its layers' calls, which differ only by their owner (a table of their own, or the cross-attention's key mask),
    share it by the identities of the owner, the key mask and the position; called on its own, tensors are matched
    by identity and version (an in-place change misses), each but the owner kept alive by its entry so that its id
    is not reused meanwhile (holding the owner would keep the entry forever)."""
    owner = options["bias_table"] if options["bias_table"] is not None else options["alibi_slopes"]
    if owner is None and not options["causal"]:
        owner = options["key_padding_mask"]
    if owner is None or options["position_bias"] is not None or options["query_segment_ids"] is not None \
            or torch.compiler.is_compiling() or (torch.is_grad_enabled() and owner.requires_grad) \
            or (forward_cache is None and isinstance(owner, torch.nn.Parameter)):
        return _sdpa_mask(query, query_length, key_length, options)
    if forward_cache is not None:
        wanted = (query_length, key_length, query.dtype, options["causal"], id(options["key_padding_mask"]),
                  id(options["q_offset"]))
        for build, tensor, key, mask in forward_cache:
            if build is _sdpa_mask and tensor is owner and key == wanted:
                return mask
        mask = _sdpa_mask(query, query_length, key_length, options)
        forward_cache.append((_sdpa_mask, owner, wanted, mask))
        return mask
    tensors = [value for value in options.values() if torch.is_tensor(value) and value is not owner]
    key = (query_length, key_length, query.dtype, query.device,
           *((id(value), _version(value)) if torch.is_tensor(value) else value for value in options.values()))
    entries = _SDPA_MASKS.get(owner)
    if entries is None:
        entries = _SDPA_MASKS[owner] = {}
    if key not in entries:
        entries[key] = (_sdpa_mask(query, query_length, key_length, options), tensors)
    return entries[key][0]


def _version(tensor):
    """The in-place change counter; an inference tensor (made under torch.inference_mode) keeps none."""
    return None if tensor.is_inference() else tensor._version


def _sdpa_mask(query, query_length, key_length, options):
    """(additive mask in the query's dtype or None, (B | 1, 1, Lq, 1) rows that see a key or None) for SDPA."""
    bias = dense_bias(query_length, key_length, bias_table=options["bias_table"],
                      bidirectional=options["bidirectional"], num_buckets=options["num_buckets"],
                      max_distance=options["max_distance"], alibi_slopes=options["alibi_slopes"],
                      position_bias=options["position_bias"], q_offset=options["q_offset"], device=query.device)
    visible = visibility_mask(
        query_length, key_length, key_padding_mask=options["key_padding_mask"], causal=options["causal"],
        q_offset=options["q_offset"], query_segment_ids=options["query_segment_ids"],
        key_segment_ids=options["key_segment_ids"], device=query.device)
    mask = None if bias is None else bias.to(query.dtype)
    if visible is None:
        return mask, None
    # An additive finfo.min mask (not a boolean one) keeps fully-masked rows finite on every SDPA backend.
    kept = torch.zeros((), dtype=query.dtype, device=query.device) if mask is None else mask
    mask = torch.where(visible, kept, torch.finfo(query.dtype).min)
    # Rows that see no key return zeros; with causality alone every row sees key 0 (q_offset >= 0).
    if options["key_padding_mask"] is None and options["key_segment_ids"] is None:
        return mask, None
    return mask, visible.any(dim=-1, keepdim=True)


def _segment_ids(segments):
    if segments is None:
        return {}
    return {"query_segment_ids": segments.query_segment_ids, "key_segment_ids": segments.key_segment_ids}


def eager_attention_forward(query, key, value, *, segments=None, output_attentions=False, forward_cache=None,
                            **kwargs):
    output, weights = eager_attention(query, key, value, **_segment_ids(segments), return_weights=True, **kwargs)
    return output, weights if output_attentions else None


def sdpa_attention_forward(query, key, value, *, segments=None, output_attentions=False, forward_cache=None,
                           **kwargs):
    return sdpa_attention(query, key, value, **_segment_ids(segments), forward_cache=forward_cache, **kwargs), None


def triton_attention_forward(query, key, value, *, segments=None, output_attentions=False, position_bias=None,
                             forward_cache=None, **kwargs):
    """The Triton kernel, attention dropout included; `select_attention_backend` never picks it with a dense bias.
    The dropout seed is drawn from torch's generator for the device on each call (see `draw_dropout_seed`).
    `forward_cache` (the stack's `PositionInputs.forward_cache`) holds the bias lookup table and the additive key
    mask that the layers of one forward share. A decode step (`is_decode_step`) runs the decode kernel instead, on
    the same lookup table and key mask."""
    # Imported lazily: the kernel needs triton, which CPU-only installs lack.
    from .kernels.flash_attention_t5 import (
        additive_key_mask,
        flash_attention_t5,
        flash_attention_t5_varlen,
        relative_bias_lut,
    )

    decode = segments is None and is_decode_step(query, key, value, kwargs)
    forward_cache = [] if forward_cache is None else forward_cache
    if kwargs["bias_table"] is not None:
        kwargs["bias_lut"] = forward_cached(forward_cache, relative_bias_lut, kwargs.pop("bias_table"),
                                            kwargs["bidirectional"], kwargs["num_buckets"], kwargs["max_distance"])
    if segments is None and kwargs["key_padding_mask"] is not None:  # both kernels' form
        kwargs["key_mask"] = forward_cached(forward_cache, additive_key_mask, kwargs.pop("key_padding_mask"))
    if decode:
        return decode_attention_forward(query, key, value, **kwargs), None
    if isinstance(kwargs["q_offset"], torch.Tensor):
        # A static cache's counter in a prefill (more than DECODE_MAX_QUERIES rows): the kernel takes a scalar.
        kwargs["q_offset"] = int(kwargs["q_offset"])
    if segments is None:
        return flash_attention_t5(query, key, value, **kwargs), None
    # Packed rows: drop padding, run each segment as one varlen sequence, put the rows back (padding rows = 0).
    if kwargs.pop("key_padding_mask") is not None or kwargs.pop("q_offset") != 0:
        raise ValueError("packed attention takes its padding from the segment ids and has no cache offset")
    layout = segments.varlen
    batch, heads, query_length, head_dim = query.shape

    def unpad(states, index):
        return states.transpose(1, 2).reshape(-1, heads, head_dim).index_select(0, index)

    output = flash_attention_t5_varlen(
        unpad(query, layout["query_index"]), unpad(key, layout["key_index"]), unpad(value, layout["key_index"]),
        layout["cu_seqlens_q"], layout["cu_seqlens_k"], layout["max_seqlen_q"], layout["max_seqlen_k"], **kwargs)
    padded = output.new_zeros(batch * query_length, heads, head_dim).index_copy(0, layout["query_index"], output)
    return padded.view(batch, query_length, heads, head_dim).transpose(1, 2), None


# The decode kernel's DECODE_MAX_QUERIES, read from it on first use (it needs triton, which CPU-only installs lack).
_decode_max_queries = None


def is_decode_step(query, key, value, kwargs):
    """Whether the decode kernel computes this Triton call: a few query rows (generation's self- and
    cross-attention steps), no gradient to compute and no attention dropout."""
    global _decode_max_queries
    if _decode_max_queries is None:
        from .kernels.decode_attention_t5 import DECODE_MAX_QUERIES

        _decode_max_queries = DECODE_MAX_QUERIES
    if query.shape[-2] > _decode_max_queries or kwargs.get("dropout_p"):
        return False
    return not (torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, kwargs.get("bias_table"))))


def decode_attention_forward(query, key, value, *, dropout_p=0.0, **kwargs):
    """One decode step on the decode kernel (split over the cached keys); a static cache's offset stays a device
    tensor, read by the kernel: no host synchronisation."""
    from .kernels.decode_attention_t5 import decode_attention_t5

    return decode_attention_t5(query, key, value, **kwargs)


# ---- The kernel where it cannot fail a run: "auto" falls back to SDPA, "triton" names the chip ---------------------

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
    bias = "t5" if kwargs.get("bias_table") is not None else "alibi" if kwargs.get("alibi_slopes") is not None \
        else "none"
    backward = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                            or bias == "t5" and kwargs["bias_table"].requires_grad)
    return (query.device, query.dtype, query.shape[-1], bias, bool(kwargs.get("causal")),
            kwargs.get("key_padding_mask") is not None, segments is not None, kwargs.get("dropout_p", 0.0) > 0,
            backward, segments is None and is_decode_step(query, key, value, kwargs))


def _describe(variant):
    _, dtype, head_dim, bias, causal, _, packed, dropout, backward, decode = variant
    words = [str(dtype).removeprefix("torch."), f"head dim {head_dim}", {"t5": "T5 bias", "alibi": "ALiBi"}.get(
        bias, "no bias"), "causal" if causal else "", "packed" if packed else "", "dropout" if dropout else "",
        "forward and backward" if backward else "decode step" if decode else "forward"]
    return ", ".join(word for word in words if word)


def _check_inputs(query, key, *, segments=None, forward_cache=None, **kwargs):
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
    if kwargs.get("bias_table") is not None:
        options["bias_table"] = kwargs["bias_table"].detach().clone()
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
    leaves = [*states] + ([options.pop("bias_table")] if options.get("bias_table") is not None else [])

    def run(function, float32=False, **overrides):
        inputs = [(leaf.float() if float32 else leaf).detach().requires_grad_(backward) for leaf in leaves]
        table = {"bias_table": inputs[3]} if len(inputs) > 3 else {}
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


# Every function takes q, k, v and the keyword arguments of the contract above (plus `segments`, the packed rows'
# PackedSegments, `forward_cache`, the stack forward's list for `forward_cached`, and `output_attentions`) and
# returns (output, weights).
ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward,
                       "triton": triton_attention_forward}


# Whether triton can be imported, asked once at import: the model's forward reads it, and torch.compile traces a plain
# global as a constant (an lru_cache-wrapped helper made it warn on every compilation).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
# The kernel's head dims, read from it on first use (importing the kernel imports triton).
_triton_head_dims = None


def triton_installed():
    return TRITON_INSTALLED


def triton_head_dims():
    """The head dims the Triton kernel takes (its own table, read here only where triton is installed)."""
    global _triton_head_dims
    if _triton_head_dims is None:
        if not TRITON_INSTALLED:
            return ()
        from .kernels.flash_attention_t5 import HEAD_DIMS

        _triton_head_dims = HEAD_DIMS
    return _triton_head_dims


def needs_dense_bias(config):
    """Whether the config's position encoding is a dense (L, L) bias the kernel cannot compute: FIRE's (an MLP of
    every query-key pair) and asymmetric ALiBi's (half the heads look each way)."""
    return config.position_encoding_type == "fire" or (
        config.position_encoding_type == "alibi" and getattr(config, "alibi_mode", None) == "asymmetric")


def select_attention_backend(config, device, head_dim, dense_bias=False):
    """Name of the backend for attention on `device` with `head_dim`: the configured one, or for "auto" the fastest
    that is exact here.

    "auto" runs the kernel on CUDA, with or without attention dropout (the kernel draws its mask in-kernel), and
    SDPA only where the kernel cannot run: a dense bias (`dense_bias`: FIRE's, computed by an MLP per pair, or
    asymmetric ALiBi's), a head dim outside its tiles, or a device that is not CUDA; output_attentions runs eager
    (`attention_function`). Where the kernel fails on the chip itself, `guarded_triton_attention_forward` falls back
    to SDPA."""
    backend = config.attention_backend
    device = torch.device(device)
    if backend == "triton" and dense_bias:
        raise ValueError(
            "attention_backend='triton' has no dense bias (FIRE's is an MLP of every query-key pair, asymmetric "
            "ALiBi's masks half the heads each way): use attention_backend='sdpa' or 'auto'"
        )
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' runs the Triton kernel, which needs CUDA tensors; got a {device.type} "
            "tensor. Use attention_backend='auto' (the kernel on CUDA, SDPA elsewhere) or 'sdpa'")
    if backend != "auto":
        return backend
    if getattr(config, "_attn_implementation", None) == "eager":
        return "eager"
    if device.type == "cuda" and not dense_bias and head_dim in triton_head_dims():
        return "triton"
    return "sdpa"


def _backend_with_weights(config):
    if config.attention_backend not in ("auto", "eager"):
        raise ValueError(
            f"output_attentions=True needs the eager attention backend, the only one that materialises attention "
            f"weights; this model uses attention_backend={config.attention_backend!r}. Call "
            "model.set_attn_implementation('eager') (or load with attn_implementation='eager') first")
    return "eager"


def attention_function(config, query, *, needs_dense_bias, output_attentions=False, forward_cache=None):
    """The function of `ATTENTION_FUNCTIONS` that computes this call's attention (the kernel guarded by
    `guarded_triton_attention_forward`). Given the stack forward's `forward_cache`, chosen once for its layers (a
    config field read costs microseconds on transformers 5, a few of them per call of every layer)."""
    if forward_cache is not None:
        return forward_cached(forward_cache, _attention_function, config, query.device, query.shape[-1],
                              needs_dense_bias, bool(output_attentions))
    return _attention_function(config, query.device, query.shape[-1], needs_dense_bias, output_attentions)


def _attention_function(config, device, head_dim, needs_dense_bias, output_attentions):
    backend = select_attention_backend(config, device, head_dim, needs_dense_bias)
    if output_attentions:
        backend = _backend_with_weights(config)  # only the eager reference materialises the probabilities
    if backend == "triton":
        return _GUARDED_KERNEL[config.attention_backend == "auto"]
    return ATTENTION_FUNCTIONS[backend]


# The guarded kernel of "auto" (falling back to SDPA) and of "triton" (raising), built once.
_GUARDED_KERNEL = {fallback: functools.partial(guarded_triton_attention_forward, fallback=fallback)
                   for fallback in (True, False)}
