"""The Triton kernel against the fp64 torch reference: outputs and gradients of q, k, v and the bias table.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes are small but ragged:
lengths are not multiples of the 16-wide interpreter tiles (nor of the GPU tiles). Outputs are poisoned with NaN
before each call. With CUDA the same tests run on the GPU. With attention dropout, the reference applies the mask
that tests/references.py draws in torch from the same seed.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import KERNEL_DEVICE
from fat5.attention_positions_fat5 import alibi_slopes
from fat5.kernels import flash_attention_t5 as kernel_module
from fat5.kernels.flash_attention_t5 import (
    additive_key_mask,
    flash_attention_t5,
    flash_attention_t5_varlen,
    relative_bias_lut,
)
from fat5.reference_fat5 import dense_bias, relative_position_bucket, relative_positions
from fat5.reference_fat5 import eager_attention as flash_attention_t5_reference
from references import (
    attention_with_dropout_mask_reference,
    dropout_keep_mask_reference,
    flash_attention_t5_varlen_reference,
    philox4x32,
)

# fp32 inputs against the fp64 reference: |error| <= TOLERANCE * max |reference|.
FP32_TOLERANCE = 1e-4
# fp16 inputs (fp32 accumulation) against the fp64 reference.
FP16_TOLERANCE = 2e-2
NUM_BUCKETS, MAX_DISTANCE = 8, 12
INTERPRETED = KERNEL_DEVICE.type == "cpu"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON_OUTPUTS", True)


def close(actual, expected, tolerance, name):
    scale = expected.abs().max().item()
    error = (actual.double() - expected).abs().max().item()
    assert error <= tolerance * scale, f"{name}: max error {error:.3g} > {tolerance * scale:.3g}"


def inputs(batch, heads, query_length, key_length, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, query_length, head_dim, generator=generator).to(KERNEL_DEVICE, dtype)
    k = torch.randn(batch, heads, key_length, head_dim, generator=generator).to(KERNEL_DEVICE, dtype)
    v = torch.randn(batch, heads, key_length, head_dim, generator=generator).to(KERNEL_DEVICE, dtype)
    table = torch.randn(NUM_BUCKETS, heads, generator=generator).to(KERNEL_DEVICE)
    return q, k, v, table


def key_mask(batch, key_length):
    return torch.ones(batch, key_length, dtype=torch.bool, device=KERNEL_DEVICE)


def seed_tensor(seed=0, stream=0):
    """A dropout seed as the kernel takes it: (Philox key, stream) as a (2,) int64 tensor."""
    return torch.tensor([seed, stream], dtype=torch.int64, device=KERNEL_DEVICE)


def check_against_reference(q, k, v, table=None, tolerance=FP32_TOLERANCE, dropout_p=0.0, dropout_seed=None,
                            **kwargs):
    """Run kernel and fp64 reference forward and backward; compare output and every gradient. With dropout, the
    reference drops what `dropout_keep_mask_reference` draws from the same seed."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    bias = {}
    if table is not None:
        table_leaf, table_reference = table.clone().requires_grad_(), table.double().requires_grad_()
        bias = dict(num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    dropout = {}
    if dropout_p:
        dropout = dict(dropout_p=dropout_p, dropout_seed=dropout_seed)
    out = flash_attention_t5(*leaves, **bias, **kwargs, **dropout,
                             **({"bias_table": table_leaf} if table is not None else {}))
    if dropout_p:
        keep = dropout_keep_mask_reference(dropout_seed, dropout_p, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        expected, _ = attention_with_dropout_mask_reference(
            *reference_leaves, keep.to(KERNEL_DEVICE), dropout_p, **bias, **kwargs,
            **({"bias_table": table_reference} if table is not None else {}))
    else:
        expected = flash_attention_t5_reference(*reference_leaves, **bias, **kwargs,
                                                **({"bias_table": table_reference} if table is not None else {}))
    assert not out.isnan().any()
    close(out, expected, tolerance, "output")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(KERNEL_DEVICE, out.dtype)
    out.backward(grad)
    expected.backward(grad.double())
    for name, leaf, reference in zip("qkv", leaves, reference_leaves):
        assert not leaf.grad.isnan().any(), name
        close(leaf.grad, reference.grad, tolerance, f"d{name}")
    if table is not None:
        close(table_leaf.grad, table_reference.grad, tolerance, "d bias_table")


def test_bias_lut_matches_torch_bucketing_at_every_distance():
    for num_buckets, max_distance in ((8, 12), (32, 128), (32, 20), (16, 9)):
        table = torch.randn(num_buckets, 3)
        relative = torch.arange(-5 * max_distance, 5 * max_distance + 1)
        clamped = relative.clamp(-max_distance, max_distance) + max_distance
        for bidirectional in (True, False):
            lut = relative_bias_lut(table, bidirectional, num_buckets, max_distance)
            buckets = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
            assert torch.equal(lut[:, clamped], table[buckets].t())



def test_layers_sharing_one_lookup_table_and_key_mask_get_each_layers_result():
    """What a stack does: the lookup table and the additive key mask built once, given to every layer. Outputs are
    those of each layer building its own, and the table's gradient is the sum of the layers' (through one gather)."""
    q, k, v, table = inputs(2, 2, 37, 37, 32, seed=5)
    mask = key_mask(2, 37)
    mask[1, 29:] = False
    options = dict(bidirectional=True, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(KERNEL_DEVICE)
    own, shared = table.clone().requires_grad_(), table.clone().requires_grad_()
    separate = [flash_attention_t5(q * scale, k, v, bias_table=own, key_padding_mask=mask, **options)
                for scale in (1.0, 0.5)]
    lut = relative_bias_lut(shared, **options)
    additive = additive_key_mask(mask)
    together = [flash_attention_t5(q * scale, k, v, bias_lut=lut, key_mask=additive) for scale in (1.0, 0.5)]
    for first, second in zip(separate, together):
        assert torch.equal(first, second)
    sum((out * grad).sum() for out in separate).backward()
    sum((out * grad).sum() for out in together).backward()
    assert torch.allclose(shared.grad, own.grad, rtol=1e-5, atol=1e-6 * own.grad.abs().max().item())


@pytest.mark.parametrize("query_length, key_length, q_offset", [
    (37, 37, 0), (19, 45, 0), (50, 23, 0), (1, 300, 299), (4, 300, torch.tensor(140))])
def test_reference_dense_bias_buckets_every_query_key_pair_as_t5(query_length, key_length, q_offset):
    """The eager/SDPA bias is bucketed once per distance; it equals T5's bucketing of every (query, key) pair."""
    table = torch.randn(32, 3, dtype=torch.float64)
    relative = relative_positions(query_length, key_length, q_offset)
    for bidirectional in (True, False):
        expected = table[relative_position_bucket(relative, bidirectional, 32, 128)].permute(2, 0, 1)[None]
        actual = dense_bias(query_length, key_length, bias_table=table, bidirectional=bidirectional,
                            q_offset=q_offset)
        assert torch.equal(actual, expected)

@pytest.mark.parametrize("query_length, key_length", [(37, 37), (19, 45), (50, 23)])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_encoder_t5_bias_with_key_padding(query_length, key_length, padding):
    q, k, v, table = inputs(2, 3, query_length, key_length, 32)
    mask = key_mask(2, key_length)
    if padding == "right":
        mask[1, key_length - 9:] = False
    elif padding == "left":
        mask[0, :7] = False
    check_against_reference(q, k, v, table, key_padding_mask=None if padding == "none" else mask,
                            bidirectional=True)


@pytest.mark.parametrize("length", [33, 50])
def test_decoder_causal_one_directional_bias(length):
    q, k, v, table = inputs(2, 2, length, length, 32, seed=1)
    mask = key_mask(2, length)
    mask[1, length - 5:] = False
    check_against_reference(q, k, v, table, bidirectional=False, causal=True, key_padding_mask=mask)


@pytest.mark.parametrize("query_length, past", [(1, 40), (5, 29), (17, 3)])
def test_decoding_with_a_kv_cache_offset(query_length, past):
    q, k, v, table = inputs(2, 2, query_length, past + query_length, 32, seed=2)
    check_against_reference(q, k, v, table, bidirectional=False, causal=True, q_offset=past)


@pytest.mark.parametrize("query_length", range(1, 17))
def test_decode_steps_far_beyond_max_distance(query_length):
    """Lq = 1..16 new tokens after a cache three max_distances long: far-left, near-band and ragged key tiles,
    and query tiles mostly made of phantom rows."""
    past = 3 * MAX_DISTANCE + 5
    q, k, v, table = inputs(1, 1, query_length, past + query_length, 32, seed=20 + query_length)
    check_against_reference(q, k, v, table, bidirectional=False, causal=True, q_offset=past)


def test_long_sequence_uses_far_tiles_and_their_gradient():
    # 70 positions with max_distance 12: most 16x16 tiles are wholly beyond +-12 (one bias value each).
    q, k, v, table = inputs(1, 2, 70, 70, 32, seed=3)
    check_against_reference(q, k, v, table, bidirectional=True)
    check_against_reference(q, k, v, table, bidirectional=False, causal=True)
    # ALiBi splits its tiles the same way: left of, across and right of the diagonal.
    check_against_reference(q, k, v, alibi_slopes=alibi_slopes(2).to(KERNEL_DEVICE))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_dq_query_tiles_taller_than_key_tiles(monkeypatch, bidirectional):
    """dQ runs 128 x 32 tiles at head dim 128 on the GPU: its per-diagonal bias gradient then sums several groups
    of rows per tile. The same ragged shapes with 32 x 16 dQ tiles (far and near key tiles, padding, and a cache
    offset when causal)."""
    default_blocks = kernel_module._blocks
    kernels = []

    def blocks(head_dim, kernel, device, dropout=False, packed=False):
        kernels.append(kernel)
        return (32, 16, 1, 1) if kernel == "dq" else default_blocks(head_dim, kernel, device, dropout, packed)

    monkeypatch.setattr(kernel_module, "_blocks", blocks)
    past = 0 if bidirectional else 9
    q, k, v, table = inputs(2, 2, 61, past + 61, 32, seed=4)
    mask = key_mask(2, past + 61)
    mask[1, -6:] = False
    check_against_reference(q, k, v, table, bidirectional=bidirectional, causal=not bidirectional, q_offset=past,
                            key_padding_mask=mask)
    assert "dq" in kernels


def test_packed_rows_and_dropout_ask_for_their_tiles(monkeypatch):
    """The backward of packed rows (varlen) takes the chip's packed tiles (Hopper's at d = 64 differ: the sequence
    bounds' registers), padded batches the plain ones; the forward has one set. With dropout, every kernel takes the
    chip's dropout tiles (Blackwell's forward at d = 64 differs: the tiles built without spills)."""
    asked, default_blocks = [], kernel_module._blocks

    def blocks(head_dim, kernel, device, dropout=False, packed=False):
        asked.append((kernel, packed, dropout))
        return default_blocks(head_dim, kernel, device, dropout, packed)

    monkeypatch.setattr(kernel_module, "_blocks", blocks)
    q, k, v, table = (t.requires_grad_() for t in inputs(1, 2, 12, 12, 32, seed=3))
    options = dict(bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    flash_attention_t5(q, k, v, **options).sum().backward()
    assert asked == [("forward", False, False), ("dkdv", False, False), ("dq", False, False)]
    asked.clear()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=KERNEL_DEVICE)
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
    flash_attention_t5_varlen(*packed, cu, cu, 7, 7, **options).sum().backward()
    assert asked == [("forward", False, False), ("dkdv", True, False), ("dq", True, False)]
    asked.clear()
    flash_attention_t5(q, k, v, **options, dropout_p=0.1).sum().backward()
    assert asked == [("forward", False, True), ("dkdv", False, True), ("dq", False, True)]
    assert kernel_module.chip_tiles(90, "dq", 64, packed=True) != kernel_module.chip_tiles(90, "dq", 64)
    assert kernel_module.chip_tiles(80, "dq", 64, packed=True) == kernel_module.chip_tiles(80, "dq", 64)
    assert kernel_module.chip_tiles(100, "forward", 64, dropout=True) != kernel_module.chip_tiles(100, "forward", 64)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi(causal):
    q, k, v, _ = inputs(2, 4, 29, 29, 32, seed=4)
    mask = key_mask(2, 29)
    mask[0, 20:] = False
    check_against_reference(q, k, v, alibi_slopes=alibi_slopes(4).to(KERNEL_DEVICE), causal=causal,
                            key_padding_mask=mask)


def test_no_bias_cross_attention_and_explicit_scale():
    q, k, v, _ = inputs(2, 2, 21, 34, 32, seed=5)
    mask = key_mask(2, 34)
    mask[1, 25:] = False
    check_against_reference(q, k, v, key_padding_mask=mask, scale=32 ** -0.5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_larger_head_dims(head_dim):
    q, k, v, table = inputs(1, 2, 20, 20, head_dim, seed=6)
    check_against_reference(q, k, v, table, bidirectional=True)


def test_fully_masked_rows_return_zeros():
    q, k, v, table = inputs(3, 2, 18, 18, 32, seed=8)
    mask = key_mask(3, 18)
    mask[1, :4] = False  # left padding: causal rows 0..3 of sequence 1 see no key
    mask[2] = False  # a fully padded sequence: no row sees any key
    out = flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE,
                             bidirectional=False, causal=True, key_padding_mask=mask)
    assert torch.equal(out[1, :, :4], torch.zeros_like(out[1, :, :4]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    check_against_reference(q, k, v, table, bidirectional=False, causal=True, key_padding_mask=mask)


@pytest.mark.parametrize("dtype", [
    torch.float16,
    # Checked on triton 3.9: the interpreter's tl.dot returns garbage (errors ~1e10) for bf16 operands, while a
    # plain bf16 load/store is exact; bf16 is covered on GPU by test_realistic_sizes_in_half_precision_on_gpu.
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="Triton interpreter: bf16 tl.dot")),
])
def test_half_precision_inputs_accumulate_in_fp32(dtype):
    q, k, v, table = inputs(1, 2, 33, 33, 32, dtype=dtype, seed=9)
    check_against_reference(q, k, v, table, tolerance=FP16_TOLERANCE, bidirectional=True)


@pytest.mark.parametrize("bias, causal, key_lengths", [
    ("t5", False, None),
    ("t5", True, None),
    ("alibi", True, None),
    ("none", False, [5, 20, 1, 33]),  # cross attention: other key lengths
    ("t5", False, [40, 3, 12, 9]),
])
def test_varlen_packed_sequences_never_see_each_other(bias, causal, key_lengths):
    check_varlen_against_reference(bias, causal, key_lengths, seed=10)


def check_varlen_against_reference(bias, causal, key_lengths, seed, dropout_p=0.0, dropout_seed=None):
    """Four packed sequences of ragged lengths through the varlen kernel against its fp64 reference: output and
    every gradient; with dropout, the reference drops the mask drawn by `dropout_keep_mask_reference`."""
    query_lengths = [17, 1, 30, 9]
    key_lengths = key_lengths or query_lengths
    cu_q, cu_k = (torch.tensor([0] + n, device=KERNEL_DEVICE).cumsum(0).to(torch.int32)
                  for n in (query_lengths, key_lengths))
    heads, dim = 3, 32
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(query_lengths), heads, dim, generator=generator).to(KERNEL_DEVICE)
    k, v = (torch.randn(sum(key_lengths), heads, dim, generator=generator).to(KERNEL_DEVICE) for _ in range(2))
    table = torch.randn(NUM_BUCKETS, heads, generator=generator).to(KERNEL_DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    references = [t.double().requires_grad_() for t in (q, k, v, table)]
    options = dict(causal=causal)
    if bias == "t5":
        options.update(num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE, bidirectional=not causal)
    elif bias == "alibi":
        options.update(alibi_slopes=alibi_slopes(heads).to(KERNEL_DEVICE))
    table_leaf = {"bias_table": leaves[3]} if bias == "t5" else {}
    table_reference = {"bias_table": references[3]} if bias == "t5" else {}
    lengths = (cu_q, cu_k, max(query_lengths), max(key_lengths))
    dropout, reference_dropout = {}, {}
    if dropout_p:
        keep = dropout_keep_mask_reference(dropout_seed, dropout_p, len(query_lengths), heads, max(query_lengths),
                                           max(key_lengths)).to(KERNEL_DEVICE)
        dropout, reference_dropout = dict(dropout_p=dropout_p, dropout_seed=dropout_seed), dict(
            dropout_keep=keep, dropout_p=dropout_p)
    out = flash_attention_t5_varlen(*leaves[:3], *lengths, **options, **table_leaf, **dropout)
    expected = flash_attention_t5_varlen_reference(*references[:3], *lengths, **options, **table_reference,
                                                   **reference_dropout)
    close(out, expected, FP32_TOLERANCE, "output")
    grad = torch.randn(out.shape, generator=generator).to(KERNEL_DEVICE)
    out.backward(grad)
    expected.backward(grad.double())
    names = ["dq", "dk", "dv", "d bias_table"] if bias == "t5" else ["dq", "dk", "dv"]
    for name, leaf, reference in zip(names, leaves, references):
        close(leaf.grad, reference.grad, FP32_TOLERANCE, name)


def test_non_contiguous_inputs_as_the_model_passes_them():
    batch, length, heads, dim = 2, 23, 2, 32
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, length, heads, dim, generator=generator).to(KERNEL_DEVICE).transpose(1, 2)
               for _ in range(3))
    assert not q.is_contiguous()
    _, _, _, table = inputs(batch, heads, length, length, dim)
    check_against_reference(q, k, v, table, bidirectional=True)


@pytest.mark.parametrize("make, message", [
    (lambda q, k, v, t: flash_attention_t5(*(x.new_zeros(2, 2, 8, 48) for x in (q, k, v))), "head dims"),
    (lambda q, k, v, t: flash_attention_t5(q, k[:, :1], v[:, :1]), "key and value must be"),
    (lambda q, k, v, t: flash_attention_t5(q, k, v, bias_table=t[:5], num_buckets=NUM_BUCKETS), "bias_table must"),
    (lambda q, k, v, t: flash_attention_t5(q, k, v, key_padding_mask=key_mask(2, 3)),
     "key_padding_mask must"),
    (lambda q, k, v, t: flash_attention_t5(q, k.double(), v), "must share one of"),
    (lambda q, k, v, t: flash_attention_t5(q, k, v, bias_table=t, num_buckets=NUM_BUCKETS,
                                           bias_lut=relative_bias_lut(t, True, NUM_BUCKETS, 4)), "pass one of"),
    (lambda q, k, v, t: flash_attention_t5(q, k, v, bias_lut=torch.zeros(2, 8, device=q.device)), "bias_lut must"),
    (lambda q, k, v, t: flash_attention_t5(q, k, v, key_padding_mask=key_mask(2, 8),
                                           key_mask=additive_key_mask(key_mask(2, 8))), "not both"),
    (lambda q, k, v, t: flash_attention_t5(q, k, v, key_mask=additive_key_mask(key_mask(2, 5))), "key_mask must"),
])
def test_bad_inputs_raise_clear_errors(make, message):
    """Head dim 48, mismatched heads, wrong table or mask shapes, mixed dtypes, a table given twice."""
    q, k, v, table = inputs(2, 2, 8, 8, 32)
    with pytest.raises(ValueError, match=message):
        make(q, k, v, table)


class _LaunchRecorder:
    """Stands in for a Triton kernel: records the grid of each launch instead of running it."""

    def __init__(self, name, grids):
        self.name, self.grids = name, grids

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.grids.append((self.name, tuple(grid)))


def test_more_than_65535_batch_heads_launch_within_cuda_grid_limits(monkeypatch):
    """CUDA caps grid axes 1 and 2 at 65535 programs: batch * heads (varlen: sequences * heads) goes on axis 0.
    The interpreter has no such cap and would take an hour for 70k programs, so the launches are recorded
    here; test_many_heads_and_offsets_past_2_31_on_gpu runs them."""
    grids = []
    for name in ("_forward_kernel", "_backward_delta_kernel", "_backward_dkdv_kernel", "_backward_dq_kernel"):
        monkeypatch.setattr(kernel_module, name, _LaunchRecorder(name, grids))
    batch, heads = 2, 35_000
    q, k, v = (torch.zeros(batch, heads, 3, 32, requires_grad=True) for _ in range(3))
    table = torch.zeros(NUM_BUCKETS, heads, requires_grad=True)
    flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE).sum().backward()
    cu = torch.arange(0, 2 * 70_000 + 1, 2, dtype=torch.int32)
    packed = torch.zeros(2 * 70_000, 1, 32)
    flash_attention_t5_varlen(packed, packed, packed, cu, cu, 2, 2)
    assert {name for name, _ in grids} == {"_forward_kernel", "_backward_delta_kernel", "_backward_dkdv_kernel",
                                           "_backward_dq_kernel"}
    for name, grid in grids:
        assert grid[0] == 70_000, (name, grid)
        assert all(size <= 65535 for size in grid[1:]), (name, grid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_many_heads_and_offsets_past_2_31_on_gpu():
    """batch * heads = 262,144 programs and (B, H, L, D) tensors of 2^31 + 2^25 elements (4.3 GB in bf16): the
    last batch entry, whose offsets pass 2^31, must match the same kernel run on that entry alone, bit for bit."""
    batch, heads, length, dim = 2**14 + 2**8, 16, 128, 64
    assert batch * heads * length * dim > 2**31
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    table = torch.randn(32, heads, device="cuda", generator=generator)
    options = dict(bias_table=table, bidirectional=False, causal=True)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention_t5(*leaves, **options)
    grad = torch.randn(out.shape[1:], device="cuda", dtype=out.dtype, generator=generator)
    out[-1].backward(grad)
    alone = [t[-1:].detach().clone().requires_grad_() for t in (q, k, v)]
    expected = flash_attention_t5(*alone, **options)
    expected.backward(grad[None])
    assert torch.equal(out[-1:], expected)
    for leaf, single in zip(leaves, alone):
        assert torch.equal(leaf.grad[-1:], single.grad)


def test_torch_compile_traces_the_op_in_one_graph():
    q, k, v, table = inputs(1, 2, 20, 20, 32)
    table = table.requires_grad_()

    def attention(q, k, v, table):
        return flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, table)
    close(out, flash_attention_t5_reference(q.double(), k.double(), v.double(), bias_table=table.double(),
                                            num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE),
          FP32_TOLERANCE, "compiled output")
    out.sum().backward()
    reference_table = table.detach().double().requires_grad_()
    flash_attention_t5_reference(q.double(), k.double(), v.double(), bias_table=reference_table,
                                 num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE).sum().backward()
    close(table.grad, reference_table.grad, FP32_TOLERANCE, "compiled d bias_table")


