"""The backends' adapters: everything between a layer's q, k, v and the attention's output, for each backend.

Backends: "eager" (the plain-torch reference of `reference_fat5`, the only one that gives weights), "sdpa" (torch's
scaled_dot_product_attention) and "triton" (the flash-attention and decode kernels of `kernels/`, padded or packed;
this is the only model module that imports `kernels/`). For the backend `attention_select_fat5` chooses, `PREPARE`
builds once a stack forward an `AttentionPlan`: the key masks in the backend's one form, and how a T5 table becomes
its bias (the kernel's lookup table, SDPA's dense mask, the table itself for eager). A kernel gets the *small*
position parameters (T5 table, ALiBi slopes), never a dense (L, L) bias: it computes the bias on the fly.

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

import torch
import torch.nn.functional as F

from .reference_fat5 import dense_bias, eager_attention, relative_positions, visibility_mask


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
class AttentionPlan:
    """One kind of attention (self or cross) of one stack forward, decided and built once by the stack: the
    function its layers call, the keyword arguments they all pass it (key masks already in the backend's form), and
    how a T5 table becomes the backend's bias (`prepare_bias`, None without a table), passed as `bias_name`."""

    function: object
    arguments: dict
    bias_name: str | None = None
    prepare_bias: object = None

    def __call__(self, query, key, value, bias=None, **options):
        arguments = self.arguments if bias is None else {**self.arguments, self.bias_name: bias}
        return self.function(query, key, value, **arguments, **options)


def _segment_ids(segments):
    if segments is None:
        return {}
    return {"query_segment_ids": segments.query_segment_ids, "key_segment_ids": segments.key_segment_ids}


# ---- eager: the reference, the only backend with weights -----------------------------------------------------------

def eager_attention_forward(query, key, value, *, segments=None, output_attentions=False, **kwargs):
    output, weights = eager_attention(query, key, value, **_segment_ids(segments), return_weights=True, **kwargs)
    return output, weights if output_attentions else None


def prepare_eager(function, query_length, key_length, dtype, device, contract, t5):
    """The eager plan: the contract as it is, the T5 table as its bias."""
    return AttentionPlan(function, contract, "bias_table", (lambda table: table) if t5 else None)


# ---- sdpa: one additive mask (bias and visibility) and the rows that see a key ----------------------------------

def sdpa_inputs(query_length, key_length, dtype, device, *, bias_table=None, bias_lut=None, bidirectional=True,
                num_buckets=32, max_distance=128, alibi_slopes=None, position_bias=None, key_padding_mask=None,
                causal=False, q_offset=0, segments=None, **unused):
    """SDPA's arguments for the contract: `attn_mask` (additive, in `dtype`, or None), `seen` ((B | 1, 1, Lq, 1)
    rows that see a key, or None) and `is_causal`. Without a bias it keeps is_causal where it can, so flash and
    efficient kernels apply. `bias_lut`: a T5 table the kernel's adapter already gathered (its fallback here)."""
    # q_offset is a tensor when it comes from a static cache: no is_causal shortcut then.
    if causal and bias_table is None and bias_lut is None and alibi_slopes is None and position_bias is None \
            and key_padding_mask is None and isinstance(q_offset, int) and q_offset == 0 \
            and query_length == key_length and segments is None:
        return {"attn_mask": None, "seen": None, "is_causal": True}
    if bias_lut is not None:
        position_bias = _lut_bias(bias_lut, query_length, key_length, q_offset, position_bias)
    bias = dense_bias(query_length, key_length, bias_table=bias_table, bidirectional=bidirectional,
                      num_buckets=num_buckets, max_distance=max_distance, alibi_slopes=alibi_slopes,
                      position_bias=position_bias, q_offset=q_offset, device=device)
    visible, seen = _sdpa_visibility(query_length, key_length, device, key_padding_mask, causal, q_offset, segments)
    return {"attn_mask": _sdpa_mask(bias, visible, dtype), "seen": seen, "is_causal": False}


def _lut_bias(bias_lut, query_length, key_length, q_offset, position_bias):
    """The dense (1, H, Lq, Lk) bias of a (H, 2 * max_distance + 1) lookup table (T5 buckets are constant past
    max_distance), added to `position_bias`."""
    reach = (bias_lut.shape[-1] - 1) // 2
    relative = relative_positions(query_length, key_length, q_offset, bias_lut.device).clamp(-reach, reach)
    bias = bias_lut[:, relative + reach][None]
    return bias if position_bias is None else position_bias + bias


def _sdpa_visibility(query_length, key_length, device, key_padding_mask, causal, q_offset, segments):
    """(visible keys or None, rows that see a key or None: only a key mask or segments can empty a row; with
    causality alone every row sees key 0, q_offset >= 0)."""
    visible = visibility_mask(query_length, key_length, key_padding_mask=key_padding_mask, causal=causal,
                              q_offset=q_offset, device=device, **_segment_ids(segments))
    if visible is None or (key_padding_mask is None and segments is None):
        return visible, None
    return visible, visible.any(dim=-1, keepdim=True)


def _sdpa_mask(bias, visible, dtype):
    mask = None if bias is None else bias.to(dtype)
    if visible is None:
        return mask
    # An additive finfo.min mask (not a boolean one) keeps fully-masked rows finite on every SDPA backend.
    kept = torch.zeros((), dtype=dtype, device=visible.device) if mask is None else mask
    return torch.where(visible, kept, torch.finfo(dtype).min)


def sdpa_prepared(query, key, value, *, attn_mask=None, seen=None, is_causal=False, scale=1.0, dropout_p=0.0,
                  output_attentions=False):
    """torch SDPA on `sdpa_inputs`' arguments (rows that see no key return zeros)."""
    if attn_mask is not None and attn_mask.dtype != query.dtype:  # built for another dtype (a user's autocast)
        attn_mask = attn_mask.float().clamp_min(torch.finfo(query.dtype).min).to(query.dtype)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                            is_causal=is_causal, scale=scale)
    return (output if seen is None else output * seen), None


