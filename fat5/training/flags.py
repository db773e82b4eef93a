"""The flags of FAT5's Trainer commands (pretraining and the recipes), read before torch and transformers load.

A command's own flags are dataclasses that transformers' `HfArgumentParser` reads together with `TrainingArguments`
once the command runs; importing those takes seconds (transformers' training modules import torch). `CommandFlags`
first reads the command line with the standard library: the command's own flags typed as HfArgumentParser types
them (and checked by their dataclasses), the Trainer's read from transformers' installed source without importing
it: their names, and the type of those annotated `int`, `float` or `bool` (or that `| None`). So `--help` (the
command's own flags, and a line on the Trainer's), an unknown flag and a bad value of an own flag or of a typed
Trainer flag answer at once. The full parse by HfArgumentParser that follows remains the authority (it checks the
other Trainer flags' values, such as names of schedulers); tests/test_command_flags.py holds the two to the same
flags and types under every tested transformers.

Only the standard library is imported here.
"""

import argparse
import ast
import copy
import dataclasses
import importlib.util
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from fat5.cli import CommandError

# transformers' Trainer flags: the dataclass, its module's file and the dataclass it extends.
TRAINER_CLASSES = {
    "TrainingArguments": ("training_args.py", None),
    "Seq2SeqTrainingArguments": ("training_args_seq2seq.py", "TrainingArguments"),
}
# The Trainer flags the --help line names as examples.
COMMON_TRAINER_FLAGS = ("--output_dir", "--max_steps", "--learning_rate", "--per_device_train_batch_size", "--bf16",
                        "--save_steps", "--resume_from_checkpoint", "--deepspeed")


@dataclass
class RunFolderArguments:
    """The run folder's flags (fat5/training/run_folder.py): mix into a TrainingArguments subclass,
    ``class Options(TrainingArguments, RunFolderArguments)``. (transformers 5 removed --overwrite_output_dir from
    TrainingArguments; 4.x has the same flag.)"""

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "replace the results of another run in --output_dir (what that run wrote is deleted when this run "
                "starts; a folder also holding files FAT5 did not write is refused); without it such a folder is "
                "refused"})
    resume_with_changed_settings: bool = field(default=False, metadata={
        "help": "with --resume_from_checkpoint: continue the run although settings that shape training differ from "
                "those it was started with (otherwise refused, naming them)"})
    allow_non_finite: bool = field(default=False, metadata={
        "help": "train a model holding NaN or infinite weights, and go on when a gradient, loss or weight turns "
                "non-finite (otherwise refused, or the run stops with exit status 1 before saving it)"})


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


class TrainerField(NamedTuple):
    """A Trainer flag as read from transformers' source."""

    has_negative: bool  # a bool field that defaults to True: it has a --no_ flag too
    kind: type | None  # int, float or bool: the type HfArgumentParser reads its value as; None: another type
    bare: bool = False  # a bool flag that may come without a value (meaning True): HfArgumentParser allows it for a
    # field annotated `bool`, or with a default other than None


# Annotations whose values the light parser checks, as their text in transformers' source (blanks removed), with
# `Optional[X]`, `X | None` and `None | X` read as X. Other annotations (enums, unions, dicts, lists) take any values
# here: the full parse judges them.
SCALAR_ANNOTATIONS = {"int": int, "float": float, "bool": bool}


def _scalar_kind(annotation):
    """(SCALAR_ANNOTATIONS' type or None, whether the annotation admits None)."""
    text = ast.unparse(annotation).replace(" ", "")
    plain = text.removesuffix("|None").removeprefix("None|")
    if plain.startswith("Optional[") and plain.endswith("]"):
        plain = plain[len("Optional["):-1]
    return SCALAR_ANNOTATIONS.get(plain), plain != text


