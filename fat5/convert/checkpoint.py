"""The converters' core, both ways: read a Hugging Face T5-family checkpoint and map it, tensor by tensor, onto
FAT5 (or a FAT5 checkpoint onto transformers' T5), and carry its config.json fields across.

FAT5 keeps T5's parameter names, so the mapping is mostly the identity; what this module adds is the proof:
every source tensor is either mapped or a known redundant copy (checked equal), every target tensor is filled
with the right shape, and anything else is an error that names the tensor. Tensors are read one at a time
(each safetensors file is opened for one tensor and closed again, so the pages read are released; a
`pytorch_model.bin` is memory-mapped), so peak memory is about one tensor. Every tensor is checked finite.
"""

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from fat5.cli import CommandError, error_line
from fat5.compat_fat5 import release
from fat5.configuration_fat5 import FAT5Config
from fat5.files import pickle_refusal, read_json_object, refused_pickle, safetensors_path
from fat5.modeling_fat5 import FAT5ForConditionalGeneration

SUPPORTED_MODEL_TYPES = ("t5", "mt5", "umt5")
# What each family's config class assumes when config.json omits the key (transformers 4).
TIE_WORD_EMBEDDINGS_DEFAULT = {"t5": True, "mt5": False, "umt5": True}
# Whether the transformers release that wrote a checkpoint multiplies the decoder output by d_model**-0.5 before the
# LM head (the weights were trained or fine-tuned with that choice), as one table: (model types, first writer
# release, first release after, rule), the first matching row wins. Read off each release's T5, mT5 and umT5 code;
# tests/test_convert_versions.py has a test per row. Rules:
#   "tie"     scales exactly when `tie_word_embeddings` (the family's default when config.json omits it)
#   "field"   scales as `scale_decoder_outputs` says (when absent: unless `tie_word_embeddings` is false)
#   "never", "always"   whatever the config says (a `scale_decoder_outputs` that disagrees is refused)
RESCALE_BY_WRITER = (
    (("t5", "mt5", "umt5"), "0", "5.0", "tie"),  # transformers 4.x, or no version recorded
    (("t5",), "5.0", None, "field"),  # T5Config records scale_decoder_outputs (tie_word_embeddings is forced true)
    (("mt5",), "5.0", None, "never"),  # 5.x's mT5 has no rescale
    (("umt5",), "5.0", "5.24", "always"),  # rescales when tie_word_embeddings, which 5.0-5.23 force to true
    (("umt5",), "5.24", None, "field"),  # 5.24 records scale_decoder_outputs, as T5 does
)
# Both directions copy every field of the source config.json (T5's own, transformers' generic ones such as
# `prefix`, `task_specific_params` or `id2label`, and any other key) except these, which the converter writes
# itself: the target's identity and code (and the transformers releases FAT5's code was tested with), the stored
# dtype, the tying and decoder-output rescale (read from the weights and the writing transformers version), and what
# T5 and FAT5 compute from other fields or set per stack.
DERIVED_FIELDS = ("model_type", "architectures", "transformers_version", "auto_map", "custom_pipelines",
                  "_name_or_path", "dtype", "torch_dtype", "is_encoder_decoder", "tie_word_embeddings",
                  "scale_decoder_outputs", "dense_act_fn", "is_gated_act", "is_decoder", "tested_transformers")
# FAT5 fields a transformers T5 ignores (training, the attention backend, captured decode steps, other position
# encodings' parameters): the way back carries those that differ from FAT5's defaults as extra keys, which
# transformers keeps.
FAT5_SETTINGS = ("attention_dropout_rate", "attention_backend", "z_loss", "label_smoothing",
                 "return_logits_in_training", "lm_loss_implementation", "rope_theta", "fire_mlp_width",
                 "fire_init_c", "fire_init_threshold", "alibi_mode", "partial_rotary_factor", "rope_interleaved",
                 "rope_cross_attention", "rope_rotates_values", "fire_normalizer_offset", "fire_normalizer_eps",
                 "decode_cuda_graphs")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# Copies of shared.weight that T5 and FAT5 state dicts name (their saved files hold shared.weight alone).
