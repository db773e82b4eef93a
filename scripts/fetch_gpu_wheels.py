"""Download the wheels the GPU image lacks, on a machine with PyPI, into the folder that
`python benchmarks/gpu_suite.py` installs from first, offline (the GPU machines have no network).

    python scripts/fetch_gpu_wheels.py          # transformers 5.24.0 and liger-kernel 0.8.5 for Python 3.12 into .whl/
    python scripts/fetch_gpu_wheels.py --python 3.11 --dest DIR datasets --with-deps

The GPU image has torch, triton, tokenizers, huggingface-hub and safetensors, and transformers 5.17, which FAT5
does not admit: by default a tested transformers release and liger-kernel are fetched, without their dependencies
(--with-deps fetches those too), as wheels for the image's Python on manylinux x86_64; nothing is built here. The
folder receives the wheels only once every download succeeded. Then the script checks what a device call carries:
one version of each package (two stop the install), and the checkout's files (tracked, and untracked but not
ignored) plus the wheels under 64 MiB, the device's limit.
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
DEFAULT_PACKAGES = ["transformers==5.24.0", "liger-kernel==0.8.5"]
CARRY_LIMIT = 64 * 2**20  # what one device call may carry: the working tree and the carried wheels


def build_parser():
    parser = CliParser(prog="fetch_gpu_wheels.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", default=DEFAULT_PACKAGES,
                        help=f"requirement specifiers (default: {' '.join(DEFAULT_PACKAGES)})")
    parser.add_argument("--python", default=DEFAULT_PYTHON, help=f"the GPU machine's Python (default {DEFAULT_PYTHON})")
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl/)")
    parser.add_argument("--with-deps", action="store_true", help="also fetch the packages' dependencies")
    return parser


def pip_download(packages, python, folder, with_deps):
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", "--dest", str(folder), *[f"--platform={platform}" for platform in PLATFORMS]]
    command += [] if with_deps else ["--no-deps"]
    result = subprocess.run(command + list(packages), capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or ["pip download failed"]
        raise CommandError(f"pip download {' '.join(packages)} for Python {python}: {lines[0]}")
    return sorted(folder.glob("*.whl"))


def carried_bytes(folder):
    """(bytes of the checkout's files a device call sends, bytes of the wheels in `folder`)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:
        raise CommandError(f"{ROOT} is not a git checkout: cannot count what a device call carries")
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    tree = sum(path.stat().st_size for path in paths if path.is_file() and folder not in path.parents)
    return tree, sum(wheel.stat().st_size for wheel in folder.glob("*.whl"))


def check_carry(folder):
    """One line saying what travels; an error if two versions of a package would be installed or if it is over
    the limit."""
    names = {}
    for wheel in sorted(folder.glob("*.whl")):
        names.setdefault(wheel.name.split("-")[0].lower(), []).append(wheel.name)
    twice = [", ".join(found) for found in names.values() if len(found) > 1]
    if twice:
        raise CommandError(f"two versions of a package in {folder}: {'; '.join(twice)}; remove the older")
    tree, wheels = carried_bytes(folder)
    line = (f"a device call carries {(tree + wheels) / 2**20:.1f} MiB: the checkout {tree / 2**20:.1f} MiB and "
            f"the wheels {wheels / 2**20:.1f} MiB (limit {CARRY_LIMIT // 2**20} MiB)")
    if tree + wheels > CARRY_LIMIT:
        raise CommandError(line + ": over the limit; fetch fewer wheels")
    return line


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
        print(f"{args.dest / wheel.name} ({(args.dest / wheel.name).stat().st_size / 2**20:.1f} MiB)")
    print(f"{len(wheels)} wheel(s) in {args.dest}; carry the folder with the device call (docs/benchmarks.md)")
    print(check_carry(args.dest.resolve()))


def main(argv=None):
    return run(fetch, argv)


if __name__ == "__main__":
    exit_with(main)
