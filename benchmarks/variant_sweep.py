"""The kernel's variants (issue 46), timed against the default kernel in one process, so that the default changes on
a GPU measurement: T5 encoder attention (bidirectional bias from the bucket table, which requires grad), forward and
forward+backward, at the attention benchmark's shapes.

    python benchmarks/variant_sweep.py                   # H100/H200: bf16, 12 heads, d = 64, 32k tokens a batch
    python benchmarks/variant_sweep.py --configs band_tiles,fused_backward@0.1 --lengths 2048
    python benchmarks/variant_sweep.py --smoke           # CPU, Triton's interpreter: checks the script end to end

A configuration is a set of the kernel's variants joined by `+` (`VARIANT_NAMES` of fat5/kernels/flash_attention_t5.py:
band_tiles, tma, fused_backward; `default`: none) with an optional attention dropout probability (`@P`); each is
compared with the default kernel at the same dropout (the same seed: the same mask), which runs first. Every
configuration's kernels are first compiled in their own processes, --jobs at once, at a small size that Triton
specialises as the timed ones (their kernels land in Triton's cache); then each is timed here (common.time_calls:
ms is the throughput of calls back to back, TFLOP/s come from it; latency_ms one call alone). A row per
configuration, L and pass: its times, its output's and gradients' largest difference from the default kernel's
(relative to their magnitude; over 3e-2 in half precision it is a mismatch, not a speed), and its speed against the
default's (> 1: faster). A variant that does not apply on the chip runs the default kernel there (the kernel module
says where: chip_tiles), and its ratio is then about 1.
"""

import concurrent.futures
import multiprocessing
import os
import sys
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. on import

import common  # noqa: E402  (puts this checkout first on sys.path)

# The GPU window's configurations: band tiles and TMA's 128-wide key tiles alone and together, and the fused
# backward where it should pay, with dropout (its mask drawn once), alone and with the other two.
CONFIGS = ("default", "band_tiles", "tma", "band_tiles+tma", "default@0.1", "fused_backward@0.1",
           "band_tiles+tma+fused_backward@0.1")
PASSES = ("fwd", "fwd+bwd")
NUM_BUCKETS, MAX_DISTANCE = 32, 128


def kernels():
    import fat5.kernels.flash_attention_t5 as module

    return module


def parse_config(text):
    """(variant names, dropout p) of a configuration such as `band_tiles+tma@0.1`."""
    names, _, dropout = text.partition("@")
    names = "" if names == "default" else names.replace("+", ",")
    return kernels().kernel_variants(names), float(dropout or 0.0)


def inputs(batch, length, heads, head_dim, dtype):
    """q, k, v and the bias table (requiring grad), an output gradient and a dropout seed."""
    device = common.device()
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_()
               for _ in range(3))
    table = torch.randn(NUM_BUCKETS, heads, device=device, generator=generator).requires_grad_()
    grad = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    seed = torch.tensor([12345, 678], dtype=torch.int64, device=device)
    return q, k, v, table, grad, seed


def passes(tensors, dropout_p):
    """{pass: (function timed, its result to compare)} for the current variants."""
    from fat5.kernels.flash_attention_t5 import flash_attention_t5

    q, k, v, table, grad, seed = tensors

    def attention():
        return flash_attention_t5(q, k, v, bias_table=table, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE,
                                  dropout_p=dropout_p, dropout_seed=seed if dropout_p else None)

    def forward():
        with torch.no_grad():
            return attention()

    def forward_backward():
        out = attention()
        return (out.detach(), *torch.autograd.grad(out, (q, k, v, table), grad))

    return {"fwd": forward, "fwd+bwd": forward_backward}


def use(variants):
    kernels().VARIANTS = variants


