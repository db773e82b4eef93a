"""What T5 users do with models larger than their memory, done to a FAT5 folder: accelerate's `cpu_offload` and
`disk_offload`, `from_pretrained(..., device_map="auto", max_memory=..., offload_folder=...)`, `low_cpu_mem_usage`,
meta-device init, and a model built by `init_empty_weights` then filled by `load_checkpoint_and_dispatch`. Each
generates the tokens transformers' own T5 generates
from the checkpoint the FAT5 folder was converted from (and T5 passes the same checks: it is the spec). Folders
written before the stacks' embeddings appeared in `state_dict()` load with identical weights."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from fat5 import FAT5ForConditionalGeneration
from fat5.convert.flan_to_fat5 import main as convert_main
from t5_checkpoints import make_t5_checkpoint, padded_batch
from t5_twins import TRANSFORMERS_5

accelerate = pytest.importorskip("accelerate")

# Tied (T5 v1.0: the head is the embedding) and untied (FLAN-T5: a head of its own).
FAMILIES = ("t5-v1.0", "flan-t5")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (T5 source folder, FAT5 folder converted from it), weights large enough for varied greedy tokens."""
    root = tmp_path_factory.mktemp("big")
    result = {}
    for family in FAMILIES:
        source = make_t5_checkpoint(family, root / family, weight_std=0.6)
        assert convert_main([str(source), str(root / f"{family}-fat5"), "--no-verify"]) == 0
        result[family] = source, root / f"{family}-fat5"
    return result


def greedy(model, vocab_size):
    batch = padded_batch(vocab_size, length=9, decoder_length=2)
    inputs = {name: batch[name] for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)


def load(folder, **kwargs):
    return AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


def cpu_offload(folder, tmp_path):
    model = load(folder)
    return accelerate.cpu_offload(model, execution_device=torch.device("cpu"))


def disk_offload(folder, tmp_path):
    model = load(folder)
    return accelerate.disk_offload(model, tmp_path / "offload", execution_device=torch.device("cpu"))


def device_map_auto(folder, tmp_path):
    # Memory for half the weights: the rest goes to the offload folder.
    budget = (folder / "model.safetensors").stat().st_size // 2
    model = load(folder, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path / "offload"))
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values(), model.hf_device_map
    return model


def low_cpu_mem_usage(folder, tmp_path):
    return load(folder, low_cpu_mem_usage=True)


def meta_init(folder, tmp_path):
    """Built on the meta device, then the checkpoint's tensors assigned (the file names the embedding once) and
    the weights tied, as transformers does inside from_pretrained."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=True)
    assert all(parameter.is_meta for parameter in model.parameters())
    missing = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False, assign=True).missing_keys
    if TRANSFORMERS_5:
        # As from_pretrained does: a head the file holds stays untied (transformers 5's T5 config always says tied).
        model.tie_weights(missing_keys=set(missing))
    else:
        model.tie_weights()
    assert not any(parameter.is_meta for parameter in model.parameters())
    return model.eval()


def built_empty(folder):
    """The model of `folder` built by accelerate's `init_empty_weights`: every weight on the meta device."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    with accelerate.init_empty_weights():
        model = AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=True)
    assert all(parameter.is_meta for parameter in model.parameters())
    return model


def dispatch(model, folder, tmp_path):
    """accelerate's `load_checkpoint_and_dispatch` with `device_map="auto"` and memory for half the weights: the
    rest is offloaded to disk."""
    budget = (folder / "model.safetensors").stat().st_size // 2
    model = accelerate.load_checkpoint_and_dispatch(model, str(folder), device_map="auto", max_memory={"cpu": budget},
                                                    offload_folder=str(tmp_path / "offload"),
                                                    no_split_module_classes=model._no_split_modules)
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values(), model.hf_device_map
    return model.eval()


ROUTES = [cpu_offload, disk_offload, device_map_auto, low_cpu_mem_usage, meta_init]


