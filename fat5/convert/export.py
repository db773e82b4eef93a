"""Write a converted checkpoint as a self-contained Hub repo folder, atomically, and prove its parity."""

import json
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import GenerationConfig, PretrainedConfig

from fat5.cli import CommandError, error_line, write_failures_reported
from fat5.convert.checkpoint import SAFETENSORS_DTYPES, iter_converted_tensors
from fat5.convert.hub import render_model_card, task_example
from fat5.convert.parity import verify_parity
from fat5.files import check_model_folder, holds_tokenizer, printable, read_text
from fat5.remote_code_fat5 import mark_as_package, write_remote_code

TOKENIZER_FILES = ("spiece.model", "sentencepiece.bpe.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json")
SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


class ExportError(CommandError):
    """The output folder cannot be written or fails its checks; the message says why."""


def parse_size(size):
    """'5GB' / '500MB' / '20KB' / bytes as int -> bytes (decimal units, as transformers' max_shard_size)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ExportError(f"--max-shard-size {size!r} is not a size such as 5GB, 500MB or 20000")
    units = {None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(float(match.group(1)) * units[match.group(2).upper() if match.group(2) else None])


def _shard_names(count):
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_safetensors_streaming(plan, folder, dtype, max_shard_size, allow_non_finite=False):
    """Write the converted tensors as (sharded) safetensors, one tensor in memory at a time.

    safetensors' own writer takes a whole dict of tensors; its file format is simple enough (a JSON header of
    names, dtypes, shapes and byte offsets, then raw bytes) to write incrementally once shapes are known.
    """
    entries = []
    for name in plan.mapping:
        source_dtype = plan.source.dtype(plan.mapping[name])
        out_dtype = dtype if dtype is not None and source_dtype.is_floating_point else source_dtype
        shape = plan.shapes[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=out_dtype).element_size()
        entries.append((name, out_dtype, shape, size))
    shards, current, current_size = [], [], 0
    for entry in entries:
        if current and current_size + entry[3] > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(entry)
        current_size += entry[3]
    shards.append(current)
    names = _shard_names(len(shards))
    weight_map = {}
    tensors = iter_converted_tensors(plan, dtype, allow_non_finite)
    with tqdm(total=len(entries), desc="Converting tensors", unit="tensor") as progress:
        for shard, file_name in zip(shards, names, strict=True):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, out_dtype, shape, size in shard:
                header[name] = {"dtype": SAFETENSORS_CODES[out_dtype], "shape": list(shape),
                                "data_offsets": [offset, offset + size]}
                offset += size
                weight_map[name] = file_name
            header_bytes = json.dumps(header, separators=(",", ":")).encode()
            header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
            with open(folder / file_name, "wb") as file:
                file.write(struct.pack("<Q", len(header_bytes)))
                file.write(header_bytes)
                for name, out_dtype, shape, _ in shard:
                    tensor_name, tensor = next(tensors)
                    if tensor_name != name or tensor.dtype != out_dtype or tuple(tensor.shape) != shape:
                        raise ExportError(f"internal: tensor {tensor_name} does not match its header entry {name}")
                    file.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
                    progress.update(1)
    if len(shards) > 1:
        total = sum(entry[3] for entry in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def check_out_path(out):
    """Refuse an OUT whose path is not UTF-8 text: safetensors, which loads the weights written there (the parity
    proof, then every user), opens only UTF-8 paths."""
    resolved = Path(out).resolve()
    if printable(resolved) != str(resolved):
        raise ExportError(f"OUT {printable(out)} is not a UTF-8 path, and safetensors, which loads the weights "
                          "written there, opens only UTF-8 paths: choose a UTF-8 name")


def export_config(plan, folder, dtype, attention_backend):
    config = plan.config
    config.attention_backend = attention_backend
    mark_as_package(config)
    stored = dtype or next(iter_converted_tensors_dtype(plan))
    config.dtype = stored
    config.save_pretrained(folder)


def iter_converted_tensors_dtype(plan):
    """The dtype of the first floating tensor of the source: what the folder stores without --dtype."""
    for source_name in plan.mapping.values():
        source_dtype = plan.source.dtype(source_name)
        if source_dtype.is_floating_point:
            yield source_dtype


def copy_side_files(source_folder, folder, source_config):
    """Copy the tokenizer files and write the generation config: the source's generation_config.json, or, as
    transformers builds it for a folder without one, from the generation fields of its config.json."""
    source_folder = Path(source_folder)
    copied = []
    for name in TOKENIZER_FILES:
        if (source_folder / name).is_file():
            shutil.copy2(source_folder / name, folder / name)
            copied.append(name)
    if (source_folder / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(source_folder)
    elif int(transformers.__version__.split(".")[0]) >= 5:  # its config classes drop the generation fields
        generation_config = GenerationConfig.from_model_config(dict(source_config))
    else:
        generation_config = GenerationConfig.from_model_config(PretrainedConfig.from_dict(source_config))
    generation_config.save_pretrained(folder)
    return copied


def source_card_metadata(source_folder):
    """license, language and description (the text after the metadata, or None) of the source's model card, when
    it has one; a card whose YAML header cannot be read is a one-line error."""
    import yaml
    from huggingface_hub import ModelCard

    readme = Path(source_folder) / "README.md"
    if not readme.exists():
        return {}
    try:
        card = ModelCard(read_text(readme).removeprefix("\ufeff"))  # as ModelCard.load, BOM or not
    except (ValueError, yaml.YAMLError) as error:
        raise ExportError(f"the source's README.md has an unreadable metadata header: {error_line(error)}") \
            from error
    return {"license": card.data.get("license"), "language": card.data.get("language"),
            "description": card.text.strip() or None}


def validate_side_files(source_folder):
    """Check, before any heavy work, every source file the export parses: the folder's JSON files (tokenizer,
    generation config) and the model card. Returns the card's metadata."""
    check_model_folder(source_folder)
    return source_card_metadata(source_folder)


