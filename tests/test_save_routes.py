"""Every way a user saves a FAT5 model gives a complete package: FAT5's code flat beside config.json, `auto_map`
and the text2text pipeline. Each saved folder is then loaded, in a fresh process where this repository cannot be
imported, through AutoModelForSeq2SeqLM and pipeline("text2text-generation"), and generates what the original
model generates."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from conftest import tiny_config
from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.remote_code_fat5 import AUTO_MAP, remote_code_files
from isolated import run_isolated

PROMPT = "reverse: the cat sat"
GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)

# Runs with the repo hidden: loads `base` as remote code and saves it by every route a fine-tuner uses.
SAVE_CHILD = """
import json, sys
from pathlib import Path
from unittest import mock
import transformers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, Trainer, TrainingArguments

base, out, out_path = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(base)

def load():
    return AutoModelForSeq2SeqLM.from_pretrained(base, trust_remote_code=True)

model = load()
model.save_pretrained(out / "loaded")
tokenizer.save_pretrained(out / "loaded")

trainer = Trainer(model=load(), args=TrainingArguments(output_dir=str(out / "trainer-run"), report_to=[]),
                  processing_class=tokenizer)
trainer.save_model(str(out / "trainer"))

import peft
lora = peft.get_peft_model(load(), peft.LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q", "v"], r=2))
lora.merge_and_unload().save_pretrained(out / "peft-merged")
tokenizer.save_pretrained(out / "peft-merged")

# push_to_hub with the upload replaced by a copy of what would be uploaded (offline).
def upload(self, working_dir, *args, **kwargs):
    import shutil
    shutil.copytree(working_dir, out / "pushed")
    tokenizer.save_pretrained(out / "pushed")

class Repo:
    repo_id = "me/fat5-finetuned"

with mock.patch.object(transformers.utils.hub.PushToHubMixin, "_upload_modified_files", upload), \\
        mock.patch("huggingface_hub.HfApi.create_repo", return_value=Repo()), \\
        mock.patch("transformers.utils.hub.create_repo", return_value=Repo(), create=True), \\
        mock.patch("transformers.utils.hub.create_and_tag_model_card",
                   return_value=mock.MagicMock(), create=True):
    load().push_to_hub("me/fat5-finetuned")
Path(out_path).write_text(json.dumps({}))
"""

# Runs with the repo hidden, in a fresh process: loads each folder as a user would and generates.
LOAD_CHILD = """
import importlib.util, json, sys
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

folders, prompt, greedy, out_path = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
result = {"importable": [m for m in ("fat5", "convert") if importlib.util.find_spec(m) is not None]}
for folder in folders:
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        tokens = model.generate(**tokenizer([prompt], return_tensors="pt"), **greedy)
    generator = pipeline("text2text-generation", model=folder, trust_remote_code=True)
    result[folder] = {"module": type(model).__module__, "tokens": tokens[0].tolist(),
                      "pipeline": generator(prompt, **greedy)[0]["generated_text"],
                      "pipeline_class": type(generator).__name__}
with open(out_path, "w") as f:
    json.dump(result, f)
"""


def scratch_model():
    """A model built from a config in a process where fat5 is installed, as a pretraining script does."""
    vocab = json.loads((DEMO_CHECKPOINT / "config.json").read_text())["vocab_size"]
    config = tiny_config(vocab_size=vocab, num_layers=1)
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # confident random weights, so generations differ between different models
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5) if parameter.dim() > 1 else parameter.uniform_(0.5, 1.5)
    return model


def assert_complete_package(folder):
    names = {path.name for path in folder.iterdir()}
    assert set(remote_code_files()) <= names, set(remote_code_files()) - names
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["custom_pipelines"]["text2text-generation"]["impl"] == "pipeline_fat5.FAT5Text2TextGenerationPipeline"
    assert not [name for name in names if ".partial-" in name]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Folders saved by every route, and the tokens the model they came from generates."""
    root = tmp_path_factory.mktemp("routes")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_CHECKPOINT)
    model = scratch_model()
    with torch.no_grad():
        expected = model.generate(**tokenizer([PROMPT], return_tensors="pt"), **GREEDY)[0].tolist()
    model.save_pretrained(root / "scratch")
    tokenizer.save_pretrained(root / "scratch")
    # The route transformers documents for custom models.
    FAT5Config.register_for_auto_class()
    FAT5ForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
    try:
        model.save_pretrained(root / "registered")
    finally:
        del FAT5Config._auto_class, FAT5ForConditionalGeneration._auto_class
    tokenizer.save_pretrained(root / "registered")
    run_isolated(SAVE_CHILD, [root / "scratch", root], cwd=root)
    return root, expected


ROUTES = ["scratch", "registered", "loaded", "trainer", "peft-merged", "pushed"]


def test_every_save_route_writes_a_complete_package(saved):
    root, _ = saved
    for route in ROUTES:
        assert_complete_package(root / route)
    assert not [path.name for path in root.iterdir() if ".partial-" in path.name]


def test_every_saved_folder_loads_and_generates_in_a_clean_process(saved, tmp_path):
    root, expected = saved
    folders = [str(root / route) for route in ROUTES]
    result = run_isolated(LOAD_CHILD, [json.dumps(folders), PROMPT, json.dumps(GREEDY)], cwd=tmp_path)
    assert result["importable"] == []
    for folder in folders:
        assert result[folder]["module"].startswith("transformers_modules"), folder
        assert result[folder]["tokens"] == expected, folder
        assert result[folder]["pipeline_class"] == "FAT5Text2TextGenerationPipeline"
        assert result[folder]["pipeline"] == AutoTokenizer.from_pretrained(DEMO_CHECKPOINT).decode(
            expected, skip_special_tokens=True)


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    model = scratch_model()
    target = tmp_path / "model"
    model.save_pretrained(target)
    before = {path.name: path.read_bytes() for path in target.iterdir()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("fat5.remote_code_fat5.write_remote_code", broken)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(target)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path / "new")
    assert {path.name: path.read_bytes() for path in target.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


def test_resaving_keeps_other_files_and_drops_stale_shards(tmp_path):
    model = scratch_model()
    target = tmp_path / "model"
    model.save_pretrained(target, max_shard_size="20KB")
    assert (target / "model.safetensors.index.json").is_file()
    (target / "notes.txt").write_text("mine")
    model.save_pretrained(target)
    names = {path.name for path in target.iterdir()}
    assert "notes.txt" in names and "model.safetensors" in names
    assert not [name for name in names if "-of-" in name or name.endswith(".index.json")]
    reloaded = FAT5ForConditionalGeneration.from_pretrained(target)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_the_converter_exports_the_same_file_list():
    from fat5.convert import export

    assert export.write_remote_code.__module__ == "fat5.remote_code_fat5"
    flat = remote_code_files()
    assert {"configuration_fat5.py", "modeling_fat5.py", "attention_fat5.py", "pipeline_fat5.py",
            "remote_code_fat5.py", "flash_attention_t5.py"} <= set(flat)
