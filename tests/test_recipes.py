"""The fine-tuning recipes (fat5/recipes/) run end to end on the bundled demo model, converted once per session.

Each recipe trains a few steps on data written here (generated from word lists; nothing downloaded): the loss
falls, the metric is computed, the saved folder (and the merged LoRA folder) loads and runs in a fresh interpreter
where this repository cannot be imported, and bad input ends with one error line.
"""

import contextlib
import csv
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import tiny_config
from fat5.recipes import classify, predict, summarization, train, translation
from fat5.recipes.runner import fine_tune, training_attention
from isolated import run_isolated

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "fat5" / "recipes" / "configs"
SUBJECTS = "cat dog bird fish fox cow hen owl".split()
VERBS = "sat ran saw ate sang slept".split()
PLACES = "mat box tree house road hill pond".split()
WORDS = SUBJECTS + VERBS + PLACES + "the a on in under by near red big small old happy little blue green".split()
# A made-up "language": every word replaced by another one of the vocabulary.
CIPHER = dict(zip(WORDS, random.Random(1).sample(WORDS, len(WORDS)), strict=True))
# Few rows, several epochs: enough for the loss to fall in a handful of steps.
TRAINER_FLAGS = ["--report_to", "none", "--logging_steps", "1", "--per_device_train_batch_size", "8",
                 "--per_device_eval_batch_size", "16", "--learning_rate", "3e-3", "--seed", "0",
                 "--save_strategy", "no", "--dataloader_pin_memory", "false", "--max_steps", "6"]


def sentence(rng):
    return f"the {rng.choice(SUBJECTS)} {rng.choice(VERBS)} on the {rng.choice(PLACES)}"


def translation_rows(rng, n):
    rows = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(2, 5))
        rows.append({"en": " ".join(words), "xx": " ".join(CIPHER[w] for w in words)})
    return rows


def summary_rows(rng, n):
    rows = []
    for _ in range(n):
        clauses = [sentence(rng) for _ in range(3)]
        rows.append({"document": " and ".join(clauses), "summary": clauses[0]})
    return rows


def double_rows(rng, n):
    rows = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(2, 4))
        rows.append({"source": "double: " + " ".join(words), "target": " ".join(w for w in words for _ in "ab")})
    return rows


def nli_rows(rng, n):
    """Premise "the S V on the P"; the hypothesis keeps S and V (entailment), changes V (contradiction) or changes
    S (neutral: another animal may have done it too)."""
    rows = []
    labels = ["entailment", "neutral", "contradiction"]
    for i in range(n):
        subject, verb, place = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(PLACES)
        label = labels[i % 3]
        if label == "entailment":
            hypothesis = f"the {subject} {verb}"
        elif label == "contradiction":
            hypothesis = f"the {subject} {rng.choice([v for v in VERBS if v != verb])}"
        else:
            hypothesis = f"the {rng.choice([s for s in SUBJECTS if s != subject])} {verb}"
        rows.append({"premise": f"the {subject} {verb} on the {place}", "hypothesis": hypothesis, "label": label})
    return rows


def write(path, rows):
    path = Path(path)
    if path.suffix in (".csv", ".tsv"):
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if path.suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    files = {}
    for name, make, suffix in [("translation", translation_rows, ".tsv"), ("summary", summary_rows, ".jsonl"),
                               ("double", double_rows, ".csv"), ("nli", nli_rows, ".jsonl")]:
        for split, n in [("train", 24), ("dev", 9), ("test", 9)]:
            files[f"{name}_{split}"] = write(folder / f"{name}_{split}{suffix}", make(rng, n))
    return files


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_loss_falls(trainer):
    history = losses(trainer)
    assert len(history) >= 4, history
    # Mean of the last two logged losses below the first two: robust to one noisy small batch.
    assert sum(history[-2:]) < sum(history[:2]), history


def metrics(output_dir, split):
    return json.loads((Path(output_dir) / f"{split}_results.json").read_text())


