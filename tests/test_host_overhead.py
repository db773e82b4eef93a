"""The host's work around the kernels, pinned as upper bounds (never as timings): the torch ops an attention call
and a generated token dispatch, and no host synchronisation in a decode step (a GPU would wait there, and a CUDA
graph could not hold the step).

Ops are counted by a TorchDispatchMode: every op that reaches the dispatcher (views included), a custom op as one op
(what runs inside it is not seen). Kernel launches are stubbed: what is counted is the host's own work, the same on
a GPU and in Triton's interpreter. The bounds are what the code dispatches now plus a little headroom; a change that
adds per-call work fails here first.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import KERNEL_DEVICE, tiny_config

pytest.importorskip("triton")
from fat5 import attention_guard_fat5 as guard  # noqa: E402
from fat5.kernels import decode_attention_t5 as decode_kernel  # noqa: E402
from fat5.kernels import flash_attention_t5 as training_kernel  # noqa: E402
from fat5.reference_fat5 import relative_position_bucket  # noqa: E402

# Ops that read a tensor's values back to the host: the host waits for the GPU.
HOST_SYNCS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero", "aten.masked_select",
              "aten._unique", "aten.unique", "aten.repeat_interleave")


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active, by name (`aten.index.Tensor`), under the current `label`."""

    def __init__(self):
        super().__init__()
        self.label, self.ops = "outside", Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.label, str(func)] += 1
        return func(*args, **(kwargs or {}))

    def count(self, label=None):
        return sum(n for (name, _), n in self.ops.items() if label is None or name == label)

    def syncs(self):
        return [op for (_, op) in self.ops if op.startswith(HOST_SYNCS)]


