"""A FAT5 model loads by its Hub id, as someone's pushed model is loaded, in an environment holding only what
`pip install fat5` installs (and, for the tools that take FAT5 models, that tool): every Auto class the folder
registers, its tokenizer, `pipeline`, `SentenceTransformer`, and PEFT's `from_pretrained` of an adapter on a FAT5
base. The Hub is a Hub-layout cache (`models--owner--name/snapshots/<commit>`, `refs/main`) read offline.

Loading by id is not loading a folder: for an id, transformers checks the import statements of every file the
model code imports (a folder: the top file only) and refuses to load when one names a library that is not installed
(`transformers.dynamic_module_utils.check_imports`), so every shipped file is read with that check too.
"""

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest
import torch
from packaging.utils import canonicalize_name
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.dynamic_module_utils import get_imports

from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS
from fat5.convert.flan_to_fat5 import main as convert_main
from fat5.recipes import translation
from fat5.recipes.runner import fine_tune
from fat5.remote_code_fat5 import remote_code_files
from fat5.training.pretrain import main as pretrain_main
from isolated import (
    HUB_USER_GREEDY,
    assert_every_class_is_the_folders_code,
    declared_distributions,
    load_by_id,
    publish_to_hub_cache,
    run_isolated,
)

PROMPTS = [prompt for prompt, _ in DEMO_PROMPTS]
ANSWERS = [answer for _, answer in DEMO_PROMPTS]
OWNER = "someone"

def answers(folder, prompts=PROMPTS):
    """The greedy answers of the folder loaded here, by path: what its Hub id must give."""
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        tokens = model.generate(**tokenizer(prompts, padding=True, return_tensors="pt"), **HUB_USER_GREEDY)
    return tokenizer.batch_decode(tokens, skip_special_tokens=True)


# -- the folders a user pushes --------------------------------------------------------------------------------------

