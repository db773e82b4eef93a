"""FAT5's Triton attention against the ways T5 attention runs today, side by side in one process.

    python benchmarks/attention.py                  # H100/H200: T5-base heads, bf16, 32k tokens a batch
    python benchmarks/attention.py --smoke          # CPU, Triton interpreter: checks the script end to end
                                                    # (without --smoke it needs CUDA, and says so)
    python benchmarks/attention.py --decode         # one decoder step (Lq = 1) against a Lk-long cache
    python benchmarks/attention.py --dropout 0.1 --impl fat5,fat5_nodropout,sdpa_dense_bias,sdpa_nobias
                                                    # attention dropout p on every implementation that has it

Implementations (all use FAT5's `relative_position_bucket`, so they compute the same function):
    fat5                 FAT5 kernel, bias computed in the kernel, gradient to the bucket table
    sdpa_dense_bias      SDPA with the (1, H, L, L) bias built from the table on every call (what transformers does)
    sdpa_efficient_bias  the same, forced onto the memory-efficient SDPA backend
    sdpa_cudnn_bias      the same, forced onto the cuDNN SDPA backend (Hopper's fastest dense-bias path)
    flex_lut             FlexAttention (torch.compile), score_mod reading an (H, 2L - 1) relative-position table
    sdpa_nobias          SDPA without any bias (flash backend): the ceiling, not a T5
    fat5_nodropout       FAT5 kernel without dropout whatever --dropout says: what in-kernel dropout costs
The bias table requires grad in every implementation (T5 learns it), so the peers' backward reaches it too.
With --dropout P every implementation drops attention probabilities with probability P (FlexAttention has no
dropout: its rows say so); each output is compared with FAT5's at P = 0, since the masks differ, in a first call
that also compiles. The SDPA peers get the dense bias contiguous (the fused backends need a unit last stride),
built inside the timed call as transformers builds it; a backend that refuses says why in its row. Their
forward+backward stops at --dense-backward-max-length (the bias table's gradient, a scatter of L² values into 32
buckets, takes about 10 s a call at L = 8192 on an H100 whatever the backend).
Each row has two timings (common.time_calls): ms, the throughput of calls back to back (triton.testing.do_bench: what
a training step sees, its host running ahead; TFLOP/s come from it), and latency_ms, one call alone, host launch work
included (what a generation step sees).
FLOPs: forward 4·B·H·L²·D (half of it when causal); forward+backward counts 3.5× the forward. Every row is written
to the JSON lines in --out the moment it is measured.
--decode times one generation step instead (fat5: the decode kernel that generation runs, with the position
q_offset = Lk - 1 as a device tensor, as a static cache gives it; sdpa_dense_bias with the bias row transformers
builds; sdpa_nobias as the bar to reach; on request fat5_training, the training kernel's one 128-row tile per
(batch, head) that decode steps ran before the decode kernel), in microseconds, batch 1 and 32, Lk = 512...8192,
both timings (throughput / latency).
"""

import contextlib
import os
import sys
import warnings

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. on import

import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

import common  # noqa: E402  (puts this checkout first on sys.path)

try:
    import triton  # noqa: E402
except ImportError:
    print(f"attention.py: needs triton ({common.BENCH_EXTRA})", file=sys.stderr)
    sys.exit(2)
from fat5.kernels.decode_attention_t5 import decode_attention_t5  # noqa: E402
from fat5.kernels.flash_attention_t5 import flash_attention_t5  # noqa: E402
from fat5.reference_fat5 import relative_position_bucket  # noqa: E402

NUM_BUCKETS, MAX_DISTANCE = 32, 128
IMPLEMENTATIONS = ("fat5", "sdpa_dense_bias", "sdpa_efficient_bias", "sdpa_cudnn_bias", "flex_lut", "sdpa_nobias",
                   "fat5_nodropout")
SDPA_BACKENDS = {"sdpa_dense_bias": None, "sdpa_efficient_bias": SDPBackend.EFFICIENT_ATTENTION,
                 "sdpa_cudnn_bias": SDPBackend.CUDNN_ATTENTION}  # None: SDPA's own choice
# Not peers in the "fat5 / best peer" ratio: FAT5 itself and the no-bias ceiling.
NOT_PEERS = ("fat5", "fat5_nodropout", "sdpa_nobias")
DECODE_IMPLEMENTATIONS = ("fat5", "fat5_training", "sdpa_dense_bias", "sdpa_nobias")


