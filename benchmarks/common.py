"""Plumbing shared by the benchmark scripts: timing, peak memory, the run header, raw rows, RESULTS.md, and the
transformers T5 / FAT5 pair with the same weights that train_step.py and generate.py compare."""

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's fat5 and convert, not an installed copy

import transformers  # noqa: E402

from fat5.training.flags import HelpFormatter  # noqa: E402  (FAT5's commands' --help layout)

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
STARTED = time.perf_counter()  # when the script imported this module: rows' at_s counts from here
# Where results go by default: a folder of the current directory (git-ignored in a checkout), never the checkout's
# tracked files; `--out benchmarks/results` keeps them with the repository on purpose.
OUT_DIR = Path("bench-results")
BENCH_EXTRA = 'pip install -e ".[bench]"'
# FAT5's T5 family: transformers' T5 v1.1-base shape (random weights; the vocabulary is T5's).
V11_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12,
                feed_forward_proj="gated-gelu")
# The `--smoke` shape: every code path, a few seconds on CPU.
SMOKE_SHAPE = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                   feed_forward_proj="gated-gelu")
# transformers' name for each T5 attention implementation we compare against.
T5_ATTENTION = {"t5_eager": "eager", "t5_sdpa": "sdpa", "t5_flex": "flex_attention"}


# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) of the chips a run may land on, by a fragment of
# torch.cuda.get_device_name(); the first match wins (longer names first). MFU is null on any other device.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("B200", 2250),
                    ("A100", 312), ("L40S", 362), ("L4", 121), ("A10", 125))


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def bf16_peak_tflops():
    """The dense bf16 peak of this device (BF16_PEAK_TFLOPS), or None."""
    name = device_name() if torch.cuda.is_available() else ""
    return next((peak for fragment, peak in BF16_PEAK_TFLOPS if fragment in name), None)


def step_flops(shape, batch, encoder_length, decoder_length):
    """Model FLOPs of one training step of a T5 of `shape` (a config dict) on `batch` examples of `encoder_length`
    input and `decoder_length` target tokens, counted from the config as docs/benchmarks.md states: every matmul's
    2 * m * n * k (projections, feed-forward, cross-attention keys and values on the encoder tokens, LM head) three
    times (forward, and twice that in the backward), attention's QK^T and PV (4 * keys * heads * d_kv a query
    token, causal rows counted whole) three and a half times (FlashAttention's convention)."""
    d, d_ff, vocab = shape["d_model"], shape["d_ff"], shape["vocab_size"]
    inner = shape["num_heads"] * shape["d_kv"]
    encoder_layers, decoder_layers = shape["num_layers"], shape.get("num_decoder_layers") or shape["num_layers"]
    ffn = 2 * ((2 if shape.get("feed_forward_proj", "relu").startswith("gated-") else 1) + 1) * d * d_ff
    encoder_token = encoder_layers * (2 * 4 * d * inner + ffn) + decoder_layers * 2 * 2 * d * inner  # + cross K, V
    decoder_token = decoder_layers * (2 * 6 * d * inner + ffn) + 2 * d * vocab
    linear = batch * (encoder_length * encoder_token + decoder_length * decoder_token)
    attention = batch * 4 * inner * (encoder_length * encoder_layers * encoder_length
                                     + decoder_length * decoder_layers * (decoder_length + encoder_length))
    return 3 * linear + 3.5 * attention


def mfu(flops, ms):
    """Model FLOPs utilisation of `flops` done in `ms` on this device, or None where its peak is unknown."""
    peak = bf16_peak_tflops()
    return None if peak is None or not ms else round(flops / (ms * 1e-3) / (peak * 1e12), 4)


class OpCounter(TorchDispatchMode):
    """The number of torch ops dispatched while active (views included; a custom op counts one)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def device_name():
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def versions():
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__}


def today():
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def header():
    return " | ".join([device_name()] + [f"{name} {version}" for name, version in versions().items()] + [today()])


def slug(text):
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _call_ms(fn):
    """Milliseconds of one call of `fn`, the device idle before and after it."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return (time.perf_counter() - start) * 1e3