def write_translation_data(path):
    pairs = [("the cat sat on the mat", "mat the on sat cat the"), ("a dog ran", "ran dog a"),
             ("the bird sang by the pond", "pond the by sang bird the"), ("an old fox slept", "slept fox old an")]
    path.write_text("".join(json.dumps({"en": source, "xx": target}) + "\n" for source, target in pairs * 4))
    return str(path)


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, demo_fat5):
    """(Hub cache, {kind: repo id}, {kind: folder}) for a converted model, one fine-tuned by a recipe, a LoRA
    adapter and its merged model, and a model pretrained from scratch, each published as OWNER/kind."""
    root = tmp_path_factory.mktemp("pushed")
    folders = {"converted": Path(demo_fat5)}
    data = write_translation_data(root / "pairs.jsonl")
    flags = ["--train_file", data, "--source_column", "en", "--target_column", "xx", "--max_target_length", "16",
             "--report_to", "none", "--per_device_train_batch_size", "8", "--max_steps", "2", "--save_strategy",
             "no", "--dataloader_pin_memory", "false", "--do_train", "--disable_tqdm", "true"]
    fine_tune(translation.RECIPE, ["--model_name_or_path", str(folders["converted"]), "--output_dir",
                                   str(root / "fine-tuned"), *flags])
    fine_tune(translation.RECIPE, ["--model_name_or_path", str(folders["converted"]), "--output_dir",
                                   str(root / "lora"), "--lora", "--merge_lora", *flags])
    folders.update({"fine-tuned": root / "fine-tuned", "lora": root / "lora", "lora-merged": root / "lora" / "merged"})
    tiny = root / "tiny.json"
    tiny.write_text(json.dumps({"d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 2,
                                "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0}))
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"the {noun} sees the {other} by the river\n" for noun in ("cat", "dog", "fox")
                              for other in ("hen", "owl", "cow")) * 4)
    assert pretrain_main(["--config", str(tiny), "--train_files", str(corpus), "--tokenizer", str(DEMO_CHECKPOINT),
                          "--output_dir", str(root / "pretrained"), "--max_steps", "2", "--save_steps", "2",
                          "--per_device_train_batch_size", "4", "--max_input_length", "32", "--max_target_length",
                          "32", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--report_to",
                          "none"]) == 0
    folders["pretrained"] = root / "pretrained"
    hub_cache = root / "hub"
    repos = {kind: publish_to_hub_cache(hub_cache, f"{OWNER}/{kind}", folder) for kind, folder in folders.items()}
    # The adapter names its base as pushed (the recipe wrote the local folder it trained from).
    adapter_config = hub_cache / f"models--{OWNER}--lora" / "snapshots"
    [adapter_config] = adapter_config.glob("*/adapter_config.json")
    config = json.loads(adapter_config.read_text())
    config["base_model_name_or_path"] = repos["converted"]
    adapter_config.unlink()  # a link into the blob store in a real cache: replaced, not written through
    adapter_config.write_text(json.dumps(config))
    return hub_cache, repos, folders


# -- what transformers' import check reads -----------------------------------------------------------------------------

def declared_import_names():
    """The top-level import names of FAT5's declared dependencies (what `pip install fat5` installs)."""
    declared = declared_distributions()
    return {name for name, distributions in importlib.metadata.packages_distributions().items()
            if any(canonicalize_name(distribution) in declared for distribution in distributions)}


def test_every_shipped_file_passes_transformers_import_check_with_only_the_declared_dependencies(tmp_path):
    """transformers' own reading of each shipped file (the installed package's and an exported folder's) names no
    library outside the standard library and FAT5's declared dependencies."""
    allowed = declared_import_names() | set(sys.stdlib_module_names)
    assert {"torch", "transformers", "safetensors"} <= allowed
    folder = tmp_path / "exported"
    assert convert_main([str(DEMO_CHECKPOINT), str(folder), "--no-verify"]) == 0
    shipped = [*remote_code_files().values(), *folder.glob("*.py")]
    assert {path.name for path in folder.glob("*.py")} == set(remote_code_files())
    outside = {path.name: sorted(set(get_imports(path)) - allowed) for path in shipped}
    assert {name: names for name, names in outside.items() if names} == {}


# -- loading by id ---------------------------------------------------------------------------------------------------

def test_every_pushed_folder_loads_by_its_id_with_only_fat5s_dependencies(pushed, tmp_path, monkeypatch):
    hub_cache, repos, folders = pushed
    kinds = ["converted", "fine-tuned", "lora-merged", "pretrained"]
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    result = load_by_id([repos[kind] for kind in kinds], PROMPTS, tmp_path)
    assert result[repos["converted"]]["pipeline"] == ANSWERS
    for kind in kinds:
        entry = result[repos[kind]]
        assert_every_class_is_the_folders_code(entry)
        expected = answers(folders[kind])
        assert entry["generate"] == expected and entry["pipeline"] == expected, kind


EMBED_BY_ID = """
import json, sys
from sentence_transformers import SentenceTransformer

repo, sentences, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = SentenceTransformer(repo, trust_remote_code=True, device="cpu")
embeddings = model.encode(sentences, convert_to_tensor=True)
json.dump({"encoder": type(model[0].auto_model).__name__, "embeddings": embeddings.tolist()}, open(out_path, "w"))
"""


def test_sentence_transformers_embeds_by_id_as_from_the_folder(pushed, tmp_path, monkeypatch):
    pytest.importorskip("sentence_transformers")
    hub_cache, repos, folders = pushed
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    by_id = run_isolated(EMBED_BY_ID, [repos["converted"], json.dumps(PROMPTS)], tmp_path,
                         plain=("sentence-transformers",))
    monkeypatch.delenv("HF_HUB_CACHE")
    from_folder = run_isolated(EMBED_BY_ID, [folders["converted"], json.dumps(PROMPTS)], tmp_path)
    assert by_id["encoder"] == from_folder["encoder"] == "FAT5EncoderModel"
    assert torch.allclose(torch.tensor(by_id["embeddings"]), torch.tensor(from_folder["embeddings"]))


PEFT_BY_ID = """
import json, sys
import torch
from peft import AutoPeftModelForSeq2SeqLM, PeftModel
from transformers import AutoModelForSeq2SeqLM

base_repo, adapter_repo, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
ids = torch.tensor([[5, 9, 14, 20, 1]])
logits = {}
base = AutoModelForSeq2SeqLM.from_pretrained(base_repo, trust_remote_code=True)
for name, model in {"PeftModel": lambda: PeftModel.from_pretrained(base, adapter_repo),
                    "AutoPeftModelForSeq2SeqLM": lambda: AutoPeftModelForSeq2SeqLM.from_pretrained(
                        adapter_repo, trust_remote_code=True)}.items():
    with torch.no_grad():
        logits[name] = model().eval()(input_ids=ids, labels=ids).logits.tolist()
json.dump(logits, open(out_path, "w"))
"""


def test_peft_loads_an_adapter_by_id_on_a_fat5_base_by_id(pushed, tmp_path, monkeypatch):
    pytest.importorskip("peft")
    hub_cache, repos, folders = pushed
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    result = run_isolated(PEFT_BY_ID, [repos["converted"], repos["lora"]], tmp_path, plain=("peft",))
    merged = AutoModelForSeq2SeqLM.from_pretrained(folders["lora-merged"], trust_remote_code=True).eval()
    ids = torch.tensor([[5, 9, 14, 20, 1]])
    with torch.no_grad():
        expected = merged(input_ids=ids, labels=ids).logits
    for name, logits in result.items():
        assert (torch.tensor(logits) - expected).abs().max() <= 1e-4 * expected.abs().max(), name
