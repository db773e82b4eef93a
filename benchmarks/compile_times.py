"""Seconds to compile each variant of FAT5's attention kernels: the first forward and backward calls of each
variant less a second, warm call, at a small size that Triton specialises as the benchmarks' sizes (12 heads,
lengths and strides multiples of 16), so the benchmarks run after it find their kernels in Triton's cache.

    python benchmarks/compile_times.py                   # GPU: the variants of the GPU plan's first call
    python benchmarks/compile_times.py --variants drop_enc,drop_dec,d128_enc --jobs 4
    python benchmarks/compile_times.py --smoke           # CPU, Triton's interpreter: checks the script

Variants compile in --jobs processes at once (Triton compiles one kernel at a time per process), each writing its
row when done: compile_s is the first calls' time less the warm calls', 0 where the first calls were no slower
(nothing compiled: Triton's interpreter, or kernels found in Triton's cache; the difference is then noise, as much as
-27 s in the interpreter on a busy CPU). A variant that fails to compile is a row with its error.
"""

import concurrent.futures
import multiprocessing
import os
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. on import

import common  # noqa: E402  (puts this checkout first on sys.path)

# name: (dtype, head dim, options of flash_attention_t5 besides the T5 bias, layout). "cross" has no bias (T5's
# cross-attention); "mask" adds a key padding mask; "packed" is the varlen layout.
VARIANTS = {
    "enc": ("bfloat16", 64, dict(), "padded"),
    "dec": ("bfloat16", 64, dict(causal=True, bidirectional=False), "padded"),
    "cross": ("bfloat16", 64, dict(bias=False), "padded"),
    "enc_mask": ("bfloat16", 64, dict(mask=True), "padded"),
    "packed": ("bfloat16", 64, dict(), "packed"),
    "fp16_enc": ("float16", 64, dict(), "padded"),
    "fp16_dec": ("float16", 64, dict(causal=True, bidirectional=False), "padded"),
    "drop_enc": ("bfloat16", 64, dict(dropout_p=0.1), "padded"),
    "drop_dec": ("bfloat16", 64, dict(dropout_p=0.1, causal=True, bidirectional=False), "padded"),
    "d128_enc": ("bfloat16", 128, dict(), "padded"),
    "alibi_enc": ("bfloat16", 64, dict(alibi=True), "padded"),
    "fp32_enc": ("float32", 64, dict(), "padded"),
    "fp32_dec": ("float32", 64, dict(causal=True, bidirectional=False), "padded"),
}
FIRST_CALL = "enc,dec,cross,enc_mask,packed,fp16_enc,fp16_dec"


def variant_row(name, **measured):
    dtype, head_dim, _, _ = VARIANTS[name]
    return dict(implementation="fat5", variant=name, dtype=dtype, head_dim=head_dim, forward_first_s=None,
                forward_ms=None, backward_first_s=None, backward_ms=None, compile_s=None, status="ok", **measured)


def compile_variant(name, smoke):
    """The row of variant `name`: seconds of its first forward and backward, milliseconds of warm ones."""
    from fat5.attention_positions_fat5 import alibi_slopes
    from fat5.kernels.flash_attention_t5 import flash_attention_t5, flash_attention_t5_varlen

    dtype, head_dim, options, layout = VARIANTS[name]
    options = dict(options)
    device = common.device()
    heads, length = (2, 32) if smoke else (12, 256)
    batch = 2
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch * length, heads, head_dim) if layout == "packed" else (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=getattr(torch, dtype), generator=generator).requires_grad_()
               for _ in range(3))
    if options.pop("alibi", False):
        options["alibi_slopes"] = alibi_slopes(heads).to(device)
    elif options.pop("bias", True):
        options["bias_table"] = torch.randn(32, heads, device=device, generator=generator).requires_grad_()
    if options.pop("mask", False):
        options["key_padding_mask"] = torch.ones(batch, length, dtype=torch.bool, device=device)

    def attention():
        if layout == "packed":
            cu = torch.arange(0, batch * length + 1, length, device=device, dtype=torch.int32)
            return flash_attention_t5_varlen(q, k, v, cu, cu, length, length, **options)
        return flash_attention_t5(q, k, v, **options)

    row = variant_row(name)
    try:
        times = []
        for _ in range(2):  # compiling, then warm
            common.synchronize()
            start = time.perf_counter()
            out = attention()
            common.synchronize()
            middle = time.perf_counter()
            out.backward(torch.ones_like(out))
            common.synchronize()
            times.append((middle - start, time.perf_counter() - middle))
        (forward, backward), (warm_forward, warm_backward) = times
        row.update(forward_first_s=round(forward, 3), forward_ms=round(warm_forward * 1e3, 3),
                   backward_first_s=round(backward, 3), backward_ms=round(warm_backward * 1e3, 3),
                   compile_s=round(max(0.0, forward + backward - warm_forward - warm_backward), 3))
    except Exception as error:  # a variant that does not compile is the finding: its row says why
        row["status"] = common.error_status(error)
    return row


def build_parser():
    parser = common.argument_parser(__doc__, output=True)
    parser.add_argument("--variants", default=FIRST_CALL,
                        help=f"variants, comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--jobs", type=common.positive_int, default=8,
                        help="variants compiled at once, each in its own process (1: in this process)")
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    args.variants = [name.strip() for name in args.variants.split(",")]
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.smoke:
        args.jobs = 1
    common.require_gpu(args, "run --smoke (it checks the script in Triton's interpreter)")
    return args


def main():
    args = parse_args()
    print(common.header(), flush=True)
    rows = common.Rows("compile_times", dict(variants=args.variants, jobs=args.jobs), args.out)

    def report(row):
        rows.append(row)
        print(f"  {row['variant']:10s} {row['dtype']:9s} d={row['head_dim']:<4d} compile {row['compile_s']} s "
              f"(forward first {row['forward_first_s']} s, backward first {row['backward_first_s']} s) "
              f"{row['status']}", flush=True)

    if args.jobs == 1:
        for name in args.variants:
            report(compile_variant(name, args.smoke))
    else:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            futures = {pool.submit(compile_variant, name, args.smoke): name for name in args.variants}
            for future in concurrent.futures.as_completed(futures):
                try:
                    report(future.result())
                except Exception as error:  # the worker died (a crash in the driver, say): its row says so
                    report(variant_row(futures[future], status=common.error_status(error)))
    total = sum(row["compile_s"] or 0 for row in rows)
    print(f"{len(rows)} variants, {total:.1f} s of compiling in all", flush=True)


if __name__ == "__main__":
    main()
