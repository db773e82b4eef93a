"""LM head + cross-entropy without the (tokens, vocab) fp32 logits: chunked forward, recomputed backward.

At mT5's vocabulary (250,112) and 8,192 target tokens the full logits are 8.2 GB in fp32, and the plain loss
keeps several such tensors alive (logits, log-softmax, their gradient). Here the tokens are cut into chunks
whose logits fit in `CHUNK_BYTES`: the forward keeps only the per-chunk loss sums, the backward recomputes each
chunk's logits and turns them into gradients of the hidden states and of the head's weight at once.

Loss (the same as `seq2seq_lm_loss` on full logits, the plain reference beside it): cross-entropy with optional
label smoothing over tokens whose label is not -100, plus `z_loss * logsumexp(logits)**2` on the same tokens;
their mean, or their sum / `num_items_in_batch` as the Trainer asks under gradient accumulation. Logits are
computed in the weight's dtype (as `nn.Linear` would) and the softmax in fp32.

`implementation="liger"` uses liger-kernel's fused linear cross-entropy (CUDA only, optional dependency).
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Largest fp32 logits block one chunk may hold (its softmax and gradient need about as much again each).
CHUNK_BYTES = 2**28
IMPLEMENTATIONS = ("chunked", "liger")


def seq2seq_lm_loss(logits, labels, label_smoothing=0.0, z_loss=0.0, num_items_in_batch=None):
    """Cross-entropy over tokens whose label is not -100 (their mean, or their sum / num_items_in_batch as the
    Trainer asks under gradient accumulation), plus the optional z-loss on the same tokens."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing,
                           reduction=reduction)
    if z_loss > 0:
        # where() rather than boolean indexing: no copy of the logits, and static shapes for torch.compile.
        real = labels != IGNORE_INDEX
        squared = torch.where(real, torch.logsumexp(logits, dim=-1).pow(2), 0.0).sum()
        loss = loss + z_loss * (squared / real.sum() if num_items_in_batch is None else squared)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def linear_cross_entropy_reference(hidden, weight, labels, label_smoothing=0.0, z_loss=0.0,
                                   num_items_in_batch=None):
    """Plain torch: full logits `hidden @ weight.T`, then `seq2seq_lm_loss`."""
    return seq2seq_lm_loss(F.linear(hidden, weight), labels, label_smoothing, z_loss, num_items_in_batch)


def _chunk_size(tokens, vocab_size):
    return max(1, min(tokens, CHUNK_BYTES // (4 * vocab_size)))


def _chunk_logits(hidden, weight):
    return F.linear(hidden, weight).float()


def _chunk_loss_sum(logits, labels, label_smoothing, z_loss):
    """Sum over the chunk's real tokens of smoothed cross-entropy + z-loss."""
    real = labels != IGNORE_INDEX
    log_z = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    loss = log_z - (1.0 - label_smoothing) * target
    if label_smoothing > 0:
        loss = loss - label_smoothing * logits.mean(dim=-1)
    if z_loss > 0:
        loss = loss + z_loss * log_z.pow(2)
    return torch.where(real, loss, 0.0).sum()


def _chunk_logits_grad(logits, labels, label_smoothing, z_loss):
    """d(chunk loss sum)/d(logits): softmax * (1 + 2 z log_z) - (1 - eps) one_hot - eps / V; zero on -100 rows."""
    real = labels != IGNORE_INDEX
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    grad = torch.exp(logits - log_z)
    if z_loss > 0:
        grad = grad * (1.0 + 2.0 * z_loss * log_z)
    if label_smoothing > 0:
        grad = grad - label_smoothing / logits.shape[-1]
    grad = grad.scatter_add(1, labels.clamp(min=0).unsqueeze(1),
                            torch.full_like(grad[:, :1], label_smoothing - 1.0))
    return grad * real.unsqueeze(1)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over real tokens of the per-token loss of `hidden @ weight.T`; hidden (N, D), weight (V, D)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, label_smoothing, z_loss):
        chunk = _chunk_size(hidden.shape[0], weight.shape[0])
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[start:start + chunk], weight)
            total = total + _chunk_loss_sum(logits, labels[start:start + chunk], label_smoothing, z_loss)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.label_smoothing, ctx.z_loss = label_smoothing, z_loss
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        chunk = _chunk_size(hidden.shape[0], weight.shape[0])
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk):
            chunk_hidden = hidden[start:start + chunk]
            logits = _chunk_logits(chunk_hidden, weight)
            grad_logits = _chunk_logits_grad(logits, labels[start:start + chunk], ctx.label_smoothing, ctx.z_loss)
            grad_logits = (grad_logits * grad_total).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ chunk_hidden).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _liger_linear_cross_entropy(hidden, weight, labels, label_smoothing, z_loss, reduction):
    if not hidden.is_cuda:
        raise ValueError("lm_loss_implementation='liger' runs on CUDA only; use 'chunked' on this device")
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        raise ImportError("lm_loss_implementation='liger' needs liger-kernel: pip install 'fat5[liger]'") from error
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, lse_square_scale=z_loss,
                                            label_smoothing=label_smoothing, reduction=reduction)
    return loss(weight, hidden, labels)


def linear_cross_entropy(hidden, weight, labels, label_smoothing=0.0, z_loss=0.0, num_items_in_batch=None,
                         implementation="chunked"):
    """`seq2seq_lm_loss(hidden @ weight.T, labels, ...)` without materialising the logits.

    hidden (..., D) in the weight's dtype, weight (V, D), labels (...) with -100 for ignored tokens.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"linear_cross_entropy: implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    if implementation == "liger":
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = _liger_linear_cross_entropy(hidden, weight, labels, label_smoothing, z_loss, reduction)
        return loss if num_items_in_batch is None else loss / num_items_in_batch
    total = ChunkedLinearCrossEntropy.apply(hidden, weight, labels, float(label_smoothing), float(z_loss))
    if num_items_in_batch is None:
        return total / (labels != IGNORE_INDEX).sum()
    return total / num_items_in_batch
