"""FAT5's GPU plan: what a lent GPU measures, in two calls that fit a 15-minute device window, losing nothing.

    python benchmarks/gpu_suite.py --call 1 --out $OUT     # one H100: at most 9 minutes
    python benchmarks/gpu_suite.py --call 2 --out $OUT     # at most 5 minutes, right after it
    python benchmarks/gpu_suite.py --call 1 --smoke --out DIR   # CPU, smoke sizes: the same plan checks itself
    python benchmarks/gpu_suite.py --goals call1-rows.tar.gz call2-rows.tar.gz [--update-results]
                                                           # the goal table from what came back, on any machine

A call runs its steps (PLAN below) in order of value, each in its own process under its own cap in seconds, and
starts no step once its --budget is spent. Each step is one of the benchmark scripts, the GPU tier's tests, or the
environment; children run unbuffered and write every row the moment it is measured (JSON lines). After every step
the suite packs everything into three files in --out: callN.log (every step's output, each step headed by its
command and process id), callN-rows.tar.gz (every row so far) and callN-goals.md (the goal table so far, then
each step's rows as a table), so a timeout, a crash or a kill loses only the step in flight. Wheels in --wheels
(scripts/fetch_gpu_wheels.py fetches the tested transformers and liger-kernel, which the GPU image lacks) are
first installed offline into the work folder, which goes first on the children's PYTHONPATH; without them the plan
runs on what is installed and its first line says so.

The command line follows FAT5's commands (fat5/cli.py): a bad flag, an unreadable archive or an --out that cannot be
written is one `error:` line, exit status 2; Ctrl-C or SIGTERM stops the running step's whole process group (its
workers and compilers too), packs what the call measured so far, and ends with one `interrupted:` (130) or
`terminated:` (143) line saying what --out holds.
"""

import argparse
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections import namedtuple
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# No torch, no transformers: the suite imports neither (standard library only, as fat5/cli.py).
from fat5.cli import CommandError, error_line, exit_with, run  # noqa: E402
from fat5.safe_files import signals_deferred, write_atomically  # noqa: E402
from fat5.training.flags import HelpFormatter  # noqa: E402

# One step: `command` runs with `python` in the repository root; with --smoke, `smoke` is appended (argparse keeps
# an option's last value). `estimate`: seconds expected on an H100 machine, set from the first run's durations
# (benchmarks/results/2026-11-27-h100/call*.log; a step that ran out of time: what it did by then, extrapolated);
# `cap`: the step's limit, the estimate with a margin. Counts behind them: a child starts in 5-8 s (torch,
# transformers); a bf16/fp16 variant of the kernel compiles its forward, dK/dV and dQ in 11-14 s of one core (fp32:
# 9-33 s a kernel); FlexAttention compiles 10-20 s a shape; a T5-base training step takes 0.25-0.7 s; a generate
# call of 128 tokens 2-4 s (eager).
Step = namedtuple("Step", "call name cap estimate command smoke")
PEERS = "sdpa_dense_bias,sdpa_efficient_bias,sdpa_cudnn_bias,sdpa_nobias"
# attention.py's first call of each implementation (the output check) compiles and warms it: one more warm-up call,
# then up to 10 calls alone (latency) within half a second and up to 10 back to back (throughput) within the other
# half (a slow peer: one of each, or one alone). The dense-bias peers' backward stops at L = 2048: at 8192 each of
# their calls took 9-10 s (the bias table's gradient), 20 s a backend, which ran the first decoder step out of time.
QUICK = ["--reps", "10", "--warmup", "1", "--max-seconds", "1", "--no-plot"]
DENSE = ["--dense-backward-max-length", "2048"]
SMOKE_ATTENTION = ["--smoke", "--impl", "fat5,sdpa_dense_bias,sdpa_cudnn_bias,sdpa_nobias"]
TESTS = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_suite", "-q", "-rfE", "-m", ""]
# The GPU tier in half precision only: the kernel's realistic sizes (padded, packed, causal, decode offsets,
# dropout, every gradient), dropout statistics, offsets past 2^31, memory flat in L, and the whole model in bf16
# against eager attention (bias tables' gradients included). 24 tests, 55 s on 8 workers (2026-11-27).
CORRECTNESS = ("half_precision_on_gpu or keep_rate or many_heads or memory_is_flat or (low_precision and full) or "
               "(gpu and (test_feed_forward or test_rms_norm))")
# ... and the fused feed-forward's and residual norm's bf16 cases (the interpreter cannot run bf16 dot products).
TEST_FILES = ["tests/test_flash_attention_t5.py", "tests/test_gpu_model.py", "tests/test_feed_forward.py",
              "tests/test_rms_norm.py"]
# The whole model in fp32 on CUDA against eager attention (every position encoding, d = 64 and 128, L = 512 and
# 2048), generation with every backend and cache, a FLAN-T5 conversion in bf16, the fused kernels at model sizes,
# liger-kernel's loss, a compiled training step, gradient checkpointing with dropout: 27 tests, never run on a GPU
# yet; the fp32 kernels compile here (9-33 s each), 16 at once (the machine's cores), Inductor once.
PARITY = ("(full and (fp32 or every_backend or flan_t5 or rms_norm or compiled or checkpointing) and not "
          "low_precision) or liger")
