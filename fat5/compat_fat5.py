"""What FAT5 adapts to in the transformers it runs under, in one place.

FAT5's code runs under whatever transformers its user has, long after it was written. Every difference between the
releases it supports is bridged here, each detected by feature (an output field, a method, a module) rather than by
version number, so a later release that keeps the feature keeps working. The releases FAT5 was checked against are
`TESTED_TRANSFORMERS`; under any other, FAT5 says so once (`warn_if_untested`).

Exported with the model code (it imports only transformers and the standard library).
"""

import dataclasses
import inspect
import re
import warnings

import transformers
from transformers import PreTrainedModel, T5ForConditionalGeneration
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import is_torchdynamo_compiling, logging

logger = logging.get_logger(__name__)

# The transformers releases FAT5 is tested with: CI runs the drift check (tests/test_drift.py) on each and the whole
# suite on the oldest and the newest. A later patch release of one of these series (5.25.1) counts as tested; any
# other release does not. pyproject.toml admits these and every later release (lower bounds only: a user's newest
# transformers is never downgraded), and FAT5 logs one line under a release not listed here. Every exported folder
# records them in config.json (`tested_transformers`) and in its model card.
TESTED_TRANSFORMERS = ("4.57.6", "5.23.0", "5.24.0", "5.25.0")

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (the old name is
# deprecated there). FAT5 returns the cache under the installed transformers' name and accepts either name as input
# on every release (`either_cache`).
CACHE_NAME = "cache" if "cache" in {field.name for field in dataclasses.fields(Seq2SeqLMOutput)} else "past_key_values"
# Where T5's forward takes `cache`, it warns when given `past_key_values` (transformers 5.24 says 5.40 removes it).
T5_DEPRECATES_PAST_KEY_VALUES = "cache" in inspect.signature(T5ForConditionalGeneration.forward).parameters

# transformers 5 initialises through `transformers.initialization`, which skips tensors loaded from a checkpoint;
# 4.x initialises only modules whose weights are missing, with torch's functions.
try:
    from transformers import initialization as init
except ImportError:
    from torch.nn import init  # noqa: F401  (re-exported)

# transformers 4.x has no generic `PreTrainedModel.get_encoder` (each T5 class defines its own); generate and
# optimum's ONNX exporter call it. Where transformers has one, FAT5 uses it (5.x's also takes `modality`).
HAS_GENERIC_GET_ENCODER = hasattr(PreTrainedModel, "get_encoder")


def _takes_any_keyword(function):
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD
               for parameter in inspect.signature(function).parameters.values())


# transformers 4.x's T5 forwards name every argument they take: an unknown keyword (a misspelt `label=`) raises
# TypeError, and transformers' own callers read the signature (generate refuses unknown generate() kwargs, the
# Trainer passes `num_items_in_batch` to a forward with **kwargs, generate filters what it passes the encoder).
# transformers 5's take **kwargs and ignore what they do not use. FAT5's forwards take **kwargs and follow the
# installed release's T5 (`match_t5_signature`, `check_keywords`).
FORWARD_TAKES_ANY_KEYWORD = _takes_any_keyword(T5ForConditionalGeneration.forward)
# transformers 4.x's generate passes `cache_position` to every encoder-decoder forward (its T5 declares it); 5.x's
# T5 does not take it, and generate warns about a remote-code forward that does. FAT5's forwards take it (and
# need no position: they count from the cache) and show it where T5's do.
T5_TAKES_CACHE_POSITION = "cache_position" in inspect.signature(T5ForConditionalGeneration.forward).parameters


def match_t5_signature(forward):
    """Give `forward` (a FAT5 forward with **kwargs and `cache_position`) the signature transformers reads (its
    `__signature__`) as the installed release's T5 forwards have it: without **kwargs where T5's take none, without
    `cache_position` where T5's lack it. (A signature, not a wrapper: export tools take a forward with
    `__wrapped__` for transformers' decorators.)"""
    signature = inspect.signature(forward)
    shown = [parameter for parameter in signature.parameters.values()
             if not (parameter.kind is inspect.Parameter.VAR_KEYWORD and not FORWARD_TAKES_ANY_KEYWORD)
             and not (parameter.name == "cache_position" and not T5_TAKES_CACHE_POSITION)]
    forward.__signature__ = signature.replace(parameters=shown)


