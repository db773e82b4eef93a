"""Convert a FAT5 folder to a CTranslate2 model, for `ctranslate2.Translator` (fast CPU and GPU serving).

    python -m convert.ct2_fat5 FOLDER OUT [--quantization int8] [--overwrite] [--no-verify]

A FAT5 model whose position_encoding_type is "t5" is T5 to CTranslate2 (same parameter names and computation):
loading its config registers CTranslate2's own T5 loader for FAT5Config (fat5/integrations_fat5.py), which is also
what makes `ct2-transformers-converter --model FOLDER --trust_remote_code` work. This command adds one-line errors,
an output that appears only complete (with the folder's tokenizer files) and a check that CTranslate2 decodes a
sample greedily to PyTorch's tokens. Other position types have no CTranslate2 counterpart and are refused.
Needs `pip install "fat5[ct2]"` (ctranslate2).
"""

import argparse
import json
from pathlib import Path

from fat5.cli import CheckFailed, CliParser, CommandError, error_line, exit_with, require, run
from fat5.files import check_tokenizer_folder, exportable_fat5_config

SAMPLE_TOKENS = 8  # decoded greedily by both, from a fixed sample of the vocabulary


def build_parser():
    parser = CliParser(prog="python -m convert.ct2_fat5", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", metavar="FOLDER", help="a FAT5 folder (config.json, weights, tokenizer)")
    parser.add_argument("out", metavar="OUT", help="output folder (created; must be empty or absent, and outside "
                                                   "FOLDER)")
    parser.add_argument("--quantization", help="CTranslate2 weight type, e.g. int8, int8_float16, float16 (default: "
                                               "the folder's)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip decoding a sample with CTranslate2 and PyTorch and comparing the tokens")
    return parser


def verify_tokens(folder, out, config):
    """Decode a fixed sample greedily with CTranslate2 (from OUT's vocabulary) and PyTorch; their tokens must be
    the same."""
    import ctranslate2
    import torch
    from transformers import AutoModelForSeq2SeqLM

    vocabulary = json.loads((Path(out) / "shared_vocabulary.json").read_text())
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    sample = [token for token in range(3, min(len(vocabulary), 40), 3) if token != eos][:12] + [eos]
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([sample]), max_new_tokens=SAMPLE_TOKENS, do_sample=False)[0, 1:]
    expected = [vocabulary[token] for token in expected.tolist() if token not in (eos, config.pad_token_id)]
    translator = ctranslate2.Translator(str(out), device="cpu")
    result = translator.translate_batch([[vocabulary[token] for token in sample]], beam_size=1,
                                        max_decoding_length=SAMPLE_TOKENS)
    actual = result[0].hypotheses[0]
    if actual != expected:
        raise CheckFailed(f"CTranslate2 decodes the sample to {actual}, PyTorch to {expected}: the conversion is "
                          "wrong under this ctranslate2; please report it")
    return len(actual)


def convert(args, progress):
    from fat5.cli import write_failures_reported
    from fat5.convert.export import TOKENIZER_FILES
    from fat5.convert.safety import AtomicOutput

    folder, out = Path(args.folder), Path(args.out)
    if not folder.is_dir():
        raise CommandError(f"FOLDER {folder} is not a directory")
    require("ct2", "ctranslate2")
    config = exportable_fat5_config(folder, "ctranslate2")
    check_tokenizer_folder(folder, "FOLDER", advice="CTranslate2 takes its vocabulary from the tokenizer")
    import ctranslate2

    output = AtomicOutput(folder, out, overwrite=args.overwrite, what="CTranslate2 conversion")
    progress.describe = output.describe
    tokenizer_files = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    converter = ctranslate2.converters.TransformersConverter(str(folder), trust_remote_code=True,
                                                             copy_files=tokenizer_files)
    with output as staging:
        with write_failures_reported(out, staging.parent):
            try:
                converter.convert(str(staging), quantization=args.quantization, force=True)
            except ValueError as error:  # e.g. an unknown --quantization
                raise CommandError(f"CTranslate2 refused the conversion: {error_line(error)}") from error
        if not args.no_verify and args.quantization is None:
            compared = verify_tokens(folder, staging, config)
            print(f"Check: CTranslate2 decodes a sample to PyTorch's {compared} greedy tokens")
        output.commit()
    print(f"Wrote {out}: {output.describe()}; load it with ctranslate2.Translator(OUT)")


def main(argv=None):
    return run(lambda argv, progress: convert(build_parser().parse_args(argv), progress), argv, extra="ct2")


if __name__ == "__main__":
    exit_with(main)
