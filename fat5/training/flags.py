"""The flags of FAT5's Trainer commands (pretraining, the recipes) and of fat5.recipes.predict, read by transformers'
`HfArgumentParser`: the command's own dataclasses and, for the Trainer commands, `TrainingArguments`.

`--help` lists the command's own flags, rendered by argparse from those dataclasses without transformers (at once);
`--help-all` adds the Trainer's, from HfArgumentParser over every flag. Any other command line is parsed once, by
HfArgumentParser over every flag, once the command has imported transformers' TrainingArguments (and torch: several
seconds); a command line may start with a flags file (`expand_flags_file`). `check_values` refuses, in one line each,
the values as given that a run would accept and then fail on deep in the run or train on silently (a NaN learning
rate or length penalty, no accumulation steps, a batch of 0, a seed numpy refuses, ...), before any model loads, and
`check_trainer_values` what Trainer's values say together.

Only the standard library is imported with this module (transformers when a parser is made).
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field

from fat5.cli import CommandError, error_line
from fat5.files import check_trainer_json_files, read_json_object

# The Trainer flags the --help line names as examples.
COMMON_TRAINER_FLAGS = ("--output_dir", "--max_steps", "--learning_rate", "--per_device_train_batch_size", "--bf16",
                        "--torch_compile", "--save_steps", "--resume_from_checkpoint", "--deepspeed")


@dataclass
class RunFolderArguments:
    """The run folder's flags (fat5/training/run_folder.py): mix into a TrainingArguments subclass,
    ``class Options(TrainingArguments, RunFolderArguments)`` (naming that subclass's own `_argument_group_name`).
    (transformers 5 removed --overwrite_output_dir from TrainingArguments; 4.x has the same flag.)"""

    _argument_group_name = "run folder"

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "replace the results of another run in --output_dir (what that run wrote is deleted when this run "
                "starts; a folder also holding files FAT5 did not write is refused, and so is a resume from the "
                "folder); without it such a folder is refused"})
    resume_with_changed_settings: bool = field(default=False, metadata={
        "help": "with --resume_from_checkpoint: continue the run although settings that shape training differ from "
                "those it was started with (otherwise refused, naming them)"})
    allow_non_finite: bool = field(default=False, metadata={
        "help": "train a model holding NaN or infinite weights, and go on when a gradient, loss or weight turns "
                "non-finite (otherwise refused, or the run stops with exit status 1 before saving it)"})


@dataclass
class ActivationCheckpointing:
    """--activation_checkpointing where transformers' TrainingArguments lacks it: transformers 5.24 renamed
    --gradient_checkpointing so and warns about the old name, which the releases before it know alone. Mixed first
    into a TrainingArguments subclass (`checkpointing_flag`), it sets gradient_checkpointing, so the docs' commands
    spell the flag one way on every admitted release."""

    activation_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in the backward pass instead of storing them (transformers 5.24's name for "
                "--gradient_checkpointing, given to earlier releases by FAT5)"})

    def __post_init__(self):
        if self.activation_checkpointing:
            self.gradient_checkpointing = True
        super().__post_init__()


def checkpointing_flag(training_class):
    """The mixins a TrainingArguments subclass of FAT5's takes first for --activation_checkpointing: none where
    `training_class` has the field (transformers 5.24 and later), else ActivationCheckpointing."""
    names = {flag.name for flag in dataclasses.fields(training_class)}
    return () if "activation_checkpointing" in names else (ActivationCheckpointing,)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout; shows defaults, except empty ones and those a help text already explains;
    names each flag once (HfArgumentParser's hyphenated aliases, --max-steps for --max_steps, work but are not
    listed)."""

    def _get_help_string(self, action):
        # `is`: a default of 0 is shown (0 == False).
        if action.default is None or action.default is False or action.default in ("", []) \
                or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):
        names = action.option_strings
        underscored = {name: name[:2] + name[2:].replace("-", "_") for name in names}
        shown = [name for name in names if underscored[name] == name or underscored[name] not in names]
        if shown != names:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


class OneLineErrors:
    """Mixin, first among an argparse parser's bases: a bad flag raises CommandError, printed by fat5.cli.run as one
    `error:` line, instead of argparse's usage dump."""

    def error(self, message):
        raise CommandError(f"{message} (see --help)")


def parser(dataclass_types, defaults=None, **kwargs):
    """transformers' HfArgumentParser over `dataclass_types` (one `error:` line for a bad flag, FAT5's help layout),
    with `defaults` replacing fields' defaults."""
    from transformers import HfArgumentParser

    class Parser(OneLineErrors, HfArgumentParser):
        pass

    made = Parser(dataclass_types, formatter_class=HelpFormatter, **kwargs)
    made.set_defaults(**(defaults or {}))
    return made


