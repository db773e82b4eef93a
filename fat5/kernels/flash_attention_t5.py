"""Flash attention with T5's relative position bias computed in the kernel (Triton), forward and backward.

The (L, L) bias is never built. T5's bucket of a query-key pair depends only on their relative position, and
every |relative position| >= max_distance shares the bucket of +-max_distance. So the bias is a per-head
lookup table over the 2 * max_distance + 1 clamped relative positions, gathered from the (num_buckets, H)
weight with the exact torch bucketing (`relative_bias_lut` of t5_bias.py, which the decode kernel shares) before
the kernel; the kernel adds ``lut[h, clamp(k - q)]`` (`near_band_bias`, shared too). Its gradient comes back as
the gradient of that small table and reaches the bucket weight through ordinary autograd of the gather, so every
length and both signs are handled by one definition.

Most tiles of a long sequence lie entirely beyond +-max_distance: there the bias is one scalar per head. Each
program therefore walks its tiles in three loops with scalar bounds (far-left, near band, far-right), the bias
kind fixed at compile time: far tiles cost what a no-bias tile costs (the scalar shifts the row max, the key mask
is one additive column vector, the causal mask only exists in the near-band loop, which holds the diagonal), and the
backward sums their dS per row into one of two table entries. Only near-band tiles gather per element and add
their dS to the table per diagonal with relaxed atomics. benchmarks/sm90_profile.py reads the build for any chip.

ALiBi (-slope * |k - q|) is computed from the slopes, per element only on tiles that cross the diagonal (on
either side it splits into a per-key and a per-row part); with no bias the kernel is plain flash attention.
batch * heads is grid axis 0 (axis 1 is capped at 65535) and base offsets are int64 (no wrap past 2^31 elements).
Layouts: padded (B, H, L, D) with an optional (B, Lk) key mask, or packed varlen (total, H, D) with
cumulative sequence lengths, where sequences never see each other and positions restart at 0.

Attention dropout (T5's `dropout` on the attention weights) runs in the kernels: each probability is kept or
dropped by a counter-based generator (Philox4x32, 7 rounds) keyed by a seed tensor drawn from torch's generator
for the device, and counted by the pair's (sequence, head, query row, key column), so the backward regenerates
the forward's mask tile by tile and nothing of size L x L is stored (`_dropout_keep` says which bits decide
which pair; tests/references.py draws the same mask in torch). Kept probabilities are scaled by 1 / (1 - p) as
`nn.functional.dropout` does; the softmax's normaliser is that of the probabilities before dropout. Without
dropout (DROPOUT=False, a compile-time switch) the kernels compile to exactly what they were without it.
"""

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
    BIAS_ALIBI,
    BIAS_LUT,
    BIAS_NONE,
    HEAD_DIMS,
    KERNEL_LOG2E,
    KEY_MASK_PAD,
    LOG2E,
    UnsupportedChip,
    additive_key_mask,
    capability,
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

# Tests set this to fill outputs with NaN before the kernels run, so a tile left unwritten fails loudly.
POISON_OUTPUTS = False
# Philox rounds of the dropout generator. 7 is the fewest that Salmon et al. (SC 2011, "Parallel random numbers:
# as easy as 1, 2, 3") found to pass BigCrush for Philox4x32 (10 is their default, with a safety margin); each
# round costs 4 instructions per 128 random bits on sm_90a, about half of the dropout's work in a far tile.
PHILOX_ROUNDS = tl.constexpr(7)
# Each pair is decided by 16 random bits: dropped with probability round(p * 2**16) / 2**16, within 2**-17 of p.
DROPOUT_BITS = 16
# Integer arguments that stay run-time values whatever they equal: Triton compiles an int argument equal to 1 as the
# constant 1 (on which `.to` fails) and one divisible by 16 as its own variant. A dropout threshold of 1
# (7.6e-6 <= p < 2.3e-5) would not compile, and other p values would compile the kernels again.
RUNTIME_SCALARS = ["dropout_threshold"]
# Kernel variants (issue 46): paths that the GPU's variant sweep (benchmarks/variant_sweep.py) times against the
# default kernel, which runs unless one is selected; none becomes the default without a GPU measurement.
#   band_tiles      the T5 bias of a near-band tile read as a plain tile of a per-head band matrix (built once a
#                   call from the lookup table: _band_matrix), straight into the scores' accumulator, instead of
#                   gathered per score, on chips whose tile table has "band tiles" (Hopper)
#   tma             the forward's key and value tiles loaded by TMA (tensor descriptors), on chips with a "forward
#                   tma" entry (Hopper): its wide key tiles beside band tiles or another bias, else the forward's own
#   fused_backward  one backward kernel: dK/dV walking query tiles and adding dQ and the table gradient with fp32
#                   atomics, so that the scores and the dropout mask are computed once, not in two kernels (chips
#                   with "fused dropout" tiles: Hopper, with dropout at d = 64 on padded batches, not causal)
VARIANT_NAMES = ("band_tiles", "tma", "fused_backward")


def kernel_variants(names):
    """The variants named in a comma-separated string (or an iterable of names), as a frozenset."""
    names = frozenset(filter(None, (name.strip() for name in (names.split(",") if isinstance(names, str)
                                                              else names))))
    unknown = sorted(names - set(VARIANT_NAMES))
    if unknown:
        raise ValueError(f"unknown kernel variants {unknown}; choose from {', '.join(VARIANT_NAMES)}")
    return names


# The variants this process runs: FAT5_KERNEL_VARIANTS=band_tiles,tma (read once, on import); the sweep and the tests
# set VARIANTS itself (kernel_variants(...)).
VARIANTS = kernel_variants(os.environ.get("FAT5_KERNEL_VARIANTS", ""))
# The band matrix of band_tiles: per head, BAND_ROWS rows, row i holding the clamped table shifted right by i columns,
# so that the bias of any near-band tile (any q_offset, BLOCK_M <= BAND_ROWS, BLOCK_N <= BAND_MARGIN) is a plain 2D
# tile of it: bias(i, j) of the query tile at start_m and the key tile at start_n is row i, column
# start_n + j - start_m - q_offset + max_distance + BAND_MARGIN.
BAND_ROWS = 128
BAND_MARGIN = 128
KERNEL_BAND_MARGIN = tl.constexpr(BAND_MARGIN)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel at head dims 32, 64 and 128, by GPU generation, chosen
# from the static build of every variant for each chip with the GPU image's triton (3.6) and the newest (3.9)
# (benchmarks/sm90_profile.py --arch N; tables in benchmarks/RESULTS.md): each fits the chip's shared memory per
# block, and the forward spills nothing. dK/dV's BLOCK_M walks query tiles for a BLOCK_N key tile; dQ needs BLOCK_M a
# multiple of BLOCK_N.
HOPPER = {  # wgmma, 227 KB: no spills and no serialised wgmma with triton 3.6
    "forward": ((128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 8, 2)),
    "forward dropout": ((128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 8, 2)),
    # d = 128: 128 query rows a key tile of 32 (under triton 3.9, 64 x 32 spilled 56-84 bytes on 8 warps, and with
    # dropout 32-96 on 4 warps; none on 128 x 32 under 3.6 or 3.9).
    "dkdv": ((64, 64, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2)),
    # The dropout mask's Philox rounds need registers that 64 x 64 on 4 warps does not have: 8 warps at d <= 64.
    "dkdv dropout": ((128, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2)),
    # At d = 128 two warpgroups of 64 query rows share each key tile (64 rows on 8 warps computed every exp2 twice
    # and serialised the wgmma; on 4 warps they read each key tile twice as often).
    "dq": ((64, 64, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2)),
    "dq dropout": ((128, 32, 8, 2), (128, 32, 8, 2), (128, 32, 8, 2)),
    # Packed rows (varlen) at d = 64 take the dropout tiles: under triton 3.9 the sequence bounds' registers made
    # 64 x 64 on 4 warps spill (dK/dV 16 bytes, dQ 56); these spill nothing under 3.6 or 3.9.
    "dkdv packed": ((64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2)),
    "dq packed": ((64, 64, 4, 2), (128, 32, 8, 2), (128, 32, 8, 2)),
    # Variant band_tiles runs here (True per head dim): elsewhere it spilled (under triton 3.6, Ampere's and sm_120's
    # dK/dV at d = 128 768-808 bytes, sm_100's forward at d = 64 32).
    "band tiles": (True, True, True),
    # Variant tma: key tiles twice as wide, loaded by TMA, for padded batches with band tiles or without T5's bias;
    # with T5's per-score gather and for packed rows the forward's own tiles (128 x 128 spilled 8-2724 bytes there
    # under triton 3.6 or 3.9).
    "forward tma": ((128, 128, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2)),
    # Variant fused_backward, with dropout at d = 64 on padded batches (and not causal: the launcher): the dK/dV
    # kernel also holds dQ's product, on 32-wide key tiles and one stage (64 x 32 on two stages spilled 8-24 bytes,
    # 64 x 64 on 4 warps 448 and more; without dropout, at d = 32 and on packed rows 64 x 32 spilled 28-68 bytes
    # under triton 3.9, at d = 128 every tile tried spilled): two kernels elsewhere.
    "fused dropout": (None, (64, 32, 4, 1), None),
}
# tcgen05, 227 KB: Hopper's tiles but where they spill there (triton 3.6 / 3.9): dQ on 128 x 32, 8 warps, at d <= 64
# (64 x 64 on 4 warps spilled 124 bytes); with dropout the forward on 128 x 32 at d = 64 (128 x 64 spilled 8 bytes
# in the decoder) and dK/dV on 64 x 64, 8 warps (128 x 64 spilled 140-252 packed at d = 64; 64 x 32 on 4 warps
# 72-708 at d = 128).
BLACKWELL = {
    "forward": ((128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 8, 2)),
    "forward dropout": ((128, 32, 8, 3), (128, 32, 8, 3), (128, 32, 8, 2)),
    "dkdv": ((64, 64, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2)),
    "dkdv dropout": ((64, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 2)),
    "dq": ((128, 32, 8, 2), (128, 32, 8, 2), (128, 32, 8, 2)),
    # d <= 64: one stage (two spilled 24 bytes in the no-bias variant under triton 3.6).
    "dq dropout": ((128, 32, 8, 2), (128, 32, 8, 1), (128, 32, 8, 2)),
}
AMPERE = {  # mma.sync, operands in registers, 99 KB (163 KB on sm_80): 32-wide key tiles
    "forward": ((128, 32, 8, 3), (128, 32, 8, 3), (128, 32, 8, 3)),
    "forward dropout": ((128, 32, 8, 3), (128, 32, 8, 3), (128, 32, 8, 3)),
    "dkdv": ((64, 32, 4, 2), (64, 32, 4, 2), (64, 32, 8, 2)),
    "dkdv dropout": ((32, 32, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2)),
    "dq": ((64, 32, 4, 2), (64, 32, 4, 2), (64, 32, 4, 2)),
    "dq dropout": ((128, 32, 8, 2), (128, 32, 8, 2), (32, 32, 8, 2)),  # d = 128: 64 x 16 spilled 16 on sm_80
}
# sm_120 (consumer Blackwell): mma.sync and 99 KB like Ampere, but its registers run out sooner: 16-wide key tiles
# at d = 128 (32-wide spill 24-164 bytes under triton 3.9), dQ on 32 x 32 at d <= 64 (64 x 32 spilled up to 228).
RTX_BLACKWELL = dict(AMPERE, forward=((128, 32, 8, 3), (128, 32, 8, 3), (128, 16, 8, 3)),
                     dkdv=((64, 32, 4, 2), (64, 32, 4, 2), (64, 16, 8, 2)),
                     dq=((32, 32, 4, 2), (32, 32, 4, 1), (64, 32, 4, 2)))  # d = 64 packed: 2 stages spilled 16
