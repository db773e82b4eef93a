"""convert.hub: the model card and the upload, without any network (HF_HUB_OFFLINE=1, HfApi mocked)."""

import importlib.util
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

from convert import hub
from convert.hub import PushError, custom_pipelines_entry, push_to_hub, render_model_card

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


def test_card_without_source_metadata(tmp_path):
    args = {**CARD_ARGS, "base_model": None, "license": None}
    card = ModelCard.load(render_model_card(tmp_path, **args))
    assert "base_model" not in card.data.to_dict() and "license" not in card.data.to_dict()
    assert "conversion of" not in card.text
    assert 'from_pretrained("path/to/this/folder", trust_remote_code=True)' in card.text
    assert "`python -m convert.flan_to_fat5`" in card.text


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