def trainer_fields(class_name):
    """{field name: TrainerField} of a transformers Trainer arguments dataclass (TRAINER_CLASSES), read from the
    installed source without importing it; None when the source cannot be read so (the full parse then judges every
    flag)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    fields = {}
    while class_name is not None:
        file_name, base = TRAINER_CLASSES[class_name]
        try:
            tree = ast.parse((Path(spec.submodule_search_locations[0]) / file_name).read_text())
        except (OSError, SyntaxError, UnicodeDecodeError):
            return None
        body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name),
                    None)
        if body is None:
            return None
        # A subclass's fields come after (and override) its base's, as dataclasses order them.
        fields = {**_init_fields(body), **fields}
        class_name = base
    return fields


def _init_fields(body):
    """{name: TrainerField} of the annotated class-body assignments that are `__init__` fields."""
    found = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(node.annotation):
            continue
        default = node.value
        metadata = {}  # argparse keywords the field sets itself (HfArgumentParser applies them last)
        if isinstance(default, ast.Call) and ast.unparse(default.func) in ("field", "dataclasses.field"):
            keywords = {keyword.arg: keyword.value for keyword in default.keywords}
            if isinstance(keywords.get("init"), ast.Constant) and keywords["init"].value is False:
                continue
            default = keywords.get("default")
            if isinstance(keywords.get("metadata"), ast.Dict):
                metadata = {key.value: value for key, value in zip(keywords["metadata"].keys,
                                                                   keywords["metadata"].values)
                            if isinstance(key, ast.Constant)}
        kind, optional = _scalar_kind(node.annotation)
        has_negative = kind is bool and isinstance(default, ast.Constant) and default.value is True
        defaults_to_none = default is None or (isinstance(default, ast.Constant) and default.value is None)
        bare = kind is bool and (not optional or not defaults_to_none)
        nargs = metadata.get("nargs")
        if kind is bool and isinstance(nargs, ast.Constant) and nargs.value == "?":
            bare = True
        elif {"type", "choices", "nargs", "action"} & set(metadata):  # values read otherwise: left to the full parse
            kind = None
        found[node.target.id] = TrainerField(has_negative, kind, bare)
    return found


def option_strings(name, has_negative=False):
    """The options HfArgumentParser gives a field: --name and --name-with-hyphens; for a bool field defaulting to
    True, also --no_name and --no-name-with-hyphens."""
    options = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    negative = [f"--no_{name}", f"--no-{name.replace('_', '-')}"] if has_negative else []
    return options, negative


def string_to_bool(value):
    """A bool flag's value, read as HfArgumentParser reads it."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"Truthy value expected: got {value} but expected one of yes/no, true/false, "
                                     f"t/f, y/n, 1/0 (case insensitive).")


def _field_type(annotation):
    """The type HfArgumentParser parses a field's values as: X for `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        return str if str in kinds else kinds[0]
    return annotation


def add_dataclass_arguments(group, dataclass_type):
    """The flags of one of the command's own dataclasses, as HfArgumentParser makes them (for the types FAT5's
    flags use: str, int, float, bool, list[...] and their `| None`)."""
    hints = typing.get_type_hints(dataclass_type)
    for flag in dataclasses.fields(dataclass_type):
        if not flag.init:
            continue
        kind = _field_type(hints[flag.name])
        kwargs = dict(flag.metadata)
        if flag.default is not dataclasses.MISSING:
            kwargs["default"] = flag.default
        elif flag.default_factory is not dataclasses.MISSING:
            kwargs["default"] = flag.default_factory()
        elif kind is bool:
            kwargs["default"] = False
        else:
            kwargs["required"] = True
        if kind is bool:
            kwargs.update(type=string_to_bool, nargs="?", const=True)
        elif typing.get_origin(kind) is list:
            kwargs.update(type=typing.get_args(kind)[0], nargs="+")
        else:
            kwargs["type"] = kind
        options, negative = option_strings(flag.name, kind is bool and flag.default is True)
        group.add_argument(*options, **kwargs)
        if negative:
            group.add_argument(*negative, action="store_false", dest=flag.name, help=kwargs.get("help"))


def _value_arguments(trainer_field):
    """add_argument's arguments for a Trainer flag's values: as HfArgumentParser reads an int, float or bool field,
    or any number of values, unchecked, for another type."""
    if trainer_field.kind is bool:
        return dict(type=string_to_bool, nargs="?", const=True) if trainer_field.bare else dict(type=string_to_bool)
    if trainer_field.kind is not None:
        return dict(type=trainer_field.kind)
    return dict(nargs="*")


class OneLineErrors:
    """Mixin, first among an argparse parser's bases (this module's and the commands' HfArgumentParser): a bad flag
    raises CommandError, printed by fat5.cli.run as one `error:` line, instead of argparse's usage dump."""

    def error(self, message):
        raise CommandError(f"{message} (see --help)")