def check_keywords(model, kwargs):
    """The TypeError transformers 4.x's T5 raises for a keyword its forward does not take (`kwargs`: what FAT5's
    forward collected beyond its named parameters); nothing where T5's forwards ignore unknown keywords."""
    if kwargs and not FORWARD_TAKES_ANY_KEYWORD:
        raise TypeError(f"{type(model).__name__}.forward() got an unexpected keyword argument '{next(iter(kwargs))}'")


def either_cache(cache, past_key_values, model):
    """The cache a forward of `model` was given, under either name: FAT5's forwards take both `cache` (in the
    position T5's forward has its cache argument) and `past_key_values` (a keyword), on every transformers release.
    `past_key_values` gives T5's FutureWarning where T5's forward gives it. Given both names, the cache named
    `cache` is used, as T5's forward uses it, unless it holds nothing and the other does: transformers 5.24's
    generate passes the empty cache it made as `cache` beside the one a caller filled under the old name (PEFT's
    prefix tuning passes its virtual tokens so), which T5 drops. (Plain parameters rather than a renaming
    decorator: export tools such as optimum take a forward with `__wrapped__` for transformers' own decorator and
    call what it wraps.)"""
    if past_key_values is not None:
        if T5_DEPRECATES_PAST_KEY_VALUES and not is_torchdynamo_compiling():
            warnings.warn(f"`past_key_values` is deprecated for `{type(model).__name__}.forward`, as for T5's "
                          f"(transformers 5.24 renamed it `cache` and removes the old name in 5.40.0): pass the cache "
                          f"as `cache`", FutureWarning, stacklevel=3)
        if cache is not None and not _holds_tokens(cache) and _holds_tokens(past_key_values):
            cache = None
    return past_key_values if cache is None else cache


def _holds_tokens(cache):
    seq_length = getattr(cache, "get_seq_length", None)
    return seq_length is None or int(seq_length()) > 0


def cache_field(cache):
    """The keyword that puts `cache` into a transformers model output: `{CACHE_NAME: cache}`."""
    return {CACHE_NAME: cache}


def output_cache(output):
    """The cache a transformers model output holds (None if none), read under the installed name (reading the
    deprecated one warns on transformers 5.24)."""
    return getattr(output, CACHE_NAME, None)


def static_cache_max_length(cache):
    """The number of key slots of a static (compileable) cache: transformers 5 names the method `get_max_length`,
    4.x `get_max_cache_shape`."""
    max_length = getattr(cache, "get_max_length", None) or cache.get_max_cache_shape
    return max_length()


# -- the tested range --------------------------------------------------------------------------------------------------

def release(version):
    """(major, minor, patch, is_final) of a version string: "5.24.0" -> (5, 24, 0, True), "5.25.0.dev0" ->
    (5, 25, 0, False)."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?(.*)$", version)
    if match is None:
        return (0, 0, 0, False)
    major, minor, patch, rest = match.groups()
    final = rest == "" or bool(re.fullmatch(r"\.post\d+", rest))
    return int(major), int(minor or 0), int(patch or 0), final


def is_tested(version, tested=TESTED_TRANSFORMERS):
    """Whether `version` is one of `tested` or a later final patch release of one of their series."""
    major, minor, patch, final = release(version)
    return final and any((major, minor) == release(known)[:2] and patch >= release(known)[2] for known in tested)


def untested_message(version, tested=TESTED_TRANSFORMERS):
    newest = release(tested[-1])
    return (f"FAT5's code was tested with transformers {', '.join(tested)} (and their later patch releases), not with "
            f"the installed {version}: check its outputs, or install a tested release "
            f"(pip install 'transformers>={newest[0]}.{newest[1]},<{newest[0]}.{newest[1] + 1}')")


_warned_untested = []


def warn_if_untested(version=None):
    """Under a transformers release FAT5 was not tested with, log one warning line naming both, once a process."""
    version = transformers.__version__ if version is None else version
    if not is_tested(version) and not _warned_untested:
        _warned_untested.append(version)
        logger.warning(untested_message(version))
