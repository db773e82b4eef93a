"""The logits-parity proof of both converters: the written folder, reloaded, against the model it came from.

One model is in memory at a time: the reference is loaded, its logits computed and the reference freed before the
written folder is loaded. The difference is taken over real (unpadded) decoder positions. Its tolerance follows the
numerics of what is compared: two correct computations of one model differ by rounding, which big weights or
peaked attention amplify, so the reference is run a second time with every weight moved by one rounding unit of its
dtype (`rounding_spread`), and the written model may differ by ROUNDING_FACTOR times what that moves the logits, or
by PARITY_TOLERANCE of the largest logit, whichever is more. A wrong tensor moves them by orders of magnitude more.
NaN and infinite logits (a model with non-finite weights, converted with --allow-non-finite) must be the same in
both. A written FAT5 model must also generate with its cache what it generates without (`prove_cached_generation`).
"""

import contextlib
import functools
import gc
from pathlib import Path

import torch

from fat5.cli import CheckFailed

# Verification tolerance on logits, relative to the largest reference logit, per stored dtype: the least allowed.
PARITY_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# Allowed difference, in units of the logits' own rounding spread (correct conversions measured at most 0.9 of it,
# flashT5's large-weight fixtures included; one tensor off by 1e-3 of its values at least 270).
ROUNDING_FACTOR = 8
GENERATION_STEPS = 6  # greedy steps of the cached-generation check
PARITY_TEXTS = ("translate English to German: The house is wonderful.", "summarize: studies have shown that "
                "owning a dog is good for you", "cola sentence: The course is jumping well.")


class ParityError(CheckFailed):
    """The written folder does not compute the logits of the model it was converted from."""


def parity_batch(folder, reference):
    """A padded batch for `reference` (a T5 or FAT5 model): a few sentences through the tokenizer in `folder`
    when it has one, else random token ids. Returns (batch, description)."""
    from transformers import AutoTokenizer

    import fat5

    if (Path(folder) / "tokenizer_config.json").is_file():
        # A written FAT5 folder names FAT5's code in config.json: unregistered, transformers 5's AutoTokenizer would
        # ask whether to run it (and wait 15 s in a terminal).
        fat5.register_auto_classes()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        batch = tokenizer(list(PARITY_TEXTS), padding=True, return_tensors="pt")
        labels = tokenizer([text.split(":")[0] for text in PARITY_TEXTS], padding=True, return_tensors="pt")
        batch["decoder_input_ids"] = reference.prepare_decoder_input_ids_from_labels(labels.input_ids)
        batch["decoder_attention_mask"] = labels.attention_mask
        return dict(batch), f"{len(PARITY_TEXTS)} padded sentences"
    generator = torch.Generator().manual_seed(0)
    vocab = reference.config.vocab_size
    batch = {"input_ids": torch.randint(2, vocab, (2, 17), generator=generator),
             "attention_mask": torch.ones(2, 17, dtype=torch.long),
             "decoder_input_ids": torch.randint(2, vocab, (2, 9), generator=generator),
             "decoder_attention_mask": torch.ones(2, 9, dtype=torch.long)}
    batch["attention_mask"][1, 11:] = 0
    return batch, "2 random padded sequences"


def finite_max(tensor):
    """The largest |value| among the finite ones (0 if none)."""
    tensor = tensor[tensor.isfinite()]
    return tensor.abs().max().item() if tensor.numel() else 0.0


def non_finite_mismatch(expected, actual):
    """(how many values of `expected` and of `actual` are NaN or infinite) when these are not the same values at
    the same places, else None."""
    bad = ~expected.isfinite()
    if torch.equal(bad, ~actual.isfinite()) and torch.equal(expected[bad].nan_to_num(), actual[bad].nan_to_num()):
        return None
    return int(bad.sum()), int((~actual.isfinite()).sum())


def rounding_spread(tensors, compute, expected):
    """How far `compute()` (which gave `expected`) moves when each of `tensors` (a model's weights) moves by one
    rounding unit of its dtype (a seeded random sign per element): the size of the differences rounding alone makes
    in this computation. Changes the tensors in place: call it last."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point():
                signs = torch.empty_like(tensor).bernoulli_(0.5, generator=generator).mul_(2).sub_(1)
                tensor.addcmul_(tensor, signs, value=torch.finfo(tensor.dtype).eps)
        return finite_max(expected - compute())


@contextlib.contextmanager
def loading_bars_hidden():
    """transformers' progress bars hidden inside the block (put back as they were after it): the models the proof
    loads are FAT5's own business, and their unlabelled "Loading weights" bars only crowd the command's output."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def real_logits(model, batch, real):
    """`model`'s logits on `batch`, in fp32, at the real (unpadded) decoder positions `real`."""
    with torch.no_grad():
        return model(**batch).logits.float()[real]


