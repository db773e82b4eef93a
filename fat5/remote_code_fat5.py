"""What makes a folder a FAT5 package: FAT5's code flat beside `config.json`, `auto_map` and the text2text
pipeline entry. One definition, used by every `save_pretrained` route and by the converter's export.

This module is itself part of the remote code: a model loaded from a checkpoint folder saves a complete package
from the copy of the code transformers loaded it from.

Saves are atomic (`StagedFolder`, standard library only, so the converter can use it too): a save is written into
a staging folder beside its target (`.NAME.partial-PID-XXXX`), then put at the target's path in one step: a rename
when the target is absent, an exchange of the two directories (Linux `renameat2(RENAME_EXCHANGE)`) when it exists,
or, where the kernel or filesystem lacks the exchange, two renames with Ctrl-C and SIGTERM held between them.
Entries of the old folder that the new save does not replace are carried into the staging folder as hard links
before the step (no data is copied). A staging folder is locked (`flock`) by the process writing it, so a later
save removes the staging folders of killed saves (unlocked ones) and never one still being written. (This lives
here rather than in its own module because transformers 4.57 copies into its module cache only the modules that
the model file imports itself.)
"""

import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

CODE_DIR = Path(__file__).resolve().parent
# The modules a checkpoint loads by name; everything they import relatively comes with them (kernels included).
ENTRY_MODULES = ("configuration_fat5", "modeling_fat5", "pipeline_fat5")
# In the installed package kernels live in kernels/ (imported by the model as `.kernels.NAME`, and importing the
# model's modules as `..NAME`); transformers resolves only same-folder imports, so checkpoints hold them flat.
NESTED_IMPORT = re.compile(r"^(\s*from\s+)(?:\.kernels\.|\.\.)(\w+\s+import\b)", re.MULTILINE)
RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\S*)\s+import", re.MULTILINE)
AUTO_MAP = {
    "AutoConfig": "configuration_fat5.FAT5Config",
    "AutoModel": "modeling_fat5.FAT5Model",
    "AutoModelForSeq2SeqLM": "modeling_fat5.FAT5ForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_fat5.FAT5ForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_fat5.FAT5ForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_fat5.FAT5ForQuestionAnswering",
    "AutoModelForTextEncoding": "modeling_fat5.FAT5EncoderModel",
}
PIPELINE_TASK = "text2text-generation"
# Weight files of an earlier save (unsharded, shards, index), never kept beside a new save's weights.
WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def custom_pipelines_entry():
    """The `custom_pipelines` value of config.json that makes `pipeline(..., trust_remote_code=True)` load
    `pipeline_fat5.py` from the checkpoint folder (keys as transformers 4.57 writes them; 5.x ignores "tf")."""
    # Imported here (not only named) so that transformers copies pipeline_fat5.py along with the model's code.
    from .pipeline_fat5 import FAT5Text2TextGenerationPipeline

    return {
        PIPELINE_TASK: {
            "impl": f"pipeline_fat5.{FAT5Text2TextGenerationPipeline.__name__}",
            "pt": ["AutoModelForSeq2SeqLM"],
            "tf": [],
            "type": "text",
        }
    }


def flatten_imports(source):
    return NESTED_IMPORT.sub(r"\1.\2", source)


def _module_path(module):
    candidates = [path for path in (CODE_DIR / f"{module}.py", CODE_DIR / "kernels" / f"{module}.py")
                  if path.is_file()]
    if "." in module or len(candidates) != 1:
        raise FileNotFoundError(f"FAT5 remote code imports .{module}, which is not exactly one module of {CODE_DIR} "
                                "(a kernel must be imported by its module path, `.kernels.NAME`)")
    return candidates[0]


def remote_code_files():
    """{flat file name: source path} of every module a FAT5 checkpoint needs: ENTRY_MODULES and, recursively,
    what they import relatively. Works from the installed package and from a flat checkpoint copy alike."""
    files, pending = {}, list(ENTRY_MODULES)
    while pending:
        module = pending.pop()
        if f"{module}.py" in files:
            continue
        path = _module_path(module)
        files[f"{module}.py"] = path
        pending.extend(RELATIVE_IMPORT.findall(flatten_imports(path.read_text())))
    return dict(sorted(files.items()))


def write_remote_code(folder):
    """Write FAT5's code flat into `folder`."""
    for flat_name, source in remote_code_files().items():
        (Path(folder) / flat_name).write_text(flatten_imports(source.read_text()))


def mark_as_package(config, encoder_only=False):
    """Set the config fields that make a saved folder load through the Auto classes and the pipeline, and record
    the transformers releases its code was tested with.
    `encoder_only`: the folder holds no decoder weights (an encoder-only class saved it), so its base model,
    `AutoModel` (what sentence-transformers loads), is the encoder."""
    from .compat_fat5 import TESTED_TRANSFORMERS

    config.auto_map = dict(AUTO_MAP)
    if encoder_only:
        config.auto_map["AutoModel"] = AUTO_MAP["AutoModelForTextEncoding"]
    config.custom_pipelines = custom_pipelines_entry()
    # The transformers releases the code written beside this config was tested with (it warns under others).
    config.tested_transformers = list(TESTED_TRANSFORMERS)


# -- atomic saves ----------------------------------------------------------------------------------------------------

