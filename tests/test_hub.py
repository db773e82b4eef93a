"""fat5.convert.hub: the model card and the upload, without any network (HF_HUB_OFFLINE=1, HfApi mocked)."""

import importlib.util
import json
import shutil
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

from fat5.convert import hub
from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.convert.hub import PushError, custom_pipelines_entry, push_to_hub, render_model_card, task_example
from t5_checkpoints import make_t5_checkpoint

CARD_ARGS = dict(
    base_model="google/flan-t5-small",
    license="apache-2.0",
    family="flan-t5",
    num_parameters=76_961_152,
    parity_max_abs_diff=3.1e-6,
    parity_sample="8 English prompts, fp32 logits",
)


def test_card_metadata_and_body(tmp_path):
    path = render_model_card(
        tmp_path, **CARD_ARGS, language=["en"], extra_tags=("text2text-generation", "fat5"), repo_id="me/fat5-small",
        convert_command="python -m convert.flan_to_fat5 google/flan-t5-small out",
    )
    assert path == tmp_path / "README.md"
    card = ModelCard.load(path)
    data = card.data
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text2text-generation"
    assert data.base_model == "google/flan-t5-small"
    assert data.license == "apache-2.0"
    assert data.language == ["en"]
    # Deduplicated, fixed tags first.
    assert data.tags == ["fat5", "custom_code", "t5", "flan-t5", "text2text-generation"]

    body = card.text
    assert "**3.1e-06**" in body and "8 English prompts, fp32 logits" in body
    assert "77M parameters" in body
    assert 'pipeline("text2text-generation", model="me/fat5-small", trust_remote_code=True)' in body
    assert 'AutoModelForSeq2SeqLM.from_pretrained("me/fat5-small", trust_remote_code=True)' in body
    assert "python -m convert.flan_to_fat5 google/flan-t5-small out" in body
    assert "{{" not in body and "{%" not in body


def test_the_cards_pipeline_line_shows_the_answer_where_it_is_known(tmp_path):
    """The card's pipeline snippet printed `[{'generated_text': '...'}]`, which reads as the model's answer. It shows
    the answer where the converter knows it (the demo's, checked after converting), else the output's form."""
    known = dict(task_example({}), output="mat the on sat cat the")
    text = render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x", example=known).read_text()
    assert "# [{'generated_text': 'mat the on sat cat the'}]" in text and "'...'" not in text
    text = render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x").read_text()
    assert "# a list with one dict per input: [{'generated_text': <the model's answer>}]" in text
    assert "'...'" not in text


def test_a_training_runs_card_keeps_small_metrics(tmp_path):
    """A fine-tuned card's metadata said eval loss 0.0 where its table said 3.9e-06 (rounded to 4 decimals): both
    keep 4 significant digits."""
    from huggingface_hub import ModelCard

    from fat5.training.model_card import RunCard

    card = RunCard(command="fat5 train ...", task="text2text-generation", base_model=None,
                   data={"validation": "dev.csv (8 rows)"}, results={"eval": {"eval_loss": 3.9031e-06,
                                                                              "eval_accuracy": 0.123456}})
    card.write(tmp_path)
    loaded = ModelCard.load(tmp_path / "README.md")
    assert {result.metric_type: result.metric_value for result in loaded.data.eval_results} == {
        "loss": 3.903e-06, "accuracy": 0.1235}
    assert "| validation | `dev.csv (8 rows)` | loss | 3.903e-06 |" in loaded.text


def test_card_without_source_metadata(tmp_path):
    args = {**CARD_ARGS, "base_model": None, "license": None}
    card = ModelCard.load(render_model_card(tmp_path, **args, folder_name="my-fat5"))
    assert "base_model" not in card.data.to_dict() and "license" not in card.data.to_dict()
    assert "conversion of" not in card.text
    # Not pushed: the snippets load the folder by the name it was written under, and the card says so.
    assert 'from_pretrained("my-fat5", trust_remote_code=True)' in card.text
    assert "load this folder as `my-fat5`, the name it was written under" in card.text
    assert "path/to" not in card.text
    assert "`python -m convert.flan_to_fat5`" in card.text


def test_card_needs_a_name_to_load():
    with pytest.raises(ValueError, match="repo_id or folder_name"):
        render_model_card("unused", **CARD_ARGS)


