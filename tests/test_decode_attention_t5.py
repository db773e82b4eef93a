"""The decode kernel (a few query rows against a key cache, split over the keys) against the fp64 torch reference,
its grid, its selection by the attention seam, and generation on it with every cache kind and beam search.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py) with 16-key tiles and a pretend chip of
INTERPRETER_SMS SMs, so short ragged caches split into several chunks; the output and the partials are poisoned
with NaN before each call."""

import pytest
import torch

from conftest import KERNEL_DEVICE
from fat5.attention_positions_fat5 import alibi_slopes
from fat5.kernels import decode_attention_t5 as kernel_module
from fat5.kernels import flash_attention_t5 as training_kernel
from fat5.kernels.decode_attention_t5 import DECODE_MAX_QUERIES, decode_attention_t5, decode_grid
from fat5.reference_fat5 import eager_attention

FP32_TOLERANCE = 1e-4
HALF_TOLERANCE = 2e-2
NUM_BUCKETS, MAX_DISTANCE = 8, 12
INTERPRETED = KERNEL_DEVICE.type == "cpu"


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON_OUTPUTS", True)


def close(actual, expected, tolerance, name=""):
    assert not actual.isnan().any(), name
    scale = expected.abs().max().item()
    error = (actual.double() - expected).abs().max().item()
    assert error <= tolerance * scale, f"{name}: max error {error:.3g} > {tolerance * scale:.3g}"


def tensors(batch, heads, query_length, key_length, head_dim=32, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator).to(KERNEL_DEVICE, dtype)
               for length in (query_length, key_length, key_length))
    padding = torch.rand(batch, key_length, generator=generator) > 0.25
    table = torch.randn(NUM_BUCKETS, heads, generator=generator).to(KERNEL_DEVICE)
    return q, k, v, padding.to(KERNEL_DEVICE), table


def position_options(bias, heads, table, causal):
    """The bias keywords of the contract: T5 (one-directional buckets when causal, as the decoder's), ALiBi, none."""
    if bias == "t5":
        return dict(bias_table=table, bidirectional=not causal, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    if bias == "alibi":
        return dict(alibi_slopes=alibi_slopes(heads).to(KERNEL_DEVICE))
    return {}


def reference(q, k, v, options):
    doubled = {name: value.double() if torch.is_tensor(value) and value.is_floating_point() else value
               for name, value in options.items()}
    if torch.is_tensor(doubled.get("q_offset")):
        doubled["q_offset"] = int(doubled["q_offset"])
    return eager_attention(q.double(), k.double(), v.double(), **doubled)


# (bias, causal, query rows, key length, past): the decoder's self-attention (causal, the new rows last), the
# cross-attention (no bias, not causal), and a non-causal biased block; key lengths not multiples of the tiles.
CASES = [("t5", True, 1, 1, 0), ("t5", True, 1, 45, 44), ("t5", True, 3, 70, 67), ("t5", True, 16, 100, 84),
         ("alibi", True, 1, 37, 36), ("alibi", True, 5, 61, 56), ("none", True, 2, 33, 31),
         ("none", False, 1, 50, 0), ("none", False, 7, 29, 0), ("t5", False, 4, 90, 30)]


@pytest.mark.parametrize("offset_kind", ["int", "tensor"])
@pytest.mark.parametrize("bias, causal, query_length, key_length, past", CASES)
def test_decode_matches_the_reference(bias, causal, query_length, key_length, past, offset_kind):
    q, k, v, padding, table = tensors(2, 3, query_length, key_length)
    padding[:, -1] = True  # the newest key (the row's own, when causal) is never padding
    options = dict(position_options(bias, 3, table, causal), causal=causal, key_padding_mask=padding,
                   q_offset=past if offset_kind == "int" else torch.tensor(past, device=KERNEL_DEVICE))
    expected = reference(q, k, v, options)
    for num_splits in (None, 1, 2, 1000):  # chosen by decode_grid, one chunk, two, one per key tile
        close(decode_attention_t5(q, k, v, **options, num_splits=num_splits), expected, FP32_TOLERANCE,
              f"{num_splits} chunks")


@pytest.mark.parametrize("dtype", [
    torch.float16,
    # The interpreter's tl.dot returns garbage for bf16 operands (see test_flash_attention_t5.py); on GPU it runs.
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="Triton interpreter: bf16 tl.dot")),
])
def test_half_precision_and_many_heads(dtype):
    q, k, v, padding, table = tensors(3, 12, 1, 83, head_dim=64, dtype=dtype)
    options = dict(position_options("t5", 12, table, True), causal=True, q_offset=82, key_padding_mask=padding)
    close(decode_attention_t5(q, k, v, **options), reference(q, k, v, options), HALF_TOLERANCE, str(dtype))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_larger_head_dims(head_dim):
    q, k, v, padding, table = tensors(1, 2, 2, 40, head_dim=head_dim)
    options = dict(position_options("t5", 2, table, True), causal=True, q_offset=38)
    close(decode_attention_t5(q, k, v, **options), reference(q, k, v, options), FP32_TOLERANCE)