def assert_model_card(folder, task, results, library="transformers"):
    """FOLDER/README.md is a model card in the Hub's format: FAT5's tags, the library, the metrics of each split's
    final evaluation (`results`: {prefix: Trainer's metrics}) under model-index, the command line that made it (a
    token hidden), no leftover of its atomic write."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(Path(folder) / "README.md")
    assert card.data.library_name == library and {"fat5", "custom_code", task} <= set(card.data.tags)
    shown = {(result.dataset_split, result.metric_type): result.metric_value for result in card.data.eval_results or []}
    expected = {({"eval": "validation"}.get(prefix, prefix), name.removeprefix(prefix + "_")): float(f"{value:.4g}")
                for prefix, scores in results.items() for name, value in scores.items()
                if name.removeprefix(prefix + "_") in ("loss", "bleu", "chrf", "accuracy", "rouge1")}
    assert shown.items() >= expected.items() and (expected or not results), (shown, expected)
    assert "```bash\npython -m fat5.recipes --model_name_or_path " in card.text
    assert "trust_remote_code=True" in card.text
    assert "hf_secret" not in card.content and ("--hub_token HIDDEN" in card.text or "--hub_token" not in card.text)
    assert [path.name for path in Path(folder).iterdir() if path.name.startswith(".README")] == []


# (recipe module, flags, flags that take effect only with --do_eval / --do_predict): a flag without effect is an
# error.
RECIPES = {
    "translation": lambda model, data, out: (translation, [
        "--model_name_or_path", model, "--output_dir", out, "--train_file", data["translation_train"],
        "--source_column", "en", "--target_column", "xx", "--max_target_length", "16"], [
        "--validation_file", data["translation_dev"], "--test_file", data["translation_test"],
        "--generation_max_length", "16"]),
    "summarization": lambda model, data, out: (summarization, [
        "--model_name_or_path", model, "--output_dir", out, "--train_file", data["summary_train"],
        "--source_prefix", "summarize: ", "--max_target_length", "16"], [
        "--validation_file", data["summary_dev"], "--test_file", data["summary_test"],
        "--generation_max_length", "16"]),
    "train": lambda model, data, out: (train, [
        "--model_name_or_path", model, "--output_dir", out, "--train_file", data["double_train"]], [
        "--validation_file", data["double_dev"]]),
    "classify_text": lambda model, data, out: (classify, [
        "--model_name_or_path", model, "--output_dir", out, "--head", "text", "--train_file", data["nli_train"]], [
        "--validation_file", data["nli_dev"], "--test_file", data["nli_test"], "--generation_max_length", "12"]),
    "classify_classifier": lambda model, data, out: (classify, [
        "--model_name_or_path", model, "--output_dir", out, "--head", "classifier",
        "--train_file", data["nli_train"]], ["--validation_file", data["nli_dev"], "--test_file", data["nli_test"]]),
}


def run_recipe(name, demo_fat5, data, out, *flags, do=("--do_train", "--do_eval", "--do_predict")):
    recipe, args, evaluation_args = RECIPES[name](demo_fat5, data, str(out))
    if name == "train":
        do = [flag for flag in do if flag != "--do_predict"]
        evaluation_args = evaluation_args if "--do_eval" in do else []
    elif "--do_eval" not in do:
        evaluation_args = []
    return fine_tune(recipe.RECIPE, [*args, *evaluation_args, *TRAINER_FLAGS, *do, *flags])


def test_translation_bleu_chrf_and_predictions_csv(demo_fat5, data, tmp_path):
    trainer = run_recipe("translation", demo_fat5, data, tmp_path / "out", "--hub_token", "hf_secret")
    assert_loss_falls(trainer)
    for split in ("eval", "test"):
        scores = metrics(tmp_path / "out", split)
        assert 0 <= scores[f"{split}_bleu"] <= 100 and 0 < scores[f"{split}_chrf"] <= 100, scores
    assert_model_card(tmp_path / "out", "translation", {split: metrics(tmp_path / "out", split)
                                                        for split in ("eval", "test")})
    with open(tmp_path / "out" / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(data["translation_test"], newline="") as f:
        expected = list(csv.DictReader(f, delimiter="\t"))
    assert list(rows[0]) == ["source", "reference", "prediction"]
    assert [(r["source"], r["reference"]) for r in rows] == [(e["en"], e["xx"]) for e in expected]


def test_packing_trains_the_same_examples_in_fewer_rows_and_says_what_it_saved(demo_fat5, data, tmp_path, caplog):
    """--packing: every batch holds the examples of the unpacked batch (same sampler, same steps) in rows of up to
    --max_source_length input and --max_target_length target tokens, kept apart by segment ids, so the first
    step's loss is the unpacked one (a mean over the same target tokens); the log says how much padding packing
    removed; evaluation and prediction still generate one example a row."""
    rng = random.Random(2)  # lengths from 1 to 30 words: padding to a batch's longest wastes most of a batch
    rows = [{"en": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 30]))), "xx": ""} for _ in range(24)]
    for row in rows:
        row["xx"] = " ".join(CIPHER[word] for word in row["en"].split())
    data = {**data, "translation_train": write(tmp_path / "varied.tsv", rows)}
    unpacked = run_recipe("translation", demo_fat5, data, tmp_path / "unpacked", "--max_target_length", "64",
                          do=("--do_train",))
    with caplog.at_level("INFO", logger="recipes"):
        packed = run_recipe("translation", demo_fat5, data, tmp_path / "packed", "--packing", "--max_target_length",
                            "64")
    assert losses(packed)[0] == pytest.approx(losses(unpacked)[0], rel=1e-5)
    assert_loss_falls(packed)
    [summary] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("packing:")]
    assert re.fullmatch(r"packing: \d+% of the tokens trained on were padding, \d+% one example a row "
                        r"\([\d,]+ padding tokens of [\d,]+ removed\)", summary), summary
    packed_share, unpacked_share = map(int, re.findall(r"(\d+)%", summary))
    assert packed_share < unpacked_share
    assert all(0 <= entry["padding_fraction"] < 1 for entry in packed.state.log_history if "loss" in entry)
    scores = metrics(tmp_path / "packed", "test")
    assert 0 <= scores["test_bleu"] <= 100
    with open(tmp_path / "packed" / "predictions.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 9


def test_packing_is_refused_in_one_line_where_examples_cannot_be_kept_apart(demo_fat5, data, tmp_path, capsys):
    t5_folder = str(REPO / "fat5" / "convert" / "demo_t5")  # transformers' T5: no segment ids
    recipe, args, _ = RECIPES["translation"](t5_folder, data, str(tmp_path / "t5"))
    line = error_line(capsys, translation.main, [*args, *TRAINER_FLAGS, "--do_train", "--packing"])
    assert line == ("error: --packing needs a FAT5 model, which keeps packed examples apart: "
                    "T5ForConditionalGeneration cannot (convert it first: fat5 convert FOLDER OUT)")
    recipe, args, evaluation = RECIPES["classify_classifier"](demo_fat5, data, str(tmp_path / "head"))
    line = error_line(capsys, classify.main, [*args, *TRAINER_FLAGS, "--do_train", "--packing"])
    assert line.startswith("error: --packing: the classifier head (--head classifier) scores one example a row")
    recipe, args, evaluation = RECIPES["translation"](demo_fat5, data, str(tmp_path / "eval"))
    line = error_line(capsys, translation.main, [*args, *evaluation, *TRAINER_FLAGS, "--do_eval", "--packing"])
    assert line.startswith("error: --packing has no effect without --do_train")


@pytest.mark.slow
def test_torch_compile_trains_the_recipe(demo_fat5, data, tmp_path):
    """transformers' own --torch_compile compiles the model (FAT5's kernels are custom ops: one graph, no break);
    aot_eager here, as Inductor's C++ build would take minutes on a small CPU."""
    trainer = run_recipe("translation", demo_fat5, data, tmp_path / "out", "--torch_compile", "--torch_compile_backend",
                         "aot_eager", do=("--do_train",))
    assert_loss_falls(trainer)
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_summarization_rouge_bf16_activation_checkpointing(demo_fat5, data, tmp_path):
    """--activation_checkpointing, transformers 5.24's name for --gradient_checkpointing (which it warns about), on
    every admitted release (FAT5 gives it to 4.57 and 5.23)."""
    trainer = run_recipe("summarization", demo_fat5, data, tmp_path / "out", "--bf16", "--use_cpu",
                         "--activation_checkpointing")
    model = trainer.model
    assert model.is_activation_checkpointing if hasattr(type(model), "is_activation_checkpointing") \
        else model.is_gradient_checkpointing
    assert_loss_falls(trainer)
    scores = metrics(tmp_path / "out", "eval")
    for name in ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_rougeLsum"):
        assert 0 <= scores[name] <= 100, scores
    assert scores["eval_rouge1"] > 0, scores


