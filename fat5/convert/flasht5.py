"""The flashT5 layout (github.com/catie-aq/flashT5, the code of CATIE-AQ's FAT5 models on the Hub) onto FAT5:
its config.json fields and tensor names. `python -m convert.flan_to_fat5` plans a folder whose config.json says
`model_type: flash_t5` with `plan_flasht5_conversion`, then writes and proves it as it does a T5's.

What flashT5 computes, and how FAT5 is told to compute the same (`fat5_config_fields`):
- the MLP comes from `use_glu_mlp` and `use_gelu_act` (tanh GELU); `feed_forward_proj` and the fields T5Config
  derives from it are leftovers its model never reads; it is an encoder-decoder whatever `is_encoder_decoder` says;
- `attention_scale` multiplies q.k before the bias (null: 1/sqrt(num_heads)); the LM head is untied and nothing is
  rescaled before it; the loss is cross-entropy with label smoothing plus z-loss, averaged over labelled tokens;
- the T5, ALiBi or FIRE encoding belongs to each stack's block 0 and is shared by its blocks; RoPE rotates q, k and
  v in every attention, cross-attention included; FIRE feeds query - key (FAT5: key - query) and normalises by the
  0-based query position plus 1e-6; ALiBi has an asymmetric mode;
- attention masks are ignored (or, with `use_masking`, they mask query rows): FAT5 masks padding keys, so it
  computes flashT5's values on unpadded rows and, on a padded batch, each row's values as if alone.
What flashT5 itself cannot run (random positions with t5 or ALiBi, a tied head, a -100 pad token, xPos) is refused
in one line naming the field. flashT5's tensor names are mapped by `fat5_tensor_name`; FIRE's first MLP weight is
negated (the distance's sign) and its threshold is the product of its two stored factors.
"""

import math
import re

import torch

from fat5.cli import error_line
from fat5.configuration_fat5 import FAT5Config
from fat5.convert.checkpoint import (
    EMBEDDING_COPIES,
    UNUSED_SOURCE_TENSORS,
    ConversionError,
    ConversionPlan,
    TensorSource,
    check_tensors,
    model_shapes,
    read_config,
)
from fat5.convert.flasht5_reference import FlashT5Reference
from fat5.modeling_fat5 import FAT5ForConditionalGeneration

MODEL_TYPE = "flash_t5"
# FlashT5Config's own defaults: what flashT5 computes with when config.json lacks the key (its T5 fields take
# T5Config's defaults, which are FAT5Config's; T5Config ties the embeddings by default).
DEFAULTS = {
    "pad_token_id": -100, "decoder_start_token_id": 0, "use_glu_mlp": False, "use_gelu_act": True,
    "position_encoding_type": "t5", "use_randomized_position_encoding": False, "label_smoothing": 0.0,
    "z_loss": None, "attention_type": "ref", "max_sequence_length": 1024, "attention_dropout_rate": 0.0,
    "alibi_mode": "symetric", "use_triton_layernorm": False, "use_triton_crossentropy": False,
    "crossentropy_inplace_backward": False, "use_full_bias_size": False, "rotary_emb_fraction": 1.0,
    "rotary_base": 10000, "rotary_interleaved": False, "rotary_scale_base": None, "fire_mlp_width": 32,
    "use_masking": False, "attention_scale": None, "tie_word_embeddings": True, "num_heads": 8,
    "relative_attention_max_distance": 128,
}
POSITION_ENCODINGS = {"t5": "t5", "RoPE": "rope", "ALiBi": "alibi", "FIRE": "fire"}
ALIBI_MODES = {"symetric": "symmetric", "asymetric": "asymmetric"}  # flashT5's spelling -> FAT5's
# flashT5's FIRE: the normaliser's query position counts from 0 and 1e-6 is added to it.
FIRE_NORMALIZER = {"fire_normalizer_offset": 0, "fire_normalizer_eps": 1e-6}
# How flashT5 computes, not what: kernels and bias layouts of the same values (FAT5 picks its own backend,
# --attn-implementation). `use_triton_crossentropy` also averages the training loss over ignored (-100) rows; FAT5
# computes the loss of flashT5's torch path, which averages over labelled tokens (docs/conversion.md).
IMPLEMENTATION_FIELDS = ("attention_type", "use_triton_layernorm", "use_triton_gated_mlp", "use_triton_crossentropy",
                         "crossentropy_inplace_backward", "use_full_bias_size")
