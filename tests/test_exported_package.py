"""The exported folder is a self-contained package: it loads and generates in a process that cannot import
this repository, through AutoModel classes and the text2text-generation pipeline, on transformers 4.57 and 5.x."""

import json
import shutil
import sys

import pytest
import torch
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from fat5.compat_fat5 import TESTED_TRANSFORMERS
from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS
from fat5.convert.flan_to_fat5 import main
from fat5.custom_ops_fat5 import DefinedOp, custom_op
from isolated import run_isolated

CHILD = """
import importlib.util, json, sys
import torch
from transformers import AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

folder, prompts, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
result = {"importable": [m for m in ("fat5", "convert") if importlib.util.find_spec(m) is not None]}
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
base = AutoModel.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # as the README and the card show it
result["tokenizer_class"] = type(tokenizer).__name__
result["classes"] = [type(model).__name__, type(model).__module__, type(base).__name__]
batch = tokenizer(prompts, padding=True, return_tensors="pt")
with torch.no_grad():
    greedy = model.generate(**batch, max_new_tokens=32, do_sample=False)
    beams = model.generate(**batch, max_new_tokens=32, num_beams=3)
result["greedy"] = tokenizer.batch_decode(greedy, skip_special_tokens=True)
result["beams"] = tokenizer.batch_decode(beams, skip_special_tokens=True)
generator = pipeline("text2text-generation", model=folder, trust_remote_code=True)
result["pipeline_class"] = type(generator).__name__
result["pipeline"] = [record["generated_text"] for record in generator(prompts, do_sample=False, num_beams=1)]
with open(out_path, "w") as f:
    json.dump(result, f)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "demo-fat5"
    assert main([str(DEMO_CHECKPOINT), str(out)]) == 0
    return out


def test_demo_checkpoint_round_trips_through_a_clean_process(exported, tmp_path):
    prompts = [prompt for prompt, _ in DEMO_PROMPTS]
    expected = [answer for _, answer in DEMO_PROMPTS]
    result, output = run_isolated(CHILD, [exported, json.dumps(prompts)], cwd=tmp_path, with_output=True)
    assert result["importable"] == []
    assert "T5Tokenizer" in result["tokenizer_class"]
    assert "custom code" not in output and "model of type" not in output, output[-2000:]
    class_name, module, base_name = result["classes"]
    assert class_name == "FAT5ForConditionalGeneration" and module.startswith("transformers_modules")
    assert base_name == "FAT5Model"
    assert result["greedy"] == expected
    assert result["beams"] == expected
    assert result["pipeline_class"] == "FAT5Text2TextGenerationPipeline"
    assert result["pipeline"] == expected


def test_model_card_carries_metadata_and_parity(exported):
    card = (exported / "README.md").read_text()
    assert "library_name: transformers" in card and "pipeline_tag: text2text-generation" in card
    assert "- fat5" in card and "- custom_code" in card
    assert "license: apache-2.0" in card
    assert "Largest absolute difference" in card
    # The transformers releases the folder's code was tested with: in the card and in config.json.
    assert f"tested with transformers {', '.join(TESTED_TRANSFORMERS)}" in card
    assert json.loads((exported / "config.json").read_text())["tested_transformers"] == list(TESTED_TRANSFORMERS)
    assert {"spiece.model", "tokenizer_config.json"} <= {path.name for path in exported.iterdir()}


# A platform without POSIX's extras, as Windows is: `fcntl` and its kin unimportable, no signal masks, no os.sync or
# O_DIRECTORY, no SIGKILL. Set once torch and the transformers modules a FAT5 model uses are imported (they choose
# their own code per platform when imported), before the folder's code loads; the repository is hidden, so saves
# take the shipped code alone.
WITHOUT_POSIX = """
for name in ("fcntl", "termios", "resource", "pwd", "grp"):
    sys.modules[name] = None
for module, names in ((os, ("sync", "O_DIRECTORY", "fork", "getuid")),
                      (signal, ("pthread_sigmask", "pthread_kill", "sigwait", "SIGKILL", "SIGHUP", "SIGALRM"))):
    for name in names:
        delattr(module, name)
