"""The pretraining run of `python -m fat5.training.pretrain` (fat5/training/pretrain.py reads its flags): the
tokenizer (given, or trained on the corpus), the stream of denoising examples, the model, the collator (packed rows or
one example a row), the optimizer, the run folder and Trainer's loop.
"""

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, DataCollatorForSeq2Seq, TrainingArguments, set_seed
from transformers.utils.logging import disable_progress_bar

from fat5 import register_auto_classes
from fat5.cli import CommandError, write_failures_reported
from fat5.files import (
    CHECKPOINT_JSON,
    check_attention_device,
    check_model_folder,
    check_tokenizer_folder,
    pickles_refused,
)

from .data import DenoisingDataset, Documents, add_missing_tokens, sentencepiece_pieces, train_sentencepiece
from .denoising import MIXTURES, DenoisingMixture, sentinel_token_ids
from .flags import RunFolderArguments, check_trainer_values, checkpointing_flag, given_flags, parse, parser
from .model_card import RunCard, command_line
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
from .pretrain_flags import DEFAULTS, PROG, USAGE, PretrainArguments, defaults_line
from .quiet import quiet_trainer_run
from .run_folder import TRAINING_SETTINGS, RunFolder, RunInput, progress_bars_closed, read_record, training_settings
from .trainer import PretrainTrainer, shard_examples

# What to do with a checkpoint whose optimizer, scheduler or RNG state is a pickle of more than tensors.
RESUME_ADVICE = "resume from a checkpoint FAT5 wrote instead, or start a new run from its weights " \
                "(--model_name_or_path)"


@dataclass
class TrainerOptions(*checkpointing_flag(TrainingArguments), TrainingArguments, RunFolderArguments):
    _argument_group_name = "TrainingArguments options (transformers)"
    # None until the start is known: the default depends on the optimizer (DEFAULTS["learning_rate"]).
    learning_rate: float | None = field(default=None, metadata={
        "help": "the initial learning rate (default: "
                + ", ".join(f"{rate:g} with --optimizer {name}" for name, rate in DEFAULTS["learning_rate"].items())
                + ")"})


def full_parser(description=None):
    """HfArgumentParser over the pretraining flags and every TrainingArguments flag, with DEFAULTS."""
    return parser((PretrainArguments, TrainerOptions), DEFAULTS["trainer"], prog=PROG, usage=USAGE,
                  description=description, epilog=defaults_line())


def parse_args(argv):
    """The two dataclasses (from the command line, or a flags file), with DEFAULTS applied (the start-dependent
    ones once the start is known), and Trainer values no run can use refused."""
    args, training_args = parse(full_parser(), argv)
    start = "checkpoint" if args.model_name_or_path else "new model"
    if args.optimizer == "auto":
        args.optimizer = DEFAULTS["optimizer"][start]
    if training_args.learning_rate is None:
        training_args.learning_rate = DEFAULTS["learning_rate"][args.optimizer]
    if args.z_loss is None:
        args.z_loss = DEFAULTS["z_loss"][start]
    check_trainer_values(training_args)
    if training_args.eval_strategy != "no" or training_args.do_eval:
        # (Trainer would stop at its start: it is given no evaluation dataset.)
        given = f"--eval_strategy {training_args.eval_strategy.value}" if training_args.eval_strategy != "no" \
            else "--do_eval"
        raise CommandError(f"{given}: pretraining has no evaluation data (the corpus streams training examples only); "
                           f"leave --eval_strategy and --do_eval out")
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


def pretrain(args, training_args, argv, progress, program=PROG):
    """The run of `python -m fat5.training.pretrain ARGV` (fat5/training/pretrain.py parsed its flags into `args`
    and `training_args`; `program` started it, for the model card). Every input is checked before anything is
    written and before the model loads, except what only the corpus can tell (a trained tokenizer, the data after
    the first example)."""
    register_auto_classes()  # a FAT5 folder's tokenizer and config load with this installation's classes
    if training_args.max_steps <= 0:
        raise CommandError("a streamed corpus has no length: pass --max_steps")
    documents = Documents(args.train_files or (), args.text_field, args.dataset_name, args.dataset_config_name,
                          args.dataset_split)
    documents.check_not_empty()
    prefixes = sorted({denoiser.prefix for denoiser, _ in MIXTURES[args.mixture] if denoiser.prefix})
    if args.model_name_or_path:
        fields = checkpoint_config(args.model_name_or_path)
        rows = fields.get("vocab_size")
        check_attention_device(fields, training_args.device.type, f"--model_name_or_path {args.model_name_or_path}")
    else:
        rows = None
        check_attention_device(model_fields(args.config), training_args.device.type, f"--config {args.config}")
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
        card = RunCard(command=command_line(program, argv), task="text2text-generation",
                       base_model=args.model_name_or_path, data={"train": ", ".join(args.train_files or ())
                                                                  or f"--dataset_name {args.dataset_name}"},
                       tags=("pretraining",), how=f"pretrained with the {args.mixture} denoising mixture",
                       datasets=(args.dataset_name,) if args.dataset_name else (),
                       model_id=training_args.hub_model_id if training_args.push_to_hub else None)
        quiet_trainer_run(training_args, given_flags(argv))
        train(args, training_args, tokenizer, dataset, run_folder, card)


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


def train(args, training_args, tokenizer, dataset, run_folder, card=None):
    resume = run_folder.resume_checkpoint
    if resume:
        check_model_folder(resume, also=CHECKPOINT_JSON)  # before Trainer reads them
    if args.model_name_or_path:
        model = load_checkpoint(args.model_name_or_path, args.z_loss, training_args.allow_non_finite)
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
    trainer.card = card
    if training_args.disable_tqdm:
        disable_progress_bar()  # transformers' own bars too (writing checkpoint shards)
    state = run_folder.resume_state()
    # Trainer loads a checkpoint's optimizer, scheduler and RNG states with torch.load(weights_only=True).
    with worker_errors_as_one_line(), progress_bars_closed(trainer), \
            pickles_refused(f"--resume_from_checkpoint {resume}", RESUME_ADVICE):
        if state and state["global_step"] >= training_args.max_steps:
            # Killed after its last checkpoint, before its final save: nothing left to train (Trainer would take
            # one step past --max_steps).
            say(f"{resume} is the run's last step ({state['global_step']}): saving it as the final model")
            trainer.load_without_training(resume)
        else:
            output = trainer.train(resume_from_checkpoint=resume)
            if card is not None:
                card.results["train"] = {**output.metrics, "steps": trainer.state.global_step}
    with write_failures_reported("the final model", training_args.output_dir):
        trainer.save_model(training_args.output_dir)
        if card is not None and trainer.is_world_process_zero():
            card.write(training_args.output_dir)
    run_folder.finish()
    say(f"saved the model and tokenizer to {training_args.output_dir}")
