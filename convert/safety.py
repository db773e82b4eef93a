"""Writing an output folder so that nothing outside it is ever touched and it is never half there.

Both converters build OUT in a staging folder beside it, then put it in place with one atomic step: a plain
rename when OUT is absent, an atomic exchange of the two directories (Linux `renameat2(RENAME_EXCHANGE)`) when
it replaces an existing OUT. At every instant OUT's path holds either the complete old folder or the complete
new one. Staging folders are named after OUT and the owning process, so a run removes those left by killed
runs on the same OUT, and only those.
"""

import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from convert.cli import CommandError

STAGING_MARK = ".fat5-staging-"
RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


class OutputError(CommandError):
    """OUT cannot be written safely; the message says why."""


def check_paths(source, out, overwrite):
    """Refuse an OUT that is, contains or lies inside the source (symlinks resolved), and an existing OUT
    that is not an empty folder unless `overwrite`."""
    source, out = Path(source), Path(out)
    resolved_source, resolved_out = source.resolve(), out.resolve()
    if resolved_out == resolved_source or resolved_source in resolved_out.parents \
            or resolved_out in resolved_source.parents:
        raise OutputError(f"OUT {out} overlaps SRC {source}: choose an output folder outside the source")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{out} exists and is not empty (use --overwrite to replace it)")


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(out):
    """Remove staging folders of `out` whose owning process is gone (a killed run)."""
    out = Path(out)
    prefix = f".{out.name}{STAGING_MARK}"
    for path in out.parent.glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_staging(out):
    """An empty staging folder beside `out`, with the permissions a new folder gets under the umask."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING_MARK}{os.getpid()}-", dir=out.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700
    return staging


def _exchange(first, second):
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where the system lacks it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    result = libc.renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # kernel or filesystem without RENAME_EXCHANGE
    raise OSError(code, os.strerror(code), str(first))


@contextmanager
def signals_deferred():
    """Hold Ctrl-C (SIGINT) and SIGTERM during a few steps that must complete together; a signal that arrives
    meanwhile is re-raised right after. (Python handlers run in the main thread, where the converters run.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = {number: signal.signal(number, lambda number, frame: received.append(number))
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in received[:1]:
            signal.raise_signal(number)


class AtomicOutput:
    """Staging folder for OUT and its final swap into place; `state` says what OUT's path holds."""

    def __init__(self, source, out, overwrite):
        self.out = Path(out)
        check_paths(source, self.out, overwrite)
        self.existed = self.out.is_dir()
        self.state = "unchanged"  # -> "written" once the new folder is at OUT's path
        self.staging = None

    def __enter__(self):
        self.staging = make_staging(self.out)
        return self.staging

    def commit(self):
        """Put the staging folder at OUT's path in one atomic step; then remove the old folder."""
        with signals_deferred():
            if not self.out.exists():
                os.rename(self.staging, self.out)
            elif not _exchange(self.staging, self.out):
                self._replace_without_exchange()
            self.state = "written"
        shutil.rmtree(self.staging, ignore_errors=True)  # now the old OUT, or already gone

    def _replace_without_exchange(self):
        # Two renames, with signals held; a crash between them leaves the old folder at the staging path
        # (reported by the next run's clean-up only if this process died).
        old = self.staging.with_name(self.staging.name + "-old")
        os.rename(self.out, old)
        try:
            os.rename(self.staging, self.out)
        except OSError:
            os.rename(old, self.out)
            raise
        self.staging = old

    def __exit__(self, *exc):
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        return False

    def describe(self):
        """One phrase for the final message: what OUT's path holds now."""
        if self.state == "written":
            return f"{self.out} holds the complete new conversion" + (" (the old folder was replaced)"
                                                                       if self.existed else "")
        if self.existed:
            return f"{self.out} is unchanged (the old folder is intact)"
        return f"nothing was written to {self.out}"
