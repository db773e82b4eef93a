"""The model card (README.md, the Hub's format) of a folder a training run saves: the recipes' final model (and its
merged LoRA folder) and pretraining's. Its YAML metadata names the base model, tags, the Hub datasets and, under
`model-index`, the metrics of the run's final evaluation; its text says how to load the folder, what it was trained
on and the exact command line that made it.

The card is written whole (fat5/safe_files.py) right after the model, and again when an evaluation adds metrics;
`ModelCardTrainerMixin` makes Trainer's `push_to_hub` (`--push_to_hub`) write this card in place of transformers'
draft, so the pushed repo carries it.
"""

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fat5.safe_files import write_atomically

# Trainer's metrics that describe the run's speed, not the model.
NOT_SCORES = ("runtime", "samples_per_second", "steps_per_second", "epoch", "total_flos", "steps")
# Where a split's metrics come from: Trainer's metric prefix -> the split's name on the card.
SPLIT_NAMES = {"eval": "validation", "test": "test"}
SECRET_FLAGS = ("--hub_token", "--token")


def command_line(program, argv):
    """The command line as typed (`program` then `argv`, default sys.argv[1:]), shell-quoted, with the value of a
    token flag hidden."""
    words = list(sys.argv[1:] if argv is None else map(str, argv))
    for index, word in enumerate(words):
        name, equals, _ = word.partition("=")
        if name.replace("-", "_").replace("__", "--", 1) in SECRET_FLAGS:
            if equals:
                words[index] = f"{name}=HIDDEN"
            elif index + 1 < len(words):
                words[index + 1] = "HIDDEN"
    return " ".join([program, *map(shlex.quote, words)])


def hub_base_model(model_name_or_path):
    """The Hub id the card's `base_model` names: the id itself, or for a local folder the `base_model` its own card
    names (a FAT5 conversion of a Hub model); None when neither is known."""
    if not model_name_or_path:
        return None
    folder = Path(model_name_or_path)
    if not folder.exists():
        return model_name_or_path
    from huggingface_hub import ModelCard

    try:
        base = ModelCard.load(folder / "README.md").data.get("base_model")
    except Exception:  # no card, or one that cannot be read: no lineage to name
        return None
    return base if isinstance(base, str) else None


@dataclass
class RunCard:
    """What a training run's card says. `results` ({Trainer metric prefix: metrics}) grows as the run evaluates."""

    command: str  # the command line that made the folder
    task: str  # a Hub task id: translation, summarization, text2text-generation, text-classification
    base_model: str | None  # what training started from (a folder or Hub id); None: a new model
    data: dict  # {split: what it was read from, e.g. "data/train.tsv (256 rows)"}
    pipeline_tag: str | None = "text2text-generation"
    tags: tuple = ()
    datasets: tuple = ()  # Hub dataset ids (--dataset_name)
    results: dict = field(default_factory=dict)
    model_id: str | None = None  # the name the usage snippet loads (default: the folder's path as written)
    how: str | None = None  # how it was trained, in a few words (default: "fine-tuned for TASK")

    def scores(self, prefix):
        metrics = self.results.get(prefix, {})
        return {name.removeprefix(prefix + "_"): value for name, value in metrics.items()
                if isinstance(value, (int, float)) and name.removeprefix(prefix + "_") not in NOT_SCORES}

    def metadata(self, folder, adapter):
        from huggingface_hub import EvalResult, ModelCardData

        data_name = "; ".join(f"{split}: {source}" for split, source in self.data.items())
        evaluations = [EvalResult(task_type=self.task, dataset_type=self.datasets[0] if self.datasets else "local",
                                  dataset_name=self.data.get(SPLIT_NAMES[prefix], data_name),
                                  dataset_split=SPLIT_NAMES[prefix], metric_type=name, metric_name=name,
                                  metric_value=float(f"{float(value):.4g}"))
                       for prefix in SPLIT_NAMES for name, value in self.scores(prefix).items()]
        return ModelCardData(
            base_model=hub_base_model(self.base_model), library_name="peft" if adapter else "transformers",
            pipeline_tag=self.pipeline_tag, datasets=list(self.datasets) or None,
            tags=list(dict.fromkeys(["fat5", "t5", "custom_code", self.task, *self.tags])),
            model_name=Path(folder).resolve().name if evaluations else None, eval_results=evaluations or None)

    def text(self, folder, adapter=False):
        """The card's whole text: YAML metadata, then Markdown."""
        model_id = self.model_id or str(folder)
        start = f"`{self.base_model}`" if self.base_model else "a new model"
        trained = ", ".join(f"{split} `{source}`" for split, source in self.data.items())
        lines = [f"# {Path(folder).resolve().name}", "",
                 f"A FAT5 model (a T5 whose relative position bias is computed inside a flash-attention kernel), "
                 f"{self.how or 'fine-tuned for ' + self.task} from {start} on {trained or 'the data below'}"
                 f"{' (a LoRA adapter)' if adapter else ''}. Its modelling code ships in the folder: load it with "
                 f"`trust_remote_code=True`.", "", "## Usage", "", "```python"]
        if adapter:
            lines += ["from peft import PeftModel", "from transformers import AutoModelForSeq2SeqLM", "",
                      f"base = AutoModelForSeq2SeqLM.from_pretrained({json.dumps(self.base_model)}, "
                      f"trust_remote_code=True)", f"model = PeftModel.from_pretrained(base, {json.dumps(model_id)})"]
        elif self.pipeline_tag == "text-classification":
            lines += ["from transformers import AutoModelForSequenceClassification, AutoTokenizer", "",
                      f"model = AutoModelForSequenceClassification.from_pretrained({json.dumps(model_id)}, "
                      f"trust_remote_code=True)", f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(model_id)})"]
        else:
            lines += ["from transformers import pipeline", "",
                      f"generator = pipeline(\"text2text-generation\", model={json.dumps(model_id)}, "
                      f"trust_remote_code=True)"]
        lines += ["```", ""]
        scored = {SPLIT_NAMES[prefix]: self.scores(prefix) for prefix in SPLIT_NAMES if self.scores(prefix)}
        if scored:
            lines += ["## Results", "", "| split | data | metric | value |", "| --- | --- | --- | --- |"]
            lines += [f"| {split} | `{self.data.get(split, '?')}` | {name} | {value:.4g} |"
                      for split, scores in scored.items() for name, value in scores.items()]
            lines.append("")
        lines += ["## Training", ""]
        train = self.results.get("train", {})
        if "train_loss" in train and "steps" in train:
            lines += [f"{train['steps']} steps, mean training loss {train['train_loss']:.4g}.", ""]
        lines += ["The command that made this folder:", "", "```bash", self.command, "```", ""]
        return f"---\n{self.metadata(folder, adapter).to_yaml()}\n---\n\n" + "\n".join(lines)

    def write(self, folder, adapter=False):
        """Write FOLDER/README.md whole (fat5/safe_files.py: a temporary file flushed, then renamed into place)."""
        path = Path(folder) / "README.md"
        write_atomically(path, self.text(folder, adapter))
        return path


class ModelCardTrainerMixin:
    """Mixin for transformers' Trainer: its public `create_model_card`, which `push_to_hub` calls before uploading,
    writes the run's card (`self.card`, a RunCard) instead of transformers' draft."""

    card = None
    card_is_adapter = False

    def create_model_card(self, *args, **kwargs):
        if self.card is None:
            return super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            self.card.write(self.args.output_dir, self.card_is_adapter)
