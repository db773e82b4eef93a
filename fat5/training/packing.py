"""Packed seq2seq batches without cross-talk, and length-grouped batching by token budget.

Packing puts several (input, target) examples in one row, up to an encoder and a decoder token budget, and
numbers them with segment ids (1, 2, ... in each row; 0 is padding). FAT5's `forward(segment_ids=...,
decoder_segment_ids=...)` then keeps every example to itself: attention never crosses segments, positions restart
at each segment, and the loss of a row is the sum of its examples' token losses.

Length grouping is the alternative when rows should hold one example each: examples of similar length go into
the same batch, and a batch holds as many as fit a token budget once padded.
"""

import random

import torch

IGNORE_INDEX = -100


def _token_list(value, name, index):
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    value = list(value)
    if not value:
        raise ValueError(f"example {index} has no {name}: every packed example needs at least one input and one "
                         f"target token")
    return value


def _check_budget(value, name):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer number of tokens, got {value!r}")


def _fit(tokens, budget, name, index, truncate):
    if len(tokens) <= budget:
        return tokens
    if truncate:
        return tokens[:budget]
    raise ValueError(f"example {index} has {len(tokens)} {name} tokens, more than the budget of {budget}: raise "
                     f"max_{name}_length or pass truncate=True")


def pack_examples(examples, max_input_length, max_target_length, truncate=False):
    """Rows of example indices such that each row's inputs fit `max_input_length` tokens and its targets fit
    `max_target_length` tokens. First-fit over examples sorted by decreasing length: an example that fits no
    existing row starts a new one, so every example lands in exactly one row. Returns (rows, examples) with the
    examples as lists of token ids (cut to the budgets only when `truncate=True`; otherwise an example over a
    budget raises ValueError)."""
    _check_budget(max_input_length, "max_input_length")
    _check_budget(max_target_length, "max_target_length")
    cleaned = []
    for index, example in enumerate(examples):
        inputs = _fit(_token_list(example["input_ids"], "input_ids", index), max_input_length, "input", index,
                      truncate)
        labels = _fit(_token_list(example["labels"], "labels", index), max_target_length, "target", index,
                      truncate)
        cleaned.append((inputs, labels))
    order = sorted(range(len(cleaned)), key=lambda i: (-len(cleaned[i][0]), -len(cleaned[i][1]), i))
    rows, room = [], []  # room: (input tokens left, target tokens left) per row
    for index in order:
        need_input, need_target = len(cleaned[index][0]), len(cleaned[index][1])
        for row, (input_left, target_left) in enumerate(room):
            if need_input <= input_left and need_target <= target_left:
                rows[row].append(index)
                room[row] = (input_left - need_input, target_left - need_target)
                break
        else:
            rows.append([index])
            room.append((max_input_length - need_input, max_target_length - need_target))
    return rows, cleaned


