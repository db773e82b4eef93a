"""Denoising objectives: T5 span corruption and the UL2 mixtures, measured over thousands of examples."""

import numpy as np
import pytest

from fat5.training.denoising import (
    MIXTURES,
    PREFIX,
    RANDOM_PREFIX,
    SPAN,
    Denoiser,
    DenoisingMixture,
    example_lengths,
    max_raw_length,
    noise_mask,
    random_spans_helper,
    sentinel_token_ids,
)

SENTINELS = list(range(900, 800, -1))  # <extra_id_0> = 900, <extra_id_1> = 899, ... (T5 order: descending ids)
EOS = 1
PREFIX_IDS = {"[R]": 10, "[S]": 11, "[X]": 12}
ALL_DENOISERS = sorted({d for mixture in MIXTURES.values() for d, _ in mixture}, key=str)


def mixture(name="fat5", max_input_length=512, max_target_length=512, sentinels=SENTINELS):
    return DenoisingMixture(name, sentinels, EOS, max_input_length, max_target_length, PREFIX_IDS)


def reassemble(example, denoiser):
    """The original text back from an example: the input with every sentinel replaced by what the target says
    it hides (or, for the random-prefix S, the input followed by the target)."""
    inputs = example["input_ids"][1 if denoiser.prefix else 0:-1]
    labels = example["labels"][:-1]
    if denoiser.kind == RANDOM_PREFIX:
        return inputs + labels
    hidden, current = {}, None
    for token in labels:
        if token in SENTINELS:
            current = hidden.setdefault(token, [])
        else:
            current.append(token)
    return [t for token in inputs for t in (hidden[token] if token in SENTINELS else [token])]


def test_random_spans_helper_matches_t5():
    # T5 and nanoT5: 512 input tokens at r = 0.15, mu = 3 come from 568 raw tokens and give 114 targets.
    assert random_spans_helper(512, 0.15, 3.0) == (568, 114)
    # r = 0.5: T5 trims one token so that targets do not exceed inputs.
    tokens_length, targets_length = random_spans_helper(512, 0.5, 3.0)
    assert targets_length <= 512


@pytest.mark.parametrize("denoiser", ALL_DENOISERS, ids=str)
def test_corruption_rate_and_mean_span_length(denoiser):
    # 3,000 texts of 512 to 4,096 tokens. Tolerances: rate within 1 point of the expected density (for the
    # random-prefix S the per-text rate is uniform on (0, 1), sd 0.29 / sqrt(3000) = 0.005, so 1 point is 2 sd;
    # with the fixed seed the draw is deterministic); mean span length within 5% of mu.
    rng = np.random.default_rng(0)
    noise = total = spans = 0
    for _ in range(3000):
        length = int(rng.integers(512, 4097))
        mask = noise_mask(denoiser, length, rng)
        noise += int(mask.sum())
        total += length
        spans += int((mask[1:] & ~mask[:-1]).sum() + mask[0])
    assert abs(noise / total - denoiser.expected_noise_density()) <= 0.01
    if denoiser.kind == SPAN:
        assert abs(noise / spans - denoiser.mean_span_length) <= 0.05 * denoiser.mean_span_length
    else:
        assert spans == 3000  # one target span per text: prefix language modelling


@pytest.mark.parametrize("denoiser", ALL_DENOISERS, ids=str)
def test_examples_reassemble_fit_and_use_sentinels_in_order(denoiser):
    mix = DenoisingMixture([(denoiser, 1.0)], SENTINELS, EOS, 512, 512, PREFIX_IDS)
    raw_length = mix.raw_lengths[0]
    rng = np.random.default_rng(1)
    for _ in range(200):
        length = int(rng.integers(2, raw_length + 1))
        tokens = rng.integers(1000, 30000, length).tolist()
        example = mix.make_example(tokens, 0, rng)
        inputs, labels = example["input_ids"], example["labels"]
        assert reassemble(example, denoiser) == tokens
        assert inputs[-1] == EOS and labels[-1] == EOS
        assert (inputs[0] == PREFIX_IDS[denoiser.prefix]) if denoiser.prefix else True
        used = [t for t in inputs if t in SENTINELS]
        assert used == SENTINELS[:len(used)]  # <extra_id_0> first, then in order
        assert [t for t in labels if t in SENTINELS] == used
        if denoiser.kind == SPAN:
            assert labels[0] == SENTINELS[0]  # targets open with the first sentinel
        # worst-case lengths bound the real ones, and the raw length fits the budgets
        max_inputs, max_labels, _ = example_lengths(denoiser, length)
        assert len(inputs) <= max_inputs <= 512 and len(labels) <= max_labels <= 512


