"""Hub side of an export: the model card, the custom pipeline entry of config.json, and the upload.

Nothing here touches the network except `check_push_access` (run before converting) and `push_to_hub`; both turn
every failure (offline mode included) into a one-line `PushError`.
"""

import importlib
import importlib.util
import json
import re
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import metadata as package_metadata
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

from fat5.cli import CommandError, error_line
from fat5.compat_fat5 import TESTED_TRANSFORMERS
from fat5.convert.parity import PARITY_TEXTS
from fat5.remote_code_fat5 import PIPELINE_TASK, custom_pipelines_entry  # noqa: F401  (re-exported)

MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent / "model_card_template.md"
# The text of the card's example (after the model's own task prefix, if any): the converter's first parity
# sentence, without its task prefix.
SAMPLE_TEXT = PARITY_TEXTS[0].split(": ", 1)[1]
# The labels of pyproject's [project.urls] the card links FAT5 to, in order of preference.
PROJECT_URL_LABELS = ("repository", "source", "homepage")

# Base errors of the HTTP clients huggingface_hub has used: httpx2 (2.x, connection errors are
# httpx2.ConnectError), httpx (1.x), requests (0.x). Only the installed ones are caught.
_CLIENT_ERRORS = tuple(
    getattr(importlib.import_module(module), name)
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException"))
    if importlib.util.find_spec(module) is not None
)


class PushError(CommandError):
    """An upload to the Hub failed; the message is one line saying why."""


def _human_count(num_parameters):
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_parameters >= scale:
            return f"{num_parameters / scale:.3g}{suffix}"
    return str(num_parameters)


def _title(base_model, source_name, family):
    source = base_model or source_name
    return f"FAT5 conversion of {source}" if source else f"FAT5 {family}"


def task_example(config):
    """The card's example input, from the task the model's config names: its `prefix` (which the pipeline puts
    before every input itself), else the first task of `task_specific_params` that has a prefix, else none.
    Returns a dict: `text` (what the tokenizer gets), `pipeline_text` (what the pipeline gets), `note` (one
    sentence saying where the example comes from)."""
    prefix = config.get("prefix")
    if isinstance(prefix, str) and prefix:
        return dict(text=prefix + SAMPLE_TEXT, pipeline_text=SAMPLE_TEXT,
                    note=f"The config sets `prefix` to `{prefix}`: the pipeline puts it before every input itself; "
                         f"with the tokenizer, add it yourself.")
    tasks = config.get("task_specific_params")
    tasks = {name: params["prefix"] for name, params in tasks.items()
             if isinstance(params, dict) and isinstance(params.get("prefix"), str) and params["prefix"]} \
        if isinstance(tasks, dict) else {}
    if tasks:
        (name, task_prefix), *others = tasks.items()
        also = "; the others: " + ", ".join(f"{other} (`{p}`)" for other, p in others) if others else ""
        return dict(text=task_prefix + SAMPLE_TEXT, pipeline_text=task_prefix + SAMPLE_TEXT,
                    note=f"The example uses the prefix of the `{name}` task of the config's `task_specific_params`"
                         f"{also}.")
    return dict(text=SAMPLE_TEXT, pipeline_text=SAMPLE_TEXT,
                note="The config names no task (no `prefix` or `task_specific_params`): give the model its input in "
                     "the form its source was trained on (see the source's description below, when there is one).")


def demoted_headings(markdown, levels=2):
    """`markdown` with every ATX heading outside code fences moved `levels` levels down (at most to level 6), so
    a source card's own title sits under the section that quotes it."""
    lines, fence = [], None
    for line in markdown.splitlines():
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = marker if fence is None else (None if marker == fence else fence)
        elif fence is None and re.match(r"#{1,6}(\s|$)", line):
            hashes = len(line) - len(line.lstrip("#"))
            line = "#" * min(6, hashes + levels) + line[hashes:]
        lines.append(line)
    return "\n".join(lines).strip()


def project_url():
    """FAT5's home page as the installed package's metadata names it (pyproject's [project.urls]), or None."""
    try:
        entries = package_metadata("fat5").get_all("Project-URL") or []
    except PackageNotFoundError:
        return None
    urls = {label.strip().lower(): url.strip() for label, _, url in (entry.partition(",") for entry in entries)}
    return next((urls[label] for label in PROJECT_URL_LABELS if urls.get(label)), None)