# flashT5's limit on sequence lengths (its RoPE and ALiBi tables, its random positions); FAT5 has none and computes
# the same values within it.
LENGTH_FIELDS = ("max_sequence_length",)
# Padding: flashT5 ignores masks unless `use_masking`, which then masks query rows only; FAT5 masks padding keys.
PADDING_FIELDS = ("use_masking",)
# Parameters of one position encoding: translated for it (`position_fields`), without effect on the others.
ENCODING_FIELDS = {"rope": ("rotary_base", "rotary_emb_fraction", "rotary_interleaved", "rotary_scale_base"),
                   "alibi": ("alibi_mode",)}
# What the converter writes itself (identity, code, stored dtype) and what flashT5's model never reads: its MLP
# comes from use_glu_mlp / use_gelu_act, it is an encoder-decoder and never rescales before its untied head.
NOT_CARRIED = ("model_type", "architectures", "transformers_version", "auto_map", "custom_pipelines", "_name_or_path",
               "dtype", "torch_dtype", "tested_transformers", "is_encoder_decoder", "is_decoder", "feed_forward_proj",
               "dense_act_fn", "is_gated_act", "scale_decoder_outputs")
# FAT5 fields flashT5 has no counterpart of: in a flashT5 config.json they are nothing flashT5 computes with, and
# carrying them would change what FAT5 computes.
FAT5_ONLY_FIELDS = ("relative_bias_per_layer", "attention_backend", "rope_theta", "fire_init_c", "fire_init_threshold",
                    "partial_rotary_factor", "rope_interleaved", "rope_cross_attention", "rope_rotates_values",
                    "fire_normalizer_offset", "fire_normalizer_eps", "return_logits_in_training",
                    "lm_loss_implementation", "decode_cuda_graphs")


def refuse(name, value, why):
    raise ConversionError(f"{name} {value!r}: {why}")


