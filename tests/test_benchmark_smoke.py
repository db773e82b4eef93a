"""The benchmark scripts run end to end on CPU (`--smoke`) and write their raw rows and tables, and refuse bad flags
with one error line. No timing is asserted: only that rows exist, the JSON is valid and the ratios were computed."""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def read_rows(path):
    """(header, rows) of a benchmark's JSON lines: every line whole."""
    header, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"benchmark", "device", "date", "torch", "triton", "transformers", "command", "settings"} <= set(header)
    return header, rows


def run_smoke(script, tmp_path, *extra):
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", "--no-plot", "--out",
                             str(tmp_path), *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (raw,) = tmp_path.glob("*.jsonl")
    return result.stdout, read_rows(raw)[1]


def table_rows(stdout, first_cell):
    return [line for line in stdout.splitlines() if line.startswith(f"| {first_cell}")]


def test_attention_smoke_writes_rows(tmp_path):
    stdout, rows = run_smoke("attention.py", tmp_path, "--impl", "fat5,sdpa_dense_bias,sdpa_nobias",
                             "--causal", "yes")
    assert "| causal | pass | L |" in stdout
    assert {"implementation", "L", "batch", "causal", "pass", "tflops", "ms", "peak_mib", "status"} <= set(rows[0])
    assert {(r["implementation"], r["pass"]) for r in rows if r["status"] == "ok"} >= {
        ("fat5", "fwd"), ("fat5", "fwd+bwd"), ("sdpa_dense_bias", "fwd"), ("sdpa_dense_bias", "fwd+bwd")}


@pytest.mark.slow
def test_train_step_smoke_compares_fat5_with_transformers_t5(tmp_path):
    stdout, rows = run_smoke("train_step.py", tmp_path)
    assert "max|logits - T5 eager fp32 logits| / max|logits|" in stdout
    ok = {(r["implementation"], r["L"]) for r in rows if r["status"] == "ok"}
    assert ok >= {("fat5", 16), ("fat5", 32), ("t5_eager", 16), ("t5_eager", 32)}
    for row in rows:
        if row["status"] == "ok":
            assert row["tokens_per_s"] > 0 and row["ms"] > 0 and row["batch"] * row["L"] == 64
            assert row["flops"] > 0 and row["ops"] > 0 and row["mfu"] is None  # no chip peak on a CPU
    # One table line per L, each ending in the two ratios (speed, memory); the speed ratio is always computed.
    lines = table_rows(stdout, "16 |") + table_rows(stdout, "32 |")
    assert len(lines) == 2
    for line in lines:
        speed = line.strip(" |").split(" | ")[-2]
        assert speed.endswith("x") and float(speed[:-1]) > 0


@pytest.mark.slow
def test_generate_smoke_compares_fat5_with_transformers_t5(tmp_path):
    stdout, rows = run_smoke("generate.py", tmp_path)
    by_key = {(r["implementation"], r["cache"], r["batch"]): r for r in rows}
    # The captured decode step ("graph") is FAT5's own.
    assert set(by_key) == {(name, cache, batch) for name in ("fat5", "t5_eager", "t5_sdpa")
                           for cache in ("dynamic", "static") for batch in (1, 2)} | {("fat5", "graph", 1),
                                                                                     ("fat5", "graph", 2)}
    for name, cache, batch in by_key:
        row = by_key[(name, cache, batch)]
        if name == "t5_sdpa":
            continue
        assert row["status"] == "ok" and row["tokens_per_s"] > 0
        # Same weights, fp32, greedy: every model and cache produces FAT5's dynamic-cache tokens.
        assert row["same_tokens_as_fat5"] is True
        # The first call on its own: to its second new token, then to its end; on CPU the CPU time too.
        assert 0 < row["first_token_s"] <= row["first_call_s"] and row["cpu_ms"] > 0
    assert by_key[("fat5", "graph", 1)]["captured_steps"] == 0  # nothing is captured without CUDA
    # A peer that cannot run here (transformers 4.57 has no SDPA T5) is an error row with its message, not a crash.
    assert all(r["status"] == "ok" or r["status"].startswith("error: ") for r in rows)
    assert {row["encoder_length"] for row in rows} == {16}
    assert all(row["ms_per_token"] > 0 for row in rows if row["status"] == "ok")
    best = table_rows(stdout, "16 | 1 | best") + table_rows(stdout, "16 | 2 | best")
    assert len(best) == 2 and all(line.strip(" |").split(" | ")[-1].endswith("x") for line in best)