def time_ms(fn, reps, warmup, seconds=0.0):
    """The latency of `fn()`: the median milliseconds of up to `reps` calls each alone (the device idle before and
    after, so the host's launch work and the device's come one after the other: what a generation step sees), after
    `warmup` calls. With `seconds`, counted from the end of the first call (which compiles), warm-up stops after half
    of it and timing after all of it, one timed call at least: a slow peer gets fewer repetitions."""
    if warmup:
        fn()
    began = time.perf_counter()

    def over(share):
        return seconds and time.perf_counter() - began > seconds * share

    for _ in range(warmup - 1):
        if over(0.5):
            break
        fn()
    times = [_call_ms(fn)]
    while len(times) < reps and not over(1.0):
        times.append(_call_ms(fn))
    return statistics.median(times)


def time_calls(fn, reps, warmup, seconds=0.0):
    """Two timings of `fn()`, in milliseconds: `latency_ms` (time_ms, in the first half of `seconds`) and `ms`, the
    throughput of calls back to back (what a training step sees, its host running ahead), in the other half and
    about `reps` calls' time at most: triton.testing.do_bench's median on CUDA (each call between CUDA events, so the
    larger of the GPU's and the host's time a call), torch.utils.benchmark's mean on CPU (synchronous: the latency
    again). A call slower than its half of `seconds` is not repeated: its throughput is its latency. (`host_ms`,
    the host's share, is no longer measured: None.)"""
    latency = time_ms(fn, reps, warmup, seconds / 2)
    budget = min(seconds * 1e3 / 2 if seconds else math.inf, reps * latency)
    if latency >= budget:
        return dict(ms=latency, latency_ms=latency, host_ms=None)
    if torch.cuda.is_available():
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=latency, rep=budget, return_mode="median")
    else:
        ms = benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=budget / 1e3).mean * 1e3
    return dict(ms=ms, latency_ms=latency, host_ms=None)


