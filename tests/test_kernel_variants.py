"""The kernel's variants (issue 46: band_tiles, tma, fused_backward, and all three at once) against the fp64 torch
reference, as tests/test_flash_attention_t5.py checks the default kernel: outputs poisoned with NaN before each call,
output and every gradient (q, k, v, the bias table), ragged lengths, padding, causal rows and cache offsets, packed
rows, attention dropout against the mask tests/references.py draws; and on the GPU's tile shapes, which the
interpreter otherwise never runs (band tiles up to 128 x 128, the dK/dV tiles' per-diagonal table gradient).

Triton's interpreter runs the tma variant's tensor descriptors (loads past a sequence's end read zeros there as on
the GPU), so every variant's own code is checked here. The variants' builds for the chips are in
tests/test_kernel_chips.py; their speed is the GPU's variant sweep's (benchmarks/variant_sweep.py).
"""

import pytest
import torch
from test_flash_attention_t5 import (  # noqa: F401  (poison_outputs: an autouse fixture, here too)
    FP16_TOLERANCE,
    MAX_DISTANCE,
    NUM_BUCKETS,
    check_against_reference,
    check_varlen_against_reference,
    inputs,
    key_mask,
    poison_outputs,
    seed_tensor,
)

from conftest import KERNEL_DEVICE
from fat5.attention_positions_fat5 import alibi_slopes
from fat5.kernels import flash_attention_t5 as kernel_module
from fat5.kernels.flash_attention_t5 import flash_attention_t5
from fat5.reference_fat5 import eager_attention
from references import attention_with_dropout_mask_reference, dropout_keep_mask_reference

SLOW = pytest.mark.slow
# The default tier runs band tiles alone (with the dQ kernel, which the fused backward replaces) and all three at once;
# the slow tier adds TMA and the fused backward alone.
VARIANT_SETS = ["band_tiles", "band_tiles,tma,fused_backward", pytest.param("tma", marks=SLOW),
                pytest.param("fused_backward", marks=SLOW)]


@pytest.fixture(params=VARIANT_SETS)
def variants(request, monkeypatch):
    """Runs the test under each set of variants; returns the launches' variant switches, one dict per launch."""
    monkeypatch.setattr(kernel_module, "VARIANTS", kernel_module.kernel_variants(request.param))
    launches = []
    for name in ("_forward_kernel", "_backward_dkdv_kernel", "_backward_dq_kernel"):
        monkeypatch.setattr(kernel_module, name, _Recorder(getattr(kernel_module, name), launches))
    return launches