class _NoLaunch:
    """A jitted kernel whose `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture(name="no_launches")
def no_launches_fixture(monkeypatch):
    for module, name in ((training_kernel, "_forward_kernel"), (decode_kernel, "_decode_chunk_kernel"),
                         (decode_kernel, "_decode_merge_kernel")):
        monkeypatch.setattr(module, name, _NoLaunch())


def dispatched(function):
    """(result, OpCounter) of `function()` run once more after a first call (which builds what is cached)."""
    function()
    with OpCounter() as counter:
        result = function()
    return result, counter


@pytest.mark.parametrize("module", [training_kernel, decode_kernel], ids=["training", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_t5_lookup_table_is_one_gather_after_the_first_call(module, dtype):
    """relative_bias_lut keeps its bucket index per device and shape: a call is a view, a gather and (for a half
    table) the cast, not T5's ~15-op bucketing. It equals the bucketing's gather, with its gradient, whether the
    index was first built under inference_mode or not."""
    with torch.inference_mode():
        module.relative_bias_lut(torch.randn(16, 3, device=KERNEL_DEVICE), False, 16, 40)
    table = torch.randn(16, 3, device=KERNEL_DEVICE, dtype=dtype, requires_grad=True)
    for bidirectional in (True, False):
        lut, counter = dispatched(lambda b=bidirectional: module.relative_bias_lut(table, b, 16, 40))
        assert counter.count() <= 3, counter.ops
        relative = torch.arange(-40, 41, device=KERNEL_DEVICE)
        expected = table[relative_position_bucket(relative, bidirectional, 16, 40)].t().float()
        assert torch.equal(lut, expected) and lut.is_contiguous()
        gradient = torch.randn_like(expected)
        assert torch.equal(*(torch.autograd.grad(x, table, gradient)[0] for x in (lut, expected)))


def test_a_decode_call_dispatches_its_outputs_only(no_launches):
    """decode_attention_t5 on a gathered table and a tensor position (a static cache's) allocates its output and,
    split over the keys, its partials: nothing per call for placeholders, the position or the checks; the table
    adds its gather."""
    q = torch.randn(1, 4, 1, 32, device=KERNEL_DEVICE)
    k = torch.randn(1, 4, 200, 32, device=KERNEL_DEVICE)
    table = torch.randn(8, 4, device=KERNEL_DEVICE)
    lut = decode_kernel.relative_bias_lut(table, False, 8, 20)
    position = torch.tensor([199], device=KERNEL_DEVICE)
    mask = torch.ones(1, 200, dtype=torch.bool, device=KERNEL_DEVICE)
    for splits, outputs in ((1, 1), (4, 4)):
        _, counter = dispatched(lambda n=splits: decode_kernel.decode_attention_t5(
            q, k, k, bias_lut=lut, causal=True, q_offset=position, num_splits=n))
        assert counter.count() <= outputs, counter.ops
    _, counter = dispatched(lambda: decode_kernel.decode_attention_t5(
        q, k, k, bias_table=table, bidirectional=False, num_buckets=8, max_distance=20, causal=True,
        q_offset=position, key_padding_mask=mask, num_splits=1))
    assert counter.count() <= 1 + 3 + 2, counter.ops  # output, the gather, the mask's view as bytes


def test_a_training_kernel_call_is_its_op(no_launches):
    """flash_attention_t5 on a shared table and key mask is its custom op and nothing else; from the bucket table it
    adds the gather (the padded key mask adds its few ops); varlen adds nothing for int32 cu_seqlens."""
    q = torch.randn(2, 4, 24, 32, device=KERNEL_DEVICE)
    table = torch.randn(8, 4, device=KERNEL_DEVICE)
    lut = training_kernel.relative_bias_lut(table, True, 8, 20)
    mask = training_kernel.additive_key_mask(torch.ones(2, 24, dtype=torch.bool, device=KERNEL_DEVICE))
    _, counter = dispatched(lambda: training_kernel.flash_attention_t5(q, q, q, bias_lut=lut, key_mask=mask))
    assert counter.count() <= 1, counter.ops
    _, counter = dispatched(lambda: training_kernel.flash_attention_t5(q, q, q, bias_table=table, num_buckets=8,
                                                                       max_distance=20))
    assert counter.count() <= 1 + 3, counter.ops
    packed = torch.randn(48, 4, 32, device=KERNEL_DEVICE)
    cu_seqlens = torch.tensor([0, 24, 48], dtype=torch.int32, device=KERNEL_DEVICE)
    _, counter = dispatched(lambda: training_kernel.flash_attention_t5_varlen(packed, packed, packed, cu_seqlens,
                                                                              cu_seqlens, 24, 24, bias_lut=lut))
    assert counter.count() <= 1 + 2, counter.ops


def count_decode_steps(model, **generate_options):
    """Generate 4 tokens, counting the ops each decoder forward dispatches, inside each self- and cross-attention
    module ("self", "cross") and outside them ("outside"). Returns the counters of the decoder forwards of one token."""
    counters, hooks = [], []

    def start(module, args, kwargs):
        counter = OpCounter()
        counter.__enter__()
        counters.append(counter)

    def stop(module, args, kwargs, output):
        counters[-1].__exit__(None, None, None)

    def label(name):
        def enter(module, args, kwargs):
            if counters:
                counters[-1].label = name

        def leave(module, args, kwargs, output):
            if counters:
                counters[-1].label = "outside"
        return enter, leave

    hooks.append(model.decoder.register_forward_pre_hook(start, with_kwargs=True))
    hooks.append(model.decoder.register_forward_hook(stop, with_kwargs=True))
    for block in model.decoder.block:
        for name, module in (("self", block.layer[0].SelfAttention), ("cross", block.layer[1].EncDecAttention)):
            enter, leave = label(name)
            hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            hooks.append(module.register_forward_hook(leave, with_kwargs=True))
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 3]], device=KERNEL_DEVICE)
    try:
        model.generate(input_ids=input_ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, **generate_options)
    finally:
        for hook in hooks:
            hook.remove()
    return counters


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_a_decode_step_dispatches_few_ops_per_layer_and_never_syncs(monkeypatch, no_launches, backend, cache):
    """One generated token through the decoder: each layer's self- and cross-attention (projections, cache update,
    attention, output projection) dispatch at most a pinned number of ops, the guarded kernel as on a GPU (its
    first-use check done); no decoder forward reads a tensor back to the host."""
    monkeypatch.setattr(guard, "GUARDED_DEVICES", {"cuda", KERNEL_DEVICE.type})
    monkeypatch.setattr(guard, "_check_against_sdpa", lambda *args: None)
    layers = 3
    model = attention_fat5_model(layers, backend)
    options = {} if cache == "dynamic" else {"cache_implementation": "static"}
    counters = count_decode_steps(model, **options)
    assert len(counters) == 4, len(counters)
    for step, counter in enumerate(counters):
        assert not counter.syncs(), (step, counter.syncs())
    later = counters[-1]  # a step whose cross-attention keys are cached
    # The same for both backends: the stack builds the masks and the T5 bias once a forward (outside the layers).
    for kind, bound in {"self": 34, "cross": 16}.items():
        assert later.count(kind) <= bound * layers, (kind, later.count(kind) / layers, later.ops)


def attention_fat5_model(layers, backend):
    from fat5.modeling_fat5 import FAT5ForConditionalGeneration

    config = tiny_config(d_kv=32, num_heads=2, num_layers=1, num_decoder_layers=layers, attention_backend=backend,
                         decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return FAT5ForConditionalGeneration(config).to(KERNEL_DEVICE).eval()


def test_torch_compile_finds_no_lru_cache_on_the_forward_path():
    """What the traced forward asks about the install (triton there? the kernel's head dims) is a plain value kept
    once: Dynamo warned about each lru_cache-wrapped helper it traced into."""
    import warnings

    from fat5.attention_fat5 import triton_installed
    from fat5.attention_select_fat5 import select_attention_backend

    config = tiny_config(attention_backend="auto")

    def forward(x):
        backend = select_attention_backend(config, torch.device("cuda"), 32)
        return x + (1 if backend == "triton" and triton_installed() else 2)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.compile(forward, backend="eager", fullgraph=True)(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert not [str(warning.message) for warning in caught if "lru_cache" in str(warning.message)]


class _NullGraph:
    """A captured step that replays nothing: what a replayed forward still dispatches is the host's own work."""

    def __init__(self, device):
        pass

    def warm_up(self, step):
        return step()

    def capture(self, step):
        return step()

    def replay(self):
        pass


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_a_replayed_decode_step_dispatches_its_input_copies_only(monkeypatch, no_launches, backend):
    """A decode step replayed from its captured graph (fat5/generation_fat5.py) dispatches the copy of its token
    into the graph and the copy of its logits out of it: no op of the step itself and no host synchronisation,
    whatever the model's depth. A generation's first replay also copies the encoder's padding mask and, where
    generate made a new cache (transformers 5), hands its tensors over to the graph's (keys, values and position
    counter of each layer's self- and cross-attention)."""
    from fat5 import generation_fat5

    monkeypatch.setitem(generation_fat5.GRAPH_CLASSES, KERNEL_DEVICE.type, _NullGraph)
    monkeypatch.setattr(guard, "GUARDED_DEVICES", {"cuda", KERNEL_DEVICE.type})
    monkeypatch.setattr(guard, "_check_against_sdpa", lambda *args: None)
    model = attention_fat5_model(3, backend)
    counters, forward = [], type(model).forward

    def counted(self, *args, **kwargs):
        with OpCounter() as counter:
            output = forward(self, *args, **kwargs)
        counters.append(counter)
        return output

    monkeypatch.setattr(type(model), "forward", counted)  # on the class: a wrapped forward is not captured
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 3]], device=KERNEL_DEVICE)
    options = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=6,
                   min_new_tokens=6, do_sample=False, cache_implementation="static")
    model.generate(**options)
    assert model.captured_decode_steps()
    counters.clear()
    model.generate(**options)  # the prefill, then 5 replays
    replays = counters[1:]
    assert len(replays) == 5, len(counters)
    layers = model.config.num_decoder_layers
    assert replays[0].count() <= 3 + 2 * 3 * layers, dict(replays[0].ops)
    assert all(counter.count() <= 2 for counter in replays[1:]), [dict(counter.ops) for counter in replays]
    assert not any(counter.syncs() for counter in counters)


