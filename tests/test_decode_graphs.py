"""The captured decode step (fat5/generation_fat5.py), proven on CPU: a recorder stands in for the CUDA graph
(tests/graph_recorder.py) and fails on whatever a capture forbids, and its replays, which rerun the recorded ops
on the recorded tensors as a graph does, give the tokens of eager generation.

What runs here is what runs on a GPU: the model's capture-and-replay logic, the step FAT5 captures (SDPA and the
Triton decode kernel, the latter in Triton's interpreter), transformers' generate around it."""

import copy
import csv
import gc
import logging
import pickle
import sys
import weakref

import pytest
import torch
from graph_recorder import CaptureError, Recorder, recorded_kernels
from test_generation_cache import confident_model, padded_inputs

from fat5 import generation_fat5

NEW_TOKENS = 6
SEARCHES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, top_k=8),
            "beam": dict(num_beams=3, do_sample=False)}


@pytest.fixture(name="recorder")
def recorder_fixture(monkeypatch):
    """Decode steps on CPU captured by a Recorder; the list of those made."""
    monkeypatch.setitem(generation_fat5.GRAPH_CLASSES, "cpu", Recorder)
    monkeypatch.setattr(Recorder, "made", [])
    return Recorder.made


@pytest.fixture(name="decode_kernels")
def decode_kernels_fixture(monkeypatch):
    pytest.importorskip("triton")
    from fat5.kernels import decode_attention_t5

    with recorded_kernels(monkeypatch, decode_attention_t5, "_decode_chunk_kernel", "_decode_merge_kernel"):
        yield


def generate(model, search="greedy", seed=0, rows=3, **options):
    torch.manual_seed(seed)
    inputs = {name: tensor[:rows] for name, tensor in padded_inputs(model.device).items()}
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          cache_implementation="static", **SEARCHES[search], **options)


def eager_tokens(model, search="greedy", **options):
    """What generation gives without captured steps."""
    limit = model.config.decode_cuda_graphs
    model.config.decode_cuda_graphs = 0
    try:
        return generate(model, search, **options)
    finally:
        model.config.decode_cuda_graphs = limit


def replays(made):
    return sum(recorder.replays for recorder in made)


@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("position", ["t5", "rope", "alibi", "fire", "none"])
def test_captured_steps_give_the_eager_tokens(recorder, position, search):
    """Every position encoding and search: the first decode step is captured (its warm-up is that step), every
    later one replayed, and the tokens are eager generation's; a second call of the same shape captures nothing
    and replays every decode step after the prefill."""
    model = confident_model(position_encoding_type=position)
    expected = eager_tokens(model, search)
    assert not recorder
    assert torch.equal(generate(model, search), expected)
    assert len(recorder) == 1 and replays(recorder) == NEW_TOKENS - 2
    assert torch.equal(generate(model, search), expected)
    assert len(recorder) == 1 and replays(recorder) == (NEW_TOKENS - 2) + (NEW_TOKENS - 1)


@pytest.mark.parametrize("search", list(SEARCHES))
def test_the_decode_kernel_is_captured_with_the_eager_tokens(recorder, decode_kernels, kernel_device, search):
    """The Triton backend (interpreted on CPU): the decode kernel's launches are recorded and replayed, reading the
    static cache's position on the device."""
    model = confident_model(1, 2, d_kv=32, num_heads=2, attention_backend="triton").to(kernel_device)
    expected = eager_tokens(model, search)
    assert torch.equal(generate(model, search), expected)
    (graph,) = recorder
    assert any(what.startswith("Triton kernel _decode_chunk_kernel") for what, _ in graph.entries)


