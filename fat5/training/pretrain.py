"""Pretrain a FAT5 from raw text, or continue pretraining a FAT5 checkpoint, with T5/UL2 denoising objectives.

From scratch (T5 v1.1 "base" shapes, a sentencepiece tokenizer trained on the corpus, nanoT5's optimizer):
    python -m fat5.training.pretrain --config base --train_files corpus/ --output_dir runs/base \\
        --max_steps 65536 --per_device_train_batch_size 128 --warmup_steps 10000 --bf16

Continued pretraining of a converted checkpoint (python -m convert.flan_to_fat5 google/flan-t5-base flan-fat5):
    python -m fat5.training.pretrain --model_name_or_path flan-fat5 --train_files domain.jsonl \\
        --output_dir runs/flan-domain --max_steps 10000 --per_device_train_batch_size 64 --bf16

The corpus is streamed (text files: one document a line; JSONL: the --text_field of each line; or a `datasets`
name), so it may be larger than memory. Each example draws a denoiser of the --mixture, takes the next chunk of a
document that fits --max_input_length/--max_target_length once corrupted, and examples are packed into rows with
no attention between them (--per_device_train_batch_size counts examples; rows hold several each). Every
`TrainingArguments` flag of transformers works (accelerate, --deepspeed, --fsdp, --gradient_accumulation_steps,
--save_steps, --resume_from_checkpoint ...; --help-all lists them); the defaults that differ from `Trainer`'s are
said at the end of --help.
Checkpoints and the final --output_dir are FAT5 folders with the tokenizer. --output_dir belongs to this run
(fat5/training/run_folder.py): a folder holding another run is refused unless resumed (--resume_from_checkpoint
latest) or replaced (--overwrite_output_dir), checkpoints are written atomically, and `latest` resumes exactly,
after any number of passes over the corpus.
"""

import sys

from fat5 import cli
from fat5.cli import exit_with, require, run

from .flags import CommandFlags, RunFolderArguments
from .pretrain_flags import PROG, USAGE, PretrainArguments, defaults_line

# This module answers --help before torch loads (fat5/training/flags.py); the run itself, with torch and
# transformers, is fat5/training/pretraining.py, which parses the flags.


def full_parser():
    from .pretraining import full_parser

    return full_parser(__doc__)


FLAGS = CommandFlags(PROG, __doc__, (PretrainArguments, RunFolderArguments), full_parser=full_parser,
                     trainer="TrainingArguments", usage=USAGE, notes=[defaults_line()])


def pretrain(argv, progress):
    """The command (run by fat5.cli.run): --help first, before torch and transformers load."""
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    FLAGS.answer_help(argv)
    require("pretrain", "accelerate")  # Trainer's, whatever the corpus
    from .pretraining import parse_args
    from .pretraining import pretrain as run_pretraining

    args, training_args = parse_args(argv)
    run_pretraining(args, training_args, argv, progress, program=cli.program or PROG)


def main(argv=None):
    return run(pretrain, argv, extra="pretrain")


if __name__ == "__main__":
    exit_with(main)
