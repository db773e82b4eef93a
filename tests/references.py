"""Plain-torch references that only the tests use, so exported checkpoints do not carry them."""

import torch
import torch.nn.functional as F

from fat5.loss_fat5 import seq2seq_lm_loss
from fat5.reference_fat5 import eager_attention


def linear_cross_entropy_reference(hidden, weight, labels, label_smoothing=0.0, z_loss=0.0,
                                   num_items_in_batch=None):
    """Plain torch: full logits `hidden @ weight.T`, then `seq2seq_lm_loss`."""
    return seq2seq_lm_loss(F.linear(hidden, weight), labels, label_smoothing, z_loss, num_items_in_batch)


def flash_attention_t5_varlen_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, dropout_keep=None, dropout_p=0.0, **kwargs):
    """Plain-torch reference of the kernel's packed layout: the eager reference on each sequence (with
    `dropout_keep` (N, H, max_seqlen_q, max_seqlen_k), sequence n's mask is dropout_keep[n])."""
    outputs = []
    for n in range(cu_seqlens_q.numel() - 1):
        q = query[cu_seqlens_q[n]:cu_seqlens_q[n + 1]].transpose(0, 1)[None]
        k = key[cu_seqlens_k[n]:cu_seqlens_k[n + 1]].transpose(0, 1)[None]
        v = value[cu_seqlens_k[n]:cu_seqlens_k[n + 1]].transpose(0, 1)[None]
        if dropout_keep is None:
            outputs.append(eager_attention(q, k, v, **kwargs)[0].transpose(0, 1))
        else:
            keep = dropout_keep[n:n + 1, :, :q.shape[2], :k.shape[2]]
            output, _ = attention_with_dropout_mask_reference(q, k, v, keep, dropout_p, **kwargs)
            outputs.append(output[0].transpose(0, 1))
    return torch.cat(outputs)


UINT32 = 0xFFFFFFFF


def _multiply_high_low(x, multiplier):
    """(high, low) 32-bit words of x * multiplier for int64 tensors of uint32 values, without int64 overflow."""
    upper, lower = (x >> 16) * multiplier, (x & 0xFFFF) * multiplier  # each < 2**48
    return (upper + (lower >> 16)) >> 16, (((upper & 0xFFFF) << 16) + lower) & UINT32


def philox4x32(counter, key, rounds):
    """Philox4x32 (Salmon et al. 2011, as Random123 and tl.philox define it): four int64 tensors of uint32 counter
    words and a (k0, k1) key -> four tensors of uint32 random words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        high0, low0 = _multiply_high_low(c0, 0xD2511F53)
        high2, low2 = _multiply_high_low(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, low2, high0 ^ c3 ^ k1, low0
        k0, k1 = (k0 + 0x9E3779B9) & UINT32, (k1 + 0xBB67AE85) & UINT32
    return c0, c1, c2, c3


def dropout_keep_mask_reference(dropout_seed, dropout_p, batch, heads, query_length, key_length):
    """(B, H, Lq, Lk) bool: the attention probabilities the kernels keep with this (2,) int64 seed (the scheme
    written in `_dropout_keep`): pair (row i, column j = 32 g + 8 w + 2 t + e) of batch entry (or packed
    sequence) b, head h is kept when half e of word w of Philox4x32-7 on (4 g + t, i, b H + h, seed[1]) keyed by
    seed[0] is at least round(p * 2**16)."""
    seed, stream = (int(word) & 0xFFFFFFFFFFFFFFFF for word in dropout_seed.cpu())
    rows = torch.arange(query_length)[None, :, None]
    columns = torch.arange(key_length)[None, None, :]
    batch_head = torch.arange(batch * heads)[:, None, None]
    shape = (batch * heads, query_length, key_length)
    counter = [((columns // 32) * 4 + (columns % 8) // 2).expand(shape), rows.expand(shape),
               batch_head.expand(shape), torch.full(shape, stream & UINT32)]
    words = philox4x32(counter, (seed & UINT32, seed >> 32), rounds=7)
    word = torch.gather(torch.stack(words, -1), -1, ((columns % 32) // 8).expand(shape)[..., None]).squeeze(-1)
    half = torch.where((columns % 2).expand(shape) == 1, word >> 16, word & 0xFFFF)
    threshold = min(round(dropout_p * 2**16), 2**16 - 1)
    return (half >= threshold).view(batch, heads, query_length, key_length)


def attention_with_dropout_mask_reference(query, key, value, keep, dropout_p, **kwargs):
    """The eager reference with the attention probabilities multiplied by keep / (1 - p), as T5's dropout on the
    weights; returns (output, dropped probabilities)."""
    _, probs = eager_attention(query, key, value, return_weights=True, **kwargs)
    dropped = probs * keep.to(probs.dtype) / (1.0 - dropout_p)
    return torch.matmul(dropped, value), dropped
