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
                                        max_seqlen_k, **kwargs):
    """Plain-torch reference of the kernel's packed layout: the eager reference on each sequence."""
    outputs = []
    for n in range(cu_seqlens_q.numel() - 1):
        q = query[cu_seqlens_q[n]:cu_seqlens_q[n + 1]].transpose(0, 1)[None]
        k = key[cu_seqlens_k[n]:cu_seqlens_k[n + 1]].transpose(0, 1)[None]
        v = value[cu_seqlens_k[n]:cu_seqlens_k[n + 1]].transpose(0, 1)[None]
        outputs.append(eager_attention(q, k, v, **kwargs)[0].transpose(0, 1))
    return torch.cat(outputs)
