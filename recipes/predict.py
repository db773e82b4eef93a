"""Generate with a saved FAT5 folder through `pipeline("text2text-generation", trust_remote_code=True)` and write
a CSV (source[, reference], prediction); with --reference_column, also print exact-match accuracy.

    python -m recipes.predict --model out/model --input_file test.csv --output_file predictions.csv \\
        [--source_column source] [--reference_column target] [--source_prefix "summarize: "] \\
        [--num_beams 4] [--max_new_tokens 64] [--length_penalty 1.0] [--batch_size 16] [--device cpu]
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformers import HfArgumentParser, pipeline

from recipes.common import RecipeError, exact_match, main_wrapper, read_table, require_columns, texts
from recipes.common import write_predictions

logger = logging.getLogger("recipes")


@dataclass
class PredictArguments:
    model: str = field(metadata={"help": "a saved model folder (e.g. a recipe's --output_dir or OUTPUT_DIR/merged)"})
    input_file: str = field(metadata={"help": ".csv, .tsv, .json or .jsonl with the inputs"})
    output_file: str = field(metadata={"help": "CSV to write (source[, reference], prediction)"})
    source_column: str = field(default="source", metadata={"help": "column with the input text"})
    reference_column: Optional[str] = field(default=None, metadata={"help": "column with expected outputs: "
                                                                            "adds it to the CSV and scores accuracy"})
    source_prefix: str = field(default="", metadata={"help": "text put before every input"})
    num_beams: int = field(default=1, metadata={"help": "beam search width (1 = greedy)"})
    max_new_tokens: int = field(default=128, metadata={"help": "most tokens generated per input"})
    length_penalty: float = field(default=1.0, metadata={"help": "beam search: > 1 favours longer outputs"})
    batch_size: int = field(default=16, metadata={"help": "inputs per generate() call"})
    device: Optional[str] = field(default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: the pipeline's)"})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "use only the first N rows"})


@main_wrapper
def main(argv=None):
    (args,) = HfArgumentParser(PredictArguments).parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if (Path(args.model) / "adapter_config.json").is_file():
        raise RecipeError(f"{args.model} holds a LoRA adapter, not a model: train with --merge_lora and predict "
                          f"from OUTPUT_DIR/merged")
    if not (Path(args.model) / "config.json").is_file():
        raise RecipeError(f"{args.model}: no config.json, not a saved model folder")
    dataset = read_table(args.input_file)
    if args.max_predict_samples is not None:
        dataset = dataset.select(range(min(args.max_predict_samples, len(dataset))))
    columns = [args.source_column] + ([args.reference_column] if args.reference_column else [])
    require_columns(dataset, columns, args.input_file)
    sources = texts(dataset, args.source_column, args.input_file)
    generator = pipeline("text2text-generation", model=args.model, trust_remote_code=True, device=args.device)
    outputs = generator([args.source_prefix + text for text in sources], batch_size=args.batch_size,
                        num_beams=args.num_beams, max_new_tokens=args.max_new_tokens,
                        length_penalty=args.length_penalty)
    predictions = [output["generated_text"].strip() for output in outputs]
    columns = {"source": sources}
    if args.reference_column:
        columns["reference"] = [text.strip() for text in texts(dataset, args.reference_column, args.input_file)]
        metrics = exact_match(predictions, columns["reference"])
        print(json.dumps(metrics))
    write_predictions(args.output_file, {**columns, "prediction": predictions})
    return predictions


if __name__ == "__main__":
    main()
