"""Chunked LM head + cross-entropy against the full-logits reference (`seq2seq_lm_loss`), and its use in the model.

Chunks are made tiny (a few tokens) so every call spans several chunks and a ragged last one.
"""

import pytest
import torch

from fat5 import loss_fat5 as loss_module
from fat5.configuration_fat5 import FAT5Config
from fat5.loss_fat5 import linear_cross_entropy
from fat5.modeling_fat5 import FAT5ForConditionalGeneration
from references import linear_cross_entropy_reference
from t5_checkpoints import padded_batch

VOCAB, DIM, TOKENS = 97, 24, 41
# Relative to the largest magnitude compared: fp32 rounding; bf16 logits and gradients rounded per chunk.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * VOCAB * 6)  # 6 tokens a chunk


def close(actual, expected, dtype, name):
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= TOLERANCE[dtype] * expected.double().abs().max().item(), (name, error)


def loss_and_grads(function, hidden, weight, labels, **options):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = function(hidden, weight, labels, **options)
    loss.backward()
    return loss, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"num_items_in_batch": 30},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "num_items_in_batch": torch.tensor(33)},
])
def test_loss_and_gradients_match_full_logits(dtype, options):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, DIM, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, DIM, generator=generator) * 0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[[0, 7, 8, 9, 40]] = -100  # ignored tokens, some filling a whole chunk
    ours = loss_and_grads(linear_cross_entropy, hidden, weight, labels, **options)
    reference = loss_and_grads(linear_cross_entropy_reference, hidden, weight, labels, **options)
    for actual, expected, name in zip(ours, reference, ("loss", "hidden grad", "weight grad")):
        assert actual.dtype == expected.dtype, name
        close(actual, expected, dtype, name)


def test_batched_hidden_states_and_frozen_head():
    hidden = torch.randn(3, 5, DIM, requires_grad=True)
    weight = torch.randn(VOCAB, DIM)  # frozen: no gradient is computed for it
    labels = torch.randint(0, VOCAB, (3, 5))
    loss = linear_cross_entropy(hidden, weight, labels)
    expected = linear_cross_entropy_reference(hidden, weight, labels)
    close(loss, expected, torch.float32, "loss")
    (grad,) = torch.autograd.grad(loss, hidden)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    close(grad, expected_grad, torch.float32, "hidden grad")


def test_loss_without_gradients_and_a_second_backward():
    """No gradient wanted (no_grad, or nothing requires it): the loss alone. The gradients are computed in the
    forward and scaled in place by the backward, so a second backward through the same loss is refused."""
    hidden, weight = torch.randn(TOKENS, DIM), torch.randn(VOCAB, DIM)
    labels = torch.randint(0, VOCAB, (TOKENS,))
    expected = linear_cross_entropy_reference(hidden, weight, labels, z_loss=1e-3)
    close(linear_cross_entropy(hidden, weight, labels, z_loss=1e-3), expected, torch.float32, "frozen")
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(), weight, labels, z_loss=1e-3)
    assert not loss.requires_grad
    close(loss, expected, torch.float32, "no_grad")
    loss = linear_cross_entropy(hidden, weight, labels) * 3.0
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_liger_and_unknown_implementations_fail_clearly_on_cpu():
    hidden, weight, labels = torch.randn(4, DIM), torch.randn(VOCAB, DIM), torch.randint(0, VOCAB, (4,))
    with pytest.raises((ValueError, ImportError), match="liger"):
        linear_cross_entropy(hidden, weight, labels, implementation="liger")
    with pytest.raises(ValueError, match="implementation"):
        linear_cross_entropy(hidden, weight, labels, implementation="fused")
    with pytest.raises(ValueError, match="FAT5Config.lm_loss_implementation"):
        FAT5Config(lm_loss_implementation="fused")


@pytest.mark.parametrize("tied", [False, True])
def test_training_returns_the_loss_without_logits_unless_asked(tied):
    """T5 v1.0 (tied head, decoder output rescaled) and v1.1: same loss and gradients as the full logits."""
    config = FAT5Config(vocab_size=VOCAB, d_model=DIM, d_kv=6, d_ff=32, num_layers=1, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                        tie_word_embeddings=tied, z_loss=1e-3, label_smoothing=0.1)
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(config).train()
    assert model.config.scale_decoder_outputs == tied
    batch = padded_batch(VOCAB)
    results = {}
    for return_logits in (False, True):
        model.zero_grad()
        model.config.return_logits_in_training = return_logits
        output = model(**batch, num_items_in_batch=50)
        output.loss.backward()
        results[return_logits] = (output, {name: p.grad.clone() for name, p in model.named_parameters()})
    assert results[False][0].logits is None
    assert results[True][0].logits.shape == (*batch["labels"].shape, VOCAB)
    close(results[False][0].loss, results[True][0].loss, torch.float32, "loss")
    for name, grad in results[True][1].items():
        close(results[False][1][name], grad, torch.float32, name)
    model.eval()
    model.config.return_logits_in_training = False
    evaluation = model(**batch, num_items_in_batch=50)
    assert evaluation.logits is not None
    close(evaluation.loss, results[True][0].loss, torch.float32, "eval loss")
