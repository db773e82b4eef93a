"""Every command in README.md and docs/*.md is run by a test, and every relative link resolves.

A command is a line of a fenced ```bash block (continuation lines joined, comments dropped), named by its text
with each run of blanks made one space. Each command is exactly one of:

- a `pip install ...` line: not run (it would change this environment); each extra it names exists in
  pyproject.toml;
- RUN_BY_CI: `.ci/run` runs it as written (its lines read without pip's `-q`): the quick start's two set-up
  commands (the venv line before them runs here, `test_the_venv_line_makes_a_venv`);
- COVERED_BY: the test that runs the same thing (a Hub push against a mocked Hub, an ONNX export on the
  transformers release optimum supports, the benchmarks' `--smoke` runs), checked to exist;
- NOT_RUN: what it needs that tests do not have (a GPU, several GPUs, the network), with the test that checks the
  same thing on CPU;
- any other command is run here (`test_page_commands_run`, the slow tier), in a workspace per page, in the
  page's order, with the substitutions below: tiny models, the pages' own sample data at a fraction of its size,
  nothing downloaded. The data the commands read is what the pages' `fat5 sample-data` command writes.

Every ```python block runs in the same kind of workspace (`test_python_blocks_run`, the default tier).
"""

import ast
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_pretrain import TINY

from fat5.convert.demo import DEMO_CHECKPOINT
from t5_checkpoints import make_t5_checkpoint

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FLASHT5 = REPO / "tests" / "fixtures" / "flasht5"
BIN = Path(sys.executable).parent

# --- what the docs' commands become here -------------------------------------------------------------------------

# Hub ids -> local checkpoints of the same layout (tests never touch the network): the bundled demo is a FLAN-T5
# (T5 v1.1 layout, with its tokenizer); the flashT5 fixtures are CATIE-AQ's layout.
HUB_IDS = {"google/flan-t5-base": str(DEMO_CHECKPOINT),
           "CATIE-AQ/FAT5-small-flan-en": str(FLASHT5 / "t5-default-scale-gelu"),
           "CATIE-AQ/FAT5-small": str(FLASHT5 / "rope")}
# (flag, value as the docs write it) -> the tiny value run here. `--config base` becomes a tiny T5 config
# (tests/test_pretrain.py's TINY), written into the workspace.
TINY_VALUES = {("--config", "base"): "tiny-config.json",
               ("--max_steps", "65536"): "2", ("--max_steps", "10000"): "2", ("--max_steps", "30"): "2",
               ("--per_device_train_batch_size", "128"): "4", ("--per_device_train_batch_size", "64"): "4",
               ("--warmup_steps", "10000"): "0"}
# Flags added to a command (its text as in `commands`): the sample data at a fraction of its size.
EXTRA_FLAGS = {"fat5 sample-data data": ["--rows", "16"]}
# GPU-only: `--bf16` without a GPU needs the Trainer's `--use_cpu` (added where the command lacks it).
# Programs: `python` is this interpreter, `fat5` is `python -m fat5`, other commands come from this environment.

RUN_BY_CI = {
    "pip install torch==2.13.0 && pip install -e . && python -m convert.flan_to_fat5":
        "README command 1, in a fresh venv (and the demo's answers: tests/test_cli.py)",
    'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q':
        "README command 2, in a fresh venv",
    "python -m pytest -q": "the default tier",
    "python -m pytest -q -m slow": "the slow tier",
    "bash .ci/drift": "the drift check under every tested transformers and the newest on PyPI",
}

COVERED_BY = {
    "fat5 convert ./my-t5-checkpoint ./my-fat5-hub --push-to-hub me/my-fat5 --private":
        "tests/test_cli.py::test_push_uploads_the_written_folder",
    "fat5 onnx ./fat5-demo ./fat5-demo-onnx":
        "tests/test_onnx_export.py::test_onnxruntime_generates_the_tokens_of_pytorch",
    "optimum-cli export onnx --model ./fat5-demo --trust-remote-code --task text2text-generation-with-past "
    "./fat5-demo-onnx-own": "tests/test_onnx_export.py::test_optimum_cli_exports_a_fat5_folder",
    "python benchmarks/attention.py --smoke --out bench-results":
        "tests/test_benchmark_smoke.py::test_attention_smoke_writes_rows",
    "python benchmarks/loss_memory.py --smoke --out bench-results":
        "tests/test_benchmark_smoke.py::test_loss_memory_smoke_run",
    "fat5 bench train_step --smoke --out bench-results":
        "tests/test_benchmark_smoke.py::test_train_step_smoke_compares_fat5_with_transformers_t5",
    "python benchmarks/gpu_suite.py --smoke --call 1 --out bench-results/suite":
        "tests/test_benchmark_smoke.py::test_gpu_plan_runs_end_to_end_at_smoke_sizes",
}

