"""Everything a GPU session measures, in one command: the GPU tier of the tests, then every benchmark, then one
table of the goals (met / missed / not measured).

    python benchmarks/gpu_suite.py --out DIR         # one H100: about 24 minutes; everything lands in DIR
    python benchmarks/gpu_suite.py --update-results  # also append every table to benchmarks/RESULTS.md
    python benchmarks/gpu_suite.py --smoke           # CPU, tiny sizes: checks the suite itself (CI); without
                                                     # --smoke it needs CUDA, and says so

Stages run one after another, each in its own process under its own time limit (--timeout STAGE=SECONDS), so an
error, an out-of-memory or a timeout in one leaves every other stage's results. Wheels in --wheels (default .whl/,
filled by scripts/fetch_gpu_wheels.py on a machine with PyPI) are installed first with pip --no-index: the GPU
machines have no network. Each stage's rows and plots land in OUT/<stage>/, and OUT/results.json, OUT/tables.md
and OUT/suite.log hold them all (OUT: --out, by default ./bench-results/gpu_suite_<date>/ in the current folder;
with --smoke and no --out, a temporary folder removed at the end). Nothing is written into the checkout unless
--update-results.
"""

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

DROPOUT_IMPLEMENTATIONS = "fat5,fat5_nodropout,sdpa_dense_bias,sdpa_nobias"
# (name, command after `python`, seconds). The limits add up to 23 minutes: a stage that reaches its limit loses its
# own rows only (the scripts write them at the end), so the slow peers (FlexAttention compiles once per L) get
# fewer repetitions.
STAGES = [
    ("gpu_tests", ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], 240),
    ("attention_encoder", ["benchmarks/attention.py", "--causal", "no", "--reps", "10", "--warmup", "3"], 170),
    ("attention_decoder", ["benchmarks/attention.py", "--causal", "yes", "--reps", "10", "--warmup", "3"], 170),
    ("attention_decode", ["benchmarks/attention.py", "--decode"], 50),
    # Attention dropout 0.1 (issue 25): the kernel with it against SDPA with a dense bias and the same dropout, and
    # against the kernel without it.
    ("attention_encoder_dropout", ["benchmarks/attention.py", "--causal", "no", "--dropout", "0.1", "--impl",
                                   DROPOUT_IMPLEMENTATIONS, "--reps", "10", "--warmup", "3"], 120),
    ("attention_decoder_dropout", ["benchmarks/attention.py", "--causal", "yes", "--dropout", "0.1", "--impl",
                                   DROPOUT_IMPLEMENTATIONS, "--reps", "10", "--warmup", "3"], 120),
    ("train_step", ["benchmarks/train_step.py", "--impl", "fat5,t5_eager,t5_sdpa,t5_flex", "--reps", "5",
                    "--warmup", "2"], 200),
    # Compiling costs a minute or more per length: the two lengths the goals name.
    ("train_step_compiled", ["benchmarks/train_step.py", "--impl", "fat5+compile,t5_sdpa+compile", "--lengths",
                             "512,4096", "--reps", "5", "--warmup", "2"], 130),
    ("generate", ["benchmarks/generate.py"], 120),
    ("loss_memory", ["benchmarks/loss_memory.py"], 60),
]
SMOKE_LIMIT = 600
TIMING_SCRIPTS = ("attention.py", "train_step.py", "generate.py")  # those taking the common output options
STATUS = {"met": "met", "missed": "MISSED", None: "not measured"}


