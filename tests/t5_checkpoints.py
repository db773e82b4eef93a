"""Tiny random T5-family checkpoints laid out as the real ones on the Hub are (no download needed)."""

import json
from pathlib import Path

import torch
import transformers
from torch import nn

from fat5.convert.checkpoint import load_source_model

COMMON = dict(vocab_size=101, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)

# family -> (transformers class prefix, config overrides, whether the LM head is the embedding)
FAMILIES = {
    "t5-v1.0": ("T5", dict(feed_forward_proj="relu"), True),
    "flan-t5": ("T5", dict(feed_forward_proj="gated-gelu"), False),
    "mt5": ("MT5", dict(feed_forward_proj="gated-gelu"), False),
    "umt5": ("UMT5", dict(feed_forward_proj="gated-gelu"), False),
    # ByT5: more encoder than decoder layers.
    "byt5": ("T5", dict(feed_forward_proj="gated-gelu", num_layers=3, num_decoder_layers=1), False),
    # Google's t5-efficient "DL" shapes: a decoder deeper than the encoder (generation caches are sized from it).
    "t5-efficient-dl": ("T5", dict(feed_forward_proj="gated-gelu", num_layers=1, num_decoder_layers=4), False),
    # T5-11B: heads x d_kv != d_model.
    "t5-11b": ("T5", dict(feed_forward_proj="relu", num_heads=4, d_kv=16, d_model=24), True),
}


def hf_classes(prefix):
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForConditionalGeneration")


def make_t5_checkpoint(family, folder, seed=0, safe_serialization=True, weight_std=None, **shape):
    """Save a random checkpoint of `family` into `folder` the way Hub checkpoints look: an untied model stores
    its own lm_head and says tie_word_embeddings=false in config.json. Without safe_serialization it writes an
    old-style `pytorch_model.bin` that also stores the tied copies (embed_tokens, a tied lm_head). `shape`
    overrides the tiny sizes (e.g. T5-base's for the GPU tests). `weight_std`: draw every matrix from N(0,
    weight_std), for generation tests (T5's initialisation makes a fresh model repeat one token, which a broken
    cache would repeat too)."""
    prefix, overrides, tied = FAMILIES[family]
    config_class, model_class = hf_classes(prefix)
    torch.manual_seed(seed)
    model = model_class(config_class(**{**COMMON, **overrides, **shape}, tie_word_embeddings=tied)).eval()
    if not tied:
        # transformers 5 ties at init whatever the flag says; give the head its own weights, as FLAN-T5 has.
        model.lm_head.weight = nn.Parameter(torch.randn_like(model.shared.weight) * 0.5)
    for parameter in model.parameters():
        # Break the exact symmetry of fresh layer norms (all ones) so parity checks see real weights.
        if parameter.dim() == 1:
            parameter.data.uniform_(0.5, 1.5)
        elif weight_std is not None:
            parameter.data.normal_(0.0, weight_std)
    model.save_pretrained(folder)
    if not safe_serialization:
        state_dict = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        torch.save(state_dict, Path(folder) / "pytorch_model.bin")
        (Path(folder) / "model.safetensors").unlink()
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = tied
    config.pop("scale_decoder_outputs", None)
    config_path.write_text(json.dumps(config, indent=2))
    return Path(folder)


def load_hf_reference(family, folder):
    """The transformers model of a saved checkpoint, as the converter's verification loads it."""
    return load_source_model(folder)


def padded_batch(vocab_size, generator=None, length=29, decoder_length=23):
    """Encoder batch with right and left padding and ragged lengths, plus a padded decoder batch."""
    generator = generator or torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, vocab_size, (3, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, length * 2 // 3:] = 0  # right padding
    attention_mask[2, :(length + 1) // 5] = 0  # left padding
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = torch.randint(2, vocab_size, (3, decoder_length), generator=generator)
    decoder_attention_mask = torch.ones_like(labels)
    decoder_attention_mask[1, decoder_length * 2 // 3:] = 0
    labels = labels.masked_fill(decoder_attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                decoder_attention_mask=decoder_attention_mask)