def dense_bias(table, length, causal):
    relative = torch.arange(length, device=table.device)[None, :] - torch.arange(length, device=table.device)[:, None]
    buckets = relative_position_bucket(relative, not causal, NUM_BUCKETS, MAX_DISTANCE)
    return table[buckets].permute(2, 0, 1).unsqueeze(0)


def sdpa_mask(table, length, causal, dtype):
    """The (1, H, L, L) additive mask the SDPA peers get: T5's bias (and -inf above the diagonal when causal), in
    `dtype`, contiguous: the gather leaves heads last (a last stride of H), which every fused backend refuses."""
    return causal_mask_bias(dense_bias(table, length, causal), causal).to(dtype).contiguous()


def causal_mask_bias(bias, causal):
    if not causal:
        return bias
    length = bias.shape[-1]
    upper = torch.ones(length, length, dtype=torch.bool, device=bias.device).triu(1)
    return bias.masked_fill(upper, float("-inf"))


_compiled_flex = None


def run(name, q, k, v, table, causal, dropout_p=0.0):
    """One forward of implementation `name`; the bias is built inside, so it is timed and differentiated."""
    global _compiled_flex
    if name in ("fat5", "fat5_nodropout"):
        return flash_attention_t5(q, k, v, bias_table=table, bidirectional=not causal, num_buckets=NUM_BUCKETS,
                                  max_distance=MAX_DISTANCE, causal=causal,
                                  dropout_p=dropout_p if name == "fat5" else 0.0)
    if name in SDPA_BACKENDS:
        mask = sdpa_mask(table, q.shape[2], causal, q.dtype)
        backend = SDPA_BACKENDS[name]
        with sdpa_kernel(backend) if backend else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, dropout_p=dropout_p)
    if name == "flex_lut":
        if dropout_p:
            raise NotImplementedError("FlexAttention has no attention dropout")
        length = q.shape[2]
        relative = torch.arange(-(length - 1), length, device=q.device)
        lut = table[relative_position_bucket(relative, not causal, NUM_BUCKETS, MAX_DISTANCE)].t().to(q.dtype)

        def score_mod(score, b, h, q_idx, kv_idx):
            biased = score + lut[h, kv_idx - q_idx + length - 1]
            return torch.where(kv_idx <= q_idx, biased, float("-inf")) if causal else biased

        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, score_mod=score_mod, scale=1.0)
    if name == "sdpa_nobias":
        backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0, dropout_p=dropout_p)
    raise ValueError(f"unknown implementation {name}")


def decode_step(name, q, k, v, table, position):
    """One decoder self-attention step: Lq new queries at positions Lk - Lq... against a cache of Lk keys;
    `position`: Lk - Lq as a one-element device tensor."""
    query_length, key_length = q.shape[2], k.shape[2]
    past = key_length - query_length
    if name == "fat5":
        return decode_attention_t5(q, k, v, bias_table=table, bidirectional=False, num_buckets=NUM_BUCKETS,
                                   max_distance=MAX_DISTANCE, causal=True, q_offset=position)
    if name == "fat5_training":
        return flash_attention_t5(q, k, v, bias_table=table, bidirectional=False, num_buckets=NUM_BUCKETS,
                                  max_distance=MAX_DISTANCE, causal=True, q_offset=past)
    if name == "sdpa_dense_bias":
        positions = torch.arange(key_length, device=q.device)
        relative = positions[None, :] - positions[past:, None]
        bias = table[relative_position_bucket(relative, False, NUM_BUCKETS, MAX_DISTANCE)].permute(2, 0, 1)[None]
        bias = bias.masked_fill(relative > 0, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    if name == "sdpa_nobias":  # one query sees the whole cache: no mask at all
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)
    raise ValueError(f"decode has no implementation {name}")


