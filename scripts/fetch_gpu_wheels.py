"""Download the wheels a GPU machine without network lacks, on a machine with PyPI, into a folder that
`python benchmarks/gpu_suite.py` installs from first (`pip install --no-index --find-links`).

    python scripts/fetch_gpu_wheels.py                          # liger-kernel for Python 3.12 into .whl/
    python scripts/fetch_gpu_wheels.py --python 3.11 --dest DIR liger-kernel datasets --with-deps

The GPU image already has torch, triton, transformers, accelerate and peft, so by default only the named
packages are fetched, without their dependencies (--with-deps fetches those too, for the image's Python and
platform). Wheels only: nothing is built here. The folder receives the wheels only once every download succeeded.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fat5.cli import CliParser, CommandError, exit_with, run  # noqa: E402

# The CUDA image's python3 (see the device notes of the machines we use) and its platform.
DEFAULT_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "linux_x86_64")


def build_parser():
    parser = CliParser(prog="fetch_gpu_wheels.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", default=["liger-kernel"],
                        help="requirement specifiers (default: liger-kernel)")
    parser.add_argument("--python", default=DEFAULT_PYTHON, help=f"the GPU machine's Python (default {DEFAULT_PYTHON})")
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl/)")
    parser.add_argument("--with-deps", action="store_true", help="also fetch the packages' dependencies")
    return parser


def pip_download(packages, python, folder, with_deps):
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python,
               "--dest", str(folder), *[f"--platform={platform}" for platform in PLATFORMS]]
    command += [] if with_deps else ["--no-deps"]
    result = subprocess.run(command + list(packages), capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or ["pip download failed"]
        raise CommandError(f"pip download {' '.join(packages)} for Python {python}: {lines[0]}")
    return sorted(folder.glob("*.whl"))


def fetch(argv, progress):
    args = build_parser().parse_args(argv)
    if not args.python.replace(".", "").isdigit() or args.python.count(".") != 1:
        raise CommandError(f"--python {args.python!r}: expected a version such as 3.12")
    args.dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetching-", dir=args.dest))
    progress.describe = lambda: f"{args.dest} is unchanged (partial downloads are removed)"
    try:
        wheels = pip_download(args.packages, args.python, staging, args.with_deps)
        for wheel in wheels:
            shutil.move(str(wheel), args.dest / wheel.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for wheel in wheels:
        print(f"{args.dest / wheel.name}")
    print(f"{len(wheels)} wheel(s) in {args.dest}; copy the folder along with the repository to the GPU machine")


def main(argv=None):
    return run(fetch, argv)


if __name__ == "__main__":
    exit_with(main)