def test_the_recorder_refuses_what_a_capture_cannot_hold():
    """Each kind of step a CUDA capture cannot hold fails the recorder's capture, naming why; a step that reads a
    tensor freed since the capture, or one whose memory moved, fails its replay."""
    x = torch.arange(6.0)
    steps = {
        "reads a tensor on the host": lambda: x * x.sum().item(),
        "Tensor.cpu()": lambda: x.cpu() + 1,
        "Tensor.tolist()": lambda: torch.tensor(x.tolist()),
        "output shape depends": lambda: x[x > 2],
        "output shape depends ": lambda: x.nonzero(),
        "reads a tensor on the host ": lambda: x + 1 if bool(x.max() > 3) else x,
        "made from host data": lambda: x * torch.tensor([2.0]),
    }
    for message, step in steps.items():
        with pytest.raises(CaptureError, match=message.strip()):
            Recorder("cpu").capture(step)
    weight = torch.ones(6)
    graph = Recorder("cpu")
    out = graph.capture(lambda: x * weight)
    weight.mul_(2)  # in place: the graph reads the new values, as a CUDA graph does
    graph.replay()
    assert torch.equal(out, 2 * x)
    weight.data = torch.full((6,), 3.0)
    with pytest.raises(CaptureError, match="memory moved"):
        graph.replay()
    graph = Recorder("cpu")
    temporary = [torch.ones(6)]
    graph.capture(lambda: x * temporary[0])
    temporary.clear()  # freed since the capture
    gc.collect()
    with pytest.raises(CaptureError, match="freed since the capture"):
        graph.replay()


def test_a_capture_changes_nothing_outside_it():
    """As on a GPU the captured ops do not run at capture: a tensor from outside that the step changes in place is
    as it was, and each replay changes it once."""
    counter = torch.zeros((), dtype=torch.long)
    graph = Recorder("cpu")
    graph.capture(lambda: counter.add_(1))
    assert int(counter) == 0
    graph.replay()
    graph.replay()
    assert int(counter) == 2


