"""FAT5: T5-family encoder-decoders whose attention never materialises the (L, L) relative bias.

Parameter names are transformers' T5 names (`shared`, `q,k,v,o`, `wi`/`wi_0`/`wi_1`/`wo`, `layer_norm`,
`relative_attention_bias`), so T5 checkpoints, PEFT `target_modules=["q", "v"]` and habits carry over. Attention
goes through one seam: the stack decides the backend of each kind of attention once a forward and builds what its
layers share (`attention_select_fat5`'s `AttentionPlan`s, in the stack's `PositionInputs`); the first block turns
its T5 table into the backend's bias and the stack hands that on to the others, as T5 hands on its position_bias.
"""

import contextlib
import copy
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.loss.loss_utils import ForQuestionAnsweringLoss, ForSequenceClassificationLoss, ForTokenClassification
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import DUMMY_INPUTS, DUMMY_MASK

from .attention_fat5 import PackedSegments, triton_installed
from .attention_positions_fat5 import (
    PositionInputs,
    apply_rotary,
    fire_distances,
    position_encoding,
    segment_positions,
)
from .attention_select_fat5 import attention_plan
from .compat_fat5 import (
    HAS_GENERIC_GET_ENCODER,
    cache_field,
    check_keywords,
    either_cache,
    init,
    match_t5_signature,
    output_cache,
    static_cache_max_length,
)
from .configuration_fat5 import FAT5Config
from .generation_fat5 import DecodeGraphs, is_decode_step_to_replay, uncapturable
from .kernels.feed_forward import ACTIVATIONS, feed_forward_act
from .kernels.residual_rms_norm import residual_rms_norm
from .loss_fat5 import linear_cross_entropy, seq2seq_lm_loss
from .peft_fat5 import register_fat5_with_peft
from .pickling_fat5 import PicklesWithItsCode
from .reference_fat5 import t5_rms_norm
from .remote_code_fat5 import mark_as_package, save_as_package

if TYPE_CHECKING:
    # Never run: only the seam imports the attention kernel. Loading a checkpoint *folder*, transformers 4.x copies
    # only the files this entry module imports relatively (not what those import), so it must read them here.
    from .attention_guard_fat5 import guarded_triton_attention_forward  # noqa: F401
    from .custom_ops_fat5 import custom_op  # noqa: F401
    from .kernels.decode_attention_t5 import decode_attention_t5  # noqa: F401
    from .kernels.flash_attention_t5 import flash_attention_t5  # noqa: F401
    from .kernels.t5_bias import near_band_bias  # noqa: F401

register_fat5_with_peft(FAT5Config.model_type)


def t5_linear(in_features, out_features, init_std, bias=False):
    """nn.Linear that records the standard deviation T5's initialisation gives it (read by `_init_weights`)."""
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.init_std = init_std
    return linear


def t5_embedding(num_embeddings, embedding_dim, init_std):
    embedding = nn.Embedding(num_embeddings, embedding_dim)
    embedding.init_std = init_std
    return embedding


def to_weight_dtype(hidden_states, linear):
    """`hidden_states` in the dtype of `linear`'s weight (wo may be kept in fp32 by `_keep_in_fp32_modules` while
    the rest runs in fp16). Under autocast the matmul runs in autocast's dtype whatever the input's, so a cast here
    would only be undone: the input is left as it is. Quantized layers take their input as it is: torch's dynamic
    quantization makes `weight` a method, int8 layers (bitsandbytes) cast themselves."""
    weight = linear.weight
    if (isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dtype != hidden_states.dtype
            and not torch.is_autocast_enabled(hidden_states.device.type)):
        return hidden_states.to(weight.dtype)
    return hidden_states


class FAT5LayerNorm(nn.Module):
    """T5's RMSNorm: no mean, no bias, statistics in fp32, output in the weight's dtype."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, update=None, dropout=None):
        """The norm of `hidden_states`; given a sub-layer's `update` (and its nn.Dropout `dropout`), the residual
        sum hidden_states + dropout(update) and its norm, as one op (`residual_rms_norm`). Called as a module,
        so hooks that gather or offload the weight (ZeRO-3, accelerate) see it."""
        if update is not None:
            return residual_rms_norm(hidden_states, update, self.weight, self.variance_epsilon,
                                     dropout_p=dropout.p if dropout is not None and dropout.training else 0.0)
        if hidden_states.is_cuda and triton_installed():
            # One fused Triton kernel instead of several elementwise ones; same casting.
            from .kernels.rms_norm import rms_norm

            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return t5_rms_norm(hidden_states, self.weight, self.variance_epsilon)


# transformers' activations FAT5's fused op does not compute (any other name of ACT2FN), one instance each. Called,
# never registered as a submodule: transformers 5.25's `kernelize` replaces the forward of every activation module it
# finds in a model, which would change FAT5's computation behind its back.
_OTHER_ACTIVATIONS = {}


def activation_and_dropout(hidden, gate, activation, dropout):
    """dropout(act(hidden) * gate) (gate None: dropout(act(hidden))), the feed-forward between its matmuls: one op
    each way (`feed_forward_act`) for the activations it computes, transformers' activation and nn.Dropout for the
    others. `dropout`: the layer's nn.Dropout, whose p applies in training."""
    if activation in ACTIVATIONS:
        return feed_forward_act(hidden, gate, activation=activation, dropout_p=dropout.p if dropout.training else 0.0)
    act = _OTHER_ACTIVATIONS.get(activation)
    if act is None:
        act = _OTHER_ACTIVATIONS[activation] = ACT2FN[activation]
    hidden = act(hidden)
    return dropout(hidden if gate is None else hidden * gate)


class FAT5DenseActDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi = t5_linear(config.d_model, config.d_ff, init_std=config.d_model**-0.5)
        self.wo = t5_linear(config.d_ff, config.d_model, init_std=config.d_ff**-0.5)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.activation = config.dense_act_fn

    def forward(self, hidden_states):
        hidden_states = activation_and_dropout(self.wi(hidden_states), None, self.activation, self.dropout)
        return self.wo(to_weight_dtype(hidden_states, self.wo))


class FAT5DenseGatedActDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi_0 = t5_linear(config.d_model, config.d_ff, init_std=config.d_model**-0.5)
        self.wi_1 = t5_linear(config.d_model, config.d_ff, init_std=config.d_model**-0.5)
        self.wo = t5_linear(config.d_ff, config.d_model, init_std=config.d_ff**-0.5)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.activation = config.dense_act_fn

    def forward(self, hidden_states):
        hidden_states = activation_and_dropout(self.wi_0(hidden_states), self.wi_1(hidden_states), self.activation,
                                               self.dropout)
        return self.wo(to_weight_dtype(hidden_states, self.wo))


class FAT5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        dense_class = FAT5DenseGatedActDense if config.is_gated_act else FAT5DenseActDense
        self.DenseReluDense = dense_class(config)
        self.layer_norm = FAT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