"""
PORTABLE_CHILD = """
import json, os, signal, sys
from pathlib import Path
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedModel, T5ForConditionalGeneration
""" + WITHOUT_POSIX + """
folder, out, prompts, out_path = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
batch = tokenizer(prompts, padding=True, return_tensors="pt")
with torch.no_grad():
    answers = tokenizer.batch_decode(model.generate(**batch, max_new_tokens=32, do_sample=False),
                                     skip_special_tokens=True)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(**batch, labels=tokenizer(answers, padding=True, return_tensors="pt").input_ids).loss.backward()
optimizer.step()
model.save_pretrained(out)
(out / "notes.txt").write_text("mine")
model.save_pretrained(out, max_shard_size="200KB")  # over the first save, sharded
reloaded = AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True)
same = all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
json.dump({"module": type(model).__module__, "answers": answers, "same": same,
           "saved": sorted(path.name for path in out.iterdir()),
           "beside": sorted(path.name for path in out.parent.iterdir())}, open(out_path, "w"))
"""


def test_a_folder_loads_generates_fine_tunes_and_saves_without_posix(exported, tmp_path):
    """The shipped code imports nothing platform-specific: a folder works where `fcntl` and POSIX signals do not
    exist, and saves in place as transformers does, an earlier save's weight files removed (docs/reliability.md)."""
    prompts = [prompt for prompt, _ in DEMO_PROMPTS]
    result = run_isolated(PORTABLE_CHILD, [exported, tmp_path / "saves" / "tuned", json.dumps(prompts)],
                          cwd=tmp_path)
    assert result["module"].startswith("transformers_modules")
    assert result["answers"] == [answer for _, answer in DEMO_PROMPTS]
    assert result["same"]
    assert "notes.txt" in result["saved"] and "model.safetensors.index.json" in result["saved"]
    assert "model.safetensors" not in result["saved"]  # the first save's weights, which would load instead
    assert result["beside"] == ["tuned"]  # no staging folder left


OPS = ("decode_attention", "feed_forward_act", "feed_forward_act_backward", "flash_attention_forward",
       "flash_attention_backward", "residual_rms_norm", "residual_rms_norm_backward")


def test_folders_code_beside_the_installed_package_uses_its_ops(exported, tmp_path):
    """A folder's code loaded with trust_remote_code (two folders: two copies) beside the installed package defines
    no op again: torch would destroy the installed package's ops under its handles (later calls failed with
    `std::bad_alloc` or `basic_string::_M_create`), so each copy calls the op first defined."""
    from fat5.kernels import decode_attention_t5, feed_forward, flash_attention_t5, residual_rms_norm  # noqa: F401
    defined = {name: getattr(torch.ops.fat5, name).default for name in OPS}
    shutil.copytree(exported, tmp_path / "second")
    for folder in (exported, tmp_path / "second"):
        # What loading the folder with trust_remote_code imports (where FAT5's own classes are not registered): its
        # configuration's module, then its model's.
        get_class_from_dynamic_module("configuration_fat5.FAT5Config", folder)
        model = get_class_from_dynamic_module("modeling_fat5.FAT5ForConditionalGeneration", folder).from_pretrained(
            folder)
        copy = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".feed_forward"]
        assert copy is not feed_forward and type(copy._feed_forward_act).__name__ == "DefinedOp"
        assert {name: getattr(torch.ops.fat5, name).default for name in OPS} == defined
        assert all(getattr(torch.ops.fat5, name).default is op for name, op in defined.items())
    ids = torch.tensor([[5, 9, 14, 20, 1]])
    for _ in range(20):  # a destroyed op fails here within a few calls
        model.train()(input_ids=ids, labels=ids).loss.backward()
        hidden = torch.randn(3, 8, requires_grad=True)
        feed_forward.feed_forward_act(hidden, hidden.detach() * 2).sum().backward()


def test_an_op_defined_with_another_signature_gets_its_own_name():
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def shift(x: torch.Tensor, by: float) -> torch.Tensor:
        return x + by

    first = custom_op("fat5_test::op", scale)
    other = custom_op("fat5_test::op", shift)
    assert not isinstance(first, DefinedOp) and not isinstance(other, DefinedOp)
    assert other._qualname.startswith("fat5_test::op_")
    again = custom_op("fat5_test::op", scale)
    assert isinstance(again, DefinedOp) and again._opoverload is torch.ops.fat5_test.op.default
    assert torch.equal(again(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(custom_op("fat5_test::op", shift)(torch.ones(2), 1.0), torch.full((2,), 2.0))
