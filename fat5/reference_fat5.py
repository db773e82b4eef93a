"""FAT5's math in plain torch: the exact definitions the Triton kernels reproduce (their tests compare against
these), and what the model runs where no kernel applies.

Torch-only and below everything else in the package: the kernels (`kernels/`) import their references from here,
the attention seam (`attention_*_fat5`) and the model import the same functions, so no module imports one above it.
Attention follows the contract written in `attention_fat5`.
"""

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


def relative_positions(query_length, key_length, q_offset=0, device=None):
    """(Lq, Lk) matrix of ``key_position - query_position``."""
    key_position = torch.arange(key_length, device=device)[None, :]
    if query_length == 1:  # a decode step: one row
        return key_position - q_offset
    query_position = torch.arange(query_length, device=device)[:, None] + q_offset
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
    if query_length == 1:  # a decode step: the distances are its row
        return per_distance[:, None, :]
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


def t5_rms_norm(hidden_states, weight, eps):
    """T5LayerNorm's math (the reference of the Triton kernel): x * rsqrt(mean(x**2) + eps) with the statistics
    in fp32, cast to the weight's dtype when it is half precision, then times the weight."""
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        hidden_states = hidden_states.to(weight.dtype)
    return weight * hidden_states
