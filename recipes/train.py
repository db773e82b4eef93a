"""Fine-tune on (source, target) pairs with the plain `Trainer` and save; predict later with recipes/predict.py.

    python -m recipes.train --model_name_or_path ./fat5-demo --output_dir out/model \\
        --train_file train.csv --validation_file dev.csv --do_train --do_eval [--lora --merge_lora]
    python -m recipes.predict --model out/model --input_file test.csv --output_file predictions.csv \\
        --num_beams 4 --max_new_tokens 64 --length_penalty 0.8
"""

from convert.cli import exit_with
from recipes.arguments import Recipe, recipe_main

RECIPE = Recipe(seq2seq=False)
main = recipe_main(RECIPE)

if __name__ == "__main__":
    exit_with(main)