def test_missing_triton_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # None makes `import triton` fail
    monkeypatch.delitem(sys.modules, kernel_module.__name__)
    with pytest.raises(ImportError, match="pip install triton"):
        importlib.import_module(kernel_module.__name__)


# A compiled graph views the real output with the fake's layout: a fake that kept the strides of the transposed view
# the model passes broke the whole-model compiled training step with more than one head.
def test_fake_output_has_the_real_output_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def transposed_query():  # (B, L, H, D) storage seen as (B, H, L, D), as the model's projections give it
        return torch.randn(1, 20, 2, 32, device=KERNEL_DEVICE).transpose(1, 2)

    real = flash_attention_t5(transposed_query(), transposed_query(), transposed_query())
    with FakeTensorMode():
        fake = flash_attention_t5(transposed_query(), transposed_query(), transposed_query())
    assert fake.shape == real.shape and fake.stride() == real.stride()


def test_fake_implementation_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 3, 40, 64)
        out = flash_attention_t5(q, q, q)
    assert out.shape == (2, 3, 40, 64)


HALF_PRECISION = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def check_half_precision(ours, reference, tensors):
    """`ours(*leaves)` against `reference` on the same tensors in their own precision and in fp64: our error within
    twice torch's low-precision error (plus 1e-3 of the magnitude), output and the gradient of every tensor."""
    runs = [(ours, [t.clone().requires_grad_() for t in tensors]),
            (reference, [t.clone().requires_grad_() for t in tensors]),
            (reference, [t.double().requires_grad_() for t in tensors])]
    outputs = [function(*leaves) for function, leaves in runs]
    grad = torch.randn(outputs[0].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1),
                       dtype=outputs[0].dtype)
    for out in outputs:
        out.backward(grad.to(out.dtype))
    pairs = [(*outputs, "output")] + [(*(leaves[i].grad for _, leaves in runs), f"gradient {i}")
                                      for i in range(len(tensors))]
    for mine, torch_low, exact, name in pairs:
        our_error = (mine.double() - exact).abs().max().item()
        torch_error = (torch_low.double() - exact).abs().max().item()
        assert our_error <= 2 * torch_error + 1e-3 * exact.abs().max().item(), \
            f"{name}: {our_error:.3g} vs torch's {torch_error:.3g}"


