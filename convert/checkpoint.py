"""Read a Hugging Face T5-family checkpoint and map it, tensor by tensor, onto FAT5.

FAT5 keeps T5's parameter names, so the mapping is mostly the identity; what this module adds is the proof:
every source tensor is either mapped or a known redundant copy (checked equal), every target tensor is filled
with the right shape, and anything else is an error that names the tensor. Tensors are read one at a time
(safetensors slices, or a memory-mapped `pytorch_model.bin`), so peak memory is about one tensor.
"""

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from fat5.configuration_fat5 import FAT5Config
from fat5.modeling_fat5 import FAT5ForConditionalGeneration

SUPPORTED_MODEL_TYPES = ("t5", "mt5", "umt5")
# What each family's config class assumes when config.json omits the key.
TIE_WORD_EMBEDDINGS_DEFAULT = {"t5": True, "mt5": False, "umt5": True}
# T5 config fields FAT5 takes over unchanged.
COPIED_FIELDS = (
    "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
    "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate", "layer_norm_epsilon",
    "initializer_factor", "feed_forward_proj", "pad_token_id", "eos_token_id", "decoder_start_token_id",
    "classifier_dropout", "use_cache",
)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
EMBEDDING_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# transformers' T5 never uses this table (cross-attention has no position bias) and ignores it on load.
UNUSED_SOURCE_TENSORS = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


class ConversionError(Exception):
    """A checkpoint that cannot be converted faithfully; the message names the culprit."""


class TensorSource:
    """Lazy access to the tensors of a checkpoint folder: names and shapes without reading data."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self._location = {}  # tensor name -> file
        self._handles = {}
        for file in self._weight_files():
            for name in self._open(file).keys():
                if name in self._location:
                    raise ConversionError(f"tensor {name} appears in both {self._location[name].name} and {file.name}")
                self._location[name] = file

    def _weight_files(self):
        for single, index in (("model.safetensors", "model.safetensors.index.json"),
                              ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            if (self.folder / index).is_file():
                weight_map = _read_json(self.folder / index).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ConversionError(f"{self.folder / index} has no weight_map")
                files = [self.folder / name for name in sorted(set(weight_map.values()))]
                missing = [file.name for file in files if not file.is_file()]
                if missing:
                    raise ConversionError(f"{index} lists missing shard(s): {', '.join(missing)}")
                return files
            if (self.folder / single).is_file():
                return [self.folder / single]
        raise ConversionError(f"no weights in {self.folder}: expected model.safetensors, pytorch_model.bin "
                              "or their sharded index")

    def _open(self, file):
        if file not in self._handles:
            try:
                if file.suffix == ".safetensors":
                    self._handles[file] = safe_open(str(file), framework="pt")
                else:
                    # mmap: tensors are read from disk only when touched.
                    self._handles[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # safetensors and torch raise several unrelated types for bad files
                raise ConversionError(f"cannot read {file.name}: corrupt or truncated weights ({error})") from error
        return self._handles[file]

    def names(self):
        return list(self._location)

    def shape(self, name):
        handle = self._open(self._location[name])
        if isinstance(handle, dict):
            return tuple(handle[name].shape)
        return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name):
        handle = self._open(self._location[name])
        if isinstance(handle, dict):
            return handle[name].dtype
        return SAFETENSORS_DTYPES[handle.get_slice(name).get_dtype()]

    def get(self, name):
        handle = self._open(self._location[name])
        try:
            tensor = handle[name] if isinstance(handle, dict) else handle.get_tensor(name)
            return tensor.clone() if isinstance(handle, dict) else tensor
        except Exception as error:  # reading past a truncated file raises from the safetensors/torch backends
            raise ConversionError(f"cannot read tensor {name}: corrupt or truncated weights ({error})") from error


@dataclass
class ConversionPlan:
    """Everything decided before any tensor data is read."""

    source: TensorSource
    config: FAT5Config
    source_config: dict
    mapping: dict  # target name -> source name
    redundant: dict = field(default_factory=dict)  # source copy -> the source tensor it must equal
    ignored: list = field(default_factory=list)  # source tensors T5 itself never uses
    shapes: dict = field(default_factory=dict)  # target name -> shape


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from error


def fat5_config_from_t5(source_config, lm_head_tied):
    """FAT5Config for a T5 / mT5 / umT5 config dict; `lm_head_tied` comes from the weights themselves."""
    model_type = source_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"unsupported model_type {model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)} "
                              "(FLAN-T5, T5 v1.1 and ByT5 are model_type t5)")
    fields = {name: source_config[name] for name in COPIED_FIELDS if source_config.get(name) is not None}
    # transformers 5 writes the v1.0 rescale explicitly (and forces tie_word_embeddings=True in the config);
    # otherwise T5 rescales exactly when the LM head is the embedding.
    scale = source_config.get("scale_decoder_outputs", lm_head_tied)
    try:
        return FAT5Config(
            **fields,
            tie_word_embeddings=lm_head_tied,
            scale_decoder_outputs=scale,
            position_encoding_type="t5",
            relative_bias_per_layer=model_type == "umt5",
            architectures=["FAT5ForConditionalGeneration"],
        )
    except ValueError as error:
        raise ConversionError(f"inconsistent source config: {error}") from error


def plan_conversion(folder):
    """Read config.json and the tensor index of `folder`, decide the mapping, and check it completely."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a directory")
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} has no config.json")
    source_config = _read_json(folder / "config.json")
    if source_config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        fat5_config_from_t5(source_config, True)  # raises the unsupported-type error
    source = TensorSource(folder)
    names = set(source.names())

    if "shared.weight" not in names:
        raise ConversionError("source checkpoint has no shared.weight (the token embedding)")
    redundant = {name: "shared.weight" for name in EMBEDDING_COPIES if name in names}
    lm_head_tied = "lm_head.weight" not in names
    tied_in_config = source_config.get("tie_word_embeddings",
                                       TIE_WORD_EMBEDDINGS_DEFAULT.get(source_config["model_type"], True))
    if not lm_head_tied and tied_in_config:
        # A tied checkpoint that still stores the head: it is a copy only if it equals the embedding.
        lm_head_tied = torch.equal(source.get("lm_head.weight"), source.get("shared.weight"))
        if lm_head_tied:
            redundant["lm_head.weight"] = "shared.weight"
    config = fat5_config_from_t5(source_config, lm_head_tied)

    with torch.device("meta"):
        target = FAT5ForConditionalGeneration(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in target.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)

    unused = [name for name in UNUSED_SOURCE_TENSORS if name in names]
    mapping = {name: name for name in shapes}
    missing = sorted(name for name in mapping if name not in names)
    if missing:
        raise ConversionError(f"source checkpoint lacks {len(missing)} tensor(s) FAT5 needs, e.g. {missing[0]}")
    unexpected = sorted(names - set(mapping) - set(redundant) - set(unused))
    if unexpected:
        raise ConversionError(f"source tensor {unexpected[0]} has no FAT5 counterpart "
                              f"({len(unexpected)} unmapped in total)")
    for name, shape in shapes.items():
        if source.shape(name) != shape:
            raise ConversionError(f"tensor {name} has shape {source.shape(name)}, the config implies {shape}")
    for copy, original in redundant.items():
        if source.shape(copy) != source.shape(original):
            raise ConversionError(f"{copy} should be a copy of {original} but has another shape")
    return ConversionPlan(source=source, config=config, source_config=source_config, mapping=mapping,
                          redundant=redundant, ignored=unused, shapes=shapes)


