"""The Triton kernel against the fp64 torch reference: outputs and gradients of q, k, v and the bias table.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes are small but ragged:
lengths are not multiples of the 16-wide interpreter tiles (nor of the GPU tiles). Outputs are poisoned with NaN
before each call. With CUDA the same tests run on the GPU.
"""

import importlib
import sys

import pytest
import torch

from fat5.attention_fat5 import alibi_slopes
from fat5.kernels import flash_attention_t5 as kernel_module
from fat5.kernels.flash_attention_t5 import flash_attention_t5, flash_attention_t5_varlen, relative_bias_lut
from fat5.reference_fat5 import dense_bias, relative_position_bucket, relative_positions
from fat5.reference_fat5 import eager_attention as flash_attention_t5_reference
from references import flash_attention_t5_varlen_reference

# fp32 inputs against the fp64 reference: |error| <= TOLERANCE * max |reference|.
FP32_TOLERANCE = 1e-4
# fp16 inputs (fp32 accumulation) against the fp64 reference.
FP16_TOLERANCE = 2e-2
NUM_BUCKETS, MAX_DISTANCE = 8, 12
INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON_OUTPUTS", True)


def close(actual, expected, tolerance, name):
    scale = expected.abs().max().item()
    error = (actual.double() - expected).abs().max().item()
    assert error <= tolerance * scale, f"{name}: max error {error:.3g} > {tolerance * scale:.3g}"


def inputs(batch, heads, query_length, key_length, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, query_length, head_dim, generator=generator).to(DEVICE, dtype)
    k = torch.randn(batch, heads, key_length, head_dim, generator=generator).to(DEVICE, dtype)
    v = torch.randn(batch, heads, key_length, head_dim, generator=generator).to(DEVICE, dtype)
    table = torch.randn(NUM_BUCKETS, heads, generator=generator).to(DEVICE)
    return q, k, v, table


def key_mask(batch, key_length):
    return torch.ones(batch, key_length, dtype=torch.bool, device=DEVICE)


def check_against_reference(q, k, v, table=None, tolerance=FP32_TOLERANCE, **kwargs):
    """Run kernel and fp64 reference forward and backward; compare output and every gradient."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    bias = {}
    if table is not None:
        table_leaf, table_reference = table.clone().requires_grad_(), table.double().requires_grad_()
        bias = dict(num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    out = flash_attention_t5(*leaves, **bias, **kwargs, **({"bias_table": table_leaf} if table is not None else {}))
    expected = flash_attention_t5_reference(*reference_leaves, **bias, **kwargs,
                                            **({"bias_table": table_reference} if table is not None else {}))
    assert not out.isnan().any()
    close(out, expected, tolerance, "output")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, out.dtype)
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
    check_against_reference(q, k, v, alibi_slopes=alibi_slopes(2).to(DEVICE))


@pytest.mark.parametrize("causal", [False, True])
def test_alibi(causal):
    q, k, v, _ = inputs(2, 4, 29, 29, 32, seed=4)
    mask = key_mask(2, 29)
    mask[0, 20:] = False
    check_against_reference(q, k, v, alibi_slopes=alibi_slopes(4).to(DEVICE), causal=causal, key_padding_mask=mask)


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
    # plain bf16 load/store is exact; bf16 is covered on GPU by test_realistic_sizes_in_bf16_on_gpu.
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
    query_lengths = [17, 1, 30, 9]
    key_lengths = key_lengths or query_lengths
    cu_q, cu_k = (torch.tensor([0] + n, device=DEVICE).cumsum(0).to(torch.int32) for n in (query_lengths, key_lengths))
    heads, dim = 3, 32
    generator = torch.Generator().manual_seed(10)
    q = torch.randn(sum(query_lengths), heads, dim, generator=generator).to(DEVICE)
    k, v = (torch.randn(sum(key_lengths), heads, dim, generator=generator).to(DEVICE) for _ in range(2))
    table = torch.randn(NUM_BUCKETS, heads, generator=generator).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    references = [t.double().requires_grad_() for t in (q, k, v, table)]
    options = dict(causal=causal)
    if bias == "t5":
        options.update(num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE, bidirectional=not causal)
    elif bias == "alibi":
        options.update(alibi_slopes=alibi_slopes(heads).to(DEVICE))
    table_leaf = {"bias_table": leaves[3]} if bias == "t5" else {}
    table_reference = {"bias_table": references[3]} if bias == "t5" else {}
    lengths = (cu_q, cu_k, max(query_lengths), max(key_lengths))
    out = flash_attention_t5_varlen(*leaves[:3], *lengths, **options, **table_leaf)
    expected = flash_attention_t5_varlen_reference(*references[:3], *lengths, **options, **table_reference)
    close(out, expected, FP32_TOLERANCE, "output")
    grad = torch.randn(out.shape, generator=generator).to(DEVICE)
    out.backward(grad)
    expected.backward(grad.double())
    names = ["dq", "dk", "dv", "d bias_table"] if bias == "t5" else ["dq", "dk", "dv"]
    for name, leaf, reference in zip(names, leaves, references):
        close(leaf.grad, reference.grad, FP32_TOLERANCE, name)


def test_non_contiguous_inputs_as_the_model_passes_them():
    batch, length, heads, dim = 2, 23, 2, 32
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, length, heads, dim, generator=generator).to(DEVICE).transpose(1, 2)
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
])
def test_bad_inputs_raise_clear_errors(make, message):
    """Head dim 48, mismatched heads, wrong table or mask shapes, mixed dtypes."""
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


def test_fake_implementation_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 3, 40, 64)
        out = flash_attention_t5(q, q, q)
    assert out.shape == (2, 3, 40, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1000, 2048])
def test_realistic_sizes_in_bf16_on_gpu(causal, length):
    """bf16 at T5-base shapes: our error against fp64 within twice torch's own bf16 error (plus a floor)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 12, length, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
               for _ in range(3))
    table = torch.randn(32, 12, device="cuda", generator=generator)
    mask = torch.ones(2, length, dtype=torch.bool, device="cuda")
    mask[1, length - 100:] = False
    options = dict(bias_table=table, bidirectional=not causal, causal=causal, key_padding_mask=mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    low = [t.clone().requires_grad_() for t in (q, k, v, table)]
    exact = [t.double().requires_grad_() for t in (q, k, v, table)]
    outputs = [flash_attention_t5(*leaves[:3], **{**options, "bias_table": leaves[3]}),
               flash_attention_t5_reference(*low[:3], **{**options, "bias_table": low[3]}),
               flash_attention_t5_reference(*exact[:3], **{**options, "bias_table": exact[3]})]
    grad = torch.randn(outputs[0].shape, device="cuda", generator=generator, dtype=torch.bfloat16)
    for out in outputs:
        out.backward(grad.to(out.dtype))
    pairs = [(outputs[0], outputs[1], outputs[2], "output")]
    pairs += [(a.grad, b.grad, c.grad, name) for a, b, c, name in zip(leaves, low, exact, ["dq", "dk", "dv", "dt"])]
    for ours, torch_low, reference, name in pairs:
        our_error = (ours.double() - reference).abs().max().item()
        torch_error = (torch_low.double() - reference).abs().max().item()
        assert our_error <= 2 * torch_error + 1e-3 * reference.abs().max().item(), name
