"""The text2text-generation pipeline shipped as remote code (fat5/pipeline_fat5.py).

The end-to-end test loads it the way users do: from a checkpoint folder, in a fresh interpreter where the repo is not
importable, through `pipeline(..., trust_remote_code=True)`. Runs on transformers 4.57 and 5.x.
"""

import io
import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import transformers
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration, T5Tokenizer

from fat5.convert.hub import custom_pipelines_entry
from fat5.pipeline_fat5 import FAT5Text2TextGenerationPipeline
from isolated import run_isolated

REPO = Path(__file__).resolve().parent.parent
PIPELINE_FILE = REPO / "fat5" / "pipeline_fat5.py"
TEXTS = ["translate English to German: how old are you", "the quick brown fox", "hello world this is a test"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "translate English to German: how old are you",
    "summarize: a tiny model for tests",
    "hello world this is a test sentence",
]
# Greedy, with pad/eos/unk suppressed: the random model would otherwise mostly emit pad, which decodes to "".
GREEDY = {"max_new_tokens": 5, "num_beams": 1, "do_sample": False, "suppress_tokens": [0, 1, 2]}
MODEL_MAX_NEW_TOKENS = 3

# Runs in the checkpoint folder with the repo hidden; writes what the pipelines returned as JSON.
CHILD = """
import importlib.util, json, sys
from transformers import pipeline

ckpt, texts, greedy, out_path = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
out = {"importable": [m for m in ("fat5", "convert") if importlib.util.find_spec(m) is not None]}
pipes = {
    "by_task": pipeline("text2text-generation", model=ckpt, trust_remote_code=True, device="cpu"),
    "inferred": pipeline(model=ckpt, trust_remote_code=True, device="cpu"),
}
for name, pipe in pipes.items():
    out[name] = {
        "class": [type(pipe).__name__, type(pipe).__module__],
        "single": pipe(texts[0], **greedy),
        "list": pipe(texts, **greedy),
        "padded_batch": pipe(texts, batch_size=2, **greedy),
    }
pipe = pipes["by_task"]
ids = pipe(texts[0], return_tensors=True, **greedy)
out["ids"] = [{k: v.tolist() for k, v in record.items()} for record in ids]
out["multi"] = pipe(texts[:2], num_beams=2, num_return_sequences=2, max_new_tokens=4)
out["prefix"] = pipe(texts[1], prefix="summarize: ", **greedy)
defaults = pipe(texts[0], return_tensors=True)
out["defaults_ids"] = [record["generated_token_ids"].tolist() for record in defaults]
with open(out_path, "w") as f:
    json.dump(out, f)
"""


def _tiny_tokenizer(tmp_dir):
    """A T5 sentencepiece tokenizer trained here, so nothing is downloaded."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=model, vocab_size=60, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False, minloglevel=2,
    )
    spm_path = tmp_dir / "spiece.model"
    spm_path.write_bytes(model.getvalue())
    if int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 5's T5Tokenizer is tokenizers-backed and takes the pieces (reading a .model file needs protobuf).
        processor = spm.SentencePieceProcessor(model_file=str(spm_path))
        vocab = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]
        return T5Tokenizer(vocab=vocab, extra_ids=0)
    return T5Tokenizer(vocab_file=str(spm_path), extra_ids=0)


def _tiny_t5(vocab_size):
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config).eval()
    # Only max_new_tokens is set: num_beams must then come from the pipeline's default (4).
    model.generation_config.max_new_tokens = MODEL_MAX_NEW_TOKENS
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny T5 folder exported like a FAT5 checkpoint: pipeline file alongside, custom_pipelines in config.json."""
    work = tmp_path_factory.mktemp("pipeline")
    tokenizer = _tiny_tokenizer(work)
    model = _tiny_t5(len(tokenizer))
    ckpt = work / "ckpt"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    shutil.copy(PIPELINE_FILE, ckpt / PIPELINE_FILE.name)
    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text())
    config["custom_pipelines"] = custom_pipelines_entry()
    config_path.write_text(json.dumps(config, indent=2))
    return ckpt


@pytest.fixture(scope="module")
def child_outputs(checkpoint):
    return run_isolated(CHILD, [checkpoint, json.dumps(TEXTS), json.dumps(GREEDY)], cwd=checkpoint.parent)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Direct model.generate + decode on the saved folder."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = T5ForConditionalGeneration.from_pretrained(checkpoint).eval()

    def generate(text, **kwargs):
        with torch.no_grad():
            ids = model.generate(**tokenizer(text, return_tensors="pt"), **kwargs)
        return ids.tolist(), tokenizer.batch_decode(ids, skip_special_tokens=True)

    return generate


def test_repo_is_hidden_from_the_child(child_outputs):
    assert child_outputs["importable"] == []