RTX_BLACKWELL["forward dropout"] = RTX_BLACKWELL["forward"]
# With dropout, dQ at d = 64 on 64 x 32, 4 warps (128 x 32 on 8 warps spilled 8 bytes on packed rows under triton
# 3.9, 64 on one stage).
RTX_BLACKWELL["dq dropout"] = ((128, 32, 8, 2), (64, 32, 4, 2), AMPERE["dq dropout"][2])
TURING = {  # no tensor cores in Triton's build (FMA dots hold whole operand rows in registers), 64 KB: small tiles
    # on 8 warps (at d = 128, 16 x 16: one score a thread, or the forward and dQ spill 0.7-2.5 KB)
    "forward": ((32, 32, 8, 1), (32, 32, 8, 1), (16, 16, 8, 1)),
    "forward dropout": ((32, 32, 8, 1), (32, 32, 8, 1), (16, 16, 8, 1)),
    "dkdv": ((32, 32, 8, 1), (32, 32, 8, 1), (32, 16, 8, 1)),
    "dkdv dropout": ((32, 32, 8, 1), (32, 32, 8, 1), (32, 16, 8, 1)),
    "dq": ((32, 32, 8, 1), (32, 32, 8, 1), (16, 16, 8, 1)),
    "dq dropout": ((32, 32, 8, 1), (32, 32, 8, 1), (16, 16, 8, 1)),
}
# Compute capability (major * 10 + minor) -> tiles; a chip not listed takes the nearest generation below it.
TILES = {75: TURING, 80: AMPERE, 86: AMPERE, 89: AMPERE, 90: HOPPER, 100: BLACKWELL, 120: RTX_BLACKWELL}


