"""Pretrain a FAT5 from raw text, or continue pretraining a FAT5 checkpoint, with T5/UL2 denoising objectives.

From scratch (T5 v1.1 "base" shapes, a sentencepiece tokenizer trained on the corpus, nanoT5's optimizer):
    python -m fat5.training.pretrain --config base --train_files corpus/ --output_dir runs/base \\
        --max_steps 65536 --per_device_train_batch_size 128 --warmup_steps 10000 --bf16

Continued pretraining of a converted checkpoint (python -m convert.flan_to_fat5 google/flan-t5-base flan-fat5):
    python -m fat5.training.pretrain --model_name_or_path flan-fat5 --train_files domain.jsonl \\
        --output_dir runs/flan-domain --max_steps 10000 --per_device_train_batch_size 64 --bf16

The corpus is streamed (text files: one document a line; JSONL: the --text_field of each line; or a `datasets`
name), so it may be larger than memory. Each example draws a denoiser of the --mixture, takes the next chunk of a
document that fits --max_input_length/--max_target_length once corrupted, and examples are packed into rows with
no attention between them (--per_device_train_batch_size counts examples; rows hold several each). Every
`TrainingArguments` flag of transformers works (accelerate, --deepspeed, --fsdp, --gradient_accumulation_steps,
--save_steps, --resume_from_checkpoint ...). Defaults that differ from `Trainer`'s: cosine schedule, logging every
10 steps, and the learning rate follows --optimizer (2e-2 with adamw_scale, nanoT5's recipe; 1e-4 with AdamW)
unless --learning_rate is given. Checkpoints and the final --output_dir are FAT5 folders with the tokenizer.
"""

import argparse
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser, TrainingArguments, set_seed

from .data import DenoisingDataset, Documents, PretrainError, add_missing_tokens, train_sentencepiece
from .denoising import MIXTURES, DenoisingMixture, sentinel_token_ids
from .models import PRESETS, fit_embeddings, load_checkpoint, new_model
from .optim import AdamWScale
from .packing import PackedSeq2SeqCollator
from .trainer import PretrainTrainer

DEFAULT_LR = {"adamw_scale": 2e-2, "adamw": 1e-4}


USAGE = """python -m fat5.training.pretrain (--train_files FILE [FILE ...] | --dataset_name NAME)
           (--config {small,base,large,CONFIG_JSON} | --model_name_or_path FAT5_FOLDER)
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
    tokenizer_vocab_size: int = field(default=32000, metadata={"help": "vocabulary of a trained tokenizer"})
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
        "help": "z-loss coefficient (default: 1e-4 for a new model, the checkpoint's when continuing)"})


class TrainerOptions(TrainingArguments):
    _argument_group_name = "TrainingArguments options (transformers; defaults changed here: lr_scheduler_type, " \
                           "logging_steps, report_to, learning_rate)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout; shows defaults, except empty ones and those a help text already explains."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv):
    parser = HfArgumentParser((PretrainArguments, TrainerOptions), usage=USAGE, description=__doc__,
                              formatter_class=HelpFormatter)
    parser.set_defaults(lr_scheduler_type="cosine", logging_steps=10, report_to="none")
    args, training_args = parser.parse_args_into_dataclasses(args=argv)
    args.learning_rate_given = any(a.split("=")[0] in ("--learning_rate", "--learning-rate") for a in argv)
    return args, training_args


def tokenizer_for(args, training_args, documents, prefixes, model):
    """The tokenizer (the checkpoint's, --tokenizer, or one trained on the corpus), with sentinels and prefixes."""
    if model is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model_name_or_path)
        add_missing_tokens(tokenizer, prefixes, model.get_input_embeddings().weight.shape[0], args.resize_embeddings)
        return tokenizer
    trained = Path(training_args.output_dir) / "tokenizer"
    if args.tokenizer or (trained / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or trained)
    else:
        print(f"training a {args.tokenizer_vocab_size}-token sentencepiece tokenizer into {trained}")
        tokenizer = train_sentencepiece(documents, trained, args.tokenizer_vocab_size, args.tokenizer_train_documents)
    add_missing_tokens(tokenizer, prefixes, None, True)
    return tokenizer