def token_ops(model, monkeypatch, **generate_options):
    """The OpCounter of one later generated token's forward (decoder and LM head), `model` generating 4 tokens."""
    counters, forward = [], type(model).forward

    def counted(self, *args, **kwargs):
        with OpCounter() as counter:
            output = forward(self, *args, **kwargs)
        counters.append(counter)
        return output

    monkeypatch.setattr(type(model), "forward", counted)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 3]])
    with torch.no_grad():
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4,
                       min_new_tokens=4, do_sample=False, **generate_options)
    monkeypatch.undo()
    return counters[-1]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_generated_token_dispatches_fewer_ops_than_transformers_t5(monkeypatch, cache):
    """Eager generation on CPU (SDPA), what a token costs the host: the decoder and LM head of one later token
    dispatch at most 50 + 80 ops a layer (998 at T5-base's 12 layers with a static cache, 961 with the dynamic one)
    and fewer than transformers' T5 built from the same config (with SDPA where it has it: 1,143 and 1,059 at 12
    layers on transformers 5.25; eager on 4.57), and never read the device back."""
    from transformers import T5Config, T5ForConditionalGeneration

    from fat5.modeling_fat5 import FAT5ForConditionalGeneration

    layers = 3
    fields = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=layers, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                  feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False)
    options = {} if cache == "dynamic" else {"cache_implementation": "static"}
    fat5 = FAT5ForConditionalGeneration(tiny_config(**fields, attention_backend="sdpa")).eval()
    ours = token_ops(fat5, monkeypatch, **options)
    assert not ours.syncs(), ours.syncs()
    assert ours.count() <= 50 + 80 * layers, ours.count()
    try:
        t5 = T5ForConditionalGeneration._from_config(T5Config(**fields), attn_implementation="sdpa").eval()
    except (ValueError, ImportError):  # transformers 4.57's T5 has no SDPA path
        t5 = T5ForConditionalGeneration._from_config(T5Config(**fields), attn_implementation="eager").eval()
    theirs = token_ops(t5, monkeypatch, **options)
    assert ours.count() < theirs.count(), (ours.count(), theirs.count())
