"""The user's JSON and text files, read under the command-line convention (fat5/cli.py): a file that is missing,
a folder, unreadable, not UTF-8 or not JSON is one `CommandError` naming the file, and the line where it can.

transformers, tokenizers and the Trainer read the JSON files of a model folder themselves, and a bad one reaches the
user as their traceback (a `UnicodeDecodeError` from the tokenizer, an `AttributeError` for a list where an object
belongs, safetensors' error for truncated weights), or is silently skipped (a bad generation_config.json):
`check_model_folder` reads those files first.
Refused pickles are said here too, once, in words that never suggest loading them unsafely.

Only the standard library is imported with this module (see fat5/cli.py); the checks of weight files import
safetensors and torch when they run.
"""

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

from fat5.cli import CommandError, error_line

# The JSON files of a model folder that transformers (4.57 and 5.x), tokenizers or PEFT parse when they load it.
MODEL_FOLDER_JSON = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                     "added_tokens.json", "tokenizer.json", "model.safetensors.index.json",
                     "pytorch_model.bin.index.json", "adapter_config.json")
# ... and those the Trainer parses when it resumes from a checkpoint folder.
CHECKPOINT_JSON = ("trainer_state.json",)
# torch.load(weights_only=True) refusing a pickle that names something other than tensors and plain containers.
WEIGHTS_ONLY_REFUSAL = "Weights only load failed"
PICKLED_GLOBAL = re.compile(r"GLOBAL (\S+)")
SAFETENSORS_ADVICE = ("to convert it safely, load it once in an environment you trust and save its state dict with "
                      "safetensors (safetensors.torch.save_file), or use the Hub's safetensors conversion "
                      "(https://huggingface.co/spaces/safetensors/convert)")


def read_bytes(path, what=""):
    """The bytes of the file at `path`. `what` names the file's role in messages ("the model config ")."""
    with open_binary(path, what) as file:
        return file.read()


def open_binary(path, what=""):
    """The file at `path` opened for reading bytes (to read as a stream), or one line saying why it cannot be."""
    path = Path(path)
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise CommandError(f"cannot read {what}{path}: no such file") from None
    except IsADirectoryError:
        raise CommandError(f"cannot read {what}{path}: it is a folder, not a file") from None
    except OSError as error:  # permissions, a lost mount
        raise CommandError(f"cannot read {what}{path}: {error.strerror or error}") from None


def decode_utf8(path, raw, what=""):
    """`raw` as UTF-8 text; a byte that is not UTF-8 is an error naming its line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - raw.rfind(b"\n", 0, error.start)
        raise CommandError(f"cannot read {what}{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x} at "
                           f"column {column}); save it as UTF-8") from None


def read_text(path, what=""):
    """The UTF-8 text of the file at `path`."""
    return decode_utf8(path, read_bytes(path, what), what)


def read_json(path, what=""):
    """The JSON value in the file at `path`; JSON that does not parse is an error naming its line and column."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as error:
        raise CommandError(f"cannot read {what}{path}:{error.lineno}:{error.colno}: not JSON ({error.msg})") \
            from None


def read_json_object(path, what=""):
    """The JSON object (a dict) in the file at `path`."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise CommandError(f"{what}{path} is not a JSON object")
    return value


def printable(text):
    """A path (or other text from the OS) as UTF-8 text: bytes that are not UTF-8, which Python holds as
    surrogates, written as \\xNN."""
    return os.fsencode(str(text)).decode("utf-8", "backslashreplace")


def safetensors_path(path):
    """`path` as safetensors opens it: a str, which safetensors requires to be UTF-8 (one line otherwise)."""
    if printable(path) != str(path):
        raise CommandError(f"cannot read {printable(path)}: safetensors opens only paths that are UTF-8; rename it")
    return str(path)


def check_model_folder(folder, also=()):
    """Read every JSON file of a local model folder that its loaders parse (MODEL_FOLDER_JSON, and `also`), the
    header of every safetensors file, the structure of every pytorch_model*.bin and the tokenizer's sentencepiece
    model, so a bad one is one line naming it before anything loads. A name that is not a local folder (a Hub id)
    is left to the loader."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for name in (*MODEL_FOLDER_JSON, *also):
        if (folder / name).exists() or (folder / name).is_symlink():
            read_json_object(folder / name)
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights)
    for weights in sorted(folder.glob("pytorch_model*.bin")):
        check_pickled_weights(weights)
    for model in SENTENCEPIECE_MODELS:
        if (folder / model).exists():
            check_sentencepiece(folder / model)
    check_fat5_config(folder)