@pytest.mark.parametrize("route", ROUTES, ids=lambda route: route.__name__)
@pytest.mark.parametrize("family", FAMILIES)
def test_big_model_routes_generate_t5s_tokens(folders, family, route, tmp_path):
    source, folder = folders[family]
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    expected = greedy(load(source), vocab_size)
    assert expected[:, 1:].unique().numel() >= 4, expected  # varied tokens: a broken route would show
    assert torch.equal(greedy(load(folder), vocab_size), expected)
    (tmp_path / "t5").mkdir()
    assert torch.equal(greedy(route(source, tmp_path / "t5"), vocab_size), expected)  # T5 itself: the spec
    (tmp_path / "fat5").mkdir()
    assert torch.equal(greedy(route(folder, tmp_path / "fat5"), vocab_size), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_init_empty_weights_then_load_checkpoint_and_dispatch(folders, family, tmp_path):
    """accelerate's big-model recipe as its documentation and its warning give it: the model built empty,
    `tie_weights()` (ties made while a model is built empty do not survive it, so a tied head needs this), then
    loaded and dispatched. T5's tokens; T5 itself answers the same, except FLAN-T5 on transformers 5, whose T5
    config always says tied: `tie_weights()` then ties the head FLAN-T5 keeps apart."""
    source, folder = folders[family]
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    expected = greedy(load(source), vocab_size)
    for name, path in (("fat5", folder), ("t5", source)):
        if name == "t5" and TRANSFORMERS_5 and family == "flan-t5":
            continue
        model = built_empty(path)
        model.tie_weights()
        (tmp_path / name).mkdir()
        assert torch.equal(greedy(dispatch(model, path, tmp_path / name), vocab_size), expected), name


def test_an_untied_head_needs_no_tie_weights_before_load_checkpoint_and_dispatch(folders, tmp_path):
    """Without `tie_weights()`, the stacks' embeddings still hold `shared`'s one Parameter after
    `init_empty_weights` (which gives every Parameter registered inside it a copy of its own), so the checkpoint's
    `shared.weight` reaches them: FLAN-T5's tokens on every release. transformers 4's T5 (whose stacks hold the
    `shared` module itself) does the same; transformers 5's leaves its stacks' embeddings on the meta device."""
    source, folder = folders["flan-t5"]
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    expected = greedy(load(source), vocab_size)
    model = built_empty(folder)
    assert model.encoder.embed_tokens.weight is model.shared.weight
    assert model.decoder.embed_tokens.weight is model.shared.weight
    (tmp_path / "fat5").mkdir()
    assert torch.equal(greedy(dispatch(model, folder, tmp_path / "fat5"), vocab_size), expected)
    if not TRANSFORMERS_5:
        (tmp_path / "t5").mkdir()
        assert torch.equal(greedy(dispatch(built_empty(source), source, tmp_path / "t5"), vocab_size), expected)


def old_layout_folder(model, folder, safe):
    """`model` saved as FAT5's save_pretrained wrote folders before the stacks' embeddings appeared in
    `state_dict()` (and as the converter writes them): the embedding once, as `shared.weight`, a tied head
    absent. `safe=False`: the `pytorch_model.bin` its `save_pretrained(safe_serialization=False)` wrote."""
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()
             if "embed_tokens" not in name and not (model.config.tie_word_embeddings and name == "lm_head.weight")}
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    if safe:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return state


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
@pytest.mark.parametrize("family", FAMILIES)
def test_folders_saved_before_load_with_identical_weights(folders, family, safe, tmp_path):
    model = FAT5ForConditionalGeneration.from_pretrained(folders[family][1])
    state = old_layout_folder(model, tmp_path / "old", safe)
    loaded, info = FAT5ForConditionalGeneration.from_pretrained(tmp_path / "old", output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded_state = loaded.state_dict()
    assert all(torch.equal(loaded_state[name], tensor) for name, tensor in state.items())
    assert loaded.encoder.embed_tokens.weight is loaded.shared.weight
    assert loaded.decoder.embed_tokens.weight is loaded.shared.weight
    assert (loaded.lm_head.weight is loaded.shared.weight) == loaded.config.tie_word_embeddings
    # Saved again, the folder has the same tensors under the same names: nothing changed on disk.
    loaded.save_pretrained(tmp_path / "new")
    with safe_open(tmp_path / "new" / "model.safetensors", "pt") as saved:
        assert sorted(saved.keys()) == sorted(state)
