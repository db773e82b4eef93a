"""Generate with a saved FAT5 folder through `pipeline("text2text-generation", trust_remote_code=True)` and write
a CSV (source[, reference], prediction); with --reference_column, also print exact-match accuracy.

    python -m fat5.recipes.predict --model out/model --input_file test.csv --output_file predictions.csv \\
        [--source_column source] [--reference_column target] [--source_prefix "summarize: "] \\
        [--num_beams 4] [--max_new_tokens 64] [--length_penalty 1.0] [--batch_size 16] [--device cpu]
"""

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fat5 import register_auto_classes
from fat5.cli import CommandError, error_line, exit_with, require, run, write_failures_reported
from fat5.files import (
    check_attention_device,
    check_model_folder,
    check_tokenizer_folder,
    pickles_refused,
    read_json_object,
)
from fat5.recipes.arguments import FileFormatArguments, require_positive
from fat5.recipes.data import exact_match, read_table, write_predictions
from fat5.training.flags import CommandFlags, parse, parser


@dataclass
class PredictArguments:
    _argument_group_name = "prediction"

    model: str = field(metadata={"help": "a saved model folder (e.g. a recipe's --output_dir or OUTPUT_DIR/merged)"})
    input_file: str = field(metadata={"help": ".csv, .tsv, .json or .jsonl with the inputs"})
    output_file: str = field(metadata={"help": "CSV to write (source[, reference], prediction)"})
    source_column: str = field(default="source", metadata={"help": "column with the input text"})
    reference_column: str | None = field(default=None, metadata={"help": "column with expected outputs: adds it "
                                                                          "to the CSV and scores accuracy"})
    source_prefix: str = field(default="", metadata={"help": "text put before every input"})
    num_beams: int = field(default=1, metadata={"help": "beam search width (1 = greedy)"})
    max_new_tokens: int = field(default=128, metadata={"help": "most tokens generated per input"})
    length_penalty: float = field(default=1.0, metadata={"help": "beam search: > 1 favours longer outputs"})
    batch_size: int = field(default=16, metadata={"help": "inputs per generate() call"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: the pipeline's)"})
    max_predict_samples: int | None = field(default=None, metadata={"help": "use only the first N rows"})

    def __post_init__(self):
        require_positive(self, "num_beams", "max_new_tokens", "batch_size", "max_predict_samples")
        if self.length_penalty != 1.0 and self.num_beams == 1:
            raise CommandError("--length_penalty has no effect without beam search (--num_beams 2 or more)")
        model = Path(self.model)
        if (model / "adapter_config.json").is_file():
            raise CommandError(f"{model} holds a LoRA adapter, not a model: train with --merge_lora and predict "
                               f"from OUTPUT_DIR/merged")
        if not (model / "config.json").exists():
            raise CommandError(f"--model {model}: no config.json, not a saved model folder")
        output = Path(self.output_file)
        if output.is_dir():
            raise CommandError(f"--output_file {output} is a folder; name a file")
        if output.resolve() == Path(self.input_file).resolve():
            raise CommandError(f"--output_file {output} is the --input_file; writing it would destroy the inputs")
        # The model folder is read too: no file of it is replaced (a CSV is no file a model folder loads from, such
        # as the predictions a recipe wrote there).
        if output.exists() and model.resolve() in output.resolve().parents and output.suffix.lower() != ".csv":
            raise CommandError(f"--output_file {output} is a file of the --model folder; writing it would destroy "
                               f"the model: name a file outside it, or a new .csv")


def check_device(device):
    """--device names a device this machine has (the pipeline would fail only after loading the model)."""
    import torch

    try:
        wanted = torch.device(device)
    except RuntimeError as error:
        raise CommandError(f"--device {device}: {error_line(error)}") from None
    if wanted.type == "cpu":
        return
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != wanted.type:
        raise CommandError(f"--device {device}: this machine has no {wanted.type} device (use --device cpu)")
    if wanted.index is not None and wanted.index >= torch.accelerator.device_count():
        raise CommandError(f"--device {device}: this machine has {torch.accelerator.device_count()} "
                           f"{wanted.type} device(s)")


def pipeline_device_type(device):
    """The type of device the pipeline runs on: --device's, else the first accelerator's (as the pipeline picks)."""
    import torch

    return torch.device(device).type if device is not None else "cuda" if torch.cuda.is_available() else "cpu"


FLAGS = CommandFlags("python -m fat5.recipes.predict", __doc__, (PredictArguments, FileFormatArguments))


def predict(argv, progress):
    FLAGS.answer_help(argv)
    require("recipes", "datasets")  # the recipes' extra
    args, format_args = parse(parser(FLAGS.own, prog=FLAGS.prog), argv)
    format_args.check_effect([args.input_file])
    table = read_table(args.input_file, format_args.tsv_quoting, format_args.max_field_chars)
    if args.max_predict_samples is not None:
        table = table.head(args.max_predict_samples)
    sources = table.texts(args.source_column, "--source_column")
    columns = {"source": sources}
    if args.reference_column:
        columns["reference"] = table.texts(args.reference_column, "--reference_column")
    if args.device is not None:
        check_device(args.device)
    check_model_folder(args.model)  # before the pipeline reads it
    check_tokenizer_folder(args.model, "--model")
    check_attention_device(read_json_object(Path(args.model) / "config.json"), pipeline_device_type(args.device),
                           f"--model {args.model}")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    from tqdm.auto import tqdm
    from transformers import pipeline

    from fat5.training.finite import check_finite_weights

    register_auto_classes()  # the folder loads with this installation's FAT5 classes (transformers 5 prefers them)
    with pickles_refused(f"the weights file of {args.model}"):
        generator = pipeline("text2text-generation", model=args.model, trust_remote_code=True, device=args.device)
    check_finite_weights(generator.model, f"--model {args.model}",
                         advice="predict with a checkpoint saved before its training diverged")
    # A generator of inputs makes the pipeline yield its outputs as its batches finish, in order: the bar counts them.
    outputs = generator((args.source_prefix + text for text in sources), batch_size=args.batch_size,
                        num_beams=args.num_beams, max_new_tokens=args.max_new_tokens,
                        length_penalty=args.length_penalty)
    with tqdm(total=len(sources), desc="generating", unit="row") as bar:
        predictions = []
        for output in outputs:
            predictions.append(output[0]["generated_text"].strip())
            bar.update()
    if args.reference_column:
        # Compared stripped, as the generated texts are; the CSV keeps the references as written.
        print(json.dumps(exact_match(predictions, [text.strip() for text in columns["reference"]])), flush=True)
    with write_failures_reported(args.output_file, Path(args.output_file).resolve().parent):
        write_predictions(args.output_file, {**columns, "prediction": predictions})
    print(f"wrote {len(predictions)} rows ({', '.join(columns)}, prediction) to {args.output_file}", file=sys.stderr)
    return predictions


def main(argv=None):
    return run(predict, argv, extra="recipes")


if __name__ == "__main__":
    exit_with(main)