# What a FAT5 config.json names in `architectures`: the classes whose weights a folder may hold.
FAT5_ARCHITECTURES = ("FAT5Model", "FAT5ForConditionalGeneration", "FAT5EncoderModel", "FAT5ForSequenceClassification",
                      "FAT5ForTokenClassification", "FAT5ForQuestionAnswering")


def check_fat5_config(folder):
    """For a FAT5 folder (config.json model_type "fat5"): its config is one FAT5Config takes (a known attention
    backend, position encoding, ...), and it describes the weights beside it (`check_config_describes_weights`), so
    an edited or mismatched config.json is one line before anything loads, not a traceback from deep in loading (or
    a model that loads and computes wrongly: a T5 folder's bias tables under `position_encoding_type: "rope"`)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return
    fields = read_json_object(folder / "config.json")
    if fields.get("model_type") != "fat5":
        return
    from fat5 import FAT5Config

    try:
        config = FAT5Config.from_dict(fields)
    except (TypeError, ValueError) as error:
        raise CommandError(f"{folder / 'config.json'}: {error_line(error)}") from None
    check_config_describes_weights(folder, config)


def weight_shapes(folder):
    """{tensor name: shape} of the model weights of a folder (model.safetensors, the shards its index names, or
    pytorch_model*.bin), read from the headers (a .bin memory-mapped); None when it holds none (an adapter)."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted({folder / name for name in read_json_object(index).get("weight_map", {}).values()}) \
        if index.is_file() else [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
    shapes = {}
    for path in files:
        with safe_open(safetensors_path(path), framework="numpy") as weights:
            shapes.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})
    if not files:
        for path in sorted(folder.glob("pytorch_model*.bin")):
            try:  # (check_pickled_weights refused what is not tensors)
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception:  # torch's legacy format, which cannot be memory-mapped: left to the loader
                return None
            shapes.update({name: tuple(tensor.shape) for name, tensor in state.items()})
    return shapes or None


def check_config_describes_weights(folder, config):
    """Refuse, in one line, a FAT5 folder whose config.json contradicts its weights: a tensor the class of
    `architectures` would give another shape (d_model edited), one it has no place for (a T5 bias table under
    another `position_encoding_type`), or one it needs that is missing (more layers than the weights hold), where
    transformers would stop with a traceback or initialise what is missing at random. Compared on the meta device
    (nothing allocated), the names the class ties to one tensor counting once, and the keys the class itself
    ignores on loading left out."""
    import re

    import torch

    import fat5

    architecture = (config.architectures or ["FAT5ForConditionalGeneration"])[0]
    shapes = weight_shapes(folder) if architecture in FAT5_ARCHITECTURES else None
    if shapes is None:
        return
    model_class = getattr(fat5, architecture)
    with torch.device("meta"):
        model = model_class(config)
    expected = model.state_dict(keep_vars=True)
    ignored = [re.compile(pattern) for pattern in (*(model_class._keys_to_ignore_on_load_unexpected or ()),
                                                   *(model_class._keys_to_ignore_on_load_missing or ()))]
    described = ", ".join(f"{name} {getattr(config, name)!r}" for name in ("d_model", "num_layers", "num_heads",
                                                                          "position_encoding_type"))
    where = f"{folder / 'config.json'} ({described}) does not describe the weights beside it"
    for name, tensor in expected.items():
        shape = shapes.get(name, tuple(tensor.shape))
        if tuple(tensor.shape) != shape:
            raise CommandError(f"{where}: tensor {name} is {list(shape)} there, the config makes it "
                               f"{list(tensor.shape)}; use the config.json the weights were saved with")
    unexpected = [name for name in shapes if name not in expected and not any(p.search(name) for p in ignored)]
    if unexpected:
        raise CommandError(f"{where}: the weights hold {len(unexpected)} tensor(s) a {architecture} of this config "
                           f"has no place for, first {unexpected[0]}; use the config.json the weights were saved with")
    tied = {}
    for name, tensor in expected.items():
        tied.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in tied.values() if not any(name in shapes for name in names)
               and not any(p.search(names[0]) for p in ignored)]
    if missing:
        raise CommandError(f"{where}: the weights lack {len(missing)} tensor(s) a {architecture} of this config needs, "
                           f"first {missing[0]}; use the config.json the weights were saved with")


