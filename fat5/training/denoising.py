"""Denoising objectives for pretraining T5s: T5 span corruption and UL2 mixtures of denoisers.

Span corruption follows T5's definitions (t5.data.preprocessors `random_spans_noise_mask` and
`random_spans_helper`): a text of L tokens gets round(L * r) noise tokens in round(noise / mu) spans; noise and
kept spans alternate, starting with a kept span, and their lengths are random partitions into non-empty parts.
Each noise span becomes one sentinel in the input; the target lists the sentinels, each followed by the tokens it
hides. The first span gets `<extra_id_0>`, the next `<extra_id_1>`, and so on.

A UL2 mixture draws one denoiser per example. R and X denoisers are span corruption with their (mu, r); S
denoisers are prefix language modelling. Two S variants exist:
  * `"prefix"` (FAT5's S, used by the `fat5` mixture): the input keeps the first round(L / mu) tokens followed by
    `<extra_id_0>`, the target is `<extra_id_0>` and the rest: with mu = 4 the model always sees 25% of the text
    and predicts 75%.
  * `"random_prefix"` (the UL2 paper's S, used by the `ul2` mixture): the text is split at a uniformly random point
    as t5's `random_prefix_noise_mask` does with density r (r = 0.5: the split is uniform over the whole text);
    the input is the part before the split, the target the part after it, with no sentinel.

Everything here is plain Python/numpy on lists of token ids; randomness comes from a numpy Generator, so an
example is a deterministic function of its tokens and its generator's seed.
"""

from dataclasses import dataclass

import numpy as np

SPAN, PREFIX, RANDOM_PREFIX = "span", "prefix", "random_prefix"


@dataclass(frozen=True)
class Denoiser:
    """One denoising objective. `kind` is "span" (R and X), "prefix" (FAT5's S) or "random_prefix" (UL2's S);
    `mean_span_length` is mu, `noise_density` is r, `max_spans` caps the number of noise spans (None: no cap), and
    `prefix` is the mode token put first in the input (None: none)."""

    kind: str = SPAN
    mean_span_length: float = 3.0
    noise_density: float = 0.15
    max_spans: int | None = None
    prefix: str | None = None

    def __post_init__(self):
        if self.kind not in (SPAN, PREFIX, RANDOM_PREFIX):
            raise ValueError(f"Denoiser.kind must be one of {SPAN!r}, {PREFIX!r}, {RANDOM_PREFIX!r}, "
                             f"got {self.kind!r}")
        if self.kind == SPAN and not 0.0 < self.noise_density < 1.0:
            raise ValueError(f"a span denoiser needs 0 < noise_density < 1, got {self.noise_density!r}")
        if self.kind == RANDOM_PREFIX and not 0.0 < self.noise_density <= 0.5:
            raise ValueError(f"a random-prefix denoiser needs 0 < noise_density <= 0.5 (as t5's "
                             f"random_prefix_noise_mask), got {self.noise_density!r}")
        if self.kind in (SPAN, PREFIX) and not self.mean_span_length >= 1.0:
            raise ValueError(f"mean_span_length must be >= 1, got {self.mean_span_length!r}")
        if self.max_spans is not None and self.max_spans < 1:
            raise ValueError(f"max_spans must be a positive integer or None, got {self.max_spans!r}")

    def expected_noise_density(self):
        """The fraction of a long text that goes to the target: r, or 1 - 1/mu for FAT5's S."""
        return 1.0 - 1.0 / self.mean_span_length if self.kind == PREFIX else self.noise_density

    def __str__(self):
        if self.kind == PREFIX:
            return f"S(mu={self.mean_span_length:g}, keeps 1/mu)"
        if self.kind == RANDOM_PREFIX:
            return f"S(random split, r={self.noise_density:g})"
        cap = f", max_spans={self.max_spans}" if self.max_spans else ""
        return f"{self.prefix or ''}(mu={self.mean_span_length:g}, r={self.noise_density:g}{cap})"


def R(mu, r, prefix="[R]"):  # noqa: N802 - UL2's names
    return Denoiser(SPAN, mu, r, None, prefix)


def X(mu, r, prefix="[X]"):  # noqa: N802
    return Denoiser(SPAN, mu, r, None, prefix)


