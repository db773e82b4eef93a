"""Packed batches: the collator, length grouping, and a model that keeps packed examples apart in every backend."""

import inspect
import random

import pytest
import torch
from transformers import Trainer, TrainingArguments

from conftest import tiny_config
from fat5.attention_fat5 import sdpa_attention
from fat5.attention_positions_fat5 import segment_positions
from fat5.compat_fat5 import cache_field, output_cache
from fat5.modeling_fat5 import (
    FAT5EncoderModel,
    FAT5ForConditionalGeneration,
    FAT5ForSequenceClassification,
    FAT5Model,
)
from fat5.reference_fat5 import eager_attention
from fat5.training.packing import (
    PackedSeq2SeqCollator,
    PaddingFractionLoggingMixin,
    PaddingTracker,
    TokenBudgetBatchSampler,
    group_by_length,
    pack_examples,
    padding_fraction,
)

PAD, START = 0, 0
# (input length, target length): the first example is longer than max_distance, so a second segment that did not
# restart its positions would fall in other buckets; one target holds a -100.
SHAPES = [(23, 5), (6, 7), (9, 3), (4, 4), (11, 6)]
SHAPES_TRITON = [(23, 5), (6, 7), (4, 3)]  # still two rows, of two examples and one: the interpreter is slow
# position encoding -> config overrides; "umt5" is T5's bias with one table per layer.
POSITIONS = {
    "t5": dict(position_encoding_type="t5"),
    "umt5": dict(position_encoding_type="t5", relative_bias_per_layer=True),
    "rope": dict(position_encoding_type="rope"),
    "alibi": dict(position_encoding_type="alibi"),
    "fire": dict(position_encoding_type="fire"),
    # flashT5's variants (convert/flasht5.py): RoPE also rotating values and cross-attention (encoder positions
    # restart per segment too), partial and interleaved; asymmetric ALiBi's dense bias; FIRE's 0-based normaliser.
    "rope-flasht5": dict(position_encoding_type="rope", partial_rotary_factor=0.5, rope_interleaved=True,
                         rope_cross_attention=True, rope_rotates_values=True),
    "alibi-asymmetric": dict(position_encoding_type="alibi", alibi_mode="asymmetric"),
    "fire-flasht5": dict(position_encoding_type="fire", fire_normalizer_offset=0, fire_normalizer_eps=1e-6),
}
# The kernel runs in the Triton interpreter (slow, ~0.3 s a launch): one case, the per-layer T5 tables. The packing
# code around the kernel does not depend on the bias (ALiBi and no-bias kernel paths are tested in
# test_flash_attention_t5.py); FIRE, a dense bias, never reaches the kernel.
CASES = [(backend, position, "reduced") for backend in ("eager", "sdpa") for position in POSITIONS]
CASES += [("triton", "umt5", "reduced"), pytest.param("triton", "umt5", "full", marks=pytest.mark.gpu)]
# The GPU tier's case ("full"): T5-base heads and examples up to 2,000 tokens, packed into rows of 2,048.
FULL_MODEL = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_heads=12, relative_attention_num_buckets=32,
                  relative_attention_max_distance=128)
SHAPES_FULL = [(1500, 100), (400, 60), (2000, 128), (40, 20), (300, 90)]
BUDGETS = {"reduced": (32, 14), "full": (2048, 256)}


def tiny_model(backend, position, model_class=FAT5ForConditionalGeneration, **overrides):
    # d_kv = 32: a head dim the triton kernel takes; one head there keeps the interpreter fast.
    heads = 1 if backend == "triton" else 2
    config = tiny_config(**{"d_model": 32 * heads, "d_kv": 32, "num_heads": heads, **overrides},
                         return_logits_in_training=True,  # the tests compare logits in train mode
                         attention_backend=backend, pad_token_id=PAD, decoder_start_token_id=START,
                         **POSITIONS[position])
    torch.manual_seed(0)
    return model_class(config)


def make_examples(shapes=SHAPES, seed=0):
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for input_length, target_length in shapes:
        labels = torch.randint(2, 101, (target_length,), generator=generator).tolist()
        examples.append({"input_ids": torch.randint(2, 101, (input_length,), generator=generator).tolist(),
                         "labels": labels})
    examples[2]["labels"][1] = -100
    return examples


