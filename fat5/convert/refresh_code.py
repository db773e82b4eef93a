"""Give a FAT5 folder written by an earlier FAT5 this FAT5's code, in place and atomically.

    python -m convert.refresh_code FOLDER [--no-verify] [--push-to-hub REPO_ID]

A folder carries the code that wrote it, and transformers runs that code for everyone who loads it with
`trust_remote_code=True`, whatever their transformers: a folder exported before FAT5 followed transformers 5.24's
rename of `past_key_values` to `cache` generates wrongly there. This rewrites the code files and the config.json
fields that name them (`auto_map`, `custom_pipelines`, `tested_transformers`); weights, tokenizer, model card and
every other file stay as they are (hard links, nothing copied), so it is instant whatever the model's size. The
folder is then loaded and, for a seq2seq model, its greedy generation with the cache checked against generation
without it, before the refreshed folder replaces the old one in one step.
"""

import argparse
import json
import types
from pathlib import Path

from fat5.cli import CliParser, CommandError, exit_with, run


def build_parser():
    parser = CliParser(prog="python -m convert.refresh_code", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", metavar="FOLDER", help="a FAT5 folder (config.json model_type fat5)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip loading the refreshed folder and checking its cached generation")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload FOLDER to this Hub model repo")
    parser.add_argument("--revision", help="branch of the Hub repo to push to")
    parser.add_argument("--create-pr", action="store_true", help="push as a pull request instead of a commit")
    parser.add_argument("--token", help="Hugging Face token (default: the logged-in one, or HF_TOKEN)")
    return parser


def refreshed_config(config):
    """`config` (a FAT5 config.json dict) with the fields that name this FAT5's code."""
    from fat5.remote_code_fat5 import AUTO_MAP, mark_as_package

    encoder_only = config.get("auto_map", {}).get("AutoModel") == AUTO_MAP["AutoModelForTextEncoding"]
    fields = types.SimpleNamespace()
    mark_as_package(fields, encoder_only=encoder_only)
    return {**config, **vars(fields)}


def check_folder(folder):
    """Load `folder` with FAT5's classes; a seq2seq model must generate the same with and without its cache."""
    import torch

    import fat5
    from fat5.convert.parity import PARITY_TOLERANCE, prove_cached_generation

    config = fat5.FAT5Config.from_pretrained(folder)
    if not config.is_encoder_decoder:
        fat5.FAT5EncoderModel.from_pretrained(folder)
        return
    model = fat5.FAT5ForConditionalGeneration.from_pretrained(folder).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, config.vocab_size, (2, 13), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    dtype = model.get_input_embeddings().weight.dtype
    prove_cached_generation(model, {"input_ids": input_ids, "attention_mask": attention_mask},
                            PARITY_TOLERANCE.get(dtype, PARITY_TOLERANCE[torch.float32]))


def refresh(args, progress):
    from fat5.cli import write_failures_reported
    from fat5.convert.checkpoint import read_config
    from fat5.files import check_model_folder
    from fat5.remote_code_fat5 import write_remote_code
    from fat5.safe_files import StagedFolder

    folder = Path(args.folder)
    if not folder.is_dir():  # (a symlinked folder is refreshed where it points: StagedFolder)
        raise CommandError(f"FOLDER {folder} {'is not a directory' if folder.exists() else 'does not exist'}")
    config = read_config(folder)
    if config.get("model_type") != "fat5":
        raise CommandError(f"{folder} is not a FAT5 folder (config.json model_type {config.get('model_type')!r})")
    check_model_folder(folder)  # the check loads it: a bad file is one line now, not a traceback then
    if args.push_to_hub:
        from fat5.convert.hub import check_push_access

        check_push_access(args.push_to_hub, args.token)
    progress.describe = lambda: f"{folder} is unchanged"
    with StagedFolder(folder) as staging:
        with write_failures_reported("the refreshed code", folder.parent):
            write_remote_code(staging.path)
            (staging.path / "config.json").write_text(json.dumps(refreshed_config(config), indent=2,
                                                                 sort_keys=True) + "\n")
        # Every other file of the folder comes along as a hard link; the complete folder is checked before it
        # replaces the old one.
        staging.commit(keep=lambda name: True, check=None if args.no_verify else check_folder)
        progress.describe = lambda: f"{folder} holds the refreshed code"
    print(f"Refreshed the FAT5 code of {folder}" + ("" if args.no_verify else " (cached generation checked)"))
    if args.push_to_hub:
        from fat5.convert.hub import push_to_hub

        url = push_to_hub(folder, args.push_to_hub, revision=args.revision, create_pr=args.create_pr,
                          token=args.token, commit_message="Refresh FAT5 code")
        print(f"Pushed to {url}")


def main(argv=None):
    return run(lambda argv, progress: refresh(build_parser().parse_args(argv), progress), argv)


if __name__ == "__main__":
    exit_with(main)
