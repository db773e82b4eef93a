"""The one runner of the fine-tuning recipes: flags, data, tokenizer, model (+ LoRA), Trainer, train / evaluate /
predict, save. A recipe (fat5/recipes/arguments.py `Recipe`) adds only how its rows become (input, target) texts, its
metric and, for a classification head, the class names.

Every input is read and checked before the model loads, so bad input costs seconds and ends with one `error:` line.
"""

import inspect
import json
import logging
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import datasets
import numpy as np
import transformers
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
)

from fat5 import register_auto_classes
from fat5.cli import CommandError, Progress, error_line, write_failures_reported
from fat5.files import (
    CHECKPOINT_JSON,
    check_attention_device,
    check_model_folder,
    check_tokenizer_folder,
    pickles_refused,
    read_json_object,
)
from fat5.recipes.arguments import FileFormatArguments, ModelArguments, changed_defaults
from fat5.recipes.data import load_dataset_splits, read_table, write_predictions
from fat5.training.finite import check_finite_weights
from fat5.training.flags import check_trainer_values, checkpointing_flag, flags_file, given_flags, parse, parser
from fat5.training.model_card import ModelCardTrainerMixin, RunCard, command_line
from fat5.training.packing import PackedSeq2SeqCollator, PackedTrainingMixin
from fat5.training.quiet import quiet_trainer_run
from fat5.training.run_folder import (
    TRAINING_SETTINGS,
    RunFolder,
    RunFolderArguments,
    RunFolderTrainerMixin,
    RunInput,
    progress_bars_closed,
    training_settings,
)

logger = logging.getLogger("recipes")
SPLITS = {"train": "do_train", "validation": "do_eval", "test": "do_predict"}
FILE_FLAGS = {"train": "train_file", "validation": "validation_file", "test": "test_file"}
LIMIT_FLAGS = {"train": "max_train_samples", "validation": "max_eval_samples", "test": "max_predict_samples"}
GENERATION_FLAGS = ("generation_max_length", "generation_num_beams", "generation_config")
# What to do with a checkpoint whose optimizer, scheduler or RNG state is a pickle of more than tensors.
RESUME_ADVICE = "resume from a checkpoint FAT5 wrote instead, or fine-tune its weights in a new run " \
                "(--model_name_or_path)"


@dataclass
class RecipeSeq2SeqTrainingArguments(*checkpointing_flag(Seq2SeqTrainingArguments), Seq2SeqTrainingArguments,
                                     RunFolderArguments):
    _argument_group_name = "Trainer options (transformers' Seq2SeqTrainingArguments)"
    # The default this runner uses (train_evaluate_predict), not the one transformers' help names.
    generation_max_length: int | None = field(default=None, metadata={
        "help": "longest generation in evaluation and prediction, in tokens (default: the model's generation "
                "config when it sets max_new_tokens, else --max_target_length)"})


@dataclass
class RecipeTrainingArguments(*checkpointing_flag(TrainingArguments), TrainingArguments, RunFolderArguments):
    _argument_group_name = "Trainer options (transformers' TrainingArguments)"


class RecipeTrainer(ModelCardTrainerMixin, RunFolderTrainerMixin, PackedTrainingMixin, Trainer):
    """Trainer whose checkpoints are atomic and belong to this run (fat5/training/run_folder.py), whose pushes
    carry the run's model card (fat5/training/model_card.py), and whose training batches may be packed rows
    (--packing: fat5/training/packing.py)."""


def recipe_dataclasses(recipe):
    """The dataclasses of a recipe's flags, in --help's order, and the Trainer defaults it changes."""
    training_class = RecipeSeq2SeqTrainingArguments if recipe.seq2seq else RecipeTrainingArguments
    return ((ModelArguments, recipe.data_arguments, FileFormatArguments, training_class),
            changed_defaults(recipe))


def recipe_parser(recipe, prog=None, description=None, usage=None):
    """The HfArgumentParser of a recipe's flags (its own and the Trainer's), with the defaults it changes."""
    dataclass_types, defaults = recipe_dataclasses(recipe)
    return parser(dataclass_types, defaults, prog=prog, description=description, usage=usage)