def compile_config(config, shape, dtype):
    """In a worker: run `config` forward and backward once at a small size (compiling its kernels into Triton's
    cache); (status, seconds)."""
    import time

    try:
        variants, dropout_p = parse_config(config)
        use(variants)
        batch, length, heads, head_dim = shape
        functions = passes(inputs(batch, length, heads, head_dim, getattr(torch, dtype)), dropout_p)
        start = time.perf_counter()
        functions["fwd+bwd"]()
        common.synchronize()
        return "ok", round(time.perf_counter() - start, 2)
    except Exception as error:  # a configuration that does not compile is the finding
        return common.error_status(error), None


def difference(ours, reference):
    """Largest |ours - reference| over the largest |reference|, over every tensor compared."""
    ours, reference = (x if isinstance(x, tuple) else (x,) for x in (ours, reference))
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(ours, reference))


def measure(config, length, tensors, references, compiled, args, rows):
    """Append the rows (one a pass) of `config` at `length`, timed here; `references` holds the default kernel's
    results and rows at each dropout, filled by the default configurations (run first)."""
    variants, dropout_p = parse_config(config)
    batch, heads, _, head_dim = tensors[0].shape
    flops = 4 * batch * heads * length * length * head_dim
    for pass_name in PASSES:
        row = dict(config=config, variants=sorted(variants), dropout=dropout_p, L=length, batch=batch,
                   **{"pass": pass_name}, ms=None, latency_ms=None, host_ms=None, tflops=None, max_difference=None,
                   speed=None, compile_s=compiled[1], status=compiled[0])
        reference = references.get((dropout_p, pass_name))
        if row["status"] == "ok":
            try:
                use(variants)
                function = passes(tensors, dropout_p)[pass_name]
                result = function()
                if not variants:
                    references[(dropout_p, pass_name)] = reference = dict(result=result, row=row)
                elif reference is None:
                    raise RuntimeError("the default kernel gave no result to compare with")
                row["max_difference"] = difference(result, reference["result"])
                if row["max_difference"] > (3e-2 if tensors[0].dtype != torch.float32 else 1e-4):
                    row["status"] = f"mismatch: relative difference {row['max_difference']:.3g} from the default"
                timing = common.time_calls(function, args.reps, args.warmup, args.max_seconds)
                row.update(ms=timing["ms"], latency_ms=timing["latency_ms"], host_ms=timing["host_ms"],
                           tflops=flops * (3.5 if pass_name == "fwd+bwd" else 1) / timing["ms"] / 1e9)
                base = reference["row"]
                row["speed"] = base["ms"] / row["ms"] if base["ms"] and row["status"] == "ok" else None
            except Exception as error:
                row["status"] = common.error_status(error)
            finally:
                use(frozenset())
        rows.append(row)
        timed = f"{row['ms']:.3f} ms, {row['tflops']:.3g} TFLOP/s" if row["ms"] is not None else ""
        speed = f"{row['speed']:.2f}x the default" if row["speed"] is not None else ""
        print(f"  {config:36s} L={length:<6d} {pass_name:8s} {timed} {speed} {row['status']}", flush=True)


def markdown(rows, args):
    lines = common.markdown_head(
        "Kernel variants", f"T5 encoder, {args.heads} heads, d = {args.head_dim}, {args.tokens} tokens a batch, "
        f"{args.dtype}; each configuration against the default kernel at the same dropout (> 1: faster), throughput "
        "timing (TFLOP/s: forward+backward counts 3.5x the forward).",
        ["configuration", "L", "fwd ms / TFLOP/s", "fwd speed", "fwd+bwd ms / TFLOP/s", "fwd+bwd speed", "status"])
    for config in dict.fromkeys(row["config"] for row in rows):
        for length in dict.fromkeys(row["L"] for row in rows):
            found = {row["pass"]: row for row in rows if row["config"] == config and row["L"] == length}
            cells = []
            for pass_name in PASSES:
                row = found.get(pass_name)
                cells.append(f"{row['ms']:.3g} / {row['tflops']:.3g}" if row and row["ms"] else "-")
                cells.append(f"{row['speed']:.2f}x" if row and row["speed"] else "-")
            status = ", ".join(dict.fromkeys(row["status"].split(":")[0] for row in found.values()))
            lines.append(f"| {config} | {length} | " + " | ".join(cells) + f" | {status} |")
    return "\n".join(lines) + "\n"