@pytest.mark.slow
def test_train_then_predict_with_generation_flags(demo_fat5, data, tmp_path):
    trainer = run_recipe("train", demo_fat5, data, tmp_path / "model")
    assert_loss_falls(trainer)
    assert "eval_loss" in metrics(tmp_path / "model", "eval")
    # A separate run loads the saved folder; the generation flags reach generate().
    outputs = {}
    for name, flags in {"short": ["--max_new_tokens", "2"], "beams": ["--num_beams", "3", "--length_penalty", "0.5",
                                                                      "--max_new_tokens", "12"]}.items():
        out_csv = tmp_path / f"{name}.csv"
        process = subprocess.run(
            [sys.executable, "-m", "fat5.recipes.predict", "--model", str(tmp_path / "model"), "--input_file",
             data["double_test"], "--reference_column", "target", "--output_file", str(out_csv), *flags],
            cwd=REPO, capture_output=True, text=True)
        assert process.returncode == 0, process.stderr[-3000:]
        assert 0 <= json.loads(process.stdout.strip().splitlines()[-1])["accuracy"] <= 1
        with open(out_csv, newline="") as f:
            outputs[name] = list(csv.DictReader(f))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model", trust_remote_code=True)
    assert len(outputs["short"]) == 9 and list(outputs["short"][0]) == ["source", "reference", "prediction"]
    assert all(len(tokenizer(row["prediction"], add_special_tokens=False).input_ids) <= 2
               for row in outputs["short"])
    assert any(len(row["prediction"].split()) > 2 for row in outputs["beams"])


