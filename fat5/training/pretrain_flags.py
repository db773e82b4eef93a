"""The pretraining command's own flags and the defaults it changes (fat5/training/pretrain.py is the command).
Standard library only (and the names of the presets and mixtures), so --help and a bad flag answer at once."""

from dataclasses import dataclass, field

from .denoising import MIXTURES
from .models import PRESETS

# Every pretraining default that is not a flag's own: TrainingArguments' values changed here, and those that
# depend on the start (a new model follows nanoT5 and FAT5; a converted checkpoint continues with AdamW and
# keeps its z-loss). --help, the docstring and docs/pretraining.md quote these.
DEFAULTS = {
    "trainer": dict(lr_scheduler_type="cosine", logging_steps=10, report_to="none"),
    "optimizer": {"new model": "adamw_scale", "checkpoint": "adamw"},
    "learning_rate": {"adamw_scale": 2e-2, "adamw": 1e-4},  # nanoT5's recipe; AdamW's usual fine-tuning rate
    "z_loss": {"new model": 1e-4, "checkpoint": None},  # None: the checkpoint's own
}


PROG = "python -m fat5.training.pretrain"
USAGE = f"""{PROG} (--train_files FILE [FILE ...] | --dataset_name NAME)
           (--config {{{','.join(PRESETS)},CONFIG_JSON}} | --model_name_or_path FAT5_FOLDER)
           --output_dir DIR --max_steps N [pretraining options] [TrainingArguments options]"""


@dataclass
class PretrainArguments:
    _argument_group_name = "pretraining options"

    train_files: list[str] = field(default=None, metadata={
        "help": "corpus files, folders (searched for .txt/.jsonl/.json) or globs; .txt: one document a line"})
    text_field: str = field(default="text", metadata={"help": "the text field of JSONL lines and dataset rows"})
    dataset_name: str = field(default=None, metadata={"help": "a `datasets` name, streamed (needs the Hub)"})
    dataset_config_name: str = field(default=None, metadata={"help": "the dataset's configuration"})
    dataset_split: str = field(default="train", metadata={"help": "the dataset's split"})
    model_name_or_path: str = field(default=None, metadata={
        "help": "a FAT5 checkpoint folder to continue pretraining (convert T5s with convert.flan_to_fat5)"})
    config: str = field(default="small", metadata={
        "help": f"for a new model: a preset ({', '.join(PRESETS)}: T5 v1.1 shapes) or a config.json"})
    tokenizer: str = field(default=None, metadata={
        "help": "tokenizer folder (default: the checkpoint's; for a new model, a sentencepiece model is trained "
                "on the corpus into OUTPUT_DIR/tokenizer, or reused from there)"})
    tokenizer_vocab_size: int = field(default=32000, metadata={
        "help": "sentencepiece pieces of a trained tokenizer, at most (a corpus that holds fewer gives fewer)"})
    tokenizer_train_documents: int = field(default=200_000, metadata={
        "help": "documents a tokenizer is trained on (the first ones of the corpus)"})
    resize_embeddings: bool = field(default=False, metadata={
        "help": "allow adding T5's 100 sentinels to a checkpoint's tokenizer that has none, growing the embeddings"})
    mixture: str = field(default="fat5", metadata={
        "help": "denoisers: fat5 (FAT5's UL2 mixture), ul2 (the UL2 paper's), t5 (span corruption r=0.15, mu=3)",
        "choices": sorted(MIXTURES)})
    max_input_length: int = field(default=512, metadata={"help": "encoder tokens of an example, and of a packed row"})
    max_target_length: int = field(default=512, metadata={"help": "decoder tokens of an example, and of a packed row"})
    packing: str = field(default="auto", metadata={
        "help": "pack examples into rows with segment ids (auto: when the model supports it)",
        "choices": ["auto", "on", "off"]})
    optimizer: str = field(default="auto", metadata={
        "help": "adamw_scale (nanoT5's AdamW scaled by parameter RMS; auto for a new model) or adamw (Trainer's "
                "--optim; auto when continuing)", "choices": ["auto", "adamw_scale", "adamw"]})
    z_loss: float = field(default=None, metadata={
        "help": f"z-loss coefficient (default: {DEFAULTS['z_loss']['new model']:g} for a new model, the "
                f"checkpoint's when continuing)"})


def defaults_line():
    """The defaults that differ from Trainer's, as --help says them."""
    trainer = ", ".join(f"{name} {value}" for name, value in DEFAULTS["trainer"].items())
    rates = ", ".join(f"{rate:g} with {name}" for name, rate in DEFAULTS["learning_rate"].items())
    return f"Trainer defaults changed here: {trainer}; learning_rate {rates} (see --optimizer)."
