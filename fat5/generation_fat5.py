"""Generation's decode step replayed from a CUDA graph: the speed of a compiled step without compiling.

transformers' `generate` calls the model once per new token. With a static cache (`cache_implementation="static"`)
every later call is the same decoder step on tensors that stay where they are: the token just chosen, the
encoder's padding mask, the caches' keys, values and position counters, the weights. On CUDA, FAT5 records that
step once (a `torch.cuda.CUDAGraph`: the step's ~1,000 kernel launches) and replays it for every later token,
where the eager step spends its time dispatching those ops one by one from Python (about 15 ms a token at
T5-base on an H100, whatever the batch). The capture takes the time of a few eager steps and no Inductor;
transformers' own answer, `torch.compile(mode="reduce-overhead")`, compiles for a minute and more per shape.

A captured step serves one bucket: (batch, cache slots, encoder length, dtype, device, whether a padding mask is
given). It is captured on the bucket's first decode step (warm-up on a side stream: that step's real run, then
the capture) and replayed by the forward of each later step, whatever calls it (`generate` with any search,
`pipeline`, the recipes' predict, a loop of the user's): the step's inputs are copied into the graph's own
tensors, and a cache whose tensors are not the graph's (a new `generate` call's, or beam search's reordered ones)
hands its contents over to them and then holds them. What a step baked in is checked before the first replay of
each generation: a change of weights (their memory), dtype, device, modules (an adapter loaded, switched or
disabled), mode, hooks or config drops every graph of the model; `train()` and `.to()` drop them at once. Each
model keeps its own graphs (never shared, never copied or pickled with it, freed with it), at most
`config.decode_cuda_graphs` of them, the least recently used evicted first; 0 turns capture off.

Memory: a bucket holds its caches' tensors (2 x decoder layers x batch x heads x d_kv x (cache slots + encoder
length) x the dtype's bytes: 0.70 GiB at T5-base in bf16, batch 32, encoder 512, 128 new tokens) and a pool for
one step's intermediates (the logits, batch x vocabulary, and a few MiB), both until it is evicted or dropped.

Devices: GRAPH_CLASSES maps a device type to the class that captures on it: CUDA's `CUDAGraphStep`. The tests put
a recorder under "cpu" that replays the recorded ops and fails on whatever a capture forbids, which proves on CPU
that the step FAT5 captures on a GPU is capture-safe (tests/test_decode_graphs.py).

Exported with the model code: it imports only torch and the standard library.
"""

import logging
import time
from collections import OrderedDict

import torch

logger = logging.getLogger(__name__)


