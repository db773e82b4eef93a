"""FAT5 as a drop-in for transformers' T5: what transformers' ModelTesterMixin / GenerationTesterMixin check on T5,
checked on FAT5 (docs/using.md, "How FAT5 differs from transformers' T5", says which checks do not apply and why).
Where T5 answers the same question, T5 built from the same config is the spec."""

import copy

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForTextEncoding,
    CompileConfig,
    PreTrainedModel,
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5Model,
)

import fat5
from fat5 import FAT5ForConditionalGeneration
from fat5.compat_fat5 import CACHE_NAME, output_cache
from t5_twins import (
    EAGER,
    SHAPES,
    T5_OF,
    TRANSFORMERS_5,
    VOCAB,
    build,
    close,
    generate_inputs,
    inputs_for,
    needs_transformers_5,
    run,
)


def field_lengths(output):
    """{field: number of entries (tuples) or shape (tensors)} of the fields an output sets; an empty tuple counts
    as unset (T5's encoder stack reports cross_attentions=() and has none)."""
    lengths = {}
    for name, value in output.items():
        if isinstance(value, tuple) and not value:
            continue
        lengths[name] = len(value) if isinstance(value, tuple) else tuple(getattr(value, "shape", ()))
    return lengths


FLAG_CASES = [
    pytest.param({"output_attentions": True, **EAGER}, {}, id="attentions-from-config"),
    pytest.param({"output_hidden_states": True}, {}, id="hidden-states-from-config"),
    pytest.param({"output_attentions": True, "output_hidden_states": True, **EAGER}, {"output_attentions": False},
                 id="argument-over-config"),
    pytest.param({**EAGER}, {"output_attentions": True}, id="argument-alone"),
]


@pytest.mark.parametrize("config_flags, arguments", FLAG_CASES)
@pytest.mark.parametrize("model_class", list(T5_OF), ids=lambda cls: cls.__name__)
def test_output_flags_fall_back_to_the_config_as_in_t5(model_class, config_flags, arguments):
    fat5_fields = field_lengths(run(build(model_class, **config_flags), **arguments))
    t5_fields = field_lengths(run(build(T5_OF[model_class], **config_flags), **arguments))
    keys = {"hidden_states", "attentions", "encoder_hidden_states", "encoder_attentions", "decoder_hidden_states",
            "decoder_attentions", "cross_attentions"}
    t5_outputs = {name: value for name, value in t5_fields.items() if name in keys}
    if T5_OF[model_class] is T5EncoderModel and model_class is not fat5.FAT5EncoderModel:
        assert {name: value for name, value in fat5_fields.items() if name in keys} == t5_outputs
    else:
        assert fat5_fields == t5_fields


@pytest.mark.parametrize("stack_name", ["encoder", "decoder"])
@pytest.mark.parametrize("config_flags, arguments", FLAG_CASES)
def test_stacks_called_alone_fall_back_to_the_config_as_in_t5(stack_name, config_flags, arguments):
    wants_attentions = arguments.get("output_attentions", config_flags.get("output_attentions"))
    if stack_name == "decoder" and wants_attentions and not TRANSFORMERS_5:
        pytest.skip("transformers 4.57's T5 decoder stack alone raises IndexError collecting cross-attentions")
    ids = inputs_for(fat5.FAT5Model)["input_ids"]
    outputs = {}
    for model_class in (fat5.FAT5Model, T5Model):
        stack = getattr(build(model_class, **config_flags), f"get_{stack_name}")()
        with torch.no_grad():
            outputs[model_class] = field_lengths(stack(input_ids=ids, **arguments))
    # FAT5's decoder caches one layer list per attention kind, T5's cache reports its own length: compare presence.
    ours, t5 = ({name: value for name, value in fields.items() if name != CACHE_NAME}
                for fields in outputs.values())
    assert ours == t5
    assert (CACHE_NAME in outputs[fat5.FAT5Model]) == (CACHE_NAME in outputs[T5Model])


@pytest.mark.parametrize("use_cache, argument, expected", [(True, None, True), (False, None, False),
                                                           (False, True, True), (True, False, False)])
def test_decoder_stack_alone_caches_as_t5(use_cache, argument, expected):
    ids = inputs_for(fat5.FAT5Model)["input_ids"]
    for model_class in (fat5.FAT5Model, T5Model):
        decoder = build(model_class, use_cache=use_cache).get_decoder()
        with torch.no_grad():
            output = decoder(input_ids=ids, use_cache=argument)
        assert (output_cache(output) is not None) == expected, model_class.__name__