@pytest.mark.parametrize("config, text, pipeline_text, note", [
    ({"prefix": "summarize: "}, "summarize: The house is wonderful.", "The house is wonderful.",
     "The config sets `prefix` to `summarize: `: the pipeline puts it before every input itself"),
    ({"task_specific_params": {"summarization": {"prefix": "summarize: ", "num_beams": 4},
                               "translation_en_to_fr": {"prefix": "translate English to French: "},
                               "no_prefix": {"max_length": 20}}},
     "summarize: The house is wonderful.", "summarize: The house is wonderful.",
     "the `summarization` task of the config's `task_specific_params`; the others: translation_en_to_fr "
     "(`translate English to French: `)"),
    ({"prefix": None, "task_specific_params": None}, "The house is wonderful.", "The house is wonderful.",
     "The config names no task"),
], ids=["prefix", "task_specific_params", "none"])
def test_example_comes_from_the_models_own_task(tmp_path, config, text, pipeline_text, note):
    example = task_example(config)
    assert (example["text"], example["pipeline_text"]) == (text, pipeline_text) and note in example["note"]
    body = ModelCard.load(render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x", example=example)).text
    assert f'tokenizer("{text}", return_tensors="pt")' in body
    assert f'generator("{pipeline_text}", max_new_tokens=32)' in body
    assert note in body
    assert "translate English to German" not in body  # only a model whose config says so gets that example


def test_source_description_is_kept_below_its_own_heading(tmp_path):
    description = ("# Model Card for FLAN-T5 small\n\nInstruction-tuned T5.\n\n## Usage\n\n"
                   "```python\n# not a heading\n```\n\n###### deepest")
    body = ModelCard.load(render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x",
                                            source_description=description)).text
    quoted = body[body.index("## The source model's card"):]
    assert "### Model Card for FLAN-T5 small\n\nInstruction-tuned T5." in quoted
    assert "#### Usage" in quoted and "```python\n# not a heading\n```" in quoted and "\n###### deepest" in quoted
    without = ModelCard.load(render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x")).text
    assert "The source model's card" not in without


def test_card_without_a_tokenizer_says_so_and_shows_no_tokenizer(tmp_path):
    body = ModelCard.load(render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x", has_tokenizer=False,
                                            vocab_size=32128)).text
    assert "**This folder has no tokenizer**" in body and "the embeddings have 32128 rows" in body
    assert "AutoTokenizer" not in body and "tokenizer(" not in body
    assert 'AutoModelForSeq2SeqLM.from_pretrained("me/x", trust_remote_code=True)' in body


def test_card_links_fat5_only_where_the_package_names_its_home(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "package_metadata", lambda name: FakeMetadata([]))
    body = ModelCard.load(render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x")).text
    assert 'FAT5 ("Flash Attention T5") is a T5-family model package' in body and "[FAT5](" not in body
    monkeypatch.setattr(hub, "package_metadata", lambda name: FakeMetadata(
        ["Documentation, https://docs.example/fat5", "Repository, https://git.example/fat5"]))
    body = ModelCard.load(render_model_card(tmp_path, **CARD_ARGS, repo_id="me/x")).text
    assert '[FAT5](https://git.example/fat5) ("Flash Attention T5")' in body


class FakeMetadata:
    def __init__(self, urls):
        self.urls = urls

    def get_all(self, name):
        return self.urls if name == "Project-URL" else None


def test_conversion_keeps_the_source_card_and_task_and_warns_without_a_tokenizer(tmp_path, capsys):
    """End to end: a tokenizer-less source with a card and task_specific_params."""
    from fat5.convert.flan_to_fat5 import main

    src = make_t5_checkpoint("flan-t5", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["task_specific_params"] = {"translation_en_to_de": {"prefix": "translate English to German: "}}
    (src / "config.json").write_text(json.dumps(config))
    (src / "README.md").write_text("---\nlicense: mit\n---\n# A tiny T5\n\nTrained on nothing at all.\n")
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "out" / "tiny-fat5")]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {src} has no tokenizer files (tokenizer_config.json or tokenizer.json); "
                        f"{tmp_path / 'out' / 'tiny-fat5'} has no tokenizer either, and its model card says so "
                        f"(tokenize with the source model's tokenizer)"]
    card = ModelCard.load(tmp_path / "out" / "tiny-fat5" / "README.md")
    assert card.data.license == "mit"
    assert "### A tiny T5\n\nTrained on nothing at all." in card.text
    assert "**This folder has no tokenizer**" in card.text and "AutoTokenizer" not in card.text
    assert 'from_pretrained("tiny-fat5", trust_remote_code=True)' in card.text
    assert "Largest absolute difference" in card.text and "2 random padded sequences" in card.text
    # With the tokenizer files, the same source gives the tokenizer example of its own task, and no warning.
    for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_CHECKPOINT / name, src / name)
    assert main([str(src), str(tmp_path / "with-tokenizer"), "--no-verify"]) == 0
    assert "warning:" not in capsys.readouterr().err
    card = ModelCard.load(tmp_path / "with-tokenizer" / "README.md")
    assert 'tokenizer("translate English to German: The house is wonderful.", return_tensors="pt")' in card.text