EMBEDDING_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# transformers' T5 never uses this table (cross-attention has no position bias) and ignores it on load.
UNUSED_SOURCE_TENSORS = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
ARCHITECTURES = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration",
                 "umt5": "UMT5ForConditionalGeneration"}


class ConversionError(CommandError):
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

        if self._index is not None:
            index_name, weight_map = self._index
            for name, file in weight_map.items():
                if self._location.get(name, self.folder / file) != self.folder / file:
                    raise ConversionError(f"{index_name} puts tensor {name} in {file}, but it is in "
                                          f"{self._location[name].name}")
            missing = sorted(set(weight_map) - set(self._location))
            if missing:
                raise ConversionError(f"{index_name} lists tensor {missing[0]}, which no shard holds")
            unlisted = sorted(set(self._location) - set(weight_map))
            if unlisted:
                raise ConversionError(f"{index_name} omits tensor {unlisted[0]}, which "
                                      f"{self._location[unlisted[0]].name} holds")

    def _weight_files(self):
        self._index = None
        for single, index in (("model.safetensors", "model.safetensors.index.json"),
                              ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            if (self.folder / index).is_file():
                weight_map = read_json_object(self.folder / index).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ConversionError(f"{index} has no weight_map object")
                bad = [name for name, file in weight_map.items() if not isinstance(file, str) or "/" in file]
                if bad:
                    raise ConversionError(f"{index}: weight_map[{bad[0]!r}] is not a shard file name")
                files = [self.folder / name for name in sorted(set(weight_map.values()))]
                missing = [file.name for file in files if not file.is_file()]
                if missing:
                    raise ConversionError(f"{index} lists missing shard(s): {', '.join(missing)}")
                self._index = (index, weight_map)
                return files
            if (self.folder / single).is_file():
                return [self.folder / single]
        raise ConversionError(f"no weights in {self.folder}: expected model.safetensors, pytorch_model.bin "
                              "or their sharded index")

    def _open(self, file):
        if file not in self._handles:
            path = safetensors_path(file) if file.suffix == ".safetensors" else file
            try:
                if file.suffix == ".safetensors":
                    self._handles[file] = safe_open(path, framework="pt")
                else:
                    # mmap: tensors are read from disk only when touched.
                    self._handles[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # safetensors and torch raise several unrelated types for bad files
                if refused_pickle(error) is not None:
                    raise pickle_refusal(file.name, error) from None
                raise ConversionError(f"cannot read {file.name}: corrupt or truncated weights "
                                      f"({error_line(error)})") from error
            if isinstance(self._handles[file], dict):
                entries = self._handles[file].items()
                odd = next((name for name, value in entries if not isinstance(value, torch.Tensor)), None)
                if odd is not None:
                    raise ConversionError(f"{file.name} holds {odd!r}, which is not a tensor: not a state dict")
            elif not isinstance(self._handles[file], safe_open):
                raise ConversionError(f"{file.name} is not a state dict")
        return self._handles[file]

    def release(self, name):
        """Forget the pages of `name`'s file: reopening a safetensors file per tensor unmaps the previous
        tensor's pages, and the page cache is told it may drop them, so memory stays about one tensor."""
        file = self._location[name]
        if file.suffix == ".safetensors" and file in self._handles:
            del self._handles[file]
            if hasattr(os, "posix_fadvise"):
                descriptor = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(descriptor)

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
            raise ConversionError(f"cannot read tensor {name}: corrupt or truncated weights "
                                  f"({error_line(error)})") from error


@dataclass
class ConversionPlan:
    """Everything decided before any tensor data is read."""

    source: TensorSource
    config: object  # FAT5Config (T5 -> FAT5), or the T5 config.json dict (FAT5 -> T5)
    source_config: dict
    mapping: dict  # target name -> source name
    redundant: dict = field(default_factory=dict)  # source copy -> the source tensor it must equal
    ignored: list = field(default_factory=list)  # source tensors T5 itself never uses
    shapes: dict = field(default_factory=dict)  # target name -> shape
    # (folder, dtype) -> the source model the parity proof compares with; None: transformers' (load_source_model)
    load_reference: object = None


def rescale_rule(model_type, writer_version):
    """The RESCALE_BY_WRITER rule of `model_type` as transformers `writer_version` computes it."""
    writer = release(writer_version)[:3]
    for model_types, first, after, rule in RESCALE_BY_WRITER:
        if model_type in model_types and release(first)[:3] <= writer and (after is None
                                                                             or writer < release(after)[:3]):
            return rule
    raise ConversionError(f"no rescale rule for model_type {model_type!r} written by transformers {writer_version}")


def scales_decoder_output(source_config):
    """Whether the transformers version that wrote the checkpoint (config.json's `transformers_version`; 4.x when
    absent) multiplies the decoder output by d_model**-0.5 before the LM head (RESCALE_BY_WRITER)."""
    model_type = source_config["model_type"]
    writer = str(source_config.get("transformers_version", "4"))
    rule = rescale_rule(model_type, writer)
    tied = source_config.get("tie_word_embeddings", TIE_WORD_EMBEDDINGS_DEFAULT[model_type])
    recorded = source_config.get("scale_decoder_outputs")
    if rule == "field":
        return bool(tied is not False if recorded is None else recorded)
    scales = {"tie": bool(tied), "never": False, "always": True}[rule]
    if recorded is not None and bool(recorded) != scales:
        raise ConversionError(f"config.json says scale_decoder_outputs={recorded!r}, but the transformers {writer} "
                              f"that wrote it ignores that field in {model_type} and "
                              f"{'scales' if scales else 'does not scale'} the decoder output; remove the field, or "
                              "correct transformers_version to the release the weights were trained with")
    return scales


def t5_computes(model_type):
    """FAT5 fields that change the logits and that no transformers T5 config has: the value `model_type`
    computes with. A FAT5 model converts back only with these values; a T5 config.json that names one of these
    keys (transformers ignores it) must agree."""
    return {"position_encoding_type": "t5", "relative_bias_per_layer": model_type == "umt5", "attention_scale": 1.0}


def carried_fields(source_config, model_type):
    """The fields of `source_config` the other side takes unchanged: every one but DERIVED_FIELDS and those of
    `t5_computes`, which must hold the value T5 computes with."""
    computed = t5_computes(model_type)
    if source_config.get("pruned_heads"):
        raise ConversionError(f"pruned_heads {source_config['pruned_heads']!r}: FAT5 has no head pruning")
    for name, value in source_config.items():
        if name in computed and value != computed[name]:
            raise ConversionError(f"{name} {value!r} has no transformers T5 counterpart: a {model_type} computes "
                                  f"with {name}={computed[name]!r}")
    return {name: value for name, value in source_config.items()
            if name not in DERIVED_FIELDS and name not in computed}


def fat5_config_from_t5(source_config, lm_head_tied):
    """FAT5Config for a T5 / mT5 / umT5 config dict, with every field it carries; `lm_head_tied` comes from the
    weights themselves, the output rescale from what the transformers version that wrote config.json does."""
    model_type = source_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"unsupported model_type {model_type!r}: supported are "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} (FLAN-T5, T5 v1.1 and ByT5 are model_type t5); "
                              "python -m convert.flan_to_fat5 also converts flash_t5 (flashT5's layout, CATIE-AQ's "
                              "FAT5 models)")
    try:
        return FAT5Config(
            **carried_fields(source_config, model_type),
            **t5_computes(model_type),
            tie_word_embeddings=lm_head_tied,
            scale_decoder_outputs=scales_decoder_output(source_config),
            architectures=["FAT5ForConditionalGeneration"],
        )
    except (ValueError, TypeError) as error:
        raise ConversionError(f"inconsistent source config: {error_line(error)}") from error


