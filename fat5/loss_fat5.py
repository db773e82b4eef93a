"""The model's LM loss: `seq2seq_lm_loss` on logits, and `linear_cross_entropy`, the LM head + the same loss
without the (tokens, vocab) fp32 logits: chunked, gradients computed in the forward.

At mT5's vocabulary (250,112) and 8,192 target tokens the full logits are 8.2 GB in fp32, and the plain loss
keeps several such tensors alive (logits, log-softmax, their gradient). Here the tokens are cut into chunks
whose logits fit in `CHUNK_BYTES`, and each chunk's logits are turned, in place, into their contribution to the
loss and to the gradients of the hidden states and of the head's weight before the next chunk is computed.

Loss (the same as `seq2seq_lm_loss` on full logits): cross-entropy with optional label smoothing over tokens
whose label is not -100, plus `z_loss * logsumexp(logits)**2` on the same tokens; their mean, or their sum /
`num_items_in_batch` as the Trainer asks under gradient accumulation. Logits are computed in the weight's dtype
(as `nn.Linear` would) and the softmax in fp32.

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


def _chunk_size(tokens, vocab_size):
    return max(1, min(tokens, CHUNK_BYTES // (4 * vocab_size)))


def _chunk_logits(hidden, weight):
    return F.linear(hidden, weight).float()


def _chunk_loss_sum(logits, labels, label_smoothing, z_loss):
    """Sum over the chunk's real tokens of smoothed cross-entropy + z-loss, and every token's logsumexp."""
    real = labels != IGNORE_INDEX
    log_z = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    loss = log_z - (1.0 - label_smoothing) * target
    if label_smoothing > 0:
        loss = loss - label_smoothing * logits.mean(dim=-1)
    if z_loss > 0:
        loss = loss + z_loss * log_z.pow(2)
    return torch.where(real, loss, 0.0).sum(), log_z


def _chunk_logits_grad_(logits, log_z, labels, row_scale, label_smoothing, z_loss):
    """row_scale * d(token loss)/d(logits), written over `logits`:
    softmax * (1 + 2 z log_z) - (1 - eps) one_hot - eps / V, where row_scale is 0 on -100 rows.

    In place, with the forward's logsumexp: each elementwise pass over a chunk's logits costs about as much
    as the chunk's matmul on a GPU, and a fresh allocation per pass costs page faults on a CPU."""
    log_z = log_z.unsqueeze(1)
    grad = logits.sub_(log_z).exp_()
    grad.mul_(row_scale * (1.0 + 2.0 * z_loss * log_z) if z_loss > 0 else row_scale)
    if label_smoothing > 0:
        grad.sub_(row_scale * (label_smoothing / logits.shape[-1]))
    return grad.scatter_add_(1, labels.clamp(min=0).unsqueeze(1), row_scale * (label_smoothing - 1.0))


def _chunked_loss_and_grads(hidden, weight, labels, label_smoothing, z_loss, grad_hidden, grad_weight):
    """Loss sum over real tokens; when given, fills fp32 `grad_hidden` (N, D) and adds into fp32 `grad_weight`
    (V, D) the gradients of that sum, one chunk of logits at a time."""
    chunk = _chunk_size(hidden.shape[0], weight.shape[0])
    row_scale = (labels != IGNORE_INDEX).float().unsqueeze(1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = _chunk_logits(hidden[rows], weight)
        chunk_total, log_z = _chunk_loss_sum(logits, labels[rows], label_smoothing, z_loss)
        total = total + chunk_total
        if grad_hidden is None and grad_weight is None:
            continue
        grad_logits = _chunk_logits_grad_(logits, log_z, labels[rows], row_scale[rows], label_smoothing, z_loss)
        grad_logits = grad_logits.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden[rows] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += (grad_logits.t() @ hidden[rows]).float()
    return total


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over real tokens of the per-token loss of `hidden @ weight.T`; hidden (N, D), weight (V, D).

    The gradients are computed in the forward, while each chunk's logits exist (as liger-kernel does), so the
    head's matmul is not recomputed; the backward only scales them. They cost no extra peak memory: the weight's
    gradient is needed from the very start of the backward anyway, and the hidden states' is (N, D)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, label_smoothing, z_loss, hidden_needs_grad, weight_needs_grad):
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) \
            if hidden_needs_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if weight_needs_grad else None
        total = _chunked_loss_and_grads(hidden, weight, labels, label_smoothing, z_loss, grad_hidden, grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.backward_done = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.backward_done:  # the stored gradients were scaled in place by the first backward
            raise RuntimeError("linear_cross_entropy: a second backward through the same loss is not supported; "
                               "compute the loss again")
        ctx.backward_done = True
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total).to(hidden_dtype)
        if grad_weight is not None:  # in place: a (V, D) copy at the start of the backward would raise the peak
            grad_weight = grad_weight.mul_(grad_total).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


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
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        total = ChunkedLinearCrossEntropy.apply(hidden, weight, labels, float(label_smoothing), float(z_loss),
                                                hidden.requires_grad, weight.requires_grad)
    else:  # evaluation: the loss alone
        total = _chunked_loss_and_grads(hidden, weight, labels, float(label_smoothing), float(z_loss), None, None)
    if num_items_in_batch is None:
        return total / (labels != IGNORE_INDEX).sum()
    return total / num_items_in_batch