def test_a_model_change_drops_the_captured_steps(recorder):
    """Weights changed in place are read by the replays (nothing to recapture); weights whose memory changed
    (`load_state_dict(assign=True)`, `.to()`), `train()` and a config change drop the steps, and the tokens
    follow the model."""
    model = confident_model()
    generate(model)
    assert len(recorder) == 1
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert torch.equal(generate(model), eager_tokens(model)) and len(recorder) == 1
    state = {name: tensor.clone() * 1.5 for name, tensor in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert torch.equal(generate(model), eager_tokens(model)) and len(recorder) == 2
    model.train().eval()
    assert not model.captured_decode_steps()
    generate(model)
    assert len(recorder) == 3
    model.to(torch.float64)
    assert not model.captured_decode_steps()
    # Two rows: a cache of the new dtype (transformers 4.57 reuses its static cache for the same batch, whatever
    # the model's dtype now).
    assert torch.equal(generate(model, rows=2), eager_tokens(model, rows=2)) and len(recorder) == 4
    model.config.attention_backend = "eager"
    assert torch.equal(generate(model, rows=2), eager_tokens(model, rows=2)) and len(recorder) == 5


def test_an_adapter_loaded_switched_or_disabled_drops_the_captured_steps(recorder):
    """PEFT's LoRA: loading it, disabling it and merging it each give a model whose replayed tokens are its
    eager ones."""
    peft = pytest.importorskip("peft")
    model = confident_model()
    base = eager_tokens(model)
    generate(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q", "v", "wo"], init_lora_weights=False))
    lora.eval()
    with_adapter = eager_tokens(lora.base_model.model)
    assert not torch.equal(with_adapter, base)
    assert torch.equal(generate(lora.base_model.model), with_adapter)
    with lora.disable_adapter():
        assert torch.equal(generate(lora.base_model.model), base)
    assert torch.equal(generate(lora.base_model.model), with_adapter)
    merged = lora.merge_and_unload()
    assert torch.equal(generate(merged), with_adapter)
    assert len(recorder) == 5  # the model, with the adapter, without, with again, merged


def test_a_failed_capture_runs_eagerly_with_one_warning(recorder, caplog):
    """A capture that fails (here: the step reads a tensor on the host) leaves generation eager, with one warning
    naming the cause, and nothing is captured for the model until it changes."""
    model = confident_model()
    norm = model.decoder.final_layer_norm

    class HostReadingNorm(type(norm)):
        def forward(self, states):
            return super().forward(states) * (1 + 0 * states.sum().item())

    norm.__class__ = HostReadingNorm
    expected = eager_tokens(model)
    with caplog.at_level(logging.WARNING, logger=generation_fat5.__name__):
        assert torch.equal(generate(model), expected)
        assert torch.equal(generate(model), expected)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "capturing the step failed (CaptureError: aten._local_scalar_dense" in warnings[0]
    assert len(recorder) == 1 and replays(recorder) == 0 and not model.captured_decode_steps()
    norm.__class__ = HostReadingNorm.__base__  # the model changed: its steps are captured again
    assert torch.equal(generate(model), expected) and len(recorder) == 2 and replays(recorder) > 0


def test_what_cannot_be_captured_runs_eagerly_with_one_warning(recorder, caplog):
    """Attention weights or hidden states of every step, and forward hooks (which a replay would not run): the
    steps run eagerly, each cause warned about once."""
    model = confident_model()
    expected = eager_tokens(model)
    with caplog.at_level(logging.WARNING, logger=generation_fat5.__name__):
        for _ in range(2):
            output = generate(model, output_attentions=True, return_dict_in_generate=True)
            assert torch.equal(output.sequences, expected) and len(output.cross_attentions) == NEW_TOKENS
        handle = model.decoder.block[0].register_forward_hook(lambda *args: None)
        assert torch.equal(generate(model), expected) and torch.equal(generate(model), expected)
        handle.remove()
    causes = [record.getMessage().split(": ", 1)[1] for record in caplog.records]
    assert causes == ["output_attentions asks for every step's attention weights",
                      "decoder.block.0 has forward hooks (or a wrapped forward), which a replayed step would not run"]
    assert not recorder
    assert torch.equal(generate(model), expected) and len(recorder) == 1  # the hook removed: captured


def test_the_least_recently_used_step_is_evicted(recorder):
    """At most config.decode_cuda_graphs steps are kept; each describes its bucket and the memory it holds."""
    model = confident_model()
    model.config.decode_cuda_graphs = 2
    inputs = padded_inputs()
    for rows in (3, 2, 3, 1, 2):
        model.generate(input_ids=inputs["input_ids"][:rows], attention_mask=inputs["attention_mask"][:rows],
                       max_new_tokens=4, min_new_tokens=4, cache_implementation="static")
    assert len(recorder) == 4  # 3, 2, (3 replayed), 1 evicts 2, 2 again
    steps = model.captured_decode_steps()
    assert [step["batch"] for step in steps] == [1, 2]
    heads, d_kv, layers = model.config.num_heads, model.config.d_kv, model.config.num_decoder_layers
    for step in steps:
        slots = step["cache_slots"] + step["encoder_length"]
        expected = 2 * layers * step["batch"] * heads * d_kv * slots * 4 / 2**20
        assert abs(step["cache_mib"] - expected) <= 0.1 + 0.01 * expected, (step, expected)
    model.release_decode_steps()
    assert not model.captured_decode_steps()


def test_decode_cuda_graphs_0_turns_capture_off(recorder):
    model = confident_model()
    model.config.decode_cuda_graphs = 0
    generate(model)
    assert not recorder and not model.captured_decode_steps()


def test_captured_steps_are_the_models_own(recorder):
    """Copies and pickles of a model start with no captured step, two models never share one, and a model's steps
    are freed with it."""
    model = confident_model()
    generate(model)
    assert len(model.captured_decode_steps()) == 1
    assert not copy.deepcopy(model).captured_decode_steps()
    assert not pickle.loads(pickle.dumps(model)).captured_decode_steps()
    other = confident_model()
    assert not other.captured_decode_steps()
    generate(other)
    assert len(recorder) == 2
    graph = weakref.ref(recorder[0])
    recorder.clear()
    del model
    gc.collect()
    assert graph() is None


def test_the_returned_logits_are_the_callers(recorder):
    """The graph rewrites its logits at every replay; what a forward returns stays as it was."""
    model = confident_model()
    generate(model)
    from transformers import EncoderDecoderCache, StaticCache

    from fat5.compat_fat5 import CACHE_NAME

    inputs = padded_inputs()
    cache = EncoderDecoderCache(StaticCache(model.config, max_cache_len=NEW_TOKENS + 1),
                                StaticCache(model.config, max_cache_len=inputs["input_ids"].shape[1]))
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
        steps = []
        for token in range(4):
            ids = torch.full((3, 1), 5 + token)
            steps.append(model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                               decoder_input_ids=ids, **{CACHE_NAME: cache}).logits)
        kept = [logits.clone() for logits in steps]
        model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
              decoder_input_ids=torch.full((3, 1), 9), **{CACHE_NAME: cache})
    assert replays(recorder) >= 2
    assert all(torch.equal(logits, copy) for logits, copy in zip(steps, kept))
    assert not torch.equal(steps[2], steps[3])