# The mixture FAT5 published (flashT5's French pretraining) and the one of the UL2 paper (Tay et al. 2022, with its
# mixing rates unpublished, so FAT5's proportions per family are reused). (denoiser, proportion) pairs.
MIXTURES = {
    "fat5": [
        (R(3, 0.15), 0.165), (R(8, 0.15), 0.165),
        (Denoiser(PREFIX, 4, 0.0, 1, "[S]"), 0.34),
        (X(3, 0.5), 0.0825), (X(8, 0.15), 0.0825), (X(64, 0.15), 0.0825), (X(64, 0.5), 0.0825),
    ],
    "ul2": [
        (R(3, 0.15), 0.165), (R(8, 0.15), 0.165),
        (Denoiser(RANDOM_PREFIX, 1.0, 0.5, None, "[S]"), 0.34),
        (X(3, 0.5), 0.0825), (X(8, 0.5), 0.0825), (X(64, 0.15), 0.0825), (X(64, 0.5), 0.0825),
    ],
    # Plain T5 span corruption (T5 v1.1, nanoT5): no prefix token.
    "t5": [(Denoiser(SPAN, 3, 0.15, None, None), 1.0)],
}


def span_counts(length, noise_density, mean_span_length, max_spans=None):
    """(noise tokens, noise spans) of a text of `length` tokens, as `random_spans_noise_mask` computes them."""
    length = max(length, 2)
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(int(round(num_noise / mean_span_length)), 1)
    # Every span needs a kept token before it (T5 would make empty spans here; only r > 0.5 gets there).
    num_spans = min(num_spans, length - num_noise)
    if max_spans is not None:
        num_spans = min(num_spans, max_spans)
    return num_noise, num_spans


def _random_segmentation(num_items, num_segments, rng):
    """Lengths of a uniformly random partition of `num_items` items into `num_segments` non-empty segments."""
    starts = np.zeros(num_items, dtype=bool)
    starts[1 + rng.permutation(num_items - 1)[: num_segments - 1]] = True
    starts[0] = True
    return np.diff(np.append(np.flatnonzero(starts), num_items))


def random_spans_noise_mask(length, noise_density, mean_span_length, rng, max_spans=None):
    """Boolean mask of `length` tokens, True on noise: T5's `random_spans_noise_mask` (spans alternate kept/noise,
    starting with a kept span), with the span count optionally capped at `max_spans`."""
    orig_length, length = length, max(length, 2)
    num_noise, num_spans = span_counts(length, noise_density, mean_span_length, max_spans)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    kept_lengths = _random_segmentation(length - num_noise, num_spans, rng)
    is_noise = np.repeat(np.tile([False, True], num_spans), np.stack([kept_lengths, noise_lengths], 1).reshape(-1))
    return is_noise[:orig_length]


def random_prefix_noise_mask(length, noise_density, rng):
    """t5's `random_prefix_noise_mask`: noise after a split point drawn uniformly between
    round((1 - 2r) * (length - 1)) (at least 1) and length - 1."""
    max_input = length - 1
    min_input = min(max_input, max(1, int(round((1 - 2 * noise_density) * max_input))))
    return np.arange(length) >= rng.integers(min_input, max_input + 1)


def _last_true(test, low, high=None):
    """The largest n >= `low` (and <= `high`, when given) with `test(n)` true, for a `test` true up to some n and
    false after it (true at `low`): galloping up, then bisecting."""
    if high is None:
        step = 1
        while test(low + step):
            step *= 2
        high = low + step - 1
    while low < high:
        middle = (low + high + 1) // 2
        if test(middle):
            low = middle
        else:
            high = middle - 1
    return low