def flags_file_argv(path, dataclass_types):
    """A flags file (one JSON object, {"flag": value}) as the command line it stands for, so that HfArgumentParser
    reads and checks its values as it reads the command line's (`"max_steps": "two"` is refused as `--max_steps two`
    is; a null value leaves the flag at its default)."""
    flags = read_json_object(path, "the flags file ")
    known = {flag.name for dataclass_type in dataclass_types for flag in dataclasses.fields(dataclass_type)
             if flag.init}
    unknown = sorted(set(flags) - known)
    if unknown:
        raise CommandError(f"the flags file {path} names flags this command does not have: {', '.join(unknown)}")
    argv = []
    for name, value in flags.items():
        if isinstance(value, list):
            argv += [f"--{name}", *map(_flag_value, value)]
        elif value is not None:
            argv.append(f"--{name}={_flag_value(value)}")
    return argv


def _flag_value(value):
    return json.dumps(value) if isinstance(value, dict) else str(value)


def flags_file(argv):
    """The flags file a command line starts with (`fat5 train flags.json [--flag value ...]`), or None."""
    return argv[0] if argv and argv[0].endswith(".json") and not argv[0].startswith("-") else None


def expand_flags_file(argv, dataclass_types):
    """The command line with its flags file (`flags_file`) replaced by the flags it holds: the flags given after the
    file come last, so they override the file's (argparse keeps a flag's last value), as transformers'
    HfArgumentParser lets a command line override its args files."""
    path = flags_file(argv)
    return argv if path is None else [*flags_file_argv(path, dataclass_types), *argv[1:]]


def parse(flags_parser, argv=None):
    """The dataclasses `flags_parser` (a `parser(...)`) reads from the command line `argv` (a list, default
    sys.argv[1:]), which may start with a flags file (`expand_flags_file`); the JSON files Trainer flags name are
    read first, and the values as given are checked (`check_values`) before the dataclasses are made (transformers
    replaces some, such as `--eval_steps 0`). Raises CommandError for a bad flag, value, file, or dataclass check."""
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    argv = expand_flags_file(argv, flags_parser.dataclass_types)
    check_trainer_json_files(argv)
    check_values(vars(flags_parser.parse_known_args(args=argv)[0]))
    try:
        return flags_parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # flags HfArgumentParser does not use, and TrainingArguments' own checks
        raise CommandError(error_line(error)) from None