class FAT5FIREBias(nn.Module):
    """FIRE (Li et al. 2023): bias = MLP(psi(distance) / psi(max(threshold, query position))), psi(x) = log(c x + 1).

    The sign of the distance (key - query) is kept, so one MLP serves the bidirectional encoder too. The query
    position counts from config.fire_normalizer_offset (1: the first query is position 1), and
    config.fire_normalizer_eps is added to the normaliser.
    """

    def __init__(self, config):
        super().__init__()
        self.mlp_in = t5_linear(1, config.fire_mlp_width, init_std=1.0, bias=True)
        self.mlp_out = t5_linear(config.fire_mlp_width, config.num_heads, init_std=config.fire_mlp_width**-0.5,
                                  bias=True)
        self.c = nn.Parameter(torch.tensor(config.fire_init_c))
        self.threshold = nn.Parameter(torch.tensor(config.fire_init_threshold))
        self.normalizer_offset = config.fire_normalizer_offset
        self.normalizer_eps = config.fire_normalizer_eps

    def forward(self, query_length, key_length, q_offset, device, positions=None):
        """(1, H, Lq, Lk) bias; (B, H, L, L) for packed rows, whose (B, L) `positions` restart at each segment."""
        distance = fire_distances(query_length, key_length, q_offset, device, self.c.abs(), self.threshold.abs(),
                                  self.normalizer_offset, self.normalizer_eps, positions)
        # The distances are computed in fp32; the MLP runs in its weights' dtype (bf16 in a bf16 model).
        distance = to_weight_dtype(distance.unsqueeze(-1), self.mlp_in)
        bias = self.mlp_out(F.relu(self.mlp_in(distance)))  # (1 | B, Lq, Lk, H)
        return bias.permute(0, 3, 1, 2)


class FAT5Attention(nn.Module):
    def __init__(self, config, is_decoder=False, is_cross_attention=False, has_relative_attention_bias=False,
                 layer_idx=None):
        super().__init__()
        self.config = config
        self.is_decoder = is_decoder
        self.is_cross_attention = is_cross_attention
        self.has_relative_attention_bias = has_relative_attention_bias
        self.layer_idx = layer_idx
        # T5Attention's attribute names, which tools that read T5's modules use (CTranslate2's T5 loader).
        self.n_heads = config.num_heads
        self.key_value_proj_dim = config.d_kv
        self.inner_dim = config.num_heads * config.d_kv
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        # T5 folds the 1/sqrt(d_kv) attention scale into q's initialisation.
        self.q = t5_linear(config.d_model, self.inner_dim, init_std=(config.d_model * config.d_kv) ** -0.5)
        self.k = t5_linear(config.d_model, self.inner_dim, init_std=config.d_model**-0.5)
        self.v = t5_linear(config.d_model, self.inner_dim, init_std=config.d_model**-0.5)
        self.o = t5_linear(self.inner_dim, config.d_model, init_std=self.inner_dim**-0.5)
        if has_relative_attention_bias:
            if config.position_encoding_type == "t5":
                self.relative_attention_bias = t5_embedding(config.relative_attention_num_buckets, config.num_heads,
                                                            init_std=config.d_model**-0.5)
            elif config.position_encoding_type == "fire":
                self.fire = FAT5FIREBias(config)

    def _project(self, linear, states):
        batch, length = states.shape[:2]
        return linear(states).view(batch, length, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

    def forward(self, hidden_states, key_value_states=None, key_padding_mask=None, position=None,
                cache=None, bias_table=None, output_attentions=False, attention_bias=None):
        """`position`: the stack's PositionInputs, with the plan of this kind of attention (None, or no plan: the
        layer makes its own from `key_padding_mask` and `bias_table`, the T5 relative-bias table it uses, its own
        when None). `attention_bias`: what the stack's plan made of its T5 table (`AttentionPlan.prepare_bias`).
        Returns (output, weights), weights None unless output_attentions."""
        position = PositionInputs() if position is None else position
        query = self._project(self.q, hidden_states)
        if self.is_cross_attention:
            key, value = self._encoder_key_value(key_value_states, cache, position.cross_rotary)
            if self.config.rope_cross_attention and position.rotary is not None:
                query = self._rotate(query, position.rotary)
            plan = position.cross_attention
        else:
            key = self._project(self.k, hidden_states)
            value = self._project(self.v, hidden_states)
            if position.rotary is not None:
                query, key = self._rotate(query, position.rotary), self._rotate(key, position.rotary)
                if self.config.rope_rotates_values:
                    value = self._rotate(value, position.rotary)
            if cache is not None:
                # cache_position tells transformers 4.x's static cache where to write (5.x counts itself).
                key, value = cache.self_attention_cache.update(
                    key, value, self.layer_idx, cache_kwargs={"cache_position": position.cache_position})
            plan = position.self_attention
            if plan is None and bias_table is None and hasattr(self, "relative_attention_bias"):
                bias_table = self.relative_attention_bias.weight  # called on its own, outside FAT5Block
        if plan is None:  # called on its own, outside a stack
            plan = self.attention_plan(position, query.dtype, query.device, query.shape[-2], key.shape[-2],
                                       key_padding_mask, output_attentions, t5=bias_table is not None)
            if bias_table is not None:
                attention_bias = plan.prepare_bias(bias_table)
        dropout_p = self.config.attention_dropout_rate if self.training else 0.0
        attn_output, attn_weights = plan(query, key, value, attention_bias, dropout_p=dropout_p,
                                         output_attentions=output_attentions)
        batch, _, length, _ = attn_output.shape
        attn_output = self.o(attn_output.transpose(1, 2).reshape(batch, length, self.inner_dim))
        return attn_output, attn_weights

    def attention_plan(self, position, dtype, device, query_length, key_length, key_padding_mask,
                       output_attentions=False, t5=False):
        """The AttentionPlan of this kind of attention for one forward (the stack's, made once for its layers).
        The cross-attention has no bias: encoder positions are not comparable with decoder positions (T5, ALiBi,
        FIRE)."""
        cross = self.is_cross_attention
        return attention_plan(
            self.config, device, dtype, self.key_value_proj_dim, query_length, key_length, t5=t5,
            output_attentions=output_attentions, bidirectional=not self.is_decoder,
            num_buckets=self.relative_attention_num_buckets, max_distance=self.relative_attention_max_distance,
            alibi_slopes=None if cross else position.alibi_slopes,
            position_bias=None if cross else position.position_bias, key_padding_mask=key_padding_mask,
            causal=self.is_decoder and not cross, q_offset=0 if cross else position.q_offset,
            scale=self.config.attention_scale, segments=position.cross_segments if cross else position.segments)

    def _rotate(self, states, rotary):
        cos, sin = rotary
        return apply_rotary(states, cos, sin, self.config.rope_interleaved)

    def _encoder_key_value(self, encoder_hidden_states, cache, rotary=None):
        """Cross-attention keys and values, from the cache once computed; `rotary`: the encoder positions' RoPE
        (rope_cross_attention), applied before caching."""
        cross_cache = cache.cross_attention_cache if cache is not None else None
        if cache is not None and cache.is_updated.get(self.layer_idx):
            # Encoder keys/values do not change while decoding: reuse them.
            return cross_cache.layers[self.layer_idx].keys, cross_cache.layers[self.layer_idx].values
        key = self._project(self.k, encoder_hidden_states)
        value = self._project(self.v, encoder_hidden_states)
        if rotary is not None:
            key = self._rotate(key, rotary)
            if self.config.rope_rotates_values:
                value = self._rotate(value, rotary)
        if cross_cache is not None:
            key, value = cross_cache.update(key, value, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return key, value


class FAT5LayerSelfAttention(nn.Module):
    def __init__(self, config, is_decoder, has_relative_attention_bias, layer_idx):
        super().__init__()
        self.SelfAttention = FAT5Attention(config, is_decoder=is_decoder,
                                           has_relative_attention_bias=has_relative_attention_bias,
                                           layer_idx=layer_idx)
        self.layer_norm = FAT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, key_padding_mask, position, cache, bias_table=None,
                output_attentions=False):
        attention_output, attention_weights = self.SelfAttention(
            self.layer_norm(hidden_states), key_padding_mask=key_padding_mask, position=position,
            cache=cache, bias_table=bias_table, output_attentions=output_attentions)
        return hidden_states + self.dropout(attention_output), attention_weights


class FAT5LayerCrossAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.EncDecAttention = FAT5Attention(config, is_decoder=True, is_cross_attention=True, layer_idx=layer_idx)
        self.layer_norm = FAT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, encoder_hidden_states, encoder_key_padding_mask, cache,
                position=None, output_attentions=False):
        attention_output, attention_weights = self.EncDecAttention(
            self.layer_norm(hidden_states), key_value_states=encoder_hidden_states,
            key_padding_mask=encoder_key_padding_mask, position=position, cache=cache,
            output_attentions=output_attentions)
        return hidden_states + self.dropout(attention_output), attention_weights


