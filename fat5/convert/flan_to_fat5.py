"""Convert a T5 / FLAN-T5 / mT5 / umT5 / ByT5 checkpoint, or a flashT5 one (CATIE-AQ's FAT5 models, config.json
model_type flash_t5), into a self-contained FAT5 Hub folder.

    python -m convert.flan_to_fat5 SRC OUT [options]   # SRC: a local folder or a Hub model id
    python -m convert.flan_to_fat5                     # demo: converts the bundled tiny T5 and runs it

The output folder holds safetensors weights, config (with auto_map and the text2text pipeline), generation
config, the source's tokenizer files, FAT5's remote code and a model card; it is written atomically and
reloaded to check its logits against the source before it appears.
"""

import argparse
import re
import shlex
import sys
from pathlib import Path

from fat5.cli import CheckFailed, CliParser, CommandError, error_line, exit_with, run
from fat5.convert.cli import add_output_arguments

# Heavy modules (torch, transformers) are imported inside `convert`, where Ctrl-C is handled.
DTYPES = ("bfloat16", "float16", "float32")
DEMO_OUTPUT = Path("fat5-demo")
# Files worth downloading from a Hub repo: config, weights, tokenizer, generation config, card.
SOURCE_PATTERNS = ["*.json", "*.safetensors", "*.model", "README.md", "LICENSE*"]
SOURCE_PATTERNS_BIN = SOURCE_PATTERNS + ["pytorch_model*.bin"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


def build_parser():
    parser = CliParser(prog="python -m convert.flan_to_fat5", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="With no SRC and OUT, converts the bundled demo T5 into ./fat5-demo and runs the "
                              "text2text pipeline on a few prompts.")
    parser.add_argument("src", nargs="?", metavar="SRC",
                        help="local checkpoint folder (config.json + safetensors or pytorch_model.bin, single or "
                             "sharded) or a Hub model id such as google/flan-t5-small or CATIE-AQ/FAT5-small-flan-en")
    parser.add_argument("out", nargs="?", metavar="OUT",
                        help="output folder (created; must be empty or absent, and outside SRC)")
    parser.add_argument("--dtype", choices=DTYPES, help="store the weights in this dtype (default: the source's)")
    parser.add_argument("--attn-implementation", default="auto", choices=["auto", "eager", "sdpa", "triton"],
                        help="attention backend saved in the config: auto = Triton kernel on CUDA, SDPA "
                             "elsewhere (default: auto)")
    add_output_arguments(parser, verify_help="skip reloading OUT and comparing its logits with the source model")
    parser.add_argument("--base-model", metavar="HUB_ID",
                        help="Hub id of the source model, for the model card (default: SRC when it is a Hub id, "
                             "else the source config's _name_or_path when that is one)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload OUT to this Hub model repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument("--revision", help="branch of the Hub repo to push to (and of SRC to download)")
    parser.add_argument("--create-pr", action="store_true", help="push as a pull request instead of a commit")
    parser.add_argument("--token", help="Hugging Face token (default: the logged-in one, or HF_TOKEN)")
    return parser


def resolve_source(src, revision, token):
    """A local folder as is; otherwise a Hub model id, downloaded with huggingface_hub."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise CommandError(f"SRC {src} is not a directory")
        return path, None
    if path.is_absolute() or src.startswith(".") or src.count("/") > 1:
        raise CommandError(f"SRC {src} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        folder = snapshot_download(src, revision=revision, token=token, allow_patterns=SOURCE_PATTERNS)
        if not any(Path(folder).glob("*.safetensors")):
            folder = snapshot_download(src, revision=revision, token=token, allow_patterns=SOURCE_PATTERNS_BIN)
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, ValueError) as error:
        raise CommandError(f"SRC {src} is neither a local folder nor a downloadable Hub model: "
                           f"{error_line(error)}") from error
    return Path(folder), src


def base_model_id(explicit, hub_id, source_config):
    """The source's Hub id, when knowable: --base-model, SRC given as a Hub id, or the config's _name_or_path."""
    name = source_config.get("_name_or_path")
    from_config = name if isinstance(name, str) and HUB_ID.fullmatch(name) and not Path(name).exists() else None
    return explicit or hub_id or from_config


def demo_example():
    """The demo's model card example: the first prompt the demo command checks, and its answer."""
    from fat5.convert.demo import DEMO_PROMPTS

    prompt, answer = DEMO_PROMPTS[0]
    tasks = list(dict.fromkeys(f"`{text.split(':')[0]}:`" for text, _ in DEMO_PROMPTS))
    return dict(text=prompt, pipeline_text=prompt, output=answer,
                note=f"The demo model knows {len(tasks)} synthetic tasks, each named by its prefix "
                     f"({', '.join(tasks)}); the answer shown is the one the demo command checks after converting.")


def run_demo_pipeline(out):
    """Answer the demo prompts with the text2text pipeline loaded from `out`, as a user would; the answers are
    known, so a wrong one fails the command (FAT5 then computes wrongly under the installed transformers)."""
    import transformers
    from transformers import pipeline

    from fat5 import register_auto_classes
    from fat5.convert.demo import DEMO_PROMPTS
    from fat5.convert.parity import loading_bars_hidden

    register_auto_classes()  # as in a user's process that uses FAT5's classes (transformers 5 then prefers them)
    with loading_bars_hidden():
        generator = pipeline("text2text-generation", model=str(out), trust_remote_code=True)
    wrong = []
    for prompt, expected in DEMO_PROMPTS:
        text = generator(prompt)[0]["generated_text"]
        print(f"  {prompt!r} -> {text!r}" + ("" if text == expected else f"   (expected {expected!r})"))
        if text != expected:
            wrong.append((prompt, text, expected))
    if wrong:
        prompt, text, expected = wrong[0]
        raise CheckFailed(f"the demo model in {out} answered {len(wrong)} of {len(DEMO_PROMPTS)} prompts wrongly, "
                          f"first {prompt!r} -> {text!r} (expected {expected!r}): FAT5 does not compute correctly "
                          f"under transformers {transformers.__version__}; please report it")


def convert(args, progress, argv=None):
    demo = args.src is None and args.out is None
    if args.src is not None and args.out is None:
        raise CommandError("OUT is required when SRC is given")
    from fat5.convert.demo import DEMO_CHECKPOINT

    src, out = (str(DEMO_CHECKPOINT), DEMO_OUTPUT) if demo else (args.src, Path(args.out))
    if not args.push_to_hub:
        # Before torch and transformers load (seconds): a Hub id that cannot be had (offline, unknown) is refused
        # at once. (With --push-to-hub, the credentials are checked before anything is downloaded.)
        source_folder, hub_id = resolve_source(src, args.revision, args.token)
    import torch

    from fat5.convert.checkpoint import plan_conversion, read_config
    from fat5.convert.export import check_out_path, export, parse_size
    from fat5.convert.flasht5 import MODEL_TYPE as FLASHT5
    from fat5.convert.flasht5 import plan_flasht5_conversion
    from fat5.convert.hub import check_push_access, push_to_hub
    from fat5.convert.safety import AtomicOutput
    from fat5.files import TOKENIZER_FILES, holds_tokenizer

    parse_size(args.max_shard_size)
    if args.push_to_hub:
        # Fail on missing credentials or network before spending time downloading and converting.
        check_push_access(args.push_to_hub, args.token)
        source_folder, hub_id = resolve_source(src, args.revision, args.token)
    output = AtomicOutput(source_folder, out, overwrite=args.overwrite or demo)
    check_out_path(out)
    progress.describe = output.describe
    flasht5 = read_config(source_folder).get("model_type") == FLASHT5  # flashT5's own layout (CATIE-AQ's FAT5)
    plan = plan_flasht5_conversion(source_folder) if flasht5 else plan_conversion(source_folder)
    print(f"Converting {src} ({plan.source_config['model_type']}, {len(plan.mapping)} tensors) -> {out}")
    command = "python -m convert.flan_to_fat5" + ("" if demo else " " + shlex.join(sys.argv[1:] if argv is None
                                                                                      else argv))
    difference, sample = export(
        plan, source_folder, output, dtype=getattr(torch, args.dtype) if args.dtype else None,
        attention_backend=args.attn_implementation, max_shard_size=args.max_shard_size, verify=not args.no_verify,
        allow_non_finite=args.allow_non_finite,
        base_model=base_model_id(args.base_model, hub_id, plan.source_config),
        source_name=Path(source_folder).resolve().name, convert_command=command, repo_id=args.push_to_hub,
        example=demo_example() if demo else None)
    if difference is not None:
        print(f"Parity: max |logits difference| = {difference:.3g} ({sample})")
    if not holds_tokenizer(source_folder):  # said once the folder is written, so a failure stays one line
        print(f"warning: {src} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}); {out} has no tokenizer "
              f"either, and its model card says so (tokenize with the source model's tokenizer)", file=sys.stderr)
    print(f"Wrote {out}: {progress.describe()}")
    if args.push_to_hub:
        url = push_to_hub(out, args.push_to_hub, private=args.private, revision=args.revision,
                          create_pr=args.create_pr, token=args.token)
        print(f"Pushed to {url}")
    if demo:
        print("text2text-generation pipeline on the converted demo model:")
        run_demo_pipeline(out)


def main(argv=None):
    return run(lambda argv, progress: convert(build_parser().parse_args(argv), progress, argv), argv)


if __name__ == "__main__":
    exit_with(main)
