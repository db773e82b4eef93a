"""The `fat5` command and every command it runs: `--help` lists the command's own flags and answers before torch
loads (the Trainer's flags behind --help-all); a bad flag is one `error:` line; a missing optional library is one line
naming the `pip install "fat5[EXTRA]"` that installs it, exit status 2; a Ctrl-C while the command loads is one
`interrupted` line, exit status 130."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fat5.cli import EXIT_BAD_INPUT, EXIT_OUTPUT_CLOSED, MissingExtra, extra_changes, run
from fat5.commands import COMMANDS
from fat5.commands import NEEDS as EXTRA_NEEDED

REPO = Path(__file__).resolve().parent.parent
# Commands that run a Python module (bench runs a script of benchmarks/).
MODULE_COMMANDS = [name for name, (module, _) in COMMANDS.items() if module is not None]
# What each command imports until it has read its flags: the standard library and FAT5's light modules.
HEAVY = ("torch", "transformers", "datasets", "accelerate")


# A warning another library's code raises ("<its file>:<line>: <category>: <message>", then its source line): PEFT's
# newest release warns on import beside transformers 4.57, which its Trainer imports. Not FAT5's to answer for.
OTHER_LIBRARIES_WARNING = re.compile(r"^(/\S+?\.py):\d+: \w*Warning: ")


def without_other_libraries_warnings(err):
    """stderr less the warnings raised in files outside this checkout (each with its indented source line)."""
    kept, skipping = [], False
    for line in err.splitlines():
        match = OTHER_LIBRARIES_WARNING.match(line)
        if match and not match[1].startswith(str(REPO)):
            skipping = True
        elif not (skipping and line.startswith("  ")):
            skipping = False
            kept.append(line)
    return "\n".join(kept)


def fat5_in_process(argv, hidden=(), env=None):
    """Run `fat5 ARGV` (fat5.commands.main) in a fresh interpreter with the modules `hidden` made unimportable;
    returns (exit status, stdout, stderr, the heavy modules it imported)."""
    code = f"""
import json, sys
for name in {list(hidden)!r}:
    sys.modules[name] = None  # "No module named ...": the library is not installed
from fat5.commands import main
try:
    status = main({list(map(str, argv))!r})
except SystemExit as exit:
    status = exit.code or 0
sys.stdout.flush()
print(json.dumps({{"status": status, "heavy": [m for m in {list(HEAVY)!r} if sys.modules.get(m)]}}),
      file=sys.stderr)