class _Recorder:
    """Runs a kernel, recording the variant switches of each launch."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            switches = ("BAND_TILES", "TMA", "FUSED", "DROPOUT", "CAUSAL")
            self.launches.append({name: kwargs.get(name) for name in switches} | {"kernel": self.kernel.fn.__name__})
            return self.kernel[grid](*args, **kwargs)
        return launch


def assert_variants_ran(launches):
    """Each selected variant ran where it applies (band tiles: T5's table; the fused backward: not causal rows), and
    dQ's kernel only without fusion."""
    selected = kernel_module.VARIANTS
    fused = "fused_backward" in selected and not launches[0]["CAUSAL"]
    kernels = [launch["kernel"] for launch in launches]
    assert ("_backward_dq_kernel" in kernels) == (not fused)
    assert all(launch["FUSED"] == fused for launch in launches if launch["kernel"] == "_backward_dkdv_kernel")
    assert all(launch["TMA"] == ("tma" in selected) for launch in launches if launch["kernel"] == "_forward_kernel")


CASES = ["encoder_right_padding", "encoder_left_padding", "cross_lengths", "decoder_causal", "decode_offset",
         "long_far_tiles", "long_far_tiles_causal", "alibi", "head_dim_64"]


@pytest.mark.parametrize("case", CASES)
def test_variant_matches_the_reference(variants, case):
    """Output and every gradient against fp64, T5's bias (and ALiBi, where band tiles do not apply)."""
    options = {}
    if case.startswith("encoder"):
        q, k, v, table = inputs(2, 3, 37, 45, 32, seed=60)
        mask = key_mask(2, 45)
        if case == "encoder_right_padding":
            mask[1, 36:] = False
        else:
            mask[0, :7] = False
        options = dict(key_padding_mask=mask, bidirectional=True)
    elif case == "cross_lengths":
        q, k, v, table = inputs(2, 2, 50, 23, 32, seed=61)
        options = dict(bidirectional=True)
    elif case == "decoder_causal":
        q, k, v, table = inputs(2, 2, 33, 33, 32, seed=62)
        mask = key_mask(2, 33)
        mask[1, 28:] = False
        options = dict(bidirectional=False, causal=True, key_padding_mask=mask)
    elif case == "decode_offset":  # an offset that is no multiple of any tile: band tiles start mid-row
        q, k, v, table = inputs(2, 2, 5, 3 * MAX_DISTANCE + 8, 32, seed=63)
        options = dict(bidirectional=False, causal=True, q_offset=3 * MAX_DISTANCE + 3)
    elif case.startswith("long_far_tiles"):
        q, k, v, table = inputs(1, 2, 70, 70, 32, seed=64)
        causal = case.endswith("causal")
        options = dict(bidirectional=not causal, causal=causal)
    elif case == "alibi":
        q, k, v, _ = inputs(2, 4, 29, 29, 32, seed=65)
        table = None
        options = dict(alibi_slopes=alibi_slopes(4).to(KERNEL_DEVICE), causal=True)
    else:
        q, k, v, table = inputs(1, 2, 40, 40, 64, seed=66)
        options = dict(bidirectional=True)
    check_against_reference(q, k, v, table, **options)
    assert_variants_ran(variants)
    if table is not None:
        assert all(launch["BAND_TILES"] == ("band_tiles" in kernel_module.VARIANTS) for launch in variants)


@pytest.mark.parametrize("bias, causal, key_lengths", [
    ("t5", False, None),
    pytest.param("t5", True, None, marks=SLOW),
    pytest.param("t5", False, [40, 3, 12, 9], marks=SLOW),  # cross attention: other key lengths
])
def test_variant_on_packed_rows(variants, bias, causal, key_lengths):
    """Packed sequences of ragged lengths: band tiles and TMA's descriptors per sequence, dQ's atomics per row."""
    check_varlen_against_reference(bias, causal, key_lengths, seed=67)
    assert_variants_ran(variants)


@pytest.mark.parametrize("case", ["encoder", "decoder", pytest.param("packed", marks=SLOW),
                                  pytest.param("fp16", marks=SLOW)])
def test_variant_with_dropout_matches_the_reference_mask(variants, case):
    """Attention dropout: the forward's mask and the backward's (once, in the fused kernel) are the reference's."""
    seed = seed_tensor(987654321 + len(case), 5 + len(case))
    if case == "packed":
        check_varlen_against_reference("t5", False, None, seed=68, dropout_p=0.25, dropout_seed=seed)
    elif case == "fp16":
        q, k, v, table = inputs(1, 2, 33, 33, 32, dtype=torch.float16, seed=69)
        check_against_reference(q, k, v, table, tolerance=FP16_TOLERANCE, bidirectional=True, dropout_p=0.2,
                                dropout_seed=seed)
    else:
        causal = case == "decoder"
        q, k, v, table = inputs(2, 3, 37, 37 if causal else 45, 32, seed=70)
        mask = key_mask(2, k.shape[2])
        mask[1, -8:] = False
        check_against_reference(q, k, v, table, key_padding_mask=mask, bidirectional=not causal, causal=causal,
                                dropout_p=0.3, dropout_seed=seed)
    assert_variants_ran(variants)
    assert all(launch["DROPOUT"] for launch in variants)


# (forward, dK/dV or fused, dQ) tiles as the GPU runs them: Hopper's 128 x 64 forward and TMA's 128 x 128 (the band
# matrix's widest and tallest tiles), the fused kernel's 64 x 32, dQ's 128 x 32; and 32 x 16 dK/dV tiles, whose
# fused per-diagonal table gradient sums two groups of rows.
GPU_SIZED_TILES = {"hopper": {"forward": (128, 64), "dkdv": (64, 32), "dq": (128, 32)},
                   "widest": {"forward": (128, 128), "dkdv": (128, 128), "dq": (128, 128)},
                   "tall": {"forward": (32, 16), "dkdv": (32, 16), "dq": (32, 16)}}


@pytest.mark.parametrize("tiles, causal, dropout", [
    ("hopper", False, False), ("widest", False, False), ("tall", False, True),
    pytest.param("hopper", True, True, marks=SLOW), pytest.param("widest", True, False, marks=SLOW),
    pytest.param("tall", True, False, marks=SLOW),
])
def test_variant_on_gpu_sized_tiles(monkeypatch, variants, tiles, causal, dropout):
    """T5's real max_distance (128) on ragged lengths past 2 x 128 (75 on the tall tiles): band tiles from both ends
    of the band matrix, far tiles on both sides, on the tile shapes of a GPU."""
    shapes = GPU_SIZED_TILES[tiles]

    def blocks(head_dim, kernel, device, dropout=False, packed=False):
        if kernel == "band tiles":
            return True
        return (*shapes["dkdv" if kernel == "fused" else kernel], 1, 1)

    def tma_blocks(key, value, wide, dropout):
        return (*shapes["forward"], 1, 1) if "tma" in kernel_module.VARIANTS else None

    monkeypatch.setattr(kernel_module, "_blocks", blocks)
    monkeypatch.setattr(kernel_module, "_tma_blocks", tma_blocks)
    generator = torch.Generator().manual_seed(71)
    length = 75 if tiles == "tall" else 301  # the tall tiles' many small programs are slow in the interpreter
    q, k, v = (torch.randn(1, 2, length, 32, generator=generator).to(KERNEL_DEVICE) for _ in range(3))
    table = torch.randn(32, 2, generator=generator).to(KERNEL_DEVICE)
    mask = key_mask(1, length)
    mask[0, -13:] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    references = [t.double().requires_grad_() for t in (q, k, v, table)]
    options = dict(bidirectional=not causal, causal=causal, key_padding_mask=mask)
    dropout_options = dict(dropout_p=0.1, dropout_seed=seed_tensor(17, 3)) if dropout else {}
    out = flash_attention_t5(*leaves[:3], bias_table=leaves[3], **options, **dropout_options)
    if dropout:
        keep = dropout_keep_mask_reference(dropout_options["dropout_seed"], 0.1, 1, 2, length, length)
        expected, _ = attention_with_dropout_mask_reference(*references[:3], keep.to(KERNEL_DEVICE), 0.1,
                                                            bias_table=references[3], **options)
    else:
        expected = eager_attention(*references[:3], bias_table=references[3], **options)
    grad = torch.randn(out.shape, generator=generator).to(KERNEL_DEVICE)
    out.backward(grad)
    expected.backward(grad.double())
    for name, actual, exact in [("output", out, expected)] + [
            (name, leaf.grad, reference.grad) for name, leaf, reference in zip(["dq", "dk", "dv", "d bias_table"],
                                                                              leaves, references)]:
        error = (actual.double() - exact).abs().max().item()
        assert error <= 1e-4 * exact.abs().max().item(), f"{name}: {error:.3g}"
    assert_variants_ran(variants)


def test_variants_are_named_once_and_off_by_default(monkeypatch):
    """FAT5_KERNEL_VARIANTS names variants comma-separated (read on import); an unknown name is refused with the
    known ones; none is selected unless named, and then the kernels compile as they were (every switch off)."""
    assert kernel_module.kernel_variants(" band_tiles, tma ,") == {"band_tiles", "tma"}
    assert kernel_module.kernel_variants("") == frozenset()
    with pytest.raises(ValueError, match="band_tiles, tma, fused_backward"):
        kernel_module.kernel_variants("band_tile")
    monkeypatch.setattr(kernel_module, "VARIANTS", frozenset())
    launches = []
    for name in ("_forward_kernel", "_backward_dkdv_kernel", "_backward_dq_kernel"):
        monkeypatch.setattr(kernel_module, name, _Recorder(getattr(kernel_module, name), launches))
    q, k, v, table = (t.requires_grad_() for t in inputs(1, 2, 20, 20, 32, seed=72))
    flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE).sum().backward()
    assert [launch["kernel"] for launch in launches] == ["_forward_kernel", "_backward_dkdv_kernel",
                                                         "_backward_dq_kernel"]
    assert not any(launch[name] for launch in launches for name in ("BAND_TILES", "TMA", "FUSED"))


