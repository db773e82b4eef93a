"""The drift check: what FAT5 must do identically under every transformers release it admits.

CI runs this file alone on each release of `fat5.compat_fat5.TESTED_TRANSFORMERS` and on the newest transformers on
PyPI the day it appears (`.ci/run`), and the whole suite on the oldest and the newest admitted. It takes about a
minute. For every T5 family, a checkpoint written by the installed transformers converts (with the converter's own
parity proof) into a FAT5 folder that, loaded as Hub users load it (`trust_remote_code`), computes transformers'
logits and loss and generates transformers' tokens with every decoding mode and cache; the cache goes in and out
under the installed transformers' name; the demo folder answers its prompts in a fresh process that cannot import
this repository, and nothing FAT5 runs logs a warning there.
"""

import functools
import importlib.metadata
import inspect
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from transformers import AutoModelForSeq2SeqLM

from fat5 import FAT5ForConditionalGeneration, compat_fat5
from fat5.compat_fat5 import CACHE_NAME, TESTED_TRANSFORMERS
from fat5.convert.checkpoint import convert_checkpoint
from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS
from fat5.convert.flan_to_fat5 import main as convert_main
from isolated import assert_every_class_is_the_folders_code, load_by_id, publish_to_hub_cache, run_isolated
from t5_checkpoints import COMMON, FAMILIES, make_t5_checkpoint, padded_batch

LOGITS_RTOL = 1e-5  # relative to the largest logit: fp32 sums in another order
INSTALLED = transformers.__version__