def decode(args, stamp, rows):
    """Append a row (pass "decode") to `rows` for every Lk, batch and implementation; return the markdown table."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    names = [n for n in args.impl if n in DECODE_IMPLEMENTATIONS]
    lines = [f"### decode step, {device_name()}, {stamp}", "",
             f"torch {torch.__version__}, triton {triton.__version__}; H={args.heads}, D={args.head_dim}, "
             f"{args.dtype}, one new query against Lk cached keys; microseconds: throughput (calls back to back) / "
             "latency (one call alone, host launch included; median).", "",
             "| batch | Lk | " + " | ".join(names) + " | fat5 / sdpa_nobias time |",
             "|" + " --- |" * (len(names) + 3)]
    for batch in args.decode_batches:
        for key_length in args.decode_lengths:
            generator = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, args.heads, 1, args.head_dim, device=device, dtype=dtype, generator=generator)
            k, v = (torch.randn(batch, args.heads, key_length, args.head_dim, device=device, dtype=dtype,
                                generator=generator) for _ in range(2))
            table = torch.randn(NUM_BUCKETS, args.heads, device=device, generator=generator)
            position = torch.full((1,), key_length - 1, dtype=torch.int64, device=device)
            with torch.no_grad():
                ours = decode_step("fat5", q, k, v, table, position).float()
                cells, times = [], {}
                for name in names:
                    row = dict(implementation=name, L=key_length, batch=batch, causal=True, **{"pass": "decode"},
                               tflops=None, ms=None, latency_ms=None, peak_mib=None, status="ok")
                    try:
                        difference = (decode_step(name, q, k, v, table, position).float() - ours).abs().max().item()
                        if name != "sdpa_nobias" and difference > (5e-2 if args.dtype != "float32" else 1e-3):
                            row["status"] = f"mismatch: max|out - fat5| = {difference:.3g}"
                        timing = common.time_calls(lambda: decode_step(name, q, k, v, table, position), args.reps,
                                                   args.warmup, args.max_seconds)
                        row.update(ms=timing["ms"], latency_ms=timing["latency_ms"])
                        times[name] = row["ms"], row["latency_ms"]
                    except Exception as error:  # out of memory, or a backend missing here: a row, not a crash
                        row["status"] = common.error_status(error)
                    cells.append(f"{row['ms'] * 1e3:.1f} / {row['latency_ms'] * 1e3:.1f}" if row["ms"] is not None
                                 else row["status"].split(":")[0])
                    rows.append(row)
                    print(f"  decode batch={batch} Lk={key_length} {name:16s} {cells[-1]} us {row['status']}",
                          flush=True)
            ratio = "-"
            if {"fat5", "sdpa_nobias"} <= set(times):
                ratio = " / ".join(f"{ours / theirs:.2f}" for ours, theirs in zip(times["fat5"], times["sdpa_nobias"]))
            lines.append(f"| {batch} | {key_length} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def attention_inputs(batch, length, args):
    """q, k, v, the bias table (all requiring grad) and the output gradient of one (batch, L)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch, args.heads, length, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_()
               for _ in range(3))
    table = torch.randn(NUM_BUCKETS, args.heads, device=device, generator=generator).requires_grad_()
    return q, k, v, table, torch.randn(shape, device=device, dtype=dtype, generator=generator)


def refusal(error, caught):
    """A row's status for `error`, with the reasons SDPA gave (its warnings) when no backend would run."""
    status = common.error_status(error)
    reasons = [str(warning.message).split(" (Triggered internally")[0] for warning in caught]
    reasons = [reason for reason in dict.fromkeys(reasons) if "not used because" not in reason]
    if "No available kernel" in status and reasons:
        status = f"{status} ({'; '.join(reasons)})"[:600]
    return status


