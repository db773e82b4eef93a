"""fat5/training/flags.py reads transformers' Trainer flags from its installed source, without importing it: their
names, and the types of the numeric and yes/no ones. Under every transformers release they must be the flags and types
HfArgumentParser makes. This module imports no Trainer (nor `datasets`), so the drift check (tests/test_drift.py)
runs it under each release in the same environment."""

import pytest
import transformers
from transformers import HfArgumentParser

from fat5.training.flags import TRAINER_CLASSES, option_strings, trainer_fields


def options_of(parser):
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


@pytest.mark.parametrize("class_name", list(TRAINER_CLASSES))
def test_trainer_flags_read_from_source_are_the_ones_hf_argument_parser_makes(class_name):
    fields = trainer_fields(class_name)
    assert fields, f"transformers {transformers.__version__}: {class_name} not read from its source"
    read = {option for name, field in fields.items() for options in option_strings(name, field.has_negative)
            for option in options}
    assert read == options_of(HfArgumentParser(getattr(transformers, class_name)))


@pytest.mark.parametrize("class_name", list(TRAINER_CLASSES))
def test_trainer_flags_typed_from_source_have_hf_argument_parsers_types(class_name):
    """A Trainer flag the light parser types (int, float, bool) has that type in HfArgumentParser too, so the light
    parser refuses only values the full parse would refuse; the common numeric and bool flags are among them."""
    fields = trainer_fields(class_name)
    full = {option: action for action in HfArgumentParser(getattr(transformers, class_name))._actions
            for option in action.option_strings}
    typed = {name: field.kind for name, field in fields.items() if field.kind is not None}
    for name, kind in typed.items():
        action = full[f"--{name}"]
        if kind is bool:
            expected_nargs = "?" if fields[name].bare else None  # `--tf32` alone: a value is required
            assert action.type.__name__ == "string_to_bool" and action.nargs == expected_nargs, name
        else:
            assert action.type is kind and action.nargs is None, name
    for name in ("learning_rate", "max_steps", "per_device_train_batch_size", "seed", "bf16", "warmup_steps"):
        assert name in typed, (transformers.__version__, name)
