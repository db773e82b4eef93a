""".ci/run itself: its exit status is every stage's (the torch drift check runs in the background), and the files
transformers 4.57's tiers leave out exist and name no test that 4.57 would need."""

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
    start = lines.index('torch_log=$(mktemp)')
    started = lines[start:start + 4]
    assert started[1].startswith("bash .ci/drift-torch") and started[3].startswith("trap "), started
    collected = lines[lines.index("status=0"):]
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "drift-torch").write_text(f"echo stand-in torch check\nsleep 1\nexit {drift_status}\n")
    script = "\n".join(["set -euo pipefail", *started, middle, *collected]) + "\n"
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout


@pytest.mark.parametrize("drift_status", [0, 3])
def test_ci_exits_with_the_background_checks_status_after_printing_its_log(tmp_path, drift_status):
    status, output = background_harness(tmp_path, drift_status, "echo the tiers")
    assert status == drift_status
    assert output.index("the tiers") < output.index("stand-in torch check")


def test_a_failing_stage_fails_ci_and_stops_the_background_check(tmp_path):
    status, output = background_harness(tmp_path, 0, "false")
    assert status == 1 and "stand-in torch check" not in output


def test_the_files_left_out_under_transformers_457_exist():
    listed = re.search(r"TRANSFORMERS_FREE=\(([^)]*)\)", CI_RUN).group(1).split()
    assert listed and all((REPO / name).is_file() for name in listed), listed
    # The kernels' tests in the interpreter import no transformers.
    for name in ("tests/test_flash_attention_t5.py", "tests/test_kernel_chips.py"):
        assert "transformers" not in re.findall(r"^(?:from|import) (\S+)", (REPO / name).read_text(), re.M)
