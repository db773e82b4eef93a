"""What makes a folder a FAT5 package: FAT5's code flat beside `config.json`, `auto_map` and the text2text
pipeline entry. One definition, used by every `save_pretrained` route and by the converter's export.

This module is itself part of the remote code: a model loaded from a checkpoint folder saves a complete package
from the copy of the code transformers loaded it from.

A save is written into a staging folder beside its target (`.NAME.partial-PID-XXXX`), then renamed to the target's
path (`StagedFolder`): standard library only and nothing platform-specific, so a folder loads and saves wherever
Python runs. Where FAT5 is installed, `save_pretrained` takes `fat5/safe_files.py`'s instead, which adds what the
platform offers (one atomic exchange over an existing folder, locks, removal of killed saves' staging folders) and
is not shipped.
(This lives here rather than in its own module because transformers 4.57 copies into its module cache only the
modules that the model file imports itself.)
"""

import os
import re
import shutil
import tempfile
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


class StagedFolder:
    """A staging folder beside `target` that `commit()` puts at `target`.

    ``with StagedFolder(target) as staging: write into staging.path; staging.commit(keep=...)``: leaving the
    block without a commit (an error, Ctrl-C) removes the staging folder and leaves `target` as it was.
    `keep(name)` says which entries of an existing target the new folder keeps (among those it does not write
    itself), as hard links; None keeps nothing, so the new folder replaces the old one whole. `check(path)`, when
    given, is called on the complete staged folder just before it goes in place: raising there leaves `target` as
    it was. Permissions follow the umask. Here the new folder goes in place by a rename, over an existing target by
    two (`rename_aside`); fat5/safe_files.py's subclass makes that one atomic step where the platform can."""

    def __init__(self, target):
        # A symlinked target is saved where it points: the link stays, the folder behind it is replaced.
        self.target = Path(target).resolve() if os.path.islink(target) else Path(target)
        self.path = None

    def __enter__(self):
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}{STAGING_MARK}{os.getpid()}-",
                                          dir=self.target.parent))
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
        self.path = self.put_in_place(self.path, self.target)

    def put_in_place(self, source, target):
        """Move the complete folder `source` to `target`; return where the old folder now lies (None if none)."""
        if not os.path.lexists(target):
            os.rename(source, target)
            return None
        return rename_aside(source, target)

    def __exit__(self, *exc):
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        return False


def save_as_package(save, save_directory, staged_folder=StagedFolder):
    """Call `save(staging_folder)` (transformers' save_pretrained), add FAT5's code, then put the result at
    `save_directory` (`staged_folder`: StagedFolder, or fat5/safe_files.py's where FAT5 is installed): the folder
    holds the complete old save or the complete new one, never new weights beside an old config. Files of the old
    folder that the new save does not write are kept, except weights (an earlier save's shards or unsharded file,
    which would otherwise load instead of the new weights). On any error `save_directory` is left as it was. Files
    and folders get the umask's permissions."""
    with staged_folder(save_directory) as staging:
        save(staging.path)
        write_remote_code(staging.path)
        staging.commit(keep=lambda name: not WEIGHT_FILE.fullmatch(name))