def _resident_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _trim_heap():
    """Give glibc's free heap pages back to the OS (no-op elsewhere), so resident memory is live memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


@contextmanager
def peak_memory():
    """Yields a dict whose "mib" is, on exit, the peak memory above the level at entry: CUDA's allocator peak on
    GPU; on CPU the process's resident high-water mark (Linux resets it through /proc/self/clear_refs), None
    where that is unavailable. Memory the allocator caches without using is not counted on GPU; on CPU the
    baseline is taken after glibc returns its free heap, and blocks it keeps during the step are counted, so CPU
    figures are upper bounds."""
    result = {"mib": None}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result["mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        return
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # reset VmHWM to the current resident size
        base = _resident_kib("VmRSS")
    except OSError:
        yield result
        return
    yield result
    result["mib"] = round((_resident_kib("VmHWM") - base) / 1024, 1)


def error_status(error):
    """The status a row records for an exception: "oom", or "error: <first line>"."""
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return "oom"
    return "error: " + (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def release_memory():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratio(ours, theirs):
    """ours / theirs as "2.50x", or "-" when either is missing."""
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


class Rows(list):
    """A benchmark's rows, each written to <out_dir>/<benchmark>_<device>_<date>.jsonl the moment it is appended
    (JSON lines; the first holds benchmark, device, versions, date, command and settings), so a run killed midway
    keeps every row it measured (gpu_suite.py reads them back, a line cut short by a kill left out). Each row gets
    at_s: seconds from the script importing this module to the row (what the GPU plan's estimates are set from)."""

    def __init__(self, benchmark, settings, out_dir):
        super().__init__()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"{benchmark}_{slug(device_name())}_{today()}.jsonl"
        header = {"benchmark": benchmark, "device": device_name(), "date": today(), **versions(),
                  "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "settings": settings}
        self.path.write_text(json.dumps(header, default=str) + "\n")
        print(f"rows: {self.path}", flush=True)

    def append(self, row):
        row.setdefault("at_s", round(time.perf_counter() - STARTED, 1))
        super().append(row)
        with open(self.path, "a") as file:
            file.write(json.dumps(row, default=str) + "\n")

    def extend(self, rows):
        for row in rows:
            self.append(row)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({BENCH_EXTRA})")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def append_results(table):
    with open(RESULTS, "a") as results:
        results.write("\n" + table)
    print(f"appended to {RESULTS}")


def markdown_head(title, description, columns):
    """First lines of a results table: heading with device and date; versions, the command that ran and
    `description`; the column header."""
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}"] + sys.argv[1:])
    return [f"### {title}, {device_name()}, {today()}",
            "",
            ", ".join(f"{name} {version}" for name, version in versions().items()) + f"; `{command}`; " + description,
            "",
            "| " + " | ".join(columns) + " |",
            "|" + " --- |" * len(columns)]


def argument_parser(docstring, timing=None, model=None, allow_cpu=False, output=False, report=False):
    """The argument helper of the benchmark scripts: a parser with the docstring as its description and every default
    shown, and the flags the scripts share, as asked: --reps, --warmup and --max-seconds (`timing`: their defaults),
    --shape and --dtype (`model`: True, or --dtype's help), --allow-cpu, --out and --smoke (`output`), --no-plot and
    --update-results (`report`)."""
    parser = argparse.ArgumentParser(description=docstring, formatter_class=HelpFormatter)
    if timing:
        add_timing_arguments(parser, *timing)
    if model:
        add_model_arguments(parser, None if model is True else model)
    if allow_cpu:
        add_allow_cpu_argument(parser)
    if output or report:
        add_output_arguments(parser, report)
    return parser


def add_timing_arguments(parser, reps, warmup, seconds):
    """--reps, --warmup and --max-seconds of the timing scripts, with their defaults."""
    parser.add_argument("--reps", type=positive_int, default=reps, help="timed calls (the median is kept)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed calls before timing")
    parser.add_argument("--max-seconds", type=float, default=seconds,
                        help="seconds one measurement may take after its first call: warm-up stops at half, timing "
                             "at all of it, after one call of each (a slow peer gets fewer repetitions; 0: no limit)")


def add_output_arguments(parser, report=True):
    """--out and --smoke, and with `report` --no-plot and --update-results."""
    parser.add_argument("--out", type=Path, default=OUT_DIR, metavar="DIR",
                        help=f"folder for the raw rows (JSON lines, written as they are measured) and the plot (PNG) "
                             f"(default: ./{OUT_DIR}/ in the current folder)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU (the Triton interpreter): checks the script itself, times nothing "
                             "worth reading")
    if report:
        parser.add_argument("--no-plot", action="store_true",
                            help=f"draw no plot (plots need matplotlib: {BENCH_EXTRA})")
        parser.add_argument("--update-results", action="store_true",
                            help="also append the markdown table to benchmarks/RESULTS.md of this checkout")


def require_gpu(args, instead="run --smoke"):
    """A script whose default sizes are a GPU's stops, without CUDA, with one line saying what to run instead and
    exit status 2 (bad input, as the project's commands). `--smoke`, and `--allow-cpu` where the script has it,
    run anyway."""
    if args.smoke or getattr(args, "allow_cpu", False) or torch.cuda.is_available():
        return
    print(f"{Path(sys.argv[0]).name}: needs a CUDA GPU; on CPU {instead}", file=sys.stderr)
    sys.exit(2)


def add_allow_cpu_argument(parser):
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without a GPU at the sizes given (the defaults are a GPU's: pass smaller ones; "
                             "benchmarks/RESULTS.md has the CPU commands)")


def report(rows, table, args, plot=None):
    """Print the table of `rows` (a `Rows`, already on disk), draw `plot(rows, args, png_path)`, append the table
    to RESULTS.md when asked."""
    print("\n" + table, flush=True)
    if plot is not None and not args.no_plot:
        plot(rows, args, rows.path.with_suffix(".png"))
    if args.update_results:
        append_results(table)


def save_figure(figure, title, path):
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---- transformers' T5 and FAT5 with the same weights -------------------------------------------------------


def t5_reference(shape, seed=0):
    """transformers' T5ForConditionalGeneration (eager) with random weights and an untied LM head (v1.1), no
    dropout, fp32 on CPU: the weights every compared model copies."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(**shape, tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    # transformers 5 ties the head to the embedding whatever the flag says; v1.1 has its own head.
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * shape["d_model"] ** -0.5)
    return model.eval()


def build_model(name, reference):
    """A fresh fp32 CPU copy of `reference`'s weights as model `name`: "fat5" (through the converter's config
    and mapping, which is the identity on names) or one of T5_ATTENTION."""
    if name == "fat5":
        from fat5.convert.checkpoint import EMBEDDING_COPIES, UNUSED_SOURCE_TENSORS, fat5_config_from_t5
        from fat5.modeling_fat5 import FAT5ForConditionalGeneration

        config = fat5_config_from_t5(reference.config.to_dict(), lm_head_tied=False)
        with torch.device("meta"):
            model = FAT5ForConditionalGeneration(config)
        state = {key: tensor.clone() for key, tensor in reference.state_dict().items()
                 if key not in EMBEDDING_COPIES + UNUSED_SOURCE_TENSORS}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()
    from transformers import T5ForConditionalGeneration

    with torch.device("meta"):
        model = T5ForConditionalGeneration._from_config(reference.config, attn_implementation=T5_ATTENTION[name])
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))  # untied, as the reference
    model.load_state_dict({key: tensor.clone() for key, tensor in reference.state_dict().items()},
                          strict=True, assign=True)
    model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared
    return model.eval()


def add_model_arguments(parser, dtype_help=None):
    """--shape and --dtype of the whole-model scripts (train_step.py, generate.py)."""
    parser.add_argument("--shape", default="", help="T5 config overrides of the v1.1-base shape, e.g. "
                        "d_model=256,num_layers=4,num_heads=4,d_ff=1024")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        default="bfloat16" if torch.cuda.is_available() else "float32",
                        help=dtype_help or "dtype of the weights (default: bfloat16 on CUDA, float32 on CPU)")


def autocast(dtype):
    """torch.autocast to `dtype` (a name) on this device; nothing for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device(), dtype=getattr(torch, dtype))