def measure(name, tensors, expected, args, causal, rows):
    """Append to `rows` one row per pass (fwd, fwd+bwd) of implementation `name`: status, ms (throughput), latency_ms,
    TFLOP/s (from ms) and peak memory above the inputs. A first call compares its output with FAT5's
    (`expected`, at dropout 0) so that a fast wrong kernel cannot win; it also compiles what compiles."""
    q, k, v, table, grad = tensors
    batch, heads, length, head_dim = q.shape
    flops = 4 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)
    status = "ok"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            difference = (run(name, q, k, v, table, causal).detach().float() - expected).abs().max().item()
        if name not in NOT_PEERS and difference > (5e-2 if args.dtype != "float32" else 1e-3):
            status = f"mismatch: max|out - fat5| = {difference:.3g}"
    except Exception as error:  # a peer out of memory or failing at one size is recorded, and the run goes on
        status = refusal(error, caught)
    for pass_name in ("fwd", "fwd+bwd"):
        def step():
            out = run(name, q, k, v, table, causal, args.dropout)
            if pass_name == "fwd+bwd":
                out.backward(grad)
            return out

        row = dict(implementation=name, L=length, batch=batch, causal=causal, **{"pass": pass_name},
                   tflops=None, ms=None, latency_ms=None, peak_mib=None, status=status)
        if pass_name == "fwd+bwd" and name in SDPA_BACKENDS and length > args.dense_backward_max_length:
            row["status"] = f"skipped: L > --dense-backward-max-length {args.dense_backward_max_length}"
        if not row["status"].startswith(("error", "oom", "skipped")):
            try:
                with common.peak_memory() as peak:
                    timing = common.time_calls(step, args.reps, args.warmup, args.max_seconds)
                row.update(ms=timing["ms"], latency_ms=timing["latency_ms"],
                           tflops=flops * (3.5 if pass_name == "fwd+bwd" else 1) / timing["ms"] / 1e9,
                           peak_mib=peak["mib"] if q.is_cuda else None)
            except Exception as error:
                row["status"] = common.error_status(error)
        for tensor in (q, k, v, table):
            tensor.grad = None
        common.release_memory()
        rows.append(row)
        speed = f"{row['tflops']:.3g} TFLOP/s {row['ms']:.3g} ms (latency {row['latency_ms']:.3g} ms)" \
            if row["ms"] is not None else ""
        peak = f"peak {row['peak_mib']} MiB" if row["peak_mib"] is not None else ""
        print(f"  {name:20s} {pass_name:8s} {speed} {peak} {row['status']}", flush=True)


def device_name():
    return common.device_name() + ("" if torch.cuda.is_available() else " (interpreter)")


def cell(row):
    """A timed row's table cell: TFLOP/s (throughput ms, latency ms, peak MiB); `*`: its output differs."""
    peak = f", {row['peak_mib']} MiB" if row["peak_mib"] is not None else ""
    latency = f" / {row['latency_ms']:.3g}" if row.get("latency_ms") is not None else ""
    mark = "*" if row["status"] != "ok" else ""  # timed, but its output differs from FAT5's
    return f"{row['tflops']:.3g}{mark} ({row['ms']:.3g}{latency} ms{peak})"


def markdown(rows, args, stamp):
    lines = [f"### {device_name()}, {stamp}",
             "",
             f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}; "
             f"H={args.heads}, D={args.head_dim}, {args.dtype}, {args.tokens} tokens a batch"
             + (f", attention dropout {args.dropout:g} (fat5_nodropout: none)" if args.dropout else "") + ". "
             "TFLOP/s from the throughput (ms: throughput / latency of one call alone); fwd+bwd FLOPs = 3.5 x fwd; "
             "peak = MiB above the inputs; `*`: output differs from FAT5's (not a peer).",
             "",
             "| causal | pass | L | " + " | ".join(args.impl) + " | fat5 / best peer |"
             + (" fat5 / fat5_nodropout |" if "fat5_nodropout" in args.impl else ""),
             "|" + " --- |" * (len(args.impl) + 4 + ("fat5_nodropout" in args.impl))]
    keys = sorted({(r["causal"], r["pass"], r["L"]) for r in rows})
    for causal, pass_name, length in keys:
        cells, peers = [], []
        for name in args.impl:
            row = next((r for r in rows if (r["implementation"], r["causal"], r["pass"], r["L"])
                        == (name, causal, pass_name, length)), None)
            if row is None:
                cells.append("-")
            elif row["ms"] is None:
                cells.append(row["status"].split(":")[0])
            else:
                cells.append(cell(row))
                if name not in NOT_PEERS and row["status"] == "ok":
                    peers.append(row["tflops"])

        def ok_row(name):
            return next((r for r in rows if (r["implementation"], r["causal"], r["pass"], r["L"])
                         == (name, causal, pass_name, length) and r["status"] == "ok"), None)

        ours, without_dropout = ok_row("fat5"), ok_row("fat5_nodropout")
        ratio = f"{ours['tflops'] / max(peers):.2f}x" if ours and peers and max(peers) > 0 else "-"
        dropout_ratio = ""
        if "fat5_nodropout" in args.impl:
            dropout_ratio = f" {ours['tflops'] / without_dropout['tflops']:.2f}x |" if ours and without_dropout \
                else " - |"
        lines.append(f"| {'yes' if causal else 'no'} | {pass_name} | {length} | " + " | ".join(cells)
                     + f" | {ratio} |" + dropout_ratio)
    return "\n".join(lines) + "\n"