def realistic_tensors(dtype, query_rows, key_rows, heads=12, batch_shape=(2,), packed=False):
    """q, k, v at T5-base heads (d = 64) in `dtype` and a fp32 bias table, on CUDA; packed: (total, H, D)."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(rows):
        shape = (rows, heads, 64) if packed else (*batch_shape, heads, rows, 64)
        return torch.randn(shape, device="cuda", generator=generator, dtype=dtype)

    return draw(query_rows), draw(key_rows), draw(key_rows), torch.randn(32, heads, device="cuda",
                                                                         generator=generator)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", HALF_PRECISION)
@pytest.mark.parametrize("case", ["encoder-1000", "encoder-2048", "decoder-1000", "decoder-2048", "packed", "decode"])
def test_realistic_sizes_in_half_precision_on_gpu(dtype, case):
    """bf16 and fp16 at T5-base shapes on the GPU's tiles: padded encoder and decoder (a row with 100 padded keys;
    lengths off and on the tiles), packed sequences of ragged lengths, and 16 decode steps at the end of a 2048-key
    cache (q_offset)."""
    if case == "packed":
        lengths = [1000, 37, 1011]
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
        options = dict(num_buckets=32, max_distance=128)

        def ours(q, k, v, table):
            return flash_attention_t5_varlen(q, k, v, cu, cu, max(lengths), max(lengths), bias_table=table, **options)

        def reference(q, k, v, table):
            return flash_attention_t5_varlen_reference(q, k, v, cu, cu, max(lengths), max(lengths), bias_table=table,
                                                       **options)

        check_half_precision(ours, reference, realistic_tensors(dtype, sum(lengths), sum(lengths), packed=True))
        return
    kind, length = case.split("-") if "-" in case else (case, 2048)
    query_length = 16 if kind == "decode" else int(length)
    causal = kind != "encoder"
    mask = torch.ones(2, int(length), dtype=torch.bool, device="cuda")
    mask[1, int(length) - 100:] = False
    options = dict(bidirectional=not causal, causal=causal, key_padding_mask=mask,
                   q_offset=int(length) - query_length)

    def ours(q, k, v, table):
        return flash_attention_t5(q, k, v, bias_table=table, **options)

    def reference(q, k, v, table):
        return flash_attention_t5_reference(q, k, v, bias_table=table, **options)

    check_half_precision(ours, reference, realistic_tensors(dtype, query_length, int(length)))


# ---- Attention dropout in the kernels (issue 25) ----------------------------------------------------------------


def test_philox_is_random123s_and_the_kernels_is_tritons():
    """The torch reference is Philox4x32 as Random123 publishes it (its known-answer vectors, 10 rounds), and the
    kernels' Philox (one 64-bit product per multiply) computes tl.philox's words at the kernels' round count."""
    known_answers = [  # counter, key, words (Random123's kat_vectors, philox4x32 10 rounds)
        ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, words in known_answers:
        assert [int(w) for w in philox4x32([torch.tensor([c]) for c in counter], key, rounds=10)] == words

    import triton
    import triton.language as tl

    @triton.jit
    def both_philox(SEED, OUT, ROUNDS: tl.constexpr):
        offsets = tl.arange(0, 64)
        c0 = offsets.to(tl.uint32) * 2654435761
        c1 = offsets.to(tl.uint32) * 7 + 3
        c2 = offsets.to(tl.uint32) ^ 0xF0F0F0F0
        c3 = offsets.to(tl.uint32) * 0 + 0xDEADBEEF
        seed = tl.load(SEED)
        ours = kernel_module._philox4x32(c0, c1, c2, c3, seed.to(tl.uint32), (seed >> 32).to(tl.uint32), ROUNDS)
        theirs = tl.philox(seed, c0, c1, c2, c3, ROUNDS)
        for index in tl.static_range(4):
            tl.store(OUT + index * 64 + offsets, ours[index].to(tl.int64))
            tl.store(OUT + 256 + index * 64 + offsets, theirs[index].to(tl.int64))

    seed = torch.tensor([-8551031580637462797], dtype=torch.int64, device=KERNEL_DEVICE)
    out = torch.zeros(512, dtype=torch.int64, device=KERNEL_DEVICE)
    both_philox[(1,)](seed, out, ROUNDS=kernel_module.PHILOX_ROUNDS)
    assert torch.equal(out[:256], out[256:])
    offsets = torch.arange(64)
    key = -8551031580637462797 & 0xFFFFFFFFFFFFFFFF
    words = philox4x32([(offsets * 2654435761) & 0xFFFFFFFF, offsets * 7 + 3, offsets ^ 0xF0F0F0F0,
                        torch.full((64,), 0xDEADBEEF)], (key & 0xFFFFFFFF, key >> 32), kernel_module.PHILOX_ROUNDS)
    assert torch.equal(torch.cat(words), out[:256].cpu())


# The slow tier (python -m pytest -m slow) holds the costlier kernel sweeps; each test keeps cases in the default.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", [
    "encoder_left_padding", "decoder_causal", "decode_offset", "decode_far_beyond", "alibi", "cross_no_bias_scale",
    "head_dim_64", "head_dim_128", "fp16",
    *(pytest.param(case, marks=SLOW)
      for case in ("encoder_right_padding", "alibi_causal", "long_far_tiles", "fully_masked_rows")),
])
def test_dropout_matches_the_mask_a_reference_draws(case):
    """Output and every gradient (q, k, v, bias table) equal the fp64 reference that drops the mask drawn in torch
    from the same seed, on every bias, causal and not, with padding and decode offsets."""
    seed = seed_tensor(1234567890123 + len(case), 77 + len(case))
    dropout = dict(dropout_p=0.3 if case != "long_far_tiles" else 0.1, dropout_seed=seed)
    if case.startswith("encoder"):
        q, k, v, table = inputs(2, 3, 37, 45, 32, seed=30)
        mask = key_mask(2, 45)
        if case == "encoder_right_padding":
            mask[1, 36:] = False
        else:
            mask[0, :7] = False
        check_against_reference(q, k, v, table, key_padding_mask=mask, bidirectional=True, **dropout)
    elif case == "decoder_causal":
        q, k, v, table = inputs(2, 2, 33, 33, 32, seed=31)
        mask = key_mask(2, 33)
        mask[1, 28:] = False
        check_against_reference(q, k, v, table, bidirectional=False, causal=True, key_padding_mask=mask, **dropout)
    elif case == "decode_offset":
        q, k, v, table = inputs(2, 2, 5, 34, 32, seed=32)
        check_against_reference(q, k, v, table, bidirectional=False, causal=True, q_offset=29, **dropout)
    elif case == "decode_far_beyond":
        past = 3 * MAX_DISTANCE + 5
        q, k, v, table = inputs(1, 2, 3, past + 3, 32, seed=33)
        check_against_reference(q, k, v, table, bidirectional=False, causal=True, q_offset=past, **dropout)
    elif case.startswith("alibi"):
        q, k, v, _ = inputs(2, 4, 29, 29, 32, seed=34)
        mask = key_mask(2, 29)
        mask[0, 20:] = False
        check_against_reference(q, k, v, alibi_slopes=alibi_slopes(4).to(KERNEL_DEVICE), causal=case == "alibi_causal",
                                key_padding_mask=mask, **dropout)
    elif case == "cross_no_bias_scale":
        q, k, v, _ = inputs(2, 2, 21, 34, 32, seed=35)
        mask = key_mask(2, 34)
        mask[1, 25:] = False
        check_against_reference(q, k, v, key_padding_mask=mask, scale=32 ** -0.5, **dropout)
    elif case == "long_far_tiles":
        q, k, v, table = inputs(1, 2, 70, 70, 32, seed=36)
        check_against_reference(q, k, v, table, bidirectional=True, **dropout)
    elif case.startswith("head_dim"):
        q, k, v, table = inputs(1, 2, 20, 23, int(case.rsplit("_", 1)[1]), seed=37)
        check_against_reference(q, k, v, table, bidirectional=True, **dropout)
    elif case == "fully_masked_rows":
        q, k, v, table = inputs(3, 2, 18, 18, 32, seed=38)
        mask = key_mask(3, 18)
        mask[1, :4] = False
        mask[2] = False
        check_against_reference(q, k, v, table, bidirectional=False, causal=True, key_padding_mask=mask, **dropout)
    else:
        q, k, v, table = inputs(1, 2, 33, 33, 32, dtype=torch.float16, seed=39)
        check_against_reference(q, k, v, table, tolerance=FP16_TOLERANCE, bidirectional=True, **dropout)