@pytest.mark.parametrize("model_class", list(T5_OF), ids=lambda cls: cls.__name__)
def test_return_dict_falls_back_to_the_config(model_class):
    """config.return_dict=False gives the tuple of the set fields. (transformers 5.23's T5Model,
    T5ForConditionalGeneration and T5ForTokenClassification fail on that config, their stacks returning tuples
    to their own forward, so T5 is no spec here; T5EncoderModel is.)"""
    model = build(model_class, return_dict=False)
    output = run(model)
    as_dict = run(model, return_dict=True)
    assert isinstance(output, tuple) and not isinstance(as_dict, tuple)
    assert len(output) == len(as_dict.to_tuple())
    for value, expected in zip(output, as_dict.to_tuple(), strict=True):
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, expected)
    if model_class is fat5.FAT5EncoderModel:
        assert len(output) == len(run(build(T5EncoderModel, return_dict=False)))


@pytest.mark.parametrize("stack_name", ["encoder", "decoder"])
def test_stacks_return_tuples_when_the_config_says_so(stack_name):
    ids = inputs_for(fat5.FAT5Model)["input_ids"]
    lengths = []
    for model_class in (fat5.FAT5Model, T5Model):
        stack = getattr(build(model_class, return_dict=False), f"get_{stack_name}")()
        with torch.no_grad():
            output = stack(input_ids=ids)
        assert isinstance(output, tuple)
        lengths.append(len(output))
    assert lengths[0] == lengths[1]


def test_encoder_stack_refuses_a_cache_as_t5():
    ids = inputs_for(fat5.FAT5Model)["input_ids"]
    for model_class in (fat5.FAT5Model, T5Model):
        with pytest.raises(ValueError, match="use_cache"):
            build(model_class).get_encoder()(input_ids=ids, use_cache=True)


def describe(found, model):
    """What get_encoder returned, in words that compare across FAT5 and T5 (T5's token-classification head keeps
    its encoder under `transformer`)."""
    if found is model:
        return "the model itself"
    return "encoder" if type(found).__name__ in ("FAT5Stack", "T5Stack") else type(found).__name__


