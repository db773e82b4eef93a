"""Classification as text (MNLI-style premise / hypothesis -> entailment | neutral | contradiction), with either
head: `--head text` trains the encoder-decoder to write the label (Seq2SeqTrainer, exact-match accuracy; the saved
folder serves `pipeline("text2text-generation", trust_remote_code=True)`); `--head classifier` trains
FAT5ForSequenceClassification (encoder, mean pooling, linear head) on the same data for comparison. With
--do_predict, OUTPUT_DIR/predictions.csv holds (source, reference, prediction) for both heads.

    python -m fat5.recipes.classify --model_name_or_path ./fat5-demo --output_dir out/nli --head text \\
        --train_file train.jsonl --validation_file dev.jsonl --do_train --do_eval [--lora]

A label is a name in --classes, as written (" neutral" is not "neutral"); a JSON integer (or, in a CSV, a number
such as "2") indexes --classes, as GLUE's MNLI stores them; JSON true / false are the names "true" / "false".
Anything else is an error, as are fewer than two classes, a class no training row holds (--classes would not fit
the data: its integer labels would name the wrong classes) and a JSON integer that names one class and indexes
another.
"""

import json
from dataclasses import dataclass, field

from fat5.cli import CommandError, exit_with
from fat5.recipes.arguments import DataArguments, Recipe
from fat5.recipes.command import recipe_main
from fat5.recipes.data import exact_match


@dataclass
class ClassificationArguments(DataArguments):
    head: str = field(default="text", metadata={"help": "text (generate the label) or classifier "
                                                        "(FAT5ForSequenceClassification)",
                                                "choices": ["text", "classifier"]})
    premise_column: str = field(default="premise", metadata={"help": "column with the premise"})
    hypothesis_column: str = field(default="hypothesis", metadata={"help": "column with the hypothesis"})
    label_column: str = field(default="label", metadata={"help": "column with the label"})
    classes: str = field(default="entailment,neutral,contradiction",
                         metadata={"help": "comma-separated label names, in the order of integer labels"})
    max_target_length: int = field(default=16, metadata={"help": "longest label name allowed, in tokens"})

    def __post_init__(self):
        super().__post_init__()
        names = class_names(self)
        if "" in names or len(set(names)) != len(names):
            raise CommandError(f"--classes {self.classes}: names must be non-empty and distinct")
        if len(names) < 2:
            # transformers reads num_labels=1 as a regression: --head classifier would train one without a word.
            raise CommandError(f"--classes {self.classes}: name at least two classes (one leaves nothing to tell "
                               f"apart, and a classifier head with one label is a regression)")


def class_names(data_args):
    return [name.strip() for name in data_args.classes.split(",")]


def label_name(value, names, table, row):
    """A label as one of the class names (see the module docstring)."""
    if isinstance(value, bool):  # tested before int: True is an int to Python, not class 1
        value = json.dumps(value)
    elif isinstance(value, int) and str(value) in names and names.index(str(value)) != value:
        raise CommandError(f"{table.where(row)}: label {value} is ambiguous: the class named {str(value)!r} or "
                           f"the class at index {value} of --classes {','.join(names)}; write labels as names "
                           f"(JSON strings) or list integer-named classes at their own index")
    elif isinstance(value, str) and not table.typed and value not in names:
        # A CSV has no types: a number written as Python writes an int ("2", not "02" or " 2") indexes --classes.
        value = next((index for index in range(len(names)) if str(index) == value), value)
    if isinstance(value, int) and 0 <= value < len(names):
        return names[value]
    if isinstance(value, str) and value in names:
        return value
    raise CommandError(f"{table.where(row)}: label {value!r} is not one of --classes {','.join(names)} "
                       f"(nor an index into them)")


def prompts_and_labels(table, data_args):
    names = class_names(data_args)
    premises = table.texts(data_args.premise_column, "--premise_column")
    hypotheses = table.texts(data_args.hypothesis_column, "--hypothesis_column")
    labels = [label_name(value, names, table, row)
              for row, value in enumerate(table.column(data_args.label_column, "--label_column"))]
    return [f"premise: {p} hypothesis: {h}" for p, h in zip(premises, hypotheses, strict=True)], labels


def every_class_trained(table, labels, data_args):
    """A class no training row holds is a --classes that does not fit the data (integer labels would name the
    wrong classes) and a class the model never sees."""
    held = set(labels)
    missing = [name for name in class_names(data_args) if name not in held]
    if missing:
        rows = f"of the first {len(table)} (--max_train_samples) " if data_args.max_train_samples else ""
        raise CommandError(f"{table.name}: no training row {rows}holds the class{'es' if len(missing) > 1 else ''} "
                           f"{', '.join(map(repr, missing))} of --classes {data_args.classes}; name the classes "
                           f"this data holds, in the order of its integer labels")


def classifier_classes(data_args):
    return class_names(data_args) if data_args.head == "classifier" else None


RECIPE = Recipe(examples=prompts_and_labels, score=exact_match, classes=classifier_classes,
                check_training=every_class_trained, data_arguments=ClassificationArguments, task="text-classification")
main = recipe_main(RECIPE, "classify", __doc__)

if __name__ == "__main__":
    exit_with(main)
