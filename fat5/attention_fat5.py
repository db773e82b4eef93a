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

import dataclasses
import functools
import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from .reference_fat5 import dense_bias, eager_attention, relative_positions, visibility_mask


def alibi_slopes(num_heads):
    """ALiBi head slopes (Press et al.), geometric in 2**(-8/n), with the paper's rule for non powers of two."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def asymmetric_alibi_bias(num_heads, query_length, key_length, q_offset, device):
    """(1, H, Lq, Lk) dense bias of asymmetric (bidirectional) ALiBi: the heads of the first half see only keys at
    or before their query, those of the second half only keys at or after it (-inf elsewhere), each half with the
    slopes of num_heads / 2 heads. Every query sees its own key, so no row is all -inf."""
    half = num_heads // 2
    slopes = alibi_slopes(half).repeat(2).to(device)
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


def sdpa_attention(query, key, value, *, bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                   alibi_slopes=None, position_bias=None, key_padding_mask=None, causal=False, q_offset=0,
                   scale=1.0, dropout_p=0.0, query_segment_ids=None, key_segment_ids=None):
    """torch SDPA. Without a bias it keeps a boolean mask (or is_causal), so flash/efficient kernels apply."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    # q_offset is a tensor when it comes from a static cache: no is_causal shortcut then.
    use_is_causal = causal and bias_table is None and alibi_slopes is None and position_bias is None \
        and key_padding_mask is None and isinstance(q_offset, int) and q_offset == 0 \
        and query_length == key_length and key_segment_ids is None
    options = dict(bias_table=bias_table, bidirectional=bidirectional, num_buckets=num_buckets,
                   max_distance=max_distance, alibi_slopes=alibi_slopes, position_bias=position_bias,
                   key_padding_mask=key_padding_mask, causal=causal, q_offset=q_offset,
                   query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids)
    mask, seen = (None, None) if use_is_causal else _shared_sdpa_mask(query, query_length, key_length, options)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                            is_causal=use_is_causal, scale=scale)
    return output if seen is None else output * seen


# SDPA masks shared by the layers of one forward, as transformers' T5 layers share their position_bias: keyed by
# the tensor that is new every forward (the stack's T5 table or ALiBi slopes; for the cross-attention, which has
# neither, its key mask), and gone with it.
_SDPA_MASKS = WeakTensorKeyDictionary()


def _shared_sdpa_mask(query, query_length, key_length, options):
    """`_sdpa_mask`, built once per (owner, arguments) where that is exact: outside autograd and compilation, never
    keyed by a weight (which lives on), without a dense bias or segments. Tensors are matched by identity and
    version (an in-place change misses), each but the owner kept alive by its entry so that its id is not reused
    meanwhile (holding the owner would keep the entry forever)."""
    owner = options["bias_table"] if options["bias_table"] is not None else options["alibi_slopes"]
    if owner is None and not options["causal"]:
        owner = options["key_padding_mask"]
    if owner is None or isinstance(owner, torch.nn.Parameter) or options["position_bias"] is not None \
            or options["query_segment_ids"] is not None or torch.compiler.is_compiling() \
            or (torch.is_grad_enabled() and owner.requires_grad):
        return _sdpa_mask(query, query_length, key_length, options)
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
    return torch.where(visible, kept, torch.finfo(query.dtype).min), visible.any(dim=-1, keepdim=True)


def _segment_ids(segments):
    if segments is None:
        return {}
    return {"query_segment_ids": segments.query_segment_ids, "key_segment_ids": segments.key_segment_ids}


def eager_attention_forward(query, key, value, *, segments=None, output_attentions=False, **kwargs):
    output, weights = eager_attention(query, key, value, **_segment_ids(segments), return_weights=True, **kwargs)
    return output, weights if output_attentions else None


def sdpa_attention_forward(query, key, value, *, segments=None, output_attentions=False, **kwargs):
    return sdpa_attention(query, key, value, **_segment_ids(segments), **kwargs), None