def t5_config_from_fat5(fat5_config, model_type, tied):
    """The config.json dict of the transformers checkpoint for a FAT5 config dict: every field carried, the
    FAT5 settings a T5 ignores kept where they differ from FAT5's defaults, `model_type` (default: umt5 for a
    bias table per layer, else t5) checked to compute what FAT5 computes."""
    import transformers

    try:
        config = FAT5Config.from_dict(fat5_config)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"invalid FAT5 config: {error_line(error)}") from error
    if config.position_encoding_type != "t5":
        raise ConversionError(f"position_encoding_type {config.position_encoding_type!r} has no transformers T5 "
                              "counterpart: only FAT5 models with T5's relative bias (\"t5\") convert back")
    per_layer = config.relative_bias_per_layer
    model_type = model_type or ("umt5" if per_layer else "t5")
    if per_layer != (model_type == "umt5"):
        raise ConversionError(f"--model-type {model_type} does not match the model: "
                              f"{'a' if per_layer else 'no'} bias table per layer means umt5"
                              + ("" if per_layer else " is impossible"))
    fields = carried_fields(fat5_config, model_type)
    defaults = FAT5Config(dropout_rate=config.dropout_rate)  # attention dropout defaults to dropout_rate
    for name in FAT5_SETTINGS:
        # (null: a setting left to its default, such as attention_dropout_rate's dropout_rate)
        if name in fields and fields[name] in (None, getattr(defaults, name)):
            del fields[name]
    scale = config.scale_decoder_outputs
    fields.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]], tie_word_embeddings=tied,
                  transformers_version=transformers.__version__, is_encoder_decoder=True)
    if rescale_rule(model_type, transformers.__version__) == "field":
        fields["scale_decoder_outputs"] = scale
    if scales_decoder_output(fields) != scale:
        raise ConversionError(f"transformers {transformers.__version__}'s {model_type} cannot express this model: "
                              f"it {'does not scale' if scale else 'scales'} the decoder output "
                              f"{'but ties' if tied else 'and does not tie'} the LM head (try --model-type t5 or "
                              "transformers 4.x)")
    return fields