class OneExampleARow(DataCollatorForSeq2Seq):
    """Padded batches plus a decoder mask. T5 pads on the right, so the mask changes no output; it lets the logs
    count decoder padding."""

    def __call__(self, examples, return_tensors=None):
        batch = super().__call__(examples, return_tensors)
        batch["decoder_attention_mask"] = (batch["labels"] != -100).long()
        return batch


def collator(args, model, tokenizer):
    supported = "segment_ids" in inspect.signature(model.forward).parameters
    if args.packing == "on" and not supported:
        raise PretrainError("this FAT5 version's forward has no segment_ids, so it cannot train on packed rows; "
                            "use --packing off")
    if args.packing == "off" or not supported:
        return OneExampleARow(tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)
    return PackedSeq2SeqCollator(tokenizer.pad_token_id, model.config.decoder_start_token_id,
                                 args.max_input_length, args.max_target_length, pad_to_multiple_of=8)


def optimizer_cls_and_kwargs(args, training_args):
    name = args.optimizer if args.optimizer != "auto" else "adamw" if args.model_name_or_path else "adamw_scale"
    if not args.learning_rate_given:
        training_args.learning_rate = DEFAULT_LR[name]
    if name == "adamw":
        return None  # Trainer's own, from --optim
    return AdamWScale, dict(lr=training_args.learning_rate, betas=(training_args.adam_beta1, training_args.adam_beta2),
                            eps=training_args.adam_epsilon, weight_decay=training_args.weight_decay)


def run(args, training_args):
    if training_args.max_steps <= 0:
        raise PretrainError("a streamed corpus has no length: pass --max_steps")
    resume = training_args.resume_from_checkpoint
    if resume and resume != "latest" and not Path(resume).is_dir():
        raise PretrainError(f"no checkpoint folder at --resume_from_checkpoint {resume}")
    documents = Documents(args.train_files or (), args.text_field, args.dataset_name, args.dataset_config_name,
                          args.dataset_split)
    documents.check_not_empty()
    denoisers = MIXTURES[args.mixture]
    prefixes = sorted({denoiser.prefix for denoiser, _ in denoisers if denoiser.prefix})
    model = load_checkpoint(args.model_name_or_path, args.z_loss) if args.model_name_or_path else None
    with training_args.main_process_first(desc="tokenizer"):  # one process trains it, the others load it
        tokenizer = tokenizer_for(args, training_args, documents, prefixes, model)
    try:
        mixture = DenoisingMixture(denoisers, sentinel_token_ids(tokenizer),
                                   tokenizer.eos_token_id, args.max_input_length, args.max_target_length,
                                   {prefix: tokenizer.convert_tokens_to_ids(prefix) for prefix in prefixes})
    except ValueError as error:
        raise PretrainError(error) from None
    if model is None:
        set_seed(training_args.seed)  # a reproducible initialisation
        model = new_model(args.config, tokenizer, 1e-4 if args.z_loss is None else args.z_loss)
    fit_embeddings(model, tokenizer)
    say = print if training_args.process_index == 0 else (lambda *_: None)
    say(f"FAT5 with {model.num_parameters() / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}; denoisers "
          + ", ".join(f"{d} {p:g} ({n} raw tokens)" for (d, p), n in zip(denoisers, mixture.raw_lengths)))
    data_collator = collator(args, model, tokenizer)
    say("batches:", "one example a row" if isinstance(data_collator, OneExampleARow) else "packed rows")
    if training_args.accelerator_config.dispatch_batches is None:
        # Packed batches differ in rows, which accelerate cannot split after the fact: every process reads the
        # stream and collates its own share of the examples instead.
        training_args.accelerator_config.dispatch_batches = False
    dataset = DenoisingDataset(documents, tokenizer, mixture, seed=training_args.data_seed or training_args.seed)
    trainer = PretrainTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=dataset,
                              data_collator=data_collator,
                              optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, training_args))
    trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    trainer.save_model(training_args.output_dir)
    say(f"saved the model and tokenizer to {training_args.output_dir}")


def main(argv=None):
    try:
        args, training_args = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as error:  # TrainingArguments' own checks, e.g. --bf16 without a GPU or --use_cpu
        raise SystemExit(f"error: {str(error).strip().splitlines()[0]}") from None
    try:
        run(args, training_args)
    except PretrainError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