@pytest.mark.parametrize("name", ["by_task", "inferred"])
def test_pipeline_is_ours_and_matches_generate(child_outputs, reference, name):
    result = child_outputs[name]
    class_name, module = result["class"]
    assert class_name == "FAT5Text2TextGenerationPipeline"
    assert module.split(".")[-1] == "pipeline_fat5" and not module.startswith("fat5")

    expected = [reference(text, **GREEDY)[1][0] for text in TEXTS]
    assert any(expected), "the tiny model only generates special tokens: the comparison would be vacuous"
    # A string gives a list with one dict; a list gives one dict per input (4.x's format).
    assert result["single"] == [{"generated_text": expected[0]}]
    assert result["list"] == [{"generated_text": text} for text in expected]
    assert result["padded_batch"] == [{"generated_text": text} for text in expected]


def test_token_ids_match_generate(child_outputs, reference):
    ids, _ = reference(TEXTS[0], **GREEDY)
    assert child_outputs["ids"] == [{"generated_token_ids": ids[0]}]


def test_several_sequences_per_input_give_lists(child_outputs, reference):
    multi = child_outputs["multi"]
    assert len(multi) == 2
    for text, records in zip(TEXTS[:2], multi):
        _, expected = reference(text, num_beams=2, num_return_sequences=2, max_new_tokens=4)
        assert records == [{"generated_text": e} for e in expected]


def test_prefix(child_outputs, reference):
    _, expected = reference("summarize: " + TEXTS[1], **GREEDY)
    assert child_outputs["prefix"] == [{"generated_text": expected[0]}]


def test_model_generation_config_wins_over_pipeline_defaults(child_outputs, reference):
    # max_new_tokens from generation_config.json, num_beams=4 from the pipeline's defaults.
    ids, _ = reference(TEXTS[0], max_new_tokens=MODEL_MAX_NEW_TOKENS, num_beams=4)
    assert child_outputs["defaults_ids"] == ids
    assert len(ids[0]) <= 1 + MODEL_MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def in_process_pipe(checkpoint):
    return FAT5Text2TextGenerationPipeline(
        model=T5ForConditionalGeneration.from_pretrained(checkpoint),
        tokenizer=AutoTokenizer.from_pretrained(checkpoint),
        device="cpu",
    )


def test_return_options(in_process_pipe):
    both = in_process_pipe(TEXTS[0], return_tensors=True, return_text=True, **GREEDY)
    assert set(both[0]) == {"generated_text", "generated_token_ids"}
    only_ids = in_process_pipe(TEXTS[0], return_tensors=True, **GREEDY)
    assert set(only_ids[0]) == {"generated_token_ids"}
    with pytest.raises(ValueError, match="nothing to return"):
        in_process_pipe(TEXTS[0], return_text=False, **GREEDY)


def test_rejects_non_string_inputs(in_process_pipe):
    with pytest.raises(TypeError, match="strings"):
        in_process_pipe([[1, 2]])


def test_rejects_decoder_only_models(checkpoint):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(ValueError, match="encoder-decoder"):
        FAT5Text2TextGenerationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint), device="cpu")


def test_custom_pipelines_entry_is_what_transformers_writes(checkpoint, tmp_path, monkeypatch):
    """`register_pipeline` + `Pipeline.save_pretrained` on the installed transformers write our entry."""
    from transformers import AutoModelForSeq2SeqLM
    from transformers.pipelines import PIPELINE_REGISTRY

    # Registering mutates the registry and the class: keep both changes local to this test.
    monkeypatch.setattr(PIPELINE_REGISTRY, "supported_tasks", dict(PIPELINE_REGISTRY.supported_tasks))
    monkeypatch.setattr(FAT5Text2TextGenerationPipeline, "_registered_impl", None, raising=False)
    task = "text2text-generation"
    PIPELINE_REGISTRY.register_pipeline(
        task, pipeline_class=FAT5Text2TextGenerationPipeline, pt_model=AutoModelForSeq2SeqLM, type="text"
    )
    pipe = FAT5Text2TextGenerationPipeline(
        model=T5ForConditionalGeneration.from_pretrained(checkpoint),
        tokenizer=AutoTokenizer.from_pretrained(checkpoint),
        device="cpu",
    )
    pipe.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["custom_pipelines"]
    expected = custom_pipelines_entry()
    if "tf" not in written[task]:
        # transformers 5 dropped TensorFlow and no longer writes the key (it ignores it when reading).
        expected[task].pop("tf")
    assert written == expected
    assert (tmp_path / PIPELINE_FILE.name).read_text() == PIPELINE_FILE.read_text()


def test_empty_list_gives_empty_list(in_process_pipe):
    # As transformers' own pipelines do: no inputs, no outputs (rather than an error from deep inside).
    assert in_process_pipe([], **GREEDY) == []
