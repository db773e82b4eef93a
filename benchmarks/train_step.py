"""A whole training step, FAT5 against transformers' T5, side by side in one process with the same weights.

    python benchmarks/train_step.py --update-results   # GPU: v1.1-base shape, bf16 autocast, L = 512 ... 32768
    python benchmarks/train_step.py --smoke            # CPU: tiny shapes, checks the script end to end
    python benchmarks/train_step.py --allow-cpu --shape d_model=256,num_heads=4,d_ff=1024,num_layers=4 ...
                                                       # CPU at sizes it can run (benchmarks/RESULTS.md)

One step = forward with labels (encoder L tokens, decoder 128), backward, AdamW step, gradients set to None.
Batch = --tokens // L. tokens/s counts encoder tokens (batch x L). Peak memory is above the resting state
(weights, AdamW state and inputs already allocated), i.e. activations, gradients and the optimizer's transients.
Each row also has the step's model FLOPs counted from the config (common.step_flops), `mfu` (those FLOPs per second
over the chip's dense bf16 peak; null where the peak is unknown: docs/benchmarks.md) and `ops` (torch ops one step
dispatches, views included: the host's share; a compiled step shows what its graph still dispatches).
Implementations:
    fat5            FAT5 converted from the T5 (Triton attention on CUDA, SDPA on CPU; its default chunked LM
                    loss, so no full fp32 logits: training forwards return logits=None)
    fat5+compile    the same under torch.compile
    t5_eager, t5_sdpa, t5_flex   transformers' T5ForConditionalGeneration with that attn_implementation
    (any name + "+compile" compiles it; e.g. t5_sdpa+compile)
Before timing, every model's logits are compared with the eager T5's (fp32); a mismatch marks its rows.
"""

import torch

import common

DEFAULT_IMPL = "fat5,fat5+compile,t5_eager,t5_sdpa,t5_flex"
CPU_INSTEAD = "run --smoke (it checks the script), or --allow-cpu with smaller sizes"


def train_rows(name, model, args, rows, status):
    """Append to `rows` one row per L for implementation `name`: tokens/s, ms per step, peak MiB, status (`status`
    unless the step fails)."""
    device = common.device()
    compiled = name.endswith("+compile")
    model.to(device).train()
    step_model = torch.compile(model, dynamic=False) if compiled else model  # one graph per L
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    failed_at = None
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        row = dict(implementation=name, L=length, batch=batch, decoder_length=args.decoder_length,
                   tokens_per_s=None, ms=None, peak_mib=None, mfu=None, ops=None, status=status,
                   flops=common.step_flops(args.shape, batch, length, args.decoder_length))
        if failed_at is not None:
            rows.append({**row, "status": f"skipped: {failed_at}"})
            continue
        generator = torch.Generator().manual_seed(length)
        input_ids = torch.randint(2, args.shape["vocab_size"], (batch, length), generator=generator).to(device)
        labels = torch.randint(2, args.shape["vocab_size"], (batch, args.decoder_length),
                               generator=generator).to(device)

        def step(input_ids=input_ids, labels=labels):
            with common.autocast(args.dtype):
                loss = step_model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:
            ms = common.time_ms(step, args.reps, args.warmup + (2 if compiled else 0), args.max_seconds)
            with common.peak_memory() as peak:
                step()
            with common.OpCounter() as counter:
                step()
            row.update(ms=round(ms, 3), tokens_per_s=round(batch * length / ms * 1e3, 1), peak_mib=peak["mib"],
                       mfu=common.mfu(row["flops"], ms), ops=counter.ops)
        except Exception as error:  # out of memory, or a peer that cannot run this: a row, not a crash
            row["status"] = common.error_status(error)
            failed_at = f"{row['status'].split(':')[0]} at L={length}"
        optimizer.zero_grad(set_to_none=True)
        del input_ids, labels, step
        common.release_memory()
        rows.append(row)
        speed = (f"{row['tokens_per_s']:.0f} tok/s {row['ms']:.1f} ms peak {row['peak_mib']} MiB "
                 f"{row['ops']} ops" + (f" MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")) \
            if row["ms"] is not None else ""
        print(f"  {name:16s} L={length:<6d} batch={batch:<4d} {speed} {row['status']}", flush=True)


def best(rows, length, prefix, key="tokens_per_s", pick=max):
    values = [r[key] for r in rows if r["L"] == length and r["implementation"].startswith(prefix)
              and r["status"] == "ok" and r[key] is not None]
    return pick(values) if values else None