def plot(rows, args, path):
    plt = common.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    for i, causal in enumerate((False, True)):
        for j, pass_name in enumerate(("fwd", "fwd+bwd")):
            axis = axes[i][j]
            for name in args.impl:
                points = sorted((r["L"], r["tflops"]) for r in rows if r["implementation"] == name
                                and r["causal"] == causal and r["pass"] == pass_name and r["status"] == "ok")
                if points:
                    axis.plot(*zip(*points), marker="o", label=name)
            axis.set(xscale="log", xlabel="L", ylabel="TFLOP/s",
                     title=f"{'decoder (causal)' if causal else 'encoder'} {pass_name}")
            axis.legend(fontsize=7)
    common.save_figure(figure, f"T5 attention, {device_name()}", path)


def build_parser():
    parser = common.argument_parser(__doc__, timing=(20, 5, 3.0), report=True)
    parser.add_argument("--lengths", type=common.positive_ints, default="512,1024,2048,4096,8192,16384,32768",
                        help="sequence lengths L (queries = keys), comma-separated")
    parser.add_argument("--heads", type=common.positive_int, default=12, help="attention heads")
    parser.add_argument("--head-dim", type=common.positive_int, default=64, help="head dimension D")
    parser.add_argument("--tokens", type=common.positive_int, default=32768, help="tokens a batch: batch = tokens // L")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of queries, keys and values")
    parser.add_argument("--impl", default=",".join(name for name in IMPLEMENTATIONS if name != "fat5_nodropout"),
                        help=f"implementations to time, comma-separated, from: {', '.join(IMPLEMENTATIONS)}")
    parser.add_argument("--causal", default="both", choices=["both", "yes", "no"],
                        help="decoder self-attention (causal), encoder (not), or both")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="attention dropout probability of every implementation (fat5_nodropout: none)")
    parser.add_argument("--peer-max-length", type=int, default=16384, help="peers stop at this L (fat5 goes on)")
    parser.add_argument("--dense-backward-max-length", type=int, default=16384,
                        help="the dense-bias SDPA peers' forward+backward stops at this L (their bias gradient "
                             "takes seconds a call from L = 8192)")
    parser.add_argument("--decode", action="store_true", help="time one generation step instead (Lq = 1)")
    parser.add_argument("--decode-lengths", type=common.positive_ints, default="512,1024,2048,4096,8192",
                        help="cache lengths Lk")
    parser.add_argument("--decode-batches", type=common.positive_ints, default="1,32", help="batch sizes of --decode")
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.heads, args.head_dim, args.tokens = [32, 48], 2, 32, 96
        args.dtype, args.reps, args.warmup, args.peer_max_length = "float32", 1, 0, 48
        args.dense_backward_max_length = min(args.dense_backward_max_length, 32)  # L = 48: the skip
        args.decode_lengths, args.decode_batches = [24], [1]
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout}: must be in [0, 1)")
    if args.dropout and args.decode:
        parser.error("--dropout applies to training passes, not to --decode")
    args.impl = [name.strip() for name in args.impl.split(",")]
    known = IMPLEMENTATIONS + (("fat5_training",) if args.decode else ())
    unknown = sorted(set(args.impl) - set(known))
    if unknown:
        parser.error(f"unknown --impl {unknown}; choose from {known}")
    common.require_gpu(args, "run --smoke (it checks the script in Triton's interpreter)")
    return args


def main():
    args = parse_args()
    stamp = common.today()
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    print(f"{device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"transformers {transformers.__version__} | {stamp}", flush=True)
    settings = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, tokens=args.tokens,
                    reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds, dropout=args.dropout)
    name = "attention_decode" if args.decode else ("attention_dropout" if args.dropout else "attention")
    rows = common.Rows(name, settings, args.out)
    if args.decode:
        common.report(rows, decode(args, stamp, rows), args)
        return
    for causal in causal_values:
        for length in args.lengths:
            batch = max(1, args.tokens // length)
            print(f"L={length} batch={batch} causal={causal}", flush=True)
            tensors = attention_inputs(batch, length, args)
            with torch.no_grad():
                expected = run("fat5", *tensors[:4], causal).float()
            for name in (n for n in args.impl if n == "fat5" or length <= args.peer_max_length):
                measure(name, tensors, expected, args, causal, rows)
            del tensors, expected
            common.release_memory()
    common.report(rows, markdown(rows, args, stamp), args, plot)


if __name__ == "__main__":
    main()
