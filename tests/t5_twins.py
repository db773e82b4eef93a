"""FAT5 classes and their transformers T5 twins, built tiny from one config with the same inputs: the shared
fixtures of the conformance tests, where T5 built from the same config is the spec."""

import pytest
import torch
import transformers
from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration, T5ForTokenClassification, T5Model

import fat5
from fat5 import FAT5Config, FAT5ForConditionalGeneration

VOCAB = 64
SHAPES = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
              feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
              num_labels=3, tie_word_embeddings=False)
# FAT5 class -> the transformers T5 class of the same architecture (T5's sequence-classification and QA heads run
# the decoder too, FAT5's are encoder-only, so those compare against T5's encoder).
T5_OF = {
    fat5.FAT5Model: T5Model,
    FAT5ForConditionalGeneration: T5ForConditionalGeneration,
    fat5.FAT5EncoderModel: T5EncoderModel,
    fat5.FAT5ForTokenClassification: T5ForTokenClassification,
    fat5.FAT5ForSequenceClassification: T5EncoderModel,
    fat5.FAT5ForQuestionAnswering: T5EncoderModel,
}
ENCODER_DECODER = (fat5.FAT5Model, FAT5ForConditionalGeneration, T5Model, T5ForConditionalGeneration)
ENCODER_ONLY = [model_class for model_class in T5_OF if model_class not in ENCODER_DECODER]


def build(model_class, **config_fields):
    """A tiny model. Tests of returned attentions pass attn_implementation="eager": T5 returns attention weights
    only from eager attention (with SDPA it silently returns none), FAT5 with its default backend runs eager for
    the calls that ask for them."""
    config_class = FAT5Config if model_class.__name__.startswith("FAT5") else T5Config
    torch.manual_seed(0)
    return model_class(config_class(**{**SHAPES, **config_fields})).eval()


def inputs_for(model_class):
    generator = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(2, VOCAB, (2, 6), generator=generator),
              "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}
    if model_class in ENCODER_DECODER:
        inputs["decoder_input_ids"] = torch.randint(2, VOCAB, (2, 4), generator=generator)
    return inputs


def generate_inputs():
    """The encoder inputs of `inputs_for`, as generate takes them."""
    inputs = inputs_for(FAT5ForConditionalGeneration)
    inputs.pop("decoder_input_ids")
    return inputs


def close(actual, expected, relative=1e-5):
    """Equal up to `relative` times the largest magnitude compared (fp32 sums in another order)."""
    return torch.allclose(actual, expected, rtol=0, atol=relative * expected.abs().max().item())


def run(model, **kwargs):
    with torch.no_grad():
        return model(**inputs_for(type(model)), **kwargs)


EAGER = {"attn_implementation": "eager"}
# Compared on transformers 5 only (the CI job on 4.57 skips them): get_encoder's modality (a transformers 5 API);
# assisted generation, which 4.57 refuses next to the min-length processor the test's generation config adds; T5's
# decoder stack called alone with output_attentions, which raises IndexError in 4.57's own T5; and the order of
# forward's arguments (4.57's T5 also takes head masks, which transformers 5 removed and FAT5 never took).
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
needs_transformers_5 = pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 5 behaviour")
