"""The Trainer commands' flags are read by transformers' HfArgumentParser (fat5/training/flags.py), from the command
line or a flags file, and every value no run can use is one `error:` line, exit status 2, before any model loads: a
non-finite or negative learning rate, a batch of 0, no accumulation steps, a negative worker count, a step count that
is not an integer, a non-UTF-8 output folder name, ... (tests/test_commands.py: --help before torch loads)."""

import json
import re

import pytest

from fat5.recipes import classify, predict, summarization, train, translation
from fat5.training import pretrain, pretraining

RECIPES = {"train": train, "translation": translation, "summarization": summarization, "classify": classify}
COMMANDS = {**RECIPES, "pretrain": pretrain}


def test_the_recipes_say_the_generation_length_they_use():
    """Not transformers' "the model configuration's max_length": the runner's (test_recipes.py tests its effect)."""
    from fat5.recipes.runner import recipe_parser

    help_text = " ".join(recipe_parser(translation.RECIPE).format_help().split())
    assert "(default: the model's generation config when it sets max_new_tokens, else --max_target_length)" in help_text


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_recipes_log_the_loss_ten_times_a_run_unless_told(name, capsys):
    """Trainer's default logs every 500 steps: nothing in a short run. A recipe logs ten times a run (a ratio of the
    run's steps), says so in --help, and keeps a value given."""
    from fat5.recipes.runner import recipe_parser
    from fat5.training.flags import parse

    base = ["--model_name_or_path", "m", "--output_dir", "o", "--do_train"]
    assert parse(recipe_parser(RECIPES[name].RECIPE), base)[-1].logging_steps == 0.1
    assert parse(recipe_parser(RECIPES[name].RECIPE), [*base, "--logging_steps", "7"])[-1].logging_steps == 7
    with pytest.raises(SystemExit):
        RECIPES[name].main(["--help"])
    assert "Trainer defaults changed here: logging_steps 0.1" in capsys.readouterr().out


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


BAD_VALUES = [
    (["--learning_rate", "nan"], "--learning_rate nan: must be a finite number"),
    (["--learning_rate", "inf"], "--learning_rate inf: must be a finite number"),
    (["--learning_rate", "-1"], "--learning_rate -1.0: must be between 1.18e-38 and 3.4e+38, float32's range, in "
                                "which the optimizer computes (a smaller rate rounds to 0, a larger one overflows)"),
    (["--learning_rate", "0"], "--learning_rate 0.0: must be between 1.18e-38"),
    # A rate that parses to 0.0 (the optimizer would refuse it, or Trainer train nothing).
    (["--learning_rate", "1e-400"], "--learning_rate 0.0: must be between 1.18e-38"),
    # Finite, but no float32 weight can take its steps (the optimizer's RuntimeError: "value cannot be converted to
    # type float without overflow").
    (["--learning_rate", "1e308"], "--learning_rate 1e+308: must be between 1.18e-38"),
    # numpy's seeds are 0 to 2**32 - 1 (Trainer's set_seed seeds numpy with torch).
    (["--seed", "-1"], "--seed -1: must be between 0 and 4294967295 (2**32 - 1: numpy's seeds"),
    (["--seed", str(2**32)], "--seed 4294967296: must be between 0 and 4294967295"),
    (["--data_seed", str(10**23)], "--data_seed 100000000000000000000000: must be between 0 and 4294967295"),
    # TrainingArguments itself reads --eval_steps 0 as --logging_steps: refused as given.
    (["--eval_steps", "0"], "--eval_steps 0.0: must be more than 0"),
    (["--learning_rate", "abc"], "argument --learning_rate/--learning-rate: invalid float value: 'abc'"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: must be at least 1"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1"),
    (["--dataloader_num_workers", "-1"], "--dataloader_num_workers -1: must be 0 or more"),
    (["--max-steps", "2.5"], "invalid int value: '2.5'"),
    (["--max_steps", "0"], "--max_steps 0: must be at least 1 (or -1: train --num_train_epochs)"),
    (["--weight_decay", "nan"], "--weight_decay nan: must be a finite number"),
    (["--adam_beta1", "1.5"], "--adam_beta1 1.5: must be below 1"),
    (["--adam_epsilon", "0"], "--adam_epsilon 0.0: must be more than 0"),
    (["--max_grad_norm", "-1"], "--max_grad_norm -1.0: must be 0 or more"),
    (["--save_steps", "nan"], "--save_steps nan: must be a finite number"),
    (["--bf16", "maybe"], "Truthy value expected"),
    (["--no-such-flag"], "Some specified arguments are not used by the HfArgumentParser: ['--no-such-flag']"),
]


def command_line(command, tmp_path, *more):
    """A command line that gets `command` as far as its flags (its model folder is no model: nothing loads)."""
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "t.csv").write_text("source,target\na,b\n")
    if command == "pretrain":
        base = ["--train_files", tmp_path / "t.csv", "--max_steps", 2]
    else:
        base = ["--model_name_or_path", tmp_path / "m", "--do_train", "--train_file", tmp_path / "t.csv"]
    return [str(arg) for arg in (*base, "--output_dir", tmp_path / "out", *more)]