@pytest.mark.parametrize("bidirectional", [True, pytest.param(False, marks=SLOW)])
def test_dropout_with_dq_tiles_taller_than_key_tiles(monkeypatch, bidirectional):
    """The near band's per-diagonal table gradient with dropout, on 32 x 16 dQ tiles (GPU dQ tiles are 128 x 32)."""
    default_blocks = kernel_module._blocks

    def blocks(head_dim, kernel, device, dropout=False, packed=False):
        return (32, 16, 1, 1) if kernel == "dq" else default_blocks(head_dim, kernel, device, dropout, packed)

    monkeypatch.setattr(kernel_module, "_blocks", blocks)
    past = 0 if bidirectional else 9
    q, k, v, table = inputs(2, 2, 61, past + 61, 32, seed=40)
    mask = key_mask(2, past + 61)
    mask[1, -6:] = False
    check_against_reference(q, k, v, table, bidirectional=bidirectional, causal=not bidirectional, q_offset=past,
                            key_padding_mask=mask, dropout_p=0.2, dropout_seed=seed_tensor(41, 42))


# The GPU's tiles: (forward, dK/dV, dQ) (BLOCK_M, BLOCK_N). The interpreter's default 16-wide key tiles take the
# kernel's half-group branch; these take the 32- and 64-wide ones (one and two Philox groups per row).
GPU_SIZED_TILES = {"d64": {"forward": (128, 64), "dkdv": (128, 64), "dq": (128, 32)},
                   "d128": {"forward": (128, 32), "dkdv": (128, 32), "dq": (128, 32)},
                   "mixed": {"forward": (32, 32), "dkdv": (32, 64), "dq": (64, 64)}}