def sdpa_attention_forward(query, key, value, *, scale=1.0, dropout_p=0.0, output_attentions=False,
                           key_mask=None, **kwargs):
    """SDPA called with the contract (its masks built for this call; `key_mask`, the kernel's form, is not read)."""
    inputs = sdpa_inputs(query.shape[-2], key.shape[-2], query.dtype, query.device, **kwargs)
    return sdpa_prepared(query, key, value, **inputs, scale=scale, dropout_p=dropout_p)


def sdpa_attention(query, key, value, *, query_segment_ids=None, key_segment_ids=None, **kwargs):
    """`sdpa_attention_forward`'s output, the segment ids given as the contract writes them."""
    segments = None if key_segment_ids is None else PackedSegments(query_segment_ids, key_segment_ids)
    return sdpa_attention_forward(query, key, value, segments=segments, **kwargs)[0]


def prepare_sdpa(function, query_length, key_length, dtype, device, contract, t5):
    """The SDPA plan: its mask built once (with the T5 table's bias by `prepare_bias`, the stack's first block)."""
    if not t5:
        return AttentionPlan(sdpa_prepared, {**sdpa_inputs(query_length, key_length, dtype, device, **contract),
                                             "scale": contract["scale"]})
    visible, seen = _sdpa_visibility(query_length, key_length, device, contract["key_padding_mask"],
                                     contract["causal"], contract["q_offset"], contract["segments"])
    options = {name: contract[name] for name in ("bidirectional", "num_buckets", "max_distance", "alibi_slopes",
                                                  "position_bias", "q_offset")}

    def prepare(table):
        return _sdpa_mask(dense_bias(query_length, key_length, bias_table=table, device=device, **options), visible,
                          dtype)

    return AttentionPlan(sdpa_prepared, dict(attn_mask=None, seen=seen, is_causal=False, scale=contract["scale"]),
                         "attn_mask", prepare)


