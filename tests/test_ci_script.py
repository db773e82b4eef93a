""".ci/run itself: its exit status is every stage's (the torch drift check runs in the background), each stage's
minutes go to its figures file, and the files transformers 4.57's run holds exist and include the checks that run
nowhere else."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CI_RUN = (REPO / ".ci" / "run").read_text()


def background_harness(tmp_path, drift_status, middle):
    """.ci/run's own lines that start the torch drift check in the background and collect it at the end, around
    `middle` (CI's stages), with a stand-in drift check that exits `drift_status`; returns (exit status, output)."""
    lines = CI_RUN.splitlines()
    figures = lines[lines.index("export FAT5_CI_FIGURES=$PWD/.ci/figures.md"):lines.index("fresh_venv() {")]
    start = lines.index("torch_log=$(mktemp) torch_start=$SECONDS")
    started = lines[start:start + 4]
    assert "bash .ci/drift-torch" in started[1] and started[3].startswith("trap "), started
    collected = lines[lines.index("status=0"):]
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "drift-torch").write_text(f"echo stand-in torch check\nsleep 1\nexit {drift_status}\n")
    script = "\n".join(["set -euo pipefail", *figures, 'stage "the tiers"', *started, middle, *collected]) + "\n"
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout


@pytest.mark.parametrize("drift_status", [0, 3])
def test_ci_exits_with_the_background_checks_status_after_printing_its_log(tmp_path, drift_status):
    status, output = background_harness(tmp_path, drift_status, "echo the tiers ran")
    assert status == drift_status
    assert output.index("the tiers ran") < output.index("stand-in torch check")
    # Each stage's minutes, and the whole run's, in the figures file.
    figures = (tmp_path / ".ci" / "figures.md").read_text()
    assert re.search(r"^- the tiers: 0\.\d min, \S+ of disk free$", figures, re.M)
    assert re.search(r"^- all: 0\.\d min", figures, re.M)


def test_a_failing_stage_fails_ci_and_stops_the_background_check(tmp_path):
    status, output = background_harness(tmp_path, 0, "false")
    assert status == 1 and "stand-in torch check" not in output


def test_the_files_transformers_457_runs_exist():
    listed = re.search(r"TRANSFORMERS_457=\(([^)]*)\)", CI_RUN).group(1).split()
    assert listed and all((REPO / name).is_file() for name in listed), listed
    # The drift check of 4.57.6 (.ci/drift leaves it out) and the ONNX export (optimum needs transformers < 4.58).
    assert {"tests/test_drift.py", "tests/test_onnx_export.py"} <= set(listed)
    # The kernels' tests in the interpreter, left out, import no transformers.
    for name in ("tests/test_flash_attention_t5.py", "tests/test_kernel_chips.py"):
        assert name not in listed
        assert "transformers" not in re.findall(r"^(?:from|import) (\S+)", (REPO / name).read_text(), re.M)
