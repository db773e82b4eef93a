"""Generation, FAT5 against transformers' T5, side by side in one process with the same weights.

    python benchmarks/generate.py --update-results   # GPU: v1.1-base shape, bf16, encoder 512, 128 new tokens
    python benchmarks/generate.py --impl fat5,t5_sdpa --caches static+compile --encoder-lengths 512,4096
    python benchmarks/generate.py --smoke            # CPU: tiny shapes, checks the script end to end
    python benchmarks/generate.py --allow-cpu --shape d_model=256,num_heads=4,d_ff=1024,num_layers=4 ...
                                                     # CPU at sizes it can run (benchmarks/RESULTS.md)

Greedy decoding of exactly --new-tokens tokens (min_new_tokens = max_new_tokens) after an encoder input of each
--encoder-lengths, at each batch size. tokens/s counts generated tokens (batch x new tokens), encoder included in
the time; ms_per_token is the time of a generate call over its new tokens. Caches:
    dynamic          transformers' default DynamicCache, uncompiled
    static           cache_implementation="static", uncompiled
    static+compile   the same with the model's forward under torch.compile ("reduce-overhead" on CUDA: CUDA
                     graphs; the row's cuda_graph_skips counts the graphs Inductor did not capture)
transformers' automatic compilation is disabled so each row is what its name says. Before timing, every model's
logits are compared with the eager T5's (fp32); each row also records whether its tokens equal FAT5's (dynamic
cache, eager) for the same inputs. Every row is written to the JSON lines in --out the moment it is measured.
"""


import torch

import common

CACHES = ("dynamic", "static", "static+compile")
DEFAULT_IMPL = "fat5,t5_eager,t5_sdpa,t5_flex"


def token_mismatch(tokens, reference):
    """None when generated `tokens` equal FAT5's `reference`; otherwise the row's status, saying how many rows
    differ and from which new token. (Such a row is still timed: it generated as many tokens.)"""
    if torch.equal(tokens, reference):
        return None
    if tokens.shape != reference.shape:
        return f"mismatch: output shape {tuple(tokens.shape)}, FAT5's {tuple(reference.shape)}"
    differ = (tokens != reference).cpu()
    rows = differ.any(dim=1)
    first = int(differ.int().argmax(dim=1)[rows].min())  # position 0 is the decoder start token
    return f"mismatch: tokens differ from FAT5's in {int(rows.sum())} of {len(tokens)} rows, from new token {first}"


def cuda_graph_skips():
    """How many compiled graphs Inductor has run without capturing a CUDA graph so far (None if torch lacks the
    counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["inductor"]["cudagraph_skips"]


def generate_rows(name, model, args, fat5_tokens, rows, status):
    """Append to `rows` one row per (encoder length, cache, batch): generated tokens/s, ms per generate call and per
    new token, peak MiB, agreement with FAT5's tokens, status."""
    device = common.device()
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    eager_forward = model.forward
    for cache in args.caches:
        if cache == "static+compile":
            mode = "reduce-overhead" if device == "cuda" else None
            model.forward = torch.compile(eager_forward, mode=mode, dynamic=False)
        for encoder_length in args.encoder_lengths:
            for batch in args.batches:
                generator = torch.Generator().manual_seed(batch)
                input_ids = torch.randint(2, args.shape["vocab_size"], (batch, encoder_length),
                                          generator=generator).to(device)
                options = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, disable_compile=True)
                if cache != "dynamic":
                    options["cache_implementation"] = "static"
                row = dict(implementation=name, cache=cache, batch=batch, encoder_length=encoder_length,
                           new_tokens=args.new_tokens, tokens_per_s=None, ms=None, ms_per_token=None, peak_mib=None,
                           same_tokens_as_fat5=None, cuda_graph_skips=None, status=status)
                skips = cuda_graph_skips()
                try:
                    outputs = []
                    with torch.no_grad(), common.peak_memory() as peak:
                        ms = common.time_ms(lambda: outputs.append(model.generate(**options)), args.reps,
                                            args.warmup, args.max_seconds)
                    tokens = outputs[-1]
                    row.update(ms=round(ms, 3), tokens_per_s=round(batch * args.new_tokens / ms * 1e3, 1),
                               ms_per_token=round(ms / args.new_tokens, 3), peak_mib=peak["mib"])
                    if cache == "static+compile" and device == "cuda" and skips is not None:
                        row["cuda_graph_skips"] = cuda_graph_skips() - skips
                    key = (encoder_length, batch)
                    if name == "fat5" and cache == "dynamic":
                        fat5_tokens[key] = tokens
                    if key in fat5_tokens:
                        mismatch = token_mismatch(tokens, fat5_tokens[key])
                        row["same_tokens_as_fat5"] = mismatch is None
                        row["status"] = mismatch or status
                except Exception as error:  # a cache or peer that cannot run here: a row, not a crash
                    row["status"] = common.error_status(error)
                rows.append(row)
                common.release_memory()
                speed = f"{row['tokens_per_s']:.0f} tok/s {row['ms_per_token']:.2f} ms/token peak " \
                    f"{row['peak_mib']} MiB same tokens as fat5: {row['same_tokens_as_fat5']}" if timed(row) else ""
                print(f"  {name:10s} {cache:15s} encoder={encoder_length:<5d} batch={batch:<4d} {speed} "
                      f"{row['status']}", flush=True)
    model.forward = eager_forward