@needs_transformers_5
@pytest.mark.parametrize("model_class", list(T5_OF), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("modality", [None, "image", "video", "audio", "text"])
def test_get_encoder_takes_a_modality_as_t5(model_class, modality):
    results = []
    for cls in (model_class, T5_OF[model_class]):
        model = build(cls)
        try:
            results.append(describe(model.get_encoder(modality=modality), model))
        except ValueError:
            results.append("ValueError")
    assert results[0] == results[1]
    assert results[0] == ("encoder" if modality is None else "ValueError" if modality == "text"
                          else "the model itself")


@pytest.mark.parametrize("model_class", [fat5.FAT5Model, FAT5ForConditionalGeneration])
def test_export_helpers_see_one_text_model_as_for_t5(model_class):
    model = build(model_class)
    assert model.get_decoder() is model.decoder
    is_multimodal = pytest.importorskip("transformers.exporters.utils").is_multimodal  # transformers 5 only
    assert not is_multimodal(model)
    assert not is_multimodal(build(T5_OF[model_class]))


def test_capabilities_are_declared():
    """The flags transformers and its test suites read: FAT5 has SDPA/eager switching and full-graph compile,
    and not transformers' flash-attention or flex integrations (it runs its own kernel)."""
    assert FAT5ForConditionalGeneration._supports_sdpa
    assert FAT5ForConditionalGeneration._can_compile_fullgraph
    assert not FAT5ForConditionalGeneration._supports_flash_attn
    assert not FAT5ForConditionalGeneration._supports_flex_attn
    assert FAT5ForConditionalGeneration._can_set_attn_implementation()
    assert FAT5ForConditionalGeneration._supports_default_dynamic_cache()


@pytest.mark.parametrize("model_class", list(T5_OF), ids=lambda cls: cls.__name__)
def test_attention_switches_as_transformers_checks_it(model_class):
    """transformers' test_can_set_attention_dynamically, on every FAT5 model and submodel."""
    model = build(model_class, attn_implementation="eager")
    configs = [module.config for module in model.modules() if isinstance(module, PreTrainedModel)]
    assert all(config._attn_implementation == "eager" for config in configs)
    assert all(module._can_set_attn_implementation() and module._supports_sdpa
               for module in model.modules() if isinstance(module, PreTrainedModel))
    model.set_attn_implementation("sdpa")
    assert all(config._attn_implementation == "sdpa" for config in configs)
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        model.set_attn_implementation("foo")
    assert all(config._attn_implementation == "sdpa" for config in configs)
    model.set_attn_implementation("eager")
    assert all(config._attn_implementation == "eager" for config in configs)


def test_generate_compiles_the_decode_step_through_transformers():
    """transformers' test_generate_compile_model_forward_fullgraph: generate() compiles the forward with a static
    cache (forced on CPU) and gives the tokens of the uncompiled dynamic cache. The "eager" backend runs Dynamo
    with fullgraph=True (any graph break is an error) without Inductor's slow C++ build."""
    torch._dynamo.reset()
    model = build(FAT5ForConditionalGeneration)
    inputs = generate_inputs()
    arguments = dict(max_new_tokens=4, do_sample=False, min_new_tokens=4)
    dynamic = model.generate(**inputs, **arguments)
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    compile_config._compile_all_devices = True
    compiled = model.generate(**inputs, **arguments, cache_implementation="static", compile_config=compile_config)
    assert getattr(model, "_compiled_call", None) is not None  # transformers did compile
    assert torch.equal(compiled, dynamic)


def test_dynamically_quantized_model_generates():
    model = build(FAT5ForConditionalGeneration)
    inputs = inputs_for(FAT5ForConditionalGeneration)
    decoder_input_ids = inputs.pop("decoder_input_ids")
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        reference = model(**inputs, decoder_input_ids=decoder_input_ids).logits
        logits = quantized(**inputs, decoder_input_ids=decoder_input_ids).logits
    # int8 weights: close to the float model, not equal.
    assert (logits - reference).norm() < 0.1 * reference.norm()
    tokens = quantized.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert tokens.shape == (2, 4)
    beams = quantized.generate(**inputs, max_new_tokens=3, min_new_tokens=3, num_beams=2, do_sample=False)
    assert beams.shape == (2, 4)


def embedding_names(names):
    return [name for name in names if "embed_tokens" in name or name.startswith("shared")]


@pytest.mark.parametrize("model_class", [fat5.FAT5Model, FAT5ForConditionalGeneration, fat5.FAT5EncoderModel])
def test_stacks_are_models_owning_the_shared_embedding(model_class):
    model = build(model_class)
    t5_twin = build(T5_OF[model_class])
    for name in ("encoder", "decoder"):
        stack = getattr(model, name, None)
        if stack is None:
            continue
        assert isinstance(stack, PreTrainedModel)
        assert stack.get_input_embeddings().weight is model.shared.weight
        assert dict(stack.named_children())["embed_tokens"].weight is model.shared.weight
        assert stack.dtype == torch.float32 and stack.device.type == "cpu"
        moved = copy.deepcopy(stack).to(torch.float64)
        assert moved.get_input_embeddings().weight.dtype == torch.float64
    # One Parameter under the names T5's state dict has (accelerate's offload hooks look each one up), a module per
    # stack as in transformers 5's T5 (4.57's T5 lists one module under `shared`), one parameter to train.
    assert embedding_names(model.state_dict()) == embedding_names(t5_twin.state_dict())
    stacks = [name for name in ("encoder", "decoder") if hasattr(model, name)]
    assert embedding_names(name for name, _ in model.named_modules()) == \
        ["shared", *(f"{name}.embed_tokens" for name in stacks)]
    if TRANSFORMERS_5:
        assert embedding_names(name for name, _ in model.named_modules()) == \
            embedding_names(name for name, _ in t5_twin.named_modules())
    assert embedding_names(name for name, _ in model.named_parameters()) == ["shared.weight"]
    new_embedding = nn.Embedding(VOCAB + 8, SHAPES["d_model"])
    model.set_input_embeddings(new_embedding)
    assert model.encoder.get_input_embeddings() is new_embedding


def test_saved_files_keep_t5_names_and_loading_ties_again(tmp_path):
    from safetensors import safe_open

    for tied in (False, True):
        model = build(FAT5ForConditionalGeneration, tie_word_embeddings=tied)
        folder = tmp_path / f"tied-{tied}"
        model.save_pretrained(folder)
        with safe_open(folder / "model.safetensors", "pt") as saved:
            names = set(saved.keys())
        assert "shared.weight" in names and not [name for name in names if "embed_tokens" in name]
        assert ("lm_head.weight" in names) != tied
        loaded = FAT5ForConditionalGeneration.from_pretrained(folder).eval()
        assert loaded.encoder.embed_tokens.weight is loaded.shared.weight
        assert loaded.decoder.embed_tokens.weight is loaded.shared.weight
        assert (loaded.lm_head.weight is loaded.shared.weight) == tied
        assert torch.equal(run(loaded).logits, run(model).logits)


def shifted(model):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    return model


def test_state_dict_round_trip_through_plain_torch():
    model = build(FAT5ForConditionalGeneration)
    other = shifted(build(FAT5ForConditionalGeneration, num_decoder_layers=3))
    other.load_state_dict(model.state_dict())
    assert other.encoder.embed_tokens.weight is other.shared.weight
    assert torch.equal(other.shared.weight, model.shared.weight)
    # A state dict that names the embedding once (FAT5's before the stacks' names appeared, or a checkpoint file's
    # tensors) loads strictly too, the stacks' names filled from shared.weight; so does one loaded with assign=True.
    once = {name: tensor for name, tensor in model.state_dict().items() if "embed_tokens" not in name}
    for assign in (False, True):
        again = shifted(build(FAT5ForConditionalGeneration))
        again.load_state_dict({name: tensor.clone() for name, tensor in once.items()}, assign=assign)
        assert again.decoder.embed_tokens.weight is again.shared.weight
        assert torch.equal(run(again).logits, run(model).logits)


def encoder_and_inputs():
    model = build(fat5.FAT5EncoderModel, attention_backend="sdpa")
    inputs = inputs_for(fat5.FAT5EncoderModel)
    with torch.no_grad():
        expected = model.get_encoder()(**inputs).last_hidden_state
    return model.get_encoder(), inputs, expected


def test_encoder_exports_with_strict_torch_export():
    encoder, inputs, expected = encoder_and_inputs()
    program = torch.export.export(encoder, (), kwargs=inputs, strict=True)
    output = program.module()(**inputs)
    assert close(output.last_hidden_state, expected)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_the_seq2seq_model_exports_with_torch_export(strict):
    """What docs/using.md points to for a graph of the whole model (transformers 4.57's `utils.fx.symbolic_trace`
    traces only transformers' own classes, and FX cannot follow FAT5's input checks)."""
    model = build(FAT5ForConditionalGeneration, attention_backend="sdpa")
    inputs = {**inputs_for(FAT5ForConditionalGeneration), "use_cache": False}
    program = torch.export.export(model, (), kwargs=inputs, strict=strict)
    with torch.no_grad():
        assert close(program.module()(**inputs).logits, model(**inputs).logits)


def test_encoder_traces_with_torch_jit():
    encoder, inputs, expected = encoder_and_inputs()
    traced = torch.jit.trace(encoder, example_kwarg_inputs=inputs, strict=False)
    output = traced(**inputs)
    assert close(output["last_hidden_state"], expected)


def test_encoder_exports_to_onnx_with_the_torchscript_exporter(tmp_path):
    pytest.importorskip("onnx")  # torch.onnx.export writes through it
    onnxruntime = pytest.importorskip("onnxruntime")
    encoder, inputs, expected = encoder_and_inputs()
    path = tmp_path / "encoder.onnx"
    axes = {0: "batch", 1: "length"}
    torch.onnx.export(encoder, (inputs["input_ids"], inputs["attention_mask"]), path, dynamo=False,
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_axes={"input_ids": axes, "attention_mask": axes})
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})
    assert close(torch.from_numpy(output), expected, relative=1e-4)