def test_a_static_cache_of_mostly_empty_slots():
    """A static cache returns all its slots; the ones past the position are future keys (causality hides them), so
    most chunks see nothing: their partials must merge to nothing, whatever the empty slots hold."""
    q, k, v, _, table = tensors(2, 2, 1, 160)
    k[:, :, 6:], v[:, :, 6:] = 1e4, float("nan")  # never read
    position = torch.tensor([5], device=KERNEL_DEVICE)
    options = dict(position_options("t5", 2, table, True), causal=True, q_offset=position)
    expected = reference(q[..., :6, :], k[:, :, :6], v[:, :, :6], options)
    close(decode_attention_t5(q, k, v, **options, num_splits=10), expected, FP32_TOLERANCE)


def test_rows_that_see_no_key_return_zeros():
    q, k, v, padding, _ = tensors(2, 2, 3, 50)
    padding[0] = False
    out = decode_attention_t5(q, k, v, key_padding_mask=padding, num_splits=4)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    close(out[1:], reference(q, k, v, dict(key_padding_mask=padding))[1:], FP32_TOLERANCE)


def test_the_model_s_transposed_projections():
    """Queries as the model passes them: (B, L, H, D) storage seen as (B, H, L, D)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 32, generator=generator).to(KERNEL_DEVICE).transpose(1, 2)
    k, v = (torch.randn(2, 40, 4, 32, generator=generator).to(KERNEL_DEVICE).transpose(1, 2) for _ in range(2))
    close(decode_attention_t5(q, k, v, causal=True, q_offset=37), reference(q, k, v, dict(causal=True, q_offset=37)),
          FP32_TOLERANCE)


def test_a_shared_lookup_table_gives_the_table_s_result():
    """The layers of one forward share the T5 lookup table (`bias_lut`, gathered once by the seam): the same output
    as the bucket table's; a table of the wrong shape, or both forms at once, is refused."""
    q, k, v, padding, table = tensors(2, 3, 2, 40)
    options = dict(bidirectional=False, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE, causal=True,
                   q_offset=38, key_padding_mask=padding)
    lut = training_kernel.relative_bias_lut(table, False, NUM_BUCKETS, MAX_DISTANCE)
    expected = decode_attention_t5(q, k, v, bias_table=table, **options)
    assert torch.equal(decode_attention_t5(q, k, v, bias_lut=lut, **options), expected)
    with pytest.raises(ValueError, match="bias_lut must be"):
        decode_attention_t5(q, k, v, bias_lut=lut[:2], **options)
    with pytest.raises(ValueError, match="pass one of"):
        decode_attention_t5(q, k, v, bias_lut=lut, bias_table=table, **options)


@pytest.mark.parametrize("make, message", [
    (lambda q, k: dict(query=q.expand(-1, -1, DECODE_MAX_QUERIES + 1, -1)), "at most 16 query rows"),
    (lambda q, k: dict(query=q.requires_grad_()), "forward only"),
    (lambda q, k: dict(q_offset=torch.tensor([1.0], device=KERNEL_DEVICE)), "one-element integer tensor"),
    (lambda q, k: dict(q_offset=torch.tensor([1, 2], device=KERNEL_DEVICE)), "one-element integer tensor"),
    (lambda q, k: dict(query=q[..., :16], key=k[..., :16], value=k[..., :16]), "head dims"),
    (lambda q, k: dict(key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), "key_padding_mask must be"),
])
def test_bad_inputs_raise_clear_errors(make, message):
    q, k, _, _, _ = tensors(2, 2, 1, 20)
    arguments = dict(query=q, key=k, value=k.clone())
    arguments.update(make(q.clone(), k))
    with pytest.raises(ValueError, match=message):
        decode_attention_t5(arguments.pop("query"), arguments.pop("key"), arguments.pop("value"), **arguments)