def convert_family(root, family, *options, **weights):
    """(transformers' model, FAT5 model) of a `family` checkpoint written by the installed transformers: the FAT5
    folder converted by the command line and loaded through the Auto classes with trust_remote_code, as a Hub user
    loads it; transformers' model loaded as transformers loads it."""
    source = make_t5_checkpoint(family, root / family, **weights)
    assert convert_main([str(source), str(root / f"{family}-fat5"), "--attn-implementation", "sdpa", *options]) == 0
    reference = AutoModelForSeq2SeqLM.from_pretrained(source).eval()
    return reference, AutoModelForSeq2SeqLM.from_pretrained(root / f"{family}-fat5", trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> the models of `convert_family`, converted with the converter's own proof (logits parity, and
    generation with the cache against generation without it)."""
    root = tmp_path_factory.mktemp("families")
    return {family: convert_family(root, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def confident(tmp_path_factory):
    """family -> the models of `convert_family` for generation: weights drawn large enough that greedy choices are
    clear and varied (T5's initialisation makes a fresh model repeat one token, which a broken cache would repeat
    too). Their activations grow so large that fp32 rounding exceeds the converter's 1e-5 logits tolerance, so they
    are compared by tokens, which must be identical."""
    root = tmp_path_factory.mktemp("confident")
    return {family: convert_family(root, family, "--no-verify", weight_std=0.6) for family in FAMILIES}


def encoder_inputs(vocab_size):
    batch = padded_batch(vocab_size, length=11, decoder_length=5)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_loss_equal_transformers_own_model(converted, family):
    reference, model = converted[family]
    batch = padded_batch(reference.config.vocab_size)
    with torch.no_grad():
        expected, actual = reference(**batch), model(**batch)
    real = batch["decoder_attention_mask"].bool()
    largest = expected.logits[real].abs().max()
    assert (expected.logits - actual.logits)[real].abs().max() <= LOGITS_RTOL * largest
    assert actual.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("model_type", ["t5", "mt5", "umt5"])
def test_tied_and_untied_checkpoints_written_by_installed_transformers_convert_to_its_logits(tmp_path, model_type,
                                                                                              tied):
    """As the installed transformers writes each family, tied or not (its config records the rescale its way)."""
    prefix = {"t5": "T5", "mt5": "MT5", "umt5": "UMT5"}[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**COMMON, feed_forward_proj="gated-gelu",
                                                      tie_word_embeddings=tied)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    model.save_pretrained(tmp_path)  # exactly as the installed transformers writes it
    fat5_config, state_dict = convert_checkpoint(tmp_path)
    converted = FAT5ForConditionalGeneration(fat5_config).eval()
    converted.load_state_dict(state_dict, strict=False)
    batch = padded_batch(config.vocab_size)
    with torch.no_grad():
        expected, actual = model(**batch).logits, converted(**batch).logits
    real = batch["decoder_attention_mask"].bool()
    assert (expected - actual)[real].abs().max() <= LOGITS_RTOL * expected[real].abs().max()


# Decoding modes, each compared with transformers' tokens on the same padded batch.
MODES = {
    "greedy": dict(do_sample=False),
    "beam": dict(num_beams=3, do_sample=False),
    "beam-sample": dict(num_beams=2, do_sample=True, top_k=20),
    "sample": dict(do_sample=True, top_k=20),
    "static-cache": dict(do_sample=False, cache_implementation="static"),
    "no-cache": dict(do_sample=False, use_cache=False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_gives_transformers_tokens(confident, family, mode):
    reference, model = confident[family]
    inputs = dict(encoder_inputs(reference.config.vocab_size), max_new_tokens=8, min_new_tokens=8)
    reference_options = dict(MODES[mode])
    if family == "t5-efficient-dl":
        # transformers' T5 sizes its caches from the encoder's depth and cannot generate with one when the decoder
        # is deeper; without a cache it can (FAT5 generates with every cache, see test_generation_cache.py).
        reference_options.pop("cache_implementation", None)
        reference_options["use_cache"] = False
    torch.manual_seed(3)
    expected = reference.generate(**inputs, **reference_options)
    torch.manual_seed(3)
    actual = model.generate(**inputs, **MODES[mode])
    assert expected[:, 1:].unique().numel() >= 4, expected  # a repeated token would hide a broken cache
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("family", ["flan-t5", "umt5", "t5-v1.0"])
def test_assisted_and_prompt_lookup_generation_give_the_greedy_tokens(confident, family):
    reference, model = confident[family]
    # (transformers 4.57 refuses min_new_tokens with an assistant)
    inputs = dict(encoder_inputs(reference.config.vocab_size), max_new_tokens=8, do_sample=False)
    single = {name: tensor[:1] for name, tensor in inputs.items() if isinstance(tensor, torch.Tensor)}
    options = {name: value for name, value in inputs.items() if not isinstance(value, torch.Tensor)}
    expected = reference.generate(**single, **options)
    assert torch.equal(model.generate(**single, **options, assistant_model=model), expected)
    assert torch.equal(model.generate(**single, **options, prompt_lookup_num_tokens=3), expected)


def deprecation_warnings(call):
    """(what `call` returns, whether it warned that `past_key_values` is deprecated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, any(issubclass(warning.category, FutureWarning)
                       and "`past_key_values` is deprecated" in str(warning.message) for warning in caught)


def test_the_cache_goes_in_and_out_under_the_installed_name(converted):
    """transformers 5.24 renamed `past_key_values` to `cache`: FAT5's outputs use the installed name, and its
    forwards take the cache by either name on every release (`cache` in the position of T5's cache argument),
    the old name with T5's FutureWarning where T5's forward gives one."""
    reference, model = converted["flan-t5"]
    for forward in (model.forward, model.get_decoder().forward):
        parameters = list(inspect.signature(forward).parameters)
        assert {"cache", "past_key_values"} <= set(parameters), parameters
        assert not hasattr(forward, "__wrapped__")  # export tools unwrap what they take for transformers' decorators
    inputs = encoder_inputs(reference.config.vocab_size)
    decoder_input_ids = torch.tensor([[0, 5, 7, 9]] * 3)
    with torch.no_grad():
        t5_cache = compat_fat5.output_cache(reference(**inputs, decoder_input_ids=decoder_input_ids[:, :2]))
        _, t5_warns = deprecation_warnings(lambda: reference(**inputs, decoder_input_ids=decoder_input_ids[:, 2:],
                                                             past_key_values=t5_cache))
        whole = model(**inputs, decoder_input_ids=decoder_input_ids).logits
        first = model(**inputs, decoder_input_ids=decoder_input_ids[:, :2], use_cache=True)
        assert CACHE_NAME in first.keys()
        for name in ("cache", "past_key_values"):
            cache = compat_fat5.output_cache(model(**inputs, decoder_input_ids=decoder_input_ids[:, :2]))
            step, warned = deprecation_warnings(
                functools.partial(model, **inputs, decoder_input_ids=decoder_input_ids[:, 2:], **{name: cache}))
            assert torch.allclose(step.logits, whole[:, 2:], rtol=0, atol=LOGITS_RTOL * whole.abs().max()), name
            assert warned == (name == "past_key_values" and t5_warns), name
        # Both names: the one named `cache`, as T5's forward takes it (tests/test_transformers_model_checks.py).
        stale = compat_fat5.output_cache(model(**inputs, decoder_input_ids=decoder_input_ids[:, :1]))
        step, _ = deprecation_warnings(lambda: model(**inputs, decoder_input_ids=decoder_input_ids[:, 2:],
                                                     cache=compat_fat5.output_cache(first), past_key_values=stale))
        assert torch.allclose(step.logits, whole[:, 2:], rtol=0, atol=LOGITS_RTOL * whole.abs().max())


# A Hub user's process: the demo folder loaded with trust_remote_code, generating in every mode and through the
# pipeline. Every warning logged or raised is recorded, first while transformers' own T5 (the demo's source
# checkpoint) does the same, then while FAT5 does: FAT5 may add none.
CHILD = """
import importlib.util, json, logging, sys, warnings
records = []
class Record(logging.Handler):
    def emit(self, record):
        records.append(f"{record.name}: {record.getMessage()}")
handler = Record(level=logging.WARNING)
logging.getLogger().addHandler(handler)
raised = []
warnings.showwarning = lambda message, category, *args, **kwargs: raised.append(f"{category.__name__}: {message}")
import torch, transformers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
logging.getLogger("transformers").addHandler(handler)
source, folder, prompts, out_path = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
MODES = {"greedy": dict(do_sample=False), "beam": dict(num_beams=3), "no-cache": dict(use_cache=False),
         "static-cache": dict(cache_implementation="static"),
         "beam-static": dict(num_beams=3, cache_implementation="static")}

def answers(model, tokenizer):
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    result = {}
    for name, options in MODES.items():
        try:
            with torch.no_grad():
                tokens = model.generate(**batch, max_new_tokens=32, **options)
        except Exception as error:  # transformers 4.57's own T5 fails beam search on a reused static cache
            result[name] = f"{type(error).__name__}: {error}"
        else:
            result[name] = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    return result

def warned():
    seen = records + raised
    records.clear(), raised.clear()
    return seen

answers(AutoModelForSeq2SeqLM.from_pretrained(source).eval(), AutoTokenizer.from_pretrained(source))
try:
    pipeline("text2text-generation", model=source)(prompts)  # transformers 4.57's own; 5.x removed the task
except Exception:
    pass
result = {"t5_warnings": warned(),
          "importable": [m for m in ("fat5", "convert") if importlib.util.find_spec(m) is not None]}
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
result["module"] = type(model).__module__
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
result.update(answers(model, tokenizer))
with torch.no_grad():
    output = model(**tokenizer(prompts, padding=True, return_tensors="pt"),
                   decoder_input_ids=torch.zeros(len(prompts), 1, dtype=torch.long))
result["output_fields"] = list(output.keys())
generator = pipeline("text2text-generation", model=folder, trust_remote_code=True)
result["pipeline"] = [record["generated_text"] for record in generator(prompts, do_sample=False, num_beams=1)]
result["fat5_warnings"] = warned()
with open(out_path, "w") as f:
    json.dump(result, f)
"""


def test_exported_demo_answers_in_a_fresh_process_in_every_mode_and_warns_no_more_than_t5(tmp_path):
    folder = tmp_path / "demo-fat5"
    assert convert_main([str(DEMO_CHECKPOINT), str(folder)]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert config["tested_transformers"] == list(TESTED_TRANSFORMERS)
    prompts = [prompt for prompt, _ in DEMO_PROMPTS]
    expected = [answer for _, answer in DEMO_PROMPTS]
    result = run_isolated(CHILD, [DEMO_CHECKPOINT, folder, json.dumps(prompts)], cwd=tmp_path)
    assert result["importable"] == [] and result["module"].startswith("transformers_modules")
    for mode in ("greedy", "beam", "no-cache", "static-cache", "beam-static", "pipeline"):
        assert result[mode] == expected, mode
    assert CACHE_NAME in result["output_fields"]
    allowed = result["t5_warnings"]
    if not compat_fat5.is_tested(INSTALLED):
        allowed += [f"{compat_fat5.logger.name}: {compat_fat5.untested_message(INSTALLED)}"]
    assert [line for line in result["fat5_warnings"] if not any(line.endswith(text.split(": ", 1)[-1])
                                                                 for text in allowed)] == []


def test_the_demo_pushed_to_the_hub_loads_by_its_id_with_only_fat5s_dependencies(tmp_path, monkeypatch):
    """As a Hub user loads a pushed model, by id (transformers then checks every shipped file's imports), in an
    environment holding only what `pip install fat5` installs: every Auto class, the tokenizer, generate and the
    pipeline (tests/test_hub_id.py does this for fine-tuned, LoRA-merged and pretrained folders, and the tools)."""
    folder = tmp_path / "demo-fat5"
    assert convert_main([str(DEMO_CHECKPOINT), str(folder), "--no-verify"]) == 0
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = publish_to_hub_cache(tmp_path / "hub", "someone/demo-fat5", folder)
    entry = load_by_id([repo], [prompt for prompt, _ in DEMO_PROMPTS], tmp_path)[repo]
    assert_every_class_is_the_folders_code(entry)
    assert entry["generate"] == entry["pipeline"] == [answer for _, answer in DEMO_PROMPTS]


def test_kernelize_leaves_a_loaded_fat5_model_as_it_is(converted):
    """transformers 5.25 runs the `kernels` library's `kernelize` over every model from_pretrained loads (use_kernels
    defaults to on) and again at train()/eval(): it finds no module of a FAT5 model to replace (none carries a
    Hub-kernel layer name), so the model computes what it computes with use_kernels=False. (Releases without
    kernelize: nothing to check.)"""
    _, model = converted["flan-t5"]
    assert [name for name, module in model.named_modules() if hasattr(module, "kernel_layer_name")] == []
    if not hasattr(model, "set_use_kernels"):
        return
    folder = model.config._name_or_path
    plain = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, use_kernels=False).eval()
    batch = padded_batch(model.config.vocab_size)
    model.train(), model.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, plain(**batch).logits)
    assert all("forward" not in vars(module) for module in model.modules())