def timed(row):
    """Whether `row` has a speed: it ran, its tokens equal to FAT5's or not (the same number of them either way)."""
    return row["status"] == "ok" or row["status"].startswith("mismatch")


def best(rows, batch, prefix, cache=None, encoder_length=None):
    values = [r["tokens_per_s"] for r in rows if r["batch"] == batch and r["implementation"].startswith(prefix)
              and timed(r) and cache in (None, r["cache"]) and encoder_length in (None, r["encoder_length"])]
    return max(values) if values else None


def markdown(rows, args):
    lines = common.markdown_head(
        "Generation",
        f"shape {args.shape}; {args.dtype} weights; {args.new_tokens} new tokens, greedy. Cells: generated "
        "tokens/s (`*`: mismatch, its tokens differ from FAT5's; the row's status in the JSON says where). Ratio: "
        "FAT5 over the best transformers T5 with the same cache; the `best` rows compare each side's best cache.",
        ["encoder", "batch", "cache", *args.impl, "fat5 / best T5"])
    for length in args.encoder_lengths:
        for batch in args.batches:
            for cache in args.caches:
                cells = []
                for name in args.impl:
                    row = next(r for r in rows if (r["implementation"], r["cache"], r["batch"], r["encoder_length"])
                               == (name, cache, batch, length))
                    mark = "*" if row["status"].startswith("mismatch") else ""
                    cells.append(f"{row['tokens_per_s']:.4g}{mark}" if timed(row) else row["status"].split(":")[0])
                speed = common.ratio(best(rows, batch, "fat5", cache, length), best(rows, batch, "t5_", cache, length))
                lines.append(f"| {length} | {batch} | {cache} | " + " | ".join(cells) + f" | {speed} |")
            bests = [best(rows, batch, name, encoder_length=length) for name in args.impl]
            speed = common.ratio(best(rows, batch, "fat5", None, length), best(rows, batch, "t5_", None, length))
            lines.append(f"| {length} | {batch} | best | " + " | ".join(f"{b:.4g}" if b else "-" for b in bests)
                         + f" | {speed} |")
    return "\n".join(lines) + "\n"


def plot(rows, args, path):
    plt = common.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(1, len(args.batches), figsize=(5 * len(args.batches), 4), squeeze=False)
    for axis, batch in zip(axes[0], args.batches):
        for offset, name in enumerate(args.impl):
            speeds = [best(rows, batch, name, cache) or 0 for cache in args.caches]
            positions = [i + offset / (len(args.impl) + 1) for i in range(len(args.caches))]
            axis.bar(positions, speeds, width=1 / (len(args.impl) + 1), label=name)
        axis.set_xticks([i + (len(args.impl) - 1) / (2 * (len(args.impl) + 1)) for i in range(len(args.caches))],
                      args.caches)
        axis.set(ylabel="generated tokens/s", title=f"batch {batch}")
        axis.legend(fontsize=7)
    common.save_figure(figure, f"T5 generation, {common.device_name()}", path)