def check_card_renders(card):
    """Render the model card once into a scratch folder, so a broken template fails before the conversion."""
    import jinja2
    import yaml

    with tempfile.TemporaryDirectory() as scratch:
        try:
            render_model_card(scratch, **card, parity_max_abs_diff=None, parity_sample=None)
        except (jinja2.TemplateError, yaml.YAMLError, ValueError, OSError) as error:
            raise ExportError(f"the model card template does not render: {error_line(error)}") from error


def export(plan, source_folder, output, *, dtype=None, attention_backend="auto", max_shard_size="5GB",
           verify=True, allow_non_finite=False, base_model=None, source_name=None, convert_command=None,
           repo_id=None, example=None):
    """Write the FAT5 folder for `plan` through `output` (a fat5.convert.safety.AtomicOutput): it appears complete
    and verified, or not at all. Returns (max |logits difference|, sample description), or (None, None).
    `example`: the model card's example (fat5.convert.hub.task_example's dict, plus the `output` the model gives), when
    the caller knows a better one than the config's task."""
    max_bytes = parse_size(max_shard_size)
    metadata = validate_side_files(source_folder)
    card = dict(base_model=base_model, source_name=source_name and printable(source_name),
                license=metadata.get("license"), language=metadata.get("language"),
                family=plan.source_config["model_type"],
                num_parameters=sum(torch.Size(shape).numel() for shape in plan.shapes.values()),
                repo_id=repo_id, folder_name=output.out.resolve().name,
                convert_command=convert_command and printable(convert_command),
                example=example or task_example(plan.source_config), has_tokenizer=holds_tokenizer(source_folder),
                vocab_size=plan.source_config.get("vocab_size"), source_description=metadata.get("description"))
    check_card_renders(card)
    with output as staging:
        with write_failures_reported(output.out, staging.parent):
            write_safetensors_streaming(plan, staging, dtype, max_bytes, allow_non_finite)
            export_config(plan, staging, dtype, attention_backend)
            copy_side_files(source_folder, staging, plan.source_config)
            write_remote_code(staging)
        difference, sample = verify_parity(source_folder, staging, dtype, plan.load_reference) if verify \
            else (None, None)
        with write_failures_reported(output.out, staging.parent):
            render_model_card(staging, **card, parity_max_abs_diff=difference, parity_sample=sample)
        output.commit()
    return difference, sample


__all__ = ["ExportError", "check_out_path", "export", "parse_size", "validate_side_files", "write_remote_code",
           "write_safetensors_streaming", "verify_parity"]