def check_flags(recipe, data_args, format_args, training_args, classes):
    """A flag that would have no effect in this combination is an error, not silently ignored."""
    if not training_args.do_train:
        for flag in ("resume_from_checkpoint", "overwrite_output_dir", "resume_with_changed_settings"):
            if getattr(training_args, flag):
                raise CommandError(f"--{flag} has no effect without --do_train")
        if data_args.packing:
            raise CommandError("--packing has no effect without --do_train (evaluation and prediction take one "
                               "example a row)")
    if not recipe.seq2seq and training_args.do_predict:
        raise CommandError("--do_predict: this recipe does not predict; run fat5.recipes.predict on the saved folder")
    for split, do_flag in SPLITS.items():
        if getattr(training_args, do_flag):
            continue
        for flag in (FILE_FLAGS[split], LIMIT_FLAGS[split]):
            if getattr(data_args, flag) is not None:
                raise CommandError(f"--{flag} has no effect without --{do_flag}")
    format_args.check_effect(getattr(data_args, flag) for flag in FILE_FLAGS.values())
    if data_args.packing and classes is not None:
        raise CommandError("--packing: the classifier head (--head classifier) scores one example a row; pack with "
                           "--head text, or train without --packing")
    if not recipe.seq2seq:
        return
    generates = classes is None and training_args.predict_with_generate
    evaluates = training_args.do_eval or training_args.do_predict
    given = [f"--{flag}" for flag in GENERATION_FLAGS if getattr(training_args, flag) is not None]
    if given and not (generates and evaluates):
        reason = "the classifier head does not generate" if classes is not None else \
            "nothing is generated without --do_eval or --do_predict (and --predict_with_generate)"
        raise CommandError(f"{', '.join(given)} has no effect: {reason}")


def load_splits(data_args, format_args, training_args):
    """{split: Table} for the splits the run needs, from files or a `datasets` name, cut to --max_*_samples."""
    wanted = [split for split, do_flag in SPLITS.items() if getattr(training_args, do_flag)]
    if not wanted:
        raise CommandError("nothing to do: pass --do_train, --do_eval and/or --do_predict")
    if data_args.dataset_name:
        tables = load_dataset_splits(data_args.dataset_name, data_args.dataset_config_name, wanted)
    else:
        tables = {}
        for split in wanted:
            path = getattr(data_args, FILE_FLAGS[split])
            if path is None:
                raise CommandError(f"--{SPLITS[split]} needs {split} data: pass --{FILE_FLAGS[split]}")
            tables[split] = read_table(path, format_args.tsv_quoting, format_args.max_field_chars)
    for split, table in tables.items():
        limit = getattr(data_args, LIMIT_FLAGS[split])
        tables[split] = table if limit is None else table.head(limit)
    return tables


class OnceEach(logging.Filter):
    """Lets each of transformers' messages through once: it repeats some warnings for every batch (on 5.24,
    generate()'s "Both `max_new_tokens` and `max_length` seem to have been set" once Seq2SeqTrainer has put the
    default max_length into the model's generation config). One filter sits on transformers' handler and on the
    root logger's: with `CI` set, transformers also propagates its records to the root logger, and a record the
    first handler printed is then not printed again."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record):
        if not record.name.startswith("transformers"):
            return True
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def setup_logging(training_args):
    """Console logging that fits a screen: the runner's own lines, and transformers' at --log_level (by default
    its warnings only: its info level prints every config it loads or saves; `--log_level info` shows them), each
    message once."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    transformers.utils.logging.enable_default_handler()
    once = OnceEach()  # a new one each run
    # transformers' own handler (its default one), and the root logger's, which `CI=1` makes transformers reach
    for handler in [*transformers.utils.logging.get_logger().handlers, *logging.getLogger().handlers]:
        for earlier in [each for each in handler.filters if isinstance(each, OnceEach)]:
            handler.removeFilter(earlier)
        handler.addFilter(once)
    transformers.set_seed(training_args.seed)


def encode(tokenizer, inputs, targets, data_args, classes, table):
    """input_ids / attention_mask (inputs truncated to --max_source_length) and labels: a class index, or the
    target's tokens. A target longer than --max_target_length is an error: truncating it would teach the model
    to stop mid-answer."""
    encoded = tokenizer([data_args.source_prefix + text for text in inputs], max_length=data_args.max_source_length,
                        truncation=True)
    if classes is not None:
        return datasets.Dataset.from_dict({**encoded, "labels": [classes.index(target) for target in targets]})
    labels = tokenizer(text_target=list(targets))["input_ids"]
    too_long = [row for row, label in enumerate(labels) if len(label) > data_args.max_target_length]
    if too_long:
        longest = max(len(label) for label in labels)
        raise CommandError(f"{table.where(too_long[0])}: target longer than --max_target_length="
                           f"{data_args.max_target_length} tokens ({len(too_long)} such rows, longest {longest}); "
                           f"raise the flag")
    return datasets.Dataset.from_dict({**encoded, "labels": labels})