@pytest.mark.slow
def test_generate_smoke_times_the_ctranslate2_export_beside_fat5(tmp_path):
    """CTranslate2 rows (cache "own"): FAT5's model exported by convert/ct2_fat5.py generates FAT5's tokens, and
    the `best` rows end with FAT5's ratio to it."""
    pytest.importorskip("ctranslate2")
    stdout, rows = run_smoke("generate.py", tmp_path, "--impl", "fat5,ct2_fp32,ct2_int8", "--caches", "dynamic")
    ct2 = {(r["implementation"], r["batch"]): r for r in rows if r["cache"] == "own"}
    assert set(ct2) == {(name, batch) for name in ("ct2_fp32", "ct2_int8") for batch in (1, 2)}
    for (name, _), row in ct2.items():
        assert row["tokens_per_s"] > 0, row
        if name == "ct2_fp32":  # the same fp32 weights, greedy
            assert row["status"] == "ok" and row["same_tokens_as_fat5"] is True, row
    best = table_rows(stdout, "16 | 1 | best") + table_rows(stdout, "16 | 2 | best")
    assert len(best) == 2 and all(line.strip(" |").split(" | ")[-1].endswith("x") for line in best)


@pytest.mark.slow
def test_loss_memory_smoke_run(tmp_path):
    """benchmarks/loss_memory.py at tiny sizes: both steps counted, chunked loss and gradients equal to the full."""
    script = BENCHMARKS / "loss_memory.py"
    result = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (output,) = tmp_path.glob("loss_memory_*.jsonl")
    row = {key: value for part in read_rows(output)[1] for key, value in part.items()}
    assert set(row["peak_bytes"]) == {"full fp32 logits", "chunked (default)"}
    assert row["chunked_peak_bytes_real_run"] == row["peak_bytes"]["chunked (default)"]
    assert row["loss_relative_difference"] < 1e-5 and row["max_gradient_relative_difference"] < 1e-4
    # liger-kernel's path is compared on CUDA when it is installed; otherwise the row says why not.
    assert isinstance(row["liger"], dict) or row["liger"].startswith("not measured: ")


@pytest.mark.parametrize("script, flags, message", [
    ("train_step.py", ["--lengths", "512,0"], "argument --lengths: 0 is not a positive integer"),
    pytest.param("generate.py", ["--shape", "d_model=x"], "error: --shape d_model: 'x' is not an integer",
                 marks=pytest.mark.slow),
    pytest.param("attention.py", ["--decode", "--decode-batches", "one"],
                 "argument --decode-batches: 'one' is not an integer", marks=pytest.mark.slow),
    pytest.param("attention.py", ["--dropout", "1.0"], "--dropout 1.0: must be in [0, 1)", marks=pytest.mark.slow),
    ("gpu_suite.py", ["--call", "1", "--steps", "tests,nope"], "unknown --steps ['tests', 'nope'] for call 1; choose "
     "from environment, compile, correctness, fp32_parity, attention_encoder, attention_decoder, train_step, "
     "generate, packed_step, pretrain_seed"),
    pytest.param("gpu_suite.py", ["--call", "2", "--cap", "generate=0"], "--cap 'generate=0': expected STEP=SECONDS "
                 "with STEP one of environment, generate_compiled, train_step_t5_compiled, variant_sweep, "
                 "train_step_compiled, attention_dropout, attention_long, train_step_long, generate_long, "
                 "generate_compiled_32, generate_profile, attention_decode, tile_sweep, compile, "
                 "attention_decoder_flex, train_step_flex", marks=pytest.mark.slow),
    pytest.param("tile_sweep.py", ["--kernels", "dq,bwd"], "unknown --kernels ['bwd']; choose from forward, dkdv, dq",
                 marks=pytest.mark.slow),
    pytest.param("variant_sweep.py", ["--configs", "default,band_tile@0.1"], "--configs 'band_tile@0.1': unknown "
                 "kernel variants ['band_tile']; choose from band_tiles, tma, fused_backward", marks=pytest.mark.slow),
    ("gpu_suite.py", [], "say which call to run (--call 1 or --call 2), or --goals ARCHIVE..."),
    ("gpu_suite.py", ["--goals", "missing.tar.gz"], "--goals: no such archive missing.tar.gz"),
    ("gpu_suite.py", ["--call", "1", "--smoke", "--budget", "nan"], "--budget nan: must be a number of seconds, 0 or "
                                                                   "more (0: none)"),
    ("gpu_suite.py", ["--goals", __file__, "--call", "1"], "--call has no effect with --goals, which runs no call"),
    ("compile_times.py", ["--variants", "enc,fp64"], "unknown --variants ['fp64']; choose from enc, dec, cross, "
     "enc_mask, packed, fp16_enc, fp16_dec, drop_enc, drop_dec, d128_enc, alibi_enc, fp32_enc, fp32_dec"),
])
def test_bad_flag_is_one_error_line_and_nonzero_exit(tmp_path, script, flags, message):
    output = ["--out", str(tmp_path / "out")] if script == "gpu_suite.py" else ["--out", str(tmp_path)]
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *flags, *output],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].endswith(message)
    assert "Traceback" not in result.stderr and not any(tmp_path.iterdir())  # nothing measured, nothing written


