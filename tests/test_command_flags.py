"""fat5/training/flags.py reads a command line before torch and transformers load; HfArgumentParser reads it again
once they have. The two must agree under every tested transformers: on the command's own flags and on their values,
and on the Trainer's flag names and types (tests/test_trainer_flags.py)."""

import dataclasses
import re

import pytest
from test_trainer_flags import options_of
from transformers import HfArgumentParser

from fat5.cli import CommandError
from fat5.recipes import classify, predict, summarization, train, translation
from fat5.recipes.command import recipe_flags
from fat5.training import pretrain, pretraining
from fat5.training.flags import trainer_fields

RECIPES = {"train": train, "translation": translation, "summarization": summarization, "classify": classify}


def command_flags():
    flags = {name: recipe_flags(module.RECIPE, name, module.__doc__) for name, module in RECIPES.items()}
    return {**flags, "predict": predict.FLAGS, "pretrain": pretrain.FLAGS}


# Own flags of every type the commands use, spelled both ways (--a_b and --a-b).
SAMPLES = {
    "recipe": [["--model_name_or_path", "m"],
               ["--model-name-or-path", "m", "--lora", "--lora_r", "4", "--lora-dropout", "0.1", "--merge_lora",
                "false", "--max_source_length", "7", "--max-train-samples", "3", "--source_prefix", "x: ",
                "--tsv_quoting", "csv", "--overwrite_output_dir", "--resume-with-changed-settings", "yes"]],
    "predict": [["--model", "m", "--input_file", "i.csv", "--output_file", "o.csv"],
                ["--model", "m", "--input-file", "i.csv", "--output_file", "o.csv", "--num_beams", "3",
                 "--length_penalty", "0.5", "--reference_column", "target", "--max_field_chars", "9"]],
    "pretrain": [[], ["--train_files", "a.txt", "b/", "--z_loss", "0.5", "--resize_embeddings", "--packing", "off",
                      "--mixture", "t5", "--tokenizer-vocab-size", "100", "--optimizer", "adamw"]],
}


@pytest.mark.parametrize("command", list(command_flags()))
def test_own_flags_read_as_hf_argument_parser_reads_them(command, tmp_path, monkeypatch):
    """Same options, and the same values for each sample command line (the checks of the dataclasses included)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    flags = command_flags()[command]
    own = [dataclass_type for _, dataclass_type in flags.groups]
    light = flags.parser(trainer_fields(flags.trainer) if flags.trainer else {})
    full = HfArgumentParser(own)
    assert options_of(full) <= options_of(light)
    samples = SAMPLES["recipe" if command in RECIPES else command]
    for argv in samples:
        expected = [dataclasses.asdict(values) for values in full.parse_args_into_dataclasses(argv)]
        assert [dataclasses.asdict(values) for values in flags.check(argv)] == expected, argv


def test_the_recipes_say_the_generation_length_they_use():
    """Not transformers' "the model configuration's max_length": the runner's (test_recipes.py tests its effect)."""
    from fat5.recipes.runner import recipe_parser

    help_text = " ".join(recipe_parser(translation.RECIPE).format_help().split())
    assert "(default: the model's generation config when it sets max_new_tokens, else --max_target_length)" in help_text


def test_pretraining_says_and_uses_its_own_learning_rate_defaults(tmp_path):
    """Not Trainer's 5e-05: 2e-2 for a new model (adamw_scale), 1e-4 when continuing (adamw), whatever the flag's
    spelling when given."""
    help_text = " ".join(pretraining.full_parser().format_help().split())
    assert "5e-05" not in help_text and "(default: 0.02 with --optimizer adamw_scale, 0.0001 with" in help_text
    base = ["--output_dir", str(tmp_path / "o"), "--max_steps", "1"]
    assert pretraining.parse_args(base)[1].learning_rate == 2e-2
    assert pretraining.parse_args([*base, "--model_name_or_path", "x"])[1].learning_rate == 1e-4
    assert pretraining.parse_args([*base, "--optimizer", "adamw"])[1].learning_rate == 1e-4
    for flag in ("--learning_rate", "--learning-rate", "--learning_r"):  # argparse takes unambiguous prefixes
        assert pretraining.parse_args([*base, flag, "3e-3"])[1].learning_rate == 3e-3


BAD_TRAINER_VALUES = [(["--learning_rate", "abc"], "invalid float value: 'abc'"),
                      (["--max-steps", "2.5"], "invalid int value: '2.5'"),
                      (["--bf16", "maybe"], "Truthy value expected")]


@pytest.mark.parametrize("command", ["train", "pretrain"])
@pytest.mark.parametrize("argv, says", BAD_TRAINER_VALUES, ids=[argv[0] for argv, _ in BAD_TRAINER_VALUES])
def test_a_bad_value_of_a_typed_trainer_flag_is_refused_by_the_light_parser(command, argv, says, tmp_path,
                                                                           monkeypatch):
    """The light parser's line, as HfArgumentParser would word it (before torch and transformers load:
    tests/test_commands.py); a good value of the same flags passes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    flags = command_flags()[command]
    base = ["--model_name_or_path", "m"] if command in RECIPES else []
    with pytest.raises(CommandError, match=re.escape(says)):
        flags.check([*base, *argv])
    flags.check([*base, "--learning_rate", "3e-4", "--max_steps", "2", "--bf16", "--bf16", "no"])
