"""The model to pretrain: a new FAT5 from a T5 v1.1 preset or a config file, or a FAT5 checkpoint to continue."""

from pathlib import Path

import fat5
from fat5.cli import CommandError, error_line
from fat5.files import check_model_folder, pickles_refused, read_json_object

# T5 v1.1 shapes (gated-GELU, untied LM head); dropout off for pretraining, as nanoT5 and FAT5 do.
T5_V1_1 = dict(d_kv=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
PRESETS = {
    # To try the command on CPU (docs/pretraining.md): on the sample corpus, 1.2M parameters whose loss falls from
    # about 20 to 2 in 30 steps.
    "tiny": dict(T5_V1_1, d_model=128, d_kv=32, d_ff=512, num_heads=4, num_layers=2),
    "small": dict(T5_V1_1, d_model=512, d_ff=1024, num_heads=6, num_layers=8),
    "base": dict(T5_V1_1, d_model=768, d_ff=2048, num_heads=12, num_layers=12),
    "large": dict(T5_V1_1, d_model=1024, d_ff=2816, num_heads=16, num_layers=24),
}
# Keys of a config.json that describe the file, not the model.
NOT_MODEL_FIELDS = ("model_type", "architectures", "auto_map", "custom_pipelines", "transformers_version", "dtype",
                    "torch_dtype", "_name_or_path")


def model_fields(config):
    """The config fields of a new model from a preset name or a config.json (a file, or a folder holding one),
    checked by building the config (so a bad one is refused before anything is trained)."""
    if config in PRESETS:
        fields = dict(PRESETS[config])
    else:
        path = Path(config)
        fields = read_json_object(path / "config.json" if path.is_dir() else path, "the model config ")
        for key in NOT_MODEL_FIELDS:
            fields.pop(key, None)
    _config(fields, config)
    return fields


def _config(fields, name):
    try:
        return fat5.FAT5Config(**fields)
    except (TypeError, ValueError) as error:
        raise CommandError(f"bad model config {name}: {error_line(error)}") from None


def new_model(config, tokenizer, z_loss):
    """A randomly initialised FAT5 from `model_fields(config)`, with its vocabulary sized for `tokenizer` (rounded
    up to a multiple of 128) and T5's special ids from it."""
    fields = model_fields(config)
    fields.update(vocab_size=-(-len(tokenizer) // 128) * 128, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    if z_loss is not None:
        fields["z_loss"] = z_loss
    return fat5.FAT5ForConditionalGeneration(_config(fields, config))


def checkpoint_config(folder):
    """The config.json of a FAT5 checkpoint folder to continue pretraining (converted, or saved by this
    command); anything else is an error."""
    config_file = Path(folder) / "config.json"
    if not config_file.exists():
        raise CommandError(f"{folder} is not a model folder (no config.json)")
    check_model_folder(folder)  # before transformers and the tokenizer read them
    config = read_json_object(config_file)
    model_type = config.get("model_type")
    if model_type != fat5.FAT5Config.model_type:
        raise CommandError(f"{folder} is not a FAT5 checkpoint (model_type {model_type!r}); convert it first: "
                           f"python -m convert.flan_to_fat5 {folder} OUT")
    return config


def load_checkpoint(folder, z_loss, allow_non_finite=False):
    """The checkpoint `checkpoint_config` accepted, loaded with the installed FAT5 code (so training uses this
    version's kernels and packing); one with a NaN or infinite weight is refused unless `allow_non_finite`."""
    from .finite import check_finite_weights

    checkpoint_config(folder)
    with pickles_refused(f"the weights file of {folder}"):
        model = fat5.FAT5ForConditionalGeneration.from_pretrained(folder)
    if not allow_non_finite:
        check_finite_weights(model, f"--model_name_or_path {folder}")
    if z_loss is not None:
        model.config.z_loss = z_loss
    return model


def fit_embeddings(model, tokenizer):
    """Grows the embeddings (and LM head) when the tokenizer has more tokens than the model has rows, rounding to
    a multiple of 128; new rows get transformers' mean-initialisation."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=128)


def check_checkpoint_shapes(model, checkpoint):
    """Refuse to resume from a checkpoint whose weights do not fit `model` (another config, preset or vocabulary):
    compares the shapes in its safetensors headers with the model's, before Trainer loads anything."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("model*.safetensors"))
    if not files:
        return  # not saved as safetensors: Trainer's own loading reports it
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    for file in files:
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():
                shape = tuple(weights.get_slice(name).get_shape())
                if name in expected and shape != expected[name]:
                    raise CommandError(
                        f"--resume_from_checkpoint {checkpoint} holds a model of another shape ({name} is "
                        f"{list(shape)} there, {list(expected[name])} in this run's model): resume with the flags "
                        f"it was trained with")
                if name not in expected:
                    raise CommandError(f"--resume_from_checkpoint {checkpoint} holds a weight this run's model "
                                       f"lacks ({name}): resume with the flags it was trained with")