@pytest.fixture(scope="module")
def seq2seq_folder(tmp_path_factory):
    from transformers import AutoTokenizer

    from fat5.convert.demo import DEMO_CHECKPOINT

    folder = tmp_path_factory.mktemp("seq2seq")
    build(FAT5ForConditionalGeneration, vocab_size=AutoTokenizer.from_pretrained(DEMO_CHECKPOINT).vocab_size + 28
          ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO_CHECKPOINT).save_pretrained(folder)
    return folder


def test_auto_model_for_text_encoding_loads_the_encoder_of_a_seq2seq_folder(seq2seq_folder):
    encoder = AutoModelForTextEncoding.from_pretrained(seq2seq_folder, trust_remote_code=True)
    full = FAT5ForConditionalGeneration.from_pretrained(seq2seq_folder)
    assert type(encoder).__name__ == "FAT5EncoderModel"
    full_encoder = full.encoder.state_dict()
    for name, tensor in encoder.encoder.state_dict().items():
        assert torch.equal(tensor, full_encoder[name]), name


def targeted_modules(model, peft_config):
    from peft import get_peft_model

    return set(get_peft_model(model, peft_config).base_model.targeted_module_names)


@pytest.mark.parametrize("method", ["lora", "ia3", "adalora"])
def test_peft_methods_work_without_target_modules_as_for_t5(method):
    peft = pytest.importorskip("peft")
    configs = {
        "lora": lambda: peft.LoraConfig(task_type="SEQ_2_SEQ_LM"),
        "ia3": lambda: peft.IA3Config(task_type="SEQ_2_SEQ_LM"),
        "adalora": lambda: peft.AdaLoraConfig(task_type="SEQ_2_SEQ_LM", total_step=10),
    }
    ours = targeted_modules(build(FAT5ForConditionalGeneration), configs[method]())
    t5 = targeted_modules(build(T5ForConditionalGeneration), configs[method]())
    assert ours and ours == t5


