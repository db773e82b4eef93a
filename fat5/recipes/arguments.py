"""The recipes' own flags and what a recipe adds to the one runner (fat5/recipes/runner.py).

Every recipe parses these dataclasses plus transformers' `Seq2SeqTrainingArguments` (or `TrainingArguments`) with
`HfArgumentParser`, so all Trainer flags (--output_dir, --max_steps, --bf16, --activation_checkpointing,
--deepspeed, --fsdp, ...) pass through unchanged.

Only the standard library is imported here (fat5/recipes/data.py uses no more), so that a recipe's command
(fat5/recipes/command.py) answers --help before torch, transformers' Trainer and datasets load.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from fat5.cli import CommandError
from fat5.recipes.data import MAX_FIELD_CHARS, TSV_QUOTING

# FAT5's parameter names are T5's: attention projections and (gated) feed-forward layers.
FAT5_LORA_TARGETS = "q,k,v,o,wi_0,wi_1,wo"


def require_positive(arguments, *names):
    """Flags that count something (beams, tokens, rows) must count at least one; None means "not given"."""
    for name in names:
        value = getattr(arguments, name)
        if value is not None and value < 1:
            raise CommandError(f"--{name} {value}: must be at least 1")


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model_name_or_path: str = field(metadata={"help": "FAT5 checkpoint folder or Hub id (loaded with "
                                                      "trust_remote_code=True)"})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter (PEFT) instead of all weights"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator"})
    lora_dropout: float = field(default=0.05, metadata={"help": "dropout on the LoRA branch"})
    lora_target_modules: str = field(default=FAT5_LORA_TARGETS,
                                     metadata={"help": "comma-separated module names to adapt"})
    merge_lora: bool = field(default=False, metadata={"help": "also save the base model with the adapter merged "
                                                              "into OUTPUT_DIR/merged"})

    def __post_init__(self):
        require_positive(self, "lora_r", "lora_alpha")
        if not 0 <= self.lora_dropout < 1:
            raise CommandError(f"--lora_dropout {self.lora_dropout}: must be in [0, 1)")
        if not self.lora:
            given = [f"--{flag.name}" for flag in fields(self)
                     if flag.name.startswith(("lora_", "merge_lora")) and getattr(self, flag.name) != flag.default]
            if given:
                raise CommandError(f"{', '.join(given)} has no effect without --lora")


@dataclass
class DataArguments:
    _argument_group_name = "data"

    train_file: str | None = field(default=None, metadata={"help": "training data: .csv, .tsv, .json or .jsonl"})
    validation_file: str | None = field(default=None, metadata={"help": "evaluation data (same formats)"})
    test_file: str | None = field(default=None, metadata={"help": "data to predict (same formats)"})
    dataset_name: str | None = field(default=None, metadata={"help": "a `datasets` name instead of files"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "the dataset's configuration"})
    source_column: str = field(default="source", metadata={"help": "column with the input text"})
    target_column: str = field(default="target", metadata={"help": "column with the output text"})
    source_prefix: str = field(default="", metadata={"help": "text put before every input, e.g. 'summarize: '"})
    max_source_length: int = field(default=512, metadata={"help": "inputs are truncated to this many tokens"})
    max_target_length: int = field(default=128, metadata={"help": "longest target allowed, in tokens (longer "
                                                                  "targets are an error, not truncated)"})
    max_train_samples: int | None = field(default=None, metadata={"help": "use only the first N training rows"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use only the first N eval rows"})
    max_predict_samples: int | None = field(default=None, metadata={"help": "use only the first N test rows"})
    packing: bool = field(default=False, metadata={
        "help": "train on packed rows: the examples of a batch share rows of up to --max_source_length input and "
                "--max_target_length target tokens, kept apart by FAT5's segment ids (same examples per step, less "
                "padding; evaluation and prediction keep one example a row)"})

    def __post_init__(self):
        require_positive(self, "max_source_length", "max_target_length", "max_train_samples", "max_eval_samples",
                         "max_predict_samples")
        if self.dataset_name and any((self.train_file, self.validation_file, self.test_file)):
            raise CommandError("--dataset_name and the --*_file flags are exclusive: pass one or the other")
        if self.dataset_config_name and not self.dataset_name:
            raise CommandError("--dataset_config_name has no effect without --dataset_name")


@dataclass
class FileFormatArguments:
    """How data files are read (fat5/recipes/data.py), by every recipe and fat5.recipes.predict."""

    _argument_group_name = "data files"

    tsv_quoting: str = field(default="none", metadata={
        "help": "none: a .tsv is TSV, one row a line, fields split at tabs, quote characters kept as data; csv: "
                "CSV quote rules with tabs (quoted values may hold tabs and line breaks)",
        "choices": list(TSV_QUOTING)})
    max_field_chars: int = field(default=MAX_FIELD_CHARS, metadata={
        "help": "longest field (a CSV or TSV value, a JSON string) read from a data file, in characters; a longer "
                "one is an error"})

    def __post_init__(self):
        require_positive(self, "max_field_chars")

    def check_effect(self, paths):
        """The flags act on the data files `paths` (None where not given): without one they would have no
        effect, an error."""
        paths = [str(path) for path in paths if path is not None]
        if self.tsv_quoting != "none" and not any(path.lower().endswith(".tsv") for path in paths):
            raise CommandError(f"--tsv_quoting {self.tsv_quoting} has no effect without a .tsv data file")
        if self.max_field_chars != MAX_FIELD_CHARS and not paths:
            raise CommandError("--max_field_chars has no effect without a data file")


def source_target(table, data_args):
    """The --source_column and --target_column texts of a split."""
    return (table.texts(data_args.source_column, "--source_column"),
            table.texts(data_args.target_column, "--target_column"))


@dataclass(frozen=True)
class Recipe:
    """What a recipe adds to the runner.

    examples(table, data_args) -> (input texts, target texts) of a split (a fat5.recipes.data Table).
    score(predictions, references) -> {metric: value}, on texts.
    classes(data_args) -> the label names when the recipe trains a classification head (targets are then one of
        them), or None when the model writes its targets.
    check_training(table, targets, data_args): refuses training rows the recipe cannot learn from as they are
        (classification: a class no training row holds), before the model loads.
    seq2seq: Seq2SeqTrainer and its flags, generating for evaluation; False: the plain Trainer, no --do_predict.
    libraries: what the recipe imports of the "recipes" extra besides Trainer's accelerate and datasets (its
        metric's library), checked before anything runs.
    task: the Hub task id its model cards name.
    """

    examples: Callable = source_target
    score: Callable | None = None
    classes: Callable | None = None
    check_training: Callable | None = None
    data_arguments: type = DataArguments
    seq2seq: bool = True
    libraries: tuple = ()
    task: str = "text2text-generation"


# The Trainer defaults every recipe changes: the loss is logged ten times a run, whatever its length (Trainer's 500
# steps would log nothing in a short run, and every 500 steps in a long one).
RECIPE_DEFAULTS = {"logging_steps": 0.1}
# The Trainer defaults a seq2seq recipe changes: evaluation and --do_predict generate (and score the texts).
SEQ2SEQ_DEFAULTS = {"predict_with_generate": True}


def changed_defaults(recipe):
    """The Trainer defaults `recipe` changes: {flag: value}."""
    return {**RECIPE_DEFAULTS, **(SEQ2SEQ_DEFAULTS if recipe.seq2seq else {})}