# -- which transformers FAT5 admits ---------------------------------------------------------------------------------

def admitted_transformers():
    """The transformers requirement of the installed FAT5 (pyproject.toml's, as pip reads it)."""
    requirements = [Requirement(line) for line in importlib.metadata.requires("fat5")]
    return next(requirement.specifier for requirement in requirements
                if requirement.name == "transformers" and requirement.marker is None)


def test_pyproject_admits_the_tested_releases_and_every_later_one():
    """The policy (docs/contributing.md): lower bounds only. pip installs FAT5 beside every tested release (and its
    later patches) and beside any later release, so a user's newest transformers is never downgraded (FAT5 says in
    one line that it is untested there); never beside an older release nor a 5.x series before the tested ones."""
    admitted = admitted_transformers()
    assert all(admitted.contains(version) for version in TESTED_TRANSFORMERS)
    assert not any(bound.operator in ("<", "<=", "==", "~=") for bound in admitted)
    for version in TESTED_TRANSFORMERS:
        major, minor, patch, _ = compat_fat5.release(version)
        assert admitted.contains(f"{major}.{minor}.{patch + 7}")  # a later patch release
    newest = compat_fat5.release(TESTED_TRANSFORMERS[-1])
    for later in (f"{newest[0]}.{newest[1] + 1}.0", f"{newest[0]}.{newest[1] + 9}.2", f"{newest[0] + 1}.0.0"):
        assert admitted.contains(later) and not compat_fat5.is_tested(later), later
    tested_series = {compat_fat5.release(version)[:2] for version in TESTED_TRANSFORMERS}
    oldest = compat_fat5.release(TESTED_TRANSFORMERS[0])
    older = ["4.56.2", f"{oldest[0]}.{oldest[1]}.{oldest[2] - 1}"]
    older += [f"5.{minor}.0" for minor in range(newest[1]) if (5, minor) not in tested_series]
    for version in older:
        assert not admitted.contains(version), version
        assert not compat_fat5.is_tested(version), version
    # pip takes a pre-release only when asked (--pre); FAT5 calls it untested.
    assert not compat_fat5.is_tested(f"{newest[0]}.{newest[1]}.0rc1")