def triton_attention_forward(query, key, value, *, segments=None, output_attentions=False, position_bias=None,
                             **kwargs):
    """The Triton kernel, attention dropout included; `select_attention_backend` never picks it with a dense bias.
    The dropout seed is drawn from torch's generator for the device on each call (see `draw_dropout_seed`).
    A decode step (`is_decode_step`) runs the decode kernel instead."""
    # Imported lazily: the kernel needs triton, which CPU-only installs lack.
    from .kernels.flash_attention_t5 import flash_attention_t5, flash_attention_t5_varlen

    if segments is None and is_decode_step(query, key, value, kwargs):
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


def is_decode_step(query, key, value, kwargs):
    """Whether the decode kernel computes this Triton call: a few query rows (generation's self- and
    cross-attention steps), no gradient to compute and no attention dropout."""
    from .kernels.decode_attention_t5 import DECODE_MAX_QUERIES

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, kwargs.get("bias_table")))
    return query.shape[-2] <= DECODE_MAX_QUERIES and not needs_grad and not kwargs.get("dropout_p")


def decode_attention_forward(query, key, value, *, dropout_p=0.0, **kwargs):
    """One decode step on the decode kernel (split over the cached keys); a static cache's offset stays a device
    tensor, read by the kernel: no host synchronisation."""
    from .kernels.decode_attention_t5 import decode_attention_t5

    return decode_attention_t5(query, key, value, **kwargs)


# Every function takes q, k, v and the keyword arguments of the contract above (plus `segments`, the packed
# rows' PackedSegments, and `output_attentions`) and returns (output, weights).
ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward,
                       "triton": triton_attention_forward}


@functools.cache
def triton_installed():
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_head_dims():
    """The head dims the Triton kernel takes (its own table, read here only where triton is installed)."""
    if not triton_installed():
        return ()
    from .kernels.flash_attention_t5 import HEAD_DIMS

    return HEAD_DIMS


def select_attention_backend(config, query, needs_dense_bias, dropout_p):
    """Name of the backend for this call: the configured one, or for "auto" the fastest that is exact here.

    "auto" runs the kernel on CUDA, with or without attention dropout (the kernel draws its mask in-kernel), and
    SDPA only where the kernel cannot run: a dense bias (FIRE's, computed by an MLP per pair, or asymmetric
    ALiBi's), a head dim outside its tiles, or a tensor that is not on CUDA; output_attentions runs eager
    (`attention_function`).
    `dropout_p` is part of the call's description but no longer decides the backend."""
    backend = config.attention_backend
    if backend == "triton" and needs_dense_bias:
        raise ValueError(
            "attention_backend='triton' has no dense bias (FIRE's is an MLP of every query-key pair, asymmetric "
            "ALiBi's masks half the heads each way): use attention_backend='sdpa' or 'auto'"
        )
    if backend == "triton" and query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' runs the Triton kernel, which needs CUDA tensors; got a {query.device.type} "
            "tensor. Use attention_backend='auto' (the kernel on CUDA, SDPA elsewhere) or 'sdpa'")
    if backend != "auto":
        return backend
    if getattr(config, "_attn_implementation", None) == "eager":
        return "eager"
    if query.is_cuda and not needs_dense_bias and query.shape[-1] in triton_head_dims():
        return "triton"
    return "sdpa"


def _backend_with_weights(config):
    if config.attention_backend not in ("auto", "eager"):
        raise ValueError(
            f"output_attentions=True needs the eager attention backend, the only one that materialises attention "
            f"weights; this model uses attention_backend={config.attention_backend!r}. Call "
            "model.set_attn_implementation('eager') (or load with attn_implementation='eager') first")
    return "eager"


def attention_function(config, query, *, needs_dense_bias, dropout_p, output_attentions=False):
    """The function of `ATTENTION_FUNCTIONS` that computes this call's attention."""
    backend = select_attention_backend(config, query, needs_dense_bias, dropout_p)
    if output_attentions:
        backend = _backend_with_weights(config)  # only the eager reference materialises the probabilities
    return ATTENTION_FUNCTIONS[backend]
