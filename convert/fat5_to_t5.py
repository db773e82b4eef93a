"""Convert a FAT5 checkpoint back into a transformers T5 / mT5 / umT5 checkpoint, so any T5 runtime serves it.

    python -m convert.fat5_to_t5 FAT5_DIR OUT [options]

Only models with T5's relative position bias (position_encoding_type "t5") have a transformers counterpart.
FAT5 keeps T5's parameter names, so the tensors stream unchanged; the output is written atomically and, by
default, reloaded with transformers and its logits compared with the FAT5 model's before it appears.
"""

import argparse
import json
from pathlib import Path

from convert.cli import CliParser, CommandError, exit_with, run
from convert.safety import add_output_arguments

MODEL_TYPES = ("t5", "mt5", "umt5")
ARCHITECTURES = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration",
                 "umt5": "UMT5ForConditionalGeneration"}
# FAT5 config fields a T5 config.json takes unchanged.
T5_FIELDS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
             "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
             "layer_norm_epsilon", "initializer_factor", "feed_forward_proj", "pad_token_id", "eos_token_id",
             "decoder_start_token_id", "classifier_dropout", "use_cache")
# Copies transformers re-creates from shared.weight when it loads a T5 checkpoint.
TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def build_parser():
    parser = CliParser(prog="python -m convert.fat5_to_t5", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", metavar="FAT5_DIR", help="a FAT5 checkpoint folder (config.json model_type fat5)")
    parser.add_argument("out", metavar="OUT", help="output folder (created; must be empty or absent, and outside "
                                                   "FAT5_DIR)")
    parser.add_argument("--model-type", choices=MODEL_TYPES,
                        help="transformers family to write (default: umt5 for a bias table per layer, else t5)")
    add_output_arguments(
        parser, verify_help="skip reloading OUT with transformers and comparing its logits with the FAT5 model")
    return parser


def t5_config(fat5_config, model_type, tied):
    """The config.json dict of the transformers checkpoint, and a check that the transformers version writing it
    reads it back with FAT5's output rescale."""
    import transformers

    from convert.checkpoint import scales_decoder_output

    if fat5_config.get("position_encoding_type", "t5") != "t5":
        raise CommandError(f"position_encoding_type {fat5_config['position_encoding_type']!r} has no transformers "
                        "T5 counterpart: only FAT5 models with T5's relative bias (\"t5\") convert back")
    per_layer = bool(fat5_config.get("relative_bias_per_layer"))
    model_type = model_type or ("umt5" if per_layer else "t5")
    if per_layer != (model_type == "umt5"):
        raise CommandError(f"--model-type {model_type} does not match the model: "
                        f"{'a' if per_layer else 'no'} bias table per layer means umt5" + ("" if per_layer else
                                                                                          " is impossible"))
    config = {name: fat5_config[name] for name in T5_FIELDS if fat5_config.get(name) is not None}
    scale = fat5_config.get("scale_decoder_outputs", tied)
    config.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]], tie_word_embeddings=tied,
                  transformers_version=transformers.__version__, is_encoder_decoder=True)
    if model_type == "t5":
        config["scale_decoder_outputs"] = scale
    if scales_decoder_output(config) != scale:
        raise CommandError(f"transformers {transformers.__version__}'s {model_type} cannot express this model: it "
                        f"{'does not scale' if scale else 'scales'} the decoder output "
                        f"{'but ties' if tied else 'and does not tie'} the LM head (try --model-type t5 or "
                        "transformers 4.x)")
    return config