def test_fat5_s_keeps_the_first_quarter():
    s = Denoiser(PREFIX, 4, 0.0, 1, "[S]")
    mix = DenoisingMixture([(s, 1.0)], SENTINELS, EOS, 512, 512, PREFIX_IDS)
    tokens = list(range(1000, 1400))
    example = mix.make_example(tokens, 0, np.random.default_rng(0))
    assert example["input_ids"] == [PREFIX_IDS["[S]"]] + tokens[:100] + [SENTINELS[0], EOS]
    assert example["labels"] == [SENTINELS[0]] + tokens[100:] + [EOS]


def test_ul2_s_splits_uniformly():
    s = Denoiser(RANDOM_PREFIX, 1.0, 0.5, None, "[S]")
    rng = np.random.default_rng(0)
    length, draws = 40, 20000
    splits = np.array([int(np.argmax(noise_mask(s, length, rng))) for _ in range(draws)])
    # t5's random_prefix_noise_mask at r = 0.5: the input keeps 1 to length - 1 tokens, each equally likely.
    counts = np.bincount(splits, minlength=length)
    assert counts[0] == 0 and counts[1:].min() > 0
    expected = draws / (length - 1)
    assert np.abs(counts[1:] - expected).max() <= 5 * np.sqrt(expected)  # 5 sd of a binomial count
    mix = DenoisingMixture([(s, 1.0)], SENTINELS, EOS, 512, 512, PREFIX_IDS)
    example = mix.make_example(list(range(1000, 1100)), 0, rng)
    assert not set(example["input_ids"]) & set(SENTINELS) and not set(example["labels"]) & set(SENTINELS)


@pytest.mark.parametrize("name", sorted(MIXTURES))
def test_mixture_proportions(name):
    mix = mixture(name)
    rng = np.random.default_rng(0)
    draws = 20000
    counts = np.bincount([mix.choose(rng) for _ in range(draws)], minlength=len(mix.denoisers))
    for count, proportion in zip(counts, mix.proportions):
        # within 4 binomial standard deviations
        assert abs(count / draws - proportion) <= 4 * np.sqrt(proportion * (1 - proportion) / draws) + 1e-12


def test_published_mixtures():
    fat5 = [(d.kind, d.mean_span_length, d.noise_density, d.prefix, p) for d, p in MIXTURES["fat5"]]
    assert fat5 == [(SPAN, 3, 0.15, "[R]", 0.165), (SPAN, 8, 0.15, "[R]", 0.165), (PREFIX, 4, 0.0, "[S]", 0.34),
                    (SPAN, 3, 0.5, "[X]", 0.0825), (SPAN, 8, 0.15, "[X]", 0.0825),
                    (SPAN, 64, 0.15, "[X]", 0.0825), (SPAN, 64, 0.5, "[X]", 0.0825)]
    assert MIXTURES["fat5"][2][0].max_spans == 1
    ul2_x = [(d.mean_span_length, d.noise_density) for d, _ in MIXTURES["ul2"] if d.prefix == "[X]"]
    assert ul2_x == [(3, 0.5), (8, 0.5), (64, 0.15), (64, 0.5)]
    assert sum(p for _, p in MIXTURES["fat5"]) == pytest.approx(1.0, rel=1e-12)


def test_stream_is_deterministic_and_never_crosses_documents():
    mix = mixture(max_input_length=64, max_target_length=64)
    rng = np.random.default_rng(0)
    documents = [rng.integers(1000, 30000, int(n)).tolist() for n in rng.integers(1, 300, 50)]

    def run(seed):
        return list(mix.examples(documents, seed=seed))

    first = run(0)
    assert first == run(0) and first != run(1)
    # Rebuild each document from consecutive examples: the chunks tile it exactly, in order.
    examples = iter(first)
    for document in documents:
        rebuilt = []
        while len(document) - len(rebuilt) >= 2:
            example = next(examples)
            # every FAT5 denoiser has a prefix and sentinels, so one reassembly rule serves them all
            rebuilt += reassemble(example, mix.denoisers[0])
            assert len(example["input_ids"]) <= 64 and len(example["labels"]) <= 64
        assert rebuilt == document[:len(rebuilt)] and len(document) - len(rebuilt) < 2
    assert next(examples, None) is None


