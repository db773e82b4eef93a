"""Every chip's build of the attention kernel fits the chip (slow tier; no GPU needed).

`benchmarks/sm90_profile.py --arch N` compiles the kernels ahead of time for compute capability N with the installed
triton and reads what ptxas reports. For the main variants on every chip of the kernel's tile table: each kernel
builds, its shared memory fits the chip's limit per block (else Triton raises OutOfResources at the first launch),
the forward spills nothing, and a backward kernel spills only where `BACKWARD_SPILLS` says no tile choice avoids it.
The kernel's variants (issue 46) are built for sm_90a alone: they run on Hopper only (the other chips' tables have
no tiles for them, and run the default kernel).
A tile change that breaks a chip fails here. `python -m pytest -m slow tests/test_kernel_chips.py` runs it with the
installed triton; `FAT5_TRITON_PYTHON=<a venv with another triton>/bin/python` runs the compiler under that one
(the GPU image's torch 2.11 pairs with triton 3.6.0, the newest torch with 3.9: benchmarks/RESULTS.md has both).
"""

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The interpreter that runs the compiler: this one, or one of a venv holding another triton.
PYTHON = os.environ.get("FAT5_TRITON_PYTHON", sys.executable)
if PYTHON == sys.executable:
    pytest.importorskip("triton")
PROFILE = Path(__file__).resolve().parent.parent / "benchmarks" / "sm90_profile.py"
# Every chip of the kernel's tile table, or those FAT5_CHIPS lists (comma-separated): .ci/triton-chips builds sm_90
# alone under the GPU image's triton, whose machines are H100s and H200s.
CHIPS = tuple(int(chip) for chip in os.environ.get("FAT5_CHIPS", "75,80,86,89,90,100,120").split(","))
# The T5 encoder (key mask), the T5 decoder at head dim 128 (the dQ that did not fit an A10), packed rows with
# attention dropout (the most registers), ALiBi.
MAIN_VARIANTS = ("t5_enc_d64", "t5_dec_d128", "t5_varlen_d64_drop", "alibi_d64")
# (chip, variant, kernel) -> bytes its build may spill, for a backward kernel that spills with every tile tried (the
# kernel's tile table and docs/kernels.md would say so): none now under triton 3.6 or 3.9.
BACKWARD_SPILLS = {}


# Sets of the kernel's variants built for sm_90a: band tiles in every kernel; TMA on the forward's own tiles beside
# T5's gather and the fused backward without band tiles; all three (TMA's wide tiles, the fused kernel's band tiles);
# on the main variants and the T5 encoder with dropout (the fused backward's case).
VARIANT_SETS = "band_tiles;tma,fused_backward;band_tiles,tma,fused_backward"
VARIANT_TAGS = (*MAIN_VARIANTS, "t5_enc_d64_drop")


def profile(arch, kernel_variants="default", tags=MAIN_VARIANTS):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([PYTHON, str(PROFILE), "--arch", str(arch), "--summary", "--kernel-variants",
                             kernel_variants, *tags], env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_every_chip_builds_the_main_variants_within_its_limits():
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        variants = pool.submit(profile, 90, VARIANT_SETS, VARIANT_TAGS)
        rows = [row for rows in pool.map(profile, CHIPS) for row in rows]
        variant_rows = variants.result()
    assert len(rows) == len(CHIPS) * len(MAIN_VARIANTS) * 3
    built = {row["tag"] for row in variant_rows}
    assert built == {f"{tag}+{'+'.join(sorted(names.split(',')))}" for tag in VARIANT_TAGS
                     for names in VARIANT_SETS.split(";")}
    rows += variant_rows
    problems = []
    for row in rows:
        where = f"sm_{row['arch']} {row['tag']} {row['kernel']} ({row['config']})"
        if "error" in row:
            problems.append(f"{where}: {row['error']}")
            continue
        if not row["fits"]:
            problems.append(f"{where}: {row['smem']} bytes of shared memory, the chip has {row['smem_limit']}")
        allowed = 0 if row["kernel"] == "forward_kernel" else \
            BACKWARD_SPILLS.get((row["arch"], row["tag"], row["kernel"].removesuffix("_kernel")), 0)
        if row["spill_bytes"] is None or row["spill_bytes"] > allowed:
            problems.append(f"{where}: spills {row['spill_bytes']} bytes (allowed: {allowed})")
    assert not problems, "\n".join(problems)
