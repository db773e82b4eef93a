"""Attention of a few query rows against a long key cache (generation's decode step), forward only (Triton).

A decode step has 1 to DECODE_MAX_QUERIES query rows per (batch, head). The training kernel
(flash_attention_t5.py) runs them in one 128-row tile per (batch, head): 12 programs for T5-base at batch 1 on a
132-SM H100. Here the rows are one 16-row tile and the keys are split into chunks, as flash-decoding does: program
(b * H + h, s) attends the rows to chunk s of the keys and writes its partial (row max, row sum, unnormalised
output), and a second kernel merges the chunks of each (batch, head) by their log-sum-exp. `decode_grid` sizes the
chunks so that about twice the chip's SM count of programs run; when batch * heads already fills the chip there is
one chunk, no partials and no merge.

Position bias and key mask are the training kernel's inputs (t5_bias.py, which both kernels share): T5's through
the (H, 2 * max_distance + 1) table over clamped relative positions (`relative_bias_lut`), ALiBi from the slopes, or
none, and padded keys as the additive (B, Lk + KEY_MASK_PAD) mask (`additive_key_mask`), so a stack builds each once
for both kernels. The bias (`near_band_bias`) is added to every score: a decode step reads each key once and is
bound by memory, not by this arithmetic. Query row i sits at position i + q_offset, where q_offset is an int or a
one-element integer tensor on the device that the kernel reads (a static cache's counter: no device-to-host copy,
so the step can run in a CUDA graph). batch * heads is grid axis 0 and base offsets are int64, as in the training
kernel.
"""

import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # the model imports this module only for the "triton" backend
    raise ImportError("FAT5's triton attention backend needs triton: pip install triton "
                      "(or use attention_backend='sdpa')") from error

from ..custom_ops_fat5 import custom_op
from .t5_bias import (
    KERNEL_LOG2E,
    LOG2E,
    bias_kind,
    cdiv,
    check_inputs,
    checked_key_mask,
    dot_precision,
    last_dim_contiguous,
    near_band_bias,
    new_output,
    placeholder,
    position_args,
    relative_bias_lut,
)

# The most query rows of one call: one tile of rows (tensor-core dots need at least 16).
DECODE_MAX_QUERIES = 16
# Tests set this to fill the output and the partials with NaN before the kernels run: a row left unwritten fails.
POISON_OUTPUTS = False
# Programs a decode step aims for, per SM of the chip: a few short programs per SM hide each other's load latency.
PROGRAMS_PER_SM = 2
# The interpreter's pretend SM count, small enough that the tests' short caches split into several chunks.
INTERPRETER_SMS = 4