def load_model(model_args, training_args, classes):
    """The model to fine-tune (with a LoRA adapter on FAT5's projections when --lora)."""
    with pickles_refused(f"the weights file of {model_args.model_name_or_path}"):
        if classes is None:
            model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, trust_remote_code=True)
            task_type, modules_to_save = "SEQ_2_SEQ_LM", None
        else:
            model = AutoModelForSequenceClassification.from_pretrained(
                model_args.model_name_or_path, trust_remote_code=True, num_labels=len(classes),
                id2label=dict(enumerate(classes)), label2id={name: index for index, name in enumerate(classes)})
            task_type, modules_to_save = "SEQ_CLS", ["classification_head"]
    if not training_args.allow_non_finite:
        check_finite_weights(model, f"--model_name_or_path {model_args.model_name_or_path}")
    if not model_args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    if training_args.gradient_checkpointing:
        # Frozen embeddings give checkpointed blocks inputs without grad; LoRA weights would get none.
        model.enable_input_require_grads()
    config = LoraConfig(task_type=task_type, r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                        lora_dropout=model_args.lora_dropout, modules_to_save=modules_to_save,
                        target_modules=[name.strip() for name in model_args.lora_target_modules.split(",")])
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        raise CommandError(f"--lora_target_modules {model_args.lora_target_modules}: {error_line(error)}") from None
    model.print_trainable_parameters()
    return model


def training_attention(config, device):
    """How attention trains on `device` (a FAT5 config; None for another model): the backend "auto" or the
    configured one picks, and the attention dropout it applies. A converted FLAN-T5 keeps Google's dropout_rate 0.1
    as attention_dropout_rate, which FAT5's Triton kernel applies in-kernel on CUDA."""
    if not hasattr(config, "attention_backend") or not hasattr(config, "attention_dropout_rate"):
        return None
    from fat5.attention_select_fat5 import needs_dense_bias, select_attention_backend

    try:
        backend = select_attention_backend(config, device, config.d_kv, needs_dense_bias(config))
    except ValueError as error:  # e.g. "triton" forced on a CPU: the first forward says the same
        return f"attention in training: {error_line(error)}"
    names = {"triton": "FAT5's Triton kernel", "sdpa": "SDPA", "eager": "the eager reference"}
    return (f"attention in training: {names.get(backend, backend)} on {device.type}, attention dropout "
            f"{config.attention_dropout_rate:g} (config.attention_dropout_rate)")


def model_line(model, source):
    """The model in one line (transformers' info level prints its whole config, at every load and save)."""
    return (f"model: {type(model).__name__} from {source}, {model.num_parameters() / 1e6:.1f}M parameters "
            f"({model.num_parameters(only_trainable=True) / 1e6:.1f}M trained), d_model {model.config.d_model}, "
            f"vocabulary {model.config.vocab_size}")


class RecipeSeq2SeqTrainer(ModelCardTrainerMixin, RunFolderTrainerMixin, PackedTrainingMixin, Seq2SeqTrainer):
    """Seq2SeqTrainer with the run folder's checkpoints and the run's model card, whose --generation_max_length holds
    even when the model's generation config sets max_new_tokens (which generate() would prefer to Seq2SeqTrainer's
    max_length)."""

    def evaluate(self, *args, **gen_kwargs):
        return super().evaluate(*args, **self.length_limit(gen_kwargs))

    def predict(self, *args, **gen_kwargs):
        return super().predict(*args, **self.length_limit(gen_kwargs))

    def length_limit(self, gen_kwargs):
        if self.args.generation_max_length is None or "max_length" in gen_kwargs or "max_new_tokens" in gen_kwargs:
            return gen_kwargs
        # An encoder-decoder's max_length counts the decoder start token.
        return {**gen_kwargs, "max_new_tokens": self.args.generation_max_length - 1}


