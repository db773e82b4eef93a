"""A recipe's command: its `main(argv=None)`, under fat5/cli.py's convention. --help, and a missing library of the
"recipes" extra, are answered first (fat5/training/flags.py), before torch, transformers' Trainer and datasets load
with the runner (fat5/recipes/runner.py), which parses the flags, inside `fat5.cli.run`, where Ctrl-C is handled.
"""

from fat5 import cli
from fat5.cli import require, run
from fat5.recipes.arguments import FileFormatArguments, ModelArguments, changed_defaults
from fat5.training.flags import CommandFlags, RunFolderArguments


def recipe_flags(recipe, name, description):
    """The recipe's --help and --help-all (`CommandFlags`)."""
    def full_parser():
        from fat5.recipes.runner import recipe_parser

        return recipe_parser(recipe, prog, description, usage)

    prog = f"python -m fat5.recipes.{name}"
    own = (ModelArguments, recipe.data_arguments, FileFormatArguments, RunFolderArguments)
    changed = ", ".join(f"{flag} {str(value).lower()}" for flag, value in changed_defaults(recipe).items())
    notes = [f"Trainer defaults changed here: {changed} (the loss is logged ten times a run"
             f"{'; evaluation and --do_predict generate' if recipe.seq2seq else ''})."]
    trainer = "Seq2SeqTrainingArguments" if recipe.seq2seq else "TrainingArguments"
    usage = (f"{prog} --model_name_or_path FOLDER --output_dir DIR --do_train|--do_eval|--do_predict\n"
             f"{' ' * len('usage: ' + prog)} [--train_file FILE ...] [options] [Trainer options]")
    return CommandFlags(prog, description, own, full_parser=full_parser, trainer=trainer, usage=usage, notes=notes)


def recipe_main(recipe, name, description):
    """The recipe's `main(argv=None)`: the runner under fat5/cli.py's convention, returning the exit status. `name`:
    the recipe's module in fat5.recipes; `description`: its --help text."""
    flags = recipe_flags(recipe, name, description)

    def command(argv, progress):
        flags.answer_help(argv)
        require("recipes", "accelerate", "datasets", *recipe.libraries)
        from fat5.recipes.runner import fine_tune  # heavy imports, once Ctrl-C is handled

        fine_tune(recipe, argv, progress, program=cli.program or f"python -m fat5.recipes.{name}")

    def main(argv=None):
        return run(command, argv, extra="recipes")
    return main