"""
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                             env=env)
    *err, result = process.stderr.strip().splitlines()
    result = json.loads(result)
    return result["status"], process.stdout, without_other_libraries_warnings("\n".join(err)), result["heavy"]


def test_fat5_help_lists_every_command_in_one_line_each():
    process = subprocess.run([sys.executable, "-m", "fat5", "--help"], cwd=REPO, capture_output=True, text=True)
    assert process.returncode == 0
    lines = process.stdout.splitlines()
    for name in COMMANDS:
        assert len([line for line in lines if line.split()[:1] == [name]]) == 1, name


@pytest.mark.parametrize("argv, says", [
    ([], "fat5: error: name a command: convert, to-t5"),
    (["nope"], "fat5: error: unknown command 'nope'; choose one of convert"),
    (["bench", "nope"], "fat5: error: bench: no script 'nope'"),
])
def test_a_wrong_command_is_one_line(argv, says):
    process = subprocess.run([sys.executable, "-m", "fat5", *argv], cwd=REPO, capture_output=True, text=True)
    assert process.returncode == EXIT_BAD_INPUT
    assert len(process.stderr.splitlines()) == 1 and process.stderr.startswith(says), process.stderr


def test_the_console_script_runs_the_command_python_m_runs():
    script = Path(sys.executable).parent / "fat5"
    if not script.exists():
        pytest.skip("FAT5 is not installed in this interpreter's environment (no `fat5` script)")
    ours = subprocess.run([str(script), "to-t5", "--help"], capture_output=True, text=True)
    theirs = subprocess.run([sys.executable, "-m", "convert.fat5_to_t5", "--help"], capture_output=True, text=True)
    assert ours.returncode == theirs.returncode == 0 and ours.stdout == theirs.stdout


# The commands whose flags transformers' HfArgumentParser reads: --help renders their own flags without it, and any
# other command line is parsed with the Trainer's flags, torch loaded (tests/test_command_flags.py holds their bad
# values to one line each).
HF_ARGUMENT_PARSER = ("pretrain", "train", "translation", "summarization", "classify", "predict")


@pytest.mark.parametrize("command", MODULE_COMMANDS)
def test_help_and_a_bad_flag_answer_before_torch_loads(command):
    status, out, err, heavy = fat5_in_process([command, "--help"])
    assert status == 0 and out.startswith("usage: ") and not heavy, (err[-2000:], heavy)
    status, out, err, heavy = fat5_in_process([command, "--no-such-flag"])
    assert status == EXIT_BAD_INPUT and (command in HF_ARGUMENT_PARSER or not heavy), (err[-2000:], heavy)
    # The flag, or the arguments a command requires before it (argparse says which comes first), or the extra a
    # command needs whatever its flags, when it is missing (optimum does not install beside transformers 5).
    needed = EXTRA_NEEDED.get(command, (None, ()))[1]
    missing = [module for module in needed if importlib.util.find_spec(module) is None]
    says = [f"error: {missing[0]} is not installed"] if missing else ["--no-such-flag", "required"]
    assert len(err.splitlines()) == 1 and "error: " in err and any(words in err for words in says), err


def command_flags():
    """The CommandFlags (--help) of each command whose flags HfArgumentParser reads."""
    from fat5.recipes import classify, predict, summarization, train, translation
    from fat5.recipes.command import recipe_flags
    from fat5.training import pretrain

    flags = {name: recipe_flags(module.RECIPE, name, module.__doc__) for name, module in [
        ("train", train), ("translation", translation), ("summarization", summarization), ("classify", classify)]}
    return {**flags, "pretrain": pretrain.FLAGS, "predict": predict.FLAGS}


@pytest.mark.parametrize("command", HF_ARGUMENT_PARSER)
def test_help_lists_the_flags_hf_argument_parser_reads(command):
    """--help is rendered without transformers, from the command's own dataclasses: it lists exactly the flags
    HfArgumentParser reads from them, with the same defaults and choices."""
    from fat5.training.flags import parser

    flags = command_flags()[command]
    shown = {action.dest: action for action in flags.help_parser()._actions if action.dest not in ("help", "help_all")}
    parsed = {action.dest: action for action in parser(flags.own)._actions if action.dest != "help"}
    assert shown.keys() == parsed.keys()
    for name, action in parsed.items():
        assert f"--{name}" in action.option_strings and shown[name].option_strings == [f"--{name}"], name
        assert (shown[name].default, shown[name].choices) == (action.default, action.choices), name
        assert shown[name].required == action.required, name


@pytest.mark.parametrize("command, first", [(["train", "--do_train"], ("datasets",)),
                                            (["pretrain"], ("torch", "transformers", "datasets"))])
def test_a_command_says_it_loads_torch_before_it_does_on_a_terminal(command, first):
    """On a terminal, a command's first line comes before torch and transformers start to load (they take seconds):
    here the first heavy import is stopped (the recipes' is datasets; pretraining's depends on the transformers),
    and the line is already there. Off a terminal (a log, a pipe: every other test) the command prints only its own
    lines."""
    import pty

    code = f"""
import os, sys

class StopAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "transformers", "datasets"):
            sys.stderr.write(f"importing {{name}}\\n")
            sys.stderr.flush()
            os._exit(0)

