"""`python -m convert.flan_to_fat5`: the folder it writes, its errors, atomicity and push."""

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from huggingface_hub import HfApi
from safetensors.torch import load_file

import fat5.convert.export
from fat5.convert.checkpoint import convert_checkpoint
from fat5.convert.demo import DEMO_PROMPTS
from fat5.convert.flan_to_fat5 import main
from fat5.convert.safety import STAGING_MARK
from t5_checkpoints import make_t5_checkpoint
from t5_twins import TRANSFORMERS_5

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "convert.flan_to_fat5", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)


def leftovers(parent):
    return [path.name for path in parent.iterdir() if STAGING_MARK in path.name]


@pytest.fixture(scope="module")
def flan(tmp_path_factory):
    return make_t5_checkpoint("flan-t5", tmp_path_factory.mktemp("src") / "flan")


def test_writes_a_complete_sharded_folder(flan, tmp_path):
    out = tmp_path / "out"
    result = run_cli(flan, out, "--max-shard-size", "30KB")
    assert result.returncode == 0, result.stderr
    assert "Parity: max |logits difference|" in result.stdout
    names = {path.name for path in out.iterdir()}
    assert {"config.json", "generation_config.json", "README.md", "model.safetensors.index.json",
            "configuration_fat5.py", "modeling_fat5.py", "attention_fat5.py", "pipeline_fat5.py",
            "flash_attention_t5.py"} <= names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / shard).is_file() for shard in shards)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fat5"
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_fat5.FAT5ForConditionalGeneration"
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM",
                                       "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                                       "AutoModelForQuestionAnswering", "AutoModelForTextEncoding"}
    assert config["custom_pipelines"]["text2text-generation"]["impl"] == \
        "pipeline_fat5.FAT5Text2TextGenerationPipeline"
    # Flat remote code: only same-folder relative imports.
    for name in names:
        if name.endswith(".py"):
            text = (out / name).read_text()
            assert "from .kernels" not in text and "from .." not in text, name
            for module in ("attention_fat5", "configuration_fat5", "flash_attention_t5"):
                assert f"from {module} import" not in text, name  # relative, never absolute

    written = {}
    for shard in shards:
        written.update(load_file(out / shard))
    _, expected = convert_checkpoint(flan)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in expected.items())
    assert leftovers(tmp_path) == []