def packing_collator(model, tokenizer, data_args):
    """The training collator of --packing: the examples of a batch in rows of up to --max_source_length input and
    --max_target_length target tokens (every encoded example fits them: inputs are truncated to the first, longer
    targets refused), kept apart by segment ids. Refused, before any training, where they cannot be kept apart."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "segment_ids" not in inspect.signature(base.forward).parameters:
        raise CommandError(f"--packing needs a FAT5 model, which keeps packed examples apart: "
                           f"{type(base).__name__} cannot (convert it first: fat5 convert FOLDER OUT)")
    return PackedSeq2SeqCollator(tokenizer.pad_token_id, base.config.decoder_start_token_id,
                                 data_args.max_source_length, data_args.max_target_length, pad_to_multiple_of=8)


def decode(tokenizer, ids):
    """Token ids (padded with -100 by the Trainer) to stripped strings."""
    ids = np.where(np.asarray(ids) < 0, tokenizer.pad_token_id, ids)
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def output_texts(tokenizer, classes, predictions):
    """The texts the model produced: generated tokens, or the name of the classifier's most likely class."""
    if classes is None:
        return decode(tokenizer, predictions)
    logits = predictions[0] if isinstance(predictions, tuple) else predictions
    return [classes[index] for index in np.asarray(logits).argmax(-1)]


def text_metrics(tokenizer, classes, score):
    """A Trainer `compute_metrics` that scores the output texts against the references with `score`."""
    def compute_metrics(eval_prediction):
        predictions = output_texts(tokenizer, classes, eval_prediction.predictions)
        references = decode(tokenizer, eval_prediction.label_ids) if classes is None else \
            [classes[index] for index in eval_prediction.label_ids]
        return {name: float(value) for name, value in score(predictions, references).items()}
    return compute_metrics


@contextmanager
def one_line_worker_errors():
    """A data-loader worker's exception carries the worker's whole traceback in its message: keep its last line."""
    try:
        yield
    except Exception as error:
        lines = str(error).strip().splitlines()
        if not lines or "in DataLoader worker process" not in lines[0]:
            raise
        raise CommandError(f"a data-loader worker failed: {lines[-1]} (run with --dataloader_num_workers 0 for "
                           f"the traceback)") from None


def save(trainer, tokenizer, model_args, training_args):
    """The model (or LoRA adapter), tokenizer and model card in --output_dir; with --merge_lora also the merged model
    and its card in OUTPUT_DIR/merged."""
    with write_failures_reported("the final model", training_args.output_dir):
        trainer.save_model()
    if model_args.merge_lora and trainer.is_world_process_zero():
        merged_dir = Path(training_args.output_dir) / "merged"
        with write_failures_reported("the merged model", training_args.output_dir):
            trainer.model.merge_and_unload().save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)
        logger.info("LoRA merged into %s", merged_dir)
    write_cards(trainer, model_args)


def write_cards(trainer, model_args):
    """The run's model card in --output_dir (an adapter's with --lora) and, with --merge_lora, in OUTPUT_DIR/merged;
    written again when an evaluation adds its metrics."""
    if trainer.card is None or not trainer.is_world_process_zero():
        return
    output_dir = trainer.args.output_dir
    with write_failures_reported("the model card", output_dir):
        trainer.card.write(output_dir, adapter=model_args.lora)
        if model_args.merge_lora:
            replace(trainer.card, model_id=None).write(Path(output_dir) / "merged")


def run_card(recipe, model_args, data_args, training_args, classes, tables, command):
    """What the model card of a training run says (fat5/training/model_card.py)."""
    return RunCard(command=command, task=recipe.task, base_model=model_args.model_name_or_path,
                   data={split: f"{table.name} ({len(table)} rows)" for split, table in tables.items()},
                   pipeline_tag="text-classification" if classes is not None else "text2text-generation",
                   tags=("lora",) if model_args.lora else (),
                   datasets=(data_args.dataset_name,) if data_args.dataset_name else (),
                   model_id=training_args.hub_model_id if training_args.push_to_hub else None)