class FAT5Block(GradientCheckpointingLayer):
    def __init__(self, config, is_decoder, has_relative_attention_bias, layer_idx):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList([FAT5LayerSelfAttention(config, is_decoder, has_relative_attention_bias,
                                                           layer_idx)])
        if is_decoder:
            self.layer.append(FAT5LayerCrossAttention(config, layer_idx))
        self.layer.append(FAT5LayerFF(config))

    def forward(self, hidden_states, key_padding_mask=None, encoder_hidden_states=None,
                encoder_key_padding_mask=None, position=None, cache=None, attention_bias=None,
                output_attentions=False):
        """Returns (hidden states, self-attention weights, cross-attention weights, shared bias): weights None
        unless output_attentions, the bias None unless this block owns a table the later blocks share.

        `attention_bias`: what the stack's self-attention plan made of its first block's T5 table (the kernel's
        lookup table, SDPA's dense mask, the table itself for eager), for the blocks that share it, as T5's blocks
        share their position_bias. It is a positional tensor argument, not a `position` field, so (reentrant)
        gradient checkpointing tracks it. Called on its own (no plans in `position`), the block's attentions make
        their own plans, and the bias it hands on is its table."""
        attention_layer = self.layer[0]
        attention = attention_layer.SelfAttention
        own_bias = bias_table = None
        if hasattr(attention, "relative_attention_bias"):
            # Read through the embedding's forward, not `.weight`, so ZeRO-3 gathers it while this block runs.
            buckets = torch.arange(attention.relative_attention_num_buckets, device=hidden_states.device)
            bias_table = own_bias = attention.relative_attention_bias(buckets)
            plan = None if position is None else position.self_attention
            if plan is not None:
                attention_bias = own_bias = plan.prepare_bias(bias_table)
                bias_table = None
        # Each sub-layer's residual add, its dropout and the next sub-layer's norm run as one op (the next
        # sub-layer's norm module given the update); the sub-layers' own forwards compute the same in three.
        crossing = self.is_decoder and encoder_hidden_states is not None
        update, self_attention_weights = attention(
            attention_layer.layer_norm(hidden_states), key_padding_mask=key_padding_mask, position=position,
            cache=cache, bias_table=bias_table, output_attentions=output_attentions, attention_bias=attention_bias)
        following = self.layer[1] if crossing else self.layer[-1]
        hidden_states, normed = following.layer_norm(hidden_states, update, attention_layer.dropout)
        cross_attention_weights = None
        if crossing:
            update, cross_attention_weights = following.EncDecAttention(
                normed, key_value_states=encoder_hidden_states, key_padding_mask=encoder_key_padding_mask,
                position=position, cache=cache, output_attentions=output_attentions)
            hidden_states, normed = self.layer[-1].layer_norm(hidden_states, update, following.dropout)
        feed_forward = self.layer[-1]
        hidden_states = hidden_states + feed_forward.dropout(feed_forward.DenseReluDense(normed))
        # A bias that serves every layer of the stack leaves the block as an output, so sharding engines
        # (FSDP per block, ZeRO-3) route the later layers' gradient back through this block.
        shared_bias = None if attention.config.relative_bias_per_layer else own_bias
        return hidden_states, self_attention_weights, cross_attention_weights, shared_bias


def _read_only(cache):
    """What a decoder forward with use_cache=False attends to when given a cache (PEFT's prefix tuning gives its
    virtual tokens so): the cache's keys and values and this forward's, leaving the cache as it was, so that the
    forward is returned the cache it was given. Written into, the cache grew by this forward's tokens, and generate
    without a cache, which hands the model every token again with the cache the last forward returned, placed them
    after a copy of themselves: no-cache tokens differed from the cached ones. A dynamic cache is copied by reference
    (a prefix's gradient flows through); a static one, which is written in place, whole."""
    if getattr(cache.self_attention_cache, "is_compileable", False):
        return copy.deepcopy(cache)
    copied = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for part in ("self_attention_cache", "cross_attention_cache"):
        for index, layer in enumerate(getattr(cache, part).layers):
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                getattr(copied, part).update(layer.keys, layer.values, index)
    copied.is_updated = dict(cache.is_updated)
    return copied


def _static_cache_length(cache, part="self_attention_cache"):
    """Length of the keys a static (compileable) self- or cross-attention cache returns (all its slots), else
    None."""
    attention_cache = getattr(cache, part, None)
    if attention_cache is None or not getattr(attention_cache, "is_compileable", False):
        return None
    return static_cache_max_length(attention_cache)


def _cross_key_mask(mask, cache, batch, encoder_length, device):
    """The cross-attention key mask (None: every encoder token) for keys a static cross-attention cache returns:
    all its slots, of which only the first `encoder_length` hold the encoder's keys. A cache sized for a longer
    input (a StaticCache the user built, reused for a shorter one) leaves the rest empty, and they are masked out
    (transformers' T5 attends to them, or fails on the mask's length)."""
    slots = _static_cache_length(cache, "cross_attention_cache")
    if slots is None or slots == encoder_length:
        return mask
    if slots < encoder_length:
        raise ValueError(f"the static cross-attention cache has {slots} slots, fewer than the {encoder_length} "
                         f"encoder tokens it must hold: size it for the encoder input")
    if mask is None:
        mask = torch.ones(batch, encoder_length, dtype=torch.bool, device=device)
    return F.pad(mask, (0, slots - encoder_length), value=False)


def _key_mask_from_causal_mask(mask):
    """(B, Lk) key mask from a causal (B, 1, Lq, Lk) mask as transformers builds them (bool: True = attend, or
    additive: 0 = attend). The last query row sees every key up to it, so it holds the keys' padding; causality
    itself is applied by the attention."""
    last_row = mask[:, 0, -1, :]
    return last_row if last_row.dtype == torch.bool else last_row == 0


