"""benchmarks/attention.py runs end to end (CPU, interpreter) and writes its raw rows. No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "attention.py"


def test_smoke_run_writes_rows(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--no-plot", "--out-dir", str(tmp_path),
                             "--impl", "fat5,sdpa_dense_bias,sdpa_nobias", "--causal", "yes"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| causal | pass | L |" in result.stdout
    (raw,) = tmp_path.glob("*.json")
    rows = json.loads(raw.read_text())["rows"]
    assert {"implementation", "L", "batch", "causal", "pass", "tflops", "ms", "peak_mib", "status"} <= set(rows[0])
    assert {(r["implementation"], r["pass"]) for r in rows if r["status"] == "ok"} >= {
        ("fat5", "fwd"), ("fat5", "fwd+bwd"), ("sdpa_dense_bias", "fwd"), ("sdpa_dense_bias", "fwd+bwd")}


def test_loss_memory_smoke_run(tmp_path):
    """benchmarks/loss_memory.py at tiny sizes: both steps counted, chunked loss and gradients equal to the full."""
    script = SCRIPT.parent / "loss_memory.py"
    output = tmp_path / "loss_memory.json"
    result = subprocess.run([sys.executable, str(script), "--smoke", "--output", str(output)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(output.read_text())
    assert set(row["peak_bytes"]) == {"full fp32 logits", "chunked (default)"}
    assert row["chunked_peak_bytes_real_run"] == row["peak_bytes"]["chunked (default)"]
    assert row["loss_relative_difference"] < 1e-5 and row["max_gradient_relative_difference"] < 1e-4


def test_decode_smoke_run_writes_rows(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--decode", "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| batch | Lk | fat5 | sdpa_dense_bias | sdpa_nobias |" in result.stdout
    (raw,) = tmp_path.glob("*_decode.json")
    rows = json.loads(raw.read_text())["rows"]
    assert {(r["implementation"], r["batch"]) for r in rows if r["status"] == "ok"} == {
        (name, 1) for name in ("fat5", "sdpa_dense_bias", "sdpa_nobias")}
