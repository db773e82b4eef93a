"""Plumbing shared by the fine-tuning recipes: flags, data, model loading, LoRA, metrics, one-line errors.

Every recipe parses its own dataclasses plus transformers' `Seq2SeqTrainingArguments` with `HfArgumentParser`,
so all Trainer flags (--output_dir, --max_steps, --bf16, --gradient_checkpointing, --deepspeed, --fsdp, ...)
pass through unchanged.
"""

import csv
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import datasets
import numpy as np
import transformers
from transformers import AutoTokenizer, HfArgumentParser
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger("recipes")
# FAT5's parameter names are T5's: attention projections and (gated) feed-forward layers.
FAT5_LORA_TARGETS = "q,k,v,o,wi_0,wi_1,wo"
SPLITS = ("train", "validation", "test")


class RecipeError(Exception):
    """Bad input or flags: reported as one line on stderr with a non-zero exit."""


@dataclass
class ModelArguments:
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


@dataclass
class DataArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "training data: .csv, .tsv, .json or .jsonl"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "evaluation data (same formats)"})
    test_file: Optional[str] = field(default=None, metadata={"help": "data to predict (same formats)"})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "a `datasets` name instead of files"})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "the dataset's configuration"})
    source_column: str = field(default="source", metadata={"help": "column with the input text"})
    target_column: str = field(default="target", metadata={"help": "column with the output text"})
    source_prefix: str = field(default="", metadata={"help": "text put before every input, e.g. 'summarize: '"})
    max_source_length: int = field(default=512, metadata={"help": "inputs are truncated to this many tokens"})
    max_target_length: int = field(default=128, metadata={"help": "longest target allowed, in tokens (longer "
                                                                  "targets are an error, not truncated)"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "use only the first N training rows"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "use only the first N eval rows"})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "use only the first N test rows"})


def main_wrapper(main):
    """Run `main(argv)` so a RecipeError ends the process with one line on stderr and exit status 2."""
    def run(argv=None):
        try:
            return main(argv)
        except RecipeError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
    return run


def parse_args(dataclass_types, argv, **defaults):
    """HfArgumentParser over the recipe's dataclasses; `defaults` overrides field defaults (e.g. of the Trainer)."""
    parser = HfArgumentParser(dataclass_types)
    parser.set_defaults(**defaults)
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(argv)


def setup(training_args):
    """Console logging as in transformers' examples; returns the checkpoint to resume from (or None)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO if training_args.should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity(logging.INFO if training_args.should_log else logging.WARNING)
    transformers.utils.logging.enable_default_handler()
    transformers.set_seed(training_args.seed)
    resume = training_args.resume_from_checkpoint
    output_dir = Path(training_args.output_dir)
    if resume in ("last", "True", "true"):
        resume = get_last_checkpoint(output_dir) if output_dir.is_dir() else None
        if resume is None:
            raise RecipeError(f"--resume_from_checkpoint {training_args.resume_from_checkpoint}: no checkpoint-* "
                              f"folder in {output_dir}")
    elif resume is not None and not Path(resume).is_dir():
        raise RecipeError(f"--resume_from_checkpoint {resume} is not a folder")
    if training_args.do_train and resume is None and output_dir.is_dir() and any(output_dir.iterdir()):
        raise RecipeError(f"--output_dir {output_dir} is not empty; use another folder or resume with "
                          f"--resume_from_checkpoint last")
    return resume


# ---------------------------------------------------------------------------------------------------------- data

def read_table(path):
    """Rows of a .csv / .tsv / .json (a list of objects) / .jsonl file as a `datasets.Dataset`."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise RecipeError(f"{path}: file is empty")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if suffix == ".tsv" else ","))
    elif suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise RecipeError(f"{path}:{number}: not JSON ({error.msg})") from None
    elif suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise RecipeError(f"{path}:{error.lineno}: not JSON ({error.msg})") from None
    else:
        raise RecipeError(f"{path}: unknown format (use .csv, .tsv, .json or .jsonl)")
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise RecipeError(f"{path}: expected one object per row")
    if not rows:
        raise RecipeError(f"{path}: no rows (only a header?)")
    columns = list(rows[0])
    return datasets.Dataset.from_dict({column: [row.get(column) for row in rows] for column in columns})