GENERATE = ["benchmarks/generate.py", "--impl", "fat5,t5_sdpa", "--encoder-lengths", "512", "--no-plot"]
GENERATE_T5 = ["benchmarks/generate.py", "--impl", "t5_sdpa", "--encoder-lengths", "512", "--no-plot"]
TRAIN = ["benchmarks/train_step.py", "--reps", "5", "--warmup", "2", "--max-seconds", "8", "--no-plot"]
# The plan's version: the goal table is computed from the archives of one version (the newest given); an older
# version's archives get a table of their own beside it, never mixed in (their steps and timings differ). 1: the
# plan of 2026-11-27 (its archives carry no version); 2: this one (issue 46: fp32 parity capped, every compiling
# peer in a step of its own, the training-step and generation rows of issues 44 and 45, the kernel variants).
PLAN_VERSION = 2
PLAN = [
    # Call 1: a 510 s budget (timeout_s 540); estimates 488 s in all, the last two as time allows. Correctness
    # first, then every goal that needs no Inductor compile.
    Step(1, "environment", 30, 8, ["-c", "ENVIRONMENT"], []),
    # 7 variants on 8 workers: 30 s (and Triton's cache then holds them for the steps below).
    Step(1, "compile", 60, 30, ["benchmarks/compile_times.py", "--jobs", "8"], ["--smoke", "--variants", "enc,packed"]),
    # 61 s for the kernel's 24 tests on 8 workers; the fused feed-forward's and norm's 38 bf16 cases (small
    # elementwise kernels) about 15 s more.
    Step(1, "correctness", 110, 75, [*TESTS, "-n", "8", "-k", CORRECTNESS, *TEST_FILES], ["-m", "gpu"]),
    # Capped at 100 s (never run: 130 s estimated on 8 workers, now 16): however long it takes, the goal steps
    # below keep their estimates (8 + 30 + 75 + 100 + 65 + 35 + 45 + 110 = 468 of 510). A test cut by the cap
    # leaves the rows of those that ended.
    Step(1, "fp32_parity", 100, 75, [*TESTS, "-n", "16", "-k", PARITY, "tests/test_gpu_model.py"], ["-m", "gpu"]),
    # 70 s on 2026-11-27 with 2 of 6 implementations refusing at once; now both run (a few s), the dense backward
    # at 8192 (20 s) is not run.
    Step(1, "attention_encoder", 100, 65, ["benchmarks/attention.py", "--causal", "no", "--lengths",
                                           "512,2048,8192", "--impl", f"fat5,flex_lut,{PEERS}", *QUICK, *DENSE],
         SMOKE_ATTENTION),
    # Every row came in 60 s, 38 s of them the dense backward at 8192 (efficient and default), now not run.
    Step(1, "attention_decoder", 60, 35, ["benchmarks/attention.py", "--causal", "yes", "--lengths",
                                          "512,2048,8192", "--impl", f"fat5,{PEERS}", *QUICK, *DENSE],
         SMOKE_ATTENTION),
    # 44 s. Each row's MFU and op count (issue 44).
    Step(1, "train_step", 75, 45, [*TRAIN, "--impl", "fat5,t5_sdpa", "--lengths", "512,4096"], ["--smoke"]),
    # 6 of 8 rows in 100 s (the decode kernels' first compiles, 7-8 s a FAT5 row, 4-5 s a T5 row): 110 s. FAT5's
    # eager (dynamic) and captured (graph) steps and transformers' eager T5, each row's first call timed on its own.
    Step(1, "generate", 150, 110, [*GENERATE, "--caches", "dynamic,graph", "--batches", "1,32", "--reps", "1",
                                   "--warmup", "1"], ["--smoke"]),
    # Issue 44's: packed against padded fine-tuning on the length mix (two models, 12 steps each), then the seed's
    # pretraining configuration (a `fat5 pretrain` process, 60 steps). Not run yet: estimated from the training
    # step's speed plus a process start and the kernels' compiles.
    Step(1, "packed_step", 50, 20, ["benchmarks/packed_step.py"], ["--smoke"]),
    Step(1, "pretrain_seed", 75, 25, ["benchmarks/pretrain_seed.py"], ["--smoke"]),
    # Call 2: a 270 s budget (timeout_s 300); estimates 248 s up to variant_sweep, then what fits, in order of
    # value. The peers that compile (Inductor: over a minute for a 12-layer decoder on that host) each in a step of
    # its own under its own cap.
    Step(2, "environment", 20, 8, ["-c", "ENVIRONMENT"], []),
    # transformers' T5 with a static cache under torch.compile ("reduce-overhead": CUDA graphs), the peer of FAT5's
    # captured step: one timed call after the first (the compile, timed as first_token_s).
    Step(2, "generate_compiled", 130, 100, [*GENERATE_T5, "--caches", "static+compile", "--batches", "1", "--reps",
                                            "1", "--warmup", "1"],
         ["--smoke", "--caches", "static"]),  # Inductor's CPU compile takes minutes
    # transformers' T5 with SDPA under torch.compile, the training step's compiled peer (issue 44: >= 1.5x it at
    # L = 512); after the variant sweep, FAT5's own compiled step. Never run: one Inductor compile of encoder and
    # decoder, forward and backward, each.
    Step(2, "train_step_t5_compiled", 110, 80, [*TRAIN, "--impl", "t5_sdpa+compile", "--lengths", "512"],
         ["--smoke", "--impl", "t5_sdpa"]),
    # The kernel's variants against today's kernel (issue 46): 7 configurations compiled 8 at once (about 40 s),
    # then L = 512, 2048, 8192, forward and forward+backward, half a second each; dropout re-timed with them.
    Step(2, "variant_sweep", 110, 60, ["benchmarks/variant_sweep.py", "--jobs", "8", "--max-seconds", "0.5"],
         ["--smoke"]),
    Step(2, "train_step_compiled", 110, 80, [*TRAIN, "--impl", "fat5+compile", "--lengths", "512"],
         ["--smoke", "--impl", "fat5"]),
    Step(2, "attention_dropout", 55, 40, ["benchmarks/attention.py", "--causal", "no", "--dropout", "0.1",
                                          "--lengths", "2048,8192", "--impl",
                                          "fat5,fat5_nodropout,sdpa_dense_bias,sdpa_nobias", *QUICK], ["--smoke"]),
    # Memory at 16k and 32k (batch 2 and 1): the dense-bias peers up to 16k, forward only; then training there.
    Step(2, "attention_long", 40, 22, ["benchmarks/attention.py", "--causal", "no", "--lengths", "16384,32768",
                                       "--impl", "fat5,sdpa_dense_bias,sdpa_cudnn_bias,sdpa_nobias",
                                       "--peer-max-length", "16384", *QUICK, *DENSE], SMOKE_ATTENTION),
    Step(2, "train_step_long", 50, 35, [*TRAIN[:1], "--impl", "fat5", "--lengths", "16384,32768", "--reps", "3",
                                        "--warmup", "1", "--max-seconds", "8", "--no-plot"], ["--smoke"]),
    Step(2, "generate_long", 60, 45, [*GENERATE[:-3], "--encoder-lengths", "4096", "--no-plot", "--caches",
                                      "dynamic,graph", "--batches", "1,32", "--reps", "1", "--warmup", "1"],
         ["--smoke"]),
    # The compiled peer at batch 32 (issue 45's second target): a compile of its own, capped alone.
    Step(2, "generate_compiled_32", 130, 100, [*GENERATE_T5, "--caches", "static+compile", "--batches", "32",
                                               "--reps", "1", "--warmup", "1"], ["--smoke", "--caches", "static"]),
    # Where a generation step's host time goes: a warm-up and a profiled call of 32 tokens for each cache.
    Step(2, "generate_profile", 50, 30, [*GENERATE, "--profile", "--caches", "dynamic,graph", "--batches", "1",
                                         "--new-tokens", "32"], ["--smoke"]),
    Step(2, "attention_decode", 30, 18, ["benchmarks/attention.py", "--decode", "--decode-lengths", "1024,8192",
                                         *QUICK], ["--smoke"]),
    # 19 candidates on 8 workers (a process start, 2-3 kernels each), then 1 s of timing each.
    Step(2, "tile_sweep", 90, 55, ["benchmarks/tile_sweep.py", "--jobs", "8"], ["--smoke"]),
    Step(2, "compile", 40, 25, ["benchmarks/compile_times.py", "--variants", "drop_enc,drop_dec,d128_enc,alibi_enc",
                                "--jobs", "4"], ["--smoke", "--variants", "drop_enc"]),
    Step(2, "attention_decoder_flex", 60, 50, ["benchmarks/attention.py", "--causal", "yes", "--lengths",
                                               "512,2048,8192", "--impl", "fat5,flex_lut", *QUICK],
         ["--smoke", "--impl", "fat5"]),
    # transformers' T5 with FlexAttention compiles per shape: no row in 90 s at L = 512; L = 4096 first.
    Step(2, "train_step_flex", 120, 110, [*TRAIN, "--impl", "t5_flex", "--lengths", "4096,512"],
         ["--smoke", "--impl", "t5_eager"]),  # FlexAttention's CPU compile takes minutes
]
# Device time (docs/benchmarks.md): 900 s = machine start and transfers (35 s on 2026-11-27) + call 1 (timeout_s
# 540) + call 2 (timeout_s 300) + 25 s spare. A call that fails early is rerun with a --budget that keeps call 2.
BUDGETS = {1: 510, 2: 270}
MIN_STEP_SECONDS = 10  # a step is not started with less left than this
SMOKE_CAP = 600  # each step's cap with --smoke: CPUs differ widely
PACK_SECONDS = 3  # kept back from the last step for packing
# The environment step: device, versions, what is installed; one row.
ENVIRONMENT = """
import importlib.metadata, json, shutil, subprocess, sys
from pathlib import Path
import torch, transformers
import common
row = dict(device=common.device_name(), **common.versions(), transformers_from=transformers.__file__,
           python=sys.version.split()[0], cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
if torch.cuda.is_available():
    properties = torch.cuda.get_device_properties(0)
    row.update(capability=f"{properties.major}.{properties.minor}", multiprocessors=properties.multi_processor_count,
               memory_gib=round(properties.total_memory / 2**30, 1))
for package in ("liger-kernel", "pytest-xdist", "matplotlib"):
    try:
        row[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        row[package] = None
common.Rows("environment", {}, Path(sys.argv[1])).append(row)
print(json.dumps(row, indent=1))
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi"])
"""
TEST_ROWS = "FAT5_TEST_ROWS"  # where the pytest plugin below writes a row per test


