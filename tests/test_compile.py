"""`torch.compile(model, fullgraph=True)` traces forward and backward of every FAT5 class in one graph on CPU.

fullgraph=True turns any graph break in the model's code into an error. The "aot_eager" backend runs Dynamo and
AOTAutograd (the parts that break graphs or reject ops) without Inductor's C++ code generation, which on a small
CPU machine would take minutes per class; the CUDA kernels are custom ops, opaque to both.
"""

import pytest
import torch

import fat5
from conftest import tiny_config
from fat5.modeling_fat5 import FAT5ForConditionalGeneration

# The tied head (T5 v1.0) is the one whose weight sharing the graph must keep.
CONFIG = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=1,
              relative_attention_max_distance=16, tie_word_embeddings=True, num_labels=3)


def batch():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, 64, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    labels = torch.randint(2, 64, (2, 5), generator=generator)
    labels[1, 3:] = -100
    return input_ids, attention_mask, labels


def inputs_and_loss(model_class):
    input_ids, attention_mask, labels = batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
    if model_class is fat5.FAT5Model:
        inputs["decoder_input_ids"] = labels.clamp(min=0)
        return inputs, lambda output: output.last_hidden_state.pow(2).mean()
    if model_class is fat5.FAT5EncoderModel:
        return inputs, lambda output: output.last_hidden_state.pow(2).mean()
    if model_class is FAT5ForConditionalGeneration:
        inputs["labels"] = labels
    elif model_class is fat5.FAT5ForSequenceClassification:
        inputs["labels"] = torch.tensor([0, 2])
    elif model_class is fat5.FAT5ForTokenClassification:
        inputs["labels"] = torch.randint(0, 3, input_ids.shape).masked_fill(attention_mask == 0, -100)
    elif model_class is fat5.FAT5ForQuestionAnswering:
        inputs.update(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    return inputs, lambda output: output.loss


@pytest.mark.parametrize("model_class", [fat5.FAT5Model, fat5.FAT5EncoderModel, FAT5ForConditionalGeneration,
                                         fat5.FAT5ForSequenceClassification, fat5.FAT5ForTokenClassification,
                                         fat5.FAT5ForQuestionAnswering])
def test_fullgraph_compile_forward_and_backward(model_class):
    torch.manual_seed(0)
    model = model_class(tiny_config(**CONFIG)).train()
    inputs, loss_of = inputs_and_loss(model_class)
    expected = loss_of(model(**inputs))
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = loss_of(compiled(**inputs))
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert expected_grads
    for name, grad in expected_grads.items():
        assert torch.allclose(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6 * grad.abs().max()), name