def test_fake_implementation_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 1, 3, 64).transpose(1, 2), torch.empty(2, 3, 100, 64)
        out = decode_attention_t5(q, k, k, q_offset=torch.tensor([7]), causal=True)
    assert out.shape == q.shape and out.is_contiguous()


def test_compiled_step_is_one_graph_for_every_position():
    """fullgraph=True over the op with a tensor position: one graph, no host read of the position, and a new
    position is a new value of the same input, not a recompilation."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    q, k, v, padding, table = tensors(1, 2, 1, 40)
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v, position):
        return decode_attention_t5(q, k, v, bias_table=table, bidirectional=False, num_buckets=NUM_BUCKETS,
                                   max_distance=MAX_DISTANCE, causal=True, q_offset=position)

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    for past in (3, 17, 39):
        position = torch.tensor(past, device=KERNEL_DEVICE)
        close(compiled(q, k, v, position), reference(q, k, v, dict(
            position_options("t5", 2, table, True), causal=True, q_offset=past)), FP32_TOLERANCE, str(past))
    assert counter.frame_count == 1
    assert not [node for graph in counter.graphs for node in graph.graph.nodes if node.target in ("item", "tolist")]


def test_grid_fills_an_h100_at_batch_1_from_2048_keys():
    for key_length in (2048, 4096, 8192):
        grid, chunk = decode_grid(1, 12, key_length, 64, 132)
        assert grid[0] * grid[1] >= 132, key_length
        assert (grid[1] - 1) * chunk < key_length <= grid[1] * chunk and chunk % 64 == 0
    assert decode_grid(32, 12, 8192, 64, 132)[0] == (384, 1)  # batch * heads fills it: no merge
    assert decode_grid(1, 12, 100, 64, 132)[0] == (12, 2)  # at most one chunk per key tile
    assert decode_grid(1, 1, 1000, 16, 4, num_splits=5) == ((1, 5), 208)


def test_the_seam_runs_decode_steps_on_the_decode_kernel(monkeypatch, tiny_config):
    """The Triton backend runs the decode kernel for a few rows without gradient or dropout, the training kernel
    otherwise (a gradient, attention dropout, a long query block), both on a static cache's tensor position."""
    from fat5 import attention_fat5

    calls = []
    for module, name in ((kernel_module, "_decode_attention"), (training_kernel, "_flash_attention_forward")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _original=original, _name=name: (
            calls.append(_name), _original(*args))[1])
    q, k, v, _, table = tensors(1, 2, 1, 30)
    options = dict(bias_table=table, bidirectional=False, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE,
                   alibi_slopes=None, key_padding_mask=None, causal=True, scale=1.0,
                   q_offset=torch.tensor(29, device=KERNEL_DEVICE))
    expected = reference(q, k, v, options)
    for query, grad, dropout, kernel in ((q, False, 0.0, "_decode_attention"),
                                         (q, True, 0.0, "_flash_attention_forward"),
                                         (q, False, 0.1, "_flash_attention_forward")):
        calls.clear()
        with torch.set_grad_enabled(grad):
            out, _ = attention_fat5.triton_attention_forward(query.clone().requires_grad_(grad), k, v,
                                                             **options, dropout_p=dropout)
        assert calls == [kernel], (grad, dropout)
        if not dropout:
            close(out.detach(), expected, FP32_TOLERANCE, kernel)
    calls.clear()
    long_query = tensors(1, 2, DECODE_MAX_QUERIES + 1, 30)[0]
    with torch.no_grad():
        attention_fat5.triton_attention_forward(long_query, k, v, **{**options, "q_offset": 13}, dropout_p=0.0)
    assert calls == ["_flash_attention_forward"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 32])
def test_realistic_decode_steps_in_bf16_on_gpu(batch):
    """T5-base heads against 4096 keys of a static cache at position 3000, as generation runs them on a GPU."""
    q, k, v, padding, table = tensors(batch, 12, 1, 4096, head_dim=64, dtype=torch.bfloat16)
    options = dict(position_options("t5", 12, table, True), causal=True, key_padding_mask=padding,
                   q_offset=torch.tensor([3000], device=KERNEL_DEVICE))
    padding[:, 3000] = True
    close(decode_attention_t5(q, k, v, **options), reference(q, k, v, options), HALF_TOLERANCE)
    cross = dict(key_padding_mask=padding)
    close(decode_attention_t5(q, k, v, **cross), reference(q, k, v, cross), HALF_TOLERANCE, "cross-attention")
