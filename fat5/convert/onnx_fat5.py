"""Export a FAT5 folder to ONNX with optimum's exporter, for onnxruntime (`optimum.onnxruntime`).

    python -m convert.onnx_fat5 FOLDER OUT [--task text2text-generation-with-past] [--opset N]

A FAT5 model whose position_encoding_type is "t5" (T5's relative bias) has T5's parameter names, config fields and
computation, so it exports with optimum's own T5 ONNX config, registered for model type "fat5" (here, and by loading
a FAT5 config once optimum's exporter is imported, which makes `optimum-cli export onnx --model FOLDER
--trust-remote-code` work too: fat5/integrations_fat5.py). Other position types (FIRE, RoPE, ...) have no ONNX config
and are refused. optimum's exporter (`pip install "fat5[onnx]"`) requires transformers < 4.58, so this runs on
transformers 4.57 only.
"""

import argparse

from fat5.cli import CliParser, CommandError, exit_with, run
from fat5.files import exportable_fat5_config


def build_parser():
    from fat5.integrations_fat5 import ONNX_TASKS as TASKS  # imports torch and transformers: inside `run`

    parser = CliParser(prog="python -m convert.onnx_fat5", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", metavar="FOLDER", help="a FAT5 folder (config.json, weights, tokenizer)")
    parser.add_argument("out", metavar="OUT", help="output folder for the ONNX files (absent or empty, unless "
                                                   "--overwrite), outside FOLDER")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists and is not empty (atomically: OUT is always either the "
                             "old or the new folder)")
    parser.add_argument("--task", default=TASKS[0], choices=TASKS,
                        help=f"what to export (default: {TASKS[0]}: encoder, decoder and decoder with cache, "
                             "for ORTModelForSeq2SeqLM.generate)")
    parser.add_argument("--opset", type=int, help="ONNX opset (default: optimum's for T5)")
    return parser


def register_fat5_onnx_config():
    """Export model type "fat5" with optimum's T5 ONNX config (what loading a FAT5 config does too once optimum's
    exporter is imported: fat5/integrations_fat5.py)."""
    try:
        import optimum.exporters.onnx  # noqa: F401
    except ImportError as error:
        raise CommandError(f"optimum's ONNX exporter cannot be imported ({error}): pip install \"fat5[onnx]\" "
                           "(it requires transformers < 4.58)") from error
    from fat5.integrations_fat5 import register_optimum_onnx_config

    register_optimum_onnx_config()


def export(args, progress):
    exportable_fat5_config(args.folder, "onnx", args.task)
    register_fat5_onnx_config()
    from optimum.exporters.onnx import main_export

    from fat5.cli import write_failures_reported
    from fat5.convert.safety import AtomicOutput

    # OUT is built in a staging folder beside it and put in place whole, as the converters' OUT: an interrupted or
    # failed export leaves no partial folder, and OUT may not overlap the model folder it reads.
    output = AtomicOutput(args.folder, args.out, overwrite=args.overwrite, what="ONNX export")
    progress.describe = output.describe
    with output as staging, write_failures_reported(output.out, output.out.resolve().parent):
        # optimum loads the folder's own remote code, reruns the exported graphs on fresh inputs and checks them
        # against PyTorch's outputs (do_validation) before returning.
        main_export(args.folder, staging, task=args.task, opset=args.opset, trust_remote_code=True)
        output.commit()
    load = ("optimum.onnxruntime.ORTModelForSeq2SeqLM.from_pretrained(OUT, trust_remote_code=True)"
            if args.task.startswith("text2text") else "onnxruntime.InferenceSession, one per .onnx file")
    print(f"Wrote {output.out}: {output.describe()}; load it with {load}")


def main(argv=None):
    return run(lambda argv, progress: export(build_parser().parse_args(argv), progress), argv)


if __name__ == "__main__":
    exit_with(main)
