"""flashT5's forward in plain torch, over a flashT5 checkpoint's own tensor names and config.json: the model the
converter's parity proof compares a converted folder with (`fat5.convert.checkpoint.load_source_model`).

flashT5's code cannot run where the converter runs (its RoPE needs flash_attn's CUDA kernels, its model fails on
transformers 5, and running a checkpoint's remote code is not the converter's business), so its semantics are
written down here, independently of FAT5's modelling code, which the proof checks. tests/test_convert_flasht5.py
checks this module against outputs of flashT5's own code (tests/fixtures/flasht5).

Eval only (no dropout). flashT5 ignores attention masks; given masks, this computes each row alone on its unmasked
tokens (right padding), which is what a model that masks padding correctly must give on the padded batch.
"""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fat5.attention_positions_fat5 import alibi_slopes
from fat5.convert.checkpoint import TensorSource
from fat5.files import read_json_object
from fat5.reference_fat5 import relative_position_bucket, t5_rms_norm

FIRE_EPS = 1e-6  # added to flashT5's FIRE normaliser


class FlashT5Reference:
    """Called as a seq2seq model: `reference(input_ids=..., decoder_input_ids=..., labels=...)` gives `.logits` and,
    with labels, `.loss` (flashT5's: cross-entropy with label smoothing plus z-loss, over labelled tokens)."""

    def __init__(self, settings, tensors):
        """`settings`: the checkpoint's config.json over FlashT5Config's defaults (fat5.convert.flasht5.DEFAULTS);
        `tensors`: its state dict."""
        self.settings = settings
        self.tensors = tensors
        settings = self.settings
        self.kind = settings["position_encoding_type"]
        self.heads = settings["num_heads"]
        self.head_dim = settings.get("d_kv", 64)
        scale = settings["attention_scale"]
        self.scale = 1.0 / math.sqrt(self.heads) if scale is None else scale
        self.config = SimpleNamespace(vocab_size=tensors["shared.weight"].shape[0],
                                      pad_token_id=settings["pad_token_id"],
                                      decoder_start_token_id=settings["decoder_start_token_id"])

    @classmethod
    def from_folder(cls, folder, defaults, dtype=None):
        source = TensorSource(folder)
        tensors = {}
        for name in source.names():
            tensor = source.get(name)
            tensors[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            source.release(name)
        return cls({**defaults, **read_json_object(Path(folder) / "config.json")}, tensors)

    def eval(self):
        return self

    def parameters(self):
        return iter(self.tensors.values())

    def prepare_decoder_input_ids_from_labels(self, labels):
        shifted = torch.full_like(labels, self.config.decoder_start_token_id)
        shifted[:, 1:] = labels[:, :-1]
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def __call__(self, input_ids, decoder_input_ids=None, attention_mask=None, decoder_attention_mask=None,
                 labels=None):
        if decoder_input_ids is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        with torch.no_grad():
            if attention_mask is None and decoder_attention_mask is None:
                logits = self._forward(input_ids, decoder_input_ids)
            else:
                logits = self._rows_alone(input_ids, decoder_input_ids, attention_mask, decoder_attention_mask)
            loss = None if labels is None else self._loss(logits, labels)
        return SimpleNamespace(logits=logits, loss=loss)

    def _rows_alone(self, input_ids, decoder_input_ids, attention_mask, decoder_attention_mask):
        lengths = [_lengths(mask, ids) for mask, ids in ((attention_mask, input_ids),
                                                          (decoder_attention_mask, decoder_input_ids))]
        rows = []
        for row, (encoder_length, decoder_length) in enumerate(zip(*lengths, strict=True)):
            logits = self._forward(input_ids[row:row + 1, :encoder_length],
                                   decoder_input_ids[row:row + 1, :decoder_length])
            rows.append(F.pad(logits, (0, 0, 0, decoder_input_ids.shape[1] - decoder_length)))
        return torch.cat(rows)

    def _loss(self, logits, labels):
        logits, labels = logits.float().flatten(0, 1), labels.flatten()
        loss = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=self.settings["label_smoothing"])
        z_loss = self.settings["z_loss"] or 0.0
        if z_loss:
            loss = loss + z_loss * torch.logsumexp(logits[labels != -100], dim=-1).square().mean()
        return loss

    def _forward(self, input_ids, decoder_input_ids):
        embedding = self.tensors["shared.weight"]
        encoded = self._stack("encoder", embedding[input_ids])
        decoded = self._stack("decoder", embedding[decoder_input_ids], encoded)
        return F.linear(decoded, self.tensors["lm_head.weight"])

    def _stack(self, stack, hidden, encoded=None):
        decoder = encoded is not None
        blocks = {int(match.group(1)) for name in self.tensors
                  for match in [re.match(rf"{stack}\.block\.(\d+)\.", name)] if match}
        # t5, ALiBi and FIRE: block 0's bias, shared by every block of the stack.
        bias = self._position_bias(stack, hidden.shape[1], bidirectional=not decoder)
        for block in sorted(blocks):
            prefix = f"{stack}.block.{block}."
            normed = self._norm(hidden, prefix + "self_attention_layer.layer_norm.weight")
            hidden = hidden + self._attention(normed, normed, prefix + "self_attention_layer.self_attention.", bias,
                                              causal=decoder)
            if decoder:
                normed = self._norm(hidden, prefix + "cross_attention_layer.layer_norm.weight")
                hidden = hidden + self._attention(normed, encoded, prefix + "cross_attention_layer.cross_attention.",
                                                  None, causal=False)
            hidden = hidden + self._mlp(self._norm(hidden, prefix + "ff_layer.layer_norm.weight"), prefix + "ff_layer.")
        return self._norm(hidden, f"{stack}.final_layer_norm.weight")

    def _norm(self, hidden, name):
        return t5_rms_norm(hidden, self.tensors[name], self.settings.get("layer_norm_epsilon", 1e-6))

    def _mlp(self, hidden, prefix):
        settings, tensors = self.settings, self.tensors
        activation = (lambda x: F.gelu(x, approximate="tanh")) if settings["use_gelu_act"] else F.relu
        if settings["use_glu_mlp"]:
            inner = activation(F.linear(hidden, tensors[prefix + "act.wi_0.weight"])) * F.linear(
                hidden, tensors[prefix + "act.wi_1.weight"])
        else:
            inner = activation(F.linear(hidden, tensors[prefix + "act.wi.weight"]))
        return F.linear(inner, tensors[prefix + "wo.weight"])

    def _attention(self, hidden, source, prefix, bias, causal):
        """Multi-head attention of `hidden`'s queries over `source`'s keys: q.k times the scale, plus the bias,
        causal in decoder self-attention; RoPE (every attention) rotates q, k and v by their own positions."""
        batch, query_length, _ = hidden.shape
        key_length = source.shape[1]

        def heads(states, name, length):
            return F.linear(states, self.tensors[prefix + name + ".weight"]).view(batch, length, self.heads, -1)

        query, key, value = heads(hidden, "Wq", query_length), heads(source, "Wk", key_length), \
            heads(source, "Wv", key_length)
        if self.kind == "RoPE":
            query, key, value = self._rope(query), self._rope(key), self._rope(value)
        scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * self.scale
        if bias is not None:
            scores = scores + bias.to(scores.dtype)  # as flashT5 adds it: in the model's dtype
        if causal:
            future = torch.ones(query_length, key_length, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        probabilities = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        output = torch.einsum("bhqk,bkhd->bqhd", probabilities, value).reshape(batch, query_length, -1)
        return F.linear(output, self.tensors[prefix + "o.weight"])

    def _rope(self, states):
        """flash_attn's rotary embedding of (B, L, H, D) states at positions 0..L-1: the first
        int(d_kv * rotary_emb_fraction) channels, as pairs (i, i + half) or, interleaved, (2i, 2i + 1)."""
        settings = self.settings
        dim = int(self.head_dim * settings["rotary_emb_fraction"])
        frequencies = 1.0 / (settings["rotary_base"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.arange(states.shape[1], dtype=torch.float32)[:, None] * frequencies
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # (L, 1, dim / 2) against (B, L, H, dim / 2)
        rotated = states[..., :dim].float()
        interleaved = settings["rotary_interleaved"]
        first, second = (rotated[..., 0::2], rotated[..., 1::2]) if interleaved else rotated.chunk(2, dim=-1)
        pair = (first * cos - second * sin, first * sin + second * cos)
        rotated = torch.stack(pair, dim=-1).flatten(-2) if interleaved else torch.cat(pair, dim=-1)
        return torch.cat((rotated.to(states.dtype), states[..., dim:]), dim=-1)

    def _position_bias(self, stack, length, bidirectional):
        """(1, H, L, L) bias of block 0's position encoding (self-attention: as many keys as queries), or None."""
        positions = torch.arange(length)
        key_minus_query = positions[None, :] - positions[:, None]
        encoding = f"{stack}.block.0.self_attention_layer.self_attention.pe_encoding."
        if self.kind == "t5":
            table = self.tensors[encoding + "relative_attention_bias.weight"]
            buckets = relative_position_bucket(key_minus_query, bidirectional=bidirectional,
                                               num_buckets=table.shape[0],
                                               max_distance=self.settings.get("relative_attention_max_distance", 128))
            return table[buckets].permute(2, 0, 1)[None]
        if self.kind == "ALiBi":
            return self._alibi(key_minus_query)
        if self.kind == "FIRE":
            return self._fire(encoding, positions)
        return None

    def _alibi(self, key_minus_query):
        distance = key_minus_query.abs().float()
        if self.settings["alibi_mode"] == "symetric":
            return (-alibi_slopes(self.heads)[:, None, None] * distance)[None]
        half = self.heads // 2  # "asymetric": the first half looks back only, the second forward only
        bias = -alibi_slopes(half).repeat(2)[:, None, None] * distance
        hidden = torch.stack([key_minus_query > 0] * half + [key_minus_query < 0] * half)
        return bias.masked_fill(hidden, float("-inf"))[None]

    def _fire(self, encoding, positions):
        tensors = self.tensors
        c = tensors[encoding + "c"].abs()
        threshold = (tensors[encoding + "L_multiplier"] * tensors[encoding + "init_L"]).abs()
        positions = positions.float()
        query_minus_key = positions[:, None] - positions[None, :]
        normaliser = torch.log(c * torch.maximum(positions, threshold) + 1) + FIRE_EPS
        distance = torch.sign(query_minus_key) * torch.log(c * query_minus_key.abs() + 1) / normaliser[:, None]
        weight = tensors[encoding + "mlp.0.weight"]  # in bf16, flashT5's own FIRE fails: fp32 distances
        inner = F.relu(F.linear(distance[..., None].to(weight.dtype), weight, tensors[encoding + "mlp.0.bias"]))
        bias = F.linear(inner, tensors[encoding + "mlp.2.weight"], tensors[encoding + "mlp.2.bias"])
        return bias.permute(2, 0, 1)[None]


def _lengths(mask, ids):
    """Each row's count of unmasked tokens; the mask must be right padding (ones, then zeros)."""
    if mask is None:
        return [ids.shape[1]] * ids.shape[0]
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    if not torch.equal(mask, torch.arange(mask.shape[1])[None, :] < lengths[:, None]):
        raise ValueError("the flashT5 reference takes right-padded rows only (mask ones, then zeros)")
    return lengths.tolist()