# ---- triton: the flash-attention and decode kernels --------------------------------------------------------------

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


def prepare_triton(function, query_length, key_length, dtype, device, contract, t5):
    """The kernel's plan: the additive key mask both kernels read (training and prefill, and a decode step), and the
    T5 table's lookup table (`relative_bias_lut`), both built once and shared by the layers."""
    from .kernels.flash_attention_t5 import additive_key_mask, relative_bias_lut

    arguments = dict(contract)
    if contract["key_padding_mask"] is not None and contract["segments"] is None:
        arguments["key_mask"] = additive_key_mask(contract["key_padding_mask"])
    bidirectional, num_buckets, max_distance = (contract[name] for name in ("bidirectional", "num_buckets",
                                                                              "max_distance"))

    def prepare(table):
        return relative_bias_lut(table, bidirectional, num_buckets, max_distance)

    return AttentionPlan(function, arguments, "bias_lut", prepare if t5 else None)


def triton_attention_forward(query, key, value, *, segments=None, output_attentions=False, position_bias=None,
                             **kwargs):
    """The Triton kernel, attention dropout included; `select_attention_backend` never picks it with a dense bias.
    The dropout seed is drawn from torch's generator for the device on each call (see `draw_dropout_seed`).
    `bias_lut` and `key_mask` (`prepare_triton`'s, shared by a stack's layers) stand for `bias_table` and
    `key_padding_mask`, made here when not given. A decode step (`is_decode_step`) runs the decode kernel instead,
    on the same lookup table."""
    # Imported lazily: the kernel needs triton, which CPU-only installs lack.
    from .kernels.flash_attention_t5 import (
        additive_key_mask,
        flash_attention_t5,
        flash_attention_t5_varlen,
        relative_bias_lut,
    )

    decode = segments is None and is_decode_step(query, key, value, kwargs)
    table = kwargs.pop("bias_table", None)
    if table is not None:
        kwargs["bias_lut"] = relative_bias_lut(table, kwargs["bidirectional"], kwargs["num_buckets"],
                                               kwargs["max_distance"])
    key_mask = kwargs.pop("key_mask", None)
    if decode:  # split over the cached keys; a static cache's offset stays a device tensor, read by the kernel
        from .kernels.decode_attention_t5 import decode_attention_t5

        kwargs.pop("dropout_p", None)
        if key_mask is not None:  # the stack's, in the kernels' one form
            kwargs.pop("key_padding_mask")
        return decode_attention_t5(query, key, value, key_mask=key_mask, **kwargs), None
    if isinstance(kwargs["q_offset"], torch.Tensor):
        # A static cache's counter in a prefill (more than DECODE_MAX_QUERIES rows): the kernel takes a scalar.
        kwargs["q_offset"] = int(kwargs["q_offset"])
    if segments is None:
        key_padding_mask = kwargs.pop("key_padding_mask")
        if key_mask is None and key_padding_mask is not None:
            key_mask = additive_key_mask(key_padding_mask)
        return flash_attention_t5(query, key, value, key_mask=key_mask, **kwargs), None
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


def decode_max_queries():
    global _decode_max_queries
    if _decode_max_queries is None:
        from .kernels.decode_attention_t5 import DECODE_MAX_QUERIES

        _decode_max_queries = DECODE_MAX_QUERIES
    return _decode_max_queries


def is_decode_step(query, key, value, kwargs):
    """Whether the decode kernel computes this Triton call: a few query rows (generation's self- and
    cross-attention steps), no gradient to compute and no attention dropout."""
    if query.shape[-2] > decode_max_queries() or kwargs.get("dropout_p"):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
        query, key, value, kwargs.get("bias_table"), kwargs.get("bias_lut"))))





PREPARE = {"eager": prepare_eager, "sdpa": prepare_sdpa, "triton": prepare_triton}
