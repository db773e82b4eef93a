"""PEFT's defaults for FAT5: PEFT picks a method's `target_modules` (and IA3's `feedforward_modules`) from tables
keyed by `config.model_type`, which know "t5" but not "fat5". FAT5 keeps T5's module names, so T5's entries are
FAT5's; registering them lets `LoraConfig()`, `IA3Config()`, `AdaLoraConfig(...)` without `target_modules` work as
they do for T5. Runs when the model code is imported (installed package or a checkpoint's remote code) and when a
FAT5 model is built, for a process that has imported PEFT by then: FAT5 never imports PEFT itself (a process that
does not use it would pay its import, and on transformers 4.57 PEFT's deprecation warning)."""

import importlib
import sys

T5_MODEL_TYPE = "t5"
# PEFT keeps the tables in peft.utils.constants; some methods import them through peft.utils or their own module.
TABLE_MODULES = ("peft.utils.constants", "peft.utils")
TABLE_PREFIX = "TRANSFORMERS_MODELS_TO_"


def register_fat5_with_peft(model_type):
    """Give `model_type` T5's entry in every PEFT default-module table; a no-op where PEFT is not imported, and
    never overrides an entry PEFT (or the user) already has."""
    if "peft" not in sys.modules:
        return
    for module_name in TABLE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        for name, table in vars(module).items():
            if name.startswith(TABLE_PREFIX) and isinstance(table, dict) and T5_MODEL_TYPE in table:
                table.setdefault(model_type, table[T5_MODEL_TYPE])
