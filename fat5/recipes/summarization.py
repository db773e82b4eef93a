"""Summarisation, up to FLAN-T5-XXL sizes: Seq2SeqTrainer scored with ROUGE (rouge-score, offline).

    python -m fat5.recipes.summarization --model_name_or_path ./fat5-demo --output_dir out/summarization \\
        --train_file train.jsonl --validation_file dev.jsonl --do_train --do_eval \\
        --bf16 --activation_checkpointing [--deepspeed fat5/recipes/configs/ds_zero3_bf16.json] [--lora]

Large models: launch with `deepspeed --num_gpus N -m fat5.recipes.summarization ... --deepspeed
fat5/recipes/configs/ds_zero3_bf16.json` (or ds_zero3_offload_bf16.json), or `accelerate launch --config_file
fat5/recipes/configs/fsdp.yaml -m fat5.recipes.summarization ...`. Seq2SeqTrainer generates with synced_gpus under both.
"""

from dataclasses import dataclass, field

from fat5.cli import exit_with
from fat5.recipes.arguments import DataArguments, Recipe
from fat5.recipes.command import recipe_main

ROUGE_TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]


@dataclass
class SummarizationDataArguments(DataArguments):
    source_column: str = field(default="document", metadata={"help": "column with the text to summarise"})
    target_column: str = field(default="summary", metadata={"help": "column with the reference summary"})


def rouge(predictions, references):
    """Mean ROUGE F1 (x100). rougeLsum splits summaries into sentences at newlines."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(ROUGE_TYPES, use_stemmer=True)
    scores = [scorer.score(reference, prediction)
              for prediction, reference in zip(predictions, references, strict=True)]
    return {name: 100 * sum(score[name].fmeasure for score in scores) / len(scores) for name in ROUGE_TYPES}


RECIPE = Recipe(score=rouge, data_arguments=SummarizationDataArguments, libraries=("rouge_score",),
                task="summarization")
main = recipe_main(RECIPE, "summarization", __doc__)

if __name__ == "__main__":
    exit_with(main)