def iter_converted_tensors(plan, dtype=None):
    """Yield (FAT5 name, tensor) one at a time; check each redundant copy against its original first."""
    for copy, original in plan.redundant.items():
        if not torch.equal(plan.source.get(copy), plan.source.get(original)):
            raise ConversionError(f"{copy} differs from {original}: the checkpoint is not a tied T5")
    for target_name, source_name in plan.mapping.items():
        tensor = plan.source.get(source_name)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield target_name, tensor.contiguous()


def convert_checkpoint(folder, dtype=None):
    """(FAT5Config, state dict) for a local T5-family checkpoint folder. Holds the whole model in memory;
    the exporter streams `iter_converted_tensors` instead."""
    plan = plan_conversion(folder)
    return plan.config, dict(iter_converted_tensors(plan, dtype))


@contextlib.contextmanager
def _expected_untied_warning_silenced(source_config):
    """transformers 5 forces tie_word_embeddings=True on T5 configs, then warns that an untied checkpoint (FLAN-T5,
    mT5) "will NOT tie"; it does not, which is right. Drop that one warning when config.json says untied."""
    import logging

    def drop(record):
        return "NOT tie" not in record.getMessage()

    logger = logging.getLogger("transformers.modeling_utils")
    untied = source_config.get("tie_word_embeddings") is False
    if untied:
        logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def load_source_model(folder, dtype=None):
    """The transformers model of a T5-family checkpoint folder, in eval mode: the reference FAT5 must match."""
    from transformers import AutoModelForSeq2SeqLM

    source_config = _read_json(Path(folder) / "config.json")
    with _expected_untied_warning_silenced(source_config):
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=dtype).eval()
    if source_config["model_type"] == "umt5":
        # transformers 5 forces tie_word_embeddings=True for UMT5 and then rescales the decoder output of
        # untied checkpoints; umT5 itself (and transformers 4) does not. Restore the checkpoint's flag.
        model.config.tie_word_embeddings = source_config.get("tie_word_embeddings",
                                                             TIE_WORD_EMBEDDINGS_DEFAULT["umt5"])
    return model
