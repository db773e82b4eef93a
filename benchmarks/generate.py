"""Generation, FAT5 against transformers' T5, side by side in one process with the same weights.

    python benchmarks/generate.py --update-results   # GPU: v1.1-base shape, bf16, encoder 512, 128 new tokens
    python benchmarks/generate.py --smoke            # CPU: tiny shapes, checks the script end to end

Greedy decoding of exactly --new-tokens tokens (min_new_tokens = max_new_tokens) after an encoder input of
--encoder-length tokens, at each batch size. tokens/s counts generated tokens (batch x new tokens), encoder
included in the time. Caches:
    dynamic          transformers' default DynamicCache, uncompiled
    static           cache_implementation="static", uncompiled
    static+compile   the same with the model's forward under torch.compile ("reduce-overhead" on CUDA)
transformers' automatic compilation is disabled so each row is what its name says. Before timing, every model's
logits are compared with the eager T5's (fp32); each row also records whether its tokens equal FAT5's (dynamic
cache) for the same inputs.
"""

import argparse

import torch

import common

CACHES = ("dynamic", "static", "static+compile")
DEFAULT_IMPL = "fat5,t5_eager,t5_sdpa,t5_flex"


def generate_rows(name, model, args, fat5_tokens):
    """One row per (batch, cache): generated tokens/s, ms per generate call, peak MiB, agreement, status."""
    device = common.device()
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    eager_forward = model.forward
    rows = []
    for cache in args.caches:
        if cache == "static+compile":
            mode = "reduce-overhead" if device == "cuda" else None
            model.forward = torch.compile(eager_forward, mode=mode, dynamic=False)
        for batch in args.batches:
            generator = torch.Generator().manual_seed(batch)
            input_ids = torch.randint(2, args.shape["vocab_size"], (batch, args.encoder_length),
                                      generator=generator).to(device)
            options = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, disable_compile=True)
            if cache != "dynamic":
                options["cache_implementation"] = "static"
            row = dict(implementation=name, cache=cache, batch=batch, encoder_length=args.encoder_length,
                       new_tokens=args.new_tokens, tokens_per_s=None, ms=None, peak_mib=None,
                       same_tokens_as_fat5=None, status="ok")
            rows.append(row)
            try:
                outputs = []
                with torch.no_grad():
                    ms = common.time_ms(lambda: outputs.append(model.generate(**options)), args.reps, args.warmup)
                    with common.peak_memory() as peak:
                        model.generate(**options)
                tokens = outputs[-1]
                row.update(ms=round(ms, 3), tokens_per_s=round(batch * args.new_tokens / ms * 1e3, 1),
                           peak_mib=peak["mib"])
                if name == "fat5" and cache == "dynamic":
                    fat5_tokens[batch] = tokens
                if batch in fat5_tokens:
                    row["same_tokens_as_fat5"] = torch.equal(tokens, fat5_tokens[batch])
            except Exception as error:  # a cache or peer that cannot run here: a row, not a crash
                row["status"] = common.error_status(error)
            common.release_memory()
            speed = f"{row['tokens_per_s']:.0f} tok/s {row['ms']:.1f} ms peak {row['peak_mib']} MiB " \
                f"same tokens as fat5: {row['same_tokens_as_fat5']}" if row["status"] == "ok" else ""
            print(f"  {name:10s} {cache:15s} batch={batch:<4d} {speed} {row['status']}", flush=True)
    model.forward = eager_forward
    return rows


def best(rows, batch, prefix, cache=None):
    values = [r["tokens_per_s"] for r in rows if r["batch"] == batch and r["implementation"].startswith(prefix)
              and r["status"] == "ok" and (cache is None or r["cache"] == cache)]
    return max(values) if values else None


def markdown(rows, args):
    lines = common.markdown_head(
        "Generation",
        f"shape {args.shape}; {args.dtype} weights; encoder {args.encoder_length} tokens, {args.new_tokens} new "
        "tokens, greedy. Cells: generated tokens/s (`*`: tokens differ from FAT5's). Ratio: FAT5 over the best "
        "transformers T5 with the same cache; the `best` rows compare each side's best cache.",
        ["batch", "cache", *args.impl, "fat5 / best T5"])
    for batch in args.batches:
        for cache in args.caches:
            cells = []
            for name in args.impl:
                row = next(r for r in rows if (r["implementation"], r["cache"], r["batch"]) == (name, cache, batch))
                mark = "*" if row["same_tokens_as_fat5"] is False else ""
                cells.append(f"{row['tokens_per_s']:.4g}{mark}" if row["status"] == "ok"
                             else row["status"].split(":")[0])
            speed = common.ratio(best(rows, batch, "fat5", cache), best(rows, batch, "t5_", cache))
            lines.append(f"| {batch} | {cache} | " + " | ".join(cells) + f" | {speed} |")
        cells = [f"{best(rows, batch, name):.4g}" if best(rows, batch, name) else "-" for name in args.impl]
        speed = common.ratio(best(rows, batch, "fat5"), best(rows, batch, "t5_"))
        lines.append(f"| {batch} | best | " + " | ".join(cells) + f" | {speed} |")
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


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder-length", type=common.positive_int, default=512)
    parser.add_argument("--new-tokens", type=common.positive_int, default=128)
    parser.add_argument("--batches", type=common.positive_ints, default="1,32")
    parser.add_argument("--impl", default=DEFAULT_IMPL)
    parser.add_argument("--caches", default=",".join(CACHES))
    common.add_model_arguments(parser)
    parser.add_argument("--reps", type=common.positive_int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    common.add_output_arguments(parser)
    args = parser.parse_args()
    base = common.V11_BASE
    if args.smoke:
        base = common.SMOKE_SHAPE
        args.encoder_length, args.new_tokens, args.batches, args.reps, args.warmup = 16, 4, [1, 2], 1, 0
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
    return args


def main():
    args = parse_args()
    reference, batch, expected = common.reference_and_check(args.shape)
    rows, fat5_tokens = [], {}
    for name in args.impl:
        model, status = common.checked_model(name, reference, batch, expected)
        if status is None:
            rows += generate_rows(name, model, args, fat5_tokens)
        else:
            rows += [dict(implementation=name, cache=cache, batch=size, encoder_length=args.encoder_length,
                          new_tokens=args.new_tokens, tokens_per_s=None, ms=None, peak_mib=None,
                          same_tokens_as_fat5=None, status=status)
                     for cache in args.caches for size in args.batches]
        del model
        common.release_memory()
    table = markdown(rows, args)
    settings = dict(shape=args.shape, dtype=args.dtype, encoder_length=args.encoder_length,
                    new_tokens=args.new_tokens, reps=args.reps, warmup=args.warmup)
    common.report("generate", rows, table, settings, args, plot)


if __name__ == "__main__":
    main()