def _checked_segment_ids(segment_ids, mask, batch, length, name):
    """Segment ids with masked positions set to padding (0), checked for the layout packing needs."""
    if tuple(segment_ids.shape) != (batch, length):
        raise ValueError(f"{name} must have shape (batch, length) = {(batch, length)}, got {tuple(segment_ids.shape)}")
    segment_ids = segment_ids.long()
    if mask is not None:
        segment_ids = segment_ids * mask.to(torch.bool)
    previous, following = segment_ids[:, :-1], segment_ids[:, 1:]
    if bool((segment_ids < 0).any() | ((following != 0) & ((following < previous) | (previous == 0))).any()):
        raise ValueError(f"{name} must number each row's examples 1, 2, ... in order, each example's tokens "
                         f"contiguous, padding (0, or attention mask 0) only at the end of the row")
    return segment_ids


def _packed_segments(segment_ids, attention_mask, encoder_segment_ids, encoder_attention_mask,
                     encoder_hidden_states, batch, length, q_offset, is_decoder):
    """(self-attention PackedSegments, cross-attention's) for a packed batch, (None, None) otherwise; the
    cross-attention's is None in the encoder."""
    if segment_ids is None:
        if encoder_segment_ids is not None:
            raise ValueError("packed batches need decoder_segment_ids as well as segment_ids")
        return None, None
    if q_offset:
        raise ValueError("segment_ids (packed batches) are for training and scoring whole sequences, not for "
                         "decoding step by step with a cache")
    segment_ids = _checked_segment_ids(segment_ids, attention_mask, batch, length,
                                       "decoder_segment_ids" if is_decoder else "segment_ids")
    cross_segments = None
    if encoder_hidden_states is not None:
        if encoder_segment_ids is None:
            raise ValueError("packed batches need segment_ids as well as decoder_segment_ids")
        encoder_segment_ids = _checked_segment_ids(encoder_segment_ids, encoder_attention_mask, batch,
                                                   encoder_hidden_states.shape[1], "segment_ids")
        cross_segments = PackedSegments(segment_ids, encoder_segment_ids)
    return PackedSegments(segment_ids, segment_ids), cross_segments


def _key_mask(mask, batch, key_length, name):
    """A (B, Lk) boolean key mask from a 0/1 attention mask, or None when nothing is masked."""
    if mask is None:
        return None
    if mask.dim() != 2 or tuple(mask.shape) != (batch, key_length):
        raise ValueError(f"{name} must have shape (batch, key_length) = {(batch, key_length)}, "
                         f"got {tuple(mask.shape)}")
    return mask.to(torch.bool)


@contextlib.contextmanager
def _no_transformers_code_copy(model_class):
    """transformers copies a registered class's module and its relative imports by their package paths, which
    breaks on fat5/kernels/ ("kernels.flash_attention_t5.py" not found); FAT5 writes its own code instead."""
    own = "_auto_class" in vars(model_class)
    previous = model_class._auto_class
    model_class._auto_class = None
    try:
        yield
    finally:
        if own:
            model_class._auto_class = previous
        else:
            del model_class._auto_class


class FAT5PreTrainedModel(PicklesWithItsCode, PreTrainedModel):
    config_class = FAT5Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FAT5Block"]
    # fp16 only: T5's FFN output overflows in half precision (transformers#20287).
    _keep_in_fp32_modules = ["wo"]
    # What transformers (and its test suites) read from a model class. FAT5 switches between eager and SDPA (see
    # set_attn_implementation) and runs its own flash kernel rather than transformers' flash/flex integrations.
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # Every class, and generate's decode step with a static cache, traces as one graph (tests/test_compile.py).
    _can_compile_fullgraph = True

    def post_init(self):
        register_fat5_with_peft(self.config.model_type)  # PEFT imported since the model code was
        super().post_init()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in vars(cls):
            # Arguments as transformers' T5 on the installed release takes them (compat_fat5.match_t5_signature).
            match_t5_signature(cls.forward)

    @torch.no_grad()
    def _init_weights(self, module):
        """T5's initialisation (Mesh TensorFlow). Each module initialises only its own parameters: for remote
        code, transformers skips a module whose direct parameters are all loaded (or that has none)."""
        factor = self.config.initializer_factor
        if isinstance(module, FAT5LayerNorm):
            init.constant_(module.weight, factor)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            # Layers made outside FAT5 (e.g. by resize_token_embeddings) get a fan-in default.
            default = 1.0 if isinstance(module, nn.Embedding) else module.in_features**-0.5
            init.normal_(module.weight, mean=0.0, std=factor * getattr(module, "init_std", default))
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, FAT5FIREBias):
            init.constant_(module.c, self.config.fire_init_c)
            init.constant_(module.threshold, self.config.fire_init_threshold)

    def save_pretrained(self, save_directory, *args, is_main_process=True, push_to_hub=False, **kwargs):
        """transformers' save_pretrained, always giving a complete FAT5 package (code flat beside the config,
        `auto_map`, the text2text pipeline), whether the model was loaded from a folder or built here; where FAT5 is
        installed, written to a staging folder first, so an error leaves `save_directory` as it was."""
        if not is_main_process or os.path.isfile(save_directory):
            return super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        hub_kwargs = {name: kwargs.pop(name) for name in ("repo_id", "commit_message", "commit_description",
                                                          "private", "token", "revision", "create_pr")
                      if name in kwargs}
        mark_as_package(self.config, encoder_only=isinstance(self, FAT5EncoderMixin))
        parent_save = super().save_pretrained
        try:  # where FAT5 is installed, its file safety (not shipped: see remote_code_fat5.py)
            from fat5.safe_files import StagedFolder
        except ImportError:
            StagedFolder = None  # in place, as transformers saves
        with _no_transformers_code_copy(type(self)):
            save_as_package(lambda staging: parent_save(staging, *args, **kwargs), save_directory, StagedFolder)
        if push_to_hub:
            repo_id = hub_kwargs.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            return self.push_to_hub(repo_id, **hub_kwargs)

    def tie_weights(self, *args, **kwargs):
        """transformers' tying (the LM head when config.tie_word_embeddings), then the stacks' embeddings, which
        are `shared` whatever the config says (transformers 4.57 ties by Parameter identity after a load).

        A tied head loaded from a checkpoint without `shared.weight` gives the embedding its weight, as transformers
        5 ties to the side that was loaded (4.57 would tie the loaded head to the embedding left on the meta
        device, T5's as well)."""
        shared, head = getattr(self, "shared", None), self.get_output_embeddings()
        if (getattr(self.config, "tie_word_embeddings", False) and isinstance(shared, nn.Embedding)
                and head is not None and shared.weight.is_meta and not head.weight.is_meta):
            shared.weight = head.weight
        super().tie_weights(*args, **kwargs)
        _tie_stack_embeddings(self)

    def get_expanded_tied_weights_keys(self, all_submodels=False):
        """transformers 5 ties, saves once, offloads and device-maps tied weights from this mapping, and ties
        nothing when config.tie_word_embeddings is false. The stacks' embeddings are always `shared` (only the LM
        head follows the flag), so they are always listed. (transformers 4.57 does not call this.)"""
        tied = super().get_expanded_tied_weights_keys(all_submodels=all_submodels)
        if not all_submodels:
            tied.update({name: "shared.weight" for name in _stack_embedding_names(self)
                         if name in (self._tied_weights_keys or {})})
        return tied

    def mark_tied_weights_as_initialized(self, loading_info):
        """transformers 5, loading a checkpoint, flags every tied name's Parameter as loaded (it will be tied to its
        source) and, for a class outside transformers, stops reporting as missing any Parameter so flagged. Here a
        tied name holds its source's own Parameter (the stacks' embeddings always, a tied head once tied), so the
        flag reached the source too: a checkpoint without `shared.weight` loaded with nothing reported missing and
        the embedding left on the meta device. A source the checkpoint lacks stays missing, as for T5, so it is
        created, initialised and reported (and tied to a tied name the checkpoint holds, if any)."""
        missing = set(loading_info.missing_keys)
        super().mark_tied_weights_as_initialized(loading_info)
        loading_info.missing_keys |= missing & set(self.all_tied_weights_keys.values())

    def _output(self, output, return_dict):
        """return_dict=False (or config.return_dict=False) gives the tuple of the fields that are set, as
        transformers' T5 does."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return output if return_dict else output.to_tuple()

    @classmethod
    def _can_set_attn_implementation(cls):
        """transformers guesses this from the module's source (attention through its AttentionInterface); FAT5
        switches with its own set_attn_implementation below."""
        return True

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        """transformers' names mapped onto FAT5's backends: "eager" and "sdpa" set `config.attention_backend`.
        FAT5 computes attention itself (the Triton kernel is attention_backend="triton", or "auto" on CUDA), so
        transformers' other implementations (flash_attention_2, flex_attention, kernels) do not apply."""
        requested = attn_implementation.get("", None) if isinstance(attn_implementation, dict) else attn_implementation
        if requested not in ("eager", "sdpa"):
            raise ValueError(
                f'Specified `attn_implementation="{requested}"` is not supported by FAT5, which maps '
                "set_attn_implementation('eager') and ('sdpa') onto config.attention_backend. For the Triton kernel "
                "set model.config.attention_backend = 'triton' (or 'auto', which uses it on CUDA)")
        self.config.attention_backend = requested
        self.config._attn_implementation_internal = requested

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """generate() turns the decoder's mask into a dense 4-D causal mask for static caches; FAT5 applies
        causality inside attention and takes only a (batch, keys) padding mask, so it keeps the 2-D one."""
        return attention_mask

    def _shift_right(self, input_ids, segment_ids=None):
        """Decoder inputs from labels: prepend decoder_start_token_id, turn -100 into pad. With (B, L)
        `segment_ids` (packed rows), every segment starts with decoder_start_token_id."""
        if self.config.pad_token_id is None:
            raise ValueError("FAT5Config.pad_token_id is null: decoder inputs made from labels need it (T5 uses 0)")
        shifted = input_ids.new_zeros(input_ids.shape)
        shifted[..., 1:] = input_ids[..., :-1].clone()
        shifted[..., 0] = self.config.decoder_start_token_id
        if segment_ids is not None:
            starts = (segment_ids != F.pad(segment_ids[:, :-1], (1, 0))) & (segment_ids > 0)
            shifted = shifted.masked_fill(starts, self.config.decoder_start_token_id)
            shifted = shifted.masked_fill(segment_ids == 0, self.config.pad_token_id)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)