def reference_and_check(shape, dtype):
    """Print the run header; return the reference T5 (on CPU), a check batch and the eager T5's logits of it (on
    the device): fp32, and under autocast to `dtype`, which `checked_model` compares each model with."""
    print(header(), flush=True)
    reference = t5_reference(shape)
    batch = check_batch(shape["vocab_size"], device())
    model = reference.to(device())
    expected = logits(model, batch), logits(model, batch, dtype)
    reference.cpu()
    return reference, batch, expected


def check_batch(vocab_size, device_, length=64, batch=2):
    generator = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(2, vocab_size, (batch, length), generator=generator).to(device_),
                labels=torch.randint(2, vocab_size, (batch, min(length, 16)), generator=generator).to(device_))


def logits(model, batch, dtype="float32"):
    with torch.no_grad(), autocast(dtype):
        return model(**batch).logits.float()


def relative_difference(actual, expected):
    """max |actual - expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


LOGIT_TOLERANCE = 1e-4  # fp32 logits, relative to their largest magnitude


def checked_model(name, reference, batch, expected, dtype):
    """(model on the device, status) for model `name` built from `reference`: its logits on `batch` under
    autocast to `dtype` (no fp32 kernel compiles on GPU) are compared with the eager T5's fp32 logits and must
    be within twice the eager T5's own error in `dtype` plus LOGIT_TOLERANCE (fp32: within LOGIT_TOLERANCE).
    status is "ok", "mismatch: ..." (the model is still returned: its rows are timed and say so), or the error
    of a peer that cannot run here (model None)."""
    exact, theirs = expected
    try:
        model = build_model(name, reference).to(device())
        ours = logits(model, batch, dtype)
    except Exception as error:  # a peer that cannot run here: its rows say why
        status = error_status(error)
        print(f"{name}: {status}", flush=True)
        return None, status
    difference, allowed = relative_difference(ours, exact), 2 * relative_difference(theirs, exact) + LOGIT_TOLERANCE
    print(f"{name}: max|logits - T5 eager fp32 logits| / max|logits| = {difference:.2g} (allowed {allowed:.2g})",
          flush=True)
    if difference > allowed:
        return model, f"mismatch: relative logit difference {difference:.2g} > {allowed:.2g}"
    return model, "ok"


def positive_int(text):
    """argparse type: an integer >= 1 (argparse turns the error into one line and exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def positive_ints(text):
    """argparse type: comma-separated integers >= 1, e.g. "512,1024"."""
    return [positive_int(item) for item in text.split(",")]


def parse_shape(text, base):
    """`base` (a T5 config shape) with "key=value,..." overrides; one error line and a non-zero exit if bad."""
    shape = dict(base)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in shape:
            sys.exit(f"error: --shape key {key!r} is not one of {sorted(shape)}")
        if key == "feed_forward_proj":
            shape[key] = value
            continue
        try:
            shape[key] = positive_int(value)
        except argparse.ArgumentTypeError as error:
            sys.exit(f"error: --shape {key}: {error}")
    return shape