def load_splits(data_args, training_args):
    """{split: Dataset} for the splits the run needs, from files or a `datasets` name, cut to --max_*_samples."""
    wanted = {"train": training_args.do_train, "validation": training_args.do_eval, "test": training_args.do_predict}
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    if data_args.dataset_name:
        loaded = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
        # Datasets name their splits differently (validation_matched, ...): the first matching prefix wins.
        files = {split: next((name for name in loaded if name.startswith(split[:4])), None) for split in SPLITS}
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    splits = {}
    for split in SPLITS:
        if not wanted[split]:
            continue
        if files[split] is None:
            flag = "--dataset_name has no such split" if data_args.dataset_name else f"pass --{split}_file"
            do_flag = {"train": "--do_train", "validation": "--do_eval", "test": "--do_predict"}[split]
            raise RecipeError(f"{do_flag} needs {split} data ({flag})")
        dataset = loaded[files[split]] if data_args.dataset_name else read_table(files[split])
        if limits[split] is not None:
            dataset = dataset.select(range(min(limits[split], len(dataset))))
        splits[split] = dataset
    if not splits:
        raise RecipeError("nothing to do: pass --do_train, --do_eval and/or --do_predict")
    return splits


def require_columns(dataset, columns, split):
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise RecipeError(f"{split} data has no column {', '.join(map(repr, missing))} "
                          f"(columns: {', '.join(dataset.column_names)}); set it with the --*_column flags")


def texts(dataset, column, split):
    values = dataset[column]
    for row, value in enumerate(values):
        if not isinstance(value, str) or not value.strip():
            raise RecipeError(f"{split} row {row}: column {column!r} is empty or not text ({value!r})")
    return values


def tokenize_pairs(tokenizer, sources, targets, data_args, split):
    """input_ids/attention_mask (truncated to --max_source_length) and labels; a target longer than
    --max_target_length is an error, since truncating it would teach the model to stop mid-answer."""
    encoded = tokenizer([data_args.source_prefix + text for text in sources], max_length=data_args.max_source_length,
                        truncation=True)
    labels = tokenizer(text_target=list(targets))["input_ids"]
    lengths = [len(label) for label in labels]
    too_long = sum(length > data_args.max_target_length for length in lengths)
    if too_long:
        raise RecipeError(f"{too_long} {split} target(s) are longer than --max_target_length="
                          f"{data_args.max_target_length} tokens (longest: {max(lengths)}); raise the flag")
    return datasets.Dataset.from_dict({**encoded, "labels": labels})


# --------------------------------------------------------------------------------------------------------- model

def load_tokenizer(model_args):
    return AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=True)


def wrap_lora(model, model_args, training_args, task_type, modules_to_save=None):
    """The model with a LoRA adapter on FAT5's projections (only the adapter, and `modules_to_save`, train)."""
    if not model_args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    if training_args.gradient_checkpointing:
        # Frozen embeddings give checkpointed blocks inputs without grad; LoRA weights would get none.
        model.enable_input_require_grads()
    config = LoraConfig(task_type=task_type, r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                        lora_dropout=model_args.lora_dropout, modules_to_save=modules_to_save,
                        target_modules=[name.strip() for name in model_args.lora_target_modules.split(",")])
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        raise RecipeError(f"--lora_target_modules {model_args.lora_target_modules}: {error}") from None
    model.print_trainable_parameters()
    return model