STAGING_MARK = ".partial-"
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # linux/fs.h
AT_FDCWD = -100


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(folder):
    """Give `folder` and everything in it the permissions new files and folders get under the umask (0666 and
    0777 less the umask): `tempfile.mkdtemp` makes folders 0700, and safetensors writes weights 0600."""
    mask = current_umask()
    folder = Path(folder)
    folder.chmod(0o777 & ~mask)
    for root, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _staging_prefix(target):
    return f".{Path(target).name}{STAGING_MARK}"


def _lock(path):
    """An exclusive lock on a folder, held while the returned descriptor is open; None if another holds it."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def remove_stale_staging(target):
    """Remove the staging folders of `target` left by killed saves (those no process holds locked)."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    for path in target.parent.glob(f"{_staging_prefix(target)}*"):
        if not path.is_dir() or path.is_symlink():
            continue
        descriptor = _lock(path)
        if descriptor is not None:
            try:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(descriptor)


def renameat2(first, second, flag):
    """Linux renameat2(first, second, flag); False where the system lacks it or the flag (kernel, filesystem)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    result = libc.renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), flag)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def exchange(first, second):
    """Atomically swap two paths (RENAME_EXCHANGE). False where the system cannot."""
    return renameat2(first, second, RENAME_EXCHANGE)


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


def _link_tree(source, destination):
    """Recreate `source` at `destination` with every file hard-linked (no data copied), keeping modes and times;
    files are copied only where the filesystem refuses hard links."""
    if source.is_symlink():
        os.symlink(os.readlink(source), destination)
        return
    if not source.is_dir():
        try:
            os.link(source, destination, follow_symlinks=False)
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
                raise
            shutil.copy2(source, destination)
        return
    os.mkdir(destination)
    for entry in source.iterdir():
        _link_tree(entry, destination / entry.name)
    shutil.copystat(source, destination)  # after the entries, so the folder keeps its own times


def _fsync_folder(folder):
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def put_in_place(source, target):
    """Move the folder `source` to `target` in one atomic step, replacing what `target` holds. Returns the path
    that then holds the old folder (`source` after an exchange, a `-old` name after two renames), or None when
    `target` did not exist."""
    source, target = Path(source), Path(target)
    _fsync_folder(source)
    with signals_deferred():
        if not os.path.lexists(target):
            os.rename(source, target)
            old = None
        else:
            old = swap_in(source, target)
    _fsync_folder(target.parent)
    return old


def swap_in(source, target):
    """Put the folder `source` at the existing path `target` (call with signals held): one exchange, or two renames
    where the system has none (a crash between them leaves the old folder at a `-old` path beside). Returns the
    path that then holds the old folder."""
    source, target = Path(source), Path(target)
    if exchange(source, target):
        return source
    old = source.with_name(source.name + "-old")
    os.rename(target, old)
    try:
        os.rename(source, target)
    except OSError:
        os.rename(old, target)
        raise
    return old


class StagedFolder:
    """A staging folder beside `target` that `commit()` puts at `target` in one step.

    ``with StagedFolder(target) as staging: write into staging.path; staging.commit(keep=...)``: leaving the
    block without a commit (an error, Ctrl-C) removes the staging folder and leaves `target` as it was.
    `keep(name)` says which entries of an existing target the new folder keeps (among those it does not write
    itself); None keeps nothing, so the new folder replaces the old one whole. `check(path)`, when given, is called
    on the complete staged folder just before it goes in place: raising there leaves `target` as it was.
    Permissions follow the umask."""

    def __init__(self, target):
        # A symlinked target is saved where it points: the link stays, the folder behind it is replaced.
        self.target = Path(target).resolve() if os.path.islink(target) else Path(target)
        self.path = None
        self._lock = None

    def __enter__(self):
        self.target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.target)
        self.path = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(self.target)}{os.getpid()}-",
                                          dir=self.target.parent))
        self._lock = _lock(self.path)
        return self

    def commit(self, keep=None, check=None):
        apply_umask(self.path)
        if self.target.is_dir() and not self.target.is_symlink() and keep is not None:
            written = {entry.name for entry in self.path.iterdir()}
            for entry in self.target.iterdir():
                if entry.name not in written and keep(entry.name):
                    _link_tree(entry, self.path / entry.name)
            shutil.copystat(self.target, self.path)
        if check is not None:
            check(self.path)
        # Then self.path holds the old folder (or nothing), which __exit__ removes.
        self.path = put_in_place(self.path, self.target)

    def __exit__(self, *exc):
        try:
            if self.path is not None and self.path.exists():
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None
        return False


def save_as_package(save, save_directory):
    """Call `save(staging_folder)` (transformers' save_pretrained), add FAT5's code, then put the result at
    `save_directory` in one atomic step (`StagedFolder`): at every instant the folder holds the
    complete old save or the complete new one, never new weights beside an old config. Files of the old folder
    that the new save does not write are kept, except weights (an earlier save's shards or unsharded file, which
    would otherwise load instead of the new weights). Staging folders of killed saves are removed. On any error
    `save_directory` is left as it was. Files and folders get the umask's permissions."""
    with StagedFolder(save_directory) as staging:
        save(staging.path)
        write_remote_code(staging.path)
        staging.commit(keep=lambda name: not WEIGHT_FILE.fullmatch(name))
