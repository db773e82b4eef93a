"""Fine-tune on (source, target) pairs with the plain `Trainer` and save; predict later with fat5/recipes/predict.py.

    python -m fat5.recipes.train --model_name_or_path ./fat5-demo --output_dir out/model \\
        --train_file train.csv --validation_file dev.csv --do_train --do_eval [--lora --merge_lora]
    python -m fat5.recipes.predict --model out/model --input_file test.csv --output_file predictions.csv \\
        --num_beams 4 --max_new_tokens 64 --length_penalty 0.8
"""

from fat5.cli import exit_with
from fat5.recipes.arguments import Recipe
from fat5.recipes.command import recipe_main

RECIPE = Recipe(seq2seq=False)
main = recipe_main(RECIPE, "train", __doc__)

if __name__ == "__main__":
    exit_with(main)
