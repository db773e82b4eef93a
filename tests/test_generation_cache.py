"""generate() with every cache transformers offers: static gives the dynamic cache's tokens (greedy, beam, padded
batches, every position encoding, encoder and decoder of different depths) and compiles; cross-attention keys
and values are computed once per generation."""


import pytest
import torch

from conftest import TINY_CONFIG, tiny_config
from fat5.modeling_fat5 import FAT5ForConditionalGeneration

POSITION_TYPES = ["t5", "rope", "alibi", "fire", "none"]
VOCAB = 61


def confident_model(num_layers=2, num_decoder_layers=2, **overrides):
    """A tiny model whose random weights are large enough that its greedy choices are not near-ties (T5's
    initialisation makes a fresh model emit one token forever, which would prove nothing)."""
    config = tiny_config(vocab_size=VOCAB, num_layers=num_layers, num_decoder_layers=num_decoder_layers, **overrides)
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.6)
    return model


def padded_inputs(device="cpu"):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, VOCAB, (3, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # right padding
    attention_mask[2, :3] = 0  # left padding
    return dict(input_ids=input_ids.masked_fill(attention_mask == 0, 0).to(device),
                attention_mask=attention_mask.to(device))


def generate(model, **options):
    return model.generate(**padded_inputs(), max_new_tokens=8, min_new_tokens=8, **options)


def assert_varied(tokens):
    # A test on one repeated token would pass with a broken cache.
    assert tokens[:, 1:].unique().numel() >= 4, tokens


@pytest.mark.parametrize("position", POSITION_TYPES)
@pytest.mark.parametrize("search", [dict(do_sample=False), dict(num_beams=3, do_sample=False)],
                         ids=["greedy", "beam"])
def test_static_cache_gives_the_dynamic_cache_tokens(position, search):
    model = confident_model(position_encoding_type=position)
    dynamic = generate(model, **search)
    assert_varied(dynamic)
    assert torch.equal(generate(model, **search, cache_implementation="static"), dynamic)


@pytest.mark.parametrize("depths", [(1, 4), (4, 1)], ids=["shallow-encoder", "shallow-decoder"])
def test_encoder_and_decoder_of_different_depths_generate_with_every_cache(depths):
    model = confident_model(*depths)
    assert model.config.get_text_config(decoder=True).num_hidden_layers == depths[1]
    assert model.config.num_hidden_layers == depths[0]  # the config itself is unchanged
    for search in (dict(), dict(num_beams=3)):
        expected = generate(model, use_cache=False, **search)  # no cache: nothing sized from the config
        assert_varied(expected)
        for cache in ("dynamic", "static"):
            assert torch.equal(generate(model, **search, cache_implementation=cache), expected), (search, cache)


def test_decoder_takes_transformers_4d_causal_mask():
    """A dense (batch, 1, queries, keys) mask, as transformers builds for static caches, means its padding."""
    model = confident_model()
    inputs = padded_inputs()
    decoder_input_ids = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    decoder_mask = torch.ones_like(decoder_input_ids)
    decoder_mask[0, 3:] = 0
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    dense = causal[None, None] & decoder_mask.bool()[:, None, None, :]
    with torch.no_grad():
        expected = model(**inputs, decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_mask).logits
        for mask in (dense, torch.where(dense, 0.0, torch.finfo(torch.float32).min)):
            actual = model(**inputs, decoder_input_ids=decoder_input_ids, decoder_attention_mask=mask).logits
            scale = expected.abs().max()
            assert ((actual - expected)[:, :3].abs().max() <= 1e-6 * scale), mask.dtype


def test_cross_attention_keys_and_values_are_computed_once_per_generation():
    model = confident_model(num_decoder_layers=3)
    calls = []
    for block in model.decoder.block:
        cross = block.layer[1].EncDecAttention
        for projection in (cross.k, cross.v):
            projection.register_forward_hook(lambda module, args, output: calls.append(module))
    for cache in (dict(), dict(cache_implementation="static")):
        for search in (dict(), dict(num_beams=3)):
            calls.clear()
            generate(model, **cache, **search)
            # one call per projection and decoder layer, not one per generated token
            assert len(calls) == 2 * 3, (cache, search)


def test_static_cache_decoding_compiles_without_graph_breaks():
    """The decode step (one token, static cache) traces as one graph: what transformers compiles."""
    model = confident_model()
    eager_tokens = generate(model, cache_implementation="static")
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False)
    decode_steps = []

    def forward(*args, **kwargs):
        if kwargs["decoder_input_ids"].shape[1] == 1 and kwargs.get("encoder_outputs") is not None:
            decode_steps.append(1)
            return compiled(*args, **kwargs)
        return original(*args, **kwargs)

    original = model.forward
    model.forward = forward
    try:
        assert torch.equal(generate(model, cache_implementation="static"), eager_tokens)
    finally:
        model.forward = original
    assert decode_steps


