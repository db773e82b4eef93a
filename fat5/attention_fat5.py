"""The attention seam of FAT5: one signature, several backends.

Every backend receives q, k, v and the *small* position-encoding parameters (the T5 bucket table,
ALiBi slopes) instead of a dense (L, L) bias, so a kernel can compute the bias on the fly.

Shared contract (all backends):
    query (B, H, Lq, D), key / value (B, H, Lk, D) -> output (B, H, Lq, D)
    query position i is ``i + q_offset``, key position j is ``j``; relative position is ``j - (i + q_offset)``
    bias_table      (num_buckets, H): T5 relative bias, bucketed as T5 does (``bidirectional`` for encoders)
    alibi_slopes    (H,): bias ``-slope * |relative position|``
    position_bias   (B | 1, H, Lq, Lk): an already dense bias (FIRE); eager/sdpa only
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

import functools
import math

import torch
import torch.nn.functional as F


def relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's bucketing of ``key_position - query_position`` (identical to transformers' T5Attention)."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # Logarithmic buckets up to max_distance; float() of distance 0 gives -inf, masked out by is_small.
    if_large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = if_large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, if_large)


def alibi_slopes(num_heads):
    """ALiBi head slopes (Press et al.), geometric in 2**(-8/n), with the paper's rule for non powers of two."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def relative_positions(query_length, key_length, q_offset=0, device=None):
    """(Lq, Lk) matrix of ``key_position - query_position``."""
    query_position = torch.arange(query_length, device=device)[:, None] + q_offset
    key_position = torch.arange(key_length, device=device)[None, :]
    return key_position - query_position


def dense_bias(query_length, key_length, *, bias_table=None, bidirectional=True, num_buckets=32,
               max_distance=128, alibi_slopes=None, position_bias=None, q_offset=0, device=None):
    """The additive bias as a dense (1 | B, H, Lq, Lk) float tensor, or None. Reference backends only."""
    bias = position_bias
    if bias_table is not None:
        table_bias = _table_bias(bias_table, query_length, key_length, bidirectional, num_buckets, max_distance,
                                 q_offset, device).unsqueeze(0)
        bias = table_bias if bias is None else bias + table_bias
    if alibi_slopes is not None:
        relative = relative_positions(query_length, key_length, q_offset, device)
        alibi = -alibi_slopes[:, None, None] * relative.abs().to(alibi_slopes.dtype)
        bias = alibi.unsqueeze(0) if bias is None else bias + alibi
    return bias


def _table_bias(bias_table, query_length, key_length, bidirectional, num_buckets, max_distance, q_offset, device):
    """(H, Lq, Lk) bias from a (num_buckets, H) table. The bucket depends only on key - query, so it is computed
    for the Lq + Lk - 1 distances and spread over the grid by one gather (bucketing all Lq * Lk pairs with its
    log and divisions cost twice the gather on CPU at L = 4096)."""
    distances = torch.arange(1 - query_length, key_length, device=device) - q_offset
    per_distance = bias_table[relative_position_bucket(distances, bidirectional, num_buckets, max_distance)].t()
    return per_distance[:, relative_positions(query_length, key_length, device=device) + (query_length - 1)]


def visibility_mask(query_length, key_length, *, key_padding_mask=None, causal=False, q_offset=0,
                    query_segment_ids=None, key_segment_ids=None, device=None):
    """Boolean (B | 1, 1, Lq | 1, Lk) mask of visible keys, or None when every key is visible."""
    visible = None
    if causal:
        visible = (relative_positions(query_length, key_length, q_offset, device) <= 0)[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask.to(torch.bool)[:, None, None, :]
        visible = keys if visible is None else visible & keys
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("pass query_segment_ids and key_segment_ids together")
    if key_segment_ids is not None:
        same = (query_segment_ids[:, None, :, None] == key_segment_ids[:, None, None, :]) \
            & (key_segment_ids[:, None, None, :] > 0)
        visible = same if visible is None else visible & same
    return visible


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


def eager_attention(query, key, value, *, bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                    alibi_slopes=None, position_bias=None, key_padding_mask=None, causal=False, q_offset=0,
                    scale=1.0, dropout_p=0.0, query_segment_ids=None, key_segment_ids=None, return_weights=False):
    """Plain-torch reference: materialises scores and bias; exact in any dtype (fp64 in kernel tests).
    With return_weights, also returns the attention probabilities (B, H, Lq, Lk) (output_attentions)."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    bias = dense_bias(query_length, key_length, bias_table=bias_table, bidirectional=bidirectional,
                      num_buckets=num_buckets, max_distance=max_distance, alibi_slopes=alibi_slopes,
                      position_bias=position_bias, q_offset=q_offset, device=query.device)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    visible = visibility_mask(query_length, key_length, key_padding_mask=key_padding_mask, causal=causal,
                              q_offset=q_offset, query_segment_ids=query_segment_ids,
                              key_segment_ids=key_segment_ids, device=query.device)
    # Softmax in at least fp32; finfo.min rather than -inf keeps fully-masked rows finite and NaN-free.
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if visible is not None:
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if visible is not None:
        probs = probs * visible.any(dim=-1, keepdim=True)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    output = torch.matmul(probs, value)
    return (output, probs) if return_weights else output


def sdpa_attention(query, key, value, *, bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                   alibi_slopes=None, position_bias=None, key_padding_mask=None, causal=False, q_offset=0,
                   scale=1.0, dropout_p=0.0, query_segment_ids=None, key_segment_ids=None):
    """torch SDPA. Without a bias it keeps a boolean mask (or is_causal), so flash/efficient kernels apply."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    bias = dense_bias(query_length, key_length, bias_table=bias_table, bidirectional=bidirectional,
                      num_buckets=num_buckets, max_distance=max_distance, alibi_slopes=alibi_slopes,
                      position_bias=position_bias, q_offset=q_offset, device=query.device)
    # q_offset is a tensor when it comes from a static cache: no is_causal shortcut then.
    use_is_causal = causal and bias is None and key_padding_mask is None and isinstance(q_offset, int) \
        and q_offset == 0 and query_length == key_length and key_segment_ids is None
    visible = None if use_is_causal else visibility_mask(
        query_length, key_length, key_padding_mask=key_padding_mask, causal=causal, q_offset=q_offset,
        query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids, device=query.device)
    mask = None if bias is None else bias.to(query.dtype)
    if visible is not None:
        # An additive finfo.min mask (not a boolean one) keeps fully-masked rows finite on every SDPA backend.
        kept = torch.zeros((), dtype=query.dtype, device=query.device) if mask is None else mask
        mask = torch.where(visible, kept, torch.finfo(query.dtype).min)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                            is_causal=use_is_causal, scale=scale)
    if visible is not None:
        output = output * visible.any(dim=-1, keepdim=True)
    return output