@pytest.mark.parametrize("causal, tiles", [
    (False, "d64"), pytest.param(False, "d128", marks=SLOW), pytest.param(False, "mixed", marks=SLOW),
    pytest.param(True, "d64", marks=SLOW), (True, "d128"), pytest.param(True, "mixed", marks=SLOW),
])
def test_dropout_on_gpu_sized_tiles(monkeypatch, tiles, causal):
    """The same mask whatever the tiles (it is a function of the pair alone): forward and backward on the GPU's
    32- and 64-wide key tiles, against the reference, on ragged lengths with padding."""
    def blocks(head_dim, kernel, device, dropout=False, packed=False):
        return (*GPU_SIZED_TILES[tiles][kernel], 1, 1)

    monkeypatch.setattr(kernel_module, "_blocks", blocks)
    q, k, v, table = inputs(2, 2, 75, 90 if not causal else 75, 32, seed=48)
    mask = key_mask(2, k.shape[2])
    mask[1, -11:] = False
    check_against_reference(q, k, v, table, bidirectional=not causal, causal=causal, key_padding_mask=mask,
                            dropout_p=0.15, dropout_seed=seed_tensor(2**61 + 17, 2**31 + 5))


@pytest.mark.parametrize("bias, causal, key_lengths", [
    ("t5", False, None),
    pytest.param("alibi", True, None, marks=SLOW),
    pytest.param("t5", False, [40, 3, 12, 9], marks=SLOW),  # cross attention: other key lengths
])
def test_dropout_in_varlen_packed_sequences(bias, causal, key_lengths):
    """Packed sequence n draws the mask of batch entry n, rows and columns counted from its own start."""
    check_varlen_against_reference(bias, causal, key_lengths, seed=43, dropout_p=0.25,
                                   dropout_seed=seed_tensor(2**40 + 3, 5))