def call_steps(call):
    return [step for step in PLAN if step.call == call]


# ---- the pytest plugin (`-p gpu_suite`): one JSON line per test, written when the test ends --------------------

_test_rows = None


def pytest_configure(config):
    global _test_rows
    if os.environ.get(TEST_ROWS) and not hasattr(config, "workerinput"):  # xdist's workers report to the controller
        _test_rows = Path(os.environ[TEST_ROWS])
        _test_rows.write_text(json.dumps({"benchmark": "tests", "command": " ".join(sys.argv)}) + "\n")


def pytest_runtest_logreport(report):
    if _test_rows is None or (report.when != "call" and report.outcome == "passed"):
        return
    if report.outcome == "passed":
        message = ""
    elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        message = str(report.longrepr[2])
    else:  # pytest's "E   ..." lines (the assertion and its values), or the report's last line
        lines = report.longreprtext.strip().splitlines() or [""]
        message = (" / ".join(line[1:].strip() for line in lines if line.startswith("E ")) or lines[-1])[:600]
    row = dict(test=report.nodeid, when=report.when, outcome=report.outcome, seconds=round(report.duration, 2),
               message=message)
    with open(_test_rows, "a") as file:
        file.write(json.dumps(row) + "\n")


# ---- running a call ----------------------------------------------------------------------------------------------