class CUDAGraphStep:
    """A decode step in a torch.cuda.CUDAGraph: warmed up and captured on a side stream of its own, replayed on the
    current stream. `pool_bytes`: the memory its capture took from the allocator (its private pool)."""

    def __init__(self, device):
        self.device = device
        self.graph = torch.cuda.CUDAGraph()
        self.stream = torch.cuda.Stream(device)
        self.pool_bytes = 0

    def warm_up(self, step):
        """step() run for real on the side stream (lazy initialisations, the kernels' first compiles): its result
        is this token's."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            result = step()
        current.wait_stream(self.stream)
        return result

    def capture(self, step):
        """step() recorded, not run: its outputs are the tensors every replay writes."""
        with torch.cuda.device(self.device), torch.cuda.graph(self.graph, stream=self.stream):
            before = torch.cuda.memory_reserved(self.device)
            outputs = step()
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        return outputs

    def replay(self):
        with torch.cuda.device(self.device):  # on the model's device's current stream, whichever device is current
            self.graph.replay()


# Device type -> the class that captures a decode step there (tests add "cpu": a recorder).
GRAPH_CLASSES = {"cuda": CUDAGraphStep}


class DecodeGraphs:
    """One model's captured decode steps, by bucket, least recently used first. A model's attribute: copies and
    pickles of the model get an empty one."""

    def __init__(self):
        self.buckets = OrderedDict()
        self.current = None  # the bucket of the last replay
        self.state = None  # what the buckets were captured from (model_state)
        self.fresh = True  # a forward ran that was no decode step (a prefill): a new generation may have begun
        self.capturing = False
        self.warned = set()
        self.failure = None  # why the model's steps cannot be captured: none is tried until the model changes

    def __deepcopy__(self, memo):
        return DecodeGraphs()

    def __reduce__(self):
        return DecodeGraphs, ()

    def release(self):
        """Drop every captured step (their memory goes back to the allocator once no output of theirs is held)."""
        self.buckets.clear()
        self.current = self.state = self.failure = None
        self.fresh = True

    def describe(self):
        """One dict per captured step, least recently used first: its bucket, memory and capture time."""
        return [dict(batch=bucket.batch, cache_slots=bucket.slots, encoder_length=bucket.encoder_length,
                     cache_mib=round(bucket.cache_bytes / 2**20, 1), pool_mib=round(bucket.pool_bytes / 2**20, 1),
                     capture_s=round(bucket.seconds, 3)) for bucket in self.buckets.values()]

    def warn(self, cause):
        if cause not in self.warned:
            self.warned.add(cause)
            logger.warning("FAT5's decode steps run eagerly, not from a captured CUDA graph: %s", cause)

    def step(self, model, decoder_input_ids, encoder_states, attention_mask, cache, refusal):
        """This decode step's logits, replayed (on a bucket's first step: captured, and the warm-up's), or None when
        it runs eagerly. `refusal`: why this call's options cannot be captured (None: they can)."""
        fresh, self.fresh = self.fresh, False
        if fresh:  # the first decode step of a generation: has the model changed since the capture?
            state = model_state(model)
            if state != self.state:
                if self.buckets:
                    logger.info("FAT5's model changed since its decode steps were captured: they are dropped")
                self.release()
                self.fresh, self.state = False, state
        if self.failure is not None or refusal is not None:
            self.warn(refusal or self.failure)
            return None
        bucket = self.current
        if fresh or bucket is None or cache is not bucket.cache or decoder_input_ids.shape[0] != bucket.batch \
                or (attention_mask is None) != (bucket.mask is None):
            key = bucket_key(decoder_input_ids, encoder_states, attention_mask, cache)
            bucket = self.buckets.get(key)
            if bucket is None:
                return self.capture(model, key, decoder_input_ids, encoder_states, attention_mask, cache)
            self.buckets.move_to_end(key)
            self.current = bucket
        with torch.inference_mode():  # the graph's tensors may be inference tensors (captured in that mode)
            if fresh or cache is not bucket.cache:
                bucket.bind(cache)
            if bucket.mask is not None and (fresh or attention_mask is not bucket.mask_source):
                bucket.mask.copy_(attention_mask)
                bucket.mask_source = attention_mask
            bucket.adopt()
            bucket.ids.copy_(decoder_input_ids)
            bucket.graph.replay()
        # The graph rewrites its logits at the next replay: the caller gets a copy of its own.
        return bucket.logits.clone()

    def capture(self, model, key, decoder_input_ids, encoder_states, attention_mask, cache):
        """Warm up and capture the step of a new bucket; the warm-up's logits are this step's."""
        hooked = next((name or "the model" for name, module in model.named_modules()
                       if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)), None)
        if hooked is not None:
            self.failure = f"{hooked} has forward hooks (or a wrapped forward), which a replayed step would not run"
            self.warn(self.failure)
            return None
        while len(self.buckets) >= model.config.decode_cuda_graphs:
            self.buckets.popitem(last=False)
        self.current = None
        device = decoder_input_ids.device
        bucket = Bucket(GRAPH_CLASSES[device.type](device), decoder_input_ids, encoder_states, attention_mask,
                        cache)
        # The decode step reads only the cross-attention caches: the encoder states stand in by their shape.
        states = torch.zeros((), dtype=encoder_states.dtype, device=device).expand(encoder_states.shape)

        def step():
            return model.forward(decoder_input_ids=bucket.ids, encoder_outputs=(states,), attention_mask=bucket.mask,
                                 cache=cache, use_cache=True, return_dict=True).logits

        started = time.perf_counter()
        self.capturing = True
        try:
            logits = bucket.graph.warm_up(step)
            try:
                bucket.logits = bucket.graph.capture(step)
            except Exception as error:  # noqa: BLE001 (whatever fails a capture, the step runs eagerly)
                self.failure = f"capturing the step failed ({type(error).__name__}: " \
                               f"{(str(error).strip().splitlines() or [''])[0][:200]})"
                self.warn(self.failure)
                return logits
        finally:
            self.capturing = False
        bucket.seconds = time.perf_counter() - started
        bucket.pool_bytes = getattr(bucket.graph, "pool_bytes", 0)
        self.buckets[key] = self.current = bucket
        self.fresh = False  # the warm-up and the capture were forwards of this generation
        return logits


class Bucket:
    """One captured step: the graph, the tensors it reads its inputs from (the token, the encoder's padding mask,
    the caches' tensors) and the logits it writes."""

    def __init__(self, graph, decoder_input_ids, encoder_states, attention_mask, cache):
        self.graph = graph
        self.batch, self.encoder_length = decoder_input_ids.shape[0], encoder_states.shape[1]
        self.ids = decoder_input_ids.clone()
        self.mask = None if attention_mask is None else attention_mask.clone()
        self.mask_source = attention_mask
        self.logits = None
        self.seconds, self.pool_bytes = 0.0, 0
        # The cache's tensors at the capture become the graph's: (part, layer index, attribute) -> tensor.
        self.tensors = {place: tensor for place, (_, tensor) in cache_tensors(cache).items()}
        self.cache_bytes = sum(tensor.nbytes for tensor in self.tensors.values())
        self.slots = cache.self_attention_cache.layers[0].keys.shape[2]
        self.cache, self.bound = None, []
        self.bind(cache)

    def bind(self, cache):
        """Serve `cache`: remember where its layers keep each of the graph's tensors."""
        layers = cache_tensors(cache)
        self.cache = cache
        self.bound = [(layers[place][0], place[2], tensor) for place, tensor in self.tensors.items()]

    def adopt(self):
        """Every cache tensor that is not the graph's (a new generation's, a reordered beam's) is copied into the
        graph's, which the cache then holds."""
        for layer, name, tensor in self.bound:
            current = getattr(layer, name)
            if current is not tensor:
                tensor.copy_(current)
                setattr(layer, name, tensor)