def collate(examples, device="cpu", budgets=BUDGETS["reduced"]):
    # Budgets that give rows with different numbers of examples (and a padded row).
    batch = PackedSeq2SeqCollator(PAD, START, max_input_length=budgets[0], max_target_length=budgets[1])(examples)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def segments_of(batch, key="decoder_segment_ids"):
    """(row, segment id, boolean position mask) of every example in a packed batch."""
    ids = batch[key]
    return [(row, segment, ids[row] == segment) for row in range(ids.shape[0])
            for segment in ids[row].unique().tolist() if segment]


def example_of(batch, row, segment):
    inputs = batch["input_ids"][row][batch["segment_ids"][row] == segment]
    labels = batch["labels"][row][batch["decoder_segment_ids"][row] == segment]
    return inputs, labels


def grads(model):
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()
            if parameter.grad is not None}


def assert_close(actual, expected, rtol=1e-4, name="", floor=0.0):
    """|actual - expected| <= rtol * the magnitude of `expected` (at least `floor`)."""
    scale = expected.abs().max().clamp(min=max(floor, 1e-30))
    error = (actual - expected).abs().max()
    assert error <= rtol * scale, f"{name}: max error {error:.3g} against magnitude {scale:.3g}"


@pytest.mark.parametrize("backend, position, scale", CASES)
def test_packed_rows_give_the_logits_loss_and_gradients_of_examples_run_one_by_one(backend, position, scale,
                                                                                   kernel_device):
    model = tiny_model(backend, position, **(FULL_MODEL if scale == "full" else {})).to(kernel_device)
    shapes = SHAPES_FULL if scale == "full" else SHAPES_TRITON if backend == "triton" else SHAPES
    batch = collate(make_examples(shapes), kernel_device, BUDGETS[scale])
    assert batch["input_ids"].shape[0] >= 2 and batch["segment_ids"].amax(dim=1).unique().numel() >= 2

    packed = model(**batch)
    packed.loss.backward()
    packed_grads = grads(model)
    model.zero_grad()

    token_count = int((batch["labels"] != -100).sum())
    summed_loss = 0.0
    for row, segment, positions in segments_of(batch):
        inputs, labels = example_of(batch, row, segment)
        alone = model(input_ids=inputs[None], labels=labels[None])
        real = int((labels != -100).sum())
        # The packed loss is the mean over all label tokens of the batch: every example's summed token loss,
        # divided by the batch's label-token count (not a mean of per-example means).
        (alone.loss * real / token_count).backward()
        summed_loss += alone.loss.detach() * real / token_count
        assert_close(packed.logits[row][positions], alone.logits[0], name=f"logits of row {row} segment {segment}")
    assert_close(packed.loss.detach(), summed_loss, name="loss")
    alone_grads = grads(model)
    assert packed_grads.keys() == alone_grads.keys() and len(packed_grads) == len(list(model.parameters()))
    # Some gradients are zero in exact arithmetic (a bias added to every score of a softmax row): their rounding
    # noise is measured against the model's largest gradient.
    largest = max(gradient.abs().max().item() for gradient in alone_grads.values())
    for name, gradient in alone_grads.items():
        assert_close(packed_grads[name], gradient, rtol=2e-4, name=f"gradient of {name}", floor=1e-3 * largest)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