def check_attention_device(fields, device_type, what):
    """Refuse, in one line, a FAT5 config (`fields`, a config.json dict; `what` names where it comes from) that
    forces attention_backend "triton" where the command runs on `device_type` other than CUDA: FAT5's Triton kernel
    needs CUDA tensors, and the first forward would fail deep in the model."""
    if fields.get("model_type", "fat5") == "fat5" and fields.get("attention_backend") == "triton" \
            and device_type != "cuda":
        raise CommandError(f"{what}: its config sets attention_backend 'triton', FAT5's Triton kernel, which needs "
                           f"CUDA, and this command runs on {device_type}: set attention_backend to 'auto' (the kernel "
                           f"on CUDA, SDPA elsewhere) or 'sdpa' in its config.json")


# TrainingArguments' flags that may name a JSON file, which it reads itself (they also take a dict, or DeepSpeed's
# base64 string): its errors for a bad file name neither the file nor the flag.
TRAINER_JSON_FLAGS = ("deepspeed", "fsdp_config", "accelerator_config")


def check_trainer_json_files(flags):
    """Read first, with one line per bad file, the JSON files that TrainingArguments' flags name: `flags` is a
    command line (a list of strings) or a flags file's dict."""
    if isinstance(flags, dict):
        named = [(name, flags.get(name)) for name in TRAINER_JSON_FLAGS]
    else:
        named = []
        for index, arg in enumerate(flags):
            flag, equals, value = arg.partition("=")
            name = flag[2:].replace("-", "_") if flag.startswith("--") else None
            if name in TRAINER_JSON_FLAGS:
                named.append((name, value if equals else (flags[index + 1] if index + 1 < len(flags) else None)))
    for name, value in named:
        if isinstance(value, str) and not value.lstrip().startswith("{") \
                and (value.endswith(".json") or Path(value).exists()):
            read_json_object(value, f"the --{name} file ")


# The classes (config.json `architectures`: what a folder's weights are) each exporter takes, and the tasks it
# exports them for (None: its only one). optimum's T5 ONNX config exports a seq2seq LM for every T5 task and the bare
# encoder-decoder for feature extraction; CTranslate2's T5 loader converts a seq2seq LM. It has neither the
# classification or question-answering heads (their folders hold an encoder and a head) nor an encoder alone.
EXPORTABLE = {
    "onnx": {"FAT5ForConditionalGeneration": None,
             "FAT5Model": ("feature-extraction", "feature-extraction-with-past")},
    "ctranslate2": {"FAT5ForConditionalGeneration": None},
}


def exportable_fat5_config(folder, exporter, task=None):
    """The FAT5Config of the model folder `folder`, which `exporter` ("onnx", "ctranslate2") takes through T5's
    description of it (fat5/integrations_fat5.py) for `task`; one line for a folder that is not a FAT5 model, one
    whose class (its head) or computation the exporter's T5 does not have, or one with non-finite weights."""
    from fat5 import FAT5Config
    from fat5.integrations_fat5 import EXPORTERS, t5_computation_problem

    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise CommandError(f"{folder} has no config.json: not a model folder")
    # The exporters read the tokenizer and generation files too: a bad one is one line here, not their traceback.
    check_model_folder(folder)
    fields = read_json_object(folder / "config.json")
    if fields.get("model_type") != "fat5":
        raise CommandError(f"{folder} is a {fields.get('model_type')!r} model, not a FAT5 one")
    try:
        config = FAT5Config.from_dict(fields)
    except ValueError as error:
        raise CommandError(f"{folder / 'config.json'}: {error_line(error)}") from None
    problem = t5_computation_problem(config, exporter)
    if problem is not None:
        raise CommandError(problem)
    taken, target = EXPORTABLE[exporter], EXPORTERS[exporter][1]
    architecture = (config.architectures or ["model of no class"])[0]
    tasks = taken.get(architecture, ())
    if tasks == () or (task is not None and tasks is not None and task not in tasks):
        accepted = " or ".join(f"a {name}" + (f" with --task {' or '.join(only)}" if only else "")
                               for name, only in taken.items())
        raise CommandError(f"{folder} holds a {architecture} (config.json architectures): the {target} export takes "
                           f"{accepted}")
    check_finite_weights(folder, f"the {target} export")
    return config