def markdown(rows, args):
    lines = common.markdown_head(
        "Training step",
        f"shape {args.shape}; {args.dtype}{' autocast' if args.dtype != 'float32' else ''}, {args.tokens} encoder "
        f"tokens a batch, decoder {args.decoder_length}. Cells: encoder tokens/s (peak MiB above resting, MFU where "
        "the chip's peak is known, ops a step; `*`: logits differ from the T5's). Ratios: best FAT5 over best "
        "transformers T5 (speed), best T5's peak over FAT5's (memory).",
        ["L", "batch", *args.impl, "speed fat5 / T5", "memory T5 / fat5"])
    for length in args.lengths:
        cells = []
        for name in args.impl:
            row = next(r for r in rows if r["implementation"] == name and r["L"] == length)
            mark = "*" if row["status"] != "ok" else ""  # timed, but its logits differ from the T5's
            extra = "".join(f", {value}" for value in (
                f"{row['mfu']:.1%}" if row.get("mfu") is not None else None,
                f"{row['ops']} ops" if row.get("ops") is not None else None) if value)
            cells.append(f"{row['tokens_per_s']:.4g}{mark} ({row['peak_mib']}{extra})" if row["ms"] is not None
                         else row["status"].split(":")[0])
        batch = max(1, args.tokens // length)
        speed = common.ratio(best(rows, length, "fat5"), best(rows, length, "t5_"))
        memory = common.ratio(best(rows, length, "t5_", "peak_mib", min), best(rows, length, "fat5", "peak_mib", min))
        lines.append(f"| {length} | {batch} | " + " | ".join(cells) + f" | {speed} | {memory} |")
    return "\n".join(lines) + "\n"


def plot(rows, args, path):
    plt = common.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in args.impl:
        ok = sorted((r["L"], r["tokens_per_s"], r["peak_mib"]) for r in rows
                    if r["implementation"] == name and r["status"] == "ok")
        if ok:
            lengths, speeds, peaks = zip(*ok)
            axes[0].plot(lengths, speeds, marker="o", label=name)
            if None not in peaks:
                axes[1].plot(lengths, peaks, marker="o", label=name)
    axes[0].set(xscale="log", xlabel="L (encoder)", ylabel="encoder tokens/s", title="training step")
    axes[1].set(xscale="log", xlabel="L (encoder)", ylabel="MiB above resting", title="peak memory")
    for axis in axes:
        axis.legend(fontsize=7)
    common.save_figure(figure, f"T5 training step, {common.device_name()}", path)


def build_parser():
    parser = common.argument_parser(
        __doc__, timing=(10, 3, 20.0), allow_cpu=True, report=True,
        model="autocast dtype (weights and AdamW state stay fp32, as Trainer's bf16=True; default: bfloat16 on CUDA, "
              "float32 on CPU)")
    parser.add_argument("--lengths", type=common.positive_ints, default="512,1024,2048,4096,8192,16384,32768",
                        help="encoder lengths L, comma-separated")
    parser.add_argument("--tokens", type=common.positive_int, default=32768,
                        help="encoder tokens a batch: batch = tokens // L")
    parser.add_argument("--decoder-length", type=common.positive_int, default=128, help="decoder tokens an example")
    parser.add_argument("--impl", default=DEFAULT_IMPL,
                        help="implementations, comma-separated: fat5 and transformers' "
                             f"{', '.join(common.T5_ATTENTION)}, each optionally +compile")
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    base = common.V11_BASE
    if args.smoke:
        base = common.SMOKE_SHAPE
        args.lengths, args.tokens, args.decoder_length, args.reps, args.warmup = [16, 32], 64, 8, 1, 0
        args.dtype = "float32"
        if args.impl == DEFAULT_IMPL:
            args.impl = "fat5,t5_eager,t5_sdpa"
    args.shape = common.parse_shape(args.shape, base)
    args.impl = [name.strip() for name in args.impl.split(",")]
    unknown = [name for name in args.impl if name.removesuffix("+compile") not in ("fat5", *common.T5_ATTENTION)]
    if unknown:
        parser.error(f"unknown --impl {unknown}; choose from fat5, {', '.join(common.T5_ATTENTION)} "
                     "(each optionally +compile)")
    common.require_gpu(args, CPU_INSTEAD)
    return args


def main():
    args = parse_args()
    settings = dict(shape=args.shape, dtype=args.dtype, tokens=args.tokens, decoder_length=args.decoder_length,
                    reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds)
    rows = common.Rows("train_step", settings, args.out)
    reference, batch, expected = common.reference_and_check(args.shape, args.dtype)
    for name in args.impl:
        model, status = common.checked_model(name.removesuffix("+compile"), reference, batch, expected, args.dtype)
        if model is not None:
            train_rows(name, model, args, rows, status)
        else:
            rows.extend(dict(implementation=name, L=length, batch=max(1, args.tokens // length),
                             decoder_length=args.decoder_length, tokens_per_s=None, ms=None, peak_mib=None,
                             mfu=None, ops=None, status=status) for length in args.lengths)
        del model
        common.release_memory()
    common.report(rows, markdown(rows, args), args, plot)


if __name__ == "__main__":
    main()