NOT_RUN = {
    "python benchmarks/gpu_suite.py --goals gpu-results/call1-rows.tar.gz gpu-results/call2-rows.tar.gz "
    "--update-results": ("needs the archives a GPU's two calls bring back, and appends to RESULTS.md",
                         "tests/test_benchmark_smoke.py::test_gpu_plan_runs_end_to_end_at_smoke_sizes"),
    "python scripts/fetch_gpu_wheels.py": ("downloads wheels from PyPI", None),
    "python -m pytest -q -m gpu": (
        "needs CUDA (every test skips without it); a reduced variant of each runs in the default tier",
        "tests/test_gpu_model.py::test_kernel_backend_matches_eager_in_fp32"),
    "bash .ci/run": ("CI itself: fresh venvs, then every tier (over half an hour on 2 cores)", None),
    "deepspeed --num_gpus 8 -m fat5.recipes.summarization --deepspeed fat5/recipes/configs/ds_zero3_bf16.json "
    "--bf16 ...": ("8 GPUs; the same ZeRO-3 training on two CPU processes",
                   "tests/test_distributed.py::test_losses_match_single_process"),
    "accelerate launch --config_file fat5/recipes/configs/fsdp.yaml -m fat5.recipes.summarization --bf16 ...":
        ("several GPUs; the same FSDP2 training on two CPU processes",
         "tests/test_distributed.py::test_losses_match_single_process"),
}

# The venv line of the quick start: run with bash in an empty folder (test_the_venv_line_makes_a_venv).
VENV_LINE = "python3 -m venv .venv && . .venv/bin/activate"

# --- reading the pages -------------------------------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(page):
    """(language, text) of each fenced block of `page`."""
    language = None
    for line in page.read_text().splitlines():
        if language is None and FENCE.match(line):
            language, body = FENCE.match(line).group(1), []
        elif language is not None and line.startswith("```"):
            yield language, "\n".join(body) + "\n"
            language = None
        elif language is not None:
            body.append(line)


def without_comment(line):
    """`line` up to a `#` that starts a shell comment (outside quotes, at the start or after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands(page):
    """The commands of `page`'s bash blocks, in order, each as (name, text as written)."""
    for language, body in blocks(page):
        if language != "bash":
            continue
        pending = ""
        for line in body.splitlines():
            line = without_comment(line).rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text, pending = pending + line, ""
            if text.strip():
                yield " ".join(text.split()), text


def is_pip(name):
    return name.startswith("pip install ")


def classify(name):
    for kind, table in (("ci", RUN_BY_CI), ("covered", COVERED_BY), ("not run", NOT_RUN)):
        if name in table:
            return kind
    if is_pip(name):
        return "pip"
    return "venv" if name == VENV_LINE else "run"


def relative(page):
    return page.relative_to(REPO).as_posix()


ALL_COMMANDS = [(relative(page), name) for page in PAGES for name, _ in commands(page)]


# --- the mapping holds ------------------------------------------------------------------------------------------

def test_every_mapped_command_is_in_the_docs():
    """A table entry whose command left the docs is stale: remove it."""
    names = {name for _, name in ALL_COMMANDS}
    stale = [name for table in (RUN_BY_CI, COVERED_BY, NOT_RUN) for name in table if name not in names]
    assert not stale, stale
    assert VENV_LINE in names


def test_what_ci_runs_is_in_ci_as_written():
    ci_lines = {" ".join(line.replace("pip install -q ", "pip install ").split())
                for line in (REPO / ".ci" / "run").read_text().splitlines()}
    # A command CI runs as the last of a `&&` chain (the default tier, at the end of README command 2) runs as written.
    ci_lines |= {line.split(" && ")[-1] for line in ci_lines}
    missing = [name for name in RUN_BY_CI if name not in ci_lines]
    assert not missing, missing


def test_the_quick_start_is_run_by_ci_or_by_this_file():
    readme = [name for page, name in ALL_COMMANDS if page == "README.md"]
    assert len(readme) >= 3, readme
    assert all(classify(name) in ("ci", "venv") for name in readme), readme


def test_covering_tests_exist():
    named = [*COVERED_BY.values(), *(test for _, test in NOT_RUN.values() if test)]
    for test in named:
        path, function = test.split("::")
        tree = ast.parse((REPO / path).read_text())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert function in functions, test


def test_every_substitution_is_used():
    """A substitution no command needs any more is stale: remove it."""
    runs = [shlex.split(name) for _, name in ALL_COMMANDS if classify(name) == "run"]
    assert set(HUB_IDS) <= {word for words in runs for word in words}
    assert set(TINY_VALUES) <= {pair for words in runs for pair in zip(words, words[1:])}
    assert set(EXTRA_FLAGS) <= {name for _, name in ALL_COMMANDS if classify(name) == "run"}