def test_pyproject_admits_torch_from_the_readmes_release_up():
    """pip installs FAT5 beside the torch every test runs on (the README's) and every later one, never an older
    one: lower bounds only (`.ci/drift-torch` checks the newest pip finds)."""
    repo = Path(__file__).resolve().parent.parent
    pinned = re.search(r"pip install torch==(\d+\.\d+\.\d+) &&", (repo / "README.md").read_text()).group(1)
    major, minor, _, _ = compat_fat5.release(pinned)
    torch = Requirement(re.search(r'^ *"(torch\b[^"]*)"', (repo / "pyproject.toml").read_text(), re.M).group(1))
    assert torch.specifier.contains(pinned) and not torch.specifier.contains(f"{major}.{minor - 1}.0")
    assert all(bound.operator == ">=" for bound in torch.specifier)
    assert torch.specifier.contains(f"{major}.{minor + 2}.0") and torch.specifier.contains(f"{major + 1}.0.0")


def test_an_untested_transformers_is_named_once_in_one_line(caplog):
    compat_fat5._warned_untested.clear()
    try:
        with caplog.at_level("WARNING"):
            compat_fat5.warn_if_untested("5.24.3")  # a later patch of a tested release
            assert caplog.records == []
            compat_fat5.warn_if_untested("9.1.0")
            compat_fat5.warn_if_untested("9.1.0")
            compat_fat5.warn_if_untested("5.25.0.dev0")
        [record] = caplog.records
        message = record.getMessage()
        assert "\n" not in message and "9.1.0" in message and all(version in message for version in TESTED_TRANSFORMERS)
        assert re.search(r"pip install 'transformers>=\d+\.\d+,<\d+\.\d+'", message)
    finally:
        compat_fat5._warned_untested.clear()