def check_finite_weights(folder, what):
    """Read the folder's weights one tensor at a time: one holding NaN or infinite values is one line naming it
    (`what` would otherwise make a model that computes NaN, and its checks would blame themselves)."""
    import torch
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(safetensors_path(path), framework="pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise CommandError(f"tensor {name} of {path} holds NaN or infinite values: {what} refuses a "
                                       "model with non-finite weights")
    for path in sorted(Path(folder).glob("pytorch_model*.bin")):
        for name, tensor in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise CommandError(f"tensor {name} of {path} holds NaN or infinite values: {what} refuses a "
                                   "model with non-finite weights")


# The files AutoTokenizer needs in a folder to know which tokenizer it holds (a sentencepiece model alone names no
# class for a FAT5 config).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def holds_tokenizer(folder):
    """Whether `folder` holds a tokenizer AutoTokenizer can load whatever its config (TOKENIZER_FILES)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer_folder(folder, what, advice="copy the tokenizer files of the model it comes from into it"):
    """Refuse, in one line, a local folder without a tokenizer: AutoTokenizer's own error for it is a multi-line
    ValueError that asks to install sentencepiece, which is installed. `what` names the flag ("--model")."""
    folder = Path(folder)
    if folder.is_dir() and not holds_tokenizer(folder):
        raise CommandError(f"{what} {folder} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}): {advice}")


# The sentencepiece models of T5-family tokenizers (T5 and ByT5's spiece.model; mT5 and umT5 ship one too).
SENTENCEPIECE_MODELS = ("spiece.model", "sentencepiece.bpe.model")


def check_sentencepiece(path):
    """Load a tokenizer's sentencepiece model, as the slow tokenizer and the conversion to a fast one do: a corrupt
    one is one line naming it (transformers 4.57 lets sentencepiece's error through with its traceback)."""
    import sentencepiece  # a FAT5 dependency

    if Path(path).is_dir():
        raise CommandError(f"cannot read {path}: it is a folder, not a file")
    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as error:  # sentencepiece raises these for a file it cannot parse
        raise CommandError(f"cannot read {path}: not a sentencepiece model ({error_line(error)})") from None


def check_safetensors(path):
    """Open a safetensors file's header, which safetensors checks against the file's length: a truncated or
    corrupt file is one line naming it (transformers lets safetensors' error through with its traceback)."""
    from safetensors import SafetensorError, safe_open  # a dependency of transformers

    if Path(path).is_dir():
        raise CommandError(f"cannot read {path}: it is a folder, not a file")
    path = safetensors_path(path)
    try:
        with safe_open(path, framework="numpy"):
            pass
    except SafetensorError as error:
        raise CommandError(f"cannot read {path}: corrupt or truncated weights ({error_line(error)})") from None
    except OSError as error:  # permissions, a lost mount
        raise CommandError(f"cannot read {path}: {error.strerror or error_line(error)}") from None


def check_pickled_weights(path):
    """Load a pytorch_model.bin as transformers does (torch.load(weights_only=True)), memory-mapped so that no
    tensor data is read: a corrupt or truncated file, or a pickle that holds more than tensors, is one line naming
    it (transformers 5 lets torch's error through with its traceback)."""
    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises several unrelated types for bad files
        if refused_pickle(error) is not None:
            raise pickle_refusal(path, error) from None
        if "_use_new_zipfile_serialization" in str(error):
            return  # torch's legacy format cannot be memory-mapped: it is left to the loader
        raise CommandError(f"cannot read {path}: corrupt or truncated weights ({error_line(error)})") from None


def refused_pickle(error):
    """torch.load(weights_only=True)'s refusal of a pickle that holds more than tensors, when `error` is it, was
    raised while handling it (transformers 4.57 turns it into an OSError about the file) or quotes it (4.57's
    pipeline puts the traceback in its ValueError's message), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if WEIGHTS_ONLY_REFUSAL in str(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def pickle_refusal(what, error, advice=SAFETENSORS_ADVICE):
    """The one line that refuses `what` for the pickled objects torch found in it (torch's own message offers to
    load the file unsafely, which must never be the advice for a file from elsewhere)."""
    named = PICKLED_GLOBAL.search(str(error))
    example = f" (such as {named.group(1)})" if named else ""
    return CommandError(f"{what} holds pickled Python objects beyond tensors{example}, which can run code when "
                        f"loaded, so it is refused; {advice}")


@contextmanager
def pickles_refused(what, advice=SAFETENSORS_ADVICE):
    """Inside the block, torch.load(weights_only=True) refusing a pickle (loading `what`) is `pickle_refusal`'s
    line."""
    try:
        yield
    except Exception as error:
        refusal = refused_pickle(error)
        if refusal is None:
            raise
        raise pickle_refusal(what, refusal, advice) from None
