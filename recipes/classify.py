"""Classification as text (MNLI-style premise / hypothesis -> entailment | neutral | contradiction), with either
head: `--head text` trains the encoder-decoder to write the label (Seq2SeqTrainer, exact-match accuracy; the saved
folder serves `pipeline("text2text-generation", trust_remote_code=True)`); `--head classifier` trains
FAT5ForSequenceClassification (encoder, mean pooling, linear head) on the same data for comparison.

    python -m recipes.classify --model_name_or_path ./fat5-demo --output_dir out/nli --head text \\
        --train_file train.jsonl --validation_file dev.jsonl --do_train --do_eval [--lora]

Labels are the label names, or integers indexing --classes (as GLUE's MNLI stores them).
"""

from dataclasses import dataclass, field

import numpy as np
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, Seq2SeqTrainingArguments, Trainer

from recipes.common import DataArguments, ModelArguments, RecipeError, finish
from recipes.common import exact_match, load_splits, load_tokenizer, main_wrapper, parse_args, require_columns
from recipes.common import run_seq2seq, save, setup, texts, wrap_lora


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


def prompt(premise, hypothesis):
    return f"premise: {premise} hypothesis: {hypothesis}"


def examples(dataset, split, data_args):
    """(prompts, label names) of a split; an unknown label is an error."""
    names = [name.strip() for name in data_args.classes.split(",")]
    require_columns(dataset, [data_args.premise_column, data_args.hypothesis_column, data_args.label_column], split)
    premises = texts(dataset, data_args.premise_column, split)
    hypotheses = texts(dataset, data_args.hypothesis_column, split)
    labels = []
    for row, label in enumerate(dataset[data_args.label_column]):
        label = label.strip() if isinstance(label, str) else label
        if isinstance(label, str) and label.isdigit():
            label = int(label)
        if isinstance(label, int) and 0 <= label < len(names):
            label = names[label]
        if label not in names:
            raise RecipeError(f"{split} row {row}: label {label!r} is not one of --classes {','.join(names)}")
        labels.append(label)
    return [prompt(p, h) for p, h in zip(premises, hypotheses)], labels, names


def train_classifier(model_args, data_args, training_args):
    resume = setup(training_args)
    tokenizer = load_tokenizer(model_args)
    splits = load_splits(data_args, training_args)
    tokenized = {}
    for split, dataset in splits.items():
        prompts, labels, names = examples(dataset, split, data_args)
        encoded = tokenizer(prompts, max_length=data_args.max_source_length, truncation=True)
        tokenized[split] = dataset.from_dict({**encoded, "labels": [names.index(label) for label in labels]})
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, trust_remote_code=True, num_labels=len(names),
        id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)})
    model = wrap_lora(model, model_args, training_args, task_type="SEQ_CLS",
                      modules_to_save=["classification_head"])

    def accuracy(eval_prediction):
        return {"accuracy": float(np.mean(eval_prediction.predictions.argmax(-1) == eval_prediction.label_ids))}

    trainer = Trainer(model=model, args=training_args, train_dataset=tokenized.get("train"),
                      eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
                      compute_metrics=accuracy)
    if training_args.do_train:
        finish(trainer, "train", trainer.train(resume_from_checkpoint=resume).metrics)
        save(trainer, tokenizer, model_args, training_args)
    if training_args.do_eval:
        finish(trainer, "eval", trainer.evaluate())
    if training_args.do_predict:
        finish(trainer, "test", trainer.predict(tokenized["test"], metric_key_prefix="test").metrics)
    return trainer


@main_wrapper
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, ClassificationArguments, Seq2SeqTrainingArguments), argv, predict_with_generate=True)
    if data_args.head == "classifier":
        training_args.predict_with_generate = False
        return train_classifier(model_args, data_args, training_args)

    def build_pairs(dataset, split):
        prompts, labels, _ = examples(dataset, split, data_args)
        return prompts, labels

    return run_seq2seq(model_args, data_args, training_args, build_pairs, exact_match)


if __name__ == "__main__":
    main()
