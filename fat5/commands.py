"""`fat5`, the one console command: `fat5 COMMAND [ARGS]` runs the module each command names with ARGS, exactly as
`python -m MODULE ARGS` does (same flags, output and exit status; `python -m` keeps working).

Only the standard library is imported until a command runs, so `fat5 --help` and a mistyped command answer at once,
and so does a command that needs an extra which is not installed (`NEEDS`).
The commands are the modules above the model package (the converters in `fat5/convert/`, the recipes, pretraining); this
launcher names them as strings and imports the one asked for, nothing else. A Ctrl-C from the first instant
`console_main` runs (imports included) ends it with one `interrupted` line and exit status 130.
"""

import os
import sys

# command: (module run with the arguments, what it does). In --help's order.
COMMANDS = {
    "convert": ("fat5.convert.flan_to_fat5", "convert a T5 / FLAN-T5 / mT5 / umT5 / ByT5 checkpoint to FAT5 (no "
                                             "arguments: the bundled demo model)"),
    "to-t5": ("fat5.convert.fat5_to_t5", "convert a FAT5 checkpoint back to transformers' T5 / mT5 / umT5"),
    "refresh-code": ("fat5.convert.refresh_code", "give a FAT5 folder written by an earlier FAT5 this FAT5's code"),
    "onnx": ("fat5.convert.onnx_fat5", "export a FAT5 folder to ONNX with optimum (the \"onnx\" extra)"),
    "ct2": ("fat5.convert.ct2_fat5", "convert a FAT5 folder to a CTranslate2 model (the \"ct2\" extra)"),
    "pretrain": ("fat5.training.pretrain", "pretrain or continue pretraining with T5/UL2 denoising (\"pretrain\" "
                                           "extra)"),
    "train": ("fat5.recipes.train", "fine-tune on (source, target) pairs with Trainer (\"recipes\" extra)"),
    "translation": ("fat5.recipes.translation", "fine-tune and score translation with BLEU and chrF (\"recipes\" "
                                                "extra)"),
    "summarization": ("fat5.recipes.summarization", "fine-tune and score summarisation with ROUGE (\"recipes\" extra)"),
    "classify": ("fat5.recipes.classify", "fine-tune a classifier, as text or with a classification head "
                                          "(\"recipes\" extra)"),
    "predict": ("fat5.recipes.predict", "generate with a saved folder into a CSV (\"recipes\" extra)"),
    "sample-data": ("fat5.recipes.sample_data", "write small data files for every recipe and for pretraining (the "
                                                "docs' examples run on them)"),
    "bench": (None, "run a script of benchmarks/ (a source checkout only: the scripts are not in the wheel)"),
}
PROG = "fat5"
# Commands that need an extra's libraries whatever their flags: (extra, import names), checked before the command
# loads (its own imports take seconds), except for --help.
NEEDS = {"onnx": ("onnx", ("optimum",)), "ct2": ("ct2", ("ctranslate2",))}
EXIT_BAD_INPUT = 2  # fat5.cli's, imported once a command runs
# The benchmarks live beside the package in a source checkout (an editable install), never in the wheel.
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "benchmarks")


def help_text():
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [ARGS]   ({PROG} COMMAND --help: the command's flags)", "",
             "FAT5: T5-family models with the relative position bias inside a flash-attention kernel.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", f"Each command is also `python -m MODULE`, e.g. `{PROG} convert` = `python -m convert.flan_to_fat5`."]
    return "\n".join(lines)


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def benchmark_scripts():
    from pathlib import Path

    return sorted(path.stem for path in Path(BENCHMARKS).glob("*.py") if path.stem != "common")


def bench(argv):
    """Run benchmarks/SCRIPT.py ARGS with this interpreter, in place of this process."""
    if not os.path.isfile(os.path.join(BENCHMARKS, "common.py")):
        return fail(f"bench runs the scripts in benchmarks/ of a FAT5 source checkout, and this installation has "
                    f"none (the wheel holds only the package): clone the repository, `pip install -e .` there and run "
                    f"`{PROG} bench SCRIPT` (or `python benchmarks/SCRIPT.py`)")
    scripts = benchmark_scripts()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} bench SCRIPT [ARGS]   (runs python {BENCHMARKS}/SCRIPT.py ARGS; SCRIPT --help: its "
              f"flags)\nscripts: {', '.join(scripts)}")
        return 0 if argv else EXIT_BAD_INPUT
    name = argv[0].removesuffix(".py")
    if name not in scripts:
        return fail(f"bench: no script {argv[0]!r} in {BENCHMARKS}; choose one of {', '.join(scripts)}")
    script = os.path.join(BENCHMARKS, f"{name}.py")
    if sys.stderr.isatty():  # as fat5.cli.LoadingNotice says it for the other commands
        print(f"{PROG} bench {name}: loading torch and transformers...", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, str(script), *argv[1:]])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        return fail(f"name a command: {', '.join(COMMANDS)} (see {PROG} --help)")
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(help_text())
        return 0
    if command == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"{PROG} {version('fat5')}")
        except PackageNotFoundError:
            print(f"{PROG} (not installed: run from a source checkout)")
        return 0
    if command not in COMMANDS:
        return fail(f"unknown command {command!r}; choose one of {', '.join(COMMANDS)} (see {PROG} --help)")
    module_name = COMMANDS[command][0]
    if module_name is None:
        return bench(rest)
    import importlib

    from fat5 import cli

    cli.program = f"{PROG} {command}"
    if command in NEEDS and not {"-h", "--help"} & set(rest):
        extra, modules = NEEDS[command]
        status = cli.run(lambda argv, progress: cli.require(extra, *modules), [], extra=extra)
        if status:
            return status
    return importlib.import_module(module_name).main(rest)


def console_main():
    """The `fat5` console script (pyproject.toml's [project.scripts]) and `python -m fat5`. Importing this module
    imports nothing slow, so a Ctrl-C or SIGTERM while `fat5.cli` and the command load is caught here or by
    `exit_with`: one `interrupted`/`terminated` line and exit status 130/143 from this function's first instant (a
    SIGTERM the process was started with ignored stays ignored)."""
    import signal

    stopped_by = []

    def stop(number, frame):
        stopped_by.append(number)
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, stop)
    try:
        from fat5 import cli
    except KeyboardInterrupt:
        word, status = ("terminated", 143) if stopped_by[:1] == [signal.SIGTERM] else ("interrupted", 130)
        print(f"{word}: nothing was written", file=sys.stderr)
        sys.exit(status)
    if signal.getsignal(signal.SIGTERM) is stop:
        signal.signal(signal.SIGTERM, cli.stop_early)  # until the command's own handler (fat5.cli.run)
    cli.exit_with(main)