def build_parser():
    parser = common.argument_parser(__doc__)
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="folder for every stage's rows, plots and log, and the collected results (default: "
                             f"./{common.OUT_DIR}/gpu_suite_<date>/; with --smoke, a temporary folder)")
    parser.add_argument("--update-results", action="store_true",
                        help="also append every table to benchmarks/RESULTS.md of this checkout")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every stage: checks the suite itself")
    parser.add_argument("--stages", type=lambda text: text.split(","), default=[name for name, _, _ in STAGES],
                        help="comma-separated stages to run (default: all): " + ", ".join(n for n, _, _ in STAGES))
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                        help="another time limit for one stage (repeatable)")
    parser.add_argument("--wheels", type=Path, default=common.ROOT / ".whl",
                        help="folder of wheels to install first, offline (default: .whl/)")
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    known = {name for name, _, _ in STAGES}
    unknown = [name for name in args.stages if name not in known]
    if unknown:
        parser.error(f"unknown --stages {unknown}; choose from {', '.join(sorted(known))}")
    # The limits are an H100's; a CPU's smoke run gets ten minutes a stage (CI machines differ widely in speed).
    args.limits = {name: SMOKE_LIMIT if args.smoke else seconds for name, _, seconds in STAGES}
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in known or not seconds.isdigit() or int(seconds) < 1:
            parser.error(f"--timeout {item!r}: expected STAGE=SECONDS with STAGE one of {', '.join(sorted(known))}")
        args.limits[name] = int(seconds)
    common.require_gpu(args, "run --smoke (it checks the suite itself)")
    return args


