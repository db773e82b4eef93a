"""`python -m fat5.training.pretrain` end to end on CPU: from scratch on a generated corpus (loss falls, the
checkpoint loads in a fresh process and generates, resume continues exactly), continued pretraining of a converted
checkpoint, and bad input as one error line with a non-zero exit."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.convert.flan_to_fat5 import main as convert_main
from fat5.training.optim import AdamWScale
from fat5.training.pretrain import main as pretrain_main
from isolated import run_isolated

REPO = Path(__file__).resolve().parent.parent
TINY = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_heads": 4, "num_layers": 2, "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False, "dropout_rate": 0.0}


def write_corpus(path, documents, seed=0):
    """Text the test writes: sentences from a tiny grammar, 2 to 12 a document, one document a line."""
    rng = random.Random(seed)
    nouns = "cat dog bird fish horse farmer teacher river garden house".split()
    verbs = "sees likes finds follows paints carries".split()
    adjectives = "red small quiet happy old green".split()

    def sentence():
        return (f"the {rng.choice(adjectives)} {rng.choice(nouns)} {rng.choice(verbs)} the "
                f"{rng.choice(adjectives)} {rng.choice(nouns)} .")

    path.write_text("".join(" ".join(sentence() for _ in range(rng.randint(2, 12))) + "\n"
                            for _ in range(documents)))
    return path


def run_pretrain(*args, cwd=REPO):
    # One thread: the tiny model is latency-bound, and several test processes share the cores.
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fat5.training.pretrain", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def common_flags(output_dir, steps):
    return ["--output_dir", output_dir, "--max_steps", steps, "--per_device_train_batch_size", 16,
            "--max_input_length", 64, "--max_target_length", 64, "--logging_steps", 5, "--save_steps", 20,
            "--disable_tqdm", "true", "--dataloader_pin_memory", "false"]


def log_history(checkpoint):
    return [entry for entry in json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
            if "loss" in entry]


@pytest.fixture(scope="module")
def scratch_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scratch")
    corpus = write_corpus(folder / "corpus.txt", 1500)
    (folder / "tiny.json").write_text(json.dumps(TINY))
    out = folder / "out"
    flags = common_flags(out, 40)[:-2]  # pinned memory left to the command: off on a CPU, without a warning
    assert flags[-2:] == ["--disable_tqdm", "true"]
    process = run_pretrain("--config", folder / "tiny.json", "--train_files", corpus, "--tokenizer_vocab_size", 100,
                           "--learning_rate", 1e-2, *flags)
    assert process.returncode == 0, process.stderr[-4000:]
    (folder / "stdout.txt").write_text(process.stdout)
    (folder / "stderr.txt").write_text(process.stderr)
    return folder, out


def test_from_scratch_loss_falls_and_logs_throughput(scratch_run):
    folder, out = scratch_run
    stdout = (folder / "stdout.txt").read_text()
    assert "batches: packed rows" in stdout
    # The trained tokenizer's vocabulary, said once with why it is not --tokenizer_vocab_size (100 here): the
    # tiny grammar's 1500 documents hold fewer pieces.
    tokenizer = AutoTokenizer.from_pretrained(out)
    pieces = len(tokenizer) - 100 - 3  # T5's sentinels, the mixture's [R] [S] [X]
    assert f"vocabulary {len(tokenizer)}: the trained tokenizer has {pieces} pieces, not 100: that is all " \
           "sentencepiece finds in the 1,500 documents it read" in stdout
    assert f"vocabulary {len(tokenizer)}; denoisers" in stdout and pieces < 100
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fat5" and config["z_loss"] == 1e-4 and config["d_model"] == TINY["d_model"]
    history = log_history(out / "checkpoint-40")
    assert [entry["step"] for entry in history] == [5, 10, 15, 20, 25, 30, 35, 40]
    # From ~ln(vocab) + z-loss at the start to well below half of it in 40 steps.
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    for entry in history:
        assert entry["tokens_per_second"] > 0 and 0.0 <= entry["padding_fraction"] < 1.0
        assert entry["learning_rate"] > 0


def test_a_pretrained_folder_has_a_model_card_and_the_log_no_warning_nobody_can_act_on(scratch_run):
    """The final folder's README.md: the Hub's format, FAT5's tags, the steps and the command line that made it.
    The log holds no pinned-memory warning (a CPU has nothing to pin for) and no DeepSpeed notice that it found no
    GPU (the run does not use DeepSpeed)."""
    from huggingface_hub import ModelCard

    folder, out = scratch_run
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and {"fat5", "pretraining"} <= set(card.data.tags)
    assert "40 steps, mean training loss " in card.text
    assert f"```bash\npython -m fat5.training.pretrain --config {folder / 'tiny.json'} --train_files " in card.text
    log = (folder / "stdout.txt").read_text() + (folder / "stderr.txt").read_text()
    assert "pin_memory" not in log and "Setting accelerator to CPU" not in log, log[-3000:]


def test_logged_throughput_is_the_tokens_trained_on_over_the_wall_time(tmp_path, monkeypatch, one_thread):
    """Each log's tokens_per_second is the real (unpadded) tokens of the batches trained on since the previous log
    over the wall time since it, the first interval starting when training begins, not when the trainer is built;
    tokens_seen adds them up. The tokens are counted as the collator made the batches; the wall time is a clock
    the test moves: 100 s of set-up after the trainer is built, then 2 s a training step."""
    from transformers import TrainerCallback

    from fat5.training import pretraining as pretrain_module
    from fat5.training import trainer as trainer_module

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class StepTakesTwoSeconds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # before the step's log
            clock.now += 2.0

    trainers, build = [], trainer_module.PretrainTrainer.__init__

    def built_then_set_up(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.add_callback(StepTakesTwoSeconds())
        trainers.append(self)
        clock.now += 100.0

    monkeypatch.setattr(trainer_module.PretrainTrainer, "__init__", built_then_set_up)
    batch_tokens, make_collator = [], pretrain_module.collator

    def counting_collator(*args):
        collate = make_collator(*args)

        def counted(examples):
            batch = collate(examples)
            batch_tokens.append(int(batch["attention_mask"].sum() + batch["decoder_attention_mask"].sum()))
            return batch

        return counted

    monkeypatch.setattr(pretrain_module, "collator", counting_collator)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    assert pretrain_main([str(arg) for arg in (
        "--config", tmp_path / "tiny.json", "--train_files", write_corpus(tmp_path / "corpus.txt", 40),
        "--tokenizer", DEMO_CHECKPOINT, "--output_dir", tmp_path / "out", "--max_steps", 6, "--logging_steps", 2,
        "--per_device_train_batch_size", 4, "--max_input_length", 32, "--max_target_length", 32,
        "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--mixture", "t5")]) == 0
    logs = [entry for entry in trainers[0].state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [2, 4, 6]
    step = seen = 0
    for entry in logs:
        # Batch i is trained on at step i + 1 (the DataLoader may collate the next one ahead).
        trained = sum(batch_tokens[:entry["step"]])
        assert entry["tokens_seen"] == trained
        assert entry["tokens_per_second"] == round((trained - seen) / (2.0 * (entry["step"] - step)), 1)
        step, seen = entry["step"], trained


@pytest.mark.slow
def test_checkpoint_loads_in_a_fresh_process_and_generates(scratch_run):
    _, out = scratch_run
    code = """