class LightParser(OneLineErrors, argparse.ArgumentParser):
    pass


class FullHelp(argparse.Action):
    """--help-all: the full parser's help (the command's flags and the Trainer's), then exit."""

    def __init__(self, option_strings, dest, full_parser, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help=kwargs.get("help"))
        self.full_parser = full_parser

    def __call__(self, parser, namespace, values, option_string=None):
        self.full_parser().print_help()
        parser.exit()


class CommandFlags:
    """A command's command line, read with the standard library (see the module docstring).

    groups: [(title, dataclass)] of the command's own flags, in --help's order.
    trainer: the transformers dataclass of its Trainer flags (a TRAINER_CLASSES name), or None for a command that
        has none.
    full_parser: () -> the command's HfArgumentParser (imports transformers), for --help-all.
    notes: lines --help ends with (e.g. the Trainer defaults the command changes).
    """

    def __init__(self, prog, description, groups, trainer=None, full_parser=None, usage=None, notes=()):
        self.prog, self.description, self.groups, self.usage = prog, description, groups, usage
        self.trainer, self.full_parser, self.notes = trainer, full_parser, notes

    def parser(self, trainer_names):
        """The light parser; `trainer_names` is trainer_fields(self.trainer) (None: unknown)."""
        notes = list(self.notes)
        if self.trainer:
            count = f"{len(trainer_names)} " if trainer_names else ""
            notes.append(f"Trainer flags: the {count}flags of transformers' {self.trainer} ("
                         f"{', '.join(COMMON_TRAINER_FLAGS)}, ...) work too; --help-all lists them.")
        parser = LightParser(prog=self.prog, description=self.description, usage=self.usage,
                             epilog="\n".join(textwrap.fill(line, 100) for line in notes) or None,
                             formatter_class=HelpFormatter)
        if self.trainer:
            parser.add_argument("--help-all", action=FullHelp, full_parser=self.full_parser,
                                help="show this help with the Trainer flags too (imports transformers: a few seconds)")
        own = set()
        for title, dataclass_type in self.groups:
            add_dataclass_arguments(parser.add_argument_group(title), dataclass_type)
            own.update(flag.name for flag in dataclasses.fields(dataclass_type))
        for name, trainer_field in (trainer_names or {}).items():
            if name in own:
                continue
            options, negative = option_strings(name, trainer_field.has_negative)
            parser.add_argument(*options, dest=f"trainer {name}", help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                                **_value_arguments(trainer_field))
            if negative:
                parser.add_argument(*negative, nargs="*", dest=f"trainer {negative[0]}", help=argparse.SUPPRESS,
                                    default=argparse.SUPPRESS)
        return parser

    def check(self, argv):
        """Read `argv` (a list; a single .json file of flags is left to the full parse): --help and --help-all
        print their help and exit (SystemExit 0); a bad flag raises CommandError. Returns the command's own
        dataclasses, in the order of `groups`, once their checks ran (None for a flags file)."""
        argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
        if len(argv) == 1 and argv[0].endswith(".json"):
            return None
        trainer_names = trainer_fields(self.trainer) if self.trainer else {}
        parser = self.parser(trainer_names)
        # Without the Trainer's names (an unreadable source), flags this parser does not know are left to the full
        # parse.
        known_only = trainer_names is None
        values = vars(parser.parse_known_args(argv)[0] if known_only else parser.parse_args(argv))
        # Their own checks (__post_init__), before anything loads.
        return [dataclass_type(**{flag.name: values[flag.name] for flag in dataclasses.fields(dataclass_type)
                                  if flag.init})
                for _, dataclass_type in self.groups]