class FAT5Stack(FAT5PreTrainedModel):
    """The encoder or the decoder: embedding, blocks, final norm, and the position parameters every layer needs.
    A model in its own right, as T5's stacks are (`model.get_encoder()` exports, moves and reports its dtype on its
    own); in the full models its `embed_tokens` is the model's `shared` embedding (see `share_embedding`)."""

    def __init__(self, config, embed_tokens=None, is_decoder=False):
        super().__init__(config)
        self.is_decoder = is_decoder
        if embed_tokens is None:
            embed_tokens = t5_embedding(config.vocab_size, config.d_model, init_std=1.0)
        self.embed_tokens = embed_tokens
        num_layers = config.num_decoder_layers if is_decoder else config.num_layers
        owns_position = config.position_encoding_type in ("t5", "fire")
        self.block = nn.ModuleList([
            FAT5Block(config, is_decoder,
                      has_relative_attention_bias=owns_position and (i == 0 or config.relative_bias_per_layer),
                      layer_idx=i)
            for i in range(num_layers)
        ])
        self.final_layer_norm = FAT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, embed_tokens):
        self.embed_tokens = embed_tokens

    def tie_embeddings_and_encoder_decoder(self):
        """Nothing to tie inside a stack: it shares the model's config, and transformers 4.57's `tie_weights` calls
        this on every submodule, looking for an `encoder` and a `decoder` when the config sets `tie_encoder_decoder`.
        The full model ties."""

    def _position_inputs(self, query_length, key_length, q_offset, device, positions=None, segments=None,
                         cross_segments=None, encoder_length=None, masks=None):
        """What one forward builds once for all its layers: small position parameters (never an (L, L) T5 bias:
        `position_encoding`) and, given `masks`, the plans of its attentions. `masks`: (self-attention key mask,
        cross-attention key mask and key count, output_attentions, the queries' dtype)."""
        first_attention = self.block[0].layer[0].SelfAttention if len(self.block) else None
        fields = position_encoding(self.config, query_length, key_length, q_offset, device, positions, cross_segments,
                                   encoder_length, fire=getattr(first_attention, "fire", None))
        fields.update(q_offset=q_offset, cache_position=torch.arange(query_length, device=device) + q_offset,
                      segments=segments, cross_segments=cross_segments)
        position = PositionInputs(**fields)
        if masks is None or first_attention is None:
            return position
        # The stack decides each attention's backend and builds its shared inputs once (see FAT5Block.forward).
        key_padding_mask, encoder_key_padding_mask, cross_length, output_attentions, dtype = masks
        fields["self_attention"] = first_attention.attention_plan(
            position, dtype, device, query_length, key_length, key_padding_mask, output_attentions,
            t5=self.config.position_encoding_type == "t5")
        if self.is_decoder and encoder_length is not None:
            fields["cross_attention"] = self.block[0].layer[1].EncDecAttention.attention_plan(
                position, dtype, device, query_length, cross_length, encoder_key_padding_mask, output_attentions)
        return PositionInputs(**fields)

    def _query_dtype(self, states):
        """The attention's queries' dtype: autocast's, or the q projection's (its input's where it is quantized)."""
        if torch.is_autocast_enabled(states.device.type):
            return torch.get_autocast_dtype(states.device.type)
        weight = getattr(self.block[0].layer[0].SelfAttention.q, "weight", None) if len(self.block) else None
        return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else states.dtype

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                inputs_embeds=None, cache=None, use_cache=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, segment_ids=None, encoder_segment_ids=None,
                past_key_values=None, cache_position=None, **kwargs):
        """Arguments left as None take the config's values (`output_attentions`, `output_hidden_states`,
        `return_dict`, and for the decoder `use_cache`), as transformers' T5 stacks do. The cache comes as `cache`
        or `past_key_values` (`compat_fat5.either_cache`). `cache_position`, which transformers 4.x's generate
        passes, is not needed: positions are counted from the cache."""
        check_keywords(self, kwargs)
        cache = either_cache(cache, past_key_values, self)
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = config.return_dict if return_dict is None else return_dict
        if use_cache and not self.is_decoder:
            raise ValueError("use_cache=True is for the decoder: the encoder keeps no cache")
        if use_cache is None:
            use_cache = self.is_decoder and config.use_cache and not self.training
        if (input_ids is None) == (inputs_embeds is None):
            if self.is_decoder:
                raise ValueError("You have to specify either decoder_input_ids or decoder_inputs_embeds (or labels, "
                                 "from which FAT5ForConditionalGeneration makes them); for encoder features alone, "
                                 "use FAT5EncoderModel or model.get_encoder()")
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        given = cache
        if not self.is_decoder:
            cache = given = None
        elif use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        elif not use_cache and cache is not None:
            cache = _read_only(cache)
        q_offset = cache.get_seq_length() if cache is not None else 0
        if isinstance(q_offset, torch.Tensor):
            # A static cache's own counter, which its update() advances in place during this forward.
            q_offset = q_offset.clone()
        static_length = _static_cache_length(cache)
        key_length = q_offset + length if static_length is None else static_length
        if attention_mask is not None and attention_mask.dim() == 4 and self.is_decoder:
            attention_mask = _key_mask_from_causal_mask(attention_mask)
        if static_length is not None and attention_mask is not None and attention_mask.shape[-1] < static_length:
            # A static cache returns all its slots; the ones not yet written are future keys, hidden by causality.
            attention_mask = F.pad(attention_mask, (0, static_length - attention_mask.shape[-1]), value=1)
        key_padding_mask = _key_mask(attention_mask, batch, key_length, "attention_mask")
        encoder_key_padding_mask = cross_length = None
        if encoder_hidden_states is not None:
            encoder_length = encoder_hidden_states.shape[1]
            encoder_key_padding_mask = _cross_key_mask(
                _key_mask(encoder_attention_mask, batch, encoder_length, "encoder_attention_mask"), cache, batch,
                encoder_length, inputs_embeds.device)
            cross_length = encoder_length if encoder_key_padding_mask is None else encoder_key_padding_mask.shape[-1]
        segments, cross_segments = _packed_segments(segment_ids, attention_mask, encoder_segment_ids,
                                                    encoder_attention_mask, encoder_hidden_states, batch, length,
                                                    q_offset, self.is_decoder)
        positions = None
        if segments is not None:
            key_padding_mask = encoder_key_padding_mask = None  # the segment ids carry the padding
            positions = segment_positions(segments.query_segment_ids)
        masks = (key_padding_mask, encoder_key_padding_mask, cross_length, output_attentions,
                 self._query_dtype(inputs_embeds))
        position = self._position_inputs(length, key_length, q_offset, inputs_embeds.device, positions, segments,
                                         cross_segments, encoder_length=None if encoder_hidden_states is None
                                         else encoder_hidden_states.shape[1], masks=masks)

        hidden_states = self.dropout(inputs_embeds)
        if hidden_states.dtype == torch.float16:
            # fp16 overflows in T5's residual stream (FFN outputs reach 1e5): carry the residual in fp32.
            hidden_states = hidden_states.float()
        all_hidden_states = () if output_hidden_states else None
        attention_bias = None  # set by the first block when the stack shares its T5 table
        all_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions and encoder_hidden_states is not None else None
        for block in self.block:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            # The key masks travel in the plans, already in the backend's form.
            hidden_states, self_attention_weights, cross_attention_weights, shared_bias = block(
                hidden_states, None, encoder_hidden_states, None, position, cache, attention_bias, output_attentions)
            if shared_bias is not None:
                attention_bias = shared_bias
            if output_attentions:
                all_attentions += (self_attention_weights,)
                if all_cross_attentions is not None:
                    all_cross_attentions += (cross_attention_weights,)
        hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        output = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states,
                                                           **cache_field(cache if use_cache else given),
                                                           hidden_states=all_hidden_states,
                                                           attentions=all_attentions,
                                                           cross_attentions=all_cross_attentions)
        return output if return_dict else output.to_tuple()