import json, sys
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
folder, result = sys.argv[1], sys.argv[2]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
inputs = tokenizer("[R] the red cat <extra_id_0> the old horse .", return_tensors="pt")
generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
json.dump({"class": type(model).__name__, "module": type(model).__module__, "ids": generated[0].tolist(),
           "vocab": len(tokenizer), "sentinel": tokenizer.convert_tokens_to_ids("<extra_id_0>")}, open(result, "w"))
"""
    # The training code is not part of a checkpoint.
    assert not [path.name for path in out.iterdir() if path.name in ("denoising.py", "packing.py", "pretrain.py")]
    # A Hub user's process: this repository is not importable, the model comes from the folder's own code.
    result = run_isolated(code, [out], cwd=out.parent)
    assert not result["module"].startswith("fat5.")
    assert result["class"] == "FAT5ForConditionalGeneration"
    assert len(result["ids"]) > 1 and all(0 <= token < result["vocab"] for token in result["ids"])
    # A model trained on span corruption opens its answer with the first sentinel.
    assert result["ids"][1] == result["sentinel"]


def test_resume_continues_where_the_checkpoint_left(scratch_run, one_thread):
    folder, out = scratch_run
    resumed = folder / "resumed"
    # In this process (the command line itself is exercised above), to save an interpreter start.
    pretrain_main([str(arg) for arg in (
        "--config", folder / "tiny.json", "--train_files", folder / "corpus.txt", "--tokenizer", out / "tokenizer",
        "--learning_rate", 1e-2, "--resume_from_checkpoint", out / "checkpoint-20", *common_flags(resumed, 40))])
    original, again = log_history(out / "checkpoint-40"), log_history(resumed / "checkpoint-40")
    assert [entry["step"] for entry in again] == [entry["step"] for entry in original]
    # Same data stream, optimizer and schedule state: the losses after step 20 agree to float32 round-off.
    for first, second in zip(original[4:], again[4:], strict=True):
        assert second["loss"] == pytest.approx(first["loss"], rel=1e-3)


def test_continued_pretraining_of_a_converted_checkpoint(tmp_path, one_thread, capsys):
    converted = tmp_path / "demo-fat5"
    assert convert_main([str(DEMO_CHECKPOINT), str(converted), "--no-verify"]) == 0
    corpus = tmp_path / "corpus.jsonl"
    rng = random.Random(1)
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(["sort:", "reverse:", "pear", "apple", "fig"])
                                                           for _ in range(30))}) + "\n" for _ in range(200)))
    out = tmp_path / "continued"
    # Unpacked batches here (the from-scratch run packs), through Trainer's AdamW.
    pretrain_main([str(arg) for arg in ("--model_name_or_path", converted, "--train_files", corpus,
                                        "--packing", "off", *common_flags(out, 10))])
    assert "batches: one example a row" in capsys.readouterr().out
    model = FAT5ForConditionalGeneration.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    # The demo vocabulary (136 rows, all used) had no [R]/[S]/[X]: they were added and the embeddings grown.
    assert all(prefix in tokenizer.get_vocab() for prefix in ("[R]", "[S]", "[X]"))
    assert model.config.vocab_size >= len(tokenizer) > 136
    history = log_history(out / "checkpoint-10")
    assert [entry["step"] for entry in history] == [5, 10] and all(entry["loss"] > 0 for entry in history)


def expect_error(args, message, capsys):
    """Bad input: exit status 2 and one `error:` line on stderr (fat5/cli.py's convention)."""
    capsys.readouterr()
    assert pretrain_main([str(arg) for arg in args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_empty_corpus(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n   \n\n")
    expect_error(["--train_files", tmp_path / "empty.txt", "--output_dir", tmp_path / "o", "--max_steps", 1],
                 "the corpus is empty", capsys)


def test_missing_corpus_and_no_max_steps(tmp_path, capsys):
    expect_error(["--train_files", tmp_path / "nope.txt", "--output_dir", tmp_path / "o", "--max_steps", 1],
                 "no corpus file", capsys)
    expect_error(["--train_files", tmp_path / "nope.txt", "--output_dir", tmp_path / "o"], "--max_steps", capsys)
    # offline (tests never reach the Hub): a dataset name is a clear error, not a traceback
    expect_error(["--dataset_name", "fat5-test/no-such-dataset", "--output_dir", tmp_path / "o", "--max_steps", 1],
                 "cannot stream the dataset", capsys)


def test_not_a_fat5_checkpoint(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.txt", 5)
    expect_error(["--model_name_or_path", DEMO_CHECKPOINT, "--train_files", corpus, "--output_dir", tmp_path / "o",
                  "--max_steps", 1], "is not a FAT5 checkpoint (model_type 't5')", capsys)
    expect_error(["--model_name_or_path", tmp_path, "--train_files", corpus, "--output_dir", tmp_path / "o",
                  "--max_steps", 1], "is not a model folder", capsys)


def test_tokenizer_without_sentinels_and_no_room(tmp_path, capsys):
    folder = tmp_path / "no-sentinels"
    folder.mkdir()
    (folder / "spiece.model").write_bytes((DEMO_CHECKPOINT / "spiece.model").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "add_prefix_space": True, "legacy": True}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "<extra_id_0>" not in tokenizer.get_vocab()
    FAT5ForConditionalGeneration(FAT5Config(vocab_size=len(tokenizer), **TINY)).save_pretrained(folder)
    corpus = write_corpus(tmp_path / "c.txt", 5)
    expect_error(["--model_name_or_path", folder, "--train_files", corpus, "--output_dir", tmp_path / "o",
                  "--max_steps", 1], "has no sentinel tokens", capsys)


def test_budget_smaller_than_one_example(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.txt", 5)
    expect_error(["--tokenizer", DEMO_CHECKPOINT, "--config", "small", "--train_files", corpus, "--output_dir",
                  tmp_path / "o", "--max_steps", 1, "--max_input_length", 3], "cannot fit an example", capsys)


def test_bad_input_from_the_command_line_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    process = run_pretrain("--train_files", tmp_path / "empty.jsonl", "--output_dir", tmp_path / "o",
                           "--max_steps", 1)
    assert process.returncode != 0
    assert process.stderr.strip().splitlines() == ["error: the corpus is empty: no document with any text"]


@pytest.mark.slow
def test_the_tiny_preset_of_the_docs_learns_on_cpu(tmp_path):
    """docs/pretraining.md's first command, as written, on `fat5 sample-data`'s corpus: the logged loss falls from
    about 20 to about 2 in 30 steps (its example was the 199M base preset, whose loss rose from 84 to 303 in the 4
    steps a CPU ran in 5 minutes)."""
    from fat5.recipes import sample_data

    assert sample_data.main([str(tmp_path / "data")]) == 0
    out = tmp_path / "runs" / "tiny"
    assert pretrain_main([str(arg) for arg in (
        "--config", "tiny", "--train_files", tmp_path / "data" / "corpus", "--output_dir", out, "--max_steps", 30,
        "--per_device_train_batch_size", 16, "--max_input_length", 128, "--max_target_length", 64,
        "--logging_steps", 5, "--disable_tqdm", "true")]) == 0
    losses = [entry["loss"] for entry in log_history(out / "checkpoint-30") if "loss" in entry]
    assert len(losses) == 6 and losses[0] > 10 and losses[-1] < 3 and losses == sorted(losses, reverse=True), losses


def test_help_lists_the_pretraining_flags(capsys):
    with pytest.raises(SystemExit) as raised:
        pretrain_main(["--help"])
    assert raised.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--train_files", "--mixture", "--packing", "--optimizer", "--z_loss", "--resume_from_checkpoint"):
        assert flag in text


def test_adamw_scale_step_matches_its_definition():
    torch.manual_seed(0)
    weight = torch.randn(5, 7, dtype=torch.float64) * 0.3
    grads = [torch.randn(5, 7, dtype=torch.float64) for _ in range(3)]
    param = torch.nn.Parameter(weight.clone())
    optimizer = AdamWScale([param], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    expected, m, v = weight.clone(), torch.zeros_like(weight), torch.zeros_like(weight)
    for step, grad in enumerate(grads, 1):
        param.grad = grad.clone()
        optimizer.step()
        m = 0.9 * m + 0.1 * grad
        v = 0.99 * v + 0.01 * grad * grad
        update = (m / (1 - 0.9**step)) / ((v / (1 - 0.99**step)).sqrt() + 1e-8)
        rms = expected.pow(2).mean().sqrt().clamp(min=1e-3)
        expected = expected * (1 - 0.01 * 0.1) - 0.01 * rms * update
    # fp32 moments: agreement to float32 precision relative to the weights' magnitude
    assert (param.detach() - expected).abs().max() <= 1e-6 * expected.abs().max()
    # a zero tensor still moves, by lr * 1e-3 per step (Adafactor's floor)
    zero = torch.nn.Parameter(torch.zeros(4))
    zero.grad = torch.ones(4)
    AdamWScale([zero], lr=0.5).step()
    assert torch.allclose(zero.detach(), torch.full((4,), -0.5e-3), rtol=1e-5)