def chip_tiles(capability, kernel, head_dim, dropout=False, packed=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of `kernel` ("forward", "dkdv" or "dq") at `head_dim` on a GPU of
    compute capability `capability` (major * 10 + minor, e.g. 86), with attention dropout or for packed rows
    (varlen: a chip's "<kernel> packed" tiles where its table has them, else its tiles without dropout).
    "forward tma" (variant tma's wide tiles) and "fused" (variant fused_backward): the tiles of the variant's kernel,
    "band tiles" (variant band_tiles) True; None where the chip's table has none (the variant does not run there)."""
    known = [key for key in TILES if key <= capability] or [min(TILES)]
    table = TILES[max(known)]
    column = 0 if head_dim <= 32 else 1 if head_dim <= 64 else 2
    if kernel in ("band tiles", "forward tma", "fused"):  # variants (the fused backward: dropout on padded batches)
        if kernel == "fused":
            kernel = "fused dropout" if dropout and not packed else None
        tiles = table.get(kernel)
        return tiles and tiles[column]
    if dropout:
        return table[f"{kernel} dropout"][column]
    return table.get(f"{kernel} packed" if packed else kernel, table[kernel])[column]


def _blocks(head_dim, kernel, device, dropout=False, packed=False):
    """The tiles of `kernel` on `device`: small ones in the CPU interpreter, the chip's (chip_tiles) on a GPU (None
    for a variant's kernel without tiles there)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 16, 16, 1, 1
    major, minor = capability(device)
    return chip_tiles(major * 10 + minor, kernel, head_dim, dropout, packed)


# Key tiles (forward, dQ) or query tiles (dK/dV) by where they lie relative to the +-max_distance band. Each kind
# runs in its own loop so that the bias is fixed at compile time: one scalar in the far loops, a gather only in
# the near band (and every element for ALiBi).
FAR_LEFT = tl.constexpr(0)  # every key at relative position <= -max_distance
NEAR = tl.constexpr(1)
FAR_RIGHT = tl.constexpr(2)  # every key at relative position >= +max_distance


@triton.jit
def _sequence_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(first row of the sequence in the packed layout, its length) for queries and keys; starts in int64."""
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        q_len = tl.load(CU_Q + b + 1) - tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b).to(tl.int64)
        k_len = tl.load(CU_K + b + 1) - tl.load(CU_K + b)
    else:
        q_start = 0
        q_len = seqlen_q
        k_start = 0
        k_len = seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def _far_bias(h, LUT, stride_lut_h, MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, REGION: tl.constexpr):
    """T5's one bias value of a far tile (log2 units), which the caller applies to the row max and shift instead
    of to every score; 0 in the near band and for the other biases."""
    bias = 0.0
    if BIAS_TYPE == 1:
        if REGION == FAR_LEFT:
            bias = tl.load(LUT + h * stride_lut_h) * KERNEL_LOG2E
        elif REGION == FAR_RIGHT:
            bias = tl.load(LUT + h * stride_lut_h + 2 * MAX_DIST) * KERNEL_LOG2E
    return bias


@triton.jit
def _alibi_row_bias(rows, start_n, h, q_offset, SLOPES, BIAS_TYPE: tl.constexpr, REGION: tl.constexpr):
    """ALiBi's part of a tile on one side of the diagonal that is constant along each row (log2 units):
    -slope * |i + q_offset - start_n| (the key part is in _scores' column vector); 0 otherwise."""
    bias = 0.0
    if BIAS_TYPE == 2:
        if REGION != NEAR:
            distance = (rows + q_offset - start_n).to(tl.float32)
            if REGION == FAR_LEFT:
                distance = -distance
            bias = tl.load(SLOPES + h) * KERNEL_LOG2E * distance
    return bias


@triton.jit
def _scores(q, kt, rows, cols, start_m, start_n, b, h, k_len, q_offset, qk_scale, LUT, stride_lut_h, band, SLOPES,
            KMASK, stride_mask_b, MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, REGION: tl.constexpr,
            MASK_CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
            BAND_TILES: tl.constexpr):
    """log2-scaled scores of one tile with the per-element bias added; -inf where the pair is not visible.

    Everything per key (keys past the end, padding) is one column vector, so a far tile costs one FMA per score
    like no bias at all; the per-row parts (_far_bias, _alibi_row_bias) are applied by the caller. Rows past the
    end need no mask: they are never stored, and the backward reads +inf for their log-sum-exp, which makes their
    probabilities 0. With BAND_TILES, a near-band tile's T5 bias is a tile of this head's band matrix (`band`),
    rows from the query tile at start_m, the initial accumulator of the scores' product (read straight into the
    accumulator's registers: added after the product, on sm_90a the forward kept two copies of the scores and
    computed each exp2 twice, and dK/dV with dropout spilled 8-128 bytes)."""
    if HAS_KMASK:
        # 0 for kept keys, -inf for padding and for the KEY_MASK_PAD columns past the end: no bounds check.
        column = tl.load(KMASK + b * stride_mask_b + cols)
    else:
        column = tl.where(cols < k_len, 0.0, float("-inf"))
    if BIAS_TYPE == 2:
        if REGION != NEAR:
            # One side of the diagonal: -slope * |j - i| = -slope * |i + q_offset - start_n| -+ slope * (j - start_n).
            offset = (cols - start_n).to(tl.float32) * (tl.load(SLOPES + h) * KERNEL_LOG2E)
            column += offset if REGION == FAR_LEFT else -offset
    if BIAS_TYPE == 1 and REGION == NEAR and BAND_TILES:
        BAND_WIDTH: tl.constexpr = (2 * MAX_DIST + 3 * KERNEL_BAND_MARGIN + 15) // 16 * 16
        band_cols = cols - start_m - q_offset + (MAX_DIST + KERNEL_BAND_MARGIN)
        bias = tl.load(band + (rows - start_m)[:, None] * BAND_WIDTH + band_cols[None, :])
        # In units of the raw product (the launcher passes no zero scale).
        s = tl.dot(q, kt, bias * (KERNEL_LOG2E / qk_scale), input_precision=DOT_PRECISION) * qk_scale
        s += column[None, :]
    else:
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale + column[None, :]
    relative = cols[None, :] - (rows[:, None] + q_offset)
    if REGION == NEAR and (BIAS_TYPE == 2 or BIAS_TYPE == 1 and not BAND_TILES):
        slope = 0.0
        if BIAS_TYPE == 2:
            slope = tl.load(SLOPES + h)
        s += near_band_bias(relative, LUT + h * stride_lut_h, slope, KERNEL_LOG2E, MAX_DIST, BIAS_TYPE)
    if MASK_CAUSAL:
        s = tl.where(relative <= 0, s, float("-inf"))
    return s


@triton.jit
def _key_tile_bounds(start_m, q_len, k_len, q_offset, MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query tile at start_m: key tiles [0, near_start) are far-left, [near_start, near_end) near (or, for
    ALiBi and no bias, on the causal diagonal), [near_end, end_n) far-right. Only real rows count, so the phantom
    rows of a short decode step do not pull far tiles into the band. ALiBi's band is the diagonal (width 0)."""
    BAND: tl.constexpr = MAX_DIST if BIAS_TYPE == 1 else 0
    last_row = tl.minimum(start_m + BLOCK_M, q_len) - 1 + q_offset
    end_n = k_len
    if CAUSAL:
        end_n = tl.minimum(k_len, last_row + 1)
    if BIAS_TYPE != 0:
        # Key tile [n, n + BLOCK_N) is far-left when n + BLOCK_N - 1 - (start_m + q_offset) <= -BAND.
        near_start = tl.maximum(start_m + q_offset - BAND + 1, 0) // BLOCK_N * BLOCK_N
        near_end = (last_row + BAND + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        if CAUSAL:  # tiles right of the diagonal need the causal mask: no far-right loop
            near_end = end_n
    elif CAUSAL:
        near_start = tl.maximum(start_m + q_offset + 1, 0) // BLOCK_N * BLOCK_N
        near_end = end_n
    else:
        near_start = end_n
        near_end = end_n
    near_start = tl.minimum(near_start, end_n)
    near_end = tl.minimum(tl.maximum(near_end, near_start), end_n)
    return near_start, near_end, end_n


@triton.jit
def _query_tile_bounds(start_n, q_len, k_len, q_offset, MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr,
                       CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the key tile at start_n: query tiles [start, near_start) are far-right (the keys lie right of them),
    [near_start, near_end) near (or on the causal diagonal), [near_end, q_len) far-left."""
    BAND: tl.constexpr = MAX_DIST if BIAS_TYPE == 1 else 0
    last_col = tl.minimum(start_n + BLOCK_N, k_len) - 1
    start = 0
    if CAUSAL:
        # Query i sees key j only if j <= i + q_offset: skip the query tiles entirely above the diagonal.
        start = tl.maximum(start_n - q_offset, 0) // BLOCK_M * BLOCK_M
    if BIAS_TYPE != 0:
        # Query tile [m, m + BLOCK_M) is far-right when start_n - (m + BLOCK_M - 1 + q_offset) >= BAND.
        near_start = tl.maximum(start_n - BAND + 1 - q_offset, 0) // BLOCK_M * BLOCK_M
        near_end = (tl.maximum(last_col + BAND - q_offset, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if CAUSAL:  # no far-right loop: the near loop starts at the first visible tile
            near_start = start
    elif CAUSAL:
        near_start = start
        near_end = (tl.maximum(last_col - q_offset, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        near_start = start
        near_end = start
    near_start = tl.minimum(tl.maximum(near_start, start), q_len)
    near_end = tl.minimum(tl.maximum(near_end, near_start), q_len)
    return start, near_start, near_end


@triton.jit
def _philox4x32(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr):
    """Philox4x32 (Random123's; `tl.philox` computes the same words) on uint32 counters (c0..c3) and key (k0, k1).
    Each 32 x 32 -> 64-bit product is computed once (tl.philox takes its high and low halves separately: two
    multiplies on sm_90a instead of one IMAD.WIDE)."""
    for _ in tl.static_range(ROUNDS):
        product0 = c0.to(tl.uint64) * 0xD2511F53
        product2 = c2.to(tl.uint64) * 0xCD9E8D57
        c0 = (product2 >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (product0 >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = product2.to(tl.uint32)
        c3 = product0.to(tl.uint32)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _high_halves(word):
    """(low 16 bits, high 16 bits) of `word` as the high halves of two words, on a new last axis: comparing either
    with threshold << 16 compares its 16 bits with the threshold."""
    return tl.join(word << 16, word)


@triton.jit
def _dropout_keep(rows, start_n, bh, seed_lo, seed_hi, stream, threshold_hi, BLOCK_N: tl.constexpr):
    """Kept pairs (True) of the (rows, key tile at start_n) tile, [BLOCK_M, BLOCK_N].

    The pair (query row i, key column j = 32 * g + 8 * w + 2 * t + e) of sequence b, head h is kept when the
    16-bit half e (0: low) of word w of Philox4x32-7 on the counter (4 * g + t, i, b * H + h, seed[1]) with the
    key seed[0] (low word first) is at least round(p * 2**16). The grouping follows the tensor-core accumulator,
    where a thread holds columns 2t, 2t+1, 2t+8, ... of its rows: each Philox call feeds the 8 scores of one
    thread, and joining the halves and words back into the tile moves no data between threads (one call per
    column would cost 8 times as many rounds)."""
    BLOCK_M: tl.constexpr = rows.shape[0]
    tl.static_assert(BLOCK_N % 16 == 0, "dropout tiles are whole halves of 32-column groups")
    if BLOCK_N >= 32:
        GROUPS: tl.constexpr = BLOCK_N // 32
        counter = (start_n // 32 + tl.arange(0, GROUPS))[:, None] * 4 + tl.arange(0, 4)[None, :]
        c0 = counter[None, :, :].to(tl.uint32) + tl.zeros([BLOCK_M, 1, 1], dtype=tl.uint32)
        c1 = rows[:, None, None].to(tl.uint32) + tl.zeros([1, GROUPS, 4], dtype=tl.uint32)
        zero = tl.zeros([BLOCK_M, GROUPS, 4], dtype=tl.uint32)
        r0, r1, r2, r3 = _philox4x32(c0, c1, zero + bh, zero + stream, seed_lo, seed_hi, PHILOX_ROUNDS)
        # [M, g, t, e, s1, s2] with word w = 2 * s1 + s2, then ordered as the columns: [M, g, s1, s2, t, e].
        bits = tl.join(tl.join(_high_halves(r0), _high_halves(r2)), tl.join(_high_halves(r1), _high_halves(r3)))
        bits = tl.permute(bits, (0, 1, 4, 5, 2, 3))
    else:
        # 16-wide tiles (the interpreter's) cover words 0-1 or 2-3 of their group.
        counter = (start_n // 32) * 4 + tl.arange(0, 4)
        c0 = counter[None, :].to(tl.uint32) + tl.zeros([BLOCK_M, 1], dtype=tl.uint32)
        c1 = rows[:, None].to(tl.uint32) + tl.zeros([1, 4], dtype=tl.uint32)
        zero = tl.zeros([BLOCK_M, 4], dtype=tl.uint32)
        r0, r1, r2, r3 = _philox4x32(c0, c1, zero + bh, zero + stream, seed_lo, seed_hi, PHILOX_ROUNDS)
        second_half = start_n % 32 >= 16
        first = tl.where(second_half, r2, r0)
        last = tl.where(second_half, r3, r1)
        bits = tl.permute(tl.join(_high_halves(first), _high_halves(last)), (0, 3, 1, 2))  # [M, w, t, e]
    return tl.reshape(bits, [BLOCK_M, BLOCK_N]) >= threshold_hi


@triton.jit
def _dropout_state(SEED, pid_bh, dropout_threshold, DROPOUT: tl.constexpr):
    """(bh, seed low and high words, stream, threshold << 16) of this program's dropout; zeros without dropout."""
    bh = pid_bh.to(tl.uint32)
    seed_lo = bh * 0
    seed_hi = bh * 0
    stream = bh * 0
    threshold_hi = bh * 0
    if DROPOUT:
        seed = tl.load(SEED)
        seed_lo = seed.to(tl.uint32)
        seed_hi = (seed >> 32).to(tl.uint32)
        stream = tl.load(SEED + 1).to(tl.uint32)
        threshold_hi = dropout_threshold.to(tl.uint32) << 16
    return bh, seed_lo, seed_hi, stream, threshold_hi


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_src, v_src, lo, hi, rows, offs_n, offs_d, start_m, b, h, k_len, q_offset,
                   qk_scale, stride_kn, stride_vn, LUT, stride_lut_h, band, SLOPES, KMASK, stride_mask_b,
                   MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, REGION: tl.constexpr,
                   MASK_CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr, bh, seed_lo, seed_hi, stream, threshold_hi, DROPOUT: tl.constexpr,
                   BAND_TILES: tl.constexpr, TMA: tl.constexpr):
    """Key tiles [lo, hi) of one region; k_src and v_src are the sequence's key and value rows: pointers, or tensor
    descriptors (TMA: rows past the end read as zeros)."""
    far_bias = _far_bias(h, LUT, stride_lut_h, MAX_DIST, BIAS_TYPE, REGION)
    # Not software-pipelined in the near band: staging its per-score table gather through shared memory doubled
    # shared memory and made ptxas serialise the wgmma of the whole kernel (benchmarks/sm90_profile.py); staging
    # band tiles serialised it too.
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if REGION == NEAR else None):
        cols = start_n + offs_n
        col_ok = cols < k_len
        if TMA:
            kt = tl.trans(k_src.load([start_n, 0]))
        else:
            kt = tl.load(k_src + cols[None, :] * stride_kn + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        s = _scores(q, kt, rows, cols, start_m, start_n, b, h, k_len, q_offset, qk_scale, LUT, stride_lut_h, band,
                    SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, REGION, MASK_CAUSAL, HAS_KMASK, DOT_PRECISION,
                    BAND_TILES)
        # A far tile's bias is constant along rows: add it to the row max and shift, not to every score.
        row_bias = far_bias + _alibi_row_bias(rows, start_n, h, q_offset, SLOPES, BIAS_TYPE, REGION)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) + row_bias)
        # Rows with nothing visible yet keep m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - (m_shift - row_bias)[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if TMA:
            v = v_src.load([start_n, 0])
        else:
            v = tl.load(v_src + cols[:, None] * stride_vn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        if DROPOUT:
            # l_i sums the probabilities before dropout (the softmax's normaliser); only the values see the mask.
            kept = _dropout_keep(rows, start_n, bh, seed_lo, seed_hi, stream, threshold_hi, BLOCK_N)
            # Zero from a finite row value rather than the constant 0.0: with a constant, LLVM moves the select
            # after the bf16 conversion and ptxas unpacks and repacks every pair (74 instructions a tile, not 34).
            p = tl.where(kept, p, (l_i * 0.0)[:, None])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=RUNTIME_SCALARS)
def _forward_kernel(Q, K, V, Out, LSE, LUT, BAND, SLOPES, KMASK, CU_Q, CU_K, SEED,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                    stride_lse_b, stride_lse_h, stride_lut_h, stride_band_h, stride_mask_b,
                    num_heads, seqlen_q, seqlen_k, q_offset, qk_scale, dropout_threshold, dropout_scale,
                    MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_KMASK: tl.constexpr, IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BAND_TILES: tl.constexpr = False, TMA: tl.constexpr = False):
    # batch * heads on grid axis 0 (no 65535 cap); base offsets in int64 (no wrap past 2^31 elements).
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, q_len, k_start, k_len = _sequence_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_start * stride_qm + rows[:, None] * stride_qm
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_src = K + b * stride_kb + h * stride_kh + k_start * stride_kn
    v_src = V + b * stride_vb + h * stride_vh + k_start * stride_vn
    if TMA:  # the sequence's rows: TMA reads zeros past its end
        k_src = tl.make_tensor_descriptor(k_src, shape=[k_len, HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_src, shape=[k_len, HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    band = BAND + h * stride_band_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bh, seed_lo, seed_hi, stream, threshold_hi = _dropout_state(SEED, pid_bh, dropout_threshold, DROPOUT)
    near_start, near_end, end_n = _key_tile_bounds(start_m, q_len, k_len, q_offset, MAX_DIST, BIAS_TYPE, CAUSAL,
                                                   BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, 0, near_start, rows, offs_n, offs_d, start_m, b, h,
                                   k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT, stride_lut_h, band, SLOPES,
                                   KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, FAR_LEFT, False, HAS_KMASK,
                                   DOT_PRECISION, BLOCK_N, bh, seed_lo, seed_hi, stream, threshold_hi, DROPOUT,
                                   BAND_TILES, TMA)
    if BIAS_TYPE != 0 or CAUSAL:
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, near_start, near_end, rows, offs_n, offs_d,
                                       start_m, b, h, k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT,
                                       stride_lut_h, band, SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, NEAR,
                                       CAUSAL, HAS_KMASK, DOT_PRECISION, BLOCK_N, bh, seed_lo, seed_hi, stream,
                                       threshold_hi, DROPOUT, BAND_TILES, TMA)
    if BIAS_TYPE != 0 and not CAUSAL:
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, near_end, end_n, rows, offs_n, offs_d, start_m,
                                       b, h, k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT, stride_lut_h, band,
                                       SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, FAR_RIGHT, False, HAS_KMASK,
                                       DOT_PRECISION, BLOCK_N, bh, seed_lo, seed_hi, stream, threshold_hi, DROPOUT,
                                       BAND_TILES, TMA)

    seen = l_i > 0
    if DROPOUT:
        out = acc * (dropout_scale / tl.where(seen, l_i, 1.0))[:, None]
    else:
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + q_start * stride_om + rows[:, None] * stride_om
             + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    # log2-sum-exp2; +inf for rows that saw no key makes their probabilities exactly 0 in the backward.
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(LSE + b * stride_lse_b + h * stride_lse_h + q_start + rows, lse, mask=row_ok)


@triton.jit
def _add_diagonal_sums(ds, dlut_base, relative_start, dropout_scale, MAX_DIST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    """Adds a near-band dS tile (query rows x key columns) to the table gradient, one value per diagonal (one
    relative position; relative_start = first column - (first row + q_offset)), not one per element.

    Skew each row cyclically, skewed[i, t] = dS[i, (i + t) mod BLOCK_N]: within a group of BLOCK_N rows
    g * BLOCK_N + r, column t holds diagonal j - i = t - g * BLOCK_N where r + t < BLOCK_N and t - (g + 1) * BLOCK_N
    where it wraps, so two masked sums per group give every diagonal. The skewed tile is no larger than dS (an
    acyclic skew, BLOCK_M x (BLOCK_M + BLOCK_N), made the sm_90a build spill). With dropout, dS lacks its factor
    1 / (1 - p), applied here."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "the diagonal sums need whole groups of BLOCK_N rows")
    GROUPS: tl.constexpr = BLOCK_M // BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    skewed = tl.gather(ds, (offs_m[:, None] + offs_n[None, :]) & (BLOCK_N - 1), axis=1)
    wrapped = (offs_m[:, None] & (BLOCK_N - 1)) + offs_n[None, :] >= BLOCK_N
    upper = tl.sum(tl.reshape(tl.where(wrapped, 0.0, skewed), [GROUPS, BLOCK_N, BLOCK_N]), axis=1)
    lower = tl.sum(tl.reshape(tl.where(wrapped, skewed, 0.0), [GROUPS, BLOCK_N, BLOCK_N]), axis=1)
    if DROPOUT:
        upper *= dropout_scale
        lower *= dropout_scale
    relative = relative_start + offs_n[None, :] - tl.arange(0, GROUPS)[:, None] * BLOCK_N
    index = tl.minimum(tl.maximum(relative, -MAX_DIST), MAX_DIST) + MAX_DIST
    tl.atomic_add(dlut_base + index, upper, sem="relaxed")
    index = tl.minimum(tl.maximum(relative - BLOCK_N, -MAX_DIST), MAX_DIST) + MAX_DIST
    # Column 0 never wraps.
    tl.atomic_add(dlut_base + index, lower, mask=(offs_n > 0)[None, :], sem="relaxed")


@triton.jit
def _dkdv_tiles(dk, dv, far_sum, kt, v, q_base, do_base, lse_base, delta_base, dq_base, dlut_base, lo, hi, cols,
                start_n, offs_m, offs_d, b, h, q_len, k_len, q_offset, qk_scale, stride_qm, stride_dom, stride_dqm, LUT,
                stride_lut_h, band, SLOPES, KMASK, stride_mask_b, MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr,
                REGION: tl.constexpr, MASK_CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, bh, seed_lo, seed_hi,
                stream, threshold_hi, keep_probability, dropout_scale, DROPOUT: tl.constexpr,
                BAND_TILES: tl.constexpr, FUSED: tl.constexpr):
    """dK and dV over query tiles [lo, hi). FUSED: also adds each tile's dS K to the fp32 dQ at dq_base and its dS
    to the table gradient (near band: per diagonal; far tiles: returned summed per key column in far_sum)."""
    far_bias = _far_bias(h, LUT, stride_lut_h, MAX_DIST, BIAS_TYPE, REGION)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < q_len
        q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + rows[:, None] * stride_dom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        s = _scores(q, kt, rows, cols, start_m, start_n, b, h, k_len, q_offset, qk_scale, LUT, stride_lut_h, band,
                    SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, REGION, MASK_CAUSAL, HAS_KMASK, DOT_PRECISION,
                    BAND_TILES)
        row_bias = far_bias + _alibi_row_bias(rows, start_n, h, q_offset, SLOPES, BIAS_TYPE, REGION)
        # Hidden pairs have s = -inf and rows past the end lse = +inf: p is exactly 0 there.
        p = tl.exp2(s - (lse - row_bias)[:, None])
        if DROPOUT:
            # The forward's mask: dV = (kept P)^T dO and dS = P * (kept dP - delta * (1 - p)), each without the
            # 1 / (1 - p), which the caller applies once to dK and dV.
            dp = tl.dot(do, tl.trans(v).to(do.dtype), input_precision=DOT_PRECISION)
            kept = _dropout_keep(rows, start_n, bh, seed_lo, seed_hi, stream, threshold_hi, BLOCK_N)
            # A zero the compiler cannot fold (delta is finite), as in _forward_tiles.
            dropped = (delta * 0.0)[:, None]
            dv = tl.dot(tl.trans(tl.where(kept, p, dropped).to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
            ds = p * (tl.where(kept, dp, 0.0) - (delta * keep_probability)[:, None])
        else:
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v).to(do.dtype), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)
        if FUSED:
            # Rows past the end have dS = 0 but no memory: masked.
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
            tl.atomic_add(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], dq, mask=row_ok[:, None],
                          sem="relaxed")
            if BIAS_TYPE == 1:
                if REGION == NEAR:
                    _add_diagonal_sums(ds, dlut_base, start_n - start_m - q_offset, dropout_scale, MAX_DIST, BLOCK_M,
                                       BLOCK_N, DROPOUT)
                else:
                    far_sum += tl.sum(ds, axis=0)
    return dk, dv, far_sum


@triton.jit(do_not_specialize=RUNTIME_SCALARS)
def _backward_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DLUT, LUT, BAND, SLOPES, KMASK, CU_Q, CU_K, SEED,
                          stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          stride_dqb, stride_dqh, stride_dqm,
                          stride_lse_b, stride_lse_h, stride_lut_h, stride_band_h, stride_mask_b,
                          num_heads, seqlen_q, seqlen_k, q_offset, qk_scale, scale, dropout_threshold,
                          dropout_scale,
                          MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, CAUSAL: tl.constexpr,
                          HAS_KMASK: tl.constexpr, IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BAND_TILES: tl.constexpr = False, FUSED: tl.constexpr = False):
    """dK and dV of one key tile; FUSED (variant fused_backward): also dQ, unscaled, added to the fp32 DQ with
    atomics, and the table gradient (DLUT), so that no dQ kernel runs."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, q_len, k_start, k_len = _sequence_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols < k_len
    kt = tl.load(K + b * stride_kb + h * stride_kh + k_start * stride_kn + cols[None, :] * stride_kn
                 + offs_d[:, None], mask=col_ok[None, :], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + k_start * stride_vn + cols[:, None] * stride_vn
                + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_base = Q + b * stride_qb + h * stride_qh + q_start * stride_qm
    do_base = DO + b * stride_dob + h * stride_doh + q_start * stride_dom
    dq_base = DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqm
    lse_base = LSE + b * stride_lse_b + h * stride_lse_h + q_start
    delta_base = DELTA + b * stride_lse_b + h * stride_lse_h + q_start
    dlut_base = DLUT + h * stride_lut_h
    band = BAND + h * stride_band_h
    # dS summed per key column over the query tiles wholly beyond +max_distance / -max_distance (FUSED).
    far_right = tl.zeros([BLOCK_N], dtype=tl.float32)
    far_left = tl.zeros([BLOCK_N], dtype=tl.float32)
    bh, seed_lo, seed_hi, stream, threshold_hi = _dropout_state(SEED, pid_bh, dropout_threshold, DROPOUT)
    keep_probability = 1.0 / dropout_scale
    start, near_start, near_end = _query_tile_bounds(start_n, q_len, k_len, q_offset, MAX_DIST, BIAS_TYPE, CAUSAL,
                                                     BLOCK_M, BLOCK_N)
    if BIAS_TYPE != 0 and not CAUSAL:
        dk, dv, far_right = _dkdv_tiles(dk, dv, far_right, kt, v, q_base, do_base, lse_base, delta_base, dq_base,
                                        dlut_base, start, near_start, cols, start_n, offs_m, offs_d, b, h, q_len,
                                        k_len, q_offset, qk_scale, stride_qm, stride_dom, stride_dqm, LUT,
                                        stride_lut_h, band, SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE,
                                        FAR_RIGHT, False, HAS_KMASK, DOT_PRECISION, BLOCK_M, BLOCK_N, bh, seed_lo,
                                        seed_hi, stream, threshold_hi, keep_probability, dropout_scale, DROPOUT,
                                        BAND_TILES, FUSED)
    if BIAS_TYPE != 0 or CAUSAL:
        dk, dv, _ = _dkdv_tiles(dk, dv, far_right, kt, v, q_base, do_base, lse_base, delta_base, dq_base, dlut_base,
                                near_start, near_end, cols, start_n, offs_m, offs_d, b, h, q_len, k_len, q_offset,
                                qk_scale, stride_qm, stride_dom, stride_dqm, LUT, stride_lut_h, band, SLOPES, KMASK,
                                stride_mask_b, MAX_DIST, BIAS_TYPE, NEAR, CAUSAL, HAS_KMASK, DOT_PRECISION, BLOCK_M,
                                BLOCK_N, bh, seed_lo, seed_hi, stream, threshold_hi, keep_probability, dropout_scale,
                                DROPOUT, BAND_TILES, FUSED)
    dk, dv, far_left = _dkdv_tiles(dk, dv, far_left, kt, v, q_base, do_base, lse_base, delta_base, dq_base, dlut_base,
                                   near_end, q_len, cols, start_n, offs_m, offs_d, b, h, q_len, k_len, q_offset,
                                   qk_scale, stride_qm, stride_dom, stride_dqm, LUT, stride_lut_h, band, SLOPES, KMASK,
                                   stride_mask_b, MAX_DIST, BIAS_TYPE, FAR_LEFT, False, HAS_KMASK, DOT_PRECISION,
                                   BLOCK_M, BLOCK_N, bh, seed_lo, seed_hi, stream, threshold_hi, keep_probability,
                                   dropout_scale, DROPOUT, BAND_TILES, FUSED)
    if DROPOUT:
        dk *= dropout_scale
        dv *= dropout_scale
    tl.store(DK + b * stride_dkb + h * stride_dkh + k_start * stride_dkn + cols[:, None] * stride_dkn
             + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + b * stride_dvb + h * stride_dvh + k_start * stride_dvn + cols[:, None] * stride_dvn
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
    if FUSED:
        if BIAS_TYPE == 1:
            if DROPOUT:
                far_left *= dropout_scale
                far_right *= dropout_scale
            tl.atomic_add(dlut_base, tl.sum(far_left, axis=0), sem="relaxed")
            tl.atomic_add(dlut_base + 2 * MAX_DIST, tl.sum(far_right, axis=0), sem="relaxed")


@triton.jit
def _dq_tiles(dq, far_sum, q, do, lse, delta, k_base, v_base, dlut_base, lo, hi, rows, offs_n, offs_d, start_m, b,
              h, k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT, stride_lut_h, band, SLOPES, KMASK,
              stride_mask_b, MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, REGION: tl.constexpr,
              MASK_CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, bh, seed_lo, seed_hi, stream, threshold_hi, keep_probability, dropout_scale,
              DROPOUT: tl.constexpr, BAND_TILES: tl.constexpr):
    """dQ over key tiles [lo, hi); far tiles also return the sum of their dS per row (one bias entry each).
    With dropout, dS lacks its factor 1 / (1 - p) (applied once by the caller), except in the near band's
    table gradient, which is added here."""
    far_bias = _far_bias(h, LUT, stride_lut_h, MAX_DIST, BIAS_TYPE, REGION)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < k_len
        kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        vt = tl.load(v_base + cols[None, :] * stride_vn + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        s = _scores(q, kt, rows, cols, start_m, start_n, b, h, k_len, q_offset, qk_scale, LUT, stride_lut_h, band,
                    SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, REGION, MASK_CAUSAL, HAS_KMASK, DOT_PRECISION,
                    BAND_TILES)
        row_bias = far_bias + _alibi_row_bias(rows, start_n, h, q_offset, SLOPES, BIAS_TYPE, REGION)
        # p (hence dS) is exactly 0 outside the visible pairs, so ragged tails and masked keys never reach the
        # bias gradient.
        p = tl.exp2(s - (lse - row_bias)[:, None])
        dp = tl.dot(do, vt.to(do.dtype), input_precision=DOT_PRECISION)
        if DROPOUT:
            kept = _dropout_keep(rows, start_n, bh, seed_lo, seed_hi, stream, threshold_hi, BLOCK_N)
            ds = p * (tl.where(kept, dp, 0.0) - (delta * keep_probability)[:, None])
        else:
            ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
        if BIAS_TYPE == 1:
            if REGION == NEAR:
                _add_diagonal_sums(ds, dlut_base, start_n - start_m - q_offset, dropout_scale, MAX_DIST, BLOCK_M,
                                   BLOCK_N, DROPOUT)
            else:
                far_sum += tl.sum(ds, axis=1)
    return dq, far_sum


@triton.jit(do_not_specialize=RUNTIME_SCALARS)
def _backward_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DLUT, LUT, BAND, SLOPES, KMASK, CU_Q, CU_K, SEED,
                        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                        stride_dqb, stride_dqh, stride_dqm,
                        stride_lse_b, stride_lse_h, stride_lut_h, stride_band_h, stride_mask_b,
                        num_heads, seqlen_q, seqlen_k, q_offset, qk_scale, scale, dropout_threshold,
                        dropout_scale,
                        MAX_DIST: tl.constexpr, BIAS_TYPE: tl.constexpr, CAUSAL: tl.constexpr,
                        HAS_KMASK: tl.constexpr, IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BAND_TILES: tl.constexpr = False):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, q_len, k_start, k_len = _sequence_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_start * stride_qm + rows[:, None] * stride_qm
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + q_start * stride_dom + rows[:, None] * stride_dom
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + b * stride_lse_b + h * stride_lse_h + q_start + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * stride_lse_b + h * stride_lse_h + q_start + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh + k_start * stride_kn
    v_base = V + b * stride_vb + h * stride_vh + k_start * stride_vn
    dlut_base = DLUT + h * stride_lut_h
    band = BAND + h * stride_band_h
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # dS summed over the tiles wholly beyond -max_distance / +max_distance: one bias entry each.
    far_left = tl.zeros([BLOCK_M], dtype=tl.float32)
    far_right = tl.zeros([BLOCK_M], dtype=tl.float32)
    bh, seed_lo, seed_hi, stream, threshold_hi = _dropout_state(SEED, pid_bh, dropout_threshold, DROPOUT)
    keep_probability = 1.0 / dropout_scale
    near_start, near_end, end_n = _key_tile_bounds(start_m, q_len, k_len, q_offset, MAX_DIST, BIAS_TYPE, CAUSAL,
                                                   BLOCK_M, BLOCK_N)
    dq, far_left = _dq_tiles(dq, far_left, q, do, lse, delta, k_base, v_base, dlut_base, 0, near_start, rows, offs_n,
                             offs_d, start_m, b, h, k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT, stride_lut_h,
                             band, SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, FAR_LEFT, False, HAS_KMASK,
                             DOT_PRECISION, BLOCK_M, BLOCK_N, bh, seed_lo, seed_hi, stream, threshold_hi,
                             keep_probability, dropout_scale, DROPOUT, BAND_TILES)
    if BIAS_TYPE != 0 or CAUSAL:
        dq, _ = _dq_tiles(dq, far_left, q, do, lse, delta, k_base, v_base, dlut_base, near_start, near_end, rows,
                          offs_n, offs_d, start_m, b, h, k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT,
                          stride_lut_h, band, SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, NEAR, CAUSAL,
                          HAS_KMASK, DOT_PRECISION, BLOCK_M, BLOCK_N, bh, seed_lo, seed_hi, stream, threshold_hi,
                          keep_probability, dropout_scale, DROPOUT, BAND_TILES)
    if BIAS_TYPE != 0 and not CAUSAL:
        dq, far_right = _dq_tiles(dq, far_right, q, do, lse, delta, k_base, v_base, dlut_base, near_end, end_n, rows,
                                  offs_n, offs_d, start_m, b, h, k_len, q_offset, qk_scale, stride_kn, stride_vn, LUT,
                                  stride_lut_h, band, SLOPES, KMASK, stride_mask_b, MAX_DIST, BIAS_TYPE, FAR_RIGHT,
                                  False, HAS_KMASK, DOT_PRECISION, BLOCK_M, BLOCK_N, bh, seed_lo, seed_hi, stream,
                                  threshold_hi, keep_probability, dropout_scale, DROPOUT, BAND_TILES)
    if DROPOUT:
        dq *= dropout_scale
        far_left *= dropout_scale
        far_right *= dropout_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqm + rows[:, None] * stride_dqm
             + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    if BIAS_TYPE == 1:
        tl.atomic_add(dlut_base, tl.sum(far_left, axis=0), sem="relaxed")
        tl.atomic_add(dlut_base + 2 * MAX_DIST, tl.sum(far_right, axis=0), sem="relaxed")


@triton.jit
def _backward_delta_kernel(O, DO, DELTA, CU_Q, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                           stride_lse_b, stride_lse_h, num_heads, seqlen_q, IS_VARLEN: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = sum_d dO_id * O_id (= sum_j P_ij dP_ij), laid out like the log-sum-exp."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    q_start, q_len, _, _ = _sequence_bounds(b, CU_Q, CU_Q, seqlen_q, seqlen_q, IS_VARLEN)
    if pid_m * BLOCK_M >= q_len:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    o = tl.load(O + b * stride_ob + h * stride_oh + q_start * stride_om + rows[:, None] * stride_om
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + q_start * stride_dom + rows[:, None] * stride_dom
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b * stride_lse_b + h * stride_lse_h + q_start + rows, delta, mask=row_ok)


def _new_output(shape, like, dtype=None):
    return new_output(shape, like, dtype, POISON_OUTPUTS)


def _layout(tensor, varlen):
    """(batch, head, row) strides of a (B, H, L, D) or packed (total, H, D) tensor; batch stride 0 if packed."""
    if varlen:
        return 0, tensor.stride(1), tensor.stride(0)
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _geometry(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, heads = cu_seqlens_q.numel() - 1, query.shape[1]
        return varlen, batch, heads, max_seqlen_q, max_seqlen_k
    return varlen, query.shape[0], query.shape[1], query.shape[2], key.shape[2]


def _lse_shape(query, varlen):
    if varlen:
        return (query.shape[1], query.shape[0])  # (H, total_q)
    return (query.shape[0], query.shape[1], query.shape[2])


def _lse_strides(lse, varlen):
    if varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def _bias_args(bias_lut, alibi_slopes, query):
    unused = placeholder(query.device, torch.float32)
    if bias_lut is not None:
        return BIAS_LUT, bias_lut, unused, bias_lut.stride(0), (bias_lut.shape[1] - 1) // 2
    if alibi_slopes is not None:
        return BIAS_ALIBI, unused, alibi_slopes, 0, 1
    return BIAS_NONE, unused, unused, 0, 1


def _dropout_args(dropout_p, dropout_seed, query):
    """(seed tensor, 16-bit threshold, 1 / (1 - p), DROPOUT) for the kernels; p = 0 compiles the dropout out."""
    if dropout_p == 0.0:
        return placeholder(query.device, torch.int64), 0, 1.0, False
    threshold = min(round(dropout_p * 2**DROPOUT_BITS), 2**DROPOUT_BITS - 1)
    return dropout_seed, threshold, 1.0 / (1.0 - dropout_p), True


# _band_matrix's index into a (H, 2 * max_distance + 1) table, per (max_distance, device): built once, in eager mode.
_BAND_INDICES = {}


def _band_width(max_dist):
    """Columns of the band matrix (as the kernels compute it): every near-band tile's, a multiple of 16."""
    return (2 * max_dist + 3 * BAND_MARGIN + 15) // 16 * 16


def _band_matrix(lut, max_dist):
    """Variant band_tiles: (H, BAND_ROWS, _band_width) float32, row i holding the table clamped and shifted by i:
    entry (h, i, c) is lut[h, clamp(c - i - max_distance - BAND_MARGIN, -max_distance, max_distance) + max_distance].
    One gather a call; its gradient is not needed (the kernels sum dS into the table's own gradient)."""
    key = (max_dist, lut.device)
    index = _BAND_INDICES.get(key)
    if index is None:
        with torch.inference_mode(False):
            relative = (torch.arange(_band_width(max_dist), device=lut.device)[None, :]
                        - torch.arange(BAND_ROWS, device=lut.device)[:, None] - max_dist - BAND_MARGIN)
            index = relative.clamp(-max_dist, max_dist) + max_dist
        if not (lut.is_cuda and torch.cuda.is_current_stream_capturing()):  # not a graph's memory
            _BAND_INDICES[key] = index
    return lut[:, index]


def _band_args(lut, bias_type, max_dist, scale, query):
    """(band matrix, its head stride, BAND_TILES) for the kernels: variant band_tiles with T5's table, on a chip whose
    table says it runs there (any in the interpreter), and a nonzero scale (the forward divides the bias by it)."""
    if bias_type != BIAS_LUT or "band_tiles" not in VARIANTS or scale == 0 \
            or not _blocks(query.shape[-1], "band tiles", query.device):
        return placeholder(query.device, torch.float32), 0, False
    band = _band_matrix(lut, max_dist)
    return band, band.stride(0), True


def _tma_scratch(size, alignment, stream):
    """Global memory for the tensor descriptors a kernel makes (Triton asks for it at launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_blocks(key, value, wide, dropout):
    """Variant tma: the forward's tiles with TMA loads (the chip's "forward tma" entry when `wide`, else its forward
    tiles; the interpreter's tiles on CPU), or None where it does not run: not selected, a chip without a "forward
    tma" entry, or keys and values whose rows TMA cannot address (16-byte aligned addresses and strides)."""
    if "tma" not in VARIANTS:
        return None
    aligned = all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
                  for t in (key, value))
    if not aligned:
        return None
    if key.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 16, 16, 1, 1
    major, minor = capability(key.device)
    chip = major * 10 + minor
    if chip_tiles(chip, "forward tma", key.shape[-1]) is None:
        return None
    triton.set_allocator(_tma_scratch)  # a context variable: set where the launch runs
    return chip_tiles(chip, "forward tma" if wide else "forward", key.shape[-1], dropout)


@custom_op("fat5::flash_attention_forward", mutates_args=())
def _flash_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             bias_lut: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                             key_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                             cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                             causal: bool, q_offset: int, scale: float, dropout_p: float,
                             dropout_seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    varlen, batch, heads, seqlen_q, seqlen_k = _geometry(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = _new_output(query.shape, query)
    lse = _new_output(_lse_shape(query, varlen), query, torch.float32)
    bias_type, lut, slopes, stride_lut_h, max_dist = _bias_args(bias_lut, alibi_slopes, query)
    band, stride_band_h, band_tiles = _band_args(lut, bias_type, max_dist, scale, query)
    mask = key_mask if key_mask is not None else placeholder(query.device, torch.float32)
    cu_q = cu_seqlens_q if varlen else placeholder(query.device, torch.int32)
    cu_k = cu_seqlens_k if varlen else cu_q
    seed, threshold, dropout_scale, dropout = _dropout_args(dropout_p, dropout_seed, query)
    # TMA's wide key tiles need the near band's registers that band tiles free (and sequences whole tiles long).
    tma_blocks = _tma_blocks(key, value, (bias_type != BIAS_LUT or band_tiles) and not varlen, dropout)
    block_m, block_n, warps, stages = tma_blocks or _blocks(query.shape[-1], "forward", query.device, dropout)
    grid = (batch * heads, cdiv(seqlen_q, block_m))
    _forward_kernel[grid](
        query, key, value, out, lse, lut, band, slopes, mask, cu_q, cu_k, seed,
        *_layout(query, varlen), *_layout(key, varlen), *_layout(value, varlen), *_layout(out, varlen),
        *_lse_strides(lse, varlen), stride_lut_h, stride_band_h, mask.stride(0),
        heads, seqlen_q, seqlen_k, q_offset, scale * LOG2E, threshold, dropout_scale,
        MAX_DIST=max_dist, BIAS_TYPE=bias_type, CAUSAL=causal, HAS_KMASK=key_mask is not None,
        IS_VARLEN=varlen, HEAD_DIM=query.shape[-1], DOT_PRECISION=dot_precision(query.dtype), DROPOUT=dropout,
        BLOCK_M=block_m, BLOCK_N=block_n, BAND_TILES=band_tiles, TMA=tma_blocks is not None, num_warps=warps,
        num_stages=stages)
    return out, lse


@_flash_attention_forward.register_fake
def _(query, key, value, bias_lut, alibi_slopes, key_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, causal, q_offset, scale, dropout_p, dropout_seed):
    varlen = cu_seqlens_q is not None
    # Contiguous like the real op's output (not empty_like, which would keep a transposed query's strides and let a
    # compiled graph view the real output with the wrong layout).
    return query.new_empty(query.shape), query.new_empty(_lse_shape(query, varlen), dtype=torch.float32)


@custom_op("fat5::flash_attention_backward", mutates_args=())
def _flash_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              bias_lut: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                              key_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                              cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool, q_offset: int, scale: float, dropout_p: float,
                              dropout_seed: Optional[torch.Tensor]
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    varlen, batch, heads, seqlen_q, seqlen_k = _geometry(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    # The gradient of a sum() arrives expanded, with stride 0 along the head dim.
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    seed, threshold, dropout_scale, dropout = _dropout_args(dropout_p, dropout_seed, query)
    # fused_backward (where the chip has tiles for it; not causal rows, where with band tiles it spilled 8 bytes under
    # triton 3.6) adds dQ to an fp32 sum, scaled and cast at the end.
    fused_blocks = "fused_backward" in VARIANTS and not causal and _blocks(query.shape[-1], "fused", query.device,
                                                                         dropout, varlen)
    fused = bool(fused_blocks)
    dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device) if fused else _new_output(query.shape,
                                                                                                      query)
    dk, dv = _new_output(key.shape, key), _new_output(value.shape, value)
    bias_type, lut, slopes, stride_lut_h, max_dist = _bias_args(bias_lut, alibi_slopes, query)
    band, stride_band_h, band_tiles = _band_args(lut, bias_type, max_dist, scale, query)
    dlut = torch.zeros_like(bias_lut) if bias_lut is not None else query.new_zeros(1, dtype=torch.float32)
    mask = key_mask if key_mask is not None else placeholder(query.device, torch.float32)
    cu_q = cu_seqlens_q if varlen else placeholder(query.device, torch.int32)
    cu_k = cu_seqlens_k if varlen else cu_q
    common = dict(MAX_DIST=max_dist, BIAS_TYPE=bias_type, CAUSAL=causal, HAS_KMASK=key_mask is not None,
                  IS_VARLEN=varlen, HEAD_DIM=query.shape[-1], DOT_PRECISION=dot_precision(query.dtype),
                  DROPOUT=dropout, BAND_TILES=band_tiles)
    block_m, block_n, warps, stages = fused_blocks or _blocks(query.shape[-1], "dkdv", query.device, dropout, varlen)
    delta = _new_output(lse.shape, lse)
    _backward_delta_kernel[(batch * heads, cdiv(seqlen_q, block_m))](
        out, grad_out, delta, cu_q, *_layout(out, varlen), *_layout(grad_out, varlen), *_lse_strides(lse, varlen),
        heads, seqlen_q, IS_VARLEN=varlen, HEAD_DIM=query.shape[-1], BLOCK_M=block_m, num_warps=warps)
    strides = (*_layout(query, varlen), *_layout(key, varlen), *_layout(value, varlen),
               *_layout(grad_out, varlen))
    scalars = (*_lse_strides(lse, varlen), stride_lut_h, stride_band_h, mask.stride(0), heads, seqlen_q, seqlen_k,
               q_offset, scale * LOG2E, scale, threshold, dropout_scale)
    # Without fused_backward the dK/dV kernel neither reads nor writes dQ and the table gradient: placeholders.
    fused_outputs = (dq, dlut) if fused else (placeholder(query.device, torch.float32),) * 2
    _backward_dkdv_kernel[(batch * heads, cdiv(seqlen_k, block_n))](
        query, key, value, grad_out, lse, delta, dk, dv, *fused_outputs, lut, band, slopes, mask, cu_q, cu_k, seed,
        *strides, *_layout(dk, varlen), *_layout(dv, varlen), *(_layout(dq, varlen) if fused else (0, 0, 0)),
        *scalars, **common, FUSED=fused, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    if fused:
        return dq.mul_(scale * dropout_scale).to(query.dtype), dk, dv, dlut
    block_m, block_n, warps, stages = _blocks(query.shape[-1], "dq", query.device, dropout, varlen)
    _backward_dq_kernel[(batch * heads, cdiv(seqlen_q, block_m))](
        query, key, value, grad_out, lse, delta, dq, dlut, lut, band, slopes, mask, cu_q, cu_k, seed,
        *strides, *_layout(dq, varlen), *scalars,
        **common, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return dq, dk, dv, dlut


@_flash_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, bias_lut, alibi_slopes, key_mask, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, causal, q_offset, scale, dropout_p, dropout_seed):
    dlut = torch.empty_like(bias_lut) if bias_lut is not None else query.new_empty(1, dtype=torch.float32)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dlut


def _setup_context(ctx, inputs, output):
    (query, key, value, bias_lut, alibi_slopes, key_mask, cu_q, cu_k, max_q, max_k, causal, q_offset, scale,
     dropout_p, dropout_seed) = inputs
    out, lse = output
    # The seed, not the mask: the backward regenerates the forward's mask from it.
    ctx.save_for_backward(query, key, value, out, lse, bias_lut, alibi_slopes, key_mask, cu_q, cu_k, dropout_seed)
    ctx.options = (max_q, max_k, causal, q_offset, scale, dropout_p)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, bias_lut, alibi_slopes, key_mask, cu_q, cu_k, dropout_seed = ctx.saved_tensors
    dq, dk, dv, dlut = _flash_attention_backward(grad_out, query, key, value, out, lse, bias_lut, alibi_slopes,
                                                 key_mask, cu_q, cu_k, *ctx.options, dropout_seed)
    return dq, dk, dv, (dlut if bias_lut is not None else None), None, None, None, None, None, None, None, \
        None, None, None, None


_flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def draw_dropout_seed(device):
    """A (2,) int64 tensor (Philox key, stream) drawn from torch's default generator for `device`.

    Drawn on the device, never read back to the host: torch.manual_seed reproduces it, activation checkpointing
    (torch.utils.checkpoint, as transformers, FSDP and DeepSpeed use it) restores the generator before recomputing
    a block and so redraws the same seed, a CUDA graph replays the draw with a fresh generator offset each time,
    and torch.compile traces it as an ordinary random op. 62-bit values: Inductor's randint computes high - low in
    int64, which the full int64 range would overflow."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def _dropout_inputs(dropout_p, dropout_seed, device):
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return 0.0, None  # no draw: p = 0 leaves torch's generator where it was
    if dropout_seed is None:
        return dropout_p, draw_dropout_seed(device)
    if dropout_seed.shape != (2,) or dropout_seed.dtype != torch.int64 or dropout_seed.device != device:
        raise ValueError(f"dropout_seed must be a (2,) int64 tensor on {device}, got {tuple(dropout_seed.shape)} "
                         f"{dropout_seed.dtype} on {dropout_seed.device}")
    return dropout_p, dropout_seed.contiguous()  # the kernels read the key at SEED and the stream at SEED + 1


def flash_attention_t5(query, key, value, *, bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                       alibi_slopes=None, key_padding_mask=None, causal=False, q_offset=0, scale=1.0, dropout_p=0.0,
                       dropout_seed=None, bias_lut=None, key_mask=None):
    """Attention over (B, H, L, D) tensors with the T5 bias (or ALiBi, or none) computed in the kernel.

    Same contract as `attention_fat5.eager_attention` (see there), without a dense bias. `dropout_p` drops
    attention probabilities in the kernel (scaled by 1 / (1 - p)); the mask is a function of `dropout_seed`, a
    (2,) int64 tensor on the inputs' device, drawn by `draw_dropout_seed` from torch's generator when None.
    `bias_lut` (`relative_bias_lut` of the table) and `key_mask` (`additive_key_mask` of the key mask) take the
    place of `bias_table` and `key_padding_mask` for callers that build them once for several layers.
    Differentiable w.r.t. query, key, value and bias_table (or bias_lut).
    """
    check_inputs("flash_attention_t5", query, key, value)
    batch, heads, query_length, _ = query.shape
    if key.shape[:2] != (batch, heads) or value.shape != key.shape:
        raise ValueError(f"key and value must be (B, H, Lk, D) with B, H = {batch}, {heads}; got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    key_mask = checked_key_mask(key_padding_mask, key_mask, batch, key.shape[2])
    bias_lut, alibi_slopes = position_args(bias_table, bidirectional, num_buckets, max_distance, alibi_slopes,
                                            heads, bias_lut)
    dropout_p, dropout_seed = _dropout_inputs(dropout_p, dropout_seed, query.device)
    query, key, value = last_dim_contiguous(query, key, value)
    out, _ = _flash_attention_forward(query, key, value, bias_lut, alibi_slopes, key_mask, None, None,
                                      query_length, key.shape[2], bool(causal), int(q_offset), float(scale),
                                      dropout_p, dropout_seed)
    return out


def flash_attention_t5_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              bias_table=None, bidirectional=True, num_buckets=32, max_distance=128,
                              alibi_slopes=None, causal=False, scale=1.0, dropout_p=0.0, dropout_seed=None,
                              bias_lut=None):
    """Packed sequences: query (total_q, H, D), key/value (total_k, H, D), cu_seqlens int32 (N + 1,).
    Sequence n is rows cu_seqlens[n]:cu_seqlens[n + 1]; it sees only itself, positions restarting at 0.
    Dropout as in `flash_attention_t5`, sequence n counted as batch entry n with rows and columns from 0."""
    check_inputs("flash_attention_t5", query, key, value)
    heads = query.shape[1]
    if key.shape[1] != heads or value.shape != key.shape:
        raise ValueError(f"key and value must be (total_k, H, D) with H = {heads}; got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1-D with one entry per sequence plus one")
    bias_lut, alibi_slopes = position_args(bias_table, bidirectional, num_buckets, max_distance, alibi_slopes,
                                            heads, bias_lut)
    dropout_p, dropout_seed = _dropout_inputs(dropout_p, dropout_seed, query.device)
    query, key, value = last_dim_contiguous(query, key, value)
    out, _ = _flash_attention_forward(query, key, value, bias_lut, alibi_slopes, None,
                                      cu_seqlens_q.to(torch.int32).contiguous(),
                                      cu_seqlens_k.to(torch.int32).contiguous(), int(max_seqlen_q),
                                      int(max_seqlen_k), bool(causal), 0, float(scale), dropout_p, dropout_seed)
    return out


__all__ = ["HEAD_DIMS", "KEY_MASK_PAD", "UnsupportedChip", "additive_key_mask", "chip_tiles", "draw_dropout_seed",
           "flash_attention_t5", "flash_attention_t5_varlen", "relative_bias_lut"]