STACK_NAMES = ("encoder", "decoder")
STACK_EMBEDDINGS_TIED = {f"{name}.embed_tokens.weight": "shared.weight" for name in STACK_NAMES}


def _stack_embedding_names(model):
    """State-dict names of the stacks' embeddings, which are `shared.weight` under other names (as in T5)."""
    return [f"{name}.embed_tokens.weight" for name in STACK_NAMES
            if getattr(getattr(model, name, None), "embed_tokens", None) is not None]


def _tie_stack_embeddings(model):
    """Make every stack's embedding alias hold `model.shared`'s weight Parameter again (a load, `to_empty` or a
    plain `load_state_dict(..., assign=True)` may have given each name its own). A stack whose `embed_tokens` is
    another module (the model's own `shared` after `set_input_embeddings`, PEFT's wrapper, a user's) is left
    alone."""
    shared = getattr(model, "shared", None)
    if not isinstance(shared, nn.Embedding):
        return
    for name in STACK_NAMES:
        embedding = getattr(getattr(model, name, None), "embed_tokens", None)
        if isinstance(embedding, SharedEmbeddingAlias):
            embedding.point_to(shared)


def _fill_embedding_aliases(model, state_dict, prefix, *args):
    """A state dict that names the embedding once (`shared.weight`, as every FAT5 and T5 checkpoint file does, and
    FAT5's own state dicts before the stacks' names appeared in them) loads strictly: the stacks' names are filled
    from it."""
    shared = state_dict.get(f"{prefix}shared.weight")
    if shared is not None:
        for alias in _stack_embedding_names(model):
            state_dict.setdefault(f"{prefix}{alias}", shared)


def _retie_after_load(model, incompatible_keys):
    # load_state_dict(..., assign=True) gives each name its own Parameter: tie them again.
    _tie_stack_embeddings(model)


class SharedEmbeddingAlias(nn.Embedding):
    """A stack's `embed_tokens`: T5's name for the model's shared embedding, a module of its own (as in transformers
    5's T5) whose weight is `shared`'s Parameter (no memory of its own). Its lookups run through the `shared`
    module itself, so whatever hooks `model.get_input_embeddings()` (NEFTune, transformers 4.57's
    `enable_input_require_grads`, accelerate's offload of `shared`) sees every stack's lookups."""

    def __init__(self, shared):
        # _weight: no tensor of its own is allocated (the meta device or a billion-parameter vocabulary alike).
        super().__init__(shared.num_embeddings, shared.embedding_dim, padding_idx=shared.padding_idx,
                         _weight=shared.weight)
        self.init_std = getattr(shared, "init_std", 1.0)
        self.point_to(shared)

    def point_to(self, shared):
        # Into the module's parameters directly, not through `register_parameter`: a context that builds models
        # empty (accelerate's `init_empty_weights`) replaces every registered Parameter with a copy of its own,
        # which would untie the alias from `shared`.
        self._parameters["weight"] = shared.weight
        # A plain attribute, not a submodule: the embedding appears once in the module tree under `shared`.
        object.__setattr__(self, "shared", shared)

    def forward(self, input_ids):
        return self.shared(input_ids)


def share_embedding(model, config, stack_names):
    """Build `model.shared` and the stacks named in `stack_names`, as transformers' T5 does: each stack owns an
    `embed_tokens` module (tracing, exports and `.to()` of a stack alone need it as a submodule; PEFT's
    `target_modules=["embed_tokens"]` finds both) whose weight is `shared`'s one Parameter. `state_dict()` names
    it under all three names, as T5's does (accelerate's offload hooks look each name up); saved files keep one
    copy, `shared.weight` (`_tied_weights_keys`), and a load fills the other names from it."""
    model.shared = t5_embedding(config.vocab_size, config.d_model, init_std=1.0)
    for name in stack_names:
        setattr(model, name, FAT5Stack(config, SharedEmbeddingAlias(model.shared), is_decoder=name == "decoder"))
    model.register_load_state_dict_pre_hook(_fill_embedding_aliases)
    model.register_load_state_dict_post_hook(_retie_after_load)