def test_changing_one_segment_leaves_every_other_segment_bit_identical(backend, kernel_device):
    # Holds in the triton backend too: each segment is its own varlen sequence, so others are never read.
    model = tiny_model(backend, "t5").to(kernel_device).eval()
    batch = collate(make_examples(), kernel_device)
    changed = {name: tensor.clone() for name, tensor in batch.items()}
    row, segment = 0, 2
    encoder_positions = batch["segment_ids"][row] == segment
    decoder_positions = batch["decoder_segment_ids"][row] == segment
    changed["input_ids"][row, encoder_positions] = (batch["input_ids"][row, encoder_positions] + 7) % 99 + 2
    changed["decoder_input_ids"][row, decoder_positions] = 5
    changed["labels"][row, decoder_positions] = 9
    with torch.no_grad():
        before, after = model(**batch), model(**changed)
    assert not torch.equal(before.logits[row][decoder_positions], after.logits[row][decoder_positions])
    for other_row, other_segment, positions in segments_of(batch):
        if (other_row, other_segment) == (row, segment):
            continue
        assert torch.equal(before.logits[other_row][positions], after.logits[other_row][positions])
        encoder_positions_other = batch["segment_ids"][other_row] == other_segment
        assert torch.equal(before.encoder_last_hidden_state[other_row][encoder_positions_other],
                           after.encoder_last_hidden_state[other_row][encoder_positions_other])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_encoder_and_base_model_take_segment_ids(backend):
    batch = collate(make_examples())
    encoder = tiny_model(backend, "t5", FAT5EncoderModel).eval()
    base = tiny_model(backend, "t5", FAT5Model).eval()
    with torch.no_grad():
        encoded = encoder(input_ids=batch["input_ids"], segment_ids=batch["segment_ids"]).last_hidden_state
        decoded = base(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state
        for row, segment, positions in segments_of(batch, "segment_ids"):
            inputs, labels = example_of(batch, row, segment)
            assert_close(encoded[row][positions], encoder(input_ids=inputs[None]).last_hidden_state[0])
            decoder_inputs = batch["decoder_input_ids"][row][batch["decoder_segment_ids"][row] == segment]
            alone = base(input_ids=inputs[None], decoder_input_ids=decoder_inputs[None]).last_hidden_state[0]
            assert_close(decoded[row][batch["decoder_segment_ids"][row] == segment], alone)


@pytest.mark.parametrize("attention", [eager_attention, sdpa_attention])
@pytest.mark.parametrize("causal", [False, True])
def test_segment_aware_attention_restarts_t5_buckets_at_every_segment(attention, causal):
    torch.manual_seed(0)
    # Segments of 30 and 5 tokens (max_distance 8), one padding token; per-head bias large enough to matter.
    segment_ids = torch.tensor([[1] * 30 + [2] * 5 + [0]])
    query, key, value = (torch.randn(1, 2, 36, 16, dtype=torch.float64) for _ in range(3))
    table = torch.randn(8, 2, dtype=torch.float64) * 3
    kwargs = dict(bias_table=table, bidirectional=not causal, num_buckets=8, max_distance=8, causal=causal)
    packed = attention(query, key, value, query_segment_ids=segment_ids, key_segment_ids=segment_ids, **kwargs)
    for start, end in ((0, 30), (30, 35)):
        alone = attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], **kwargs)
        assert_close(packed[:, :, start:end], alone, rtol=1e-12)
    assert torch.equal(packed[:, :, 35], torch.zeros_like(packed[:, :, 35]))  # padding sees nothing
    assert segment_positions(segment_ids).tolist() == [list(range(30)) + list(range(5)) + [0]]


def test_labels_alone_are_shifted_per_segment_by_the_model():
    model = tiny_model("eager", "t5").eval()
    batch = collate(make_examples())
    with torch.no_grad():
        given = model(**batch).logits
        derived = model(**{k: v for k, v in batch.items() if k != "decoder_input_ids"}).logits
    assert torch.equal(given, derived)


def test_bad_segment_ids_get_one_clear_error():
    model = tiny_model("eager", "t5").eval()
    batch = collate(make_examples())
    shuffled = dict(batch, segment_ids=batch["segment_ids"].flip(1))
    with pytest.raises(ValueError, match="segment_ids must number each row"):
        model(**shuffled)
    with pytest.raises(ValueError, match="need decoder_segment_ids"):
        model(**{k: v for k, v in batch.items() if k != "decoder_segment_ids"})
    with pytest.raises(ValueError, match="need segment_ids"):
        model(**{k: v for k, v in batch.items() if k != "segment_ids"})
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        model(**dict(batch, segment_ids=batch["segment_ids"][:, :-1]))
    with pytest.raises(ValueError, match="not for decoding step by step with a cache"):
        with torch.no_grad():
            output = model(**batch, use_cache=True)
            step = {k: v[:, -1:] if k.startswith("decoder_") else v for k, v in batch.items()
                    if k not in ("labels", "decoder_attention_mask")}
            model(**step, **cache_field(output_cache(output)))
    classifier = FAT5ForSequenceClassification(model.config)
    with pytest.raises(ValueError, match="packed batches \\(segment_ids\\) are not supported"):
        classifier(input_ids=batch["input_ids"], segment_ids=batch["segment_ids"])