def _blocks(head_dim, dtype, device):
    """(BLOCK_N, num_warps, num_stages): 16-key tiles in the CPU interpreter; on GPU the tiles whose sm_90a builds
    have no spills and the fewest registers (benchmarks/decode_grid.py: 64 x 64 tiles on 4 warps spilled in half
    precision at d = 64, 64-key tiles took 200-250 registers at d = 128, fp32 spilled with 3 stages)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 16, 1, 1
    if dtype == torch.float32:
        return (64, 4, 2) if head_dim <= 64 else (32, 4, 1)
    return (64, 8, 3) if head_dim <= 64 else (32, 4, 3)


@functools.cache
def _sm_count(device):
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_grid(batch, heads, key_length, block_n, sm_count, num_splits=None):
    """(grid, keys per chunk) of one decode call: grid = (batch * heads, chunks), every chunk whole key tiles.
    Chunks are added until about PROGRAMS_PER_SM * sm_count programs run, at most one per key tile; `num_splits`
    asks for that many chunks instead (at most one per tile)."""
    tiles = max(cdiv(key_length, block_n), 1)
    wanted = num_splits or cdiv(PROGRAMS_PER_SM * sm_count, batch * heads)
    tiles_per_chunk = cdiv(tiles, min(max(wanted, 1), tiles))
    return (batch * heads, cdiv(tiles, tiles_per_chunk)), tiles_per_chunk * block_n


@triton.jit
def _decode_chunk_kernel(Q, K, V, Out, PartMax, PartSum, PartAcc, LUT, SLOPES, KMASK, QOFF,
                         stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lut_h,
                         stride_mask_b, num_heads, seqlen_q, seqlen_k, q_offset, chunk, qk_scale,
                         MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, CAUSAL: tl.constexpr,
                         HAS_KMASK: tl.constexpr, OFFSET_TENSOR: tl.constexpr, SPLIT: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """The query rows of one (batch, head) against key chunk program_id(1): its partial (log2 row max, row sum,
    unnormalised output) for the merge, or with one chunk (SPLIT False) the normalised output."""
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    if OFFSET_TENSOR:
        q_offset += tl.load(QOFF).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < seqlen_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    slope = 0.0
    if BIAS_TYPE == 2:
        slope = tl.load(SLOPES + h) * KERNEL_LOG2E
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen_k)
    if CAUSAL:  # the last row, at seqlen_q - 1 + q_offset, sees no key after it
        hi = tl.minimum(hi, seqlen_q + q_offset)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        relative = cols[None, :] - (rows[:, None] + q_offset)
        if BIAS_TYPE != 0:
            s += near_band_bias(relative, LUT + h * stride_lut_h, slope, 1.0, MAX_DIST, BIAS_TYPE)
        if HAS_KMASK:  # 0 for kept keys, -inf for padding and past the end (KEY_MASK_PAD columns: no bounds check)
            s += tl.load(KMASK + b * stride_mask_b + cols)[None, :]
        visible = col_ok[None, :]  # keys past the chunk's end are the next chunk's
        if CAUSAL:
            visible = visible & (relative <= 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Partials hold the real rows only: (batch * heads, chunks, seqlen_q[, HEAD_DIM]).
        part = (pid_bh * tl.num_programs(1) + split) * seqlen_q + rows
        tl.store(PartMax + part, m_i, mask=row_ok)
        tl.store(PartSum + part, l_i, mask=row_ok)
        tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that see no key: zeros
        tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_merge_kernel(PartMax, PartSum, PartAcc, Out, stride_ob, stride_oh, stride_om, num_heads, seqlen_q,
                         num_chunks, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The output of one (batch, head): its chunks' partials weighted by exp2(chunk max - overall max)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < seqlen_q
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(0, num_chunks):
        part = (pid_bh * num_chunks + split) * seqlen_q + rows
        m_s = tl.load(PartMax + part, mask=row_ok, other=float("-inf"))
        l_s = tl.load(PartSum + part, mask=row_ok, other=0.0)
        acc_s = tl.load(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        beta = tl.exp2(m_s - m_shift)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def _new(shape, like, dtype=None):
    return new_output(shape, like, dtype, POISON_OUTPUTS)


def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias_lut: Optional[torch.Tensor],
                      alibi_slopes: Optional[torch.Tensor], key_mask: Optional[torch.Tensor],
                      q_offset_tensor: Optional[torch.Tensor], q_offset: int, causal: bool, scale: float,
                      num_splits: int) -> torch.Tensor:
    """The decode kernels' launch: the body of the custom op `_decode_attention_op`, which eager calls run directly
    (the op has no autograd and nothing to record; its dispatch costs about as much host time as this body)."""
    batch, heads, seqlen_q, head_dim = query.shape
    seqlen_k = key.shape[2]
    out = _new(query.shape, query)
    unused = placeholder(query.device)
    bias_type, max_dist = bias_kind(bias_lut, alibi_slopes)
    lut = bias_lut if bias_lut is not None else unused
    block_n, warps, stages = _blocks(head_dim, query.dtype, query.device)
    grid, chunk = decode_grid(batch, heads, seqlen_k, block_n, _sm_count(query.device), num_splits or None)
    split = grid[1] > 1
    if split:
        part_shape = (batch * heads, grid[1], seqlen_q)
        part_max, part_sum = _new(part_shape, query, torch.float32), _new(part_shape, query, torch.float32)
        part_acc = _new((*part_shape, head_dim), query, torch.float32)
    else:  # one chunk writes the output itself
        part_max = part_sum = part_acc = unused
    _decode_chunk_kernel[grid](
        query, key, value, out, part_max, part_sum, part_acc, lut,
        alibi_slopes if alibi_slopes is not None else unused,
        key_mask if key_mask is not None else unused,
        q_offset_tensor if q_offset_tensor is not None else unused,
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *out.stride()[:3], lut.stride(0),
        key_mask.stride(0) if key_mask is not None else 0, heads, seqlen_q, seqlen_k, q_offset, chunk,
        scale * LOG2E, MAX_DIST=max_dist, BIAS_TYPE=bias_type, CAUSAL=causal,
        HAS_KMASK=key_mask is not None, OFFSET_TENSOR=q_offset_tensor is not None, SPLIT=split, HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(query.dtype), BLOCK_M=DECODE_MAX_QUERIES, BLOCK_N=block_n, num_warps=warps,
        num_stages=stages)
    if split:
        _decode_merge_kernel[(batch * heads,)](part_max, part_sum, part_acc, out, *out.stride()[:3], heads,
                                               seqlen_q, grid[1], HEAD_DIM=head_dim, BLOCK_M=DECODE_MAX_QUERIES,
                                               num_warps=4 if head_dim >= 64 else 2)
    return out


_decode_attention_op = custom_op("fat5::decode_attention", _decode_attention, mutates_args=())


@_decode_attention_op.register_fake
def _(query, key, value, bias_lut, alibi_slopes, key_mask, q_offset_tensor, q_offset, causal, scale, num_splits):
    return query.new_empty(query.shape)


def _checked_offset(q_offset, device):
    """(tensor or None, int) of a query offset given as an int or a one-element integer tensor on `device`."""
    if not isinstance(q_offset, torch.Tensor):
        return None, int(q_offset)
    if q_offset.numel() != 1 or q_offset.dtype.is_floating_point or q_offset.dtype == torch.bool \
            or q_offset.device != device:
        raise ValueError(f"q_offset must be an int or a one-element integer tensor on {device}, got a "
                         f"{tuple(q_offset.shape)} {q_offset.dtype} tensor on {q_offset.device}")
    return q_offset, 0  # the kernel reads its one element, whatever its shape


def decode_attention_t5(query, key, value, *, bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                        alibi_slopes=None, key_padding_mask=None, causal=False, q_offset=0, scale=1.0,
                        num_splits=None, bias_lut=None, key_mask=None):
    """Attention of at most DECODE_MAX_QUERIES query rows over (B, H, L, D) tensors, forward only, with the T5 bias
    (or ALiBi, or none) computed in the kernel: `flash_attention_t5`'s contract for a decode step. `q_offset` is an
    int or a one-element integer tensor on the inputs' device (read by the kernel, never by the host).
    `num_splits` forces that many key chunks (at most one per key tile); by default `decode_grid` chooses.
    `bias_lut` (`relative_bias_lut` of the table) and `key_mask` (`additive_key_mask` of the key mask) take the
    place of `bias_table` and `key_padding_mask`, as in `flash_attention_t5`: a stack builds them once for its
    layers, whichever kernel runs them."""
    check_inputs("decode_attention_t5", query, key, value)
    batch, heads, query_length, head_dim = query.shape
    if query_length > DECODE_MAX_QUERIES:
        raise ValueError(f"decode_attention_t5 takes at most {DECODE_MAX_QUERIES} query rows, got {query_length}: "
                         "use flash_attention_t5")
    if key.dim() != 4 or key.shape[:2] != (batch, heads) or value.shape != key.shape:
        raise ValueError(f"key and value must be (B, H, Lk, D) with B, H, D = {batch}, {heads}, {head_dim}; got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (query, key, value, bias_table, bias_lut, alibi_slopes)):
        raise ValueError("decode_attention_t5 is forward only (generation): use flash_attention_t5 where a "
                         "gradient is needed")
    bias_lut, alibi_slopes = position_args(bias_table, bidirectional, num_buckets, max_distance, alibi_slopes,
                                           heads, bias_lut)
    key_mask = checked_key_mask(key_padding_mask, key_mask, batch, key.shape[2])
    offset_tensor, offset = _checked_offset(q_offset, query.device)
    query, key, value = last_dim_contiguous(query, key, value)
    # Traced (torch.compile, torch.export) or given tensor subclasses (fake, meta), the op; run eagerly, its body.
    eager = not (torch.compiler.is_compiling() or query.is_meta) and type(query) is type(key) is type(value) \
        is torch.Tensor
    return (_decode_attention if eager else _decode_attention_op)(
        query, key, value, bias_lut, alibi_slopes, key_mask, offset_tensor, offset, bool(causal), float(scale),
        int(num_splits or 0))


__all__ = ["DECODE_MAX_QUERIES", "decode_attention_t5", "decode_grid", "relative_bias_lut"]