def test_variants_run_only_where_the_chip_has_their_tiles():
    """The variants run on Hopper, where they were built without spills (band tiles spilled on other chips); the
    fused backward has tiles for dropout at d = 64 on padded batches alone (elsewhere the tiles tried spilled).
    Elsewhere the variant runs the default kernels."""
    assert all(kernel_module.chip_tiles(90, "band tiles", head_dim) for head_dim in kernel_module.HEAD_DIMS)
    assert kernel_module.chip_tiles(90, "forward tma", 64)[1] == 2 * kernel_module.chip_tiles(90, "forward", 64)[1]
    assert kernel_module.chip_tiles(90, "fused", 64, dropout=True) is not None
    assert kernel_module.chip_tiles(90, "fused", 64) is None
    assert kernel_module.chip_tiles(90, "fused", 64, dropout=True, packed=True) is None
    assert kernel_module.chip_tiles(90, "fused", 128, dropout=True) is None
    for capability in (75, 80, 86, 89, 100, 120):
        assert kernel_module.chip_tiles(capability, "band tiles", 64) is None
        assert kernel_module.chip_tiles(capability, "forward tma", 64) is None
        assert kernel_module.chip_tiles(capability, "fused", 64, dropout=True) is None
    for head_dim in kernel_module.HEAD_DIMS:
        tiles = kernel_module.chip_tiles(90, "fused", head_dim, dropout=True)
        if tiles:  # the per-diagonal table gradient needs whole groups of key-tile rows
            assert tiles[0] % tiles[1] == 0 and tiles[0] <= kernel_module.BAND_ROWS
        for dropout in (False, True):
            tiles = kernel_module.chip_tiles(90, "forward tma", head_dim, dropout)
            assert tiles == kernel_module.chip_tiles(90, "forward tma", head_dim)  # the same with dropout
            assert tiles[0] <= kernel_module.BAND_ROWS and tiles[1] <= kernel_module.BAND_MARGIN
            assert kernel_module.chip_tiles(90, "band tiles", head_dim, dropout) is True


def test_tma_keeps_the_default_loads_for_rows_it_cannot_address(monkeypatch):
    """TMA needs 16-byte aligned addresses and strides: keys whose rows are not (a view one element in) run the
    default loads, with the same result."""
    monkeypatch.setattr(kernel_module, "VARIANTS", kernel_module.kernel_variants("tma"))
    q, k, v, table = inputs(1, 2, 20, 21, 32, seed=73)
    shifted_k, shifted_v = k[..., 1:, :], v[..., 1:, :]  # storage offset of 32 floats: still aligned
    assert kernel_module._tma_blocks(shifted_k, shifted_v, True, False) is not None
    odd = torch.randn(1, 2, 20, 33).to(KERNEL_DEVICE)[..., 1:]  # rows of 33 floats: strides not 16-byte multiples
    assert kernel_module._tma_blocks(odd, odd, True, False) is None
    options = dict(bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
    expected = flash_attention_t5(q[..., :20, :], odd, odd.contiguous(), **options)
    monkeypatch.setattr(kernel_module, "VARIANTS", frozenset())
    assert torch.allclose(expected, flash_attention_t5(q[..., :20, :], odd, odd.contiguous(), **options),
                          rtol=1e-6, atol=1e-6)
