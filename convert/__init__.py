"""The converters' first home, kept for the commands and imports that name it: the code lives in `fat5.convert`, and
each module here is the `fat5.convert` module of its name (`python -m convert.flan_to_fat5` runs
`fat5.convert.flan_to_fat5`; `from convert.flan_to_fat5 import main` imports its `main`)."""

import importlib
import runpy
import sys


def alias(name, run_name):
    """Make module `name` (convert.X) fat5.convert.X: run as the program under `python -m`, else the same module."""
    if run_name == "__main__":
        runpy.run_module(f"fat5.{name}", run_name="__main__", alter_sys=True)
    else:
        sys.modules[name] = importlib.import_module(f"fat5.{name}")
