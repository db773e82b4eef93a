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
--save_steps, --resume_from_checkpoint ...); the defaults that differ from `Trainer`'s are in DEFAULTS below.
Checkpoints and the final --output_dir are FAT5 folders with the tokenizer. --output_dir belongs to this run
(fat5/training/run_folder.py): a folder holding another run is refused unless resumed (--resume_from_checkpoint
latest) or replaced (--overwrite_output_dir), checkpoints are written atomically, and `latest` resumes exactly,
after any number of passes over the corpus.
"""

import argparse
import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser, TrainingArguments, set_seed
from transformers.utils.logging import disable_progress_bar

from convert.cli import EXIT_BAD_INPUT, CommandError, error_line, exit_with, run
from convert.files import (
    CHECKPOINT_JSON,
    check_model_folder,
    check_tokenizer_folder,
    check_trainer_json_files,
    pickles_refused,
)
from convert.safety import write_failures_reported

from .data import DenoisingDataset, Documents, add_missing_tokens, sentencepiece_pieces, train_sentencepiece
from .denoising import MIXTURES, DenoisingMixture, sentinel_token_ids
from .models import (
    PRESETS,
    check_checkpoint_shapes,
    checkpoint_config,
    fit_embeddings,
    load_checkpoint,
    model_fields,
    new_model,
)
from .optim import AdamWScale
from .packing import PackedSeq2SeqCollator
from .run_folder import TRAINING_SETTINGS, RunFolder, RunFolderArguments, RunInput, read_record, training_settings
from .trainer import PretrainTrainer, shard_examples

# Every pretraining default that is not a flag's own: TrainingArguments' values changed here, and those that
# depend on the start (a new model follows nanoT5 and FAT5; a converted checkpoint continues with AdamW and
# keeps its z-loss). --help, the docstring and the README quote these.
DEFAULTS = {
    "trainer": dict(lr_scheduler_type="cosine", logging_steps=10, report_to="none"),
    "optimizer": {"new model": "adamw_scale", "checkpoint": "adamw"},
    "learning_rate": {"adamw_scale": 2e-2, "adamw": 1e-4},  # nanoT5's recipe; AdamW's usual fine-tuning rate
    "z_loss": {"new model": 1e-4, "checkpoint": None},  # None: the checkpoint's own
}


# What to do with a checkpoint whose optimizer, scheduler or RNG state is a pickle of more than tensors.
RESUME_ADVICE = "resume from a checkpoint FAT5 wrote instead, or start a new run from its weights " \
                "(--model_name_or_path)"

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


@dataclass
class TrainerOptions(TrainingArguments, RunFolderArguments):
    _argument_group_name = (
        f"TrainingArguments options (transformers; defaults changed here: {', '.join(DEFAULTS['trainer'])}, "
        f"learning_rate ({', '.join(f'{rate:g} with {name}' for name, rate in DEFAULTS['learning_rate'].items())}))")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout; shows defaults, except empty ones and those a help text already explains."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(HfArgumentParser):
    def error(self, message):
        # One line, no usage dump (convert/cli.py's convention).
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv):
    """The two dataclasses, with DEFAULTS applied: the start-dependent ones once the start is known."""
    parser = Parser((PretrainArguments, TrainerOptions), usage=USAGE, description=__doc__,
                    formatter_class=HelpFormatter)
    parser.set_defaults(**DEFAULTS["trainer"])
    check_trainer_json_files(argv)
    try:
        args, training_args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # TrainingArguments' own checks, e.g. --bf16 without a GPU or --use_cpu
        raise CommandError(error_line(error)) from None
    start = "checkpoint" if args.model_name_or_path else "new model"
    if args.optimizer == "auto":
        args.optimizer = DEFAULTS["optimizer"][start]
    if not any(arg.split("=")[0] in ("--learning_rate", "--learning-rate") for arg in argv):
        training_args.learning_rate = DEFAULTS["learning_rate"][args.optimizer]
    if args.z_loss is None:
        args.z_loss = DEFAULTS["z_loss"][start]
    return args, training_args


def given_tokenizer(args, prefixes, rows):
    """The checkpoint's tokenizer or --tokenizer, with sentinels and prefixes (None: one is trained on the corpus).
    `rows` is the checkpoint's embedding size (None for a new model)."""
    if not (args.tokenizer or args.model_name_or_path):
        return None
    folder, flag = (args.tokenizer, "--tokenizer") if args.tokenizer else (args.model_name_or_path,
                                                                             "--model_name_or_path")
    check_model_folder(folder)
    check_tokenizer_folder(folder, flag, advice="name a folder that holds one with --tokenizer, or leave "
                                                "--tokenizer out to train one on the corpus"
                           if args.tokenizer else "name a folder that holds one with --tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    add_missing_tokens(tokenizer, prefixes, rows, rows is None or args.resize_embeddings)
    return tokenizer


def trained_tokenizer(args, training_args, documents, prefixes):
    """A sentencepiece tokenizer trained on the corpus into OUTPUT_DIR/tokenizer, or reused from there; one line
    says the vocabulary it gives and why (a corpus too small for --tokenizer_vocab_size pieces gives fewer)."""
    trained = Path(training_args.output_dir) / "tokenizer"
    read = None  # documents the tokenizer was trained on here (None: reused)
    if (trained / "tokenizer_config.json").exists():
        check_model_folder(trained)
        tokenizer = AutoTokenizer.from_pretrained(trained)
    else:
        print(f"training a sentencepiece tokenizer of at most {args.tokenizer_vocab_size:,} pieces on the first "
              f"{args.tokenizer_train_documents:,} documents into {trained}")
        with write_failures_reported(f"the tokenizer {trained}", training_args.output_dir):
            tokenizer, read = train_sentencepiece(documents, trained, args.tokenizer_vocab_size,
                                                  args.tokenizer_train_documents)
    pieces = sentencepiece_pieces(trained)
    add_missing_tokens(tokenizer, prefixes, None, True)
    if read is None:
        origin = f"the tokenizer in {trained} (this run's) has {pieces:,} pieces"
    elif pieces < args.tokenizer_vocab_size:
        origin = (f"the trained tokenizer has {pieces:,} pieces, not {args.tokenizer_vocab_size:,}: that is all "
                  f"sentencepiece finds in the {read:,} documents it read (--tokenizer_vocab_size is an upper bound; "
                  f"more text gives more)")
    else:
        origin = f"the trained tokenizer has {pieces:,} pieces"
    if training_args.process_index == 0:
        print(f"vocabulary {len(tokenizer):,}: {origin}, plus {len(tokenizer) - pieces} sentinel and mode tokens")
    return tokenizer


def denoising_dataset(args, training_args, documents, tokenizer):
    """The stream of examples, refused when the corpus cannot make one."""
    denoisers = MIXTURES[args.mixture]
    prefixes = sorted({denoiser.prefix for denoiser, _ in denoisers if denoiser.prefix})
    try:
        mixture = DenoisingMixture(denoisers, sentinel_token_ids(tokenizer),
                                   tokenizer.eos_token_id, args.max_input_length, args.max_target_length,
                                   {prefix: tokenizer.convert_tokens_to_ids(prefix) for prefix in prefixes})
    except ValueError as error:
        raise CommandError(error) from None
    dataset = DenoisingDataset(documents, tokenizer, mixture, seed=training_args.data_seed or training_args.seed)
    if dataset.first_example() is None:
        raise CommandError("the corpus is too small to make one training example: every document has fewer than 2 "
                           "tokens")
    return dataset


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
        raise CommandError("this FAT5 version's forward has no segment_ids, so it cannot train on packed rows; "
                            "use --packing off")
    if args.packing == "off" or not supported:
        return OneExampleARow(tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)
    return PackedSeq2SeqCollator(tokenizer.pad_token_id, model.config.decoder_start_token_id,
                                 args.max_input_length, args.max_target_length, pad_to_multiple_of=8)


def optimizer_cls_and_kwargs(args, training_args):
    if args.optimizer == "adamw":
        return None  # Trainer's own, from --optim
    return AdamWScale, dict(lr=training_args.learning_rate, betas=(training_args.adam_beta1, training_args.adam_beta2),
                            eps=training_args.adam_epsilon, weight_decay=training_args.weight_decay)


@contextmanager
def worker_errors_as_one_line():
    """A data error raised in a DataLoader worker reaches the main process re-raised by torch with the worker's
    traceback inside its message; keep the original message only."""
    try:
        yield
    except CommandError as error:
        text = str(error)
        if "Original Traceback" not in text:
            raise
        raise CommandError(text.strip().splitlines()[-1].split(": ", 1)[-1]) from None


def pretrain(argv, progress):
    """The command (run by convert.cli.run). Every input is checked before anything is written and before the
    model loads, except what only the corpus can tell (a trained tokenizer, the data after the first example)."""
    argv = sys.argv[1:] if argv is None else argv
    args, training_args = parse_args(argv)
    if training_args.max_steps <= 0:
        raise CommandError("a streamed corpus has no length: pass --max_steps")
    documents = Documents(args.train_files or (), args.text_field, args.dataset_name, args.dataset_config_name,
                          args.dataset_split)
    documents.check_not_empty()
    prefixes = sorted({denoiser.prefix for denoiser, _ in MIXTURES[args.mixture] if denoiser.prefix})
    if args.model_name_or_path:
        rows = checkpoint_config(args.model_name_or_path).get("vocab_size")
    else:
        rows = None
        model_fields(args.config)
    tokenizer = given_tokenizer(args, prefixes, rows)
    dataset = None if tokenizer is None else denoising_dataset(args, training_args, documents, tokenizer)
    run_folder = RunFolder(training_args.output_dir, training_args.resume_from_checkpoint,
                           overwrite=training_args.overwrite_output_dir, resume_flag="latest",
                           command=["python", "-m", "fat5.training.pretrain", *argv],
                           inputs=run_inputs(args, training_args, documents),
                           settings=run_settings(args, training_args, documents),
                           accept_changed_settings=training_args.resume_with_changed_settings,
                           check_changes=lambda changed: check_stream_changes(changed, training_args))
    with run_folder.opened(training_args):
        progress.describe = run_folder.describe
        if run_folder.already_finished:
            print(f"{training_args.output_dir}: this run finished (its final model is there); nothing to do")
            return
        if tokenizer is None:
            with training_args.main_process_first(desc="tokenizer"):  # one process trains it, the others load it
                tokenizer = trained_tokenizer(args, training_args, documents, prefixes)
            dataset = denoising_dataset(args, training_args, documents, tokenizer)
        train(args, training_args, tokenizer, dataset, run_folder)


def run_inputs(args, training_args, documents):
    """Every path the run reads, for the run folder's check against --output_dir."""
    inputs = [RunInput("--train_files", pattern, recursive=Path(pattern).is_dir())
              for pattern in args.train_files or ()]
    inputs += [RunInput("--train_files", path) for path in documents.files]
    inputs += [RunInput("--model_name_or_path", args.model_name_or_path), RunInput("--tokenizer", args.tokenizer)]
    if not args.model_name_or_path and args.config not in PRESETS:
        inputs.append(RunInput("--config", args.config))
    if isinstance(training_args.deepspeed, str):
        inputs.append(RunInput("--deepspeed", training_args.deepspeed))
    return inputs


# Settings that define the stream of examples: a resume that changes them cannot continue the stream where it was.
STREAM_SETTINGS = ("train_files", "text_field", "dataset_name", "dataset_config_name", "dataset_split", "tokenizer",
                   "mixture", "max_input_length", "max_target_length", "seed", "data_seed", "dataloader_num_workers",
                   "world_size")


def run_settings(args, training_args, documents):
    """What shapes the training, recorded by the run folder and compared when the run resumes. Corpus files count
    with their sizes: a file that grew or shrank is another stream."""
    settings = {name: getattr(args, name) for name in (
        "text_field", "dataset_name", "dataset_config_name", "dataset_split", "model_name_or_path", "config",
        "tokenizer", "resize_embeddings", "mixture", "max_input_length", "max_target_length", "packing",
        "optimizer", "z_loss")}
    settings["train_files"] = [[str(path), path.stat().st_size] for path in documents.files]
    settings.update(training_settings(training_args, (*TRAINING_SETTINGS, "dataloader_num_workers")))
    return settings


def check_stream_changes(changed, training_args):
    """A resume with changed settings (--resume_with_changed_settings) continues the stream by the examples of
    each shard already trained on; settings that redefine the stream or its shards make that impossible."""
    redefined = sorted(set(changed) & set(STREAM_SETTINGS))
    if redefined:
        raise CommandError(f"--resume_with_changed_settings cannot continue the run's stream of examples with another "
                           f"--{redefined[0]}: start a new run from its last checkpoint's model "
                           f"(--model_name_or_path {training_args.output_dir}/checkpoint-N)")
    batch_shape = {"per_device_train_batch_size", "gradient_accumulation_steps"} & set(changed)
    if batch_shape and training_args.world_size > 1:
        raise CommandError(f"--resume_with_changed_settings: another --{sorted(batch_shape)[0]} over several processes "
                           f"cannot continue the stream exactly; resume with the run's, or on one process")


def stream_position(run_folder, training_args, dataset):
    """Where this process starts reading the stream, when resuming: after the examples of each shard the checkpoint
    records as trained on. Trainer's own skip of the batches already trained on lands there while the run kept its
    batch settings throughout; after a change (--resume_with_changed_settings) the dataset skips them itself.
    Returns the trainer's `stream_start` (None: counted from the start of the run)."""
    checkpoint = run_folder.resume_checkpoint
    if not checkpoint:
        return None
    counts = (read_record(checkpoint) or {}).get("examples_per_shard")
    step = run_folder.resume_state()["global_step"]
    if counts is None:  # an earlier FAT5's checkpoint: Trainer's skip, which needs the run's batch settings
        if run_folder.changed.keys() & {"per_device_train_batch_size", "gradient_accumulation_steps"}:
            raise CommandError(f"--resume_from_checkpoint {checkpoint} was written by an earlier FAT5 that did not "
                               f"record the examples it trained on: resume with the run's batch settings")
        return None
    by_trainer = shard_examples(step * training_args.gradient_accumulation_steps, len(counts),
                                training_args.per_device_train_batch_size)
    if counts == by_trainer:
        return None
    dataset.skip = counts
    # The dataset skips by examples, not Trainer by batches (its `epoch` in the logs then counts from the resume).
    training_args.ignore_data_skip = True
    return step, counts


def train(args, training_args, tokenizer, dataset, run_folder):
    resume = run_folder.resume_checkpoint
    if resume:
        check_model_folder(resume, also=CHECKPOINT_JSON)  # before Trainer reads them
    if args.model_name_or_path:
        model = load_checkpoint(args.model_name_or_path, args.z_loss)
    else:
        set_seed(training_args.seed)  # a reproducible initialisation
        model = new_model(args.config, tokenizer, args.z_loss)
    fit_embeddings(model, tokenizer)
    if resume:
        check_checkpoint_shapes(model, resume)
    say = print if training_args.process_index == 0 else (lambda *_: None)
    mixture = dataset.mixture
    say(f"FAT5 with {model.num_parameters() / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}; denoisers "
          + ", ".join(f"{d} {p:g} ({n} raw tokens)"
                      for d, p, n in zip(mixture.denoisers, mixture.proportions, mixture.raw_lengths, strict=True)))
    data_collator = collator(args, model, tokenizer)
    say("batches:", "one example a row" if isinstance(data_collator, OneExampleARow) else "packed rows")
    if training_args.accelerator_config.dispatch_batches is None:
        # Packed batches differ in rows, which accelerate cannot split after the fact: every process reads the
        # stream and collates its own share of the examples instead.
        training_args.accelerator_config.dispatch_batches = False
    trainer = PretrainTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=dataset,
                              data_collator=data_collator,
                              optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, training_args),
                              stream_start=stream_position(run_folder, training_args, dataset))
    if training_args.disable_tqdm:
        disable_progress_bar()  # transformers' own bars too (writing checkpoint shards)
    state = run_folder.resume_state()
    # Trainer loads a checkpoint's optimizer, scheduler and RNG states with torch.load(weights_only=True).
    with worker_errors_as_one_line(), pickles_refused(f"--resume_from_checkpoint {resume}", RESUME_ADVICE):
        if state and state["global_step"] >= training_args.max_steps:
            # Killed after its last checkpoint, before its final save: nothing left to train (Trainer would take
            # one step past --max_steps).
            say(f"{resume} is the run's last step ({state['global_step']}): saving it as the final model")
            trainer.load_without_training(resume)
        else:
            trainer.train(resume_from_checkpoint=resume)
    with write_failures_reported("the final model", training_args.output_dir):
        trainer.save_model(training_args.output_dir)
    run_folder.finish()
    say(f"saved the model and tokenizer to {training_args.output_dir}")


def main(argv=None):
    return run(pretrain, argv)


if __name__ == "__main__":
    exit_with(main)