def test_static_cache_with_the_triton_kernel_gives_the_eager_tokens(kernel_device):
    """The kernel (interpreted on CPU) takes a static cache's offset, which is a tensor, as a scalar."""
    model = confident_model(1, 1, d_kv=32, num_heads=2).to(kernel_device)
    inputs = dict(**padded_inputs(kernel_device), max_new_tokens=3, min_new_tokens=3)
    model.config.attention_backend = "eager"
    expected = model.generate(**inputs)
    model.config.attention_backend = "triton"
    assert torch.equal(model.generate(**inputs, cache_implementation="static"), expected)


def test_a_static_cross_attention_cache_longer_than_the_encoder_input_gives_t5s_tokens():
    """A StaticCache built for longer inputs (reused, or sized for the longest prompt) has more cross-attention slots
    than the encoder has tokens: the slots no encoder token fills are masked out, and FAT5 generates the tokens
    transformers' T5 (the same weights) generates with a cache of the encoder's length. (T5 itself attends to the
    empty slots, which changes its logits, or fails on its mask's length when the batch is padded.)"""
    from transformers import EncoderDecoderCache, StaticCache, T5Config, T5ForConditionalGeneration

    from fat5.compat_fat5 import CACHE_NAME
    from fat5.convert.checkpoint import fat5_config_from_t5

    t5_config = T5Config(**{**TINY_CONFIG, "vocab_size": VOCAB}, decoder_start_token_id=0, pad_token_id=0,
                         eos_token_id=1, attn_implementation="eager")
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(t5_config).eval()
    with torch.no_grad():  # confident, as confident_model's
        for parameter in t5.parameters():
            parameter.copy_(torch.empty_like(parameter).uniform_(0.5, 1.5) if parameter.dim() == 1
                            else torch.empty_like(parameter).normal_(0.0, 0.6))
    model = FAT5ForConditionalGeneration(fat5_config_from_t5(t5_config.to_dict(), lm_head_tied=False)).eval()
    model.load_state_dict(t5.state_dict())
    expected = generate(t5)
    assert_varied(expected)
    encoder_length = padded_inputs()["input_ids"].shape[1]
    for slots in (encoder_length, encoder_length + 7):
        cache = EncoderDecoderCache(StaticCache(model.config, max_cache_len=32),
                                    StaticCache(model.config, max_cache_len=slots))
        assert torch.equal(generate(model, **{CACHE_NAME: cache}), expected), slots
    # Unpadded and without an attention mask: the empty slots are masked all the same.
    unpadded = {"input_ids": padded_inputs()["input_ids"][:1]}
    long_cache = EncoderDecoderCache(StaticCache(model.config, max_cache_len=32),
                                     StaticCache(model.config, max_cache_len=encoder_length + 7))
    assert torch.equal(model.generate(**unpadded, max_new_tokens=8, min_new_tokens=8, **{CACHE_NAME: long_cache}),
                       t5.generate(**unpadded, max_new_tokens=8, min_new_tokens=8))
    too_short = EncoderDecoderCache(StaticCache(model.config, max_cache_len=32),
                                    StaticCache(model.config, max_cache_len=encoder_length - 1))
    with pytest.raises(ValueError, match="fewer than the 9 encoder tokens"):
        generate(model, **{CACHE_NAME: too_short})


def kernel_model(kernel_device, **overrides):
    """A confident model whose heads the Triton kernels take (d_kv 32)."""
    return confident_model(1, 1, d_kv=32, num_heads=2, **overrides).to(kernel_device)


def decode_kernel_calls(monkeypatch):
    """A list that grows by one for every call of the decode kernel's op."""
    from fat5.kernels import decode_attention_t5

    calls, original = [], decode_attention_t5._decode_attention
    monkeypatch.setattr(decode_attention_t5, "_decode_attention",
                        lambda *args: (calls.append(args[0].shape), original(*args))[1])
    return calls


@pytest.mark.parametrize("position, search, cache", [
    ("t5", dict(), dict()), ("t5", dict(), dict(cache_implementation="static")), ("t5", dict(), dict(use_cache=False)),
    ("t5", dict(num_beams=3), dict()), ("t5", dict(num_beams=3), dict(cache_implementation="static")),
    ("alibi", dict(), dict(cache_implementation="static")), ("none", dict(num_beams=3), dict()),
    # Offloaded caches need CUDA (transformers moves each layer to and from the GPU).
    pytest.param("t5", dict(), dict(cache_implementation="offloaded"), marks=pytest.mark.gpu),
    pytest.param("t5", dict(), dict(cache_implementation="offloaded_static"), marks=pytest.mark.gpu),
], ids=["t5-dynamic", "t5-static", "t5-no-cache", "t5-beam-dynamic", "t5-beam-static", "alibi-static",
        "none-beam-dynamic", "t5-offloaded", "t5-offloaded-static"])
