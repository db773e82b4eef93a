"""The bundled demo checkpoint (made by scripts/train_demo_t5.py) is a genuine T5 v1.1-style model that answers."""

import json

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS


@pytest.fixture(scope="module")
def demo():
    return AutoTokenizer.from_pretrained(DEMO_CHECKPOINT), AutoModelForSeq2SeqLM.from_pretrained(DEMO_CHECKPOINT)


def test_folder_is_small_and_complete():
    names = {path.name for path in DEMO_CHECKPOINT.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "spiece.model", "tokenizer_config.json",
            "README.md"} <= names
    assert sum(path.stat().st_size for path in DEMO_CHECKPOINT.iterdir()) < 5 * 2**20


def test_is_a_flan_style_t5(demo):
    tokenizer, model = demo
    config = model.config
    assert type(model).__name__ == "T5ForConditionalGeneration" and config.model_type == "t5"
    assert config.feed_forward_proj == "gated-gelu" and config.is_gated_act
    # transformers 5 reports tie_word_embeddings=True for every T5 config, so read the file itself.
    assert json.loads((DEMO_CHECKPOINT / "config.json").read_text())["tie_word_embeddings"] is False
    assert not torch.equal(model.shared.weight, model.lm_head.weight)
    assert (config.pad_token_id, config.eos_token_id, config.decoder_start_token_id) == (0, 1, 0)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == config.vocab_size - 1


def test_greedy_answers(demo):
    tokenizer, model = demo
    prompts = [prompt for prompt, _ in DEMO_PROMPTS]
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, num_beams=1)
    assert tokenizer.batch_decode(output, skip_special_tokens=True) == [answer for _, answer in DEMO_PROMPTS]
