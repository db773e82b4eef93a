"""FAT5's kernel tiles, measured: the forward, dK/dV and dQ kernels of the T5 encoder variant under a handful of
(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates around the chip's tiles (fat5/kernels/flash_attention_t5.py,
`chip_tiles`), so that the tables there can be set from timings instead of static build readings.

    python benchmarks/tile_sweep.py                  # H100/H200: bf16, 12 heads, d = 64, L = 4096, 32k tokens
    python benchmarks/tile_sweep.py --kernels dq --jobs 4
    python benchmarks/tile_sweep.py --smoke          # CPU, Triton's interpreter: checks the script end to end

Every candidate is first compiled in its own process, --jobs at once (Triton compiles one kernel at a time per
process; the compiled kernels land in Triton's cache), then timed here one after the other: a row per candidate with
its tiles, whether it compiled, its output's (forward) or gradients' (dK/dV, dQ) largest difference from the chip's
own tiles', the pass's throughput and latency (common.time_calls: the forward alone; the backward alone, the other
backward kernel at the chip's tiles, so candidates of one kernel differ only in it) and, on a GPU, the kernel's own
time from torch.profiler. The chip's current tiles are the first candidate of each kernel. The benchmark passes a
candidate by replacing the kernel module's TILES table for every chip (fat5 itself is unchanged); in Triton's
interpreter (--smoke) tiles are fixed at 16 x 16, so the smoke run checks the plumbing, not the tiles.
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

KERNELS = ("forward", "dkdv", "dq")
# The kernel's name in profiler events.
KERNEL_NAMES = {"forward": "_forward_kernel", "dkdv": "_backward_dkdv_kernel", "dq": "_backward_dq_kernel"}
# Candidates at d = 64 on Hopper, the chip's own first (HOPPER in fat5/kernels/flash_attention_t5.py): bigger and
# smaller tiles, one warp group more or less, one pipeline stage more or less. dQ needs BLOCK_M a multiple of
# BLOCK_N.
CANDIDATES = {
    "forward": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 3),
                (128, 32, 8, 3), (64, 64, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2)],
    "dq": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)],
}
SMOKE_CANDIDATES = {"forward": [(16, 16, 1, 1), (32, 16, 1, 1)], "dkdv": [(16, 16, 1, 1), (16, 32, 1, 1)],
                    "dq": [(16, 16, 1, 1), (32, 16, 1, 1)]}
CAPABILITY = 90  # the chip whose tiles the smoke run checks the patch against (on a GPU: the GPU's)


def module():
    import fat5.kernels.flash_attention_t5 as kernels

    return kernels


def chip_tiles_now(kernel):
    """The tiles the kernel module gives `kernel` on this chip at d = 64 now (the public `chip_tiles`)."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        capability = major * 10 + minor
    else:
        capability = CAPABILITY
    return tuple(module().chip_tiles(capability, kernel, 64))


def use_tiles(kernel, tiles):
    """Make `kernel` run with `tiles` (None: the module's own) on every chip, at every head dim; returns the tiles
    it now gets. Replaces the module's TILES table (a copy; the original is kept for None)."""
    kernels = module()
    original = getattr(kernels, "_ORIGINAL_TILES", None) or kernels.TILES
    kernels._ORIGINAL_TILES = original
    if tiles is None:
        kernels.TILES = original
    else:
        kernels.TILES = {chip: {**table, kernel: (tuple(tiles),) * 3} for chip, table in original.items()}
    for name in ("chip_tiles", "_blocks"):  # in case a later version memoizes the lookup
        cached = getattr(kernels, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    return chip_tiles_now(kernel)


def inputs(smoke):
    """q, k, v, the bias table (requiring grad) and an output gradient: 32k tokens at L = 4096 (smoke: tiny)."""
    heads, length, batch, head_dim = (2, 48, 1, 32) if smoke else (12, 4096, 8, 64)
    dtype = torch.float32 if smoke else torch.bfloat16
    device = common.device()
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_() for _ in range(3))
    table = torch.randn(32, heads, device=device, generator=generator).requires_grad_()
    return q, k, v, table, torch.randn(shape, device=device, dtype=dtype, generator=generator)