def test_custom_pipelines_entry_points_at_the_flat_pipeline_file():
    entry = custom_pipelines_entry()
    assert entry == {
        "text2text-generation": {
            "impl": "pipeline_fat5.FAT5Text2TextGenerationPipeline",
            "pt": ["AutoModelForSeq2SeqLM"],
            "tf": [],
            "type": "text",
        }
    }
    # A fresh dict each time: callers may edit it.
    assert custom_pipelines_entry() is not entry


@pytest.fixture
def api():
    with (
        mock.patch.object(HfApi, "create_repo") as create_repo,
        mock.patch.object(HfApi, "upload_folder") as upload_folder,
    ):
        upload_folder.return_value = mock.Mock(commit_url="https://huggingface.co/me/x/commit/abc123")
        yield create_repo, upload_folder


def test_push_calls(tmp_path, api):
    create_repo, upload_folder = api
    url = push_to_hub(
        tmp_path, "me/x", private=True, revision="v1", create_pr=True, token="hf_test", commit_message="Add FAT5"
    )
    assert url == "https://huggingface.co/me/x/commit/abc123"
    create_repo.assert_called_once_with("me/x", private=True, exist_ok=True)
    upload_folder.assert_called_once_with(
        repo_id="me/x", folder_path=str(tmp_path), revision="v1", create_pr=True, commit_message="Add FAT5"
    )


def test_push_defaults_use_the_stored_token(tmp_path, api, monkeypatch):
    create_repo, upload_folder = api
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_stored")
    with mock.patch.object(hub, "HfApi", wraps=HfApi) as api_class:
        push_to_hub(tmp_path, "me/x")
    api_class.assert_called_once_with(token="hf_stored")
    create_repo.assert_called_once_with("me/x", private=False, exist_ok=True)
    upload_folder.assert_called_once_with(
        repo_id="me/x", folder_path=str(tmp_path), revision=None, create_pr=False,
        commit_message="Upload FAT5 checkpoint",
    )


def test_push_without_credentials(tmp_path, api, monkeypatch):
    create_repo, upload_folder = api
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(PushError, match="no Hugging Face credentials"):
        push_to_hub(tmp_path, "me/x")
    create_repo.assert_not_called()
    upload_folder.assert_not_called()


def test_push_offline_without_mocks_is_a_push_error(tmp_path):
    # conftest sets HF_HUB_OFFLINE=1: the real client refuses before any network access.
    with pytest.raises(PushError, match="^cannot push to me/x: Cannot reach .* offline mode is enabled"):
        push_to_hub(tmp_path, "me/x", token="hf_test")


def test_push_missing_folder(tmp_path, api):
    create_repo, _ = api
    with pytest.raises(PushError, match="not a directory"):
        push_to_hub(tmp_path / "missing", "me/x", token="hf_test")
    create_repo.assert_not_called()


def _connection_error():
    """What a refused connection raises: httpx2.ConnectError on huggingface_hub 2.x, requests' on 0.x."""
    if importlib.util.find_spec("httpx2") is not None:
        import httpx2

        return httpx2.ConnectError("[Errno 111] Connection refused")
    import requests

    return requests.ConnectionError("[Errno 111] Connection refused")


def _http_error(status):
    httpx2 = pytest.importorskip("httpx2")
    request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
    response = httpx2.Response(status, request=request)
    return HfHubHTTPError(f"{status} Client Error: Forbidden for url: {request.url}\nmore detail", response=response)


@pytest.mark.parametrize(
    "make_error, message",
    [
        (_connection_error,
         r"^push to me/x failed: cannot reach the Hub \(\[Errno 111\] Connection refused\)$"),
        (lambda: _http_error(403), r"^push to me/x failed: the Hub answered 403 Client Error: Forbidden for url: \S+$"),
        (lambda: OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled."),
         r"^cannot push to me/x: Cannot reach https://huggingface.co: offline mode is enabled\.$"),
    ],
    ids=["connection", "http", "offline"],
)
def test_push_api_errors_become_one_line_push_errors(tmp_path, api, make_error, message):
    create_repo, upload_folder = api
    error = make_error()
    upload_folder.side_effect = error
    with pytest.raises(PushError, match=message) as raised:
        push_to_hub(tmp_path, "me/x", token="hf_test")
    assert raised.value.__cause__ is error
    assert "\n" not in str(raised.value)
    create_repo.assert_called_once()


def test_push_invalid_repo_id(tmp_path, api):
    create_repo, _ = api
    create_repo.side_effect = HFValidationError("Repo id must use alphanumeric chars: 'not a/valid/id'.")
    with pytest.raises(PushError, match="^cannot push to not a/valid/id: invalid repo id or revision: Repo id must"):
        push_to_hub(tmp_path, "not a/valid/id", token="hf_test")