def build_parser():
    parser = common.argument_parser(__doc__)
    parser.add_argument("--encoder-lengths", type=common.positive_ints, default="512",
                        help="encoder input tokens, comma-separated")
    parser.add_argument("--new-tokens", type=common.positive_int, default=128,
                        help="tokens each generate call produces (min_new_tokens = max_new_tokens)")
    parser.add_argument("--batches", type=common.positive_ints, default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--impl", default=DEFAULT_IMPL,
                        help=f"implementations, comma-separated: fat5 and transformers' "
                             f"{', '.join(common.T5_ATTENTION)}")
    parser.add_argument("--caches", default=",".join(CACHES), help="caches, comma-separated")
    common.add_model_arguments(parser)
    common.add_timing_arguments(parser, reps=3, warmup=1, seconds=20.0)
    common.add_allow_cpu_argument(parser)
    common.add_output_arguments(parser)
    return parser


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    base = common.V11_BASE
    if args.smoke:
        base = common.SMOKE_SHAPE
        args.encoder_lengths, args.new_tokens, args.batches, args.reps, args.warmup = [16], 4, [1, 2], 1, 0
        args.dtype = "float32"
        if args.impl == DEFAULT_IMPL:
            args.impl = "fat5,t5_eager,t5_sdpa"
        if args.caches == ",".join(CACHES):
            args.caches = "dynamic,static"
    args.shape = common.parse_shape(args.shape, base)
    args.impl = [name.strip() for name in args.impl.split(",")]
    args.caches = [cache.strip() for cache in args.caches.split(",")]
    unknown = [name for name in args.impl if name not in ("fat5", *common.T5_ATTENTION)]
    unknown += [cache for cache in args.caches if cache not in CACHES]
    if unknown:
        parser.error(f"unknown --impl or --caches {unknown}; implementations: fat5, "
                     f"{', '.join(common.T5_ATTENTION)}; caches: {', '.join(CACHES)}")
    if "fat5" in args.impl:
        args.impl.remove("fat5")
        args.impl.insert(0, "fat5")  # first, so the others can be compared with its tokens
    common.require_gpu(args, "run --smoke (it checks the script), or --allow-cpu with smaller sizes")
    return args


def main():
    args = parse_args()
    settings = dict(shape=args.shape, dtype=args.dtype, new_tokens=args.new_tokens, reps=args.reps,
                    warmup=args.warmup, max_seconds=args.max_seconds)
    rows, fat5_tokens = common.Rows("generate", settings, args.out), {}
    reference, batch, expected = common.reference_and_check(args.shape, args.dtype)
    for name in args.impl:
        model, status = common.checked_model(name, reference, batch, expected, args.dtype)
        if model is not None:
            generate_rows(name, model, args, fat5_tokens, rows, status)
        else:
            rows.extend(dict(implementation=name, cache=cache, batch=size, encoder_length=length,
                             new_tokens=args.new_tokens, tokens_per_s=None, ms=None, ms_per_token=None, peak_mib=None,
                             same_tokens_as_fat5=None, cuda_graph_skips=None, status=status)
                        for cache in args.caches for length in args.encoder_lengths for size in args.batches)
        del model
        common.release_memory()
    common.report(rows, markdown(rows, args), args, plot)
    mismatches = [row for row in rows if row["status"].startswith("mismatch")]
    if mismatches:
        print(f"{len(mismatches)} of {len(rows)} rows generated other tokens than FAT5 (dynamic cache): "
              + "; ".join(f"{r['implementation']} {r['cache']} encoder {r['encoder_length']} batch {r['batch']}: "
                          f"{r['status']}" for r in mismatches))


if __name__ == "__main__":
    main()