def test_dtype_and_backend_options(flan, tmp_path):
    out = tmp_path / "bf16"
    assert main([str(flan), str(out), "--dtype", "bfloat16", "--attn-implementation", "sdpa"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["attention_backend"] == "sdpa"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


# A process each (a few seconds): half of them in the slow tier (their checks also run in-process elsewhere).
@pytest.mark.parametrize("args, message", [
    (["{missing}", "{out}"], "does not exist"),
    pytest.param(["{flan}", "{out}", "--dtype", "int4"], "invalid choice: 'int4'", marks=pytest.mark.slow),
    (["{flan}", "{out}", "--max-shard-size", "lots"], "is not a size"),
    pytest.param(["{flan}"], "OUT is required", marks=pytest.mark.slow),
    pytest.param(["{unsupported}", "{out}"], "unsupported model_type 'bart'", marks=pytest.mark.slow),
    (["{truncated}", "{out}"], "corrupt or truncated"),
    (["{flan}", "{nonempty}"], "exists and is not empty"),
    pytest.param(["{flan}", "{out}", "--push-to-hub", "me/x"], "no Hugging Face credentials", marks=pytest.mark.slow),
])
def test_bad_input_is_one_line_and_nonzero(flan, tmp_path, args, message):
    unsupported = make_t5_checkpoint("flan-t5", tmp_path / "bart")
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    truncated = make_t5_checkpoint("flan-t5", tmp_path / "cut")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    nonempty = tmp_path / "nonempty"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("mine")
    paths = dict(flan=flan, out=tmp_path / "out", missing=tmp_path / "missing", unsupported=unsupported,
                 truncated=truncated, nonempty=nonempty)
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = run_cli(*[arg.format(**paths) for arg in args], env=env)
    assert result.returncode != 0
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert (nonempty / "keep.txt").read_text() == "mine"
    assert leftovers(tmp_path) == []


def test_hub_id_source_offline_is_a_clear_error(tmp_path):
    result = run_cli("google/flan-t5-small", tmp_path / "out",
                     env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2
    assert "neither a local folder nor a downloadable Hub model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_interrupted_run_leaves_nothing(flan, tmp_path, failure):
    out = tmp_path / "out"
    with mock.patch.object(fat5.convert.export, "verify_parity", side_effect=failure("stop")):
        if failure is KeyboardInterrupt:
            assert main([str(flan), str(out)]) == 130
        else:
            with pytest.raises(RuntimeError):
                main([str(flan), str(out)])
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_atomically(flan, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with mock.patch.object(fat5.convert.export, "verify_parity", side_effect=RuntimeError("stop")):
        with pytest.raises(RuntimeError):
            main([str(flan), str(out), "--overwrite"])
    assert (out / "stale.txt").is_file()  # a failed run leaves the old folder as it was
    assert main([str(flan), str(out), "--overwrite", "--no-verify"]) == 0
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert "not measured" in (out / "README.md").read_text()
    assert leftovers(tmp_path) == []


def test_parity_failure_is_loud(flan, tmp_path):
    def broken(*args, **kwargs):
        yield from ((name, tensor + 0.1) for name, tensor in original(*args, **kwargs))

    original = fat5.convert.export.iter_converted_tensors
    with mock.patch.object(fat5.convert.export, "iter_converted_tensors", broken):
        assert main([str(flan), str(tmp_path / "out")]) == 1  # a failed self-check, not bad input
    assert not (tmp_path / "out").exists()


def test_push_uploads_the_written_folder(flan, tmp_path):
    out = tmp_path / "out"
    with mock.patch.object(HfApi, "whoami") as whoami, mock.patch.object(HfApi, "create_repo") as create_repo, \
            mock.patch.object(HfApi, "upload_folder") as upload_folder:
        upload_folder.return_value = mock.Mock(commit_url="https://huggingface.co/me/fat5-x/commit/1")
        code = main([str(flan), str(out), "--push-to-hub", "me/fat5-x", "--private", "--revision", "dev",
                     "--create-pr", "--token", "hf_test"])
    assert code == 0
    whoami.assert_called_once_with()
    create_repo.assert_called_once_with("me/fat5-x", private=True, exist_ok=True)
    upload_folder.assert_called_once_with(repo_id="me/fat5-x", folder_path=str(out), revision="dev",
                                          create_pr=True, commit_message="Upload FAT5 checkpoint")
    assert 'from_pretrained("me/fat5-x", trust_remote_code=True)' in (out / "README.md").read_text()


def test_push_offline_fails_with_one_line_before_converting(flan, tmp_path, capsys):
    # conftest sets HF_HUB_OFFLINE=1 and nothing is mocked: huggingface_hub refuses, we report it.
    assert main([str(flan), str(tmp_path / "out"), "--push-to-hub", "me/x", "--token", "hf_test"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "offline mode is enabled" in errors[0]
    assert "Converting" not in captured.out and not (tmp_path / "out").exists()


def test_help_documents_every_option():
    result = run_cli("--help")
    assert result.returncode == 0
    for option in ("--dtype", "--attn-implementation", "--max-shard-size", "--overwrite", "--no-verify",
                   "--push-to-hub", "--private", "--revision", "--create-pr", "--token"):
        assert option in result.stdout


def test_demo_with_a_wrong_answer_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """README command 1 knows the demo's answers: a wrong one is exit status 1 and one line naming the prompt."""
    import transformers

    monkeypatch.chdir(tmp_path)
    answers = iter(["mat", *(answer for _, answer in DEMO_PROMPTS[1:])])
    monkeypatch.setattr(transformers, "pipeline", lambda *args, **kwargs: lambda prompt: [
        {"generated_text": next(answers)}])
    assert main([]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the demo model in fat5-demo answered 1 of 6 prompts wrongly, first "
                      f"{DEMO_PROMPTS[0][0]!r} -> 'mat' (expected {DEMO_PROMPTS[0][1]!r}): FAT5 does not compute "
                      f"correctly under transformers {transformers.__version__}; please report it"]


def test_a_model_that_generates_wrongly_with_its_cache_is_refused(flan, tmp_path, capsys):
    """Every forward right, but the decoder drops the cache generate hands it (what transformers 5.24's rename did
    to FAT5): the converter's generation check fails the conversion, exit status 1, and writes nothing."""
    from fat5.modeling_fat5 import FAT5Stack

    original = FAT5Stack.forward

    def forgetful(self, *args, cache=None, past_key_values=None, **kwargs):
        return original(self, *args, **kwargs)

    with mock.patch.object(FAT5Stack, "forward", forgetful):
        assert main([str(flan), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: generation check failed: at step 2 of greedy generation"), error
    assert not (tmp_path / "out").exists()


def test_a_conversion_asks_no_question(tmp_path):
    """The parity proof loads the written folder's tokenizer: on transformers 5 an unregistered FAT5 folder makes
    AutoTokenizer ask whether to run its code, and wait 15 s for an answer in a terminal. The converter registers
    FAT5 first, as FAT5's commands do before they load a folder."""
    from fat5.convert.demo import DEMO_CHECKPOINT

    result = subprocess.run([sys.executable, "-m", "convert.flan_to_fat5", str(DEMO_CHECKPOINT), str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Do you wish to run the custom code?" not in result.stdout + result.stderr


def test_the_demo_and_the_converters_print_no_unlabelled_bars_nor_the_tied_weights_warning(flan, tmp_path, capfd,
                                                                                           monkeypatch):
    """README command 1 showed three unlabelled "Loading weights" bars (the parity check's two loads and the demo's
    pipeline), and converting an untied T5 saved by transformers 5 (which writes tie_word_embeddings true) or
    converting back printed transformers' "will NOT tie" warning, about a tying the converter decides from the
    weights. Only the converter's own, labelled bar remains."""
    import shutil

    from fat5.convert import fat5_to_t5

    monkeypatch.chdir(tmp_path)
    saved = shutil.copytree(flan, tmp_path / "saved-by-5")
    if TRANSFORMERS_5:  # as transformers 5's save_pretrained writes an untied T5 (4.57 would tie it on loading)
        config = json.loads((saved / "config.json").read_text())
        (saved / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert main([]) == 0
    assert main([str(saved), str(tmp_path / "fat5")]) == 0
    assert fat5_to_t5.main([str(tmp_path / "fat5"), str(tmp_path / "back")]) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "NOT tie" not in err, err[-3000:]
    assert "Converting tensors" in err