def cache_tensors(cache):
    """{(part, layer index, attribute): (layer, tensor)} of every tensor the static caches' layers hold (keys,
    values, and where transformers keeps one, the position counter)."""
    found = {}
    for part in ("self_attention_cache", "cross_attention_cache"):
        for index, layer in enumerate(getattr(cache, part).layers):
            for name, value in vars(layer).items():
                if isinstance(value, torch.Tensor):
                    found[part, index, name] = (layer, value)
    return found


def bucket_key(decoder_input_ids, encoder_states, attention_mask, cache):
    """What one captured step is for: the shapes, dtypes and device of everything it reads."""
    parts = []
    for part in (cache.self_attention_cache, cache.cross_attention_cache):
        first = vars(part.layers[0])
        parts.append((len(part.layers), tuple((name, tuple(value.shape), value.dtype) for name, value in first.items()
                                              if isinstance(value, torch.Tensor))))
    mask = None if attention_mask is None else (tuple(attention_mask.shape), attention_mask.dtype)
    return (tuple(decoder_input_ids.shape), decoder_input_ids.dtype, tuple(encoder_states.shape),
            encoder_states.dtype, decoder_input_ids.device, mask, *parts)


def _plain(value):
    """A hashable copy of a plain setting (a number, a string, a flag, or a list, tuple or dict of them), else None:
    what a module's or a config's switches look like."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return (value,)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(item) for item in value]
        if None in items:
            return None
        return (type(value).__name__, tuple(sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items))
    if isinstance(value, dict):
        items = [(key, _plain(item)) for key, item in value.items() if isinstance(key, str)]
        return None if any(item is None for _, item in items) else ("dict", tuple(sorted(items, key=repr)))
    return None


# What every nn.Module keeps in its __dict__ (parameters, buffers, submodules, hooks): read apart, never compared.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _own_class(cls):
    """Whether `cls` is FAT5's (a module of this package, or of its copy in a checkpoint folder) or torch's: modules
    whose settings are their config's or their construction's. Another class was put in by a tool (PEFT's adapter
    layers), and its settings are switches a captured step baked in."""
    return cls.__module__.startswith("torch.") or cls.__module__.rsplit(".", 1)[0] == __name__.rsplit(".", 1)[0]


def model_state(model):
    """What a captured step baked in beyond its inputs: every module (name, class, mode, hooks, a replaced forward,
    and for a tool's module its plain settings, such as an adapter's switches), every parameter and buffer (its
    memory, dtype, device, shape), the config's plain fields and the float32 matmul precision (the kernels read
    it)."""
    state = [torch.get_float32_matmul_precision(),
             tuple(sorted((key, _plain(value)) for key, value in vars(model.config).items()))]
    for name, module in model.named_modules():
        entry = [name, type(module), module.training, len(module._forward_hooks), len(module._forward_pre_hooks),
                 "forward" in vars(module)]
        if not _own_class(type(module)):
            entry.append(tuple((key, _plain(value)) for key, value in vars(module).items()
                               if key not in _MODULE_INTERNALS))
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                entry.append((tensor.data_ptr(), tensor.dtype, tensor.device, tensor.shape))
        state.append(tuple(entry))
    return state


def uncapturable(model, output_attentions, output_hidden_states, decoder_attention_mask):
    """Why a decode step with these options cannot be captured (None: it can)."""
    config = model.config
    if output_attentions or (output_attentions is None and config.output_attentions):
        return "output_attentions asks for every step's attention weights"
    if output_hidden_states or (output_hidden_states is None and config.output_hidden_states):
        return "output_hidden_states asks for every step's hidden states"
    if decoder_attention_mask is not None:
        return "a decoder attention mask grows with every token"
    return None


def is_decode_step_to_replay(model, decoder_input_ids, encoder_outputs, cache, use_cache):
    """Whether this forward is a decode step a captured graph could serve: a graph device, eval mode without
    gradients, one token per row after the cross-attention keys were computed, static self- and cross-attention
    caches, captures on (config.decode_cuda_graphs > 0), not inside a capture or a compilation."""
    if decoder_input_ids is None or decoder_input_ids.dim() != 2 or decoder_input_ids.shape[1] != 1 \
            or encoder_outputs is None or cache is None or use_cache is False:
        return False
    graphs = model._decode_graphs
    if graphs.capturing or decoder_input_ids.device.type not in GRAPH_CLASSES or model.training \
            or torch.is_grad_enabled() or not model.config.decode_cuda_graphs or torch.compiler.is_compiling():
        return False
    parts = [getattr(cache, part, None) for part in ("self_attention_cache", "cross_attention_cache")]
    if any(part is None or not getattr(part, "is_compileable", False) or not getattr(part, "layers", None)
           for part in parts):
        return False
    updated = getattr(cache, "is_updated", {})
    return len(updated) == len(parts[1].layers) and all(updated.values())
