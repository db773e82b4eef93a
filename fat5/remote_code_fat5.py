"""What makes a folder a FAT5 package: FAT5's code flat beside `config.json`, `auto_map` and the text2text
pipeline entry. One definition, used by every `save_pretrained` route and by the converter's export.

This module is itself part of the remote code: a model loaded from a checkpoint folder saves a complete package
from the copy of the code transformers loaded it from. Where FAT5 is installed, a save is staged and put in place
whole by `fat5/safe_files.py` (not shipped); where it is not, it is written in place as transformers writes it.
(This lives here rather than in its own module because transformers 4.57 copies into its module cache only the
modules that the model file imports itself.)
"""

import re
from pathlib import Path

CODE_DIR = Path(__file__).resolve().parent
# The files a checkpoint folder holds: the model's code, flat (tests/test_package_layout.py checks that this is the
# closure of the modules a checkpoint loads by name, and that their relative imports stay within it).
SHIPPED_FILES = (
    "attention_fat5.py", "attention_guard_fat5.py", "attention_positions_fat5.py", "attention_select_fat5.py",
    "compat_fat5.py", "configuration_fat5.py", "custom_ops_fat5.py", "generation_fat5.py", "integrations_fat5.py",
    "loss_fat5.py", "modeling_fat5.py", "peft_fat5.py", "pickling_fat5.py", "pipeline_fat5.py", "reference_fat5.py",
    "remote_code_fat5.py",
    # kernels/ in the installed package
    "decode_attention_t5.py", "feed_forward.py", "flash_attention_t5.py", "residual_rms_norm.py", "rms_norm.py",
    "t5_bias.py",
)
# In the installed package kernels live in kernels/ (imported by the model as `.kernels.NAME`, and importing the
# model's modules as `..NAME`); transformers resolves only same-folder imports, so checkpoints hold them flat.
NESTED_IMPORT = re.compile(r"^(\s*from\s+)(?:\.kernels\.|\.\.)(\w+\s+import\b)", re.MULTILINE)
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


def remote_code_files():
    """{flat file name: source path} of SHIPPED_FILES, from the installed package (kernels in kernels/) or from a
    flat checkpoint copy alike."""
    files = {}
    for name in SHIPPED_FILES:
        path = CODE_DIR / name
        files[name] = path if path.is_file() else CODE_DIR / "kernels" / name
    return files


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


def save_as_package(save, save_directory, staged_folder=None):
    """Call `save(folder)` (transformers' save_pretrained) and add FAT5's code. With `staged_folder`
    (fat5/safe_files.py's StagedFolder, where FAT5 is installed) into a staging folder then put at `save_directory`
    whole: on any error `save_directory` is left as it was; files of the old folder that the new save does not write
    are kept, except weights. Without it, in place as transformers saves. Either way an earlier save's weight files
    (shards or an unsharded file, which would otherwise load instead of the new weights) are not kept."""
    if staged_folder is None:
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():
            if WEIGHT_FILE.fullmatch(entry.name) and entry.is_file():
                entry.unlink()
        save(folder)
        write_remote_code(folder)
        return
    with staged_folder(save_directory) as staging:
        save(staging.path)
        write_remote_code(staging.path)
        staging.commit(keep=lambda name: not WEIGHT_FILE.fullmatch(name))