def test_peft_targets_the_stacks_embeddings_as_in_t5():
    """`target_modules=["embed_tokens"]` wraps both stacks' embeddings, as for transformers 5's T5 (4.57's T5 shares
    one module under the name `shared`, so PEFT finds none there); the adapter starts as the identity and trains."""
    peft = pytest.importorskip("peft")
    lora = lambda: peft.LoraConfig(target_modules=["embed_tokens"])  # noqa: E731
    model = build(FAT5ForConditionalGeneration)
    expected = run(model).logits
    wrapped = peft.get_peft_model(model, lora())
    assert set(wrapped.base_model.targeted_module_names) == {"encoder.embed_tokens", "decoder.embed_tokens"}
    if TRANSFORMERS_5:
        assert set(wrapped.base_model.targeted_module_names) == targeted_modules(build(T5ForConditionalGeneration),
                                                                                  lora())
    with torch.no_grad():
        assert torch.equal(wrapped(**inputs_for(FAT5ForConditionalGeneration)).logits, expected)
    wrapped.train()
    wrapped(**inputs_for(FAT5ForConditionalGeneration)).logits.sum().backward()
    adapters = [parameter for name, parameter in wrapped.named_parameters() if "lora_embedding" in name]
    assert len(adapters) == 4 and all(parameter.grad is not None for parameter in adapters)


def test_hooks_on_the_input_embeddings_see_every_stacks_lookups():
    """NEFTune, transformers 4.57's enable_input_require_grads and accelerate's offload of `shared` hook the module
    `get_input_embeddings()` returns: the stacks' embeddings run through it."""
    model = build(FAT5ForConditionalGeneration)
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: calls.append(output.shape))
    run(model)
    assert calls == [(2, 6, SHAPES["d_model"]), (2, 4, SHAPES["d_model"])]


def generate_structure(model, **arguments):
    """Shapes of what generate returns with every output flag on: {field: per-step / per-layer shapes}."""
    inputs = generate_inputs()
    output = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, return_dict_in_generate=True,
                            output_scores=True, output_logits=True, output_attentions=True,
                            output_hidden_states=True, **arguments)

    def shapes(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        if isinstance(value, tuple):
            return [shapes(item) for item in value]
        return type(value).__name__

    return {name: shapes(value) for name, value in output.items() if name != CACHE_NAME}


@pytest.mark.parametrize("arguments", [{"do_sample": False}, {"do_sample": True, "num_return_sequences": 2},
                                       {"num_beams": 2, "do_sample": False}],
                         ids=["greedy", "sample", "beam"])
def test_generate_returns_what_t5_returns(arguments):
    """GenerationTesterMixin's output checks: scores, logits, attentions and hidden states of every step, with the
    same shapes as T5's. (Equal depths: transformers 5.23's T5 fails here when its decoder is deeper than
    its encoder; FAT5 does not, see test_generation_cache.py.)"""
    structures = [generate_structure(build(model_class, num_decoder_layers=2, **EAGER), **arguments)
                  for model_class in (FAT5ForConditionalGeneration, T5ForConditionalGeneration)]
    assert structures[0] == structures[1]
@needs_transformers_5
def test_generate_from_inputs_embeds_and_with_an_assistant_gives_the_greedy_tokens():
    model = build(FAT5ForConditionalGeneration)
    inputs = generate_inputs()
    arguments = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    greedy = model.generate(**inputs, **arguments)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], **arguments)
    assert torch.equal(from_embeds, greedy)
    first = {name: tensor[:1] for name, tensor in inputs.items()}
    assisted = model.generate(**first, assistant_model=build(FAT5ForConditionalGeneration), **arguments)
    assert torch.equal(assisted, greedy[:1])