def random_spans_helper(inputs_length, noise_density, mean_span_length, extra_tokens_per_span_inputs=1,
                        extra_tokens_per_span_targets=1):
    """T5's `random_spans_helper`: the raw text length whose span-corrupted input is at most `inputs_length`
    tokens (with one sentinel per span and one EOS), and the resulting target length. Returns
    (tokens_length, targets_length)."""

    def lengths(tokens_length):
        num_noise = int(round(tokens_length * noise_density))
        num_spans = int(round(num_noise / mean_span_length))
        return (tokens_length - num_noise + num_spans * extra_tokens_per_span_inputs + 1,
                num_noise + num_spans * extra_tokens_per_span_targets + 1)

    # T5 counts up from inputs_length - 1 while the next length still fits; the input length only grows with the
    # text's, so the same length is found by bisection (steps logarithmic in inputs_length, not linear).
    start = inputs_length - 1
    tokens_length = start + _last_true(lambda extra: lengths(start + extra)[0] <= inputs_length, 0)
    _, targets_length = lengths(tokens_length)
    # T5 keeps the targets no longer than the (usually round) inputs length at r = 0.5.
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def example_lengths(denoiser, length):
    """(input tokens, target tokens, sentinels) of the example `denoiser` makes from `length` raw tokens, in the
    worst case over its randomness; the input counts the prefix token and EOS, the target EOS."""
    prefix = 1 if denoiser.prefix else 0
    if denoiser.kind == SPAN:
        num_noise, num_spans = span_counts(length, denoiser.noise_density, denoiser.mean_span_length,
                                           denoiser.max_spans)
        return prefix + length - num_noise + num_spans + 1, num_noise + num_spans + 1, num_spans
    if denoiser.kind == PREFIX:
        kept = _prefix_length(length, denoiser.mean_span_length)
        return prefix + kept + 2, length - kept + 2, 1
    max_input = length - 1
    min_input = min(max_input, max(1, int(round((1 - 2 * denoiser.noise_density) * max_input))))
    return prefix + max_input + 1, length - min_input + 1, 0


def max_raw_length(denoiser, max_input_length, max_target_length, num_sentinels):
    """The longest raw text whose example fits both budgets and needs at most `num_sentinels` sentinels. For span
    denoisers this starts from T5's `random_spans_helper` length and only shortens it when the targets or the
    sentinels would not fit, so r and mu stay exact. Raises ValueError when not even 2 tokens fit."""
    if denoiser.kind == SPAN:
        start, _ = random_spans_helper(max_input_length - (1 if denoiser.prefix else 0), denoiser.noise_density,
                                       denoiser.mean_span_length)
    else:
        start = max_input_length + max_target_length

    def fits(length):
        inputs, targets, sentinels = example_lengths(denoiser, length)
        return inputs <= max_input_length and targets <= max_target_length and sentinels <= num_sentinels

    # The longest length from `start` down that fits. An example's input, target and sentinel counts only grow with
    # its text's length, so the lengths that fit are those up to one: found by bisection, in steps logarithmic in
    # the budgets (counting down from `start` took hours for a budget of 10^12 tokens).
    if start >= 2 and fits(2):
        return start if fits(start) else 2 + _last_true(lambda extra: fits(2 + extra), 0, start - 2)
    raise ValueError(f"denoiser {denoiser} cannot fit an example of even 2 text tokens in max_input_length="
                     f"{max_input_length} and max_target_length={max_target_length} with {num_sentinels} sentinels")


def _prefix_length(length, mean_span_length):
    return min(max(int(round(length / mean_span_length)), 1), length - 1)


def noise_mask(denoiser, length, rng):
    """The noise mask `denoiser` draws for a text of `length` tokens."""
    if denoiser.kind == SPAN:
        return random_spans_noise_mask(length, denoiser.noise_density, denoiser.mean_span_length, rng,
                                       denoiser.max_spans)
    if denoiser.kind == PREFIX:
        return np.arange(length) >= _prefix_length(length, denoiser.mean_span_length)
    return random_prefix_noise_mask(length, denoiser.noise_density, rng)


def corrupt(tokens, mask, sentinel_ids, eos_token_id, prefix_id=None, use_sentinels=True):
    """Builds (input_ids, labels) from `tokens` and its noise `mask`: every noise span becomes the next sentinel in
    the input; the labels are each sentinel followed by the tokens it hides. Without sentinels (random-prefix S),
    the input is the kept tokens and the labels the noise tokens. Both end with EOS; the input starts with
    `prefix_id` when given."""
    inputs = [] if prefix_id is None else [prefix_id]
    labels = []
    span = -1
    previous = False
    for token, is_noise in zip(tokens, mask, strict=True):
        if is_noise and not previous and use_sentinels:
            span += 1
            if span >= len(sentinel_ids):
                raise ValueError(f"this example has more than {len(sentinel_ids)} noise spans, the number of "
                                 f"sentinel tokens")
            inputs.append(sentinel_ids[span])
            labels.append(sentinel_ids[span])
        (labels if is_noise else inputs).append(token)
        previous = bool(is_noise)
    return inputs + [eos_token_id], labels + [eos_token_id]