def train(trainer, tokenizer, model_args, training_args, run_folder):
    """Train (or continue the run), then save. A run killed after its last step's checkpoint is saved from it
    (Trainer would train one step past its end)."""
    resume, state = run_folder.resume_checkpoint, run_folder.resume_state()
    # Trainer loads a checkpoint's optimizer, scheduler and RNG states with torch.load(weights_only=True).
    with pickles_refused(f"--resume_from_checkpoint {resume}", RESUME_ADVICE):
        if state and not run_folder.changed and state["global_step"] >= state["max_steps"] > 0:
            print(f"{resume} is the run's last step: saving it as the final model")
            trainer.load_without_training(resume)
        else:
            finish(trainer, "train", trainer.train(resume_from_checkpoint=resume).metrics)
            if summary := trainer.packing_summary() if trainer.train_collator is not None else None:
                logger.info(summary)
    save(trainer, tokenizer, model_args, training_args)
    run_folder.finish()


def finish(trainer, split, metrics, model_args=None):
    """Log and save a split's metrics; after training, the model card says them (`model_args`: rewrite it)."""
    trainer.log_metrics(split, metrics)
    with write_failures_reported(f"the {split} metrics", trainer.args.output_dir):
        trainer.save_metrics(split, metrics)
    if trainer.card is not None:
        trainer.card.results[split] = {**metrics, "steps": trainer.state.global_step}
        if model_args is not None:
            write_cards(trainer, model_args)


def fine_tune(recipe, argv=None, progress=None, program="python -m fat5.recipes"):
    """Run a recipe with command-line flags `argv`; returns the Trainer. A training run owns its --output_dir
    for its lifetime (fat5/training/run_folder.py); evaluation and prediction only add their results to it.
    `program`: how the command was started, for the model card's command line."""
    progress = progress or Progress()
    model_args, data_args, format_args, training_args = parse(recipe_parser(recipe), argv)
    check_trainer_values(training_args)
    classes = recipe.classes(data_args) if recipe.classes else None
    if classes is not None:
        training_args.predict_with_generate = False
    check_flags(recipe, data_args, format_args, training_args, classes)
    tables = load_splits(data_args, format_args, training_args)
    examples = {split: recipe.examples(table, data_args) for split, table in tables.items()}
    if recipe.check_training and "train" in tables:
        recipe.check_training(tables["train"], examples["train"][1], data_args)
    check_model_folder(model_args.model_name_or_path)  # before transformers and the tokenizer read it
    check_tokenizer_folder(model_args.model_name_or_path, "--model_name_or_path")
    if Path(model_args.model_name_or_path, "config.json").is_file():
        check_attention_device(read_json_object(Path(model_args.model_name_or_path) / "config.json"),
                               training_args.device.type, f"--model_name_or_path {model_args.model_name_or_path}")
    run_folder = None
    if training_args.do_train:
        run_folder = RunFolder(training_args.output_dir, training_args.resume_from_checkpoint,
                               overwrite=training_args.overwrite_output_dir, resume_flag="last",
                               inputs=run_inputs(model_args, data_args, training_args, argv),
                               settings=run_settings(model_args, data_args, format_args, training_args),
                               accept_changed_settings=training_args.resume_with_changed_settings,
                               check_changes=lambda changed: check_resumable_changes(changed, training_args))
    with run_folder.opened(training_args) if run_folder else nullcontext():
        if run_folder:
            progress.describe = run_folder.describe
            if run_folder.already_finished:
                print(f"{training_args.output_dir}: this run finished (its final model is there); nothing to do "
                      f"(evaluate or predict with --model_name_or_path {training_args.output_dir}, without --do_train)")
                return None
        return train_evaluate_predict(recipe, model_args, data_args, training_args, classes, tables, examples,
                                      run_folder, argv, program)


def run_inputs(model_args, data_args, training_args, argv):
    """Every path a training run reads, for the run folder's check against --output_dir."""
    argv = sys.argv[1:] if argv is None else list(argv)
    inputs = [RunInput("--model_name_or_path", model_args.model_name_or_path)]
    inputs += [RunInput(f"--{flag}", getattr(data_args, flag)) for flag in FILE_FLAGS.values()]
    if isinstance(training_args.deepspeed, str):
        inputs.append(RunInput("--deepspeed", training_args.deepspeed))
    if flags_file(argv):
        inputs.append(RunInput("the flags file", flags_file(argv)))
    return inputs