def gpu_suite_module():
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_suite

    return gpu_suite


def one_line(capsys, main, argv, status=2):
    """The one line a command prints on stderr, ending with exit status `status`."""
    capsys.readouterr()
    assert main([str(arg) for arg in argv]) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def archive(path, members):
    """A gzipped tar archive at `path` holding {name: bytes}."""
    import io

    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("content, says", [
    (b"", "not a callN-rows.tar.gz archive of the GPU plan (an empty file)"),
    (bytes(range(256)) * 4, "not a callN-rows.tar.gz archive of the GPU plan (neither tar nor gzipped tar data)"),
    ({"call1/suite.jsonl": b"[1, 2]\n"}, "line 1 of call1/suite.jsonl is a JSON list, not a row (an object): not the "
                                         "GPU plan's rows"),
    ({"call1/suite.jsonl": b'{"benchmark": "suite"}\n{"step": "caf\xe9"}\n'},
     "line 2 of call1/suite.jsonl is not UTF-8 text: not the GPU plan's rows"),
    ({"call1/suite.jsonl": b'{"benchmark": "suite"}\n{"step": "x"}\n'},
     "--goals: the archives' rows are not the GPU plan's (KeyError: 'call')"),
], ids=["empty", "random bytes", "a list", "not UTF-8", "other rows"])
def test_gpu_suite_goals_of_a_file_that_is_no_archive_of_rows_is_one_line(tmp_path, capsys, content, says):
    """Before: tarfile's ReadError, an AttributeError or a UnicodeDecodeError with their tracebacks."""
    path = tmp_path / "call1-rows.tar.gz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        archive(path, content)
    line = one_line(capsys, gpu_suite_module().main, ["--goals", path])
    assert line.startswith("error: ") and line.endswith(says), line


def test_gpu_suite_appends_to_the_results_only_what_was_measured(tmp_path, capsys, monkeypatch):
    """An archive with nothing measured once exited 0 and appended a 22-line table of "not measured" to
    benchmarks/RESULTS.md; a measured one is appended whole (fat5/safe_files.py)."""
    gpu_suite = gpu_suite_module()
    results = tmp_path / "benchmarks" / "RESULTS.md"
    results.parent.mkdir()
    results.write_text("# Results\n")
    monkeypatch.setattr(gpu_suite, "ROOT", tmp_path)
    nothing = archive(tmp_path / "nothing.tar.gz", {"call1/suite.jsonl": b'{"benchmark": "suite", "call": 1}\n'})
    capsys.readouterr()
    assert gpu_suite.main(["--goals", str(nothing), "--update-results"]) == 2
    captured = capsys.readouterr()
    assert "| goal | figure | status |" in captured.out  # the table is still printed
    assert captured.err.splitlines() == [f"error: --update-results: {nothing} measured no goal (every goal is not "
                                         f"measured): benchmarks/RESULTS.md is left as it is"]
    assert results.read_text() == "# Results\n"
    compiled = {"call1/compile/compile_times.jsonl": b'{"benchmark": "compile_times"}\n{"variant": "enc", '
                                                     b'"dtype": "bfloat16", "head_dim": 64, "compile_s": 12.5, '
                                                     b'"status": "ok"}\n'}
    assert gpu_suite.main(["--goals", str(archive(tmp_path / "compiled.tar.gz", compiled)), "--update-results"]) == 0
    text = results.read_text()
    assert text.startswith("# Results\n\n### GPU plan") and "| 1 of 1, 12 s in all, slowest enc 12 s | met |" in text


def test_gpu_suite_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """Before: a traceback (FileExistsError, NotADirectoryError) and nothing measured."""
    gpu_suite = gpu_suite_module()
    (tmp_path / "a-file").write_text("mine\n")
    for out, says in [(tmp_path / "a-file", f"--out {tmp_path / 'a-file'} is a file, not a folder"),
                      (tmp_path / "a-file" / "out", f"--out {tmp_path / 'a-file' / 'out'}: cannot write there (Not a "
                                                    f"directory)")]:
        line = one_line(capsys, gpu_suite.main, ["--call", "1", "--smoke", "--steps", "environment", "--out", out])
        assert line == f"error: {says}", line
    assert (tmp_path / "a-file").read_text() == "mine\n"
    if os.geteuid() != 0:  # root writes into any folder whatever its permissions
        (tmp_path / "read-only").mkdir(mode=0o555)
        line = one_line(capsys, gpu_suite.main, ["--call", "1", "--smoke", "--out", tmp_path / "read-only"])
        assert line == f"error: --out {tmp_path / 'read-only'}: cannot write there (Permission denied)", line


@pytest.mark.parametrize("number, word, status", [(signal.SIGINT, "interrupted", 130),
                                                  (signal.SIGTERM, "terminated", 143)], ids=["ctrl-c", "sigterm"])
