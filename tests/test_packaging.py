"""What `pip install` gets: the wheel holds the packages and their data files, nothing else (no output folder of a
command, no tests, no caches), under two top-level names, `fat5` and `convert`, with one console command, `fat5`;
and each extra installs what the commands say it does."""

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fat5.cli import EXTRAS

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fat5", "convert")
# Read at run time, so in the wheel: the demo checkpoint, the model-card template, the recipes' configs.
DATA_FILES = ["fat5/convert/model_card_template.md", *(f"fat5/convert/demo_t5/{path.name}" for path in
                                                        (REPO / "fat5" / "convert" / "demo_t5").iterdir()),
              *(f"fat5/recipes/configs/{path.name}" for path in (REPO / "fat5" / "recipes" / "configs").iterdir())]
# Distributions whose import name is not their name.
DISTRIBUTION_OF = {"rouge_score": "rouge-score", "optimum": "optimum-onnx", "liger_kernel": "liger-kernel"}


def source_files():
    """The package files of the checkout, as the wheel should hold them."""
    files = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.add(path.relative_to(REPO).as_posix())
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from a copy of the checkout holding what a user's checkout may hold besides the package:
    the demo output folder, a dist/ folder, caches."""
    pytest.importorskip("setuptools", reason="builds the wheel without network, with the installed setuptools")
    root = tmp_path_factory.mktemp("build")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "dist",
                                                                 ".whl", "fat5-demo", ".pytest_cache"))
    for leftover in ("fat5-demo/config.json", "dist/old.whl", "fat5/__pycache__/x.cpython-311.pyc"):
        (source / leftover).parent.mkdir(parents=True, exist_ok=True)
        (source / leftover).write_text("not package data")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "wheel"), str(source)], check=True, capture_output=True)
    (path,) = (root / "wheel").glob("fat5-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_packages_and_their_data_only(wheel):
    names = set(wheel.namelist())
    metadata = {name for name in names if name.split("/")[0].endswith(".dist-info")}
    assert names - metadata == {name for name in source_files() if "__pycache__" not in name}
    assert set(DATA_FILES) <= names
    assert not [name for name in names if name.startswith(("fat5-demo/", "dist/", "tests/", "benchmarks/"))
                or "__pycache__" in name]


def test_the_wheel_installs_two_top_level_names_and_the_fat5_command(wheel):
    def read(suffix):
        (name,) = [name for name in wheel.namelist() if name.endswith(f".dist-info/{suffix}")]
        return wheel.read(name).decode()

    assert read("top_level.txt").split() == sorted(PACKAGES)
    assert "fat5 = fat5.commands:console_main" in read("entry_points.txt")


def test_every_package_of_the_checkout_is_listed():
    """A new subpackage must be added to pyproject.toml's package list (or its files would be left out)."""
    folders = {path.parent.relative_to(REPO).as_posix().replace("/", ".")
               for package in PACKAGES for path in (REPO / package).rglob("__init__.py")}
    wheel_packages = {name.rpartition("/")[0].replace("/", ".") for name in source_files()
                      if name.endswith("__init__.py")}
    assert folders == wheel_packages == {"fat5", "fat5.kernels", "fat5.training", "fat5.recipes", "fat5.convert",
                                                  "convert"}


def test_each_extra_installs_the_libraries_its_commands_name():
    """fat5/cli.py's EXTRAS (what a missing library's error line tells to install) matches pyproject.toml."""
    requirements = [Requirement(line) for line in importlib.metadata.requires("fat5")]
    for extra, modules in EXTRAS.items():
        installed = {requirement.name for requirement in requirements
                     if requirement.marker is not None and requirement.marker.evaluate({"extra": extra})}
        assert installed == {DISTRIBUTION_OF.get(module, module) for module in modules}, extra
