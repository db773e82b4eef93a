"""Run Python code in a fresh interpreter where this repository cannot be imported, as a Hub user would; or, with
`plain`, in an interpreter that sees only FAT5's declared dependencies (and the libraries named beside them), as in
an environment where a user ran `pip install fat5` alone."""

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# An editable install hooks into the import system (setuptools' "__editable__" finder, path hook and path
# entry); the child undoes it so only what it loads from a checkpoint folder is there.
HIDE_REPO = """
import sys

def _from_editable(hook):
    return getattr(hook, "__module__", "").startswith("__editable__")

sys.meta_path[:] = [f for f in sys.meta_path if not _from_editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _from_editable(h)]
sys.path[:] = [p for p in sys.path if not p.startswith("__editable__")]
sys.path_importer_cache.clear()
"""


def declared_distributions(*libraries):
    """The canonical names of the distributions `pip install fat5` installs (FAT5's requirements without extras,
    and theirs, recursively; FAT5 itself left out), plus each of `libraries` (requirement strings such as
    "sentence-transformers") and what it requires."""
    names, pending = set(), [Requirement("fat5"), *map(Requirement, libraries)]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in names:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement of a platform or Python this is not (its marker holds, the wheel left it out)
        names.add(name)
        for line in distribution.requires or []:
            dependency = Requirement(line)
            if dependency.marker is None or dependency.marker.evaluate({"extra": ""}):
                pending.append(dependency)
    return names - {"fat5"}


def plain_site(folder, *libraries):
    """`folder` made a site folder holding only `declared_distributions(*libraries)`: a link to each of their
    top-level packages, modules and metadata folders in the current environment (nothing is copied)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in declared_distributions(*libraries):
        distribution = importlib.metadata.distribution(name)
        site = Path(distribution.locate_file("")).resolve()
        if distribution.files is None:
            raise RuntimeError(f"{name} lists no files (no RECORD): cannot place it in a plain environment")
        for top in {file.parts[0] for file in distribution.files if file.parts[0] != ".."}:
            source = site / top
            if source.exists() and not (folder / top).exists() and not top.endswith(".pth"):
                (folder / top).symlink_to(source)
    return folder


# Python started with -S (no site folders): the plain site folder is put first on sys.path.
PLAIN_SITE = """
import sys
sys.path.insert(0, sys.argv.pop(1))
"""


def run_isolated(code, args, cwd, timeout=300, with_output=False, plain=None):
    """Run HIDE_REPO + code with `python -I` (no PYTHONPATH, no cwd on sys.path) in `cwd`, offline, with no
    standard input; the code writes JSON to the path given as its last argument, which is returned parsed (with
    the process's stdout + stderr when `with_output`). `plain`: a tuple of libraries (possibly empty) to run
    instead where only FAT5's declared dependencies and those libraries can be imported (`plain_site`); an
    `HF_HUB_CACHE` of the environment is kept (the Hub-layout cache a test built)."""
    out_path = cwd / "isolated_result.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "modules"))
    command = [sys.executable, "-I", "-c", HIDE_REPO + code]
    if plain is not None:
        site = plain_site(cwd / ("plain-site-" + "-".join(sorted(map(canonicalize_name, plain)))), *plain)
        command = [sys.executable, "-I", "-S", "-c", PLAIN_SITE + code, str(site)]
    process = subprocess.run([*command, *map(str, args), str(out_path)],
                             cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=timeout)
    assert process.returncode == 0, process.stderr[-4000:]
    result = json.loads(out_path.read_text())
    return (result, process.stdout + process.stderr) if with_output else result


def publish_to_hub_cache(cache, repo_id, folder):
    """Put the files of `folder` into `cache` as huggingface_hub lays out a model repo it downloaded (`models--owner
    --name/blobs/<hash>`, `snapshots/<commit>/<path>` linking to the blobs, `refs/main` naming the commit), so that
    `from_pretrained(repo_id)` finds it offline with `HF_HUB_CACHE=cache`, as a user finds a pushed model.
    Returns `repo_id`."""
    files = sorted(path for path in Path(folder).rglob("*") if path.is_file())
    digest = hashlib.sha1()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + hashlib.sha256(path.read_bytes()).digest())
    commit = digest.hexdigest()
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for path in files:
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(path.read_bytes())
        target = repo / "snapshots" / commit / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    return repo_id


HUB_USER_GREEDY = dict(do_sample=False, num_beams=1, max_new_tokens=24)
# A Hub user's process: each repo id through every Auto class its config registers, the tokenizer, generate and
# the text2text pipeline. Writes {repo: {what: result}}.
LOAD_BY_ID = """
import json, sys
import torch, transformers
from transformers import AutoConfig, AutoTokenizer, pipeline

repos, prompts, greedy, out_path = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), \\
    sys.argv[4]
result = {}
for repo in repos:
    entry = result[repo] = {}
    config = AutoConfig.from_pretrained(repo, trust_remote_code=True)
    entry["config"] = [type(config).__name__, type(config).__module__]
    for auto_name in sorted(set(config.auto_map) - {"AutoConfig"}):
        model = getattr(transformers, auto_name).from_pretrained(repo, trust_remote_code=True)
        entry[auto_name] = [type(model).__name__, type(model).__module__]
    tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True).eval()
    with torch.no_grad():
        tokens = model.generate(**tokenizer(prompts, padding=True, return_tensors="pt"), **greedy)
    entry["generate"] = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    generator = pipeline("text2text-generation", model=repo, trust_remote_code=True)
    entry["pipeline"] = [record["generated_text"] for record in generator(prompts, **greedy)]
with open(out_path, "w") as f:
    json.dump(result, f)
"""


def load_by_id(repos, prompts, cwd):
    """What LOAD_BY_ID finds for each of `repos` (ids in the Hub cache the environment's HF_HUB_CACHE names), run
    where only FAT5's declared dependencies can be imported."""
    return run_isolated(LOAD_BY_ID, [json.dumps(repos), json.dumps(prompts), json.dumps(HUB_USER_GREEDY)], cwd,
                        plain=())


def assert_every_class_is_the_folders_code(entry):
    """Every Auto class of a LOAD_BY_ID entry loaded the class FAT5's `auto_map` names, from the repo's own code."""
    from fat5.remote_code_fat5 import AUTO_MAP

    assert entry["config"] == ["FAT5Config", entry["config"][1]] and entry["config"][1].startswith(
        "transformers_modules"), entry["config"]
    expected = {auto_name: target.split(".")[1] for auto_name, target in AUTO_MAP.items() if auto_name != "AutoConfig"}
    for auto_name, class_name in expected.items():
        name, module = entry[auto_name]
        assert module.startswith("transformers_modules") and module.endswith(".modeling_fat5"), (auto_name, module)
        if auto_name != "AutoModel":  # an encoder-only folder's base model is the encoder (remote_code_fat5)
            assert name == class_name, (auto_name, name)