def observed_masks(dropout_p, draws, batch=2, heads=2, query_length=48, key_length=32, dtype=torch.float32):
    """The kernel's masks of `draws` calls, each seeded from torch's generator, read back (to the rounding of
    `dtype`): with q = k = 0 every probability is 1 / Lk, and with V the identity the output row is the kept
    columns times 1 / (Lk (1 - p))."""
    q = torch.zeros(batch, heads, query_length, key_length, device=KERNEL_DEVICE, dtype=dtype)
    k = torch.zeros(batch, heads, key_length, key_length, device=KERNEL_DEVICE, dtype=dtype)
    v = torch.eye(key_length, device=KERNEL_DEVICE, dtype=dtype).expand(batch, heads, key_length,
                                                                        key_length).contiguous()
    outputs = [flash_attention_t5(q, k, v, dropout_p=dropout_p) for _ in range(draws)]
    return torch.stack(outputs).float() * key_length * (1 - dropout_p)


@SLOW
@pytest.mark.parametrize("dropout_p", [0.1, 0.6])
def test_dropout_keep_rate_is_within_binomial_bounds(dropout_p):
    """Over many draws the kept fraction is 1 - p within 5 standard deviations (p as the kernel rounds it to 16
    bits, 2**-17 away at most), overall and for each key column of a Philox group (each reads its own half-word);
    kept values are scaled by exactly 1 / (1 - p). On CUDA in fp16 at T5-base heads on the GPU's tiles (the
    rounding of fp16 outputs), in the interpreter in fp32."""
    torch.manual_seed(0)
    on_gpu = KERNEL_DEVICE.type == "cuda"
    sizes = dict(heads=12, query_length=1000, key_length=64, dtype=torch.float16) if on_gpu else {}
    masks = observed_masks(dropout_p, draws=12, **sizes)
    kept = masks > 0.5
    assert torch.allclose(masks[kept], torch.ones((), device=masks.device), rtol=2e-3 if on_gpu else 1e-6)
    assert torch.equal(masks[~kept], masks[~kept] * 0)
    keep_rate = 1 - round(dropout_p * 2**16) / 2**16
    assert abs(keep_rate - (1 - dropout_p)) <= 2**-17
    columns = kept.movedim(-1, 0).reshape(kept.shape[-1], -1).double()

    def within_bounds(rate, count):
        return abs(rate - keep_rate) <= 5 * (keep_rate * (1 - keep_rate) / count) ** 0.5

    assert within_bounds(columns.mean().item(), columns.numel()), columns.mean().item()
    for column, rates in enumerate(columns.mean(dim=1).tolist()):
        assert within_bounds(rates, columns.shape[1]), (column, rates)
    # Neighbouring pairs share a Philox word: their decisions must still be independent (correlation ~ 0).
    first, second = columns[0::2].flatten(), columns[1::2].flatten()
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1].item()
    assert abs(correlation) <= 5 / first.numel() ** 0.5, correlation