def test_raw_lengths_respect_the_sentinel_supply():
    # 8 sentinels (the demo tokenizer): X(3, 0.5) would need ~43 spans at 256 inputs, so its text gets shorter
    # instead of its spans longer.
    x = Denoiser(SPAN, 3, 0.5, None, "[X]")
    length = max_raw_length(x, 256, 256, num_sentinels=8)
    assert example_lengths(x, length)[2] <= 8 < example_lengths(x, length + 10)[2]


def counted_spans_helper(inputs_length, noise_density, mean_span_length):
    """T5's random_spans_helper as T5 writes it: counting up one raw token at a time."""
    def lengths(tokens_length):
        num_noise = int(round(tokens_length * noise_density))
        num_spans = int(round(num_noise / mean_span_length))
        return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    targets_length = lengths(tokens_length)[1]
    if noise_density == 0.5 and targets_length > inputs_length:
        return tokens_length - 1, targets_length - 1
    return tokens_length, targets_length


def counted_raw_length(denoiser, max_input_length, max_target_length, num_sentinels):
    """The longest raw length that fits, counting down one token at a time from where max_raw_length starts."""
    start = random_spans_helper(max_input_length - (1 if denoiser.prefix else 0), denoiser.noise_density,
                                denoiser.mean_span_length)[0] if denoiser.kind == SPAN \
        else max_input_length + max_target_length
    for length in range(start, 1, -1):
        inputs, targets, sentinels = example_lengths(denoiser, length)
        if inputs <= max_input_length and targets <= max_target_length and sentinels <= num_sentinels:
            return length
    return None


def test_raw_lengths_are_found_by_bisection_as_counting_finds_them():
    """An example's input, target and sentinel counts only grow with its text, so bisection finds the lengths
    counting finds (counting took hours for --max_input_length 10**12), for every denoiser and budget."""
    for inputs_length in [*range(1, 300), 511, 512, 4096, 10**5]:
        for density, mean in ((0.15, 3.0), (0.5, 3.0), (0.5, 32.0), (0.15, 8.0)):
            assert random_spans_helper(inputs_length, density, mean) == counted_spans_helper(
                inputs_length, density, mean), (inputs_length, density, mean)
    budgets = [(i, t, s) for i in (2, 3, 5, 9, 17, 64, 257, 1000) for t in (2, 3, 7, 33, 128, 999) for s in (1, 8, 100)]
    for denoiser in [*ALL_DENOISERS, Denoiser(SPAN, 3, 0.9, None, "[X]"), Denoiser(RANDOM_PREFIX, 1, 0.05, None, "[S]"),
                     Denoiser(PREFIX, 1.5, 0.25, None, "[S]"), Denoiser(SPAN, 3, 0.5, 4, None)]:
        for budget in budgets:
            expected = counted_raw_length(denoiser, *budget)
            if expected is None:
                with pytest.raises(ValueError, match="cannot fit an example"):
                    max_raw_length(denoiser, *budget)
            else:
                assert max_raw_length(denoiser, *budget) == expected, (denoiser, budget)
    assert max_raw_length(Denoiser(SPAN, 3, 0.15, None, "[R]"), 10**12, 512, 100) == counted_raw_length(
        Denoiser(SPAN, 3, 0.15, None, "[R]"), 5000, 512, 100)


def test_budget_smaller_than_one_example():
    with pytest.raises(ValueError, match="cannot fit an example"):
        mixture(max_input_length=3, max_target_length=3)


def test_no_sentinels_is_an_error():
    with pytest.raises(ValueError, match="no sentinel tokens"):
        mixture(sentinels=[])


def test_sentinel_ids_come_from_the_tokenizer():
    class Vocab:
        def get_vocab(self):
            return {"<extra_id_1>": 7, "<extra_id_0>": 9, "<extra_id_2>": 3, "<extra_id_4>": 2, "a": 5}

    assert sentinel_token_ids(Vocab()) == [9, 7, 3]