def prove_parity(load_reference, load_written, tokenizer_folder, check_generation=False):
    """Compare the logits of the model `load_reference()` returns with those of the model `load_written()` returns,
    on `parity_batch`; with `check_generation`, also the written model's cached generation
    (`prove_cached_generation`).

    The reference is freed before the written model is loaded. Returns (max |difference| over real decoder tokens,
    description of the sample); raises ParityError above tolerance (see the module docstring).
    """
    with loading_bars_hidden():
        reference = load_reference()
    batch, sample = parity_batch(tokenizer_folder, reference)
    real = batch["decoder_attention_mask"].bool()
    expected = real_logits(reference, batch, real)
    spread = rounding_spread(reference.parameters(), functools.partial(real_logits, reference, batch, real), expected)
    del reference
    gc.collect()
    with loading_bars_hidden():
        written = load_written()
    actual = real_logits(written, batch, real)
    stored = written.get_input_embeddings().weight.dtype
    sample = f"{sample}, {str(stored).removeprefix('torch.')}"
    mismatch = non_finite_mismatch(expected, actual)
    if mismatch is not None:
        raise ParityError(f"parity check failed: {mismatch[0]} of the source model's logits and {mismatch[1]} of "
                          f"the written model's are NaN or infinite, not the same ones ({sample})")
    non_finite = int((~expected.isfinite()).sum())
    if non_finite:
        sample += f"; {non_finite} of {expected.numel()} logits NaN or infinite in both"
    difference, scale = finite_max(expected - actual), finite_max(expected)
    tolerance = max(PARITY_TOLERANCE[stored] * scale, ROUNDING_FACTOR * spread)
    if not difference <= tolerance:
        raise ParityError(f"parity check failed: max |logits difference| {difference:.3g} > tolerance "
                          f"{tolerance:.3g} ({sample})")
    if check_generation:
        prove_cached_generation(written, batch, tolerance / scale if scale else PARITY_TOLERANCE[stored])
    return difference, sample


def prove_cached_generation(model, batch, relative_tolerance, steps=GENERATION_STEPS):
    """Greedy `generate` (transformers' own loop, as users call it) with the model's cache and without: at every
    step where a row's two sequences still agree, its logits must agree within `relative_tolerance` of the largest
    one (and be NaN or infinite at the same places). A cache the installed transformers hands the model in a way it
    does not read shows up here, although every single forward is right. (A row whose two runs pick different
    tokens at a near tie is compared up to that step.)"""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    options = dict(do_sample=False, num_beams=1, max_new_tokens=steps, min_new_tokens=steps, output_logits=True,
                   return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(**inputs, **options, use_cache=True)
        uncached = model.generate(**inputs, **options, use_cache=False)
    agree = torch.ones(len(batch["input_ids"]), dtype=torch.bool)
    start = cached.sequences.shape[1] - len(cached.logits)  # the decoder start token(s) come first
    for step, (with_cache, without) in enumerate(zip(cached.logits, uncached.logits, strict=True)):
        with_cache, without = with_cache[agree].float(), without[agree].float()
        mismatch = non_finite_mismatch(without, with_cache)
        if mismatch is not None:
            raise ParityError(f"generation check failed: at step {step + 1} of greedy generation, {mismatch[1]} "
                              f"logits are NaN or infinite with the cache and {mismatch[0]} without it")
        difference = finite_max(with_cache - without)
        if not difference <= relative_tolerance * finite_max(without):
            raise ParityError(f"generation check failed: at step {step + 1} of greedy generation, the logits with "
                              f"the cache differ from those without it by {difference:.3g}")
        agree &= cached.sequences[:, start + step] == uncached.sequences[:, start + step]
        if not agree.any():
            break


def load_fat5(folder, dtype=None):
    """A FAT5 folder's model on the eager reference attention (the backend the parity proof trusts)."""
    import fat5

    model = fat5.FAT5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    model.config.attention_backend = "eager"
    return model


def verify_parity(source_folder, folder, dtype, load_reference=None):
    """T5 -> FAT5: the FAT5 folder written at `folder` against the model of `source_folder`: transformers' T5, or
    what `load_reference(source_folder, dtype)` returns (flashT5's, see convert/flasht5_reference.py)."""
    from fat5.convert.checkpoint import load_source_model

    return prove_parity(lambda: (load_reference or load_source_model)(source_folder, dtype=dtype),
                        lambda: load_fat5(folder, dtype), folder, check_generation=True)


def verify_back_parity(fat5_folder, folder):
    """FAT5 -> T5: the checkpoint written at `folder`, loaded by plain transformers, against the FAT5 model."""
    from transformers import AutoModelForSeq2SeqLM

    from fat5.convert.checkpoint import untied_warning_silenced

    def load_written():
        with untied_warning_silenced():
            return AutoModelForSeq2SeqLM.from_pretrained(folder).eval()

    return prove_parity(lambda: load_fat5(fat5_folder), load_written, folder)