def plan_back_conversion(folder, model_type):
    """A ConversionPlan from a FAT5 folder to transformers' T5 tensors (the same names), checked complete."""
    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from convert.checkpoint import ConversionPlan, TensorSource, read_json_object

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CommandError(f"{folder} has no config.json")
    fat5_config = read_json_object(folder / "config.json")
    if fat5_config.get("model_type") != "fat5":
        raise CommandError(f"{folder} is not a FAT5 checkpoint (config.json model_type "
                        f"{fat5_config.get('model_type')!r})")
    source = TensorSource(folder)
    names = set(source.names())
    tied = "lm_head.weight" not in names
    config = t5_config(fat5_config, model_type, tied)
    fields = {key: value for key, value in config.items() if key not in ("architectures", "transformers_version")}
    with torch.device("meta"):
        target = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(**fields))
    shapes = {name: tuple(tensor.shape) for name, tensor in target.state_dict().items()
              if name not in TIED_COPIES and not (tied and name == "lm_head.weight")}
    shapes = {name: shape for name, shape in shapes.items()
              if not name.endswith("EncDecAttention.relative_attention_bias.weight")}
    missing = sorted(set(shapes) - names)
    if missing:
        raise CommandError(f"FAT5 checkpoint lacks {len(missing)} tensor(s) {config['model_type']} needs, "
                        f"e.g. {missing[0]}")
    unmapped = sorted(names - set(shapes))
    if unmapped:
        raise CommandError(f"FAT5 tensor {unmapped[0]} has no {config['model_type']} counterpart")
    for name, shape in shapes.items():
        if source.shape(name) != shape:
            raise CommandError(f"tensor {name} has shape {source.shape(name)}, the config implies {shape}")
    return ConversionPlan(source=source, config=config, source_config=fat5_config,
                          mapping={name: name for name in shapes}, shapes=shapes)


def verify_back_parity(fat5_folder, folder):
    """Logits of the written checkpoint, loaded by plain transformers, against the FAT5 model's; one model in
    memory at a time. Returns (max |difference|, sample)."""
    import gc

    import torch
    from transformers import AutoModelForSeq2SeqLM

    import fat5
    from convert.export import PARITY_TOLERANCE, ExportError

    generator = torch.Generator().manual_seed(0)
    model = fat5.FAT5ForConditionalGeneration.from_pretrained(fat5_folder).eval()
    model.config.attention_backend = "eager"
    vocab = model.config.vocab_size
    batch = {"input_ids": torch.randint(2, vocab, (2, 17), generator=generator),
             "attention_mask": torch.ones(2, 17, dtype=torch.long),
             "decoder_input_ids": torch.randint(2, vocab, (2, 9), generator=generator)}
    batch["attention_mask"][1, 11:] = 0
    with torch.no_grad():
        expected = model(**batch).logits.float()
    dtype = model.shared.weight.dtype
    del model
    gc.collect()
    written = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    with torch.no_grad():
        actual = written(**batch).logits.float()
    difference = (expected - actual).abs().max().item()
    tolerance = PARITY_TOLERANCE[dtype] * expected.abs().max().item()
    sample = f"2 random padded sequences, {str(dtype).removeprefix('torch.')}"
    if not difference <= tolerance:
        raise ExportError(f"parity check failed: max |logits difference| {difference:.3g} > tolerance "
                          f"{tolerance:.3g} ({sample})")
    return difference, sample


def convert(args, progress):
    from convert.export import copy_side_files, parse_size, validate_side_files, write_safetensors_streaming
    from convert.safety import AtomicOutput

    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise CommandError(f"FAT5_DIR {src} is not a directory")
    max_bytes = parse_size(args.max_shard_size)
    output = AtomicOutput(src, out, overwrite=args.overwrite)
    progress.describe = output.describe
    plan = plan_back_conversion(src, args.model_type)
    validate_side_files(src)
    print(f"Converting {src} (FAT5, {len(plan.mapping)} tensors) -> {out} ({plan.config['model_type']})")
    with output as staging:
        write_safetensors_streaming(plan, staging, None, max_bytes, args.allow_non_finite)
        (staging / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")
        copy_side_files(src, staging, None)
        if not args.no_verify:
            difference, sample = verify_back_parity(src, staging)
            print(f"Parity: max |logits difference| = {difference:.3g} ({sample})")
        output.commit()
    print(f"Wrote {out}: {progress.describe()}")


def main(argv=None):
    return run(lambda argv, progress: convert(build_parser().parse_args(argv), progress), argv)


if __name__ == "__main__":
    exit_with(main)