def build_parser():
    parser = common.argument_parser(__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="configurations, comma-separated: variants joined by + (or default), @P for dropout P")
    parser.add_argument("--lengths", type=common.positive_ints, default="512,2048,8192",
                        help="sequence lengths L (queries = keys), comma-separated")
    parser.add_argument("--heads", type=common.positive_int, default=12, help="attention heads")
    parser.add_argument("--head-dim", type=common.positive_int, default=64, choices=[32, 64, 128],
                        help="head dimension D")
    parser.add_argument("--tokens", type=common.positive_int, default=32768, help="tokens a batch: batch = tokens // L")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of queries, keys and values")
    parser.add_argument("--jobs", type=common.positive_int, default=8,
                        help="configurations compiled at once, each in its own process (1: in this process)")
    common.add_timing_arguments(parser, reps=20, warmup=3, seconds=1.0)
    parser.add_argument("--out", type=Path, default=common.OUT_DIR, metavar="DIR",
                        help=f"folder for the rows (JSON lines, each written when measured) (default: "
                             f"./{common.OUT_DIR}/ in the current folder)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU (Triton's interpreter), every configuration, one job: checks the "
                             "script")
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    args.configs = [config.strip() for config in args.configs.split(",") if config.strip()]
    for config in args.configs:
        try:
            _, dropout_p = parse_config(config)
        except ValueError as error:
            parser.error(f"--configs {config!r}: {error}")
        if not 0.0 <= dropout_p < 1.0:
            parser.error(f"--configs {config!r}: dropout must be in [0, 1)")
    # The default kernel at each dropout first: every other configuration is compared with it.
    defaults = [f"default@{p:g}" if p else "default" for p in dict.fromkeys(parse_config(c)[1] for c in args.configs)]
    args.configs = list(dict.fromkeys(defaults + [c for c in args.configs if parse_config(c)[0]]))
    if args.smoke:
        args.lengths, args.heads, args.head_dim, args.tokens, args.dtype = [32], 2, 32, 64, "float32"
        args.jobs, args.reps, args.warmup = 1, 1, 0
    common.require_gpu(args, "run --smoke (it checks the script in Triton's interpreter)")
    return args


def main():
    args = parse_args()
    print(common.header(), flush=True)
    rows = common.Rows("variant_sweep", dict(configs=args.configs, lengths=args.lengths, heads=args.heads,
                                             head_dim=args.head_dim, tokens=args.tokens, dtype=args.dtype,
                                             reps=args.reps, warmup=args.warmup), args.out)
    # Specialised as the timed sizes: lengths and strides multiples of 16, q_offset 0.
    shape = (1, args.heads, 16 if args.smoke else 128, args.head_dim)
    if args.jobs == 1:
        compiled = {config: compile_config(config, shape, args.dtype) for config in args.configs}
    else:
        compiled = {}
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with concurrent.futures.ProcessPoolExecutor(min(args.jobs, len(args.configs)), mp_context=context) as pool:
            futures = {pool.submit(compile_config, config, shape, args.dtype): config for config in args.configs}
            for future in concurrent.futures.as_completed(futures):
                try:
                    compiled[futures[future]] = future.result()
                except Exception as error:  # the worker died: the configuration's rows say so
                    compiled[futures[future]] = common.error_status(error), None
                print(f"  compiled {futures[future]}: {compiled[futures[future]]}", flush=True)
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        print(f"L={length} batch={batch}", flush=True)
        tensors = inputs(batch, length, args.heads, args.head_dim, getattr(torch, args.dtype))
        references = {}
        for config in args.configs:
            measure(config, length, tensors, references, compiled[config], args, rows)
        del tensors, references
        common.release_memory()
    print("\n" + markdown(rows, args), flush=True)


if __name__ == "__main__":
    main()