def test_the_decode_kernel_generates_the_eager_tokens(kernel_device, monkeypatch, position, search, cache):
    """generate() on the Triton backend runs every decode step (self- and cross-attention) on the decode kernel and
    gives the tokens of the eager reference, with every cache kind and beam search."""
    model = kernel_model(kernel_device, position_encoding_type=position)
    inputs = dict(**padded_inputs(kernel_device), max_new_tokens=4, min_new_tokens=4, **search, **cache)
    model.config.attention_backend = "eager"
    expected = model.generate(**inputs)
    calls = decode_kernel_calls(monkeypatch)
    model.config.attention_backend = "triton"
    assert torch.equal(model.generate(**inputs), expected)
    assert len(calls) >= 2 * 4, len(calls)  # self- and cross-attention of every step


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_a_static_cache_decode_step_compiles_into_two_graphs_for_any_number_of_tokens(kernel_device, backend):
    """transformers compiles the decode step (one token, static cache) with fullgraph=True: it traces into two
    graphs (the first step computes the cross-attention keys, the later ones reuse them) however many tokens are
    generated, and gives the eager tokens. On the Triton backend the decode kernel reads the cache's position as a
    tensor: no graph reads a tensor back to the host (what a CUDA graph could not capture)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = kernel_model(kernel_device)
    model.config.attention_backend = backend
    original = model.forward
    for new_tokens in (4, 8):
        inputs = dict(**padded_inputs(kernel_device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      cache_implementation="static")
        eager_tokens = model.generate(**inputs)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        compiled = torch.compile(original, backend=counter, fullgraph=True, dynamic=False)

        def forward(*args, _compiled=compiled, **kwargs):
            if kwargs["decoder_input_ids"].shape[1] == 1 and kwargs.get("encoder_outputs") is not None:
                return _compiled(*args, **kwargs)
            return original(*args, **kwargs)

        model.forward = forward
        try:
            assert torch.equal(model.generate(**inputs), eager_tokens), new_tokens
        finally:
            model.forward = original
        assert counter.frame_count == 2, (new_tokens, counter.frame_count)
        graphs = [node for graph in counter.graphs for node in graph.graph.nodes]
        assert not [node for node in graphs if node.target in ("item", "tolist", torch.ops.aten._local_scalar_dense)]
        if backend == "triton":
            assert any(node.target == torch.ops.fat5.decode_attention.default for node in graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_static_cache_decode_step_is_captured_in_a_cuda_graph(kernel_device):
    """generate() with a static cache and the forward compiled in "reduce-overhead" mode replays every decode step
    from a CUDA graph (nothing in the step reads the device back: Inductor skips no graph) and gives the eager
    tokens."""
    from torch._dynamo.utils import counters

    model = kernel_model(kernel_device)
    model.config.attention_backend = "triton"
    inputs = dict(**padded_inputs(kernel_device), max_new_tokens=8, min_new_tokens=8, cache_implementation="static")
    eager_tokens = model.generate(**inputs)
    torch._dynamo.reset()
    counters.clear()
    original = model.forward
    model.forward = torch.compile(original, mode="reduce-overhead", fullgraph=True, dynamic=False)
    try:
        assert torch.equal(model.generate(**inputs, disable_compile=True), eager_tokens)
    finally:
        model.forward = original
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_the_layers_of_one_forward_share_their_sdpa_masks(monkeypatch):
    """The SDPA path builds each dense mask once per stack forward (the T5 bias with the padding, the
    cross-attention's key mask), with or without a gradient, and every layer reuses it, as transformers' T5 layers
    share their position_bias: the table's gradient flows through the one dense bias. The layers compute what the
    eager reference computes, and the table gets eager's gradient."""
    from fat5 import attention_fat5

    model = confident_model(3, 3)
    model.config.attention_backend = "sdpa"
    builds, original = [], attention_fat5._sdpa_mask
    monkeypatch.setattr(attention_fat5, "_sdpa_mask", lambda *args: (builds.append(1), original(*args))[1])
    inputs = dict(**padded_inputs(), decoder_input_ids=torch.randint(2, VOCAB, (3, 4)),
                  decoder_attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]))
    with torch.no_grad():
        shared = model(**inputs).logits
    assert len(builds) == 3  # encoder self-attention, decoder self-attention, cross-attention
    builds.clear()
    model.zero_grad()
    model(**inputs).logits.sum().backward()
    assert len(builds) == 3  # with a gradient too: one dense bias a stack
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if "relative" in name}
    model.config.attention_backend = "eager"
    model.zero_grad()
    expected = model(**inputs).logits
    expected.sum().backward()
    assert torch.allclose(shared, expected, atol=1e-4 * expected.abs().max().item())
    for name, p in model.named_parameters():
        if "relative" in name:
            assert torch.allclose(grads[name], p.grad, atol=1e-4 * p.grad.abs().max().item()), name


def test_a_shared_sdpa_mask_follows_its_key_mask_changed_in_place():
    from fat5.attention_fat5 import sdpa_attention
    from fat5.reference_fat5 import eager_attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, length, 8, generator=generator) for length in (1, 6, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(2):
            mask[1, 2:] = not mask[1, 2]  # the same tensor, padded then not
            expected = eager_attention(query, key, value, key_padding_mask=mask)
            assert torch.allclose(sdpa_attention(query, key, value, key_padding_mask=mask), expected,
                                  atol=1e-5 * expected.abs().max().item())