def get_own_encoder(self):
    return self.encoder


class FAT5EncoderDecoderMixin:
    """Shared plumbing of the two encoder-decoder classes."""

    if not HAS_GENERIC_GET_ENCODER:
        get_encoder = get_own_encoder

    def _build_encoder_decoder(self, config):
        share_embedding(self, config, STACK_NAMES)

    @property
    def dummy_inputs(self):
        """transformers' dummy batch with decoder inputs, as T5's: `model(**model.dummy_inputs)` runs."""
        input_ids = torch.tensor(DUMMY_INPUTS)
        return {"input_ids": input_ids, "decoder_input_ids": input_ids,
                "decoder_attention_mask": torch.tensor(DUMMY_MASK)}

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = new_embeddings
        self.encoder.set_input_embeddings(new_embeddings)
        self.decoder.set_input_embeddings(new_embeddings)

    def _encode_and_decode(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
                           encoder_outputs, cache, inputs_embeds, decoder_inputs_embeds, use_cache,
                           output_hidden_states, output_attentions=None, segment_ids=None, decoder_segment_ids=None):
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                                           output_attentions=output_attentions, segment_ids=segment_ids,
                                           return_dict=True)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        decoder_outputs = self.decoder(input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
                                       inputs_embeds=decoder_inputs_embeds, cache=cache,
                                       encoder_hidden_states=encoder_outputs.last_hidden_state,
                                       encoder_attention_mask=attention_mask, use_cache=use_cache,
                                       output_hidden_states=output_hidden_states,
                                       output_attentions=output_attentions, segment_ids=decoder_segment_ids,
                                       encoder_segment_ids=segment_ids, return_dict=True)
        return encoder_outputs, decoder_outputs


class FAT5Model(FAT5EncoderDecoderMixin, FAT5PreTrainedModel):
    _tied_weights_keys = dict(STACK_EMBEDDINGS_TIED)

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self._build_encoder_decoder(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None,
                use_cache=None, output_hidden_states=None, return_dict=None, output_attentions=None, segment_ids=None,
                decoder_segment_ids=None, past_key_values=None, cache_position=None, **kwargs):
        check_keywords(self, kwargs)
        encoder_outputs, decoder_outputs = self._encode_and_decode(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
            either_cache(cache, past_key_values, self), inputs_embeds, decoder_inputs_embeds, use_cache,
            output_hidden_states, output_attentions=output_attentions,
            segment_ids=segment_ids, decoder_segment_ids=decoder_segment_ids)
        return self._output(Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_field(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        ), return_dict)


class FAT5ForConditionalGeneration(FAT5EncoderDecoderMixin, FAT5PreTrainedModel, GenerationMixin):
    # As T5's; the LM head is tied only when config.tie_word_embeddings is true (the stacks' embeddings always).
    _tied_weights_keys = {**STACK_EMBEDDINGS_TIED, "lm_head.weight": "shared.weight"}
    # The Trainer passes num_items_in_batch (the label tokens of the whole accumulated batch) to the loss. Said
    # here, not read from forward's **kwargs, which transformers 4.57 does not see (compat_fat5.match_t5_signature).
    accepts_loss_kwargs = True

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self.model_dim = config.d_model
        self._build_encoder_decoder(config)
        self.lm_head = t5_linear(config.d_model, config.vocab_size, init_std=1.0)
        # The decode steps captured for generation with a static cache on CUDA (generation_fat5.py).
        self._decode_graphs = DecodeGraphs()
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None,
                labels=None, use_cache=None, output_hidden_states=None, return_dict=None, num_items_in_batch=None,
                output_attentions=None, segment_ids=None, decoder_segment_ids=None, past_key_values=None,
                cache_position=None, **kwargs):
        """Packed batches (several examples per row, see `fat5.training.packing`) pass `segment_ids` (B, L_enc)
        and `decoder_segment_ids` (B, L_dec): 1, 2, ... numbers a row's examples, 0 is padding. Each example then
        attends only to itself (decoder segment s to encoder segment s), positions restart at every segment, and
        the loss stays the mean over the batch's label tokens, i.e. the sum of every example's token losses over
        the number of label tokens."""
        check_keywords(self, kwargs)
        cache = either_cache(cache, past_key_values, self)
        if labels is None and decoder_inputs_embeds is None and decoder_segment_ids is None \
                and is_decode_step_to_replay(self, decoder_input_ids, encoder_outputs, cache, use_cache):
            encoder_states = encoder_outputs[0]
            logits = self._decode_graphs.step(self, decoder_input_ids, encoder_states, attention_mask, cache,
                                              uncapturable(self, output_attentions, output_hidden_states,
                                                           decoder_attention_mask))
            if logits is not None:
                encoder = encoder_outputs if isinstance(encoder_outputs, BaseModelOutput) else None
                return self._output(Seq2SeqLMOutput(
                    logits=logits, **cache_field(cache), encoder_last_hidden_state=encoder_states,
                    encoder_hidden_states=getattr(encoder, "hidden_states", None),
                    encoder_attentions=getattr(encoder, "attentions", None)), return_dict)
        else:
            self._decode_graphs.fresh = True
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self._shift_right(labels, decoder_segment_ids)
        encoder_outputs, decoder_outputs = self._encode_and_decode(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, cache,
            inputs_embeds, decoder_inputs_embeds, use_cache, output_hidden_states,
            output_attentions=output_attentions, segment_ids=segment_ids, decoder_segment_ids=decoder_segment_ids)
        sequence_output = decoder_outputs.last_hidden_state
        if self.config.scale_decoder_outputs:
            # T5 v1.0 ties the LM head to the input embedding and rescales before it.
            sequence_output = sequence_output * self.model_dim**-0.5
        sequence_output = to_weight_dtype(sequence_output, self.lm_head)
        loss = logits = None
        if labels is not None and self._loss_without_logits():
            loss = linear_cross_entropy(sequence_output, self.lm_head.weight, labels, self.config.label_smoothing,
                                        self.config.z_loss, num_items_in_batch, self.config.lm_loss_implementation)
        else:
            logits = self.lm_head(sequence_output)
            if labels is not None:
                loss = seq2seq_lm_loss(logits, labels, self.config.label_smoothing, self.config.z_loss,
                                       num_items_in_batch)
        return self._output(Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **cache_field(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        ), return_dict)

    def get_compiled_call(self, compile_config):
        """What `generate` runs its decode steps with when it would compile them (a static cache on CUDA): FAT5's
        forward, which replays its captured decode step (generation_fat5.py; seconds to capture, no Inductor), unless
        the call names a `compile_config` or the captured step is off (`config.decode_cuda_graphs = 0`)."""
        if compile_config is None and self.config.decode_cuda_graphs:
            return self.__call__
        return super().get_compiled_call(compile_config)

    def captured_decode_steps(self):
        """The decode steps captured for generation (generation_fat5.py), least recently used first: one dict each,
        its bucket (batch, cache_slots, encoder_length), the memory it holds (cache_mib, pool_mib) and capture_s."""
        return self._decode_graphs.describe()

    def release_decode_steps(self):
        """Drop the captured decode steps now (their memory goes back to torch's allocator)."""
        self._decode_graphs.release()

    def train(self, mode=True):
        # A captured step is eval mode's (no dropout): training drops them.
        if mode and "_decode_graphs" in vars(self):
            self._decode_graphs.release()
        return super().train(mode)

    def _apply(self, *args, **kwargs):
        # `.to()`, `.half()`, `.cuda()` and the like move the weights a captured step reads: drop them first.
        if "_decode_graphs" in vars(self):
            self._decode_graphs.release()
        return super()._apply(*args, **kwargs)

    def text2text_pipeline(self, tokenizer, **kwargs):
        """This model's text2text-generation pipeline (see `pipeline_fat5.text2text_pipeline`); works where the
        model came from a checkpoint folder with trust_remote_code as well as with FAT5 installed."""
        from .pipeline_fat5 import text2text_pipeline

        return text2text_pipeline(self, tokenizer, **kwargs)

    def _loss_without_logits(self):
        """Training computes the loss chunk by chunk and returns no logits (8 GB in fp32 at mT5's vocabulary and
        8k target tokens), unless config.return_logits_in_training asks for them. Evaluation keeps the logits.
        A head that is not a plain bias-free Linear (e.g. wrapped by PEFT), or one partitioned by DeepSpeed
        ZeRO-3 (gathered only when its own forward runs), goes through the full logits."""
        head = self.lm_head
        return (self.training and not self.config.return_logits_in_training and type(head) is nn.Linear
                and head.bias is None and not hasattr(head.weight, "ds_id"))

    def prepare_decoder_input_ids_from_labels(self, labels):
        return self._shift_right(labels)


