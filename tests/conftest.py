"""What every test shares: where Triton kernels run, the tiny model's config, the `gpu` and `slow` tiers.

Test files import `KERNEL_DEVICE` and `tiny_config` from here (`from conftest import ...`: tests/ is on sys.path);
tests that only need them as arguments take the `kernel_device` and `tiny_config` fixtures.
"""

import os
import signal
import time

import pytest
import torch

# Triton kernels run on CUDA tensors when CUDA is present; without it, on CPU tensors in Triton's interpreter.
# Every test that runs a kernel puts its tensors (and models) on this device, so the same test checks the GPU
# code on a CUDA machine and the interpreter elsewhere.
# The commands the tests interrupt start as from a terminal, with Ctrl-C's default action, however pytest itself was
# started: a script's background job (`pytest &`) inherits SIGINT ignored, and its children with it.
signal.signal(signal.SIGINT, signal.default_int_handler)

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter is read when kernels are decorated, so it must be set before any kernel module is imported.
if KERNEL_DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The tiny model most tests build: every layer type (gated FFN, untied head, encoder and decoder, T5 buckets) at
# sizes that run in milliseconds on CPU.
TINY_CONFIG = dict(vocab_size=101, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def tiny_config(**overrides):
    """A FAT5Config of TINY_CONFIG with `overrides`."""
    from fat5.configuration_fat5 import FAT5Config

    return FAT5Config(**{**TINY_CONFIG, **overrides})


@pytest.fixture(name="kernel_device")
def kernel_device_fixture():
    return KERNEL_DEVICE


@pytest.fixture(name="tiny_config")
def tiny_config_fixture():
    return tiny_config


@pytest.fixture(scope="session")
def demo_fat5(tmp_path_factory):
    """The bundled demo T5 converted to FAT5 once a session, as the quick start's command 1 writes ./fat5-demo (its
    parity proof and answers: tests/test_cli.py): the path, as text. Tests read it; one that changes a folder copies
    it first."""
    from fat5.convert.demo import DEMO_CHECKPOINT
    from fat5.convert.flan_to_fat5 import main

    folder = tmp_path_factory.mktemp("demo") / "fat5-demo"
    assert main([str(DEMO_CHECKPOINT), str(folder), "--no-verify"]) == 0
    return str(folder)


def pytest_configure(config):
    """The default run leaves the slow tier out (pyproject.toml's addopts, `-m "not slow"`); a run that names test
    files or tests without a -m of its own runs them whole, slow tests included."""
    args = config.invocation_params.args
    marks_given = any(arg.startswith("-m") for arg in args)
    named = any(".py" in arg or "::" in arg for arg in args if not arg.startswith("-"))
    if named and not marks_given and config.option.markexpr == "not slow":
        config.option.markexpr = ""


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (the GPU tier, `python -m pytest -m gpu`) are skipped without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


STARTED = time.monotonic()
# CI's figures file: this run's, taken out of the environment so that the test runs the tests themselves start (the
# GPU plan's smoke steps) do not write theirs.
CI_FIGURES = os.environ.pop("FAT5_CI_FIGURES", None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under CI, each test run's counts and minutes go to the figures file `.ci/run` writes (FAT5_CI_FIGURES), the one
    place test counts and durations live."""
    figures = CI_FIGURES
    if not figures:
        return
    import transformers

    named = [arg for arg in config.invocation_params.args if ".py" in arg and not arg.startswith("-")]
    counts = ", ".join(f"{len(terminalreporter.stats[key])} {key}" for key in
                       ("passed", "failed", "error", "skipped", "deselected") if terminalreporter.stats.get(key))
    which = f"-m \"{config.option.markexpr}\"" + (f" on {len(named)} files" if named else "")
    with open(figures, "a") as file:
        file.write(f"- pytest {which} (transformers {transformers.__version__}, torch {torch.__version__}): "
                   f"{counts}; {(time.monotonic() - STARTED) / 60:.1f} min\n")