def isolated_accuracy(folder, rows, task, cwd):
    """Accuracy of a saved folder on NLI rows through `pipeline(task, trust_remote_code=True)` in a fresh
    interpreter that cannot import this repository."""
    code = """
import importlib.util, json, sys
from transformers import pipeline
folder, task, rows, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
pipe = pipeline(task, model=folder, trust_remote_code=True, device="cpu")
prompts = [f"premise: {r['premise']} hypothesis: {r['hypothesis']}" for r in rows]
if task == "text2text-generation":
    answers = [o["generated_text"].strip() for o in pipe(prompts, num_beams=1, do_sample=False, max_new_tokens=12)]
else:
    answers = [o["label"] for o in pipe(prompts)]
json.dump({"importable": [m for m in ("fat5", "convert") if importlib.util.find_spec(m)],
           "accuracy": sum(a == r["label"] for a, r in zip(answers, rows)) / len(rows)}, open(out, "w"))
"""
    result = run_isolated(code, [folder, task, json.dumps(rows)], cwd)
    assert result["importable"] == []
    return result["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("head, task", [("text", "text2text-generation"), ("classifier", "text-classification")])
def test_classification_both_heads_accuracy_in_fresh_process(demo_fat5, data, tmp_path, head, task):
    trainer = run_recipe(f"classify_{head}", demo_fat5, data, tmp_path / "out")
    assert_loss_falls(trainer)
    test_accuracy = metrics(tmp_path / "out", "test")["test_accuracy"]
    assert 0 <= test_accuracy <= 1
    rows = [json.loads(line) for line in Path(data["nli_test"]).read_text().splitlines()]
    # The saved folder, loaded by a user's pipeline elsewhere, scores what the Trainer measured.
    assert isolated_accuracy(str(tmp_path / "out"), rows, task, tmp_path) == pytest.approx(test_accuracy)
    # Both heads write their test predictions as label names.
    with open(tmp_path / "out" / "predictions.csv", newline="") as f:
        predictions = list(csv.DictReader(f))
    assert [row["reference"] for row in predictions] == [row["label"] for row in rows]
    accuracy = sum(row["prediction"] == row["reference"] for row in predictions) / len(rows)
    assert accuracy == pytest.approx(test_accuracy)


@pytest.fixture(scope="module")
def lora_run(demo_fat5, data, tmp_path_factory):
    """name -> (trainer, output folder) of recipe `name` trained with --lora --merge_lora, once a module: the tests
    read the folder."""
    runs = {}

    def run(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(f"lora-{name}") / "out"
            runs[name] = run_recipe(name, demo_fat5, data, out, "--lora", "--merge_lora", do=("--do_train",)), out
        return runs[name]

    return run


# translation in the default tier, the other recipes in the slow one.
@pytest.mark.parametrize("name", [name if name == "translation" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in RECIPES])
def test_lora_adapter_and_merged_folder(demo_fat5, lora_run, name):
    trainer, out = lora_run(name)
    assert_loss_falls(trainer)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    task = {"classify_text": "text-classification", "classify_classifier": "text-classification",
            "train": "text2text-generation"}.get(name, name)
    assert_model_card(out, task, {}, library="peft")  # the adapter's card, and the merged folder's
    assert_model_card(out / "merged", task, {})
    frozen = [n for n, p in trainer.model.named_parameters() if not p.requires_grad]
    assert any(".q." in n or n.endswith("q.base_layer.weight") for n in frozen)
    # The merged folder computes what the base model plus adapter computes.
    from peft import PeftModel

    auto = AutoModelForSequenceClassification if name == "classify_classifier" else AutoModelForSeq2SeqLM
    merged = auto.from_pretrained(out / "merged", trust_remote_code=True).eval()
    base = auto.from_pretrained(demo_fat5, trust_remote_code=True, **(
        {"num_labels": 3} if name == "classify_classifier" else {}))
    adapted = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[5, 9, 14, 20, 1]])
    inputs = {"input_ids": ids} if name == "classify_classifier" else {"input_ids": ids, "labels": ids}
    with torch.no_grad():
        expected, got = adapted(**inputs).logits, merged(**inputs).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.slow
def test_merged_lora_folder_serves_pipeline_in_fresh_process(lora_run, data, tmp_path):
    _, out = lora_run("classify_text")  # the run test_lora_adapter_and_merged_folder checks
    rows = [json.loads(line) for line in Path(data["nli_test"]).read_text().splitlines()]
    accuracy = isolated_accuracy(str(out / "merged"), rows, "text2text-generation", tmp_path)
    assert 0 <= accuracy <= 1


def test_resume_from_last_checkpoint(demo_fat5, data, tmp_path):
    out = tmp_path / "out"
    flags = ["--save_strategy", "steps", "--save_steps", "2"]
    first = run_recipe("train", demo_fat5, data, out, *flags, "--max_steps", "2", do=("--do_train",))
    assert (out / "checkpoint-2").is_dir() and first.state.global_step == 2
    # More steps than the run was started with change its schedule: an explicit choice.
    resumed = run_recipe("train", demo_fat5, data, out, *flags, "--max_steps", "4", "--resume_from_checkpoint",
                         "last", "--resume_with_changed_settings", do=("--do_train",))
    assert resumed.state.global_step == 4
    # The resumed run continues the saved history rather than starting over.
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4]


def error_line(capsys, main, argv):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), lines
    return lines[-1]


def test_bad_input_one_error_line(demo_fat5, data, tmp_path, capsys):
    base = ["--model_name_or_path", demo_fat5, "--do_train", "--report_to", "none"]
    missing = error_line(capsys, translation.main, [*base, "--output_dir", str(tmp_path / "a"), "--train_file",
                                                    data["translation_train"], "--source_column", "de"])
    assert "no column 'de'" in missing and "en, xx" in missing
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert "empty" in error_line(capsys, train.main, [*base, "--output_dir", str(tmp_path / "b"),
                                                      "--train_file", str(empty)])
    header_only = tmp_path / "header.csv"
    header_only.write_text("source,target\n")
    assert "no rows" in error_line(capsys, train.main, [*base, "--output_dir", str(tmp_path / "c"),
                                                        "--train_file", str(header_only)])
    too_long = error_line(capsys, summarization.main, [*base, "--output_dir", str(tmp_path / "d"), "--train_file",
                                                       data["summary_train"], "--max_target_length", "3"])
    assert "longer than --max_target_length=3" in too_long
    label = tmp_path / "label.jsonl"
    label.write_text(json.dumps({"premise": "the cat sat", "hypothesis": "a cat", "label": "maybe"}) + "\n")
    assert "'maybe'" in error_line(capsys, classify.main, [*base, "--output_dir", str(tmp_path / "e"),
                                                           "--train_file", str(label)])
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("a user's file")
    assert "holds files that are not a FAT5 run's" in error_line(capsys, train.main, [
        *base, "--output_dir", str(occupied), "--train_file", data["double_train"]])
    assert (occupied / "keep.txt").read_text() == "a user's file"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert "LoRA adapter" in error_line(capsys, predict.main, ["--model", str(adapter), "--input_file",
                                                               data["double_test"], "--output_file", "x.csv"])