def test_get_compiled_call_replays_instead_of_compiling():
    """generate asks get_compiled_call for its decode steps where it would compile them (a static cache on CUDA):
    FAT5 answers with its own forward, which replays its captured steps; a compile_config, or the captured step
    turned off, gets transformers' compiled call."""
    from transformers import CompileConfig

    model = confident_model()
    assert model.get_compiled_call(None) == model.__call__
    assert model.get_compiled_call(CompileConfig()) != model.__call__
    model.config.decode_cuda_graphs = 0
    assert model.get_compiled_call(None) != model.__call__


def test_no_capture_while_torch_compile_traces(recorder):
    """A forward compiled by torch.compile traces the eager step (the static+compile path): nothing is captured."""
    model = confident_model()
    expected = eager_tokens(model)
    torch._dynamo.reset()
    original = model.forward
    model.forward = torch.compile(original, backend="eager", dynamic=False)
    try:
        assert torch.equal(generate(model), expected)
    finally:
        model.forward = original
    assert not recorder


def test_the_demo_pipeline_and_predict_reach_the_captured_step(recorder, tmp_path, monkeypatch):
    """`pipeline` (FAT5's text2text pipeline) and the recipes' predict generate through the captured step when the
    model's generation config asks for a static cache, with eager generation's answers."""
    pytest.importorskip("datasets")
    from pathlib import Path

    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from fat5.convert.checkpoint import fat5_config_from_t5
    from fat5.convert.demo import DEMO_CHECKPOINT
    from fat5.modeling_fat5 import FAT5ForConditionalGeneration
    from fat5.recipes import predict

    demo = Path(DEMO_CHECKPOINT)
    t5 = T5ForConditionalGeneration.from_pretrained(demo)
    model = FAT5ForConditionalGeneration(fat5_config_from_t5(t5.config.to_dict(), lm_head_tied=False)).eval()
    model.load_state_dict(t5.state_dict(), strict=False)
    tokenizer = AutoTokenizer.from_pretrained(demo)
    prompts = ["reverse: the cat sat on the mat", "spell out: 347", "sort: pear apple fig"]
    pipe = model.text2text_pipeline(tokenizer)
    expected = [output["generated_text"] for output in pipe(prompts, max_new_tokens=12)]
    answers = [output["generated_text"] for output in pipe(prompts, max_new_tokens=12, cache_implementation="static")]
    assert answers == expected and recorder and replays(recorder) > 0
    model.generation_config.cache_implementation = "static"
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "inputs.csv").write_text("source\n" + "\n".join(prompts) + "\n")
    argv = ["--model", str(tmp_path / "model"), "--input_file", str(tmp_path / "inputs.csv"), "--output_file",
            str(tmp_path / "out.csv"), "--max_new_tokens", "12", "--batch_size", "3", "--device", "cpu"]
    assert predict.main(argv) == 0
    # transformers 4.57 runs the folder's own copy of the code (trust_remote_code): its recorder too.
    for name, module in list(sys.modules.items()):
        if name.endswith(".generation_fat5") and module is not generation_fat5:
            monkeypatch.setitem(module.GRAPH_CLASSES, "cpu", Recorder)
    made = len(recorder)
    assert predict.main(argv) == 0
    with open(tmp_path / "out.csv") as file:
        assert [row["prediction"] for row in csv.DictReader(file)] == [text.strip() for text in expected]
    assert len(recorder) > made