def positive(value):
    """Whether `value` is a positive number (bool excluded); config.json may hold anything."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def position_fields(config, kind):
    """FAT5's fields for flashT5's position encoding `kind` (FAT5's name), from its parameters in `config`."""
    if kind == "rope":
        if config["rotary_scale_base"] is not None:
            refuse("rotary_scale_base", config["rotary_scale_base"], "flashT5's xPos scaling of RoPE has no FAT5 "
                   "counterpart")
        if not positive(config["rotary_base"]):
            refuse("rotary_base", config["rotary_base"], "RoPE's base must be a positive number")
        fraction, head_dim = config["rotary_emb_fraction"], config.get("d_kv", 64)
        rotated = int(head_dim * fraction) if positive(fraction) and positive(head_dim) else 0
        # (a bad d_kv is refused by FAT5Config, naming it)
        if positive(head_dim) and not (positive(fraction) and fraction <= 1 and rotated > 0 and rotated % 2 == 0):
            refuse("rotary_emb_fraction", fraction, "RoPE rotates an even, positive number of channels "
                   f"(int(d_kv * rotary_emb_fraction) = {rotated})")
        return {"rope_theta": float(config["rotary_base"]), "partial_rotary_factor": config["rotary_emb_fraction"],
                "rope_interleaved": config["rotary_interleaved"], "rope_cross_attention": True,
                "rope_rotates_values": True}
    if kind == "alibi":
        mode = config["alibi_mode"]
        if mode not in ALIBI_MODES:
            refuse("alibi_mode", mode, f"flashT5 implements {' and '.join(map(repr, ALIBI_MODES))} only")
        return {"alibi_mode": ALIBI_MODES[mode]}
    if kind == "fire":
        # fire_init_*: FAT5's initialisation of a fresh FIRE module, as flashT5's (the values are in the weights).
        distance = config["relative_attention_max_distance"]  # FAT5Config refuses a bad one by name
        return {**FIRE_NORMALIZER, "fire_init_c": 0.1, **({"fire_init_threshold": float(distance)}
                                                          if positive(distance) else {})}
    return {}


def fat5_config_fields(source_config):
    """The FAT5Config fields of a flashT5 config.json dict: every key carried, translated or refused in one line
    naming it (ConversionError). Keys flashT5's model does not read (transformers' generic ones, any other) are
    carried, as the T5 path carries them."""
    config = {**DEFAULTS, **source_config}
    fat5_only = sorted(set(FAT5_ONLY_FIELDS) & set(source_config))
    if fat5_only:
        name = fat5_only[0]
        refuse(name, source_config[name], "a FAT5 field, not one of flashT5's: flashT5 does not compute with it")
    if config["tie_word_embeddings"] is not False:
        refuse("tie_word_embeddings", config["tie_word_embeddings"], "flashT5's FlashT5ForConditionalGeneration "
               "requires untied embeddings (it asserts tie_word_embeddings is false)")
    pad = config["pad_token_id"]
    if pad is not None and not (isinstance(pad, int) and pad >= 0):
        refuse("pad_token_id", pad, "not a token id (-100 is FlashT5Config's default, which its _shift_right "
               "feeds to the embedding): set pad_token_id in config.json to the tokenizer's pad token id")
    kind = POSITION_ENCODINGS.get(config["position_encoding_type"])
    if kind is None:
        refuse("position_encoding_type", config["position_encoding_type"], "flashT5 knows "
               f"{', '.join(POSITION_ENCODINGS)} (any other value computes no position encoding, surely not meant)")
    if config["use_randomized_position_encoding"] and kind in ("t5", "alibi"):
        why = ("flashT5 draws random positions on every forward, evaluation included, which no deterministic "
               "model reproduces" if kind == "t5" else "flashT5's randomised ALiBi fails with a shape error")
        refuse("use_randomized_position_encoding", True, why)
    scale, heads = config["attention_scale"], config["num_heads"]
    if scale is None and positive(heads):  # null: flashT5's 1/sqrt(num_heads) (not of d_kv)
        scale = 1.0 / math.sqrt(heads)  # (a bad num_heads is refused by FAT5Config, naming it, before the scale)
    translated = {
        "position_encoding_type": kind,
        **position_fields(config, kind),
        "feed_forward_proj": ("gated-" if config["use_glu_mlp"] else "")
        + ("gelu_pytorch_tanh" if config["use_gelu_act"] else "relu"),
        "attention_scale": scale,
        # null: flashT5's loss raises a TypeError with labels; FAT5 computes it without z-loss
        "z_loss": 0.0 if config["z_loss"] is None else config["z_loss"],
        "tie_word_embeddings": False,
        "scale_decoder_outputs": False,
        # FlashT5Config's defaults where they differ from FAT5Config's
        "decoder_start_token_id": config["decoder_start_token_id"],
        "attention_dropout_rate": config["attention_dropout_rate"],
    }
    read_into_translation = {"use_glu_mlp", "use_gelu_act", "use_randomized_position_encoding"} | {
        name for names in ENCODING_FIELDS.values() for name in names}
    not_carried = (set(translated) | read_into_translation | set(NOT_CARRIED) | set(IMPLEMENTATION_FIELDS)
                   | set(LENGTH_FIELDS) | set(PADDING_FIELDS))
    carried = {name: value for name, value in source_config.items() if name not in not_carried}
    return {**carried, **translated}


# flashT5 tensor names (below each stack's block N: `{stack}.block.{block}.`) -> FAT5's. `ff` is the FAT5 layer index
# of the feed-forward layer: 1 in the encoder, 2 in the decoder (after cross-attention).
BLOCK = r"(?P<stack>encoder|decoder)\.block\.(?P<block>\d+)\."
SELF = BLOCK + r"self_attention_layer\."
ENCODING = SELF + r"self_attention\.pe_encoding\."
TENSOR_NAMES = tuple((re.compile(pattern), template) for pattern, template in (
    (r"shared\.weight", "shared.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"(?P<stack>encoder|decoder)\.final_layer_norm\.weight", "{stack}.final_layer_norm.weight"),
    (SELF + r"self_attention\.W(?P<projection>[qkv])\.weight", "{layer}.0.SelfAttention.{projection}.weight"),
    (SELF + r"self_attention\.o\.weight", "{layer}.0.SelfAttention.o.weight"),
    (ENCODING + r"relative_attention_bias\.weight", "{layer}.0.SelfAttention.relative_attention_bias.weight"),
    (ENCODING + r"mlp\.0\.(?P<part>weight|bias)", "{layer}.0.SelfAttention.fire.mlp_in.{part}"),
    (ENCODING + r"mlp\.2\.(?P<part>weight|bias)", "{layer}.0.SelfAttention.fire.mlp_out.{part}"),
    (ENCODING + r"c", "{layer}.0.SelfAttention.fire.c"),
    (ENCODING + r"(?:init_L|L_multiplier)", "{layer}.0.SelfAttention.fire.threshold"),
    (SELF + r"layer_norm\.weight", "{layer}.0.layer_norm.weight"),
    (BLOCK + r"cross_attention_layer\.cross_attention\.W(?P<projection>[qkv])\.weight",
     "{layer}.1.EncDecAttention.{projection}.weight"),
    (BLOCK + r"cross_attention_layer\.cross_attention\.o\.weight", "{layer}.1.EncDecAttention.o.weight"),
    (BLOCK + r"cross_attention_layer\.layer_norm\.weight", "{layer}.1.layer_norm.weight"),
    (BLOCK + r"ff_layer\.layer_norm\.weight", "{layer}.{ff}.layer_norm.weight"),
    (BLOCK + r"ff_layer\.act\.(?P<wi>wi|wi_0|wi_1)\.weight", "{layer}.{ff}.DenseReluDense.{wi}.weight"),
    (BLOCK + r"ff_layer\.wo\.weight", "{layer}.{ff}.DenseReluDense.wo.weight"),
))


def fat5_tensor_name(name):
    """FAT5's name for the flashT5 tensor `name`, or None when flashT5 has no such tensor."""
    for pattern, template in TENSOR_NAMES:
        match = pattern.fullmatch(name)
        if match:
            parts = match.groupdict()
            if "block" in parts:
                parts["layer"] = f"{parts['stack']}.block.{parts['block']}.layer"
                parts["ff"] = 1 if parts["stack"] == "encoder" else 2
            return template.format(**parts)
    return None


def negated(weight):
    """FIRE's first MLP weight: flashT5 feeds it query - key, FAT5 key - query (exact: -x * -w == x * w)."""
    return -weight


def product(first, second):
    """FIRE's threshold, stored by flashT5 as init_L times a learnt L_multiplier (in that product's dtype)."""
    return first * second


class FlashT5Tensors:
    """A flashT5 checkpoint's tensors under FAT5's names (the embed_tokens aliases of shared.weight, and the table
    transformers' T5 never uses, under their own), FIRE's translated: the TensorSource interface
    `fat5.convert.checkpoint` checks and the exporter reads. A tensor flashT5 does not have is refused by name."""

    def __init__(self, source):
        self.source = source
        self._origins = {}  # FAT5 name -> (flashT5 names, function of their tensors)
        for name in sorted(source.names()):
            if name in EMBEDDING_COPIES or name in UNUSED_SOURCE_TENSORS:
                target = name
            else:
                target = fat5_tensor_name(name)
            if target is None:
                raise ConversionError(f"flashT5 tensor {name} has no FAT5 counterpart (not a tensor of flashT5's "
                                      "FlashT5ForConditionalGeneration)")
            names = self._origins.get(target, ((), None))[0] + (name,)
            self._origins[target] = names, product if target.endswith("fire.threshold") else (
                negated if target.endswith("fire.mlp_in.weight") else None)
        for target, (names, _) in self._origins.items():
            if target.endswith("fire.threshold") and len(names) != 2:
                stem = names[0].rsplit(".", 1)[0]
                raise ConversionError(f"flashT5 FIRE tensors {stem}.init_L and {stem}.L_multiplier come together "
                                      f"(its threshold is their product); the checkpoint has only {names[0]}")

    def origin(self, name):
        """The flashT5 tensor(s) FAT5's `name` is made of."""
        return self._origins[name][0]

    def names(self):
        return list(self._origins)

    def shape(self, name):
        shapes = [self.source.shape(part) for part in self.origin(name)]
        try:
            return tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            raise ConversionError(f"flashT5 tensors {' and '.join(self.origin(name))} have shapes {shapes} that "
                                  "do not multiply") from None

    def dtype(self, name):
        dtypes = [self.source.dtype(part) for part in self.origin(name)]
        return dtypes[0] if len(dtypes) == 1 else torch.promote_types(*dtypes)

    def get(self, name):
        names, function = self._origins[name]
        tensors = [self.source.get(part) for part in names]
        return tensors[0] if function is None else function(*tensors)

    def release(self, name):
        for part in self.origin(name):
            self.source.release(part)


def plan_flasht5_conversion(folder):
    """flashT5 -> FAT5: the config translated, every tensor of `folder` mapped (or a copy of shared.weight, or the
    table transformers' T5 never uses), checked against the FAT5 model the config describes; the parity proof's
    reference is `FlashT5Reference`."""
    source_config = read_config(folder)
    if source_config.get("model_type") != MODEL_TYPE:
        raise ConversionError(f"{folder} is not a flashT5 checkpoint (config.json model_type "
                              f"{source_config.get('model_type')!r})")
    try:
        config = FAT5Config(**fat5_config_fields(source_config), architectures=["FAT5ForConditionalGeneration"])
    except (ValueError, TypeError) as error:
        raise ConversionError(f"inconsistent source config: {error_line(error)}") from error
    source = FlashT5Tensors(TensorSource(folder))
    names = set(source.names())
    if "shared.weight" not in names:
        raise ConversionError("flashT5 checkpoint has no shared.weight (the token embedding)")
    if not any(name.startswith("decoder.block.") for name in names):
        raise ConversionError("flashT5 checkpoint has no decoder: an encoder-only one (FlashT5EncoderModel, or a "
                              "classification head) has no FAT5 encoder-decoder to convert into")
    with torch.device("meta"):
        shapes = model_shapes(FAT5ForConditionalGeneration(config), tied=False)
    redundant = {name: "shared.weight" for name in EMBEDDING_COPIES if name in names}
    unused = [name for name in UNUSED_SOURCE_TENSORS if name in names]
    unexpected = sorted(names - set(shapes) - set(redundant) - set(unused))
    if unexpected:
        raise ConversionError(f"flashT5 tensor {source.origin(unexpected[0])[0]} has no counterpart in the FAT5 "
                              f"model its config describes (e.g. a position encoding in a block other than 0, "
                              f"a gated MLP weight with use_glu_mlp false; {len(unexpected)} unmapped in total)")
    mapping = check_tensors(source, shapes, ("flashT5", "FAT5"), redundant, unused)
    return ConversionPlan(source=source, config=config, source_config=source_config, mapping=mapping,
                          redundant=redundant, ignored=unused, shapes=shapes, load_reference=load_reference)


def load_reference(folder, dtype=None):
    """flashT5's computation on `folder`'s weights: flashT5's code cannot run here (its RoPE needs flash_attn's
    CUDA kernels, its model fails on transformers 5), so its semantics, written in convert/flasht5_reference.py."""
    return FlashT5Reference.from_folder(folder, DEFAULTS, dtype)