def given_flags(argv=None):
    """The names of the flags a command line (and its flags file) gives, underscored: what the user asked for, where
    a command would change a default."""
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    path = flags_file(argv)
    given = set(read_json_object(path, "the flags file ")) if path else set()
    return given | {arg[2:].partition("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}


# The range an optimizer computes a learning rate in: float32's normal numbers (the optimizers step float32 or
# narrower weights, whose arithmetic turns a larger rate into inf and a smaller one into 0 or lost precision).
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127
# numpy's seeds, which transformers' set_seed (and Trainer) gives numpy with torch's and Python's.
SEED_MAX = 2**32 - 1
# The most tokens a sequence may hold: FAT5 counts positions and a packed batch's tokens with 32-bit integers. (No
# tokenizer's model_max_length bounds FAT5's lengths: T5's 512 is no limit of its relative positions.)
MAX_TOKENS = 2**31 - 1
TOKEN_LENGTHS = ("max_input_length", "max_target_length", "max_source_length", "max_new_tokens",
                 "generation_max_length")
# Flag values no run can use: the fields, the test each value given (not None) must pass, and what it must be.
# Checked on the values as given, before TrainingArguments replaces any (it reads `--eval_steps 0` as
# --logging_steps).
VALUE_RULES = (
    (("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
      "eval_accumulation_steps", "dataloader_prefetch_factor", "torch_empty_cache_steps", "generation_max_length",
      "generation_num_beams"), lambda value: value >= 1, "must be at least 1"),
    (("learning_rate",), lambda value: FLOAT32_TINY <= value <= FLOAT32_MAX,
     f"must be between {FLOAT32_TINY:.3g} and {FLOAT32_MAX:.3g}, float32's range, in which the optimizer computes "
     f"(a smaller rate rounds to 0, a larger one overflows)"),
    ((*TOKEN_LENGTHS, "tokenizer_vocab_size", "tokenizer_train_documents"), lambda value: value >= 1,
     "must be at least 1"),
    (TOKEN_LENGTHS, lambda value: value <= MAX_TOKENS,
     f"must be at most {MAX_TOKENS:,} tokens (FAT5 counts positions with 32-bit integers)"),
    (("weight_decay", "max_grad_norm", "warmup_steps", "warmup_ratio", "dataloader_num_workers",
      "neftune_noise_alpha", "label_smoothing_factor", "num_train_epochs", "z_loss"), lambda value: value >= 0,
     "must be 0 or more"),
    (("logging_steps", "save_steps", "eval_steps", "adam_epsilon"), lambda value: value > 0, "must be more than 0"),
    (("adam_beta1", "adam_beta2", "label_smoothing_factor", "warmup_ratio"), lambda value: value < 1,
     "must be below 1"),
    (("max_steps",), lambda value: value == -1 or value >= 1, "must be at least 1 (or -1: train --num_train_epochs)"),
    (("seed", "data_seed"), lambda value: 0 <= value <= SEED_MAX,
     f"must be between 0 and {SEED_MAX} (2**32 - 1: numpy's seeds, which Trainer seeds with torch's)"),
)


def check_values(values):
    """Refuse, in one line naming the flag, a value as given ({flag: value}, argparse's namespace) that no run can
    use: a non-finite number for any flag (a NaN learning rate trains a NaN model, a NaN length penalty ranks every
    beam alike), and those of VALUE_RULES (a batch of 0, no accumulation steps, a negative worker count, a learning
    rate the optimizer cannot represent, a seed numpy refuses, ...)."""
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise CommandError(f"--{name} {value}: must be a finite number")
    for names, test, rule in VALUE_RULES:
        for name in names:
            value = values.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not test(value):
                raise CommandError(f"--{name} {value}: {rule}")


def check_trainer_values(training_args):
    """Refuse, in one line, what the values of `training_args` say together that no run can use (each value was
    checked as given by `parse`): no epochs and no steps; and an --output_dir whose name is not UTF-8 (transformers
    writes it into JSON files and the model card, after training)."""
    if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise CommandError(f"--num_train_epochs {training_args.num_train_epochs}: nothing to train (pass a number of "
                           f"epochs above 0, or --max_steps)")
    output_dir = str(training_args.output_dir)
    try:
        output_dir.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(output_dir).decode("utf-8", "backslashreplace")
        raise CommandError(f"--output_dir {shown}: the name is not UTF-8 text, which the run's JSON files and model "
                           f"card must hold; choose a UTF-8 name") from None


def _shown(flag):
    """How --help shows a dataclass field: its help, choices, default, and whether it takes a value (a bool flag is
    shown given alone, which HfArgumentParser reads as true) or several (a list)."""
    shown = {"help": flag.metadata.get("help")}
    if flag.default is not dataclasses.MISSING:
        shown["default"] = flag.default
    elif flag.default_factory is not dataclasses.MISSING:
        shown["default"] = flag.default_factory()
    else:
        shown["required"] = True
    if flag.type is bool and shown.get("default") is False:
        return {**shown, "action": "store_true"}
    if "choices" in flag.metadata:
        shown["choices"] = flag.metadata["choices"]
    if str(flag.type).startswith("list"):
        shown["nargs"] = "+"
    return shown


class CommandFlags:
    """A command's --help and --help-all, answered before its heavy imports (its parse is `parse`, after them).

    own: the command's own dataclasses, in --help's order (each titled by its `_argument_group_name`).
    full_parser: () -> the command's parser over every flag (imports transformers' TrainingArguments), for
        --help-all; None for a command without Trainer flags.
    trainer: the name of the transformers dataclass of its Trainer flags, said in --help.
    notes: lines --help ends with (e.g. the Trainer defaults the command changes).
    """

    def __init__(self, prog, description, own, full_parser=None, trainer=None, usage=None, notes=()):
        self.prog, self.description, self.own, self.usage = prog, description, own, usage
        self.full_parser, self.trainer, self.notes = full_parser, trainer, notes

    def help_parser(self):
        """An argparse parser that only prints --help: the own dataclasses' flags, rendered here without transformers
        (HfArgumentParser parses them, once the command has imported it)."""
        notes = list(self.notes)
        if self.trainer:
            notes.append(f"Trainer flags: the flags of transformers' {self.trainer} ({', '.join(COMMON_TRAINER_FLAGS)}"
                         f", ...) work too; --help-all lists them.")
        help_parser = argparse.ArgumentParser(
            prog=self.prog, description=self.description, usage=self.usage, formatter_class=HelpFormatter,
            epilog="\n".join(textwrap.fill(line, 100) for line in notes) or None)
        for dataclass_type in self.own:
            group = help_parser.add_argument_group(getattr(dataclass_type, "_argument_group_name", None))
            for flag in dataclasses.fields(dataclass_type):
                if flag.init:
                    group.add_argument(f"--{flag.name}", **_shown(flag))
        if self.full_parser:
            help_parser.add_argument("--help-all", action="store_true",
                                     help="show this help with the Trainer flags too (imports torch: a few seconds)")
        return help_parser

    def answer_help(self, argv):
        """--help (-h) and --help-all anywhere in `argv`: print that help and exit (SystemExit 0)."""
        argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
        if self.full_parser and "--help-all" in argv:
            self.full_parser().print_help()
            raise SystemExit(0)
        if "-h" in argv or "--help" in argv:
            self.help_parser().print_help()
            raise SystemExit(0)