def run_settings(model_args, data_args, format_args, training_args):
    """What shapes the training, recorded by the run folder and compared when the run resumes: the model, data and
    file-format flags of training (the training file with its size) and Trainer's training settings."""
    not_training = ("merge_lora", "validation_file", "test_file", "max_eval_samples", "max_predict_samples")
    flags = {**asdict(model_args), **asdict(data_args), **asdict(format_args)}
    settings = {name: value for name, value in flags.items() if name not in not_training}
    if data_args.train_file and Path(data_args.train_file).is_file():
        settings["train_file"] = [data_args.train_file, Path(data_args.train_file).stat().st_size]
    return {**json.loads(json.dumps(settings, default=str)), **training_settings(training_args)}


# Settings --resume_with_changed_settings may change: they change how the run trains from here on, not which
# examples come next (Trainer positions a resumed epoch by batches, so another batch size, data or seed cannot be
# continued exactly).
RESUMABLE_CHANGES = tuple(name for name in TRAINING_SETTINGS if name not in (
    "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed", "group_by_length",
    "dataloader_drop_last"))


def check_resumable_changes(changed, training_args):
    fixed = sorted(set(changed) - set(RESUMABLE_CHANGES))
    if fixed:
        raise CommandError(f"--resume_with_changed_settings cannot continue this run exactly with another "
                           f"--{fixed[0]} (the data it trains on would not follow on); start a new run from its last "
                           f"checkpoint (--model_name_or_path {training_args.output_dir}/checkpoint-N)")


def train_evaluate_predict(recipe, model_args, data_args, training_args, classes, tables, examples, run_folder,
                           argv=None, program="python -m fat5.recipes"):
    resume = run_folder.resume_checkpoint if run_folder else None
    if resume:
        check_model_folder(resume, also=CHECKPOINT_JSON)  # before Trainer reads them
    setup_logging(training_args)
    quiet_trainer_run(training_args, given_flags(argv))
    register_auto_classes()  # the folder loads with this installation's FAT5 classes (transformers 5 prefers them)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=True)
    encoded = {split: encode(tokenizer, *examples[split], data_args, classes, tables[split]) for split in tables}
    model = load_model(model_args, training_args, classes)
    logger.info(model_line(model, model_args.model_name_or_path))
    if training_args.do_train and (line := training_attention(model.config, training_args.device)):
        logger.info(line)
    generates = recipe.seq2seq and classes is None and training_args.predict_with_generate
    if generates and training_args.generation_max_length is None and model.generation_config.max_new_tokens is None:
        training_args.generation_max_length = data_args.max_target_length
    scores = recipe.score is not None and (generates or classes is not None)
    if classes is None:
        collator = DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8)
    else:
        collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    trainer = (RecipeSeq2SeqTrainer if recipe.seq2seq else RecipeTrainer)(
        model=model, args=training_args, train_dataset=encoded.get("train"), eval_dataset=encoded.get("validation"),
        processing_class=tokenizer, data_collator=collator,
        compute_metrics=text_metrics(tokenizer, classes, recipe.score) if scores else None)
    if training_args.do_train and data_args.packing:
        trainer.train_collator = packing_collator(model, tokenizer, data_args)
    if training_args.do_train:
        trainer.card = run_card(recipe, model_args, data_args, training_args, classes, tables,
                                command_line(program, argv))
        trainer.card_is_adapter = model_args.lora
    with one_line_worker_errors(), progress_bars_closed(trainer):
        if training_args.do_train:
            train(trainer, tokenizer, model_args, training_args, run_folder)
        if training_args.do_eval:
            finish(trainer, "eval", trainer.evaluate(), model_args)
        if training_args.do_predict:
            output = trainer.predict(encoded["test"], metric_key_prefix="test")
            finish(trainer, "test", output.metrics, model_args)
            if trainer.is_world_process_zero() and (generates or classes is not None):
                inputs, references = examples["test"]
                with write_failures_reported("predictions.csv", training_args.output_dir):
                    write_predictions(Path(training_args.output_dir) / "predictions.csv",
                                      {"source": inputs, "reference": references,
                                       "prediction": output_texts(tokenizer, classes, output.predictions)})
    if training_args.do_train and training_args.push_to_hub and (training_args.do_eval or training_args.do_predict):
        # The save pushed the model and its card; this push adds the evaluation's metrics to the card, as
        # transformers' example scripts push once more at their end.
        trainer.push_to_hub(commit_message="Add the evaluation's metrics to the model card")
    return trainer
