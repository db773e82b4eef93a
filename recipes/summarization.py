"""Summarisation, up to FLAN-T5-XXL sizes: Seq2SeqTrainer scored with ROUGE (rouge-score, offline).

    python -m recipes.summarization --model_name_or_path ./fat5-demo --output_dir out/summarization \\
        --train_file train.jsonl --validation_file dev.jsonl --do_train --do_eval \\
        --bf16 --gradient_checkpointing [--deepspeed recipes/configs/ds_zero3_bf16.json] [--lora]

Large models: launch with `deepspeed --num_gpus N -m recipes.summarization ... --deepspeed
recipes/configs/ds_zero3_bf16.json` (or ds_zero3_offload_bf16.json), or `accelerate launch --config_file
recipes/configs/fsdp.yaml -m recipes.summarization ...`. Seq2SeqTrainer generates with synced_gpus under both.
"""

from dataclasses import dataclass, field

import numpy as np
from rouge_score import rouge_scorer
from transformers import Seq2SeqTrainingArguments

from recipes.common import DataArguments, ModelArguments, main_wrapper, parse_args
from recipes.common import run_seq2seq, source_target_pairs

ROUGE_TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]


@dataclass
class SummarizationDataArguments(DataArguments):
    source_column: str = field(default="document", metadata={"help": "column with the text to summarise"})
    target_column: str = field(default="summary", metadata={"help": "column with the reference summary"})


def rouge(predictions, references):
    """Mean ROUGE F1 (x100). rougeLsum splits summaries into sentences at newlines."""
    scorer = rouge_scorer.RougeScorer(ROUGE_TYPES, use_stemmer=True)
    scores = [scorer.score(reference, prediction) for prediction, reference in zip(predictions, references)]
    return {name: 100 * float(np.mean([score[name].fmeasure for score in scores])) for name in ROUGE_TYPES}


@main_wrapper
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, SummarizationDataArguments, Seq2SeqTrainingArguments), argv, predict_with_generate=True)
    return run_seq2seq(model_args, data_args, training_args, source_target_pairs(data_args), rouge)


if __name__ == "__main__":
    main()
