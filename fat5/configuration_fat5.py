"""FAT5 configuration: T5's fields, plus the position encoding and attention backend choices."""

import copy
import math

from transformers import PretrainedConfig

from .compat_fat5 import CACHE_NAME, warn_if_untested
from .integrations_fat5 import register_with_imported_libraries
from .pickling_fat5 import PicklesWithItsCode

POSITION_ENCODING_TYPES = ("t5", "rope", "alibi", "fire", "none")
ATTENTION_BACKENDS = ("auto", "eager", "sdpa", "triton")
ALIBI_MODES = ("symmetric", "asymmetric")
LM_LOSS_IMPLEMENTATIONS = ("chunked", "liger")


def _integer(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _feed_forward_proj(value):
    from transformers.activations import ACT2FN

    if not isinstance(value, str):
        return False
    parts = value.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        return False
    return ("gelu_new" if value == "gated-gelu" else parts[-1]) in ACT2FN


def _token_id(value):
    return _integer(value) and value >= 0


# What each field must hold, checked on every assignment (config.json at load, `from_pretrained(..., field=...)`,
# later changes), so a bad value fails with one line naming the field instead of at the first forward.
_RULES = (
    (("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "relative_attention_num_buckets",
      "relative_attention_max_distance", "fire_mlp_width"), lambda value: _integer(value) and value > 0,
     "a positive integer"),
    (("num_layers", "num_decoder_layers"), lambda value: _integer(value) and value >= 0, "a non-negative integer"),
    (("dropout_rate", "classifier_dropout", "label_smoothing"), lambda value: _number(value) and 0 <= value < 1,
     "a number in [0, 1)"),
    (("attention_dropout_rate",), lambda value: value is None or (_number(value) and 0 <= value < 1),
     "a number in [0, 1), or null for dropout_rate's value"),
    (("partial_rotary_factor",), lambda value: _number(value) and 0 < value <= 1, "a number in (0, 1]"),
    (("fire_normalizer_offset", "decode_cuda_graphs"), lambda value: _integer(value) and value >= 0,
     "a non-negative integer"),
    (("layer_norm_epsilon", "initializer_factor", "attention_scale", "rope_theta", "fire_init_c",
      "fire_init_threshold"), lambda value: _number(value) and value > 0, "a finite number > 0"),
    (("z_loss", "fire_normalizer_eps"), lambda value: _number(value) and value >= 0, "a finite number >= 0"),
    (("tie_word_embeddings", "scale_decoder_outputs", "relative_bias_per_layer", "return_logits_in_training",
      "use_cache", "is_encoder_decoder", "rope_interleaved", "rope_cross_attention", "rope_rotates_values"),
     lambda value: isinstance(value, bool), "true or false"),
    (("position_encoding_type",), lambda value: value in POSITION_ENCODING_TYPES,
     f"one of {POSITION_ENCODING_TYPES}"),
    (("attention_backend",), lambda value: value in ATTENTION_BACKENDS, f"one of {ATTENTION_BACKENDS}"),
    (("alibi_mode",), lambda value: value in ALIBI_MODES, f"one of {ALIBI_MODES}"),
    (("lm_loss_implementation",), lambda value: value in LM_LOSS_IMPLEMENTATIONS, f"one of {LM_LOSS_IMPLEMENTATIONS}"),
    (("feed_forward_proj",), _feed_forward_proj,
     "of the form 'ACT' or 'gated-ACT' with ACT a transformers activation (e.g. 'relu', 'gated-gelu', 'gated-silu')"),
    # As in T5Config, pad_token_id may be null (generate then pads with eos; training from labels needs it and
    # says so); the decoder always starts from a token.
    (("pad_token_id",), lambda value: value is None or _token_id(value), "a token id or null"),
    (("decoder_start_token_id",), _token_id, "a token id (the decoder starts from it; T5 uses 0, its pad token)"),
    (("eos_token_id",), lambda value: value is None or _token_id(value)
     or (isinstance(value, list) and all(_token_id(item) for item in value)), "a token id, a list of them or null"),
)
FIELD_RULES = {name: (test, description) for names, test, description in _RULES for name in names}


class FAT5Config(PicklesWithItsCode, PretrainedConfig):
    r"""
    Configuration of a FAT5 encoder-decoder. Field names and defaults follow transformers' `T5Config`, so a T5
    user's configs carry over; FAT5 adds:

    position_encoding_type (`str`, defaults to `"t5"`):
        `"t5"` (bucketed relative bias, what every converted checkpoint uses), `"rope"`, `"alibi"`, `"fire"` or
        `"none"` (the last four for models trained from scratch).
    relative_bias_per_layer (`bool`, defaults to `False`):
        umT5 style: every layer owns a bias table instead of sharing the first layer's.
    scale_decoder_outputs (`bool`, *optional*):
        Multiply the decoder output by `d_model**-0.5` before the LM head (T5 v1.0). Defaults to
        `tie_word_embeddings`, which is how T5 couples the two.
    attention_scale (`float`, defaults to 1.0):
        Scale of the q·k product. T5 folds 1/sqrt(d_kv) into its initialisation, so it uses 1.0.
    attention_dropout_rate (`float`, *optional*):
        Dropout on attention probabilities. Unset (or null), it is `dropout_rate`, read whenever it is used, as in
        T5, whose `dropout_rate` is its attention dropout too: `from_pretrained(folder, dropout_rate=0.0)` turns
        every dropout off unless `attention_dropout_rate` is given as well. Saved only when set. A config.json
        value equal to its `dropout_rate` (what converters before this rule wrote for every folder) reads as unset.
        Every backend applies it in training, the Triton kernel included: it drops probabilities in-kernel with a
        Philox generator seeded from torch's, scaled by 1 / (1 - p) as T5 does.
    attention_backend (`str`, defaults to `"auto"`):
        `"auto"` uses the Triton kernel for CUDA tensors when Triton is installed and SDPA otherwise;
        `"eager"`, `"sdpa"` or `"triton"` force one.
    rope_theta (`float`), fire_mlp_width (`int`), fire_init_c (`float`), fire_init_threshold (`float`):
        Parameters of RoPE and FIRE.
    alibi_mode (`str`, defaults to `"symmetric"`):
        `"symmetric"`: every head's bias is `-slope * |j - i|`. `"asymmetric"` (bidirectional ALiBi as flashT5
        trains it): the first half of the heads sees only keys j <= i, the second half only keys j >= i, each half
        with the slopes of num_heads / 2 heads. Its bias is dense, so the Triton kernel does not run it.
    partial_rotary_factor (`float`, defaults to 1.0):
        RoPE rotates the first `int(d_kv * partial_rotary_factor)` channels of each head and leaves the rest.
    rope_interleaved (`bool`, defaults to `False`):
        RoPE rotates channel pairs (0, 1), (2, 3), ... (GPT-J style) instead of (i, i + dim / 2) (GPT-NeoX style).
    rope_cross_attention (`bool`, defaults to `False`):
        Also rotate cross-attention: queries by their decoder position, keys by their encoder position.
    rope_rotates_values (`bool`, defaults to `False`):
        Also rotate the values by their key position (flashT5 does; the outputs are not rotated back).
    fire_normalizer_offset (`int`, defaults to 1), fire_normalizer_eps (`float`, defaults to 0.0):
        FIRE divides by `psi(max(threshold, i + fire_normalizer_offset)) + fire_normalizer_eps` for the 0-based
        query position i (flashT5: offset 0, eps 1e-6).
    z_loss (`float`), label_smoothing (`float`):
        Extra terms of the language-modelling loss (z-loss as in PaLM: `z_loss * logsumexp(logits)**2`).
    return_logits_in_training (`bool`, defaults to `False`):
        In training, `FAT5ForConditionalGeneration` computes the LM head and its loss chunk by chunk without
        materialising the logits, and returns `logits=None`. Set True to get the logits (full-vocabulary fp32
        memory). Evaluation (`model.eval()`) always returns them.
    lm_loss_implementation (`str`, defaults to `"chunked"`):
        `"chunked"`: FAT5's chunked linear cross-entropy (any device). `"liger"`: liger-kernel's fused linear
        cross-entropy (CUDA only, `pip install fat5[liger]`).
    decode_cuda_graphs (`int`, defaults to 2):
        On CUDA, generation with a static cache (`cache_implementation="static"`) replays its decode step from a
        CUDA graph captured on the first step of each (batch, cache length, encoder length): at most this many
        are kept per model, the least recently used dropped first (each holds its caches' memory). 0 turns the
        captured step off (`generation_fat5.py`).
    """

    model_type = "fat5"
    # Output fields the Trainer leaves out of evaluation predictions (the cache, under the installed name).
    keys_to_ignore_at_inference = [CACHE_NAME]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "num_hidden_layers": "num_layers",
        "head_dim": "d_kv",
    }

    def __init__(
        self,
        vocab_size=32128,
        d_model=512,
        d_kv=64,
        d_ff=2048,
        num_layers=6,
        num_decoder_layers=None,
        num_heads=8,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.1,
        attention_dropout_rate=None,
        classifier_dropout=0.0,
        layer_norm_epsilon=1e-6,
        initializer_factor=1.0,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        scale_decoder_outputs=None,
        position_encoding_type="t5",
        relative_bias_per_layer=False,
        attention_scale=1.0,
        attention_backend="auto",
        rope_theta=10000.0,
        fire_mlp_width=32,
        fire_init_c=0.1,
        fire_init_threshold=512.0,
        alibi_mode="symmetric",
        partial_rotary_factor=1.0,
        rope_interleaved=False,
        rope_cross_attention=False,
        rope_rotates_values=False,
        fire_normalizer_offset=1,
        fire_normalizer_eps=0.0,
        z_loss=0.0,
        label_smoothing=0.0,
        return_logits_in_training=False,
        lm_loss_implementation="chunked",
        decode_cuda_graphs=2,
        is_encoder_decoder=True,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.d_kv = d_kv
        self.d_ff = d_ff
        self.num_layers = num_layers
        self.num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        self.num_heads = num_heads
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate
        self.classifier_dropout = classifier_dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_factor = initializer_factor
        self.feed_forward_proj = feed_forward_proj
        self.scale_decoder_outputs = tie_word_embeddings if scale_decoder_outputs is None else scale_decoder_outputs
        self.position_encoding_type = position_encoding_type
        self.relative_bias_per_layer = relative_bias_per_layer
        self.attention_scale = attention_scale
        self.attention_backend = attention_backend
        self.rope_theta = rope_theta
        self.fire_mlp_width = fire_mlp_width
        self.fire_init_c = fire_init_c
        self.fire_init_threshold = fire_init_threshold
        self.alibi_mode = alibi_mode
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_interleaved = rope_interleaved
        self.rope_cross_attention = rope_cross_attention
        self.rope_rotates_values = rope_rotates_values
        self.fire_normalizer_offset = fire_normalizer_offset
        self.fire_normalizer_eps = fire_normalizer_eps
        self.z_loss = z_loss
        self.label_smoothing = label_smoothing
        self.return_logits_in_training = return_logits_in_training
        self.lm_loss_implementation = lm_loss_implementation
        self.decode_cuda_graphs = decode_cuda_graphs
        self.use_cache = use_cache
        # T5 starts decoding from the pad token.
        decoder_start_token_id = pad_token_id if decoder_start_token_id is None else decoder_start_token_id
        # transformers 5 drops unknown kwargs it derives itself; keep T5's derived fields out of **kwargs.
        for derived in ("dense_act_fn", "is_gated_act", "is_decoder"):
            kwargs.pop(derived, None)
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            decoder_start_token_id=decoder_start_token_id,
            is_encoder_decoder=is_encoder_decoder,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        # transformers 4.x reads the tie flag from the config object, 5.x from the init kwarg; set both.
        self.tie_word_embeddings = tie_word_embeddings
        self._validate_fat5()
        warn_if_untested()
        # sentence-transformers, optimum and CTranslate2, when imported, learn FAT5 here: they read the config
        # first, then look the class up in their tables.
        register_with_imported_libraries(type(self))

    def __setattr__(self, key, value):
        # Checked on every assignment, so `from_pretrained(..., dropout_rate=...)` (which sets attributes after
        # __init__) fails at load time rather than at the first forward.
        name = self.attribute_map.get(key, key)
        if name in FIELD_RULES:
            test, description = FIELD_RULES[name]
            try:
                valid = test(value)
            except TypeError:  # e.g. an unhashable value compared with a tuple of choices
                valid = False
            if not valid:
                raise ValueError(f"FAT5Config.{name}: {value!r} is not {description}")
        super().__setattr__(key, value)

    @property
    def attention_dropout_rate(self):
        explicit = self.__dict__.get("attention_dropout_rate")
        return self.dropout_rate if explicit is None else explicit

    @attention_dropout_rate.setter
    def attention_dropout_rate(self, value):
        # Stored under its own name (None when unset), so to_dict and config.json say whether it was set.
        self.__dict__["attention_dropout_rate"] = value

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' from_dict, reading an `attention_dropout_rate` equal to `dropout_rate` as unset: earlier
        converters and saves wrote the derived value into every config.json, and a later `dropout_rate` override
        must still reach attention (see the class docstring)."""
        if config_dict.get("attention_dropout_rate") == config_dict.get("dropout_rate", 0.1):
            config_dict = {**config_dict, "attention_dropout_rate": None}
        return super().from_dict(config_dict, **kwargs)

    def to_diff_dict(self):
        """transformers' to_diff_dict (what save_pretrained writes), without derived fields left unset."""
        diff = super().to_diff_dict()
        if self.__dict__.get("attention_dropout_rate") is None:
            diff.pop("attention_dropout_rate", None)
        return diff

    def get_text_config(self, decoder=None, encoder=None):
        """transformers sizes generation caches from `get_text_config(decoder=True).num_hidden_layers`, which is
        the encoder's depth here (as in T5): report the decoder's, so a decoder deeper than its encoder generates."""
        text_config = super().get_text_config(decoder=decoder, encoder=encoder)
        if decoder and not encoder and text_config.num_layers != self.num_decoder_layers:
            text_config = copy.deepcopy(text_config) if text_config is self else text_config
            text_config.num_layers = self.num_decoder_layers
        return text_config

    @property
    def is_gated_act(self):
        return self.feed_forward_proj.startswith("gated-")

    @property
    def dense_act_fn(self):
        act = self.feed_forward_proj.split("-")[-1]
        # T5 v1.1 "gated-gelu" means the tanh approximation.
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else act

    @property
    def rotary_dim(self):
        """Channels of each head RoPE rotates (the first ones)."""
        return int(self.d_kv * self.partial_rotary_factor)

    def _validate_fat5(self):
        """What no single field can say; each field's own type and range is checked when it is set."""

        def fail(field, message):
            raise ValueError(f"FAT5Config.{field}: {message}")

        if self.relative_bias_per_layer and self.position_encoding_type != "t5":
            fail("relative_bias_per_layer", "a bias table per layer needs position_encoding_type='t5'")
        if self.position_encoding_type == "t5":
            buckets, distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
            if buckets < 4 or buckets % 2:
                fail("relative_attention_num_buckets", f"must be an even integer >= 4, got {buckets!r}")
            # The decoder's one-directional buckets are exact up to num_buckets // 2, logarithmic beyond.
            if distance <= buckets // 2:
                fail("relative_attention_max_distance",
                     f"must exceed relative_attention_num_buckets // 2 = {buckets // 2}, got {distance!r}")
        if self.position_encoding_type == "rope" and self.d_kv % 2:
            fail("d_kv", f"RoPE rotates pairs of channels, so d_kv must be even, got {self.d_kv}")
        if self.position_encoding_type == "rope" and (self.rotary_dim % 2 or not self.rotary_dim):
            fail("partial_rotary_factor", f"RoPE rotates pairs of channels, so int(d_kv * partial_rotary_factor) "
                 f"must be even and positive, got {self.rotary_dim}")
        if self.position_encoding_type == "alibi" and self.alibi_mode == "asymmetric" and self.num_heads % 2:
            fail("alibi_mode", f"asymmetric ALiBi splits the heads in two halves, so num_heads must be even, "
                 f"got {self.num_heads}")
        for field in ("pad_token_id", "decoder_start_token_id"):
            if getattr(self, field) is not None and getattr(self, field) >= self.vocab_size:
                fail(field, f"{getattr(self, field)} is not below vocab_size {self.vocab_size}")


__all__ = ["FAT5Config"]
