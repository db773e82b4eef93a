"""A CUDA graph's stand-in on CPU that fails on whatever a capture forbids: what proves, without a GPU, that the
decode step FAT5 captures on CUDA (fat5/generation_fat5.py) is capture-safe.

`Recorder` has `CUDAGraphStep`'s interface (warm_up, capture, replay). Its capture runs the step under a
TorchDispatchMode that records every torch op (and every Triton launch through `recorded_kernels`) with the
tensors it reads and writes, and raises `CaptureError` on what a CUDA capture cannot hold:

- a read of a tensor on the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool(tensor)` (a Python branch
  on a tensor's values), `int()`/`float()` of one, `torch.equal`;
- a shape that depends on the values: `nonzero`, `masked_select`, `unique`, boolean-mask indexing,
  `repeat_interleave` by a tensor without `output_size`, `bincount`;
- a tensor made from Python data in the step (`torch.tensor(...)`): on a GPU a copy from host memory, which a
  capture cannot hold (and which would replay the values it had then).

As on a GPU, the capture does not change what it did not make: tensors from outside it (weights, the caches, the
graph's inputs) are put back as they were when it ends. Its replay runs the recorded ops again, with their
recorded arguments, on the same tensors (a graph's kernels read and write fixed addresses with the scalars baked
in at capture): a value the step read on the host, or a Python number that should have changed between tokens,
is replayed stale, and the tokens differ from eager generation's. Tensors from outside the capture are held
weakly, and a replay fails when one was freed since the capture, or its memory moved (`param.data = ...`): on a
GPU the graph would read freed memory (an allocation whose address changed between replays).
"""

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# Ops that read a tensor's values on the host (the GPU would be waited for: no capture holds that).
HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item"}
# Ops whose output shape depends on tensor values (a host read to size the output).
DATA_DEPENDENT = {"aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::_unique",
                  "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
                  "aten::bincount"}
# Ops that make a tensor from host data (torch.tensor, torch.as_tensor).
HOST_DATA = {"aten::lift_fresh", "aten::lift", "aten::lift_fresh_copy"}
HOST_METHODS = ("cpu", "numpy", "tolist")


class CaptureError(AssertionError):
    """What a CUDA capture would refuse, or a graph would get wrong."""


_active = []  # the Recorder capturing now (at most one)


def _is_tensor(value):
    return isinstance(value, torch.Tensor)


class _External:
    """A tensor from outside the capture, held weakly with its memory's address at the capture."""

    def __init__(self, tensor):
        self.ref, self.address, self.shape = weakref.ref(tensor), tensor.data_ptr(), tuple(tensor.shape)

    def resolve(self, what):
        tensor = self.ref()
        if tensor is None:
            raise CaptureError(f"{what} reads a {self.shape} tensor made outside the graph and freed since the "
                               "capture: on a GPU it would read freed memory")
        if tensor.data_ptr() != self.address:
            raise CaptureError(f"{what} reads a {self.shape} tensor whose memory moved since the capture: on a GPU "
                               "the graph reads the old address")
        return tensor


