"""What makes a folder a FAT5 package: FAT5's code flat beside `config.json`, `auto_map` and the text2text
pipeline entry. One definition, used by every `save_pretrained` route and by the converter's export.

This module is itself part of the remote code: a model loaded from a checkpoint folder saves a complete package
from the copy of the code transformers loaded it from.
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
# Weight shards (and their index) of an earlier save that a new save no longer writes, as transformers removes them.
SHARD_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5}\.(safetensors|bin)|\.(safetensors|bin)\.index\.json)")


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
    """Set the config fields that make a saved folder load through the Auto classes and the pipeline.
    `encoder_only`: the folder holds no decoder weights (an encoder-only class saved it), so its base model,
    `AutoModel` (what sentence-transformers loads), is the encoder."""
    config.auto_map = dict(AUTO_MAP)
    if encoder_only:
        config.auto_map["AutoModel"] = AUTO_MAP["AutoModelForTextEncoding"]
    config.custom_pipelines = custom_pipelines_entry()


def save_as_package(save, save_directory):
    """Call `save(staging_folder)` (transformers' save_pretrained), add FAT5's code, then move the result into
    `save_directory`. On any error `save_directory` is left as it was: no partial folder, no partial package."""
    target = Path(save_directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        save(staging)
        write_remote_code(staging)
        if not target.exists():
            staging.rename(target)  # same filesystem: atomic
            return
        new_files = {path.name for path in staging.iterdir()}
        for name in new_files:
            os.replace(staging / name, target / name)
        for path in target.iterdir():
            if SHARD_FILE.fullmatch(path.name) and path.name not in new_files:
                path.unlink()  # a shard of an earlier save, as transformers removes it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