def one_error_line(capsys, main, argv):
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("flags, says", BAD_VALUES, ids=[" ".join(flags) for flags, _ in BAD_VALUES])
def test_a_trainer_value_no_run_can_use_is_one_line_before_anything_loads(command, flags, says, tmp_path, capsys):
    line = one_error_line(capsys, COMMANDS[command].main, command_line(command, tmp_path, *flags))
    assert says in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_a_flags_file_is_read_as_the_command_line(command, tmp_path, capsys):
    """A flags file's values are checked as the command line's are: a string where a number belongs, a number
    that is impossible, a key no flag has."""
    argv = command_line(command, tmp_path)
    flags = {argv[index][2:]: argv[index + 1] for index in range(0, len(argv), 2) if argv[index] != "--do_train"} \
        if command == "pretrain" else {"model_name_or_path": argv[1], "do_train": True, "train_file": argv[4],
                                       "output_dir": argv[6]}
    for more, says in [({"max_steps": "two"}, "argument --max_steps/--max-steps: invalid int value: 'two'"),
                       ({"max_steps": 2.5}, "invalid int value: '2.5'"),
                       ({"learning_rate": -1}, "--learning_rate -1.0: must be between 1.18e-38"),
                       ({"seed": 10**23}, "--seed 100000000000000000000000: must be between 0 and 4294967295"),
                       ({"gradient_accumulation_steps": 0}, "--gradient_accumulation_steps 0: must be at least 1"),
                       ({"max_step": 2}, "names flags this command does not have: max_step")]:
        (tmp_path / "flags.json").write_text(json.dumps({**flags, **more}))
        line = one_error_line(capsys, COMMANDS[command].main, [str(tmp_path / "flags.json")])
        assert says in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_flags_after_a_flags_file_override_its_values(command, tmp_path, capsys):
    """`fat5 train flags.json --max_steps 2`: the file is read, and a flag given after it overrides its value (as
    transformers' HfArgumentParser lets a command line override its args files); a bad value is refused wherever
    it comes from."""
    from fat5.recipes.runner import recipe_parser
    from fat5.training.flags import given_flags, parse

    argv = command_line(command, tmp_path)
    flags = {argv[index][2:]: argv[index + 1] for index in range(0, len(argv), 2) if argv[index] != "--do_train"} \
        if command == "pretrain" else {"model_name_or_path": argv[1], "do_train": True, "train_file": argv[4],
                                       "output_dir": argv[6]}
    (tmp_path / "flags.json").write_text(json.dumps({**flags, "learning_rate": 1e-3, "seed": 7}))
    file_and_flags = [str(tmp_path / "flags.json"), "--learning_rate", "2e-3", "--report_to", "none"]
    parsed = pretraining.parse_args(file_and_flags) if command == "pretrain" else \
        parse(recipe_parser(train.RECIPE), file_and_flags)
    training_args = parsed[-1]
    assert (training_args.learning_rate, training_args.seed, training_args.report_to) == (2e-3, 7, [])
    assert {"learning_rate", "seed", "report_to", "output_dir"} <= given_flags(file_and_flags)
    line = one_error_line(capsys, COMMANDS[command].main, [str(tmp_path / "flags.json"), "--seed", "-1"])
    assert "--seed -1: must be between 0 and 4294967295" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, says", [
    (["--max_input_length", str(10**12)], "--max_input_length 1000000000000: must be at most 2,147,483,647 tokens "
                                          "(FAT5 counts positions with 32-bit integers)"),
    (["--max_input_length", "0"], "--max_input_length 0: must be at least 1"),
    (["--max_target_length", "-3"], "--max_target_length -3: must be at least 1"),
    (["--tokenizer_vocab_size", "0"], "--tokenizer_vocab_size 0: must be at least 1"),
    (["--z_loss", "nan"], "--z_loss nan: must be a finite number"),
    (["--z_loss", "-1"], "--z_loss -1.0: must be 0 or more"),
    # Pretraining evaluates nothing: Trainer would stop at its start without an evaluation dataset.
    (["--eval_strategy", "steps", "--eval_steps", "5"], "--eval_strategy steps: pretraining has no evaluation data"),
    (["--do_eval"], "--do_eval: pretraining has no evaluation data"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_pretraining_refuses_lengths_and_values_it_cannot_use(flags, says, tmp_path, capsys):
    """Before anything is written (a length of 10**12 tokens was once taken, and the example lengths counted down
    from it for hours)."""
    line = one_error_line(capsys, pretrain.main, command_line("pretrain", tmp_path, *flags))
    assert says in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_an_output_folder_name_that_is_not_utf8_is_refused_before_training(command, tmp_path, capsys):
    """Not trained, then failing in the final save (transformers writes the name into JSON and the model card)."""
    name = str(tmp_path / b"out\xff".decode("utf-8", "surrogateescape"))
    argv = command_line(command, tmp_path)
    argv[argv.index("--output_dir") + 1] = name
    line = one_error_line(capsys, COMMANDS[command].main, argv)
    assert re.fullmatch(r"error: --output_dir .*out\\xff: the name is not UTF-8 text, which the run's JSON files and "
                        r"model card must hold; choose a UTF-8 name", line), line


def test_predict_reads_its_flags_with_hf_argument_parser(tmp_path, capsys):
    line = one_error_line(capsys, predict.main, ["--model", tmp_path, "--input_file", tmp_path / "i.csv",
                                                 "--output_file", tmp_path / "o.csv", "--num_beams", "x"])
    assert "argument --num_beams/--num-beams: invalid int value: 'x'" in line
    # A NaN length penalty ranks every beam alike: every prediction would be wrong, with exit status 0.
    line = one_error_line(capsys, predict.main, ["--model", tmp_path, "--input_file", tmp_path / "i.csv",
                                                 "--output_file", tmp_path / "o.csv", "--num_beams", "2",
                                                 "--length_penalty", "nan"])
    assert line == "error: --length_penalty nan: must be a finite number"