sys.meta_path.insert(0, StopAtTorch())  # behind the LoadingNotice the command puts first
sys.argv = ["fat5", *{command!r}, "--model_name_or_path", "m", "--output_dir", "o"]
from fat5.commands import console_main
console_main()
"""
    leader, follower = pty.openpty()
    try:
        process = subprocess.run([sys.executable, "-c", code], cwd=REPO, stderr=follower, stdout=subprocess.DEVNULL,
                                 timeout=600)
        output = os.read(leader, 65536).decode()
    finally:
        os.close(leader)
        os.close(follower)
    lines = output.replace("\r", "").splitlines()
    assert process.returncode == 0, lines
    assert lines[:1] == [f"fat5 {command[0]}: loading torch and transformers..."], lines
    assert len(lines) == 2 and lines[1].removeprefix("importing ") in first, lines


@pytest.mark.parametrize("command, module, extra", [("onnx", "optimum", "onnx"), ("ct2", "ctranslate2", "ct2")])
def test_a_conversion_without_its_extra_says_so_before_anything_loads(command, module, extra, tmp_path):
    status, _, err, heavy = fat5_in_process([command, tmp_path / "model", tmp_path / "out"], hidden=[module])
    assert status == EXIT_BAD_INPUT and not heavy, (err[-2000:], heavy)
    assert err.splitlines() == [f'error: {module} is not installed; this command needs FAT5\'s "{extra}" '
                                f'extra{extra_changes(extra)}: pip install "fat5[{extra}]"'], err


def test_a_hub_id_that_cannot_be_had_offline_is_refused_before_torch_loads(tmp_path):
    """`fat5 convert ORG/NAME OUT` offline once refused the id only after torch and transformers had loaded (18 s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    status, _, err, heavy = fat5_in_process(["convert", "google/flan-t5-base", tmp_path / "out"], env=env)
    assert status == EXIT_BAD_INPUT and heavy == [], (err[-2000:], heavy)
    assert len(err.splitlines()) == 1 and err.startswith("error: SRC google/flan-t5-base is neither a local folder nor "
                                                         "a downloadable Hub model: "), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("number, word, status", [(signal.SIGINT, "interrupted", 130),
                                                  (signal.SIGTERM, "terminated", 143)], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("module", ["fat5.cli", "fat5.recipes.command", "fat5.training.flags", "transformers",
                                    "torch"])
def test_ctrl_c_or_sigterm_while_a_command_imports_is_one_line(module, number, word, status):
    """Ctrl-C or SIGTERM while `fat5` and its command load (here: as `module` is imported) ends with one line and
    exit status 130 or 143, whenever it comes after Python itself has started (a SIGTERM before the command's own
    handler once ended it silently, killed by the signal)."""
    code = f"""
import os, signal, sys

class Stop:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), {int(number)})

sys.meta_path.insert(0, Stop())
sys.argv = ["fat5", "train", "--model_name_or_path", "m", "--output_dir", "o", "--do_train"]
from fat5.commands import console_main
console_main()
"""
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert process.returncode == status and len(process.stderr.splitlines()) == 1, process.stderr[-3000:]
    assert process.stderr.startswith(f"{word}: "), process.stderr


def test_a_command_started_with_ctrl_c_ignored_keeps_it_ignored():
    """A script's background job (`fat5 train ... &`) starts with SIGINT ignored, so that the terminal's Ctrl-C
    does not reach it: the command does not take it back, and runs on (here to its flag check)."""
    code = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
import fat5.cli
real_run = fat5.cli.run

def run(command, argv, *args, **kwargs):
    def interrupted_command(argv, progress):
        os.kill(os.getpid(), signal.SIGINT)
        return command(argv, progress)
    return real_run(interrupted_command, argv, *args, **kwargs)

fat5.cli.run = run
sys.argv = ["fat5", "train", "--model_name_or_path", "m", "--output_dir", "o", "--do_train"]
from fat5.commands import console_main
console_main()
"""
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert process.returncode == EXIT_BAD_INPUT, process.stderr[-3000:]
    assert process.stderr.splitlines() == ["error: --do_train needs train data: pass --train_file"], process.stderr


@pytest.mark.parametrize("command", ["train", "translation", "summarization", "classify", "pretrain"])
def test_help_lists_the_commands_own_flags_and_points_to_the_trainers(command):
    """--help: the command's flags, and one line on the Trainer's; --help-all adds them."""
    _, short, _, _ = fat5_in_process([command, "--help"])
    assert "--resume_with_changed_settings" in short and "--adam_beta1" not in short
    assert "flags of transformers' " in short and "--help-all lists them" in short
    assert len(short.splitlines()) < 150
    status, full, err, _ = fat5_in_process([command, "--help-all"])
    assert status == 0 and "--adam_beta1" in full, err[-2000:]
    flags = [line.split()[0] for line in full.splitlines() if line.startswith("  --")]
    assert "--resume_with_changed_settings" in flags and "--output_dir" in flags  # the run folder's, mixed in
    for flag in ("--max_source_length", "--mixture"):  # the command's own flags come first
        if flag in short:
            assert flags.index(flag) < flags.index("--adam_beta1")


# Each command with flags that get it to its libraries, and the libraries (import names) it needs.
NEEDS = {
    "train": (["--model_name_or_path", "m", "--output_dir", "o", "--do_train", "--train_file", "t.csv"],
              ["accelerate", "datasets"]),
    "translation": (["--model_name_or_path", "m", "--output_dir", "o", "--do_eval", "--validation_file", "t.csv"],
                    ["accelerate", "datasets", "sacrebleu"]),
    "summarization": (["--model_name_or_path", "m", "--output_dir", "o", "--do_eval", "--validation_file", "t.csv"],
                      ["accelerate", "datasets", "rouge_score"]),
    "classify": (["--model_name_or_path", "m", "--output_dir", "o", "--do_eval", "--validation_file", "t.csv"],
                 ["accelerate", "datasets"]),
    "pretrain": (["--train_files", "c.txt", "--output_dir", "o", "--max_steps", "1"], ["accelerate"]),
}


@pytest.mark.parametrize("command, module", [(command, module) for command, (_, modules) in NEEDS.items()
                                             for module in modules])
def test_a_missing_library_is_one_line_naming_its_extra(command, module, tmp_path):
    argv, _ = NEEDS[command]
    extra = "pretrain" if command == "pretrain" else "recipes"
    status, _, err, heavy = fat5_in_process([command, *argv], hidden=[module])
    assert status == EXIT_BAD_INPUT, err[-2000:]
    assert err.splitlines() == [f'error: {module} is not installed; this command needs FAT5\'s "{extra}" extra: '
                                f'pip install "fat5[{extra}]"'], err[-2000:]
    assert not heavy  # said before anything loads


def test_predict_without_datasets_is_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    status, _, err, _ = fat5_in_process(["predict", "--model", tmp_path / "model", "--input_file", tmp_path / "in.csv",
                                         "--output_file", tmp_path / "out.csv"], hidden=["datasets"])
    assert status == EXIT_BAD_INPUT and err.splitlines() == [
        'error: datasets is not installed; this command needs FAT5\'s "recipes" extra: pip install "fat5[recipes]"']


def test_pretraining_a_dataset_without_datasets_is_one_line(tmp_path):
    """datasets is pretraining's only for --dataset_name: the import there, deep in the run, is one line too."""
    status, _, err, _ = fat5_in_process(["pretrain", "--dataset_name", "someone/corpus", "--output_dir",
                                         tmp_path / "o", "--max_steps", "1"], hidden=["datasets"])
    assert status == EXIT_BAD_INPUT and err.splitlines()[-1:] == [
        'error: datasets is not installed; this command needs FAT5\'s "pretrain" extra: pip install "fat5[pretrain]"'
    ], err[-2000:]


@pytest.mark.parametrize("module, extra, command_extra", [
    ("peft", "recipes", "recipes"), ("peft.tuners", "recipes", None), ("datasets", "pretrain", "pretrain"),
    ("liger_kernel.ops", "liger", "recipes"), ("optimum.exporters", "onnx", None)])
def test_a_library_missing_deep_in_a_command_names_its_extra(capsys, module, extra, command_extra):
    def command(argv, progress):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    assert run(command, [], extra=command_extra) == EXIT_BAD_INPUT
    library = module.partition(".")[0]
    assert capsys.readouterr().err.splitlines() == [
        f'error: {library} is not installed; this command needs FAT5\'s "{extra}" extra{extra_changes(extra)}: '
        f'pip install "fat5[{extra}]"']


@pytest.mark.parametrize("installed, changes", [("5.24.0", True), ("4.57.6", False)])
def test_the_onnx_extra_says_it_replaces_transformers_5_before_anything_is_installed(monkeypatch, installed,
                                                                                      changes):
    """optimum-onnx requires transformers < 4.58: `pip install "fat5[onnx]"` under transformers 5 would replace it
    (and huggingface_hub) with older releases, so the missing-extra line says so; under 4.57 nothing is replaced."""
    versions = {"transformers": installed}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    line = str(MissingExtra("optimum", "onnx"))
    assert line.endswith(': pip install "fat5[onnx]"') and "\n" not in line
    assert (f"replaces transformers {installed} with transformers 4.57 and huggingface_hub 0.x" in line) == changes
    assert ("virtual environment of its own" in line) == changes
    assert str(MissingExtra("peft", "recipes")) == ('peft is not installed; this command needs FAT5\'s "recipes" '
                                                    'extra: pip install "fat5[recipes]"')


def test_a_missing_module_of_fat5_itself_keeps_its_traceback():
    def command(argv, progress):
        raise ModuleNotFoundError("No module named 'fat5.nowhere'", name="fat5.nowhere")

    with pytest.raises(ModuleNotFoundError):
        run(command, [])


def test_importing_fat5_imports_no_model_code_until_a_class_is_used():
    """`import fat5` (and the command-line modules) load nothing heavy; the first use of a model class loads it and
    registers FAT5 with transformers' Auto classes."""
    code = """
import sys
import fat5, fat5.cli, fat5.files, fat5.commands, fat5.training.flags, fat5.training.pretrain
import fat5.recipes.train, fat5.recipes.translation, fat5.recipes.summarization, fat5.recipes.classify
import fat5.recipes.predict, convert.flan_to_fat5, convert.fat5_to_t5, convert.refresh_code, convert.onnx_fat5
assert not [name for name in ("torch", "transformers") if name in sys.modules], sys.modules.keys()
assert "FAT5ForConditionalGeneration" in dir(fat5)
from fat5 import FAT5ForConditionalGeneration
from transformers import AutoConfig, AutoModelForSeq2SeqLM
config = AutoConfig.for_model("fat5", num_layers=1, num_decoder_layers=1, d_model=8, d_kv=4, d_ff=8, num_heads=2,
                              vocab_size=32)
assert type(AutoModelForSeq2SeqLM.from_config(config)) is FAT5ForConditionalGeneration is fat5.AUTO_CLASSES[
    AutoModelForSeq2SeqLM]
"""
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert process.returncode == 0, process.stderr[-3000:]


def test_a_reader_that_stops_early_ends_the_command_without_a_traceback():
    """`fat5 --help | head -1`: standard output's reader is gone (here before the command writes a byte); the command
    ends quietly with 128 + SIGPIPE, as a shell reports for a command a pipe cut short."""
    read, write = os.pipe()
    os.close(read)
    try:
        process = subprocess.run([sys.executable, "-m", "fat5", "--help"], stdout=write, stderr=subprocess.PIPE,
                                 text=True)
    finally:
        os.close(write)
    assert process.returncode == EXIT_OUTPUT_CLOSED and process.stderr == "", process.stderr