def model_shapes(model, tied):
    """Target tensor names and shapes of a model built on the meta device, without the copies of the
    embedding a T5 state dict repeats, a tied LM head, and tables T5 never uses."""
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()
            if name not in EMBEDDING_COPIES and not (tied and name == "lm_head.weight")
            and not name.endswith("EncDecAttention.relative_attention_bias.weight")}


def check_tensors(source, shapes, labels, redundant=None, unused=()):
    """Prove the plan complete: every target tensor of `shapes` is in `source` with that shape, and every
    source tensor is either a target tensor, a copy (`redundant`: copy -> original, same shape) or `unused`.
    `labels` is (source family, target family) for the messages."""
    redundant = redundant or {}
    names = set(source.names())
    source_label, target_label = labels
    missing = sorted(set(shapes) - names)
    if missing:
        raise ConversionError(f"{source_label} checkpoint lacks {len(missing)} tensor(s) {target_label} needs, "
                              f"e.g. {missing[0]}")
    unexpected = sorted(names - set(shapes) - set(redundant) - set(unused))
    if unexpected:
        raise ConversionError(f"{source_label} tensor {unexpected[0]} has no {target_label} counterpart "
                              f"({len(unexpected)} unmapped in total)")
    for name, shape in shapes.items():
        if source.shape(name) != shape:
            raise ConversionError(f"tensor {name} has shape {source.shape(name)}, the config implies {shape}")
    for copy, original in redundant.items():
        if source.shape(copy) != source.shape(original):
            raise ConversionError(f"{copy} should be a copy of {original} but has another shape")
    return {name: name for name in shapes}  # FAT5 keeps T5's parameter names


def read_config(folder):
    folder = Path(folder)
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a directory")
    if not (folder / "config.json").exists():
        raise ConversionError(f"{folder} has no config.json")
    return read_json_object(folder / "config.json")


def plan_conversion(folder):
    """T5 -> FAT5: read config.json and the tensor index of `folder`, decide the mapping, and check it."""
    source_config = read_config(folder)
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
    try:
        with torch.device("meta"):
            shapes = model_shapes(FAT5ForConditionalGeneration(config), config.tie_word_embeddings)
    except ValueError as error:  # e.g. transformers 4 validating the generation fields of config.json
        raise ConversionError(f"inconsistent source config: {error_line(error)}") from error
    unused = [name for name in UNUSED_SOURCE_TENSORS if name in names]
    mapping = check_tensors(source, shapes, ("source", "FAT5"), redundant, unused)
    return ConversionPlan(source=source, config=config, source_config=source_config, mapping=mapping,
                          redundant=redundant, ignored=unused, shapes=shapes)