class _Mode(TorchDispatchMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder.paused:
            return func(*args, **kwargs)
        name = func._schema.name
        if name in HOST_READS:
            raise CaptureError(f"{func} reads a tensor on the host (.item(), bool(), int(), a Python branch on "
                               "values): a CUDA capture cannot wait for the GPU")
        if name in HOST_DATA:
            raise CaptureError(f"{func}: a tensor made from host data in the step (torch.tensor): on a GPU a copy "
                               "from host memory, which a CUDA capture cannot hold")
        data_dependent = name in DATA_DEPENDENT or (name == "aten::repeat_interleave" and "Tensor" in
                                                    func._overloadname and kwargs.get("output_size") is None)
        if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            data_dependent |= any(_is_tensor(index) and index.dtype in (torch.bool, torch.uint8)
                                  for index in indices)
        if data_dependent:
            raise CaptureError(f"{func}'s output shape depends on tensor values: a CUDA capture cannot size it")
        return self.recorder.record_op(func, args, kwargs)


class Recorder:
    """Stands in for `CUDAGraphStep` (tests put it in `generation_fat5.GRAPH_CLASSES["cpu"]`). Every instance is
    listed in `Recorder.made`, with how many times it replayed."""

    made = []

    def __init__(self, device):
        self.device = device
        self.entries = []  # (what, run): replayed in order
        self.internal = set()  # ids of the tensors the capture made (held by `kept`)
        self.kept = []
        self.saved = {}  # id -> (tensor, its value before the capture): outside tensors, put back after it
        self.paused = False
        self.replays = 0
        Recorder.made.append(self)

    def warm_up(self, step):
        return step()

    def capture(self, step):
        originals = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}

        def refused(name):
            def method(tensor, *args, **kwargs):
                if not self.paused:
                    raise CaptureError(f"Tensor.{name}() copies a tensor to the host: a CUDA capture cannot")
                return originals[name](tensor, *args, **kwargs)
            return method

        _active.append(self)
        try:
            for name in HOST_METHODS:
                setattr(torch.Tensor, name, refused(name))
            with _Mode(self):
                outputs = step()
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
            _active.remove(self)
            with torch.inference_mode():  # a capture runs nothing: what it changed outside goes back
                for tensor, value in self.saved.values():
                    tensor.copy_(value)
            self.saved.clear()
        return outputs

    def replay(self):
        self.replays += 1
        for _, run in self.entries:
            run()

    # -- recording ---------------------------------------------------------------------------------------------

    def _hold(self, value):
        """How an argument is kept: the capture's own tensors strongly, outside ones weakly (first saved)."""
        if not _is_tensor(value):
            return value
        if id(value) in self.internal:
            return value
        if id(value) not in self.saved:
            self.paused = True
            try:
                self.saved[id(value)] = (value, value.detach().clone())
            finally:
                self.paused = False
        return _External(value)

    def _made(self, outputs):
        for value in tree_flatten(outputs)[0]:
            if _is_tensor(value) and id(value) not in self.internal:
                self.internal.add(id(value))
                self.kept.append(value)

    def record_op(self, func, args, kwargs):
        held_args, held_kwargs = tree_map(self._hold, args), tree_map(self._hold, kwargs)  # saved before it runs
        outputs = func(*args, **kwargs)
        self._made(outputs)
        captured = tree_flatten(outputs)[0]

        def run():
            what = str(func)
            fresh = func(*tree_map(lambda v: v.resolve(what) if isinstance(v, _External) else v, held_args),
                         **tree_map(lambda v: v.resolve(what) if isinstance(v, _External) else v, held_kwargs))
            # A graph writes its kernels' outputs where the capture put them.
            for old, new in zip(captured, tree_flatten(fresh)[0]):
                if _is_tensor(old) and new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
                    old.copy_(new)

        self.entries.append((str(func), run))
        return outputs

    def record_launch(self, kernel, grid, args, kwargs):
        held_args, held_kwargs = tree_map(self._hold, list(args)), tree_map(self._hold, kwargs)
        what = f"Triton kernel {getattr(kernel, '__name__', kernel)}"

        def run():
            kernel[grid](*tree_map(lambda v: v.resolve(what) if isinstance(v, _External) else v, held_args),
                         **tree_map(lambda v: v.resolve(what) if isinstance(v, _External) else v, held_kwargs))

        self.entries.append((what, run))


class RecordedKernel:
    """A jitted Triton kernel whose launches a capturing Recorder records (and runs, outside its dispatch mode)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.__name__ = getattr(kernel, "__name__", repr(kernel))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            recorder = _active[-1] if _active else None
            if recorder is None:
                return self.kernel[grid](*args, **kwargs)
            recorder.record_launch(self.kernel, grid, args, kwargs)
            recorder.paused = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                recorder.paused = False
        return launch


@contextlib.contextmanager
def recorded_kernels(monkeypatch, module, *names):
    """The named kernels of `module` launched through RecordedKernel while the context is open."""
    for name in names:
        monkeypatch.setattr(module, name, RecordedKernel(getattr(module, name)))
    yield