def test_pip_lines_name_only_existing_extras():
    extras = set(importlib.metadata.metadata("fat5").get_all("Provides-Extra"))  # pyproject.toml's, as installed
    pip_lines = [name for _, name in ALL_COMMANDS if is_pip(name)]  # the README's too, which CI runs
    assert pip_lines
    for name in pip_lines:
        for group in re.findall(r"\[([\w,]+)\]", name):
            assert set(group.split(",")) <= extras, (name, extras)


def test_every_command_to_run_starts_a_program_of_this_environment():
    for _, name in ALL_COMMANDS:
        if classify(name) == "run":
            assert argv_of(shlex.split(name)[:1])[0], name


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) < 200


# --- links -------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), blanks to
    hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page):
    seen, result, fenced = {}, set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def prose(page):
    """`page` without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(target)
    assert not broken, broken


# --- running them ------------------------------------------------------------------------------------------------

def workspace(folder, demo_fat5):
    """What the docs' commands read besides the data their `fat5 sample-data` writes, under the names they use: the
    demo folder, a T5 checkpoint and a tiny model config."""
    shutil.copytree(demo_fat5, folder / "fat5-demo")
    make_t5_checkpoint("flan-t5", folder / "my-t5-checkpoint")
    (folder / "tiny-config.json").write_text(json.dumps(TINY))
    return folder


def argv_of(words):
    """The program of a docs command as this environment starts it."""
    program, rest = words[0], list(words[1:])
    if program == "python":
        return [sys.executable, *rest]
    if program == "fat5":
        return [sys.executable, "-m", "fat5", *rest]
    installed = BIN / program
    return [str(installed) if installed.exists() else None, *rest]


def substituted(words):
    words = [HUB_IDS.get(word, word) for word in words] + EXTRA_FLAGS.get(" ".join(words), [])
    for i in range(len(words) - 1):
        words[i + 1] = TINY_VALUES.get((words[i], words[i + 1]), words[i + 1])
    if "--bf16" in words and "--use_cpu" not in words:
        words.append("--use_cpu")
    return words


def run(words, cwd, env):
    result = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (shlex.join(words), result.stdout[-3000:], result.stderr[-3000:])
    return result


# Offline, and one thread a process: the models are tiny and test processes share the cores.
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
PAGES_WITH_COMMANDS = [page for page in PAGES if any(classify(name) == "run" for name, _ in commands(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS, ids=relative)
def test_page_commands_run(page, tmp_path, demo_fat5):
    folder = workspace(tmp_path, demo_fat5)
    for name, text in commands(page):
        if classify(name) != "run":
            continue
        words = shlex.split(text)
        while words:  # `a && b`: a, then b
            end = words.index("&&") if "&&" in words else len(words)
            run(argv_of(substituted(words[:end])), folder, ENV)
            words = words[end + 1:]


PYTHON_BLOCKS = [pytest.param(page, i, id=f"{relative(page)}-{i}") for page in PAGES
                 for i, (language, _) in enumerate(blocks(page)) if language == "python"]


@pytest.mark.parametrize("page, index", PYTHON_BLOCKS)
def test_python_blocks_run(page, index, tmp_path, demo_fat5):
    code = list(blocks(page))[index][1]
    shutil.copytree(demo_fat5, tmp_path / "fat5-demo")
    run([sys.executable, "-c", code], tmp_path, ENV)


def test_the_venv_line_makes_a_venv(tmp_path):
    run(["bash", "-c", f"{VENV_LINE} && python -c 'import sys; assert sys.prefix != sys.base_prefix'"], tmp_path,
        ENV)
    assert (tmp_path / ".venv" / "bin" / "python").exists()


def test_the_int8_route_shows_no_warning_nobody_can_act_on(tmp_path, demo_fat5):
    """docs/using.md's int8 call leaves out torch's two deprecation warnings of its dynamic quantization (which still
    works), filtered by message at the call; without those filters, this torch gives them (so the filters are
    needed, and the test notices when a torch stops warning or drops the route)."""
    code = next(text for language, text in blocks(REPO / "docs" / "using.md")
                if language == "python" and "quantize_dynamic" in text)
    shutil.copytree(demo_fat5, tmp_path / "fat5-demo")
    shown = run([sys.executable, "-W", "default", "-c", code], tmp_path, ENV)
    assert shown.stdout.strip() == "mat the on sat cat the" and "Warning" not in shown.stderr, shown.stderr
    unfiltered = "\n".join(line for line in code.splitlines() if "filterwarnings" not in line)
    warned = run([sys.executable, "-W", "default", "-c", unfiltered], tmp_path, ENV).stderr
    assert "torch.ao.quantization is deprecated" in warned and "torch.quantize_per_tensor" in warned, warned