def test_trainer_keeps_the_packing_columns_and_logs_the_padding_fraction(tmp_path):
    # Trainer drops dataset columns that forward does not name: a pre-packed dataset must keep its segment ids.
    for model_class in (FAT5ForConditionalGeneration, FAT5Model):
        parameters = inspect.signature(model_class.forward).parameters
        assert {"segment_ids", "decoder_segment_ids"} <= parameters.keys()
    assert "segment_ids" in inspect.signature(FAT5EncoderModel.forward).parameters

    batch = collate(make_examples())
    rows = [{name: tensor[row].tolist() for name, tensor in batch.items()} | {"text": "dropped"}
            for row in range(batch["input_ids"].shape[0])]
    model = tiny_model("eager", "t5")
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)

    class PackedTrainer(PaddingFractionLoggingMixin, Trainer):
        pass

    arguments = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=len(rows), max_steps=2,
                                  logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                  disable_tqdm=True)
    trainer = PackedTrainer(model=model, args=arguments, train_dataset=rows)
    trainer.train()
    assert seen and all({"segment_ids", "decoder_segment_ids"} <= keys and "text" not in keys for keys in seen)
    logged = [entry["padding_fraction"] for entry in trainer.state.log_history if "padding_fraction" in entry]
    assert logged == [pytest.approx(padding_fraction(batch), abs=1e-4)] * 2


# --- the collator ---


def test_collator_packs_every_example_once_with_per_segment_shift_and_labels():
    examples = make_examples()
    batch = collate(examples)
    assert batch["input_ids"].shape[1] <= 32 and batch["labels"].shape[1] <= 14
    seen = []
    for row, segment, positions in segments_of(batch):
        inputs, labels = example_of(batch, row, segment)
        seen.append((inputs.tolist(), labels.tolist()))
        decoder_inputs = batch["decoder_input_ids"][row][positions].tolist()
        expected = [START] + [PAD if token == -100 else token for token in labels.tolist()[:-1]]
        assert decoder_inputs == expected
    assert sorted(seen) == sorted((e["input_ids"], e["labels"]) for e in examples)  # none dropped, none doubled
    for side in ("", "decoder_"):
        ids = batch[f"{side}segment_ids"]
        assert torch.equal(batch[f"{side}attention_mask"], (ids > 0).long())
    padding = batch["decoder_segment_ids"] == 0
    assert (batch["labels"][padding] == -100).all() and (batch["decoder_input_ids"][padding] == PAD).all()
    assert (batch["input_ids"][batch["segment_ids"] == 0] == PAD).all()


def test_collator_starts_a_new_row_for_an_example_that_fits_no_row():
    examples = [{"input_ids": [5] * 8, "labels": [6] * 2} for _ in range(3)]
    batch = PackedSeq2SeqCollator(PAD, START, max_input_length=10, max_target_length=10)(examples)
    assert batch["input_ids"].shape == (3, 8)
    assert batch["segment_ids"].amax().item() == 1
    # The target budget limits rows too.
    examples = [{"input_ids": [5], "labels": [6] * 6} for _ in range(3)]
    rows, _ = pack_examples(examples, max_input_length=10, max_target_length=10)
    assert sorted(len(row) for row in rows) == [1, 1, 1]


def test_collator_pads_to_budget_or_multiple():
    examples = make_examples()
    fixed = PackedSeq2SeqCollator(PAD, START, 32, 14, pad_to_budget=True)(examples)
    assert fixed["input_ids"].shape[1] == 32 and fixed["labels"].shape[1] == 14
    rounded = PackedSeq2SeqCollator(PAD, START, 32, 14, pad_to_multiple_of=8)(examples)
    assert rounded["input_ids"].shape[1] % 8 == 0 and rounded["labels"].shape[1] % 8 == 0


