"""Selection: which backend computes a stack's attention, decided once per stack forward and kind (self, cross).

`attention_plan` picks the configured backend, or for "auto" the fastest that is exact here (the kernel through the
guard of `attention_guard_fat5`), and has its adapter (`attention_fat5.PREPARE`) build what every layer of that kind
shares: an `AttentionPlan`.
"""

import functools
import os

import torch

from .attention_fat5 import (
    PREPARE,
    eager_attention_forward,
    sdpa_attention_forward,
    triton_attention_forward,
    triton_head_dims,
)
from .attention_guard_fat5 import guarded_triton_attention_forward


def needs_dense_bias(config):
    """Whether the config's position encoding is a dense (L, L) bias the kernel cannot compute: FIRE's (an MLP of
    every query-key pair) and asymmetric ALiBi's (half the heads look each way)."""
    return config.position_encoding_type == "fire" or (
        config.position_encoding_type == "alibi" and getattr(config, "alibi_mode", None) == "asymmetric")


def select_attention_backend(config, device, head_dim, dense_bias=False):
    """Name of the backend for attention on `device` with `head_dim`: the configured one, or for "auto" the fastest
    that is exact here.

    "auto" runs the kernel on CUDA, with or without attention dropout (the kernel draws its mask in-kernel), and
    SDPA only where the kernel cannot run: a dense bias (`dense_bias`: FIRE's, computed by an MLP per pair, or
    asymmetric ALiBi's), a head dim outside its tiles, or a device that is not CUDA; output_attentions runs eager
    (`attention_plan`). Where the kernel fails on the chip itself, `guarded_triton_attention_forward` falls back
    to SDPA."""
    backend = config.attention_backend
    device = torch.device(device)
    if backend == "triton" and dense_bias:
        raise ValueError(
            "attention_backend='triton' has no dense bias (FIRE's is an MLP of every query-key pair, asymmetric "
            "ALiBi's masks half the heads each way): use attention_backend='sdpa' or 'auto'"
        )
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' runs the Triton kernel, which needs CUDA tensors; got a {device.type} "
            "tensor. Use attention_backend='auto' (the kernel on CUDA, SDPA elsewhere) or 'sdpa'")
    if backend != "auto":
        return backend
    if getattr(config, "_attn_implementation", None) == "eager":
        return "eager"
    if device.type == "cuda" and not dense_bias and head_dim in triton_head_dims():
        return "triton"
    return "sdpa"


def _backend_with_weights(config):
    if config.attention_backend not in ("auto", "eager"):
        raise ValueError(
            f"output_attentions=True needs the eager attention backend, the only one that materialises attention "
            f"weights; this model uses attention_backend={config.attention_backend!r}. Call "
            "model.set_attn_implementation('eager') (or load with attn_implementation='eager') first")
    return "eager"


# Every function takes q, k, v and the keyword arguments of the contract (`attention_fat5`, plus `segments`, the
# packed rows' PackedSegments, and `output_attentions`) and returns (output, weights).
ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward,
                       "triton": triton_attention_forward}


def attention_plan(config, device, dtype, head_dim, query_length, key_length, *, t5=False, output_attentions=False,
                   **contract):
    """The `AttentionPlan` of one kind of attention in one stack forward: queries of `dtype` and `head_dim` on
    `device`, `query_length` of them over `key_length` keys, the rest of the contract as keywords (`t5`: its layers
    bring a T5 table)."""
    backend = select_attention_backend(config, device, head_dim, contract["position_bias"] is not None)
    if output_attentions:
        backend = _backend_with_weights(config)  # only the eager reference materialises the probabilities
    function = ATTENTION_FUNCTIONS[backend]
    if backend == "triton":  # the kernel where it cannot fail a run: "auto" falls back to SDPA, "triton" raises
        function = functools.partial(guarded_triton_attention_forward, fallback=config.attention_backend == "auto")
    return PREPARE[backend](function, query_length, key_length, dtype, device, contract, t5)
