"""Run Python code in a fresh interpreter where this repository cannot be imported, as a Hub user would."""

import json
import os
import subprocess
import sys

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


def run_isolated(code, args, cwd, timeout=300, with_output=False):
    """Run HIDE_REPO + code with `python -I` (no PYTHONPATH, no cwd on sys.path) in `cwd`, offline, with no
    standard input; the code writes JSON to the path given as its last argument, which is returned parsed (with
    the process's stdout + stderr when `with_output`)."""
    out_path = cwd / "isolated_result.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "modules"))
    process = subprocess.run([sys.executable, "-I", "-c", HIDE_REPO + code, *map(str, args), str(out_path)],
                             cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=timeout)
    assert process.returncode == 0, process.stderr[-4000:]
    result = json.loads(out_path.read_text())
    return (result, process.stdout + process.stderr) if with_output else result