def test_steps_captured_under_inference_mode_replay_outside_it(recorder):
    """A step captured under torch.inference_mode (its tensors inference tensors) serves later generations outside
    it, and the other way round."""
    model = confident_model()
    expected = eager_tokens(model)
    with torch.inference_mode():
        assert torch.equal(generate(model), expected)
    assert torch.equal(generate(model), expected)
    model.release_decode_steps()
    assert torch.equal(generate(model), expected)
    with torch.inference_mode():
        assert torch.equal(generate(model), expected)
    assert len(recorder) == 2 and replays(recorder) == 2 * (NEW_TOKENS - 2) + 2 * (NEW_TOKENS - 1)


def test_the_cuda_capture_calls_torch_as_its_api_says(monkeypatch):
    """CUDAGraphStep, which only a GPU runs, checked here against torch's own signatures: torch.cuda's functions
    replaced by fakes that bind every call to the real one's signature and record it. The warm-up runs on the side
    stream after it waited for the current one (which then waits for it), the capture records on that same side
    stream, and every call runs under the model's device."""
    import inspect

    calls = []

    class Context:
        def __init__(self, name, *args):
            self.name, self.args = name, args

        def __enter__(self):
            calls.append(("enter", self.name, *self.args))

        def __exit__(self, *exc):
            calls.append(("exit", self.name))

    def checked(name, result):
        real = getattr(torch.cuda, name)

        def fake(*args, **kwargs):
            inspect.signature(real.__init__ if inspect.isclass(real) else real).bind(
                *((None,) if inspect.isclass(real) else ()), *args, **kwargs)
            calls.append((name, *args, *kwargs.values()))
            return result(*args, **kwargs)
        monkeypatch.setattr(torch.cuda, name, fake)

    wait_stream = inspect.signature(torch.cuda.Stream.wait_stream)

    class Stream:
        def wait_stream(self, other):
            wait_stream.bind(self, other)
            calls.append(("wait_stream", self, other))

    class Graph:
        def replay(self):
            calls.append(("replay",))

    side, current = Stream(), Stream()
    checked("CUDAGraph", lambda: Graph())
    checked("Stream", lambda device: side)
    checked("current_stream", lambda device=None: current)
    checked("stream", lambda stream: Context("stream", stream))
    checked("device", lambda device: Context("device", device))
    checked("graph", lambda cuda_graph, stream=None, **kwargs: Context("graph", stream))
    checked("memory_reserved", lambda device=None: 1000 * (1 + len(calls)))
    device = torch.device("cuda", 1)
    step = generation_fat5.CUDAGraphStep(device)
    assert step.warm_up(lambda: calls.append("step") or "logits") == "logits"
    assert step.capture(lambda: calls.append("step") or "graph's logits") == "graph's logits"
    step.replay()
    names = [call if isinstance(call, str) else call[:2] for call in calls]
    assert names == [
        ("CUDAGraph",), ("Stream", device), ("current_stream", device), ("wait_stream", side),
        ("device", device), ("enter", "device"), ("stream", side), ("enter", "stream"), "step", ("exit", "stream"),
        ("exit", "device"), ("wait_stream", current),
        ("device", device), ("enter", "device"), ("graph", step.graph), ("enter", "graph"), ("memory_reserved", device),
        "step", ("exit", "graph"), ("exit", "device"), ("memory_reserved", device),
        ("device", device), ("enter", "device"), ("replay",), ("exit", "device")], names
    assert ("graph", step.graph, side) in calls and ("stream", side) in calls and step.pool_bytes > 0