def _round_up(length, multiple):
    return length if not multiple else -(-length // multiple) * multiple


class PaddingTracker:
    """Running count of real and padded tokens (encoder plus decoder), for logging a padding fraction; for packed
    batches also the tokens the same examples would have taken one a row (`unpacked_tokens`), padded to the
    longest as `pad_to_multiple_of` says."""

    def __init__(self, pad_to_multiple_of=None):
        self.real_tokens = 0
        self.total_tokens = 0
        self.unpacked_tokens = 0
        self.pad_to_multiple_of = pad_to_multiple_of

    def update(self, batch):
        """Counts a batch from its `attention_mask` and `decoder_attention_mask` (whichever it has), and with
        `segment_ids`/`decoder_segment_ids` what it would have taken unpacked."""
        for name, segments in (("attention_mask", "segment_ids"), ("decoder_attention_mask", "decoder_segment_ids")):
            mask = batch.get(name)
            if mask is None:
                continue
            self.real_tokens += int(mask.sum())
            self.total_tokens += mask.numel()
            lengths = segment_lengths(batch[segments]) if segments in batch else mask.sum(-1)
            if len(lengths):
                self.unpacked_tokens += len(lengths) * _round_up(int(lengths.max()), self.pad_to_multiple_of)

    @property
    def padding_fraction(self):
        return 1.0 - self.real_tokens / self.total_tokens if self.total_tokens else 0.0

    def pop(self):
        """The padding fraction since the last pop, and a reset."""
        fraction = self.padding_fraction
        self.real_tokens = self.total_tokens = 0
        return fraction


class PaddingFractionLoggingMixin:
    """Mixin for `transformers.Trainer` (``class MyTrainer(PaddingFractionLoggingMixin, Trainer)``): every training
    log gets `padding_fraction`, that of the batches trained on since the previous log (micro-batches of gradient
    accumulation included). Counted in the training loop, so DataLoader workers do not hide it."""

    def training_step(self, model, inputs, *args, **kwargs):
        if not hasattr(self, "padding_tracker"):
            self.padding_tracker = PaddingTracker()
        self.padding_tracker.update(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs, *args, **kwargs):
        tracker = getattr(self, "padding_tracker", None)
        if "loss" in logs and tracker is not None and tracker.total_tokens:
            logs["padding_fraction"] = round(tracker.pop(), 4)
        super().log(logs, *args, **kwargs)


def segment_lengths(segment_ids):
    """The token count of every segment of a (B, L) batch of segment ids (0: padding), one entry a segment."""
    segments = int(segment_ids.max()) + 1 if segment_ids.numel() else 1
    rows = torch.arange(segment_ids.shape[0], device=segment_ids.device)[:, None] * segments
    counts = torch.bincount((rows + segment_ids).flatten(), minlength=segment_ids.shape[0] * segments)
    counts = counts.view(segment_ids.shape[0], segments)[:, 1:].flatten()
    return counts[counts > 0]


class PackedTrainingMixin(PaddingFractionLoggingMixin):
    """Mixin for `transformers.Trainer` whose training batches are packed rows: `train_collator` (e.g. a
    `PackedSeq2SeqCollator`) collates the training batches and `data_collator` evaluation's and prediction's (one
    example a row, as generation needs). A batch holds the examples of an unpacked one (the same
    per_device_train_batch_size and steps), in fewer rows. Training logs get `padding_fraction`;
    `packing_summary()` says how much padding packing removed."""

    train_collator = None

    def get_train_dataloader(self):
        if self.train_collator is None:
            return super().get_train_dataloader()
        collator, self.data_collator = self.data_collator, self.train_collator
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def training_step(self, model, inputs, *args, **kwargs):
        if not hasattr(self, "packing_tracker"):
            self.packing_tracker = PaddingTracker(getattr(self.train_collator, "pad_to_multiple_of", None))
        self.packing_tracker.update(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def packing_summary(self):
        """One line: the padding of the batches trained on, packed and as they would have been one example a row."""
        tracker = getattr(self, "packing_tracker", None)
        if tracker is None or not tracker.total_tokens:
            return None
        unpacked = 1 - tracker.real_tokens / tracker.unpacked_tokens
        return (f"packing: {tracker.padding_fraction:.0%} of the tokens trained on were padding, "
                f"{unpacked:.0%} one example a row ({tracker.unpacked_tokens - tracker.total_tokens:,} padding "
                f"tokens of {tracker.unpacked_tokens:,} removed)")


def padding_fraction(batch):
    """Fraction of a batch's encoder plus decoder positions that are padding."""
    tracker = PaddingTracker()
    tracker.update(batch)
    return tracker.padding_fraction


class PackedSeq2SeqCollator:
    """Collates {"input_ids", "labels"} examples into packed rows for FAT5.

    Returns tensors: input_ids, attention_mask, segment_ids (B, L_enc); decoder_input_ids, decoder_attention_mask,
    decoder_segment_ids, labels (B, L_dec). Segment s of a row is the row's s-th example on both sides; its
    decoder inputs are its labels shifted right behind `decoder_start_token_id` (shifted per segment, never across
    two); labels are -100 on padding. Rows are padded to the longest row (a multiple of `pad_to_multiple_of`), or
    to the budgets with `pad_to_budget=True` (static shapes). The number of rows follows from the examples: give it
    more examples per call than rows you want. `padding` (a PaddingTracker) counts every batch made in this process;
    with DataLoader workers, count in the training loop instead (`PaddingTracker.update(batch)`).
    """

    def __init__(self, pad_token_id, decoder_start_token_id, max_input_length, max_target_length, truncate=False,
                 pad_to_budget=False, pad_to_multiple_of=None):
        _check_budget(max_input_length, "max_input_length")
        _check_budget(max_target_length, "max_target_length")
        if pad_token_id is None or decoder_start_token_id is None:
            raise ValueError("pad_token_id and decoder_start_token_id must be token ids, got "
                             f"{pad_token_id!r} and {decoder_start_token_id!r}")
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id
        self.max_input_length = max_input_length
        self.max_target_length = max_target_length
        self.truncate = truncate
        self.pad_to_budget = pad_to_budget
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding = PaddingTracker()

    def __call__(self, examples):
        if not examples:
            raise ValueError("PackedSeq2SeqCollator got no examples")
        rows, cleaned = pack_examples(examples, self.max_input_length, self.max_target_length, self.truncate)
        if self.pad_to_budget:
            input_length, target_length = self.max_input_length, self.max_target_length
        else:
            input_length = _round_up(max(sum(len(cleaned[i][0]) for i in row) for row in rows),
                                     self.pad_to_multiple_of)
            target_length = _round_up(max(sum(len(cleaned[i][1]) for i in row) for row in rows),
                                      self.pad_to_multiple_of)
        shape_input, shape_target = (len(rows), input_length), (len(rows), target_length)
        batch = {
            "input_ids": torch.full(shape_input, self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros(shape_input, dtype=torch.long),
            "segment_ids": torch.zeros(shape_input, dtype=torch.long),
            "decoder_input_ids": torch.full(shape_target, self.pad_token_id, dtype=torch.long),
            "decoder_attention_mask": torch.zeros(shape_target, dtype=torch.long),
            "decoder_segment_ids": torch.zeros(shape_target, dtype=torch.long),
            "labels": torch.full(shape_target, IGNORE_INDEX, dtype=torch.long),
        }
        for row, indices in enumerate(rows):
            input_start = target_start = 0
            for segment, index in enumerate(indices, start=1):
                inputs, labels = cleaned[index]
                input_end, target_end = input_start + len(inputs), target_start + len(labels)
                batch["input_ids"][row, input_start:input_end] = torch.tensor(inputs)
                batch["segment_ids"][row, input_start:input_end] = segment
                labels = torch.tensor(labels)
                decoder_inputs = torch.cat([torch.tensor([self.decoder_start_token_id]), labels[:-1]])
                decoder_inputs[decoder_inputs == IGNORE_INDEX] = self.pad_token_id
                batch["decoder_input_ids"][row, target_start:target_end] = decoder_inputs
                batch["decoder_segment_ids"][row, target_start:target_end] = segment
                batch["labels"][row, target_start:target_end] = labels
                input_start, target_start = input_end, target_end
        batch["attention_mask"] = (batch["segment_ids"] > 0).long()
        batch["decoder_attention_mask"] = (batch["decoder_segment_ids"] > 0).long()
        self.padding.update(batch)
        return batch


def _budget_batches(items, lengths, max_tokens):
    """Cuts `items` (already ordered by length) into consecutive batches whose padded size, examples times the
    longest one, stays within `max_tokens`."""
    batches, current, longest = [], [], 0
    for item in items:
        length = lengths(item)
        if length > max_tokens:
            raise ValueError(f"an example of {length} tokens exceeds the batch budget max_tokens={max_tokens}")
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(item)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def _padded_tokens(batches, lengths):
    real = sum(lengths(item) for batch in batches for item in batch)
    total = sum(len(batch) * max(lengths(item) for item in batch) for batch in batches)
    return real, total


class TokenBudgetBatchSampler(torch.utils.data.Sampler):
    """Batch sampler for a map-style dataset: examples of similar length share a batch, and each batch holds as
    many as fit `max_tokens` once padded (examples × longest). `lengths[i]` is example i's token count (e.g. input
    plus target length). Each epoch shuffles, sorts within windows of `window` examples (so batches stay random
    across the corpus), cuts, and shuffles the batches. A larger window pads less: on 20,000 lognormal lengths
    with 8192-token batches, windows of 1,000 / 5,000 / 20,000 give 21% / 6% / 2% padding (random batches: 83%).
    `padding_fraction` is that of the current epoch's batches.
    Use with `DataLoader(dataset, batch_sampler=...)`; call `set_epoch` for a new order."""

    def __init__(self, lengths, max_tokens, window=10000, shuffle=True, seed=0):
        _check_budget(max_tokens, "max_tokens")
        _check_budget(window, "window")
        self.lengths = [int(length) for length in lengths]
        self.max_tokens = max_tokens
        self.window = window
        self.shuffle = shuffle
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch):
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed + epoch)
        if self.shuffle:
            rng.shuffle(order)
        batches = []
        for start in range(0, len(order), self.window):
            window = sorted(order[start:start + self.window], key=lambda i: self.lengths[i])
            batches += _budget_batches(window, self.lengths.__getitem__, self.max_tokens)
        if self.shuffle:
            rng.shuffle(batches)
        self.batches = batches
        real, total = _padded_tokens(batches, self.lengths.__getitem__)
        self.padding_fraction = 1.0 - real / total if total else 0.0

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def group_by_length(examples, max_tokens, window=10000, length=None, seed=0):
    """Streaming form of `TokenBudgetBatchSampler`: reads `window` examples at a time from an iterable, sorts them
    by `length(example)` (default: input plus target tokens), and yields lists of examples within `max_tokens`
    once padded, in random order within each window."""
    _check_budget(max_tokens, "max_tokens")
    _check_budget(window, "window")
    length = length or (lambda example: len(example["input_ids"]) + len(example["labels"]))
    rng = random.Random(seed)
    buffer = []

    def flush():
        batches = _budget_batches(sorted(buffer, key=length), length, max_tokens)
        rng.shuffle(batches)
        return batches

    for example in examples:
        buffer.append(example)
        if len(buffer) == window:
            yield from flush()
            buffer = []
    if buffer:
        yield from flush()


__all__ = ["PackedSeq2SeqCollator", "PackedTrainingMixin", "PaddingFractionLoggingMixin", "PaddingTracker",
           "TokenBudgetBatchSampler", "group_by_length", "pack_examples", "padding_fraction", "segment_lengths"]
