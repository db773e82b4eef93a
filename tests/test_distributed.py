"""FAT5 under the distributed engines users train large T5s with, on two CPU processes (gloo): PyTorch FSDP2
(`fully_shard` per FAT5Block, then the root) and DeepSpeed ZeRO-3 (`DS_ACCELERATOR=cpu`, `deepspeed.initialize`
with the shipped fat5/recipes/configs/ds_zero3_bf16.json). The losses match a single-process run, and
`generate(synced_gpus=True)` with a different length on each rank finishes and matches single-process generation.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; without it ZeRO-3 cannot be tested")

import distributed_worker as worker  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    # DeepSpeed's CPU backend JIT-builds a shared-memory op; a private build folder means a lock left by a killed
    # earlier run cannot make both ranks wait forever.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": str(out / "torch_extensions")}
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(worker.WORLD),
         str(Path(worker.__file__)), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert process.returncode == 0, process.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(worker.WORLD)]


@pytest.fixture(scope="module")
def reference():
    return worker.reference_run()


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_losses_match_single_process(ranks, reference, engine):
    expected, _ = reference
    for result in ranks:
        got = result[engine]["losses"]
        assert len(got) == worker.STEPS
        for step, (a, b) in enumerate(zip(got, expected)):
            assert abs(a - b) <= 1e-4 * abs(b), (engine, step, got, expected)
    assert expected[-1] < expected[0]


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_generate_synced_gpus_different_lengths(ranks, reference, engine):
    _, expected = reference
    for rank, result in enumerate(ranks):
        generated = result[engine]["generated"]
        assert len(generated) == 1 + worker.NEW_TOKENS[rank]
        assert generated == expected[rank]