def plan_back_conversion(folder, model_type=None):
    """FAT5 -> transformers T5: the plan from a FAT5 folder to the tensors of `model_type` (the same names),
    checked complete; `plan.config` is the T5 config.json dict."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    fat5_config = read_config(folder)
    if fat5_config.get("model_type") != "fat5":
        raise ConversionError(f"{folder} is not a FAT5 checkpoint (config.json model_type "
                              f"{fat5_config.get('model_type')!r})")
    source = TensorSource(folder)
    tied = "lm_head.weight" not in source.names()
    config = t5_config_from_fat5(fat5_config, model_type, tied)
    floating = [source.dtype(name) for name in source.names() if source.dtype(name).is_floating_point]
    if floating:
        config["dtype"] = str(floating[0]).removeprefix("torch.")
    fields = {key: value for key, value in config.items() if key not in ("architectures", "transformers_version")}
    with torch.device("meta"):
        shapes = model_shapes(AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(**fields)), tied)
    mapping = check_tensors(source, shapes, ("FAT5", config["model_type"]))
    return ConversionPlan(source=source, config=config, source_config=fat5_config, mapping=mapping, shapes=shapes)


def iter_converted_tensors(plan, dtype=None, allow_non_finite=False):
    """Yield (FAT5 name, tensor) one at a time, each checked finite (after the cast to `dtype`, which can
    overflow); check each redundant copy against its original first."""
    for copy, original in plan.redundant.items():
        if not torch.equal(plan.source.get(copy), plan.source.get(original)):
            raise ConversionError(f"{copy} differs from {original}: the checkpoint is not a tied T5")
        plan.source.release(copy)
    for target_name, source_name in plan.mapping.items():
        tensor = plan.source.get(source_name)
        plan.source.release(source_name)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if not allow_non_finite and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            cast = f" after the cast to {str(tensor.dtype).removeprefix('torch.')}" if dtype is not None else ""
            raise ConversionError(f"tensor {source_name} has NaN or infinite values{cast} "
                                  "(--allow-non-finite converts it anyway)")
        yield target_name, tensor.contiguous()


def convert_checkpoint(folder, dtype=None):
    """(FAT5Config, state dict) for a local T5-family checkpoint folder. Holds the whole model in memory;
    the exporter streams `iter_converted_tensors` instead."""
    plan = plan_conversion(folder)
    return plan.config, dict(iter_converted_tensors(plan, dtype))


@contextlib.contextmanager
def untied_warning_silenced():
    """transformers 5 forces tie_word_embeddings=True on T5 configs (and writes it into the configs it saves, an untied
    FLAN-T5's included), then warns, loading a checkpoint whose LM head differs from its embedding, that it "will NOT
    tie" them; it does not, which is right, and the converters decided the tying from the weights themselves
    (`plan_conversion`, `plan_back_conversion`). Drop that one warning while a converter loads a T5 (the source, or
    the folder it wrote): transformers' logger is filtered for that message only, and only inside the block."""
    import logging

    def drop(record):
        return "NOT tie" not in record.getMessage()

    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def load_source_model(folder, dtype=None):
    """The transformers model of a T5-family checkpoint folder, in eval mode: the reference FAT5 must match.

    The installed transformers may scale the decoder output differently from the version that wrote the
    checkpoint (transformers 5's mT5 never does, its umT5 always does); the scale is applied here as the writer
    did, in a hook before the LM head, after turning the installed model's own choice off.
    """
    from transformers import AutoModelForSeq2SeqLM

    source_config = read_json_object(Path(folder) / "config.json")
    with untied_warning_silenced():
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=dtype).eval()
    # Read only by the output rescale once the weights are loaded (and tied).
    model.config.tie_word_embeddings = False
    model.config.scale_decoder_outputs = False
    if scales_decoder_output(source_config):
        factor = model.config.d_model**-0.5
        model.lm_head.register_forward_pre_hook(lambda module, args: (args[0] * factor, *args[1:]))
    return model
