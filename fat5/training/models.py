"""The model to pretrain: a new FAT5 from a T5 v1.1 preset or a config file, or a FAT5 checkpoint to continue."""

import json
from pathlib import Path

from fat5 import FAT5Config, FAT5ForConditionalGeneration

from .data import PretrainError

# T5 v1.1 shapes (gated-GELU, untied LM head); dropout off for pretraining, as nanoT5 and FAT5 do.
T5_V1_1 = dict(d_kv=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
PRESETS = {
    "small": dict(T5_V1_1, d_model=512, d_ff=1024, num_heads=6, num_layers=8),
    "base": dict(T5_V1_1, d_model=768, d_ff=2048, num_heads=12, num_layers=12),
    "large": dict(T5_V1_1, d_model=1024, d_ff=2816, num_heads=16, num_layers=24),
}
# Keys of a config.json that describe the file, not the model.
NOT_MODEL_FIELDS = ("model_type", "architectures", "auto_map", "custom_pipelines", "transformers_version", "dtype",
                    "torch_dtype", "_name_or_path")


def _read_config_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PretrainError(f"cannot read the model config {path}: {error}") from None


def new_model(config, tokenizer, z_loss):
    """A randomly initialised FAT5 from a preset name or a config.json (a file, or a folder holding one), with its
    vocabulary sized for `tokenizer` (rounded up to a multiple of 128) and T5's special ids from it."""
    if config in PRESETS:
        fields = dict(PRESETS[config])
    else:
        path = Path(config)
        fields = _read_config_json(path / "config.json" if path.is_dir() else path)
        for key in NOT_MODEL_FIELDS:
            fields.pop(key, None)
    fields.update(vocab_size=-(-len(tokenizer) // 128) * 128, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    if z_loss is not None:
        fields["z_loss"] = z_loss
    try:
        return FAT5ForConditionalGeneration(FAT5Config(**fields))
    except (TypeError, ValueError) as error:
        raise PretrainError(f"bad model config {config}: {error}") from None


def load_checkpoint(folder, z_loss):
    """A FAT5 checkpoint folder (converted, or saved by this command) to continue pretraining, loaded with the
    installed FAT5 code (so training uses this version's kernels and packing). Anything else is an error."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise PretrainError(f"{folder} is not a model folder (no config.json)")
    model_type = _read_config_json(config_file).get("model_type")
    if model_type != FAT5Config.model_type:
        raise PretrainError(f"{folder} is not a FAT5 checkpoint (model_type {model_type!r}); convert it first: "
                            f"python -m convert.flan_to_fat5 {folder} OUT")
    model = FAT5ForConditionalGeneration.from_pretrained(folder)
    if z_loss is not None:
        model.config.z_loss = z_loss
    return model


def fit_embeddings(model, tokenizer):
    """Grows the embeddings (and LM head) when the tokenizer has more tokens than the model has rows, rounding to
    a multiple of 128; new rows get transformers' mean-initialisation."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=128)