def test_deepspeed_and_fsdp_configs():
    """The shipped configs have the fields the FLAN-T5-XXL ZeRO-3 recipes use, and the Trainer fills every "auto"."""
    from transformers import Seq2SeqTrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from fat5 import FAT5ForConditionalGeneration
    from fat5.modeling_fat5 import FAT5PreTrainedModel

    # The bucket sizes are "auto": the Trainer derives them from the model's hidden size (d_model).
    model = FAT5ForConditionalGeneration(tiny_config(vocab_size=32, d_model=16, d_kv=4, num_layers=1,
                                                     num_decoder_layers=1, decoder_start_token_id=0))
    for name, offload in [("ds_zero3_bf16.json", False), ("ds_zero3_offload_bf16.json", True)]:
        config = json.loads((CONFIGS / name).read_text())
        zero = config["zero_optimization"]
        assert zero["stage"] == 3 and zero["overlap_comm"] and zero["contiguous_gradients"]
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
        assert config["bf16"]["enabled"] == "auto" and config["train_micro_batch_size_per_gpu"] == "auto"
        assert ("offload_optimizer" in zero and zero["offload_param"]["device"] == "cpu") == offload
        filled = HfTrainerDeepSpeedConfig(config)
        args = Seq2SeqTrainingArguments(output_dir="unused", bf16=False, report_to="none")
        filled.trainer_config_process(args)
        filled.trainer_config_finalize(args, model, num_training_steps=10)
        assert "auto" not in json.dumps(filled.config), filled.config
    fsdp = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    assert fsdp["distributed_type"] == "FSDP"
    assert fsdp["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] in FAT5PreTrainedModel._no_split_modules


def test_generation_max_length_holds_over_the_models_max_new_tokens(demo_fat5, data, tmp_path):
    """The demo model's generation config sets max_new_tokens=32, which generate() prefers to the max_length
    Seq2SeqTrainer passes: --generation_max_length must still bound what is generated."""
    tokenizer = AutoTokenizer.from_pretrained(demo_fat5, trust_remote_code=True)
    lengths = {}
    for name, flags in {"default": [], "bounded": ["--generation_max_length", "3"]}.items():
        out = tmp_path / name
        fine_tune(translation.RECIPE, ["--model_name_or_path", demo_fat5, "--output_dir", str(out), "--test_file",
                                       data["translation_test"], "--source_column", "en", "--target_column", "xx",
                                       "--do_predict", "--report_to", "none", *flags])
        with open(out / "predictions.csv", newline="") as f:
            lengths[name] = [len(tokenizer(row["prediction"], add_special_tokens=False).input_ids)
                             for row in csv.DictReader(f)]
    assert max(lengths["default"]) > 2, lengths
    # max_length counts the decoder start token.
    assert max(lengths["bounded"]) <= 2, lengths


@pytest.mark.parametrize("ci", [None, "true"], ids=["CI unset", "CI=true"])
def test_the_default_log_fits_a_screen(demo_fat5, data, tmp_path, ci):
    """A recipe run as a user runs it: the model in one line (transformers' info level would print its config at
    every load and save), each message once (transformers 5.24 repeats a generation warning for every evaluation
    batch once Seq2SeqTrainer has set the default max_length), no warning about pinned memory on a CPU. Also
    where `CI` is set, as on CI services: transformers then hands its records to the root logger as well."""
    _, args, _ = RECIPES["translation"](demo_fat5, data, str(tmp_path / "out"))
    env = {key: value for key, value in os.environ.items() if key != "CI"} | ({"CI": ci} if ci else {})
    process = subprocess.run(
        [sys.executable, "-m", "fat5.recipes.translation", *args, "--validation_file", data["translation_dev"],
         "--do_train", "--do_eval",
         "--max_steps", "2", "--per_device_eval_batch_size", "2", "--report_to", "none", "--disable_tqdm", "true"],
        cwd=REPO, capture_output=True, text=True, env=env)
    assert process.returncode == 0, process.stderr[-3000:]
    lines = [line for line in (process.stdout + process.stderr).splitlines() if line.strip()]
    text = "\n".join(lines)
    assert '"d_model"' not in text and "Model config" not in text and "pin_memory" not in text, text
    assert "Setting accelerator to CPU" not in text, text  # DeepSpeed's, when installed: the run does not use it
    assert len([line for line in lines if "model: FAT5ForConditionalGeneration from " in line]) == 1, text
    messages = [line.split(": ", 1)[-1] for line in lines if "WARNING" in line or "warn" in line.lower()]
    assert len(messages) == len(set(messages)), text
    assert len(lines) < 40, text


def test_warnings_nobody_can_act_on_are_left_out_and_those_asked_for_kept():
    """On a CPU, pinned memory is off unless --dataloader_pin_memory is given (torch would warn that it has nothing to
    pin for); DeepSpeed's notice that it found no GPU is left out, by its message and module only, unless the run uses
    DeepSpeed."""
    import logging
    from types import SimpleNamespace

    from fat5.training.quiet import quiet_trainer_run

    def training_args(**flags):
        return SimpleNamespace(**{"device": torch.device("cpu"), "dataloader_pin_memory": True, "deepspeed": None,
                                  **flags})

    quiet = training_args()
    quiet_trainer_run(quiet, given=set())
    asked = training_args()
    quiet_trainer_run(asked, given={"dataloader_pin_memory"})
    assert quiet.dataloader_pin_memory is False and asked.dataloader_pin_memory is True
    deepspeed_logger = logging.getLogger("DeepSpeed")
    notice = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."

    def shown(message, path="site-packages/deepspeed/accelerator/real_accelerator.py"):
        return bool(deepspeed_logger.filter(deepspeed_logger.makeRecord(
            "DeepSpeed", logging.WARNING, path, 213, message, None, None)))

    assert not shown(notice) and shown(notice, path="elsewhere.py") and shown("another warning")
    quiet_trainer_run(training_args(deepspeed="ds_config.json"), given={"deepspeed"})
    assert shown(notice)


@pytest.mark.slow
def test_ctrl_c_and_the_run_folder(demo_fat5, data, tmp_path, capsys):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it, data-loader workers included) ends a
    training run with one `interrupted:` line saying what the output folder holds, exit status 130. While it runs,
    a second run on its folder is refused; afterwards, a new run is refused unless it resumes or overwrites, and
    `--resume_from_checkpoint last` never picks an incomplete checkpoint."""
    out = tmp_path / "out"
    base = ["--model_name_or_path", demo_fat5, "--output_dir", str(out), "--train_file", data["double_train"],
            "--do_train", "--save_strategy", "steps", "--save_steps", "1", "--report_to", "none"]
    process = subprocess.Popen(
        [sys.executable, "-m", "fat5.recipes.train", *base, "--max_steps", "100000", "--dataloader_num_workers", "2"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoint-2" / "fat5_run.json").is_file() and process.poll() is None \
                and time.monotonic() < deadline:  # checkpoint-2 complete (marked)
            time.sleep(0.2)
        assert process.poll() is None, process.stderr.read()[-3000:]
        # Even a run that would resume it may not write into a folder in use.
        assert "is in use by another run" in error_line(capsys, train.main, [*base, "--max_steps", "3",
                                                                             "--resume_from_checkpoint", "last"])
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"interrupted: {out} holds checkpoint-"), last_line
    assert "--resume_from_checkpoint last" in last_line, last_line
    steps = sorted(int(path.name.split("-")[1]) for path in out.glob("checkpoint-*"))
    assert steps and steps[-1] >= 2

    assert "holds another run's results" in error_line(capsys, train.main, [*base, "--max_steps", "1"])
    # A checkpoint that is not complete (its save was interrupted) is never resumed from.
    incomplete = out / f"checkpoint-{steps[-1] + 50}"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    resumed = fine_tune(train.RECIPE, [*base, "--max_steps", str(steps[-1] + 1), "--resume_from_checkpoint", "last",
                                       "--resume_with_changed_settings"])
    assert resumed.state.global_step == steps[-1] + 1
    assert not incomplete.exists()
    overwritten = fine_tune(train.RECIPE, [*base, "--max_steps", "1", "--overwrite_output_dir"])
    assert overwritten.state.global_step == 1
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-1"]


def test_a_run_never_destroys_or_silently_changes_its_inputs(demo_fat5, data, tmp_path, capsys):
    """Fine-tuning in place is refused before anything is deleted; a resume with another batch size cannot continue
    exactly and is refused even when asked; a finished run resumed is a no-op that says so."""
    model = tmp_path / "model"
    shutil.copytree(demo_fat5, model)
    before = sorted(path.name for path in model.iterdir())
    line = error_line(capsys, train.main, ["--model_name_or_path", str(model), "--output_dir", str(model),
                                           "--overwrite_output_dir", "--train_file", data["double_train"],
                                           "--do_train", "--report_to", "none"])
    assert line == (f"error: --model_name_or_path {model} is --output_dir {model} itself: the run would write over "
                    f"what it reads; choose another --output_dir")
    assert sorted(path.name for path in model.iterdir()) == before
    out = tmp_path / "out"
    flags = ["--save_strategy", "steps", "--save_steps", "2", "--max_steps", "2"]
    run_recipe("train", demo_fat5, data, out, *flags, do=("--do_train",))
    inside = out / "train.csv"
    shutil.copy(data["double_train"], inside)
    recipe, args, _ = RECIPES["train"](demo_fat5, {**data, "double_train": str(inside)}, str(out))
    assert recipe.main([*args, *TRAINER_FLAGS, "--do_train", "--overwrite_output_dir", *flags]) == 2
    assert f"--train_file {inside} lies inside --output_dir {out}" in capsys.readouterr().err
    assert inside.is_file() and (out / "checkpoint-2").is_dir()
    inside.unlink()
    resume = [*flags, "--resume_from_checkpoint", "last", "--resume_with_changed_settings"]
    recipe, args, _ = RECIPES["train"](demo_fat5, data, str(out))
    smaller = [*args, *TRAINER_FLAGS, "--do_train", *resume, "--per_device_train_batch_size", "4"]
    assert "cannot continue this run exactly with another --per_device_train_batch_size" in error_line(
        capsys, recipe.main, smaller)
    assert recipe.main([*args, *TRAINER_FLAGS, "--do_train", *flags, "--resume_from_checkpoint", "last"]) == 0
    assert "this run finished (its final model is there); nothing to do" in capsys.readouterr().out
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]
    # --overwrite_output_dir with a resume from the folder (under any path to it), or another path to the output
    # folder as the model: refused, nothing deleted.
    files = sorted(str(path.relative_to(out)) for path in out.rglob("*"))
    alias = tmp_path / "alias"
    alias.symlink_to(out)
    for resume in ("last", "latest", str(out / "checkpoint-2"), str(alias / "checkpoint-2")):
        line = error_line(capsys, recipe.main, [*args, *TRAINER_FLAGS, "--do_train", *flags, "--overwrite_output_dir",
                                                "--resume_from_checkpoint", resume])
        assert line.startswith(f"error: --overwrite_output_dir would delete what --resume_from_checkpoint {resume} "
                               f"continues from in {out}"), line
    line = error_line(capsys, train.main, ["--model_name_or_path", str(alias), "--output_dir", str(out),
                                           "--overwrite_output_dir", "--train_file", data["double_train"],
                                           "--do_train", "--report_to", "none"])
    assert f"--model_name_or_path {alias} is --output_dir {out} itself" in line
    assert sorted(str(path.relative_to(out)) for path in out.rglob("*")) == files


def poisoned(folder, into):
    """A copy of the model folder `folder` in which one weight holds a NaN: (the copy, the weight's name)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    weights = load_file(into / "model.safetensors")
    name = sorted(name for name in weights if name.endswith("layer_norm.weight"))[0]
    weights[name][0] = float("nan")
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into, name


def test_a_model_with_a_nan_weight_is_refused_naming_it(demo_fat5, data, tmp_path, capsys):
    """Training or predicting with it: one line naming the tensor, before anything is written; --allow_non_finite
    trains it anyway (and saves what it trains)."""
    model, name = poisoned(Path(demo_fat5), tmp_path / "model")
    args = ["--model_name_or_path", str(model), "--train_file", data["double_train"], "--do_train", *TRAINER_FLAGS]
    line = error_line(capsys, train.main, [*args, "--output_dir", str(tmp_path / "out")])
    assert line == f"error: --model_name_or_path {model}: {name} holds 1 NaN value, so it computes nothing useful; " \
                   f"pass --allow_non_finite to use it anyway"
    assert not (tmp_path / "out").exists()
    line = error_line(capsys, predict.main, ["--model", str(model), "--input_file", data["double_test"],
                                             "--output_file", str(tmp_path / "predictions.csv")])
    assert line.startswith(f"error: --model {model}: {name} holds 1 NaN value") and \
        not (tmp_path / "predictions.csv").exists()
    assert train.main([*args, "--output_dir", str(tmp_path / "allowed"), "--allow_non_finite", "--max_steps",
                       "1"]) == 0


def test_a_run_whose_loss_turns_nan_stops_keeping_its_last_good_checkpoint(demo_fat5, data, tmp_path, capsys):
    """A learning rate so large that the weights overflow after the first step: the second step's gradient is NaN,
    and the run stops there with exit status 1 and one line, its checkpoint-1 intact, no final model saved."""
    out = tmp_path / "out"
    args = ["--model_name_or_path", demo_fat5, "--train_file", data["double_train"], "--do_train", *TRAINER_FLAGS,
            "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "1", "--learning_rate", "1e30"]
    assert train.main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == f"error: training stopped at step 2: the gradient norm is nan; nothing from this step on was " \
                        f"saved (pass --allow_non_finite to train on non-finite values); {out} holds checkpoint-1, " \
                        f"this run's last complete checkpoint (continue with --resume_from_checkpoint last)", lines
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / "model.safetensors").exists()


def test_recipes_say_a_flan_t5_fine_tunes_with_its_own_dropout_on_the_kernel():
    """A FLAN-T5-shaped config (dropout_rate 0.1, hence attention_dropout_rate 0.1) trains with the kernel on CUDA
    (the line the runner logs before training), SDPA elsewhere, and only FIRE's dense bias leaves the kernel."""
    pytest.importorskip("triton")
    flan_shaped = tiny_config(dropout_rate=0.1, d_kv=64, num_heads=12)
    assert flan_shaped.attention_dropout_rate == 0.1
    assert training_attention(flan_shaped, torch.device("cuda")) == (
        "attention in training: FAT5's Triton kernel on cuda, attention dropout 0.1 (config.attention_dropout_rate)")
    assert training_attention(flan_shaped, torch.device("cpu")) == (
        "attention in training: SDPA on cpu, attention dropout 0.1 (config.attention_dropout_rate)")
    fire = tiny_config(dropout_rate=0.1, d_kv=64, position_encoding_type="fire")
    assert training_attention(fire, torch.device("cuda")).startswith("attention in training: SDPA on cuda")
    assert training_attention(object(), torch.device("cuda")) is None


def test_push_to_hub_pushes_the_model_card(demo_fat5, data, tmp_path):
    """--push_to_hub uploads the folder with the run's card (Trainer's create_model_card writes ours), and once more
    at the end with the evaluation's metrics. The Hub is mocked: HfApi's methods (transformers 5) and the functions
    4.57's Trainer imported."""
    import transformers.trainer
    from huggingface_hub import HfApi

    uploaded = []

    def upload_folder(*args, folder_path=None, **kwargs):
        uploaded.append((Path(folder_path) / "README.md").read_text())
        return mock.Mock(commit_url="https://huggingface.co/me/fat5-x/commit/1", oid="1")

    repo = mock.Mock(repo_id="me/fat5-x")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(HfApi, "create_repo", return_value=repo))
        stack.enter_context(mock.patch.object(HfApi, "upload_folder", side_effect=upload_folder))
        for name, function in (("create_repo", lambda *args, **kwargs: repo), ("upload_folder", upload_folder)):
            if hasattr(transformers.trainer, name):
                stack.enter_context(mock.patch.object(transformers.trainer, name, side_effect=function))
        run_recipe("train", demo_fat5, data, tmp_path / "out", "--push_to_hub", "--hub_model_id", "me/fat5-x",
                   do=("--do_train", "--do_eval"))
    assert len(uploaded) >= 2, uploaded
    assert all(text.startswith("---\n") and "- fat5\n" in text for text in uploaded)
    assert 'model="me/fat5-x"' in uploaded[-1] and "split: validation" in uploaded[-1]