def install_wheels(folder, log):
    """pip install --no-index from `folder` when it holds wheels; returns a one-line status."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return f"no wheels in {folder}"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder),
                             *map(str, wheels)], capture_output=True, text=True)
    log.write(f"\n===== wheels: pip install --no-index from {folder}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        return "error: " + (result.stderr.strip().splitlines() or ["pip failed"])[-1][:200]
    return f"installed {len(wheels)} wheel(s) from {folder}"


def stage_command(name, command, stage_dir, smoke, update_results=False):
    command = list(command)
    script = Path(command[0]).name
    if script in TIMING_SCRIPTS:
        if smoke and name.startswith("train_step"):
            # The script's smoke lengths and implementations: compiling (Inductor, FlexAttention) takes minutes on CPU.
            options = dict(zip(command[1::2], command[2::2], strict=True))
            command = [command[0]] + [item for key, value in options.items() if key not in ("--lengths", "--impl")
                                      for item in (key, value)]
        if smoke and name.startswith("attention") and name != "attention_decode" and "--dropout" not in command:
            command += ["--impl", "fat5,sdpa_dense_bias"]  # FlexAttention's CPU compile takes minutes
        command += ["--out", str(stage_dir)] + (["--smoke"] if smoke else []) \
            + (["--update-results"] if update_results else [])
    elif script == "loss_memory.py":
        command += ["--out", str(stage_dir)] + (["--smoke"] if smoke else [])
    elif name == "gpu_tests":
        # Only the files that hold GPU tests: the others may import what the GPU image lacks (datasets, ...).
        files = sorted(path.relative_to(common.ROOT).as_posix() for path in (common.ROOT / "tests").glob("test_*.py")
                       if "mark.gpu" in path.read_text())
        # Without CUDA the tier is skipped: collecting one file shows the stage works.
        command += (["tests/test_gpu_model.py"] if smoke else files) + [f"--junitxml={stage_dir / 'gpu_tests.xml'}"]
    return [sys.executable, *command]


def run_stage(name, command, limit, log):
    """Run one stage in its own process; returns (status, seconds). Its output goes to the log and the screen."""
    start = time.monotonic()
    log.write(f"\n===== {name}: {' '.join(command)} (limit {limit} s)\n")
    log.flush()
    print(f"[{name}] running (limit {limit} s)", flush=True)
    try:
        result = subprocess.run(command, cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
        status = "ok" if result.returncode == 0 else f"exit {result.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timeout after {limit} s"
    seconds = round(time.monotonic() - start, 1)
    print(f"[{name}] {status} in {seconds} s", flush=True)
    return status, seconds


def rows_of(stage_dir):
    """Every row of the JSON files a timing script wrote into `stage_dir`."""
    rows = []
    for path in sorted(stage_dir.glob("*.json")) if stage_dir.is_dir() else []:
        document = json.loads(path.read_text())
        rows += document.get("rows", []) if isinstance(document, dict) else []
    return rows


def ok(rows, **match):
    return [row for row in rows if row.get("status") == "ok" and all(row.get(k) == v for k, v in match.items())]


def goal(name, figure, target, compare=lambda value, target: value >= target, text=None):
    """One line of the goal table: its measured figure (None when not measured) against `target`."""
    if figure is None:
        return dict(goal=name, figure="-", status=STATUS[None])
    return dict(goal=name, figure=text or f"{figure:.3g}", status=STATUS["met" if compare(figure, target)
                                                                         else "missed"])


def kernel_goals(attention_rows):
    def lowest(rows):
        return min((row["tflops"] for row in rows), default=None)

    fat5 = ok(attention_rows, implementation="fat5")
    forward = lowest([row for row in fat5 if row["pass"] == "fwd" and row["L"] >= 2048])
    both = lowest([row for row in fat5 if row["pass"] == "fwd+bwd" and row["L"] >= 2048])
    short = lowest([row for row in fat5 if row["pass"] == "fwd+bwd" and row["L"] == 512])
    ratios = []
    for row in fat5:
        peers = [peer for peer in ok(attention_rows, implementation="flex_lut", L=row["L"], causal=row["causal"])
                 if peer["pass"] == row["pass"]]
        ratios += [row["tflops"] / peer["tflops"] for peer in peers]
    return [
        goal("kernel fwd >= 350 TFLOP/s at every L >= 2048 (lowest)", forward, 350),
        goal("kernel fwd+bwd >= 280 TFLOP/s at every L >= 2048 (lowest)", both, 280),
        goal("kernel fwd+bwd >= 200 TFLOP/s at L = 512 (lowest)", short, 200),
        goal("kernel >= 2x FlexAttention at every L (lowest ratio)", min(ratios, default=None), 2,
             text=f"{min(ratios):.2f}x" if ratios else None),
    ]


def dropout_goals(attention_rows):
    """The kernel with attention dropout 0.1 against SDPA with a dense bias and the same dropout, and against
    itself without dropout (fwd+bwd, the lowest ratio over L and causality). The targets are issue 25's session's:
    SDPA with a dense bias ran 10-25 TFLOP/s on an H100, and the static sm_90a reading puts dropout at 1.3-1.5x the
    far-loop instructions of the kernel without it, which tensor-core and memory time partly hide."""
    peers, own = [], []
    for row in ok(attention_rows, implementation="fat5"):
        if row["pass"] != "fwd+bwd":
            continue
        match = dict(L=row["L"], causal=row["causal"])
        peers += [row["tflops"] / peer["tflops"] for peer in ok(attention_rows, implementation="sdpa_dense_bias",
                                                               **match) if peer["pass"] == "fwd+bwd"]
        own += [row["tflops"] / base["tflops"] for base in ok(attention_rows, implementation="fat5_nodropout",
                                                             **match) if base["pass"] == "fwd+bwd"]

    def ratio_goal(name, ratios, target):
        value = min(ratios, default=None)
        return goal(name, value, target, text=f"{value:.2f}x" if value is not None else None)

    return [
        ratio_goal("kernel with dropout 0.1 >= 5x SDPA with a dense bias and dropout (fwd+bwd, lowest)", peers, 5),
        ratio_goal("kernel with dropout 0.1 >= 0.75x the kernel without dropout (fwd+bwd, lowest)", own, 0.75),
    ]


def best_tokens(rows, prefix, **match):
    values = [row["tokens_per_s"] for row in ok(rows, **match) if row["implementation"].startswith(prefix)]
    return max(values, default=None)


def model_goals(train_rows, generate_rows):
    def speedup(length, peer="t5_"):
        ours, theirs = best_tokens(train_rows, "fat5", L=length), best_tokens(train_rows, peer, L=length)
        return ours / theirs if ours and theirs else None

    flex = [speedup(length, "t5_flex") for length in sorted({row["L"] for row in train_rows})]
    flex = [ratio for ratio in flex if ratio is not None]
    # A generation whose tokens differ from FAT5's ("mismatch", e.g. a bf16 near-tie) generated as many tokens: its
    # speed compares, and its row says mismatch.
    generated = [{**row, "status": "ok"} if str(row.get("status")).startswith("mismatch") else row
                 for row in generate_rows]
    generation = []
    for batch in sorted({row["batch"] for row in generated}):
        ours, theirs = best_tokens(generated, "fat5", batch=batch), best_tokens(generated, "t5_", batch=batch)
        if ours and theirs:
            generation.append(ours / theirs)
    longest = ok(train_rows, implementation="fat5", L=32768)

    def ratio_goal(name, value, target):
        return goal(name, value, target, text=f"{value:.2f}x" if value is not None else None)

    return [
        ratio_goal("model: FAT5 >= 2x transformers T5 flex_attention at every L (training step)",
                   min(flex, default=None), 2),
        ratio_goal("training step >= 3x the best transformers T5 at L = 512", speedup(512), 3),
        ratio_goal("training step >= 4x the best transformers T5 at L = 4096", speedup(4096), 4),
        goal("L = 32768 trains at batch 1", 1.0 if longest else (0.0 if train_rows else None), 1,
             text=f"{longest[0]['tokens_per_s']:.0f} tokens/s" if longest else "did not run"),
        ratio_goal("generation >= 2x transformers' tokens/s (lowest over batch sizes)", min(generation, default=None),
                   2),
    ]


def tests_goal(stage_dir):
    report = stage_dir / "gpu_tests.xml"
    if not report.is_file():
        return goal("GPU tier of the tests passes", None, 0)
    import xml.etree.ElementTree as ElementTree

    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    ran = counts["tests"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    text = f"{ran - bad} passed, {bad} failed, {counts['skipped']} skipped"
    return goal("GPU tier of the tests passes", None if ran == 0 else float(bad), 0,
                compare=lambda value, target: value == target, text=text)


def goal_table(goals, stages):
    lines = [f"### GPU suite, {common.device_name()}, {common.today()}", "",
             ", ".join(f"{name} {version}" for name, version in common.versions().items())
             + "; `python benchmarks/gpu_suite.py`; stages: "
             + ", ".join(f"{name} {status} ({seconds} s)" for name, (status, seconds) in stages.items()), "",
             "| goal | figure | status |", "| --- | --- | --- |"]
    lines += [f"| {row['goal']} | {row['figure']} | {row['status']} |" for row in goals]
    return "\n".join(lines) + "\n"


def collect(root, goals, table):
    """The suite's results in two files beside the stages' folders: results.json (every stage's rows and the
    goals) and tables.md."""
    document = {"device": common.device_name(), "date": common.today(), **common.versions(), "goals": goals,
                "stages": {}}
    for stage_dir in sorted(path for path in root.iterdir() if path.is_dir()):
        document["stages"][stage_dir.name] = {path.name: json.loads(path.read_text())
                                              for path in sorted(stage_dir.glob("*.json"))}
    (root / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (root / "tables.md").write_text(table)
    print(f"results in {root}")


def main():
    args = parse_args()
    temporary = args.smoke and args.out is None
    root = Path(tempfile.mkdtemp(prefix="gpu_suite_")) if temporary else \
        (args.out or common.OUT_DIR / f"gpu_suite_{common.today()}").resolve()  # the stages run in the checkout
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "suite.log"
    print(common.header(), flush=True)
    stages = {}
    with open(log_path, "a") as log:
        print(install_wheels(args.wheels, log), flush=True)
        for name, command, _ in STAGES:
            if name in args.stages:
                stage_dir = root / name
                stage_dir.mkdir(exist_ok=True)
                stages[name] = run_stage(name, stage_command(name, command, stage_dir, args.smoke,
                                                             args.update_results), args.limits[name], log)
    attention = rows_of(root / "attention_encoder") + rows_of(root / "attention_decoder")
    train = rows_of(root / "train_step") + rows_of(root / "train_step_compiled")
    dropout = rows_of(root / "attention_encoder_dropout") + rows_of(root / "attention_decoder_dropout")
    goals = [tests_goal(root / "gpu_tests"), *kernel_goals(attention), *dropout_goals(dropout),
             *model_goals(train, rows_of(root / "generate"))]
    table = goal_table(goals, stages)
    print(f"\nlog: {log_path}\n\n{table}")
    if args.update_results:
        common.append_results(table)
    collect(root, goals, table)
    if temporary:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