def passes(kernel, tensors):
    """(function timed, its result to compare) for `kernel`: the forward alone, or the backward alone (one
    forward first)."""
    from fat5.kernels.flash_attention_t5 import flash_attention_t5

    q, k, v, table, grad = tensors
    if kernel == "forward":
        def forward():
            with torch.no_grad():
                return flash_attention_t5(q, k, v, bias_table=table)

        return forward, forward
    out = flash_attention_t5(q, k, v, bias_table=table)

    def backward():
        return torch.autograd.grad(out, (q, k, v, table), grad, retain_graph=True)

    return backward, backward


def compile_candidate(kernel, tiles, smoke):
    """In a worker: run `kernel` once with `tiles` (compiling it into Triton's cache); (status, seconds)."""
    import time

    try:
        given = use_tiles(kernel, tiles)
        if given != tuple(tiles):
            return f"error: the kernel module gives {given}, not the candidate", None
        function, _ = passes(kernel, inputs(smoke))
        common.synchronize()
        start = time.perf_counter()
        function()
        common.synchronize()
        return "ok", round(time.perf_counter() - start, 2)
    except Exception as error:  # a candidate that does not compile (shared memory, registers) is the finding
        return common.error_status(error), None
    finally:
        use_tiles(kernel, None)


def kernel_ms(function, kernel, calls=5):
    """The kernel's own mean milliseconds over `calls` calls of `function`, from torch.profiler (None on CPU or
    when the profiler sees no such kernel)."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            function()
        common.synchronize()
    spans = [event.time_range.elapsed_us() for event in profiler.events()
             if event.device_type == DeviceType.CUDA and KERNEL_NAMES[kernel] in event.name]
    return round(sum(spans) / len(spans) / 1e3, 4) if spans else None


def measure(kernel, tiles, compiled, args, tensors, reference, rows):
    """Append the row of one candidate, timed in this process with `tiles`."""
    block_m, block_n, warps, stages = tiles
    row = dict(kernel=kernel, block_m=block_m, block_n=block_n, warps=warps, stages=stages,
               current=tiles == args.current[kernel], compile_s=compiled[1], ms=None, latency_ms=None, host_ms=None,
               kernel_ms=None, max_difference=None, status=compiled[0])
    if row["status"] == "ok":
        try:
            use_tiles(kernel, tiles)
            function, result = passes(kernel, tensors)
            ours = result()
            ours = ours if isinstance(ours, tuple) else (ours,)
            row["max_difference"] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                        for a, b in zip(ours, reference[kernel]))
            if row["max_difference"] > (3e-2 if tensors[0].dtype != torch.float32 else 1e-4):
                row["status"] = f"mismatch: relative difference {row['max_difference']:.3g} from the chip's tiles"
            timing = common.time_calls(function, args.reps, args.warmup, args.max_seconds)
            row.update(ms=round(timing["ms"], 4), latency_ms=round(timing["latency_ms"], 4),
                       host_ms=timing["host_ms"] and round(timing["host_ms"], 4), kernel_ms=kernel_ms(function, kernel))
        except Exception as error:
            row["status"] = common.error_status(error)
        finally:
            use_tiles(kernel, None)
    rows.append(row)
    timed = f"{row['ms']:.3f} ms (kernel {row['kernel_ms']} ms)" if row["ms"] is not None else ""
    print(f"  {kernel:8s} {tiles} {'(current)' if row['current'] else '':9s} compile {row['compile_s']} s "
          f"{timed} {row['status']}", flush=True)


def markdown(rows):
    lines = common.markdown_head(
        "Kernel tiles", "T5 encoder, 12 heads, d = 64, L = 4096, 32k tokens, bf16. Per kernel: each candidate's pass "
        "time (the forward; the backward, the other backward kernel at the chip's tiles), throughput / latency ms, "
        "the kernel's own ms (profiler), and its ratio to the chip's current tiles (> 1: faster).",
        ["kernel", "BLOCK_M x BLOCK_N, warps, stages", "pass ms", "kernel ms", "speed vs current", "status"])
    for kernel in KERNELS:
        current = next((row for row in rows if row["kernel"] == kernel and row["current"] and row["ms"]), None)
        for row in (row for row in rows if row["kernel"] == kernel):
            tiles = f"{row['block_m']} x {row['block_n']}, {row['warps']}, {row['stages']}" + (
                " (current)" if row["current"] else "")
            times = f"{row['ms']:.3g} / {row['latency_ms']:.3g}" if row["ms"] else "-"
            own = row["kernel_ms"] or row["ms"]
            base = current and (current["kernel_ms"] or current["ms"])
            speed = f"{base / own:.2f}x" if own and base else "-"
            lines.append(f"| {kernel} | {tiles} | {times} | {row['kernel_ms'] or '-'} | {speed} | "
                         f"{row['status'].split(':')[0]} |")
    return "\n".join(lines) + "\n"


def build_parser():
    parser = common.argument_parser(__doc__)
    parser.add_argument("--kernels", default=",".join(KERNELS), help="kernels to sweep, comma-separated")
    parser.add_argument("--jobs", type=common.positive_int, default=8,
                        help="candidates compiled at once, each in its own process (1: in this process)")
    common.add_timing_arguments(parser, reps=20, warmup=3, seconds=1.0)
    parser.add_argument("--out", type=Path, default=common.OUT_DIR, metavar="DIR",
                        help=f"folder for the rows (JSON lines, each written when its candidate is timed) (default: "
                             f"./{common.OUT_DIR}/ in the current folder)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU (Triton's interpreter), two candidates a kernel, at most 2 jobs: "
                             "checks the script")
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    args.kernels = [name.strip() for name in args.kernels.split(",")]
    unknown = [name for name in args.kernels if name not in KERNELS]
    if unknown:
        parser.error(f"unknown --kernels {unknown}; choose from {', '.join(KERNELS)}")
    if args.smoke:
        args.jobs, args.reps, args.warmup = min(args.jobs, 2), 1, 0
    common.require_gpu(args, "run --smoke (it checks the script in Triton's interpreter)")
    return args


def main():
    args = parse_args()
    print(common.header(), flush=True)
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    args.current = {kernel: chip_tiles_now(kernel) for kernel in KERNELS}
    if args.smoke:  # the interpreter's tiles are its own: the smoke run checks that a candidate reaches chip_tiles
        args.current = {kernel: candidates[kernel][0] for kernel in KERNELS}
    todo = [(kernel, tuple(tiles)) for kernel in args.kernels
            for tiles in dict.fromkeys([args.current[kernel], *map(tuple, candidates[kernel])])]
    rows = common.Rows("tile_sweep", dict(candidates=todo, reps=args.reps, warmup=args.warmup), args.out)
    tensors = inputs(args.smoke)
    reference = {}
    for kernel in args.kernels:  # the chip's own tiles: the results every candidate is compared with
        result = passes(kernel, tensors)[1]()
        reference[kernel] = result if isinstance(result, tuple) else (result,)
    common.synchronize()
    compiled = {}
    if args.jobs == 1:
        compiled = {candidate: compile_candidate(*candidate, args.smoke) for candidate in todo}
    else:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            futures = {pool.submit(compile_candidate, *candidate, args.smoke): candidate for candidate in todo}
            for future in concurrent.futures.as_completed(futures):
                try:
                    compiled[futures[future]] = future.result()
                except Exception as error:  # the worker died: the candidate's row says so
                    compiled[futures[future]] = common.error_status(error), None
                print(f"  compiled {futures[future]}: {compiled[futures[future]]}", flush=True)
    for kernel, tiles in todo:
        measure(kernel, tiles, compiled[(kernel, tiles)], args, tensors, reference, rows)
    print("\n" + markdown(rows), flush=True)


if __name__ == "__main__":
    main()
