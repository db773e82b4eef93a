"""Writing an output folder so that nothing outside it is ever touched and it is never half there.

Both converters and both exporters build OUT in a staging folder beside it and put it in place with one atomic
step (fat5/safe_files.py, the one home of FAT5's file safety): without --overwrite, a rename that replaces nothing
when OUT was absent, or only an empty folder when OUT was one; with --overwrite, an atomic exchange with the old
folder. At every instant OUT's path holds either the complete old folder or the complete new one, and without
--overwrite nothing that appeared at OUT during the run is replaced. A symlinked OUT is written where it points.
"""

import os
from pathlib import Path

from fat5.cli import CommandError
from fat5.safe_files import STAGING_MARK, StagedFolder, signals_deferred  # noqa: F401  (STAGING_MARK re-exported)


class OutputError(CommandError):
    """OUT cannot be written safely; the message says why."""


def check_paths(source, out, overwrite):
    """Refuse an OUT that is, contains or lies inside the source (symlinks resolved), one that is not a folder, and
    an existing OUT that is not an empty folder unless `overwrite`."""
    source, out = Path(source), Path(out)
    resolved_source, resolved_out = source.resolve(), out.resolve()
    if resolved_out == resolved_source or resolved_source in resolved_out.parents \
            or resolved_out in resolved_source.parents:
        raise OutputError(f"OUT {out} overlaps SRC {source}: choose an output folder outside the source")
    if out.is_symlink() and not out.is_dir():
        what = "a file" if out.exists() else "nothing"
        raise OutputError(f"OUT {out} is a symbolic link to {os.readlink(out)}, which is {what}: give a folder")
    if out.exists() and not out.is_dir():
        raise OutputError(f"OUT {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{out} exists and is not empty (use --overwrite to replace it)")


class AtomicOutput:
    """Staging folder for OUT and its final swap into place; `state` says what OUT's path holds."""

    def __init__(self, source, out, overwrite, what="conversion"):
        self.out = Path(out)
        self.what = what  # what the folder holds, for `describe`
        check_paths(source, self.out, overwrite)
        self.existed = self.out.is_dir()
        self.state = "unchanged"  # -> "written" once the new folder is at OUT's path
        # Without --overwrite, only what the run started with may be replaced: nothing, or an empty folder.
        self.folder = StagedFolder(self.out, replace="all" if overwrite else "empty" if self.existed else "nothing")

    def __enter__(self):
        return self.folder.__enter__().path

    def commit(self):
        """Put the staging folder at OUT's path in one atomic step; the old folder is removed on leaving."""
        # Signals held around the step and the state, so that a Ctrl-C during the step is told what OUT holds.
        with signals_deferred():
            try:
                self.folder.commit()
            except FileExistsError as error:
                raise OutputError(f"{self.out} appeared or was filled while converting: left as it is (use "
                                  "--overwrite to replace it)") from error
            self.state = "written"

    def __exit__(self, *exc):
        return self.folder.__exit__(*exc)

    def describe(self):
        """One phrase for the final message: what OUT's path holds now."""
        if self.state == "written":
            return f"{self.out} holds the complete new {self.what}" + (" (the old folder was replaced)"
                                                                       if self.existed else "")
        if self.existed:
            return f"{self.out} is unchanged (the old folder is intact)"
        return f"nothing was written to {self.out}"