def render_model_card(
    out_dir,
    *,
    base_model,
    license,
    family,
    num_parameters,
    parity_max_abs_diff,
    parity_sample,
    language=None,
    extra_tags=(),
    repo_id=None,
    folder_name=None,
    convert_command=None,
    source_name=None,
    example=None,
    has_tokenizer=True,
    vocab_size=None,
    source_description=None,
):
    """Writes `out_dir/README.md` from the FAT5 template and returns its path. Offline: the card is not validated.

    base_model: source checkpoint id, or None. license: carried from the source, or None when unknown.
    family: "t5", "flan-t5", "mt5"... parity_max_abs_diff: largest |logits FAT5 - logits source| measured on
    parity_sample, or None when not measured (a short description of the inputs and dtype). repo_id: the Hub id
    the snippets load, when the folder is pushed; otherwise they load `folder_name`, the name the folder was
    written under, and the card says so. convert_command: the command line that produced the folder. source_name:
    what the title names when there is no base_model (e.g. the source folder's name). example: `task_example`'s
    dict, plus an optional `output` the model is known to give (default: `task_example({})`). has_tokenizer: False
    when the folder holds no tokenizer (no tokenizer example then; the card names `vocab_size`, the embeddings'
    rows, instead). source_description: the source card's text
    without its metadata, quoted at the end.
    """
    if not (repo_id or folder_name):
        raise ValueError("render_model_card needs repo_id or folder_name: the name the card's snippets load")
    example = example or task_example({})
    tags = list(dict.fromkeys(["fat5", "custom_code", "t5", family, *extra_tags]))
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=PIPELINE_TASK,
        base_model=base_model,
        license=license,
        language=language,
        tags=tags,
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(MODEL_CARD_TEMPLATE),
        model_name=_title(base_model, source_name, family),
        model_id=repo_id or folder_name,
        pushed=repo_id is not None,
        project_url=project_url(),
        example=example,
        example_literal=json.dumps(example["text"], ensure_ascii=False),
        # What the pipeline returns, as Python prints it, where the answer is known (the demo's); else its form.
        pipeline_output=repr([{"generated_text": example["output"]}]) if example.get("output") else None,
        pipeline_literal=json.dumps(example["pipeline_text"], ensure_ascii=False),
        has_tokenizer=has_tokenizer,
        vocab_size=vocab_size,
        source_description=demoted_headings(source_description) if source_description else None,
        family=family,
        parameters=_human_count(num_parameters),
        parity_max_abs_diff=None if parity_max_abs_diff is None else f"{parity_max_abs_diff:.3g}",
        parity_sample=parity_sample,
        convert_command=convert_command,
        tested_transformers=", ".join(TESTED_TRANSFORMERS),
    )
    path = Path(out_dir) / "README.md"
    card.save(path)
    return path


def check_push_credentials(token=None):
    """The token a push would use; raises PushError, without touching the network, if there is none.
    (Offline mode needs no check of ours: huggingface_hub refuses every call, and that becomes a PushError.)"""
    token = token or huggingface_hub.get_token()
    if not token:
        raise PushError(
            "cannot push: no Hugging Face credentials (pass --token, set HF_TOKEN or run `hf auth login`)"
        )
    return token


def check_push_access(repo_id, token=None):
    """Before converting: a token exists and the Hub accepts it (`whoami`), and `repo_id` is a valid id.
    Raises PushError with one line (offline mode included)."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"cannot push to {repo_id}: invalid repo id: {error_line(error)}") from error
    api = HfApi(token=check_push_credentials(token))
    with _hub_errors(repo_id):
        api.whoami()


@contextmanager
def _hub_errors(repo_id):
    """Every failure of a Hub call as a one-line PushError."""
    try:
        yield
    except OfflineModeIsEnabled as error:
        raise PushError(f"cannot push to {repo_id}: {error_line(error)}") from error
    except HFValidationError as error:
        raise PushError(f"cannot push to {repo_id}: invalid repo id or revision: {error_line(error)}") from error
    except HfHubHTTPError as error:
        raise PushError(f"push to {repo_id} failed: the Hub answered {error_line(error)}") from error
    except _CLIENT_ERRORS as error:
        raise PushError(f"push to {repo_id} failed: cannot reach the Hub ({error_line(error)})") from error


def push_to_hub(
    folder,
    repo_id,
    *,
    private=False,
    revision=None,
    create_pr=False,
    token=None,
    commit_message="Upload FAT5 checkpoint",
):
    """Creates `repo_id` if needed and uploads `folder` to it; returns the commit URL. Raises PushError."""
    if not Path(folder).is_dir():
        raise PushError(f"cannot push {folder}: not a directory")
    api = HfApi(token=check_push_credentials(token))
    with _hub_errors(repo_id):
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message,
        )
    return commit.commit_url
