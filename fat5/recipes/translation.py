"""Translation (or any text-to-text pairs): Seq2SeqTrainer scored with sacreBLEU's BLEU and chrF; with
--do_predict, OUTPUT_DIR/predictions.csv holds (source, reference, prediction).

    python -m fat5.recipes.translation --model_name_or_path ./fat5-demo --output_dir out/translation \\
        --train_file train.tsv --validation_file dev.tsv --test_file test.tsv \\
        --source_column en --target_column de --do_train --do_eval --do_predict [--lora] [any Trainer flag]
"""

from fat5.cli import exit_with
from fat5.recipes.arguments import Recipe
from fat5.recipes.command import recipe_main


def bleu_chrf(predictions, references):
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
            "chrf": sacrebleu.corpus_chrf(predictions, [references]).score}


RECIPE = Recipe(score=bleu_chrf, libraries=("sacrebleu",), task="translation")
main = recipe_main(RECIPE, "translation", __doc__)

if __name__ == "__main__":
    exit_with(main)
