"""Translation (mT5-style): fine-tune on a parallel corpus, score with sacreBLEU (BLEU and chrF), write the test
predictions to OUTPUT_DIR/predictions.csv (source, reference, prediction).

    python -m recipes.translation --model_name_or_path ./fat5-demo --output_dir out/translation \\
        --train_file train.tsv --validation_file dev.tsv --test_file test.tsv \\
        --source_column en --target_column de --do_train --do_eval --do_predict [--lora] [any Trainer flag]
"""

import sacrebleu
from transformers import Seq2SeqTrainingArguments

from recipes.common import DataArguments, ModelArguments, main_wrapper, parse_args
from recipes.common import run_seq2seq, source_target_pairs


def bleu_chrf(predictions, references):
    return {"bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
            "chrf": sacrebleu.corpus_chrf(predictions, [references]).score}


@main_wrapper
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataArguments, Seq2SeqTrainingArguments), argv, predict_with_generate=True)
    return run_seq2seq(model_args, data_args, training_args, source_target_pairs(data_args), bleu_chrf)


if __name__ == "__main__":
    main()