def install_wheels(folder, site):
    """pip install --no-index --no-deps --target `site` every wheel in `folder`; returns the one line to log."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return (f"wheels: none in {folder} (python scripts/fetch_gpu_wheels.py fetches them): running with the "
                "installed transformers and without liger-kernel unless installed")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--target", str(site), *map(str, wheels)], capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["pip failed"]
        return f"wheels: not installed ({lines[-1][:200]}): running with what is installed"
    return f"wheels: installed {', '.join(wheel.name for wheel in wheels)}"


def step_command(step, smoke, rows_dir):
    if step.command[0] == "-c":
        return [sys.executable, "-c", ENVIRONMENT, str(rows_dir)]
    command = [sys.executable, *step.command, *(step.smoke if smoke else [])]
    if step.command[0].endswith(".py"):
        command += ["--out", str(rows_dir)]
    elif "-n" in command and importlib.util.find_spec("xdist") is None:  # pytest without xdist: one process
        del command[command.index("-n"):command.index("-n") + 2]
    return command


def run_step(command, cap, log, env):
    """Run `command` as a process group under `cap` seconds, its output into `log`; returns (status, seconds). The
    group is killed whole (the step and what it started: pytest's workers, compilers) at the cap, or when the suite
    is interrupted or terminated (fat5.cli.run raises KeyboardInterrupt for Ctrl-C and SIGTERM: the group, in a
    process group of its own, gets neither from the terminal); it stays in the suite's session, so nothing outlives
    the device call."""
    log.flush()
    start = time.monotonic()
    process = None
    try:
        with signals_deferred():  # a signal now comes once the group exists, to be killed with it
            process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=os.setpgrp)
        log.write(f"pid {process.pid}\n")
        log.flush()
        code = process.wait(timeout=cap)
        status = "ok" if code == 0 else (f"killed by signal {-code}" if code < 0 else f"exit {code}")
    except subprocess.TimeoutExpired:
        kill_group(process)
        status = f"timeout after {cap:.0f} s"
    except BaseException:
        kill_group(process)
        raise
    return status, round(time.monotonic() - start, 1)


def kill_group(process):
    """Kill a step's process group (it may have ended already) and reap the step."""
    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def pack(rows_dir, out, call, log_line):
    """The archive of every row so far and the goal table so far, each replaced whole (never half-written)."""
    archive = out / f"call{call}-rows.tar.gz"
    with tarfile.open(archive.with_name(archive.name + ".partial"), "w:gz") as tar:
        tar.add(rows_dir, arcname=f"call{call}")
    os.replace(archive.with_name(archive.name + ".partial"), archive)
    goals = out / f"call{call}-goals.md"
    try:
        table = goal_table(read_archives([archive]))
    except Exception as error:  # a goal that cannot be computed must not stop the call: the rows are safe
        table = f"goal table not computed ({type(error).__name__}: {error}): run --goals on the archive\n"
    goals.with_name(goals.name + ".partial").write_text(table)
    os.replace(goals.with_name(goals.name + ".partial"), goals)
    log_line(f"packed: {archive.name}, {goals.name}")


def check_out(out):
    """--out is a folder the call can write (made if missing): one line otherwise, before any step runs."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise CommandError(f"--out {out}: cannot write there ({error.strerror or error_line(error)})") from None


def run_call(args, progress=None):
    began = time.monotonic()
    check_out(args.out)
    log_path = args.out / f"call{args.call}.log"
    steps = [step for step in call_steps(args.call) if step.name in args.steps]
    packed = []  # (step, status) of the steps whose rows --out holds

    def describe():
        if not packed:
            return f"{args.out} holds no rows of call {args.call} (its log is {log_path})"
        return (f"{args.out} holds call{args.call}.log, call{args.call}-rows.tar.gz and call{args.call}-goals.md with "
                f"the rows of {len(packed)} of {len(steps)} steps (the last, {packed[-1][0]}: {packed[-1][1]})")

    if progress is not None:
        progress.describe = describe
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as work, open(log_path, "a") as log:
        def log_line(text):
            line = f"[{datetime.now().strftime('%H:%M:%S')}] {text}"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()

        rows_dir, site = Path(work) / "rows", Path(work) / "site"
        rows_dir.mkdir()
        budget = f"a budget of {args.budget:.0f} s" if args.budget else "no budget"
        log_line(f"gpu_suite.py call {args.call}{' (smoke)' if args.smoke else ''}, {budget}: "
                 f"{install_wheels(args.wheels, site)}")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(site), str(ROOT), str(ROOT / "benchmarks"),
                                                            os.environ.get("PYTHONPATH")])))
        suite_rows = rows_dir / "suite.jsonl"
        suite_rows.write_text(json.dumps({"benchmark": "suite", "plan": PLAN_VERSION, "call": args.call,
                                          "smoke": args.smoke, "budget": args.budget,
                                          "command": " ".join(sys.argv)}) + "\n")

        def finish_step(step, status, seconds):
            # Ctrl-C and SIGTERM wait until the step's row is recorded and every file packed (none half-written).
            with signals_deferred():
                with open(suite_rows, "a") as file:
                    file.write(json.dumps(dict(step=step.name, call=args.call, status=status, seconds=seconds,
                                               cap=step.cap, estimate=step.estimate)) + "\n")
                log_line(f"{step.name}: {status} ({seconds} s)")
                pack(rows_dir, args.out, args.call, log_line)
                packed.append((step.name, status))

        for step in steps:
            left = args.budget - (time.monotonic() - began) - PACK_SECONDS if args.budget else float("inf")
            cap = min(args.caps.get(step.name, SMOKE_CAP if args.smoke else step.cap), left)
            step_dir = rows_dir / step.name
            step_dir.mkdir()
            if cap < MIN_STEP_SECONDS and step.name not in args.caps:
                status, seconds = f"skipped: {max(left, 0):.0f} s of the budget left", 0.0
            else:
                command = step_command(step, args.smoke, step_dir)
                shown = command if command[1] != "-c" else [*command[:2], "ENVIRONMENT", *command[3:]]
                log.write(f"\n===== {step.name} (cap {cap:.0f} s, estimate {step.estimate} s): {shlex.join(shown)}\n")
                stepped = time.monotonic()
                try:
                    status, seconds = run_step(command, cap, log, dict(env, **{TEST_ROWS: str(step_dir /
                                                                                              "tests.jsonl")}))
                except KeyboardInterrupt:  # the step's group is killed; the rows it wrote are packed
                    finish_step(step, "interrupted", round(time.monotonic() - stepped, 1))
                    raise
            finish_step(step, status, seconds)
        log_line(f"call {args.call} done in {time.monotonic() - began:.0f} s")
    print("\n" + (args.out / f"call{args.call}-goals.md").read_text(), flush=True)


# ---- the goal table ------------------------------------------------------------------------------------------------

STATUS = {True: "met", False: "MISSED", None: "not measured"}


def read_archives(paths):
    """{benchmark: [(step, header, rows)]} of every JSON-lines file in the archives (a line cut short is dropped); a
    file that is not such an archive, or holds other JSON, is one line naming it (CommandError)."""
    found = {}
    for path in paths:
        try:
            with tarfile.open(path) as tar:
                for member in tar.getmembers():
                    if member.name.endswith(".jsonl"):
                        read_rows(path, member.name, tar.extractfile(member).read(), found)
        except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
            reason = "an empty file" if path.stat().st_size == 0 else "neither tar nor gzipped tar data" \
                if isinstance(error, tarfile.ReadError) else error_line(error)
            raise CommandError(f"--goals {path}: not a callN-rows.tar.gz archive of the GPU plan ({reason})") \
                from None
    return found


def read_rows(path, name, raw, found):
    """Add the header and rows of the JSON-lines file `name` (bytes `raw`) of the archive `path` to `found`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise CommandError(f"--goals {path}: line {line} of {name} is not UTF-8 text: not the GPU plan's rows") \
            from None
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(document, dict):
            raise CommandError(f"--goals {path}: line {number} of {name} is a JSON {type(document).__name__}, not a "
                               f"row (an object): not the GPU plan's rows")
        documents.append(document)
    if documents:
        header, *rows = documents
        found.setdefault(header.get("benchmark"), []).append((Path(name).parent.name, header, rows))


def all_rows(found, benchmark, steps=None):
    return [row for step, _, rows in found.get(benchmark, []) if steps is None or step in steps for row in rows]


def ok(rows, **match):
    return [row for row in rows if row.get("status") == "ok" and all(row.get(k) == v for k, v in match.items())]


def goal(name, value, met, text=None):
    """One line of the goal table: its figure (None: not measured) and whether `met(value)`."""
    if value is None:
        return dict(goal=name, figure="-", status=STATUS[None])
    return dict(goal=name, figure=text if text is not None else f"{value:.3g}", status=STATUS[bool(met(value))])


def lowest(pairs):
    """(value, where) of the smallest value among (value, where) pairs, or (None, None)."""
    return min(pairs, key=lambda pair: pair[0], default=(None, None))


def at_least(target):
    return lambda value: value >= target


def kernel_goals(attention):
    """Issue 34's kernel goals from attention.py's rows (no dropout), pooled over the plan's steps."""
    fat5 = ok(attention, implementation="fat5")
    keys = sorted({(row["L"], row["causal"], row["pass"]) for row in fat5})

    def best(name_test, key):
        values = [row["tflops"] for row in ok(attention, L=key[0], causal=key[1]) if row["pass"] == key[2]
                  and name_test(row["implementation"])]
        return max(values, default=None)

    def where(key):
        return f"L {key[0]} {'decoder' if key[1] else 'encoder'} {key[2]}"

    def fat5_lowest(test):
        return lowest([(row["tflops"], where((row["L"], row["causal"], row["pass"]))) for row in fat5 if test(row)])

    def ratios(peer_test):
        found = []
        for key in keys:
            ours, theirs = best(lambda name: name == "fat5", key), best(peer_test, key)
            if theirs:
                found.append((ours / theirs, where(key)))
        return found

    forward = fat5_lowest(lambda row: row["pass"] == "fwd" and row["L"] >= 2048)
    both = fat5_lowest(lambda row: row["pass"] == "fwd+bwd" and row["L"] >= 2048)
    short = fat5_lowest(lambda row: row["pass"] == "fwd+bwd" and row["L"] == 512)
    t5_peer = lowest(ratios(lambda name: name == "flex_lut" or name.endswith("_bias")))  # not sdpa_nobias
    ceiling = lowest(ratios(lambda name: name == "sdpa_nobias"))
    peaks = sorted((row["L"], row["peak_mib"]) for row in fat5 if row["pass"] == "fwd+bwd" and row["peak_mib"]
                   and not row["causal"])
    flat = peaks[-1][1] / peaks[0][1] if len(peaks) > 1 and peaks[-1][0] > peaks[0][0] else None

    def figure(pair, unit=""):
        return None if pair[0] is None else f"{pair[0]:.3g}{unit} ({pair[1]})"

    return [
        goal("kernel forward >= 350 TFLOP/s at every L >= 2048 (lowest)", forward[0], at_least(350), figure(forward)),
        goal("kernel forward+backward >= 280 TFLOP/s at every L >= 2048 (lowest)", both[0], at_least(280),
             figure(both)),
        goal("kernel forward+backward >= 200 TFLOP/s at L = 512 (lowest)", short[0], at_least(200), figure(short)),
        goal("kernel >= 1.2x the best T5-capable path (FlexAttention with a bias lookup, SDPA with a dense bias on "
             "each backend) at every L (lowest ratio)", t5_peer[0], at_least(1.2), figure(t5_peer, "x")),
        goal("kernel >= 0.85x SDPA without a bias at every L (lowest ratio)", ceiling[0], at_least(0.85),
             figure(ceiling, "x")),
        goal("kernel memory flat in L: forward+backward peak at the longest L <= 1.25x the shortest's (same tokens)",
             flat, lambda value: value <= 1.25,
             None if flat is None else f"{flat:.2f}x ({peaks[0][1]} MiB at L {peaks[0][0]}, {peaks[-1][1]} MiB at "
                                       f"L {peaks[-1][0]})"),
    ]


def dropout_goals(rows):
    """Issue 25's: the kernel with dropout 0.1 against SDPA with a dense bias and the same dropout, and against
    itself without dropout (forward+backward, lowest ratio over L)."""
    def ratio_goal(name, base, target):
        found = []
        for row in ok(rows, implementation="fat5"):
            if row["pass"] == "fwd+bwd":
                found += [(row["tflops"] / other["tflops"], f"L {row['L']}") for other in ok(
                    rows, implementation=base, L=row["L"], causal=row["causal"]) if other["pass"] == "fwd+bwd"]
        value, where = lowest(found)
        return goal(name, value, at_least(target), None if value is None else f"{value:.2f}x ({where})")

    return [ratio_goal("kernel with dropout 0.1 >= 5x SDPA with a dense bias and dropout (fwd+bwd, lowest; issue "
                       "25)", "sdpa_dense_bias", 5),
            ratio_goal("kernel with dropout 0.1 >= 0.75x the kernel without dropout (fwd+bwd, lowest; issue 25)",
                       "fat5_nodropout", 0.75)]


def best_speed(rows, prefix, **match):
    return max((row["tokens_per_s"] for row in rows if row["implementation"].startswith(prefix)
                and all(row.get(k) == v for k, v in match.items())), default=None)


def model_goals(train, generated):
    """The training-step and generation goals: FAT5's best against the best transformers T5 measured."""
    tried = any(row["L"] == 32768 and row["implementation"] == "fat5" for row in train)
    train = ok(train)

    def speedup(length):
        ours, theirs = best_speed(train, "fat5", L=length), best_speed(train, "t5_", L=length)
        peers = sorted({row["implementation"] for row in train if row["L"] == length and
                        row["implementation"].startswith("t5_")})
        return (ours / theirs, f"{ours / theirs:.2f}x (against {', '.join(peers)})") if ours and theirs else (None,
                                                                                                              None)

    # A generation whose tokens differ from FAT5's (a bf16 near-tie) generated as many tokens: its speed counts.
    generated = [row for row in generated if row["status"] == "ok" or row["status"].startswith("mismatch")]
    generation = []
    for batch, length in sorted({(row["batch"], row["encoder_length"]) for row in generated}):
        ours = best_speed(generated, "fat5", batch=batch, encoder_length=length)
        theirs = best_speed(generated, "t5_", batch=batch, encoder_length=length)
        if ours and theirs:
            generation.append((ours / theirs, f"batch {batch}, encoder {length}"))
    generation = lowest(generation)
    longest = [row for row in train if row["implementation"] == "fat5" and row["L"] == 32768 and row["batch"] == 1]
    return [
        goal("training step >= 3x the best transformers T5 at L = 512", speedup(512)[0], at_least(3), speedup(512)[1]),
        goal("training step >= 4x the best transformers T5 at L = 4096", speedup(4096)[0], at_least(4),
             speedup(4096)[1]),
        goal("L = 32768 trains at batch 1", 1.0 if longest else (0.0 if tried else None), at_least(1),
             f"{longest[0]['tokens_per_s']:.0f} tokens/s, peak {longest[0]['peak_mib']} MiB" if longest
             else "did not train"),
        goal("generation >= 2x transformers' tokens/s (lowest over batch and encoder length, each side's best cache)",
             generation[0], at_least(2), None if generation[0] is None else f"{generation[0]:.2f}x ({generation[1]})"),
        *captured_step_goals(generated),
    ]


# FAT5's peak memory in the T5-base training step at L = 512 (batch 64) on 2026-11-27 (H100, bf16): the baseline of
# issue 44's memory goal.
TRAIN_PEAK_MIB_2026_11_27 = 36042.7


def training_goals(train, packed, seed):
    """Issue 44's: FAT5's training step at L = 512 by MFU, against transformers' T5 with SDPA compiled, and its peak
    memory; the seed's pretraining configuration's tokens/s; packed fine-tuning against the same run padded."""
    train = ok(train, L=512)
    fat5 = [row for row in train if row["implementation"].startswith("fat5")]
    best = max(fat5, key=lambda row: row["tokens_per_s"], default=None)
    mfu = best.get("mfu") if best else None
    compiled = best_speed(train, "t5_sdpa+compile")
    versus = best["tokens_per_s"] / compiled if best and compiled else None
    peak = min((row["peak_mib"] for row in fat5 if row.get("peak_mib")), default=None)
    seeded = max((row["tokens_per_s"] for row in ok(seed) if row.get("tokens_per_s")), default=None)
    padded, packing = (best_useful(packed, name) for name in ("fat5 padded", "fat5 packed"))
    gain = packing / padded if packing and padded else None
    return [
        goal("training step at L = 512: MFU >= 33% (FAT5's fastest; issue 44)", mfu, at_least(0.33),
             None if mfu is None else f"{mfu:.1%} ({best['implementation']})"),
        goal("training step at L = 512 >= 1.5x transformers' T5 with SDPA under torch.compile (issue 44)", versus,
             at_least(1.5), None if versus is None else f"{versus:.2f}x ({best['implementation']})"),
        goal(f"training step at L = 512: FAT5's peak memory <= 0.75x 2026-11-27's ({TRAIN_PEAK_MIB_2026_11_27:.0f} "
             f"MiB; issue 44)", peak and peak / TRAIN_PEAK_MIB_2026_11_27, lambda value: value <= 0.75,
             None if peak is None else f"{peak / TRAIN_PEAK_MIB_2026_11_27:.2f}x ({peak:.0f} MiB)"),
        goal("the seed's pretraining configuration >= 400k tokens/s (issue 44)", seeded, at_least(400e3),
             None if seeded is None else f"{seeded:.4g} tokens/s"),
        goal("packed fine-tuning >= 1.5x the same run padded, useful target tokens/s (issue 44)", gain,
             at_least(1.5), None if gain is None else f"{gain:.2f}x ({packing:.4g} against {padded:.4g})"),
    ]


def best_useful(rows, name):
    return max((row["target_tokens_per_s"] for row in ok(rows, implementation=name)), default=None)


def captured_step_goals(generated):
    """Issue 45's: FAT5's captured decode step (cache "graph") against transformers' eager T5 (its dynamic cache)
    and its static+compile, encoder 512, 128 new tokens; and its first token."""
    def ratio_goal(batch, cache, target, peer):
        ours = best_speed(generated, "fat5", batch=batch, encoder_length=512, cache="graph")
        theirs = best_speed(generated, "t5_", batch=batch, encoder_length=512, cache=cache)
        value = ours / theirs if ours and theirs else None
        return goal(f"generation, batch {batch}, encoder 512: FAT5's captured step >= {target}x {peer} (issue 45)",
                    value, at_least(target), None if value is None else f"{value:.2f}x ({ours:.4g} against "
                                                                          f"{theirs:.4g} tokens/s)")

    first = [row for row in generated if row["implementation"] == "fat5" and row.get("cache") == "graph"
             and row["batch"] == 1 and row["encoder_length"] == 512 and row.get("first_token_s") is not None]
    compiled = [row["first_token_s"] for row in generated if row["implementation"].startswith("t5_")
                and row.get("cache") == "static+compile" and row["batch"] == 1 and row.get("first_token_s") is not None]
    seconds = min((row["first_token_s"] for row in first), default=None)
    return [ratio_goal(1, "dynamic", 10, "transformers' eager T5"),
            ratio_goal(1, "static+compile", 1, "transformers' static+compile"),
            goal("generation, batch 1, encoder 512: FAT5's first token from its captured step within 5 s of the first "
                 "call (issue 45)", seconds, lambda value: value <= 5, None if seconds is None else
                 f"{seconds:.2f} s" + (f" (transformers' static+compile: {min(compiled):.1f} s)" if compiled else "")),
            ratio_goal(32, "dynamic", 2, "transformers' eager T5"),
            ratio_goal(32, "static+compile", 1, "transformers' static+compile")]


def tests_goal(name, rows):
    counts = {outcome: sum(row["outcome"] == outcome for row in rows) for outcome in ("passed", "failed", "skipped")}
    if not counts["passed"] + counts["failed"]:
        return goal(name, None, None)
    failed = [row["test"].split("::")[-1] for row in rows if row["outcome"] == "failed"]
    return goal(name, counts["failed"], lambda value: value == 0,
                f"{counts['passed']} passed, {counts['failed']} failed" + (f" ({', '.join(failed[:3])})" if failed
                                                                           else ""))


def compile_goal(rows):
    if not rows:
        return goal("every kernel variant compiles (call 1 and 2's variants)", None, None)
    compiled = [row for row in rows if row["status"] == "ok"]
    slowest = max(compiled, key=lambda row: row["compile_s"], default=None)
    text = f"{len(compiled)} of {len(rows)}, {sum(row['compile_s'] for row in compiled):.0f} s in all" + (
        f", slowest {slowest['variant']} {slowest['compile_s']:.0f} s" if slowest else "")
    return goal("every kernel variant compiles (call 1 and 2's variants)", len(rows) - len(compiled),
                lambda value: value == 0, text)


def goals(found):
    """The goal table's lines (`goal`'s dicts) from the rows `read_archives` found."""
    attention = all_rows(found, "attention")  # attention.py's rows without dropout (with it: attention_dropout)
    return [compile_goal(all_rows(found, "compile_times")),
            tests_goal("correctness on CUDA in bf16 and fp16 passes (call 1)", all_rows(found, "tests",
                                                                                        {"correctness"})),
            tests_goal("fp32 parity and compiled variants pass (call 1)", all_rows(found, "tests", {"fp32_parity"})),
            *kernel_goals(attention), *dropout_goals(all_rows(found, "attention_dropout")),
            *model_goals(all_rows(found, "train_step"), all_rows(found, "generate")),
            *training_goals(all_rows(found, "train_step"), all_rows(found, "packed_step"),
                            all_rows(found, "pretrain_seed"))]


def goal_table(found, goal_rows=None):
    """The markdown goal table of the rows `read_archives` found: a heading with device and versions (from the
    environment rows), the steps' statuses, then one line per goal (`goals`); then each step's rows as a table
    (`step_tables`), so that a step killed before printing its own table loses nothing."""
    environment = next(iter(found.get("environment", [])), (None, {}, []))[1]  # its header: device, versions, date
    steps = "; ".join(f"call {row['call']} {row['step']} {row['status']} ({row['seconds']} s)"
                      for row in all_rows(found, "suite"))
    versions = ", ".join(f"{name} {environment.get(name)}" for name in ("torch", "triton", "transformers"))
    heading = f"### GPU plan {plan_version(found)}, {environment.get('device', 'device unknown')}, "
    lines = [(heading + environment.get("date", "")).rstrip(", "),
             "", f"{versions}; `python benchmarks/gpu_suite.py --call N`. Steps: {steps or 'none'}.", "",
             "| goal | figure | status |", "| --- | --- | --- |"]
    lines += [f"| {row['goal']} | {row['figure']} | {row['status']} |"
              for row in (goals(found) if goal_rows is None else goal_rows)]
    return "\n".join(lines) + "\n" + step_tables(found)


def _number(value, digits=3):
    return "-" if value is None else f"{value:.{digits}g}"


def _attention_cell(row):
    mark = "*" if row["status"].startswith("mismatch") else ""
    latency = f" / {_number(row.get('latency_ms'))}" if row.get("latency_ms") is not None else ""
    return f"{_number(row['tflops'])}{mark} ({_number(row['ms'])}{latency} ms)"


def _decode_cell(row):
    latency = f" / {row['latency_ms'] * 1e3:.1f}" if row.get("latency_ms") is not None else ""
    return f"{row['ms'] * 1e3:.1f}{latency} us"


def _profile_cell(row):
    return (f"{row.get('launches_per_token')} launches, {row.get('kernels_per_token')} kernels, "
            f"{row.get('synchronizations_per_token')} syncs, {row.get('device_to_host_copies_per_token')} copies to "
            f"host, {row.get('local_scalar_dense_per_token')} reads a token; {row.get('self_cpu_ms')} ms host")


# How `step_tables` shows each benchmark's rows: the columns that make a line, the column whose values become the
# table's columns (None: one "result" column), the cell of a row that has a result, and the field that says so.
ROW_TABLES = {
    "attention": (("causal", "pass", "L"), "implementation", _attention_cell, "ms"),
    "attention_dropout": (("causal", "pass", "L"), "implementation", _attention_cell, "ms"),
    "attention_decode": (("batch", "L"), "implementation", _decode_cell, "ms"),
    "train_step": (("L", "batch"), "implementation",
                   lambda row: f"{row['tokens_per_s']:.4g} tok/s, {row['ms']:.4g} ms, {row['peak_mib']} MiB"
                   + (f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""), "ms"),
    "generate": (("encoder_length", "batch", "cache"), "implementation",
                 lambda row: f"{row['tokens_per_s']:.4g}{'*' if row['status'].startswith('mismatch') else ''} tok/s"
                 + (f", first token {row['first_token_s']:.3g} s" if row.get("first_token_s") is not None else ""),
                 "ms"),
    "generate_profile": (("cache", "batch"), "implementation", _profile_cell, "self_cpu_ms"),
    "tile_sweep": (("kernel", "block_m", "block_n", "warps", "stages", "current"), None,
                   lambda row: f"{row['ms']:.4g} / {row['latency_ms']:.4g} ms, kernel {row['kernel_ms']} ms", "ms"),
    "compile_times": (("variant", "dtype", "head_dim"), None, lambda row: f"{row['compile_s']} s", "compile_s"),
    "variant_sweep": (("L", "pass"), "config", lambda row: f"{row['tflops']:.3g} TFLOP/s"
                      + (f", {row['speed']:.2f}x" if row.get("speed") is not None else ""), "ms"),
    "packed_step": (("implementation",), None, lambda row: f"{row['target_tokens_per_s']:.4g} target tok/s, "
                    f"padding {row['padding']:.0%}", "target_tokens_per_s"),
    "pretrain_seed": (("implementation", "batch"), None, lambda row: f"{row['tokens_per_s']:.4g} tok/s"
                      + (f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""), "tokens_per_s"),
}
TIME_UNITS = {"attention": "TFLOP/s from the throughput (ms: throughput / latency, one call alone)",
              "attention_dropout": "TFLOP/s from the throughput (ms: throughput / latency, one call alone)",
              "attention_decode": "throughput / latency",
              "variant_sweep": "speed: against the default kernel at the same dropout",
              "tile_sweep": "pass ms throughput / latency, the kernel's own ms (profiler)"}


def step_tables(found):
    """Each step's rows as a markdown table (ROW_TABLES), and each test step's failures with their messages."""
    lines = []
    for benchmark, (keys, column, cell, result) in ROW_TABLES.items():
        for step, _, rows in found.get(benchmark, []):
            if not rows:
                lines += ["", f"#### {step} ({benchmark}): no rows"]
                continue
            columns = list(dict.fromkeys(row.get(column) for row in rows)) if column else ["result"]
            units = f"; {TIME_UNITS[benchmark]}" if benchmark in TIME_UNITS else ""
            names = [*keys, *map(str, columns)]
            lines += ["", f"#### {step} ({benchmark}{units})", "", "| " + " | ".join(names) + " |",
                      "|" + " --- |" * len(names)]
            for key in dict.fromkeys(tuple(row.get(name) for name in keys) for row in rows):
                cells = []
                for name in columns:
                    row = next((row for row in rows if tuple(row.get(k) for k in keys) == key
                                and (column is None or row.get(column) == name)), None)
                    if row is None:
                        cells.append("-")
                    elif row.get(result) is None:
                        cells.append(str(row.get("status", "-"))[:120].replace("|", "/"))
                    else:
                        cells.append(cell(row).replace("|", "/"))
                lines.append("| " + " | ".join([*map(str, key), *cells]) + " |")
    for step, _, rows in found.get("tests", []):
        failed = [row for row in rows if row["outcome"] == "failed"]
        if failed:
            lines += ["", f"#### {step}: {len(failed)} failed", ""]
            lines += [f"- `{row['test']}` ({row['when']}): {row['message']}" for row in failed]
    return "\n".join(lines) + ("\n" if lines else "")


# ---- command line ------------------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one `error:` line (fat5.cli.run prints it), exit status 2, as for FAT5's commands."""

    def error(self, message):
        raise CommandError(message)


def build_parser():
    parser = OneLineParser(prog="gpu_suite.py", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--call", type=int, choices=sorted(BUDGETS), help="which call of the plan to run")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "gpu_suite", metavar="DIR",
                        help="folder for the call's three files (callN.log, callN-rows.tar.gz, callN-goals.md); "
                             "on the GPU machine $OUT")
    parser.add_argument("--smoke", action="store_true",
                        help="run the call's steps at smoke sizes on CPU (Triton's interpreter): checks the plan")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help=f"start no step past this many seconds of the call (default: {BUDGETS[1]} for call 1, "
                             f"{BUDGETS[2]} for call 2; none with --smoke)")
    parser.add_argument("--cap", action="append", default=[], metavar="STEP=SECONDS",
                        help="another cap for one step (repeatable)")
    parser.add_argument("--steps", type=lambda text: text.split(","),
                        help="run only these steps of the call, comma-separated (default: all, in the plan's order)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                        help="folder of wheels installed first, offline (default: .whl/ of this checkout)")
    parser.add_argument("--goals", nargs="+", type=Path, metavar="ARCHIVE",
                        help="print the goal table of these callN-rows.tar.gz archives instead of running a call")
    parser.add_argument("--update-results", action="store_true",
                        help="with --goals: also append the table to benchmarks/RESULTS.md (refused when the "
                             "archives measured no goal)")
    return parser


# The flags of a call, which --goals (it runs no call) does not take.
CALL_FLAGS = ("call", "smoke", "budget", "cap", "steps")


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.goals:
        given = [f"--{name}" for name in CALL_FLAGS if getattr(args, name) not in (None, False, [])]
        if given:
            parser.error(f"{', '.join(given)} has no effect with --goals, which runs no call")
        missing = [str(path) for path in args.goals if not path.is_file()]
        if missing:
            parser.error(f"--goals: no such archive {', '.join(missing)}")
        return args
    if args.update_results:
        parser.error("--update-results goes with --goals (a call writes only into --out)")
    if args.call is None:
        parser.error("say which call to run (--call 1 or --call 2), or --goals ARCHIVE...")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget >= 0):
        parser.error(f"--budget {args.budget}: must be a number of seconds, 0 or more (0: none)")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file, not a folder")
    names = [step.name for step in call_steps(args.call)]
    args.steps = args.steps or names
    unknown = [name for name in args.steps if name not in names]
    if unknown:
        parser.error(f"unknown --steps {unknown} for call {args.call}; choose from {', '.join(names)}")
    args.caps = {}
    for item in args.cap:
        name, _, seconds = item.partition("=")
        if name not in names or not seconds.isdigit() or int(seconds) < 1:
            parser.error(f"--cap {item!r}: expected STEP=SECONDS with STEP one of {', '.join(names)}")
        args.caps[name] = int(seconds)
    if args.budget is None:
        args.budget = 0 if args.smoke else BUDGETS[args.call]
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_suite.py: needs a CUDA GPU; on CPU run --smoke (it checks the plan itself)", file=sys.stderr)
        sys.exit(2)
    return args


