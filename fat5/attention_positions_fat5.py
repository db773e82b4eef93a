"""Positions: what the position encodings other than T5's buckets give the attention, built once per stack forward.

ALiBi's head slopes (or asymmetric ALiBi's dense bias), RoPE's rotation, FIRE's normalised distances (its MLP and
parameters are `modeling_fat5.FAT5FIREBias`), the positions of packed rows' tokens counted from their segment's
start, and `PositionInputs`, what one stack forward hands its layers. T5's bucketed bias is the backends' own: a
layer gets the table (or what its backend made of it), never an (L, L) bias from here.
"""

import dataclasses
import math

import torch

from .reference_fat5 import relative_positions


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


def fire_distances(query_length, key_length, q_offset, device, c, threshold, normalizer_offset, normalizer_eps,
                   positions=None):
    """FIRE's (1 | B, Lq, Lk) fp32 input: psi(key - query) / (psi(max(threshold, query position + normalizer_offset))
    + normalizer_eps), psi(x) = log(c x + 1) keeping the sign (one MLP serves the bidirectional encoder too). Packed
    rows' (B, L) `positions` restart at each segment."""
    if positions is None:
        relative = relative_positions(query_length, key_length, q_offset, device).float()[None]
        query_position = (torch.arange(query_length, device=device, dtype=torch.float32) + q_offset)[None]
    else:
        query_position = positions.float()
        relative = query_position[:, None, :] - query_position[:, :, None]
    normaliser = torch.log(c * torch.maximum(threshold, query_position + normalizer_offset) + 1)[..., None]
    return torch.sign(relative) * torch.log(c * relative.abs() + 1) / (normaliser + normalizer_eps)


def rotate_half(x, interleaved=False):
    """The pair partner of every channel, negated on the first of the pair: pairs (i, i + dim / 2), or (2i, 2i + 1)
    when `interleaved`."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_cos_sin(positions, dim, theta, device, interleaved=False):
    """cos/sin of shape (*positions.shape, dim) for RoPE over `dim` channels, in fp32 so long positions stay
    distinct; the angle of pair k is laid out where `rotate_half` puts that pair."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin, interleaved=False):
    """x with its first cos.shape[-1] channels rotated (all of them unless partial_rotary_factor < 1)."""
    dim = cos.shape[-1]
    rotated = x[..., :dim].float()
    rotated = (rotated * cos + rotate_half(rotated, interleaved) * sin).to(x.dtype)
    return rotated if dim == x.shape[-1] else torch.cat((rotated, x[..., dim:]), dim=-1)


def position_encoding(config, query_length, key_length, q_offset, device, positions=None, cross_segments=None,
                      encoder_length=None, fire=None):
    """The `PositionInputs` fields of the config's position encoding for one stack forward: ALiBi's slopes, a dense
    bias (asymmetric ALiBi's, or FIRE's from the stack's `fire` module), RoPE's rotations (the encoder keys' too,
    `rope_cross_attention`, given the cross-attention's `encoder_length`). `positions` (B, L): per-segment positions
    of a packed batch (T5 and ALiBi need none: see `attention_fat5`)."""
    kind = config.position_encoding_type
    if kind == "alibi" and config.alibi_mode == "asymmetric":
        return {"position_bias": asymmetric_alibi_bias(config.num_heads, query_length, key_length, q_offset, device)}
    if kind == "alibi":
        return {"alibi_slopes": alibi_slopes(config.num_heads, device)}
    if kind == "fire" and fire is not None:
        return {"position_bias": fire(query_length, key_length, q_offset, device, positions)}
    if kind != "rope":
        return {}

    def rotary(positions):  # (L, D) for (L,) positions; (B, 1, L, D) against (B, H, L, D) states for (B, L) ones
        cos, sin = rotary_cos_sin(positions, config.rotary_dim, config.rope_theta, device, config.rope_interleaved)
        return (cos, sin) if positions.dim() == 1 else (cos[:, None], sin[:, None])

    fields = {"rotary": rotary(torch.arange(query_length, device=device) + q_offset if positions is None
                               else positions)}
    if config.rope_cross_attention and encoder_length is not None:
        fields["cross_rotary"] = rotary(torch.arange(encoder_length, device=device) if cross_segments is None
                                        else segment_positions(cross_segments.key_segment_ids))
    return fields


@dataclasses.dataclass(frozen=True)
class PositionInputs:
    """What one stack forward builds once and hands its layers: the position parameters (never an (L, L) T5 bias:
    the T5 table, or what the backend made of it, goes from block to block as a tensor argument) and each kind of
    attention's `AttentionPlan` (`attention_select_fat5`). Unset fields do not apply to this model or this batch;
    without a plan a layer called on its own makes its own."""

    q_offset: int | torch.Tensor = 0  # position of the first query (a static cache's counter is a tensor)
    cache_position: torch.Tensor | None = None  # (Lq,) cache slots of the queries
    alibi_slopes: torch.Tensor | None = None  # (H,)
    position_bias: torch.Tensor | None = None  # dense FIRE or asymmetric ALiBi bias (1 | B, H, Lq, Lk)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE cos, sin: (Lq, D), or (B, 1, L, D) when packed
    cross_rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE of the encoder keys (rope_cross_attention)
    segments: object = None  # packed rows: self-attention's PackedSegments
    cross_segments: object = None  # packed rows: cross-attention's (decoder queries, encoder keys)
    self_attention: object = None  # the self-attention's AttentionPlan
    cross_attention: object = None  # the cross-attention's AttentionPlan