class FAT5EncoderMixin:
    """Shared plumbing of the encoder-only classes; a seq2seq checkpoint loads into them (decoder ignored)."""

    if not HAS_GENERIC_GET_ENCODER:
        get_encoder = get_own_encoder

    _keys_to_ignore_on_load_unexpected = [r"decoder\.", r"lm_head\."]
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config):
        # As T5's encoder-only classes do, the model's config says it is no encoder-decoder and keeps no cache
        # (transformers' output checks, pipelines and saved folders read these); unlike T5, on a copy, so the
        # caller's config still describes the seq2seq model it came from.
        config = copy.deepcopy(config)
        config.is_encoder_decoder = False
        config.use_cache = False
        super().__init__(config)

    def _build_encoder(self):
        share_embedding(self, self.config, ("encoder",))

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = new_embeddings
        self.encoder.set_input_embeddings(new_embeddings)

    def _encode(self, input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions=None,
                segment_ids=None):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                            segment_ids=segment_ids, return_dict=True)


class FAT5EncoderModel(FAT5EncoderMixin, FAT5PreTrainedModel):
    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self._build_encoder()
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_hidden_states=None,
                return_dict=None, output_attentions=None, segment_ids=None, **kwargs):
        """`segment_ids` (B, L): packed rows, 1, 2, ... per example and 0 for padding; examples do not see
        each other and positions restart at each."""
        check_keywords(self, kwargs)
        outputs = self._encode(input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions,
                               segment_ids)
        return self._output(BaseModelOutput(last_hidden_state=outputs.last_hidden_state,
                                            hidden_states=outputs.hidden_states, attentions=outputs.attentions),
                            return_dict)


def _reject_segment_ids(kwargs, class_name):
    if kwargs.pop("segment_ids", None) is not None:
        raise ValueError(f"{class_name} takes one example per row: packed batches (segment_ids) are not supported")


class FAT5ClassificationHead(nn.Module):
    """Dense-tanh-projection head, as T5ForSequenceClassification's."""

    def __init__(self, config):
        super().__init__()
        self.dense = t5_linear(config.d_model, config.d_model, init_std=config.d_model**-0.5, bias=True)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.out_proj = t5_linear(config.d_model, config.num_labels, init_std=config.d_model**-0.5, bias=True)

    def forward(self, hidden_states):
        hidden_states = torch.tanh(self.dense(self.dropout(hidden_states)))
        return self.out_proj(self.dropout(hidden_states))


class FAT5ForSequenceClassification(FAT5EncoderMixin, FAT5PreTrainedModel):
    """Encoder + mean pooling over real tokens + classification head; regression when num_labels == 1."""

    # The loss is a mean over the batch's examples: the Trainer divides it by the gradient-accumulation steps
    # rather than passing num_items_in_batch (which `**kwargs` in forward would otherwise announce).
    accepts_loss_kwargs = False

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self._build_encoder()
        self.classification_head = FAT5ClassificationHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, return_dict=None, output_attentions=None, **kwargs):
        _reject_segment_ids(kwargs, "FAT5ForSequenceClassification")
        check_keywords(self, kwargs)
        outputs = self._encode(input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions)
        hidden = outputs.last_hidden_state
        if attention_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        logits = self.classification_head(pooled)
        loss = None
        if labels is not None:
            # transformers' own rule: config.problem_type when set, else inferred (and recorded) from num_labels
            # and the labels' dtype.
            loss = ForSequenceClassificationLoss(labels, logits.float(), self.config)
        return self._output(SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                                     attentions=outputs.attentions), return_dict)


class FAT5ForTokenClassification(FAT5EncoderMixin, FAT5PreTrainedModel):
    accepts_loss_kwargs = True  # num_items_in_batch, as FAT5ForConditionalGeneration's
    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self._build_encoder()
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = t5_linear(config.d_model, config.num_labels, init_std=config.d_model**-0.5, bias=True)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, return_dict=None, output_attentions=None, segment_ids=None,
                num_items_in_batch=None, **kwargs):
        """`num_items_in_batch` (from the Trainer): labelled tokens in the whole accumulated batch, so gradient
        accumulation weighs every token alike however the tokens fall into micro-batches."""
        check_keywords(self, kwargs)
        outputs = self._encode(input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions,
                               segment_ids)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = ForTokenClassification(logits, labels, self.config, num_items_in_batch=num_items_in_batch)
        return self._output(TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                                  attentions=outputs.attentions), return_dict)


class FAT5ForQuestionAnswering(FAT5EncoderMixin, FAT5PreTrainedModel):
    """Extractive QA: start/end logits over the encoder tokens."""

    accepts_loss_kwargs = False  # a mean over examples, as FAT5ForSequenceClassification's

    def __init__(self, config: FAT5Config):
        super().__init__(config)
        self._build_encoder()
        self.qa_outputs = t5_linear(config.d_model, 2, init_std=config.d_model**-0.5, bias=True)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, start_positions=None,
                end_positions=None, output_hidden_states=None, return_dict=None, output_attentions=None, **kwargs):
        _reject_segment_ids(kwargs, "FAT5ForQuestionAnswering")
        check_keywords(self, kwargs)
        outputs = self._encode(input_ids, attention_mask, inputs_embeds, output_hidden_states, output_attentions)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).float().unbind(dim=-1)
        # Positions outside the sequence are ignored, as in transformers' QA heads.
        loss = ForQuestionAnsweringLoss(start_logits, end_logits, start_positions, end_positions)
        return self._output(QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                                         hidden_states=outputs.hidden_states,
                                                         attentions=outputs.attentions), return_dict)


__all__ = [
    "FAT5PreTrainedModel",
    "FAT5Model",
    "FAT5EncoderModel",
    "FAT5ForConditionalGeneration",
    "FAT5ForSequenceClassification",
    "FAT5ForTokenClassification",
    "FAT5ForQuestionAnswering",
]
