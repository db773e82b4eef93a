"""Convert a FAT5 checkpoint back into a transformers T5 / mT5 / umT5 checkpoint, so any T5 runtime serves it.

    python -m convert.fat5_to_t5 FAT5_DIR OUT [options]

Only models with T5's relative position bias (position_encoding_type "t5") have a transformers counterpart.
FAT5 keeps T5's parameter names, so the tensors stream unchanged; the output is written atomically and, by
default, reloaded with transformers and its logits compared with the FAT5 model's before it appears.
"""

import argparse
import json
from pathlib import Path

from fat5.cli import CliParser, CommandError, exit_with, run
from fat5.convert.cli import add_output_arguments

MODEL_TYPES = ("t5", "mt5", "umt5")


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


def convert(args, progress):
    from fat5.cli import write_failures_reported
    from fat5.convert.checkpoint import plan_back_conversion
    from fat5.convert.export import (
        check_out_path,
        copy_side_files,
        parse_size,
        validate_side_files,
        write_safetensors_streaming,
    )
    from fat5.convert.parity import verify_back_parity
    from fat5.convert.safety import AtomicOutput

    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise CommandError(f"FAT5_DIR {src} is not a directory")
    max_bytes = parse_size(args.max_shard_size)
    output = AtomicOutput(src, out, overwrite=args.overwrite)
    check_out_path(out)
    progress.describe = output.describe
    plan = plan_back_conversion(src, args.model_type)
    validate_side_files(src)
    print(f"Converting {src} (FAT5, {len(plan.mapping)} tensors) -> {out} ({plan.config['model_type']})")
    with output as staging:
        with write_failures_reported(out, staging.parent):
            write_safetensors_streaming(plan, staging, None, max_bytes, args.allow_non_finite)
            (staging / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")
            copy_side_files(src, staging, plan.source_config)
        if not args.no_verify:
            difference, sample = verify_back_parity(src, staging)
            print(f"Parity: max |logits difference| = {difference:.3g} ({sample})")
        output.commit()
    print(f"Wrote {out}: {progress.describe()}")


def main(argv=None):
    return run(lambda argv, progress: convert(build_parser().parse_args(argv), progress), argv)


if __name__ == "__main__":
    exit_with(main)
