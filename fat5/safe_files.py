"""Writing files and folders whole or not at all: the one home of FAT5's file safety for everything that is not a
model's shipped code: the converters and exporters (convert/safety.py), `save_pretrained` wherever FAT5 is installed
(a checkpoint's shipped fat5/remote_code_fat5.py stages through `StagedFolder` here when it can import it; where
FAT5 is not installed, it saves in place as transformers does), training checkpoints and the run
folder's records (fat5/training/run_folder.py), the tokenizer pretraining trains, the model cards of
training runs (fat5/training/model_card.py) and `fat5 sample-data`'s files.

A folder is written into a staging folder beside its target (`.NAME.partial-PID-XXXX`), then put in place, with
what the platform offers:
- one atomic step over an existing target: Linux `renameat2(RENAME_EXCHANGE)` swaps the two folders; elsewhere two
  renames with Ctrl-C and SIGTERM held between them (a crash between them leaves the old folder at `...-old` and
  none at the target: the next writer puts it back);
- a rename that replaces nothing (`renameat2(RENAME_NOREPLACE)`; elsewhere the target is claimed with `mkdir`
  first), so that what appeared at the target meanwhile is replaced only when asked (`replace`);
- a lock (`flock`) on each staging folder while it is written, so that the next writer on the same target removes
  the staging folders of killed ones and never one still being written (where there is no `fcntl`, none is
  removed);
- `LockFile`, a process's lock on a file (a run folder's): `flock` where there is `fcntl`, elsewhere (Windows) the
  file created exclusively, holding its process id, with stale-lock detection;
- the staged folder and its parent flushed to disk around the step.
Standard library only; nothing platform-specific is imported at module level.
"""

import errno
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # linux/fs.h
AT_FDCWD = -100
# In the name of every staging folder: `.NAME.partial-PID-XXXX`.
STAGING_MARK = ".partial-"


def apply_umask(folder):
    """Give `folder` and everything in it the permissions new files and folders get under the umask (0666 and
    0777 less the umask): `tempfile.mkdtemp` makes folders 0700, and safetensors writes weights 0600."""
    mask = os.umask(0)
    os.umask(mask)
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _link_or_copy(source, destination):
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, destination)


def link_tree(source, destination):
    """Recreate `source` at `destination` with every file hard-linked (copied where the filesystem has no hard
    links), keeping symbolic links, modes and times."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
    elif os.path.isdir(source):
        shutil.copytree(source, destination, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, destination)


def rename_aside(source, target):
    """Put the folder `source` at the existing path `target` with two renames, the old folder moved aside first
    (to `source`-old, whose path this returns); if the second fails (or Ctrl-C comes between), it is put back."""
    old = Path(f"{source}-old")
    try:
        os.rename(target, old)
        os.rename(source, target)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(target):
            os.rename(old, target)
        raise
    return old


def staging_prefix(target):
    return f".{Path(target).name}{STAGING_MARK}"


def lock(path, create=False):
    """An exclusive lock (`flock`) on the file or folder at `path` (a file, made if absent, with `create`), held
    until the returned descriptor is closed; None when another process holds it. Where the platform has no `fcntl`
    nothing is locked: the descriptor of the file with `create`, else None."""
    if fcntl is None:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666) if create else None
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666) if create else os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


class LockFile:
    """An exclusive lock of this process on the file `path` (made if absent), which records its holder ("PID HOST"):
    `LockFile.acquire(path)` returns it, or None while another process holds it (`holder(path)` says which);
    `release()` frees it.

    With `fcntl` (Linux, macOS) it is `flock` on the file, which the kernel frees when the process dies. Without it
    (Windows) the file itself is the lock: created exclusively (`O_CREAT | O_EXCL`) and removed on release. A lock
    file a killed process left is stale when that process no longer exists on this host (`process_exists`), and is
    replaced; one written on another host, or by a process that still runs, is held. (On Windows a live holder also
    keeps its lock file open, which forbids removing it, so two processes never both take over a stale one.)
    """

    STALE_EMPTY_SECONDS = 10  # an empty lock file this old was left by a process killed between creating and writing

    def __init__(self, path, descriptor, created):
        self.path, self.descriptor, self.created = Path(path), descriptor, created

    @classmethod
    def acquire(cls, path):
        owner = f"{os.getpid()} {socket.gethostname()}\n".encode()
        if fcntl is not None:
            descriptor = lock(path, create=True)
            if descriptor is None:
                return None
            os.ftruncate(descriptor, 0)
            os.write(descriptor, owner)
            return cls(path, descriptor, created=False)
        for _ in range(2):
            try:
                descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                if not cls.stale(path):
                    return None
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except PermissionError:  # Windows: its holder still has it open
                    return None
                continue
            os.write(descriptor, owner)
            return cls(path, descriptor, created=True)
        return None

    @staticmethod
    def holder(path):
        """(process id, host) that the lock file records, (None, None) where it records none."""
        try:
            pid, _, host = Path(path).read_text(errors="replace").strip().partition(" ")
            return int(pid), host
        except (OSError, ValueError):
            return None, None

    @classmethod
    def stale(cls, path):
        """Whether a lock file (without fcntl) was left by a process that no longer exists."""
        pid, host = cls.holder(path)
        if pid is None:
            try:
                return time.time() - os.stat(path).st_mtime > cls.STALE_EMPTY_SECONDS
            except FileNotFoundError:
                return True
        return host == socket.gethostname() and not process_exists(pid)

    def release(self):
        if self.descriptor is None:
            return
        os.close(self.descriptor)
        self.descriptor = None
        if self.created:
            Path(self.path).unlink(missing_ok=True)


def process_exists(pid):
    """Whether process `pid` exists on this machine (standard library only: `os.kill(pid, 0)` on POSIX; on Windows,
    where `os.kill` would end the process, its exit code read through the Windows API)."""
    if pid == os.getpid():
        return True
    if os.name == "nt":
        import ctypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: it exists, another user's
        try:
            code = ctypes.c_ulong()
            return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259  # STILL_ACTIVE
        finally:
            kernel32.CloseHandle(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_stale_staging(target):
    """Remove the staging folders of `target` that killed writers left (those no process holds locked); an old
    folder that a killed replacement had moved aside (`...-old`, no folder at `target`) is put back instead."""
    target = Path(target)
    if fcntl is None or not target.parent.is_dir():
        return
    prefix = staging_prefix(target)
    for path in sorted(target.parent.iterdir()):
        if not path.name.startswith(prefix) or path.is_symlink() or not path.is_dir():
            continue
        descriptor = lock(path)
        if descriptor is None:
            continue
        try:
            if path.name.endswith("-old") and not os.path.lexists(target):
                os.rename(path, target)
            else:
                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(descriptor)


def renameat2(first, second, flag):
    """Linux renameat2(first, second, flag); False where the system lacks it or the flag (kernel, filesystem)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    if libc.renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), flag) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def exchange(first, second):
    """Atomically swap two paths (RENAME_EXCHANGE). False where the system cannot."""
    return renameat2(first, second, RENAME_EXCHANGE)