def test_collator_errors_on_bad_budgets_and_examples():
    for budget in (0, -3, 2.5, None):
        with pytest.raises(ValueError, match="max_input_length must be a positive integer"):
            PackedSeq2SeqCollator(PAD, START, budget, 8)
    with pytest.raises(ValueError, match="max_target_length must be a positive integer"):
        PackedSeq2SeqCollator(PAD, START, 8, 0)
    collator = PackedSeq2SeqCollator(PAD, START, 8, 4)
    with pytest.raises(ValueError, match="example 1 has 9 input tokens, more than the budget of 8"):
        collator([{"input_ids": [3], "labels": [4]}, {"input_ids": [3] * 9, "labels": [4]}])
    with pytest.raises(ValueError, match="example 0 has 5 target tokens"):
        collator([{"input_ids": [3], "labels": [4] * 5}])
    with pytest.raises(ValueError, match="example 0 has no labels"):
        collator([{"input_ids": [3], "labels": []}])
    with pytest.raises(ValueError, match="got no examples"):
        collator([])
    truncated = PackedSeq2SeqCollator(PAD, START, 8, 4, truncate=True)([{"input_ids": list(range(2, 12)),
                                                                          "labels": [4] * 5}])
    assert truncated["input_ids"][0].tolist() == list(range(2, 10)) and truncated["labels"].shape == (1, 4)


def test_collator_records_the_padding_fraction():
    collator = PackedSeq2SeqCollator(PAD, START, 32, 14)
    batch = collator(make_examples())
    real = int(batch["attention_mask"].sum() + batch["decoder_attention_mask"].sum())
    total = batch["attention_mask"].numel() + batch["decoder_attention_mask"].numel()
    assert collator.padding.padding_fraction == pytest.approx(1 - real / total)
    assert padding_fraction(batch) == pytest.approx(1 - real / total)
    assert collator.padding.pop() == pytest.approx(1 - real / total) and collator.padding.total_tokens == 0
    tracker = PaddingTracker()
    tracker.update(batch)
    tracker.update(batch)
    assert tracker.padding_fraction == pytest.approx(1 - real / total)


# --- length grouping ---


def skewed_lengths(count=2000, seed=0):
    rng = random.Random(seed)
    # Mostly short examples, a long tail: the case where naive batches pad the most.
    return [min(512, int(rng.lognormvariate(3.5, 0.8)) + 1) for _ in range(count)]


def naive_padding_fraction(lengths, batch_size):
    real = total = 0
    for start in range(0, len(lengths), batch_size):
        chunk = lengths[start:start + batch_size]
        real += sum(chunk)
        total += len(chunk) * max(chunk)
    return 1 - real / total


def test_token_budget_batches_cover_every_example_within_budget_with_less_padding():
    lengths = skewed_lengths()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=2048, window=500, seed=1)
    batches = list(sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert all(len(batch) * max(lengths[i] for i in batch) <= 2048 for batch in batches)
    average_batch = len(lengths) / len(batches)
    naive = naive_padding_fraction(lengths, round(average_batch))
    assert sampler.padding_fraction < naive / 3, (sampler.padding_fraction, naive)
    first = [list(batch) for batch in sampler]
    sampler.set_epoch(1)
    assert [list(batch) for batch in sampler] != first and len(sampler) == len(sampler.batches)


def test_group_by_length_streams_batches_within_budget():
    lengths = skewed_lengths(600)
    examples = [{"input_ids": [3] * (n - 1), "labels": [4]} for n in lengths]
    batches = list(group_by_length(iter(examples), max_tokens=1024, window=200))
    assert sum(len(batch) for batch in batches) == len(examples)
    assert all(len(batch) * max(len(e["input_ids"]) + 1 for e in batch) <= 1024 for batch in batches)
    with pytest.raises(ValueError, match="exceeds the batch budget"):
        list(group_by_length([{"input_ids": [3] * 30, "labels": [4]}], max_tokens=16))
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        TokenBudgetBatchSampler([3, 4], max_tokens=0)