def test_gpu_suite_stopped_during_a_step_stops_the_step_and_says_what_out_holds(tmp_path, number, word, status):
    """Ctrl-C (at the suite alone, as a terminal's reaches its process group: a step runs in a group of its own)
    once ended in a traceback and left the step running as an orphan (compile_times.py --jobs 8). Now the step's
    group is killed, its rows are packed with the others, and one line says what --out holds."""
    out = tmp_path / "out"
    suite_process = subprocess.Popen(suite("--call", "1", "--out", str(out), "--steps", "compile"),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = out / "call1.log", time.monotonic() + 120
    while not (log.exists() and re.search(r"^pid \d+$", log.read_text(), re.M)):
        assert time.monotonic() < deadline and suite_process.poll() is None, "the compile step did not start"
        time.sleep(0.1)
    step = int(re.search(r"^pid (\d+)$", log.read_text(), re.M).group(1))
    suite_process.send_signal(number)
    _, err = suite_process.communicate(timeout=60)
    assert suite_process.returncode == status
    assert err.splitlines() == [f"{word}: {out} holds call1.log, call1-rows.tar.gz and call1-goals.md with the rows "
                                f"of 1 of 1 steps (the last, compile: interrupted)"], err
    with pytest.raises(ProcessLookupError):
        os.killpg(step, 0)  # the step's process group is gone
    assert sorted(path.name for path in out.iterdir()) == ["call1-goals.md", "call1-rows.tar.gz", "call1.log"]
    assert [(row["step"], row["status"]) for row in archive_rows(out / "call1-rows.tar.gz")["suite"][1]] == [
        ("compile", "interrupted")]


def archive_rows(archive):
    """{step: (header, rows)} of a gpu_suite.py archive, every line of every file whole."""
    found = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".jsonl"):
                header, *rows = [json.loads(line) for line in tar.extractfile(member).read().decode().splitlines()]
                parts = member.name.split("/")  # callN/suite.jsonl, callN/STEP/FILE.jsonl
                found[parts[1] if len(parts) == 3 else "suite"] = header, rows
    return found