def rename_no_replace(first, second):
    """Rename `first` to `second`, failing (EEXIST) if `second` exists. Without renameat2, `second` is claimed with
    mkdir first, then replaced by the rename, which replaces only an empty folder (so anything put into the
    claimed one meanwhile makes it fail); elsewhere than POSIX a rename never replaces anything."""
    if renameat2(first, second, RENAME_NOREPLACE):
        return
    if os.name == "posix":
        os.mkdir(second)
    os.rename(first, second)


@contextmanager
def signals_deferred():
    """Hold Ctrl-C (SIGINT) and SIGTERM during steps that must complete together; a signal that arrives meanwhile
    is re-raised right after. (Python runs signal handlers in the main thread only; elsewhere nothing is held.)"""
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


def fsync_folder(folder):
    """Flush a folder's entries to disk (where folders can be opened: not on Windows)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def swap_in(source, target):
    """Put the folder `source` at the existing path `target` (call with signals held): one exchange, or two renames
    where the system has none. Returns the path that then holds the old folder."""
    return Path(source) if exchange(source, target) else rename_aside(source, target)


def put_in_place(source, target, replace="all"):
    """Move the complete folder `source` to `target` in one step; return where the folder that was at `target` now
    lies, for the caller to remove (None when there was none, or only an empty folder).

    `replace`: "all" replaces whatever is at `target`; "empty" accepts `target` absent or an empty folder (a rename
    replaces only an empty folder, atomically); "nothing" accepts only an absent `target`. Otherwise `target` is
    left as it is and FileExistsError says so.
    """
    source, target = Path(source), Path(target)
    fsync_folder(source)
    with signals_deferred():
        try:
            if replace == "empty":
                os.rename(source, target)
            else:
                rename_no_replace(source, target)
            old = None
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
            if replace != "all":
                raise FileExistsError(errno.EEXIST, "appeared while the new folder was written", str(target)) \
                    from error
            old = swap_in(source, target)
    fsync_folder(target.parent)
    return old


class StagedFolder:
    """A staging folder beside `target` that `commit()` puts at `target`, with the steps above: locked while it is
    written, staging folders of killed writers removed first, put in place by `put_in_place` with `replace` ("all" by
    default: what `save_pretrained` does).

    ``with StagedFolder(target) as staging: write into staging.path; staging.commit(keep=...)``: leaving the
    block without a commit (an error, Ctrl-C) removes the staging folder and leaves `target` as it was.
    `keep(name)` says which entries of an existing target the new folder keeps (among those it does not write
    itself), as hard links; None keeps nothing, so the new folder replaces the old one whole. `check(path)`, when
    given, is called on the complete staged folder just before it goes in place: raising there leaves `target` as
    it was. Permissions follow the umask."""

    def __init__(self, target, replace="all"):
        # A symlinked target is saved where it points: the link stays, the folder behind it is replaced.
        self.target = Path(target).resolve() if os.path.islink(target) else Path(target)
        self.replace = replace
        self.path = self._lock = None

    def __enter__(self):
        remove_stale_staging(self.target)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(self.target)}{os.getpid()}-",
                                          dir=self.target.parent))
        self._lock = lock(self.path)
        return self

    def commit(self, keep=None, check=None):
        apply_umask(self.path)
        if self.target.is_dir() and keep is not None:
            written = {entry.name for entry in self.path.iterdir()}
            for entry in self.target.iterdir():
                if entry.name not in written and keep(entry.name):
                    link_tree(entry, self.path / entry.name)
            shutil.copystat(self.target, self.path)
        if check is not None:
            check(self.path)
        # Then self.path holds the old folder (or nothing), which __exit__ removes.
        self.path = put_in_place(self.path, self.target, self.replace)

    def __exit__(self, *exc):
        try:
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
            return False
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None


def remove_folder(path):
    """Delete a folder so that it is never seen half deleted: renamed to `.NAME.removed` first (what a deletion cut
    short leaves there is removed by the next one)."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.removed")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def fsync_tree(folder):
    """Flush a folder's files and subfolders to disk (files only where folders cannot be opened: not on Windows)."""
    for root, _, files in os.walk(folder):
        for name in files:
            descriptor = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        fsync_folder(root)


def write_atomically(path, text):
    """Write `text` (UTF-8) to the file `path` whole or not at all: into a temporary file beside it, flushed to
    disk, then renamed over it; a failed write (a full disk) leaves `path` as it was and nothing beside it."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
