"""`torch.library.custom_op` for the kernels' ops, each op defined once a process, by whichever copy of FAT5's code
comes first.

A model folder's code loaded with `trust_remote_code` is a copy of FAT5's kernels beside the installed package's, and
a second model's folder another copy. torch's `custom_op` on a name already defined destroys the first definition, and
the first copy's handles on it then point at freed memory: its next call fails with `std::bad_alloc` or
`basic_string::_M_create`, or computes from garbage. So a copy whose op has the signature of the one defined uses
that one (what it registered stays: its kernels, fake and autograd); a copy whose signature differs defines its own,
named after that signature.
"""

import hashlib

import torch


class DefinedOp:
    """An op another copy of this code defined, called as the `CustomOpDef` that copy holds; registering on it does
    nothing (that copy registered its fake and autograd with it)."""

    def __init__(self, op):
        self._opoverload = op

    def __call__(self, *args, **kwargs):
        return self._opoverload(*args, **kwargs)

    def register_fake(self, fn):
        return fn

    def register_autograd(self, backward, *, setup_context=None):
        pass


def custom_op(qualname, fn=None, *, mutates_args=()):
    """`torch.library.custom_op(qualname, fn, mutates_args=...)` (or its decorator when `fn` is None), or the op of
    that name and signature already defined."""
    if fn is None:
        return lambda fn: custom_op(qualname, fn, mutates_args=mutates_args)
    schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
    for name in (qualname, f"{qualname}_{hashlib.sha1(schema.encode()).hexdigest()[:8]}"):
        namespace, op_name = name.split("::")
        defined = getattr(getattr(torch.ops, namespace), op_name, None)
        if defined is None:
            return torch.library.custom_op(name, fn, mutates_args=mutates_args)
        if str(defined.default._schema) == name + schema:
            return DefinedOp(defined.default)
    raise RuntimeError(f"{qualname}'s name and its signature's are both defined with other signatures")