def plan_version(found):
    """The plan version an archive's rows were measured under (its suite header's; 1 before versions were kept)."""
    headers = [header for _, header, _ in found.get("suite", [])]
    return max((header.get("plan", 1) for header in headers), default=1)


def by_plan(paths):
    """{plan version: [archive]} of the archives given, newest version first."""
    versions = {}
    for path in paths:
        versions.setdefault(plan_version(read_archives([path])), []).append(path)
    return dict(sorted(versions.items(), reverse=True))


def print_goals(args):
    """--goals: the goal table of the archives of the newest plan version given (an older version's archives: a
    table of their own after it, never pooled with the newer rows); with --update-results, the newest table is
    appended to benchmarks/RESULTS.md (whole, or not at all), unless it measured no goal."""
    tables = []
    for number, (version, paths) in enumerate(by_plan(args.goals).items()):
        found = read_archives(paths)
        try:
            measured = goals(found)
            table = goal_table(found, measured)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as error:
            raise CommandError(f"--goals: the archives' rows are not the GPU plan's ({type(error).__name__}: "
                               f"{error_line(error)})") from None
        if number:
            table = (f"\n### Older plan (version {version}: {', '.join(map(str, paths))}), not pooled with the "
                     f"table above\n\n" + table)
        else:
            newest, newest_measured = table, measured
        tables.append(table)
    print("".join(tables), flush=True)
    if args.update_results:
        if all(row["status"] == STATUS[None] for row in newest_measured):
            raise CommandError(f"--update-results: {', '.join(map(str, args.goals))} measured no goal (every goal "
                               f"is not measured): benchmarks/RESULTS.md is left as it is")
        results = ROOT / "benchmarks" / "RESULTS.md"
        write_atomically(results, results.read_text(encoding="utf-8") + "\n" + newest)
        print("appended to benchmarks/RESULTS.md")


def command(argv, progress):
    args = parse_args(argv)
    if args.goals:
        print_goals(args)
    else:
        run_call(args, progress)


def main(argv=None):
    return run(command, argv)


if __name__ == "__main__":
    exit_with(main)