class DenoisingMixture:
    """Turns raw token sequences into UL2 (or T5) examples.

    `denoisers` is a list of (Denoiser, proportion) pairs (proportions are normalised) or a `MIXTURES` name;
    `sentinel_ids` the ids of `<extra_id_0>`, `<extra_id_1>`, ... in that order (see `sentinel_token_ids`);
    `prefix_ids` maps each prefix string to its token id. `raw_lengths[i]` is how many raw tokens denoiser i takes
    so that its examples fit `max_input_length` and `max_target_length`.
    """

    def __init__(self, denoisers, sentinel_ids, eos_token_id, max_input_length, max_target_length, prefix_ids=None):
        if isinstance(denoisers, str):
            if denoisers not in MIXTURES:
                raise ValueError(f"unknown mixture {denoisers!r}; choose one of {sorted(MIXTURES)}")
            denoisers = MIXTURES[denoisers]
        self.denoisers = [denoiser for denoiser, _ in denoisers]
        weights = np.array([weight for _, weight in denoisers], dtype=np.float64)
        if not len(weights) or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"mixture proportions must be non-negative with a positive sum, got {weights.tolist()}")
        self.proportions = weights / weights.sum()
        self.sentinel_ids = list(sentinel_ids)
        self.eos_token_id = eos_token_id
        self.prefix_ids = dict(prefix_ids or {})
        missing = {d.prefix for d in self.denoisers if d.prefix} - set(self.prefix_ids)
        if missing:
            raise ValueError(f"no token id given for the prefixes {sorted(missing)}")
        needs_sentinels = any(d.kind != RANDOM_PREFIX for d in self.denoisers)
        if needs_sentinels and not self.sentinel_ids:
            raise ValueError("the tokenizer has no sentinel tokens (<extra_id_0>, ...), which span corruption needs")
        self.raw_lengths = [max_raw_length(d, max_input_length, max_target_length, len(self.sentinel_ids))
                            for d in self.denoisers]

    def choose(self, rng):
        """Index of the denoiser for the next example."""
        return int(rng.choice(len(self.denoisers), p=self.proportions))

    def make_example(self, tokens, denoiser_index, rng):
        """{"input_ids", "labels"} for raw `tokens` (at least 2) under denoiser `denoiser_index`."""
        denoiser = self.denoisers[denoiser_index]
        mask = noise_mask(denoiser, len(tokens), rng)
        return dict(zip(("input_ids", "labels"), corrupt(
            tokens, mask, self.sentinel_ids, self.eos_token_id, self.prefix_ids.get(denoiser.prefix),
            use_sentinels=denoiser.kind != RANDOM_PREFIX), strict=True))

    def examples(self, documents, seed=0):
        """Yields examples from an iterable of token-id lists (one a document). Each example takes the next raw
        chunk of its denoiser's length from the current document (chunks never cross documents; a document's
        last chunk may be shorter; pieces under 2 tokens are dropped). Example n uses a generator seeded with
        (*seed, n) (`seed` an int or a tuple of ints), so the stream is deterministic for a seed."""
        seed = list(seed) if isinstance(seed, (tuple, list)) else [seed]
        count = 0
        for tokens in documents:
            start = 0
            while len(tokens) - start >= 2:
                rng = np.random.default_rng([*seed, count])
                index = self.choose(rng)
                chunk = tokens[start:start + self.raw_lengths[index]]
                start += len(chunk)
                yield self.make_example(chunk, index, rng)
                count += 1


def sentinel_token_ids(tokenizer):
    """Ids of `<extra_id_0>`, `<extra_id_1>`, ... in the tokenizer, in that order (looked up by name, never
    assumed); stops at the first one the tokenizer lacks."""
    ids = []
    vocab = tokenizer.get_vocab()
    while f"<extra_id_{len(ids)}>" in vocab:
        ids.append(vocab[f"<extra_id_{len(ids)}>"])
    return ids


__all__ = ["Denoiser", "DenoisingMixture", "MIXTURES", "R", "X", "corrupt", "example_lengths", "max_raw_length",
           "noise_mask", "random_prefix_noise_mask", "random_spans_helper", "random_spans_noise_mask",
           "sentinel_token_ids", "span_counts"]
