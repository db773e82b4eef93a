"""Pickling FAT5 models and configs loaded with trust_remote_code, so they load in a fresh process as T5's do.

Pickle names a class by its module. A class transformers loaded from a folder's code lives in a module of its
module cache (`transformers_modules...`), which transformers makes importable only when it loads remote code, so by
name alone such a model would not unpickle in a new process. Here the class is pickled as the calls that make it
importable first (transformers' `init_hf_modules`, which puts the module cache on the path, then an import of the
module, which that cache holds on this machine). Classes of an installed package pickle by name, as any other.
Exported with the model code; it imports no other FAT5 module (transformers 4.57 copies into its module cache only
the modules that the configuration module imports itself).
"""

import copyreg
import importlib

# Where transformers puts the code of folders loaded with trust_remote_code (transformers.dynamic_module_utils).
DYNAMIC_MODULES = "transformers_modules"


class _Call:
    """Pickles as the call `function(*args)`: unpickling makes the call."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def reduce_keeping_code_importable(obj, reduced):
    """`reduced` (what `object.__reduce_ex__` gave for `obj`, a FAT5 model or config), with the class pickled as
    the calls that import it when it comes from a folder's code (see the module docstring)."""
    cls = type(obj)
    if not cls.__module__.startswith(f"{DYNAMIC_MODULES}."):
        return reduced
    from transformers.dynamic_module_utils import init_hf_modules

    module = _Call(importlib.import_module, cls.__module__, _Call(init_hf_modules))  # (name, package=None)
    return (copyreg._reconstructor, (_Call(getattr, module, cls.__qualname__), object, None), *reduced[2:])


def shallow_copy(obj):
    """What `copy.copy` makes without `__reduce_ex__` (whose reduction names the class by calls)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


class PicklesWithItsCode:
    """Mixin, first among a FAT5 model's or config's bases: pickled, the object names its class by the calls that
    import it (reduce_keeping_code_importable), so one loaded with trust_remote_code unpickles in a fresh process too,
    as T5's do; `copy.copy` copies it without that reduction."""

    def __reduce_ex__(self, protocol):
        return reduce_keeping_code_importable(self, super().__reduce_ex__(protocol))

    def __copy__(self):
        return shallow_copy(self)