def suite(*flags):
    return [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--smoke", "--wheels", "no-wheels", *flags]


@pytest.mark.slow
def test_gpu_plan_runs_end_to_end_at_smoke_sizes(tmp_path):
    """Both calls of the plan at once on CPU (as on a GPU they run one after the other, into the same $OUT): every
    step runs and writes rows, each call leaves exactly its three files, and --goals reads both archives."""
    results_before = (BENCHMARKS / "RESULTS.md").read_text()
    out = tmp_path / "out"
    calls = [subprocess.Popen(suite("--call", call, "--out", str(out)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for call in ("1", "2")]
    outputs = [call.communicate(timeout=900)[0] for call in calls]
    assert [call.returncode for call in calls] == [0, 0], outputs
    assert "wheels: none in no-wheels" in outputs[0]
    assert sorted(path.name for path in out.iterdir()) == [
        f"call{call}{suffix}" for call in (1, 2) for suffix in ("-goals.md", "-rows.tar.gz", ".log")]
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_suite

    for call in (1, 2):
        found = archive_rows(out / f"call{call}-rows.tar.gz")
        steps = [step.name for step in gpu_suite.call_steps(call)]
        assert [(row["step"], row["status"]) for row in found["suite"][1]] == [(step, "ok") for step in steps]
        assert set(found) == {"suite", *steps}
        for step in steps:
            header, rows = found[step]
            assert "benchmark" in header and rows, step  # the tests' steps: every GPU test skipped on CPU, a row each
        if call == 1:
            assert all(row["outcome"] == "skipped" for step in ("correctness", "fp32_parity") for row in found[step][1])
        # The interpreter compiles nothing: its first calls less its warm ones were noise, as much as -27 s.
        assert all(row["compile_s"] >= 0 for row in found["compile"][1]), found["compile"][1]
        goals, *tables = (out / f"call{call}-goals.md").read_text().split("\n#### ")
        assert goals.count("\n| ") == 2 + 25
        # Each step's rows as a table too (a step killed before its own table loses nothing).
        assert {table.split(" ")[0] for table in tables} >= set(steps) - {"environment", "correctness", "fp32_parity"}
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--goals",
                             str(out / "call1-rows.tar.gz"), str(out / "call2-rows.tar.gz")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    goals = result.stdout.split("\n#### ")[0]  # then each step's table
    lines = [line for line in goals.splitlines() if line.startswith("| ")][2:]
    assert len(lines) == 25 and all(line.endswith(("| met |", "| MISSED |", "| not measured |")) for line in lines)
    assert goals.startswith(f"### GPU plan {gpu_suite.PLAN_VERSION}, ")
    # What each new step proves at smoke sizes: packed rows pad less, in fewer rows a step; the seed's pretraining
    # loop reports tokens/s; every variant configuration compiles, matches the default kernel at its dropout (the
    # fused backward's fp32 atomics included) and is timed after its default, forward and forward+backward.
    found = archive_rows(out / "call1-rows.tar.gz") | archive_rows(out / "call2-rows.tar.gz")
    padded, packed = found["packed_step"][1]
    assert (padded["implementation"], packed["implementation"]) == ("fat5 padded", "fat5 packed")
    assert packed["padding"] < padded["padding"] and packed["rows_per_step"] < padded["rows_per_step"]
    [seed] = found["pretrain_seed"][1]
    assert seed["status"] == "ok" and seed["tokens_per_s"] > 0 and seed["vocabulary"] == 384
    from variant_sweep import CONFIGS

    rows = found["variant_sweep"][1]
    configs = list(dict.fromkeys(row["config"] for row in rows))
    assert configs == ["default", "default@0.1"] + [c for c in CONFIGS if not c.startswith("default")]
    assert [row["pass"] for row in rows] == ["fwd", "fwd+bwd"] * len(configs)
    assert all(row["status"] == "ok" and row["ms"] > 0 and row["max_difference"] < 1e-4 for row in rows), rows
    assert all(row["speed"] == 1.0 for row in rows if not row["variants"])
    assert {row["implementation"] for row in found["train_step_t5_compiled"][1]} == {"t5_sdpa"}  # smoke: eager
    # The tile sweep: each candidate reaches the kernel module's chip_tiles (checked in the worker that compiles it),
    # compiles, matches the chip's own tiles' results and is timed; the chip's tiles come first, marked current.
    rows = found["tile_sweep"][1]
    assert [(row["kernel"], row["current"]) for row in rows] == [(kernel, current) for kernel in ("forward", "dkdv",
                                                                                                   "dq")
                                                                  for current in (True, False)]
    assert all(row["status"] == "ok" and row["ms"] > 0 and row["max_difference"] < 1e-4 for row in rows), rows
    log = (out / "call2.log").read_text()
    assert "| kernel | BLOCK_M x BLOCK_N, warps, stages |" in log
    # The kernel with and without dropout beside SDPA; one decode step against its cache.
    assert {row["implementation"] for row in found["attention_dropout"][1] if row["status"] == "ok"} >= {
        "fat5", "fat5_nodropout", "sdpa_dense_bias"}
    assert "fat5 / fat5_nodropout" in log and "| batch | Lk | fat5 | sdpa_dense_bias | sdpa_nobias |" in log
    assert {(r["implementation"], r["batch"]) for r in found["attention_decode"][1] if r["status"] == "ok"} == {
        (name, 1) for name in ("fat5", "sdpa_dense_bias", "sdpa_nobias")}
    assert "call 1 fp32_parity ok" in result.stdout and "call 2 train_step_flex ok" in result.stdout
    assert "#### tile_sweep (tile_sweep" in result.stdout
    assert "#### generate_profile (generate_profile)" in result.stdout
    with tarfile.open(out / "call2-rows.tar.gz") as tar:  # the profiler's tables come back in the archive
        (profile,) = [member for member in tar.getmembers() if member.name.endswith(".txt")]
        text = tar.extractfile(profile).read().decode()
    assert profile.name.startswith("call2/generate_profile/generate_profile_")
    assert text.count("\n## fat5, ") == 4 and "Self CPU" in text  # dynamic, graph x batch 1, 2 (smoke sizes)
    assert (BENCHMARKS / "RESULTS.md").read_text() == results_before  # nothing is written into the checkout


@pytest.mark.slow
def test_gpu_plan_keeps_every_row_when_a_step_is_killed(tmp_path):
    """A step killed in the middle (SIGKILL of its process once it has written a row) and a step over its cap
    (1 s) lose only themselves: the rows written before, the earlier steps' rows and the three packed files stay
    whole, and the call goes on to its end."""
    out = tmp_path / "out"
    call = subprocess.Popen(suite("--call", "1", "--out", str(out), "--steps", "environment,attention_decoder,"
                                  "train_step", "--cap", "train_step=1"), stdout=subprocess.DEVNULL)
    log, deadline = out / "call1.log", time.monotonic() + 600
    rows_file = pid = None
    while rows_file is None or len(rows_file.read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and call.poll() is None, "attention_decoder wrote no row"
        time.sleep(0.2)
        text = log.read_text() if log.exists() else ""
        if "===== attention_decoder" in text:
            step = text[text.index("===== attention_decoder"):]
            pid = int(re.search(r"^pid (\d+)$", step, re.M).group(1)) if re.search(r"^pid ", step, re.M) else None
            found = re.search(r"^rows: (.+\.jsonl)$", step, re.M)
            rows_file = Path(found.group(1)) if found else None
    os.kill(pid, signal.SIGKILL)
    written = rows_file.read_text().splitlines()
    assert call.wait(timeout=600) == 0
    assert sorted(path.name for path in out.iterdir()) == ["call1-goals.md", "call1-rows.tar.gz", "call1.log"]
    found = archive_rows(out / "call1-rows.tar.gz")
    assert [(row["step"], row["status"]) for row in found["suite"][1]] == [
        ("environment", "ok"), ("attention_decoder", "killed by signal 9"), ("train_step", "timeout after 1 s")]
    assert len(found["environment"][1]) == 1
    rows = found["attention_decoder"][1]
    assert len(rows) >= 1 and rows == [json.loads(line) for line in written[1:]]
    assert "| goal | figure | status |" in (out / "call1-goals.md").read_text()
    assert "train_step: timeout after 1 s" in log.read_text()


def test_step_flops_count_t5_base_as_docs_benchmarks_states():
    """T5-base, 64 x 512 encoder and 128 decoder tokens: 28.4 TFLOP a step (3 x the matmuls, 3.5 x attention);
    8 x 4096: 38.1."""
    sys.path.insert(0, str(BENCHMARKS))
    import common

    assert common.step_flops(common.V11_BASE, 64, 512, 128) == pytest.approx(28.406e12, rel=1e-4)
    assert common.step_flops(common.V11_BASE, 8, 4096, 128) == pytest.approx(38.118e12, rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA answers")
@pytest.mark.parametrize("script, instead", [
    ("attention.py", "run --smoke (it checks the script in Triton's interpreter)"),
    *(pytest.param(script, "run --smoke (it checks the script), or --allow-cpu with smaller sizes",
                   marks=pytest.mark.slow) for script in ("train_step.py", "generate.py")),
    pytest.param("gpu_suite.py", "run --smoke (it checks the plan itself)", marks=pytest.mark.slow),
    *(pytest.param(script, "run --smoke (it checks the script in Triton's interpreter)", marks=pytest.mark.slow)
      for script in ("compile_times.py", "variant_sweep.py")),
])
def test_default_run_without_a_gpu_says_what_to_run_instead(tmp_path, script, instead):
    call = ["--call", "1"] if script == "gpu_suite.py" else []
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *call, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"{script}: needs a CUDA GPU; on CPU {instead}"], result.stderr[-3000:]
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


# Runs each script given as __main__ in one process, argparse's parse_args replaced: it records the flags without
# help of the parser the script builds and stops the script there. sm90_profile.py goes last (it replaces the
# `fat5` module with a bare package).
EVERY_FLAG_HAS_HELP = """
import argparse, json, os, runpy, sys

class Parsed(Exception):
    pass

def report(parser, *args, **kwargs):
    raise Parsed([action.option_strings or action.dest for action in parser._actions if not action.help])

argparse.ArgumentParser.parse_args = report
without_help = {}
for script in sys.argv[1:]:
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does
    try:
        runpy.run_path(script, run_name="__main__")
    except Parsed as parsed:
        without_help[os.path.basename(script)] = parsed.args[0]
print(json.dumps(without_help))
"""


def test_every_flag_has_help():
    scripts = sorted((path for path in BENCHMARKS.glob("*.py") if path.name != "common.py"),
                     key=lambda path: (path.name == "sm90_profile.py", path.name))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}  # sm90_profile's rule
    result = subprocess.run([sys.executable, "-c", EVERY_FLAG_HAS_HELP, *map(str, scripts)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    without_help = json.loads(result.stdout.strip().splitlines()[-1])
    assert without_help == {path.name: [] for path in scripts}


def test_generate_reports_other_tokens_as_a_mismatch():
    sys.path.insert(0, str(BENCHMARKS))
    import generate

    fat5 = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7]])
    assert generate.token_mismatch(fat5.clone(), fat5) is None
    other = fat5.clone()
    other[1, 3] = 9
    assert generate.token_mismatch(other, fat5) == \
        "mismatch: tokens differ from FAT5's in 1 of 2 rows, from new token 3"
    # The row keeps its speed (as many tokens were generated), and the table marks it.
    row = dict(implementation="t5_eager", cache="dynamic", batch=2, encoder_length=8, tokens_per_s=50.0,
               status="mismatch: ...")
    ours = dict(implementation="fat5", cache="dynamic", batch=2, encoder_length=8, tokens_per_s=100.0, status="ok")
    args = SimpleNamespace(shape={}, dtype="bfloat16", encoder_lengths=[8], new_tokens=3, batches=[2],
                           caches=["dynamic"], impl=["fat5", "t5_eager"], clock="wall")
    table = generate.markdown([ours, row], args)
    assert "| 8 | 2 | dynamic | 100 | 50* | 2.00x |" in table and "`*`: mismatch" in table


def test_gpu_suite_goals_from_rows():
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_suite

    def attention(name, length, passes, tflops, causal=False, peak=None, status="ok"):
        return dict(implementation=name, L=length, causal=causal, status=status, **{"pass": passes}, tflops=tflops,
                    peak_mib=peak)

    rows = [attention("fat5", 512, "fwd+bwd", 210, peak=100), attention("fat5", 2048, "fwd", 360),
            attention("fat5", 2048, "fwd+bwd", 250, peak=110), attention("flex_lut", 2048, "fwd", 150),
            attention("sdpa_cudnn_bias", 2048, "fwd", 300), attention("flex_lut", 2048, "fwd+bwd", 100),
            attention("flex_lut", 512, "fwd+bwd", 120), attention("sdpa_nobias", 2048, "fwd", 400),
            attention("sdpa_efficient_bias", 512, "fwd+bwd", 1000, status="mismatch: max|out - fat5| = 1")]
    goals = gpu_suite.kernel_goals(rows)
    # 250 < 280; the best T5-capable peer at 2048 fwd is cuDNN's (360 / 300), the lowest ratio 210 / 120; a
    # mismatching peer is no peer; 360 / 400 >= 0.85; memory 110 / 100 MiB.
    assert [goal["status"] for goal in goals] == ["met", "MISSED", "met", "met", "met", "met"]
    assert goals[0]["figure"] == "360 (L 2048 encoder fwd)" and goals[3]["figure"].startswith("1.2x (L 2048 encoder")
    assert goals[5]["figure"].startswith("1.10x")
    assert [goal["status"] for goal in gpu_suite.kernel_goals([])] == ["not measured"] * 6

    dropout_rows = [attention("fat5", 2048, "fwd+bwd", 160), attention("fat5_nodropout", 2048, "fwd+bwd", 200),
                    attention("sdpa_dense_bias", 2048, "fwd+bwd", 20), attention("fat5", 512, "fwd+bwd", 100),
                    attention("fat5_nodropout", 512, "fwd+bwd", 150), attention("sdpa_dense_bias", 512, "fwd+bwd", 25)]
    goals = gpu_suite.dropout_goals(dropout_rows)
    assert [goal["status"] for goal in goals] == ["MISSED", "MISSED"]  # 100 / 25 < 5; 100 / 150 < 0.75
    assert [goal["figure"] for goal in goals] == ["4.00x (L 512)", "0.67x (L 512)"]
    assert [goal["status"] for goal in gpu_suite.dropout_goals(dropout_rows[:3])] == ["met", "met"]
    assert [goal["status"] for goal in gpu_suite.dropout_goals([])] == ["not measured"] * 2

    def train(name, length, tokens_per_s, status="ok", batch=1):
        return dict(implementation=name, L=length, batch=batch, tokens_per_s=tokens_per_s, peak_mib=1, status=status)

    train_rows = [train("fat5", 512, 300), train("fat5+compile", 512, 400), train("t5_sdpa", 512, 100),
                  train("t5_flex", 512, 100), train("fat5", 4096, 300), train("t5_sdpa+compile", 4096, 100),
                  train("t5_flex", 4096, 900, status="mismatch: relative logit difference 1"), train("fat5", 32768, 50)]
    generate_rows = [dict(implementation="fat5", batch=1, encoder_length=512, tokens_per_s=90, status="ok"),
                     dict(implementation="t5_sdpa", batch=1, encoder_length=512, tokens_per_s=50, status="ok")]
    goals = gpu_suite.model_goals(train_rows, generate_rows)
    # ... then issue 45's five captured-step goals, not measured by these rows (no cache named).
    assert [goal["status"] for goal in goals] == ["met", "MISSED", "met", "MISSED", *["not measured"] * 5]
    assert goals[0]["figure"] == "4.00x (against t5_flex, t5_sdpa)" and goals[1]["figure"].startswith("3.00x")
    assert [goal["status"] for goal in gpu_suite.model_goals([], [])] == ["not measured"] * 9
    # Issue 44's: MFU and the compiled peer at L = 512 from FAT5's fastest row, its peak against 2026-11-27's, the
    # seed's tokens/s, packed against padded.
    train_rows[1].update(mfu=0.35, peak_mib=20000)
    train_rows.append(train("t5_sdpa+compile", 512, 200))
    packed = [dict(implementation="fat5 padded", target_tokens_per_s=100.0, status="ok"),
              dict(implementation="fat5 packed", target_tokens_per_s=140.0, status="ok")]
    seed = [dict(implementation="fat5 pretrain", tokens_per_s=450e3, status="ok")]
    goals = gpu_suite.training_goals(train_rows, packed, seed)
    assert [goal["status"] for goal in goals] == ["met", "met", "met", "met", "MISSED"]
    assert [goal["figure"] for goal in goals] == ["35.0% (fat5+compile)", "2.00x (fat5+compile)",
                                                  "0.00x (1 MiB)", "4.5e+05 tokens/s", "1.40x (140 against 100)"]
    assert [goal["status"] for goal in gpu_suite.training_goals([], [], [])] == ["not measured"] * 5
    assert gpu_suite.model_goals([train("fat5", 32768, None, status="oom")], [])[2]["status"] == "MISSED"
    # A peer whose tokens differ generated as many: its speed still counts against FAT5's.
    generate_rows[1]["status"] = "mismatch: tokens differ from FAT5's in 1 of 1 rows, from new token 7"
    assert gpu_suite.model_goals(train_rows, generate_rows)[3]["figure"] == "1.80x (batch 1, encoder 512)"

    tests = [dict(test="a.py::x", outcome="passed"), dict(test="a.py::y[bf16]", outcome="failed"),
             dict(test="a.py::z", outcome="skipped")]
    assert gpu_suite.tests_goal("tests", tests) == dict(goal="tests", figure="1 passed, 1 failed (y[bf16])",
                                                        status="MISSED")
    assert gpu_suite.tests_goal("tests", tests[2:])["status"] == "not measured"


def test_sdpa_peers_get_the_dense_bias_contiguous(monkeypatch):
    """The fused SDPA backends refuse a mask whose last stride is not 1 ("No available kernel" on the H100): every
    SDPA peer gets T5's bias contiguous, built inside the timed call, equal to the gathered bias (and -inf above
    the diagonal when causal)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(BENCHMARKS))
    import attention

    seen = []

    def spy(q, k, v, attn_mask=None, **options):
        seen.append(attn_mask)
        return torch.zeros_like(q)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    table = torch.randn(attention.NUM_BUCKETS, 3)
    q = torch.randn(2, 3, 20, 8)
    for name in ("sdpa_dense_bias", "sdpa_efficient_bias", "sdpa_cudnn_bias"):
        for causal in (False, True):
            seen.clear()
            try:
                attention.run(name, q, q, q, table, causal)
            except RuntimeError:  # a backend this build lacks: the mask was still built and passed
                pass
            (mask,) = seen
            assert mask.is_contiguous() and mask.stride(-1) == 1 and mask.shape == (1, 3, 20, 20)
            expected = attention.causal_mask_bias(attention.dense_bias(table, 20, causal), causal)
            assert torch.equal(mask, expected)


def test_time_calls_reports_throughput_and_latency():
    """common.time_calls: both timings of every call, the throughput over calls back to back (torch.utils.benchmark
    on CPU, triton.testing.do_bench on CUDA) after the latency's calls; a call slower than half the time allowed is
    not repeated (its throughput is its latency)."""
    sys.path.insert(0, str(BENCHMARKS))
    import common

    calls = []
    timing = common.time_calls(lambda: calls.append(time.sleep(0.002)), reps=5, warmup=2, seconds=0.0)
    assert len(calls) > 2 + 5  # warm-up, latency, then the throughput's calls
    assert timing["ms"] >= 2 and timing["latency_ms"] >= 2 and timing["host_ms"] is None
    calls.clear()
    slow = common.time_calls(lambda: calls.append(time.sleep(0.03)), reps=5, warmup=1, seconds=0.05)
    assert len(calls) == 1 + 1 and slow["ms"] == slow["latency_ms"] >= 30 and slow["host_ms"] is None
    assert common.time_ms(lambda: time.sleep(0.002), reps=3, warmup=1) >= 2


def test_gpu_suite_rebuilds_each_steps_table_from_its_rows():
    """A step killed before printing its table (the first run's decoder step) still gets one in callN-goals.md:
    the rows it wrote, throughput and latency side by side, a refusal's reason in its cell, test failures listed."""
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_suite

    def row(name, passes, ms, status="ok"):
        return dict(implementation=name, L=512, batch=64, causal=True, status=status, **{"pass": passes},
                    tflops=None if ms is None else 10 / ms, ms=ms, latency_ms=None if ms is None else 2 * ms)

    found = {"attention": [("attention_decoder", {}, [row("fat5", "fwd", 0.5), row("fat5", "fwd+bwd", 1.0),
                                                      row("sdpa_cudnn_bias", "fwd", None, "error: No available "
                                                          "kernel (reason | here)")])],
             "generate_compiled": [],
             "tests": [("correctness", {}, [dict(test="t.py::a[x]", when="call", outcome="failed",
                                                 message="AssertionError: 1.73e-3 > 6.46e-4")])]}
    text = gpu_suite.step_tables(found)
    assert "| causal | pass | L | fat5 | sdpa_cudnn_bias |" in text
    assert "| True | fwd | 512 | 20 (0.5 / 1 ms) | error: No available kernel (reason / here) |" in text
    assert "| True | fwd+bwd | 512 | 10 (1 / 2 ms) | - |" in text
    assert "#### correctness: 1 failed" in text and "`t.py::a[x]` (call): AssertionError: 1.73e-3 > 6.46e-4" in text