def test_the_card_names_the_hub_model_a_folder_was_converted_from(tmp_path):
    from fat5.training.model_card import hub_base_model

    (tmp_path / "README.md").write_text("---\nbase_model: google/flan-t5-small\ntags:\n- fat5\n---\n\n# A FAT5\n")
    assert hub_base_model(str(tmp_path)) == "google/flan-t5-small"
    assert hub_base_model("google/flan-t5-base") == "google/flan-t5-base"
    assert hub_base_model(str(tmp_path / "missing")) == str(tmp_path / "missing")  # no such folder: a Hub id
    (tmp_path / "README.md").unlink()
    assert hub_base_model(str(tmp_path)) is None and hub_base_model(None) is None


def test_predict_shows_progress_and_says_where_it_wrote(demo_fat5, data, tmp_path, capsys):
    output = tmp_path / "predictions.csv"
    assert predict.main(["--model", demo_fat5, "--input_file", data["double_test"], "--output_file", str(output),
                         "--reference_column", "target", "--batch_size", "4", "--max_new_tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "accuracy" in json.loads(captured.out)  # stdout: the score only
    lines = captured.err.replace("\r", "\n").strip().splitlines()
    assert any(line.startswith("generating: 100%") and "9/9" in line for line in lines), lines
    assert lines[-1] == f"wrote 9 rows (source, reference, prediction) to {output}", lines
    assert len(list(csv.DictReader(output.open(newline="")))) == 9


def test_sample_data_writes_a_file_for_every_format_and_keeps_what_is_there(tmp_path, capsys):
    from fat5.recipes import sample_data
    from fat5.recipes.data import FORMATS, read_table
    from fat5.training.data import Documents

    folder = tmp_path / "data"
    assert sample_data.main([str(folder), "--rows", "24"]) == 0
    files = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    assert files == sorted(sample_data.sample_files(24)) and {Path(name).suffix for name in files} >= set(FORMATS)
    columns = {"translation": ["words", "digits"], "summaries": ["document", "summary"], "pairs": ["source", "target"],
               "nli": ["premise", "hypothesis", "label"]}
    for name in files:
        task, _, split = Path(name).stem.partition("_")
        if task in columns:
            table = read_table(folder / name)
            assert list(table.columns) == columns[task] and len(table) == (24 if split == "train" else 3), name
    assert Documents([str(folder / "corpus"), str(folder / "domain.jsonl")], "text").files
    # The same command again keeps the files; a file of the user's under one of the names is refused, untouched.
    assert sample_data.main([str(folder), "--rows", "24"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote 0 sample files to {folder} (15 already there)"
    (folder / "pairs_dev.csv").write_text("mine\n")
    assert sample_data.main([str(folder), "--rows", "24"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {folder}/pairs_dev.csv exists with other content (another --rows or --seed, or a file of yours); "
        f"choose another folder"]
    assert (folder / "pairs_dev.csv").read_text() == "mine\n"


@pytest.mark.parametrize("argv, says", [
    # An empty name once wrote the fifteen files into the current folder ("wrote 15 sample files to ").
    ([""], "error: DIR '' names no folder: give one, such as data"),
    # 10^11 rows once grew to 5.9 GB in 13 minutes, printing nothing.
    (["data", "--rows", str(10**11)], "error: --rows 100000000000: must be between 3 and 100,000 (sample files to "
                                      "try the commands on; 100,000 rows make about 93 MB)"),
    (["data", "--rows", "2"], "error: --rows 2: must be between 3 and 100,000"),
])
def test_sample_data_refuses_sizes_and_names_before_writing(argv, says, tmp_path, capsys, monkeypatch):
    from fat5.recipes import sample_data

    monkeypatch.chdir(tmp_path)
    assert sample_data.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), lines
    assert not any(tmp_path.iterdir())
