"""What FAT5's two attention kernels share: T5's bias as they read it, their key mask, their input checks.

The training kernel (flash_attention_t5.py) and the decode kernel (decode_attention_t5.py) are different algorithms
(a three-region walk over query and key tiles; a few rows split over key chunks), but read the same inputs: T5's
bias as the (H, 2 * max_distance + 1) lookup table over clamped relative positions (`relative_bias_lut`, gathered
from the (num_buckets, H) weight with the exact torch bucketing, its index built once per device and shape), ALiBi's
slopes, and the (B, Lk + KEY_MASK_PAD) additive key mask (`additive_key_mask`). A stack builds each once for all its
layers, whichever kernel runs them. `near_band_bias` is the per-score bias of a tile both kernels compute element by
element. The kernels' bodies and tiles stay in their own modules.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # the model imports the kernels only for the "triton" backend
    raise ImportError("FAT5's triton attention backend needs triton: pip install triton "
                      "(or use attention_backend='sdpa')") from error

from ..reference_fat5 import relative_position_bucket

HEAD_DIMS = (32, 64, 128)
BIAS_NONE, BIAS_LUT, BIAS_ALIBI = 0, 1, 2
LOG2E = 1.4426950408889634
# Compiled (non-interpreted) kernels may only read globals wrapped as constexpr.
KERNEL_LOG2E = tl.constexpr(LOG2E)
# Columns of -inf after the additive key mask: at least the widest key tile of either kernel.
KEY_MASK_PAD = 128


@triton.jit
def near_band_bias(relative, lut_row, slope, SLOPE_SCALE: tl.constexpr, MAX_DIST: tl.constexpr,
                   BIAS_TYPE: tl.constexpr):
    """The bias (log2 units) of the scores at `relative` = key position - query position: T5's table entry of the
    clamped relative position (`lut_row`: the head's row of the lookup table) or ALiBi's -slope * |relative|, in log2
    units once times SLOPE_SCALE (the training kernel scales per score, LOG2E; the decode kernel passes a scaled slope
    and 1.0: each build as it was before they shared this). Only for BIAS_TYPE 1 (T5) and 2 (ALiBi)."""
    if BIAS_TYPE == 1:
        index = tl.minimum(tl.maximum(relative, -MAX_DIST), MAX_DIST) + MAX_DIST
        bias = tl.load(lut_row + index) * KERNEL_LOG2E
    else:
        bias = -(slope * tl.abs(relative).to(tl.float32) * SLOPE_SCALE)
    return bias


def cdiv(numerator, denominator):
    """triton.cdiv without its constexpr wrapper (a few microseconds a call on the host)."""
    return -(-numerator // denominator)


def dot_precision(dtype):
    """fp32 inputs use TF32 tensor cores only where torch's own fp32 matmuls may (set_float32_matmul_precision)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def new_output(shape, like, dtype=None, poison=False):
    """An output for a kernel to fill; NaN where `poison` (tests: a row or tile left unwritten fails loudly)."""
    dtype = dtype or like.dtype
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


# One-element tensors (two: a seed's slot) passed where a kernel takes a pointer it does not read (no bias table, no
# key mask, no tensor offset, not packed, no dropout, no partials), one per (device, dtype) instead of a new one each
# call. Never written, never handed to the caller.
_PLACEHOLDERS = {}


def placeholder(device, dtype=torch.float32):
    key = (device, dtype)
    tensor = _PLACEHOLDERS.get(key)
    if tensor is None:
        with torch.inference_mode(False):
            tensor = torch.zeros(2, dtype=dtype, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # not a graph's memory
            _PLACEHOLDERS[key] = tensor
    return tensor


# (major, minor) compute capability of each CUDA device, asked once (the query costs microseconds on every call).
_CAPABILITIES = {}


def capability(device):
    found = _CAPABILITIES.get(device)
    if found is None:
        found = _CAPABILITIES[device] = torch.cuda.get_device_capability(device)
    return found


def _lut_index(heads, bidirectional, num_buckets, max_distance, device):
    """(H, 2 * max_distance + 1) index into the flattened (num_buckets, H) table: entry (h, r) is bucket(r) * H + h,
    the bucket of relative position r - max_distance by the exact torch bucketing."""
    relative = torch.arange(-max_distance, max_distance + 1, device=device)
    buckets = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    return buckets[None, :] * heads + torch.arange(heads, device=device)[:, None]


# _lut_index of each (H, bidirectional, num_buckets, max_distance, device), built once in eager mode: the bucketing is
# about 15 ops, the same every call. Made outside inference mode, so that a lookup table built under autograd can
# save it for its backward.
_LUT_INDICES = {}


def relative_bias_lut(bias_table, bidirectional, num_buckets, max_distance):
    """(H, 2 * max_distance + 1) bias per clamped relative position -max_distance..max_distance, gathered
    (differentiably) from the (num_buckets, H) T5 weight with the exact torch bucketing. The layers of a stack that
    share one table can share its table too (`bias_lut=` of either kernel): their gradients add up in it.
    One gather (and a cast to float32 for a half-precision table): the index is built once per device and shape,
    inline where torch.compile traces (it folds the constant) or a CUDA graph captures."""
    key = (bias_table.shape[1], bool(bidirectional), num_buckets, max_distance, bias_table.device)
    if torch.compiler.is_compiling():
        index = _lut_index(*key)
    else:
        index = _LUT_INDICES.get(key)
        if index is None:
            with torch.inference_mode(False):
                index = _lut_index(*key)
            if not (bias_table.is_cuda and torch.cuda.is_current_stream_capturing()):  # not a graph's memory
                _LUT_INDICES[key] = index
    lut = bias_table.reshape(-1)[index]
    return lut if lut.dtype == torch.float32 else lut.float()


def additive_key_mask(key_padding_mask):
    """The kernels' form of a (B, Lk) key mask (True = attend): (B, Lk + KEY_MASK_PAD) float32, 0 for a kept key,
    -inf for padding and for the KEY_MASK_PAD columns past the end, so key tiles read it without a bounds check (one
    add per score, no compare). Layers that share a key mask can share this (`key_mask=` of either kernel).
    Two ops: log(True) = 0 and log(False) = -inf exactly, then the padding."""
    mask = torch.log(key_padding_mask.bool())
    if mask.dtype != torch.float32:  # torch's default dtype set to another
        mask = mask.float()
    return torch.nn.functional.pad(mask, (0, KEY_MASK_PAD), value=float("-inf"))


def checked_key_mask(key_padding_mask, key_mask, batch, key_length):
    """The additive key mask of a call given `key_padding_mask` (built here), `key_mask` (additive_key_mask's,
    checked) or neither (None)."""
    if key_padding_mask is not None:
        if key_mask is not None:
            raise ValueError("pass key_padding_mask or key_mask (additive_key_mask's), not both")
        if tuple(key_padding_mask.shape) != (batch, key_length):
            raise ValueError(f"key_padding_mask must be (B, Lk) = {(batch, key_length)}, "
                             f"got {tuple(key_padding_mask.shape)}")
        return additive_key_mask(key_padding_mask)
    if key_mask is not None and (tuple(key_mask.shape) != (batch, key_length + KEY_MASK_PAD)
                                 or key_mask.dtype != torch.float32 or key_mask.stride(-1) != 1):
        raise ValueError(f"key_mask must be additive_key_mask's (B, Lk + {KEY_MASK_PAD}) = "
                         f"{(batch, key_length + KEY_MASK_PAD)} float32 mask, got {tuple(key_mask.shape)} "
                         f"{key_mask.dtype}")
    return key_mask


class UnsupportedChip(ValueError):
    """The kernel cannot run these inputs on this GPU (bf16 on a chip without it)."""


def check_inputs(name, query, key, value):
    """The head dim and dtype both kernels take (`name`: the kernel's, for the message)."""
    head_dim = query.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name} supports head dims {HEAD_DIMS}, got {head_dim}")
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        raise ValueError(f"query, key and value must share the head dim, got {query.shape[-1]}, "
                         f"{key.shape[-1]}, {value.shape[-1]}")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float32, torch.float16,
                                                                            torch.bfloat16):
        raise ValueError(f"query, key and value must share one of float32/float16/bfloat16, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    if query.dtype == torch.bfloat16 and query.is_cuda and capability(query.device) < (8, 0):
        major, minor = capability(query.device)
        raise UnsupportedChip(f"{torch.cuda.get_device_name(query.device)} (sm_{major}{minor}) has no bfloat16: the "
                              "kernel takes float16 or float32 there")


def position_args(bias_table, bidirectional, num_buckets, max_distance, alibi_slopes, heads, bias_lut):
    """(lookup table or None, float32 slopes or None) of a call's position arguments, checked: at most one of the
    T5 table (gathered here), its lookup table, ALiBi's slopes."""
    if sum(x is not None for x in (bias_table, bias_lut, alibi_slopes)) > 1:
        raise ValueError("pass one of bias_table (T5), bias_lut (T5's, from relative_bias_lut) and alibi_slopes")
    if bias_table is not None:
        if tuple(bias_table.shape) != (num_buckets, heads):
            raise ValueError(f"bias_table must have shape (num_buckets, heads) = {(num_buckets, heads)}, "
                             f"got {tuple(bias_table.shape)}")
        bias_lut = relative_bias_lut(bias_table, bidirectional, num_buckets, max_distance)
    elif bias_lut is not None and (bias_lut.dim() != 2 or bias_lut.shape[0] != heads or bias_lut.shape[1] % 2 == 0
                                   or bias_lut.dtype != torch.float32 or bias_lut.stride(-1) != 1):
        raise ValueError(f"bias_lut must be relative_bias_lut's (heads, 2 * max_distance + 1) float32 table for "
                         f"{heads} heads, got {tuple(bias_lut.shape)} {bias_lut.dtype}")
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.float().contiguous()
    return bias_lut, alibi_slopes


def bias_kind(bias_lut, alibi_slopes):
    """(BIAS_TYPE, MAX_DIST) of the kernels for a call's (checked) position arguments."""
    if bias_lut is not None:
        return BIAS_LUT, (bias_lut.shape[1] - 1) // 2
    return (BIAS_ALIBI if alibi_slopes is not None else BIAS_NONE), 1


def last_dim_contiguous(query, key, value):
    """The kernels read rows with unit stride: anything else is copied (the others are passed as they are)."""
    if query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1:
        return query, key, value
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