def save(trainer, tokenizer, model_args, training_args):
    """Save the model (or LoRA adapter) and tokenizer to --output_dir; with --merge_lora also the merged model
    to OUTPUT_DIR/merged. Returns the folders written."""
    trainer.save_model()
    folders = [training_args.output_dir]
    if model_args.lora and model_args.merge_lora and trainer.is_world_process_zero():
        merged_dir = Path(training_args.output_dir) / "merged"
        merged = trainer.model.merge_and_unload()
        merged.save_pretrained(merged_dir)
        tokenizer.save_pretrained(merged_dir)
        logger.info("LoRA merged into %s", merged_dir)
        folders.append(str(merged_dir))
    return folders


# ------------------------------------------------------------------------------------------------------- metrics

def decode(tokenizer, ids):
    """Token ids (padded with -100 by the Trainer) to stripped strings."""
    ids = np.where(np.asarray(ids) < 0, tokenizer.pad_token_id, ids)
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def generation_metrics(tokenizer, score):
    """A Trainer `compute_metrics` for predict_with_generate: decodes, then `score(predictions, references)`."""
    def compute_metrics(eval_prediction):
        predictions = decode(tokenizer, eval_prediction.predictions)
        references = decode(tokenizer, eval_prediction.label_ids)
        return {name: round(float(value), 4) for name, value in score(predictions, references).items()}
    return compute_metrics


def exact_match(predictions, references):
    return {"accuracy": float(np.mean([p == r for p, r in zip(predictions, references)]))}


def write_predictions(path, columns):
    """A CSV with one column per entry of `columns` ({name: list}), written whole then renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(list(columns))
        writer.writerows(zip(*columns.values()))
    partial.replace(path)
    logger.info("predictions written to %s", path)


def finish(trainer, split, metrics):
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)


def source_target_pairs(data_args):
    """`build_pairs` for run_seq2seq: the --source_column and --target_column texts."""
    def build_pairs(dataset, split):
        require_columns(dataset, [data_args.source_column, data_args.target_column], split)
        return texts(dataset, data_args.source_column, split), texts(dataset, data_args.target_column, split)
    return build_pairs


def run_seq2seq(model_args, data_args, training_args, build_pairs, score):
    """Fine-tune with Seq2SeqTrainer, evaluate with generation and `score`, write test predictions to
    OUTPUT_DIR/predictions.csv (source, reference, prediction) and save. `build_pairs(dataset, split)` returns
    the (sources, targets) texts of a split. Under ZeRO-3 or FSDP, Seq2SeqTrainer generates with synced_gpus."""
    from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, Seq2SeqTrainer

    resume = setup(training_args)
    tokenizer = load_tokenizer(model_args)
    splits = load_splits(data_args, training_args)
    pairs = {split: build_pairs(dataset, split) for split, dataset in splits.items()}
    tokenized = {split: tokenize_pairs(tokenizer, *pair, data_args, split) for split, pair in pairs.items()}
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, trust_remote_code=True)
    if training_args.generation_max_length is None and model.generation_config.max_new_tokens is None:
        training_args.generation_max_length = data_args.max_target_length
    model = wrap_lora(model, model_args, training_args, task_type="SEQ_2_SEQ_LM")
    trainer = Seq2SeqTrainer(
        model=model, args=training_args, train_dataset=tokenized.get("train"),
        eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8),
        compute_metrics=generation_metrics(tokenizer, score) if training_args.predict_with_generate else None)
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=resume)
        finish(trainer, "train", result.metrics)
        save(trainer, tokenizer, model_args, training_args)
    if training_args.do_eval:
        finish(trainer, "eval", trainer.evaluate())
    if training_args.do_predict:
        output = trainer.predict(tokenized["test"], metric_key_prefix="test")
        finish(trainer, "test", output.metrics)
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            sources, references = pairs["test"]
            write_predictions(Path(training_args.output_dir) / "predictions.csv",
                              {"source": sources, "reference": references,
                               "prediction": decode(tokenizer, output.predictions)})
    return trainer
