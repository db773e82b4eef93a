"""Fine-tune on (source, target) pairs with the plain `Trainer` and save; predict later with recipes/predict.py.

    python -m recipes.train --model_name_or_path ./fat5-demo --output_dir out/model \\
        --train_file train.csv --validation_file dev.csv --do_train --do_eval [--lora --merge_lora]
    python -m recipes.predict --model out/model --input_file test.csv --output_file predictions.csv \\
        --num_beams 4 --max_new_tokens 64 --length_penalty 0.8
"""

from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from recipes.common import DataArguments, ModelArguments, finish, load_splits, load_tokenizer, main_wrapper
from recipes.common import parse_args, save, setup, source_target_pairs, tokenize_pairs, wrap_lora


@main_wrapper
def main(argv=None):
    model_args, data_args, training_args = parse_args((ModelArguments, DataArguments, TrainingArguments), argv)
    resume = setup(training_args)
    tokenizer = load_tokenizer(model_args)
    splits = load_splits(data_args, training_args)
    build_pairs = source_target_pairs(data_args)
    tokenized = {split: tokenize_pairs(tokenizer, *build_pairs(dataset, split), data_args, split)
                 for split, dataset in splits.items()}
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, trust_remote_code=True)
    model = wrap_lora(model, model_args, training_args, task_type="SEQ_2_SEQ_LM")
    trainer = Trainer(model=model, args=training_args, train_dataset=tokenized.get("train"),
                      eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
                      data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8))
    if training_args.do_train:
        finish(trainer, "train", trainer.train(resume_from_checkpoint=resume).metrics)
        save(trainer, tokenizer, model_args, training_args)
    if training_args.do_eval:
        finish(trainer, "eval", trainer.evaluate())
    return trainer


if __name__ == "__main__":
    main()