def test_zero_dropout_runs_todays_kernel_and_draws_nothing(monkeypatch):
    """p = 0 launches the kernels with DROPOUT=False (the kernel without dropout, bit for bit) and leaves torch's
    generator untouched; p > 0 launches DROPOUT=True."""
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["DROPOUT"])
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_forward_kernel", "_backward_dkdv_kernel", "_backward_dq_kernel"):
        monkeypatch.setattr(kernel_module, name, Recorder(getattr(kernel_module, name)))
    q, k, v, table = inputs(1, 2, 20, 20, 32, seed=44)
    options = dict(bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    results = []
    for dropout in ({}, {"dropout_p": 0.0}):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        state = torch.get_rng_state()
        out = flash_attention_t5(*leaves, **options, **dropout)
        out.sum().backward()
        assert torch.equal(torch.get_rng_state(), state)
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for without, zero in zip(*results):
        assert torch.equal(without, zero)
    assert launches == [False] * 6
    launches.clear()
    flash_attention_t5(q.requires_grad_(), k, v, **options, dropout_p=0.1).sum().backward()
    assert launches == [True] * 3


def test_dropout_seeds_reproduce_and_differ():
    """The same seed gives the same output and gradients bit for bit, torch.manual_seed reproduces the drawn seed,
    and other seeds give other masks."""
    q, k, v, table = inputs(1, 2, 24, 24, 32, seed=45)
    options = dict(bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE, dropout_p=0.2)

    def run(**seed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention_t5(*leaves, **options, **seed)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    def same(first, second):
        return all(torch.equal(a, b) for a, b in zip(first, second))

    assert same(run(dropout_seed=seed_tensor(5, 6)), run(dropout_seed=seed_tensor(5, 6)))
    assert not torch.equal(run(dropout_seed=seed_tensor(5, 6))[0], run(dropout_seed=seed_tensor(5, 7))[0])
    assert not torch.equal(run(dropout_seed=seed_tensor(5, 6))[0], run(dropout_seed=seed_tensor(6, 6))[0])
    torch.manual_seed(11)
    first = run()
    torch.manual_seed(11)
    assert same(first, run())
    assert not torch.equal(first[0], run()[0])


@SLOW  # the default tier has test_gpu_model's reduced gradient-checkpointing test
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_mask(use_reentrant):
    """torch.utils.checkpoint (transformers', FSDP's) restores torch's generator before recomputing, so the
    recomputed forward draws the same seed: every gradient equals the uncheckpointed one bit for bit."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, table = inputs(2, 2, 21, 21, 32, seed=46)

    def attention(q, k, v, table):
        hidden = flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE,
                                    dropout_p=0.3)
        return flash_attention_t5(hidden, k, v, dropout_p=0.3, causal=True)  # two draws in one checkpoint

    results = []
    for checkpointed in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
        torch.manual_seed(12)
        out = checkpoint(attention, *leaves, use_reentrant=use_reentrant) if checkpointed else attention(*leaves)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for name, plain, recomputed in zip(["output", "dq", "dk", "dv", "d bias_table"], *results):
        assert torch.equal(plain, recomputed), name


def test_torch_compile_traces_dropout_in_one_graph():
    """fullgraph=True over the seed draw and the op; under the same torch.manual_seed the compiled call draws the
    seed the eager call draws, so outputs and the table gradient match."""
    q, k, v, table = inputs(1, 2, 20, 20, 32, seed=47)

    def attention(q, k, v, table):
        return flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE,
                                  dropout_p=0.25)

    results = []
    for function in (attention, torch.compile(attention, backend="aot_eager", fullgraph=True)):
        leaf = table.clone().requires_grad_()
        torch.manual_seed(13)
        out = function(q, k, v, leaf)
        out.sum().backward()
        results.append((out.detach(), leaf.grad))
    close(results[1][0], results[0][0].double(), FP32_TOLERANCE, "compiled output")
    close(results[1][1], results[0][1].double(), FP32_TOLERANCE, "compiled d bias_table")


@pytest.mark.parametrize("make, message", [
    (lambda q: flash_attention_t5(q, q, q, dropout_p=1.0), "dropout_p must be in"),
    (lambda q: flash_attention_t5(q, q, q, dropout_p=-0.1), "dropout_p must be in"),
    (lambda q: flash_attention_t5(q, q, q, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int32)),
     "dropout_seed must be"),
])
def test_bad_dropout_arguments_raise_clear_errors(make, message):
    q, _, _, _ = inputs(1, 1, 8, 8, 32)
    with pytest.raises(ValueError, match=message):
        make(q)


def test_a_strided_dropout_seed_is_read_as_its_values():
    """The kernels read the Philox key at SEED and the stream at SEED + 1: a strided (2,) view gives the mask of
    its values, not of the memory beside them."""
    q, k, v, table = inputs(1, 2, 20, 20, 32, seed=48)
    options = dict(bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE, dropout_p=0.3)
    strided = torch.tensor([5, 99, 6, 98], dtype=torch.int64, device=KERNEL_DEVICE)[::2]
    assert not strided.is_contiguous()
    assert torch.equal(flash_attention_t5(q, k, v, **options, dropout_seed=strided),
                       flash_attention_t5(q, k, v, **options, dropout_seed=seed_tensor(5, 6)))


# Runs without the interpreter: records the kernels' launches (on CPU tensors, nothing runs), asks each kernel's
# own argument binder how Triton would specialise them for an sm_90 GPU, and compiles the forward for it.
SPECIALISATION = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from fat5.kernels import flash_attention_t5 as kernel_module

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
launches = []


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


for name in ("_forward_kernel", "_backward_delta_kernel", "_backward_dkdv_kernel", "_backward_dq_kernel"):
    setattr(kernel_module, name, Recorder(getattr(kernel_module, name)))
q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
lut = kernel_module.relative_bias_lut(torch.randn(32, 2), True, 32, 128)
found = {}
for p in map(float, sys.argv[1:]):
    launches.clear()
    dropout_p, seed = kernel_module._dropout_inputs(p, torch.tensor([3, 4]), q.device)
    _, lse = kernel_module._flash_attention_forward(q, q, q, lut, None, None, None, None, 64, 64, False, 0, 1.0,
                                                    dropout_p, seed)
    kernel_module._flash_attention_backward(q, q, q, q, q, lse, lut, None, None, None, None, 64, 64, False, 0, 1.0,
                                            dropout_p, seed)
    for kernel, args, kwargs in launches:
        if "dropout_threshold" in kernel.arg_names:
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            found[f"{p} {kernel.fn.__name__}"] = specialization[kernel.arg_names.index("dropout_threshold")]
            if p == float(sys.argv[1]) and kernel.fn.__name__ == "_forward_kernel":  # the first p's forward
                options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization,
                                                                          options)
                triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
print(json.dumps(found))
"""


def test_every_dropout_threshold_compiles_as_one_runtime_argument():
    """Triton compiles an int argument equal to 1 as a constant (the interpreter never does): 7.6e-6 <= p < 2.3e-5
    rounds to a 16-bit threshold of 1, on which the kernels' `.to` failed to compile. The threshold stays an i32
    argument whatever p is (no variant per value either), and the forward compiles for sm_90 at p = 1e-5."""
    probabilities = [1e-5, 2**-16, 0.1, 0.5]
    assert [round(p * 2**16) for p in probabilities] == [1, 1, 6554, 32768]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", SPECIALISATION, *map(str, probabilities)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(found) == 3 * len(probabilities)
    assert {tuple(specialisation) for specialisation in found.values()} == {("i32", None)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", HALF_PRECISION)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_at_realistic_sizes_in_half_precision_on_gpu(dtype, causal):
    """bf16 and fp16 at T5-base head dims on the GPU's own tiles: with the mask the reference draws, our error
    against fp64 within twice torch's error in the same precision (plus a floor), output and every gradient."""
    length, heads, dropout_p, seed = 1000, 4, 0.1, seed_tensor(2**50 + 3, 99)
    mask = torch.ones(2, length, dtype=torch.bool, device="cuda")
    mask[1, length - 100:] = False
    options = dict(bidirectional=not causal, causal=causal, key_padding_mask=mask)
    keep = dropout_keep_mask_reference(seed, dropout_p, 2, heads, length, length).cuda()

    def ours(q, k, v, table):
        return flash_attention_t5(q, k, v, bias_table=table, dropout_p=dropout_p, dropout_seed=seed, **options)

    def reference(q, k, v, table):
        return attention_with_dropout_mask_reference(q, k, v, keep, dropout_p, bias_table=table, **options)[0]

    check_half_precision(ours, reference, realistic_tensors(dtype, length, length, heads=heads))


def test_every_chips_tiles_are_valid_and_unlisted_chips_take_the_generation_below():
    """What the kernels assume of their tiles (powers of two of at least 16; dQ's BLOCK_M a multiple of BLOCK_N;
    key tiles no wider than the key mask's padding), for every chip of the table and head dim.
    tests/test_kernel_chips.py (slow tier) compiles them for each chip."""
    for capability in kernel_module.TILES:
        for kernel in ("forward", "dkdv", "dq"):
            for head_dim in kernel_module.HEAD_DIMS:
                for dropout, packed in ((False, False), (True, False), (False, True), (True, True)):
                    block_m, block_n, warps, stages = kernel_module.chip_tiles(capability, kernel, head_dim, dropout,
                                                                               packed)
                    assert all(x >= 16 and x & (x - 1) == 0 for x in (block_m, block_n)), (capability, kernel)
                    assert block_n <= kernel_module.KEY_MASK_PAD and warps in (1, 2, 4, 8) and stages >= 1
                    assert kernel != "dq" or block_m % block_n == 0, (capability, head_dim, dropout)
    for unlisted, listed in ((87, 86), (103, 100), (110, 100), (121, 120), (70, 75), (130, 120)):
        assert kernel_module.chip_tiles(unlisted, "dq", 128) == kernel_module.chip_tiles(listed, "dq", 128)
