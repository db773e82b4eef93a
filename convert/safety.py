"""Writing an output folder so that nothing outside it is ever touched and it is never half there.

Both converters build OUT in a staging folder beside it, then put it in place with one atomic step
(`put_in_place`): a rename that refuses to replace anything when OUT was absent (Linux
`renameat2(RENAME_NOREPLACE)`), a rename that replaces only an empty folder when OUT was one, and with
--overwrite an atomic exchange of the two directories (`renameat2(RENAME_EXCHANGE)`). At every instant OUT's path
holds either the complete old folder or the complete new one, and without --overwrite nothing that appeared at
OUT during the run is replaced. Staging folders are named after OUT and the owning process, so a run removes
those left by killed runs on the same OUT, and only those.
"""

import errno
import os
import shutil
import tempfile
from pathlib import Path

from fat5.cli import CommandError
from fat5.remote_code_fat5 import RENAME_NOREPLACE, current_umask, renameat2, signals_deferred, swap_in

STAGING_MARK = ".fat5-staging-"


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


def make_staging(out):
    """An empty staging folder beside `out`, with the permissions a new folder gets under the umask."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING_MARK}{os.getpid()}-", dir=out.parent))
    staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700
    return staging


def _rename_no_replace(first, second):
    """Rename `first` to `second`, atomically failing with FileExistsError if `second` exists. Without
    renameat2, `second` is claimed with mkdir first, then replaced by the rename (which replaces only an empty
    folder, so anything put into the claimed one meanwhile makes it fail)."""
    if renameat2(first, second, RENAME_NOREPLACE):
        return
    os.mkdir(second)
    os.rename(first, second)


def put_in_place(staging, out, replace):
    """Move the complete folder `staging` to `out` in one atomic step; return the path where the folder that
    was at `out` now lies, for the caller to remove (None when there was none, or only an empty folder).

    `replace`: "all" replaces whatever is at `out` (--overwrite); "empty" accepts `out` absent or an empty folder
    (a rename replaces only an empty folder, atomically); "nothing" accepts only an absent `out`. Otherwise
    `out` is left as it is and OutputError says so.
    """
    staging, out = Path(staging), Path(out)
    try:
        if replace == "empty":
            os.rename(staging, out)
        else:
            _rename_no_replace(staging, out)
        return None
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
        if replace != "all":
            raise OutputError(f"{out} appeared or was filled while converting: left as it is (use --overwrite "
                              "to replace it)") from error
    return swap_in(staging, out)  # signals are held by the caller


class AtomicOutput:
    """Staging folder for OUT and its final swap into place; `state` says what OUT's path holds."""

    def __init__(self, source, out, overwrite, what="conversion"):
        self.out = Path(out)
        self.what = what  # what the folder holds, for `describe`
        check_paths(source, self.out, overwrite)
        self.existed = self.out.is_dir()
        self.overwrite = overwrite
        self.state = "unchanged"  # -> "written" once the new folder is at OUT's path
        self.staging = None

    def __enter__(self):
        self.staging = make_staging(self.out)
        return self.staging

    def commit(self):
        """Put the staging folder at OUT's path in one atomic step; then remove the old folder. Without
        --overwrite, only what the run started with may be replaced: nothing, or an empty folder."""
        replace = "all" if self.overwrite else "empty" if self.existed else "nothing"
        with signals_deferred():
            # From here on `staging` names the old folder to remove (None if there is none): __exit__ removes
            # it even when a signal held during the swap is raised right after it.
            self.staging = put_in_place(self.staging, self.out, replace)
            self.state = "written"
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def __exit__(self, *exc):
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        return False

    def describe(self):
        """One phrase for the final message: what OUT's path holds now."""
        if self.state == "written":
            return f"{self.out} holds the complete new {self.what}" + (" (the old folder was replaced)"
                                                                       if self.existed else "")
        if self.existed:
            return f"{self.out} is unchanged (the old folder is intact)"
        return f"nothing was written to {self.out}"
