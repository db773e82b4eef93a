"""Generation, FAT5 against transformers' T5, side by side in one process with the same weights.

    python benchmarks/generate.py --update-results   # GPU: v1.1-base shape, bf16, encoder 512, 128 new tokens
    python benchmarks/generate.py --smoke            # CPU: tiny shapes, checks the script end to end
    python benchmarks/generate.py --allow-cpu --shape d_model=256,num_heads=4,d_ff=1024,num_layers=4 ...
                                                     # CPU at sizes it can run (benchmarks/RESULTS.md)

Greedy decoding of exactly --new-tokens tokens (min_new_tokens = max_new_tokens) after an encoder input of
--encoder-length tokens, at each batch size. tokens/s counts generated tokens (batch x new tokens), encoder
included in the time. Caches:
    dynamic          transformers' default DynamicCache, uncompiled
    static           cache_implementation="static", uncompiled
    static+compile   the same with the model's forward under torch.compile ("reduce-overhead" on CUDA)
transformers' automatic compilation is disabled so each row is what its name says. Before timing, every model's
logits are compared with the eager T5's (fp32); each row also records whether its tokens equal FAT5's (dynamic
cache) for the same inputs. FAT5 runs as users get it: on CUDA its decode steps run the decode kernel
(fat5/kernels/decode_attention_t5.py: a static cache's position stays on the device, so "static+compile" replays
CUDA graphs), on CPU SDPA.

`--impl ...,ct2_fp32,ct2_int8` adds CTranslate2 (`pip install ctranslate2`), the engine a CPU user would pick: FAT5's
model exported by convert/ct2_fat5.py, run by `ctranslate2.Translator` with float32 or int8 compute, greedy,
exactly --new-tokens tokens, with its own cache (rows with cache "own"; the table's `best` rows compare it).
"""


import torch

import common

CACHES = ("dynamic", "static", "static+compile")
DEFAULT_IMPL = "fat5,t5_eager,t5_sdpa,t5_flex"
# CTranslate2 runs of FAT5's export: their compute type.
CT2 = {"ct2_fp32": "float32", "ct2_int8": "int8"}


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
            input_ids = encoder_input(batch, args).to(device)
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
                    mismatch = token_mismatch(tokens, fat5_tokens[batch])
                    row["same_tokens_as_fat5"] = mismatch is None
                    row["status"] = mismatch or "ok"
            except Exception as error:  # a cache or peer that cannot run here: a row, not a crash
                row["status"] = common.error_status(error)
            common.release_memory()
            speed = f"{row['tokens_per_s']:.0f} tok/s {row['ms']:.1f} ms peak {row['peak_mib']} MiB " \
                f"same tokens as fat5: {row['same_tokens_as_fat5']}" if timed(row) else ""
            print(f"  {name:10s} {cache:15s} batch={batch:<4d} {speed} {row['status']}", flush=True)
    model.forward = eager_forward
    return rows


def encoder_input(batch, args):
    """The (batch, --encoder-length) input ids every implementation generates from at this batch size."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(2, args.shape["vocab_size"], (batch, args.encoder_length), generator=generator)


def ct2_export(reference, folder):
    """FAT5's model (`reference`'s weights) exported for CTranslate2 by convert/ct2_fat5.py into folder/ct2, with a
    word-level tokenizer of one token per id ("t<id>"); returns the ids' token strings, in id order."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from convert.ct2_fat5 import main as ct2_main

    vocabulary = ["<pad>", "</s>", "<unk>"] + [f"t{i}" for i in range(3, reference.config.vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocabulary)}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder / "fat5")
    common.build_model("fat5", reference).save_pretrained(folder / "fat5")
    if ct2_main([str(folder / "fat5"), str(folder / "ct2"), "--no-verify"]) != 0:
        raise RuntimeError("convert/ct2_fat5.py could not export FAT5's model (its error line is above)")
    return vocabulary


def ct2_rows(names, reference, args, fat5_tokens):
    """One row per (CTranslate2 compute type in `names`, batch): FAT5's export generating as generate_rows' models
    do (greedy, exactly --new-tokens tokens, the same inputs), with its own cache."""
    import tempfile
    from pathlib import Path

    rows = [dict(implementation=name, cache="own", batch=batch, encoder_length=args.encoder_length,
                 new_tokens=args.new_tokens, tokens_per_s=None, ms=None, peak_mib=None, same_tokens_as_fat5=None,
                 status="ok") for name in names for batch in args.batches]
    with tempfile.TemporaryDirectory(prefix="generate_ct2_") as folder:
        try:
            import ctranslate2

            vocabulary = ct2_export(reference, Path(folder))
        except Exception as error:  # no ctranslate2, or an export it refuses: rows, not a crash
            for row in rows:
                row["status"] = common.error_status(error)
            return rows
        index = {token: i for i, token in enumerate(vocabulary)}
        for row in rows:
            try:
                translator = ctranslate2.Translator(str(Path(folder) / "ct2"), device=common.device(),
                                                    compute_type=CT2[row["implementation"]],
                                                    intra_threads=torch.get_num_threads())
                source = [[vocabulary[i] for i in ids] for ids in encoder_input(row["batch"], args).tolist()]
                options = dict(beam_size=1, max_decoding_length=args.new_tokens,
                               min_decoding_length=args.new_tokens, max_input_length=0, return_end_token=True)
                outputs = []
                ms = common.time_ms(lambda: outputs.append(translator.translate_batch(source, **options)),
                                    args.reps, args.warmup)
                with common.peak_memory() as peak:
                    translator.translate_batch(source, **options)
                row.update(ms=round(ms, 3), tokens_per_s=round(row["batch"] * args.new_tokens / ms * 1e3, 1),
                           peak_mib=peak["mib"])
                tokens = torch.tensor([[index[token] for token in result.hypotheses[0]] for result in outputs[-1]])
                if row["batch"] in fat5_tokens:
                    mismatch = token_mismatch(tokens, fat5_tokens[row["batch"]][:, 1:].cpu())
                    row["same_tokens_as_fat5"] = mismatch is None
                    row["status"] = mismatch or "ok"
            except Exception as error:  # a compute type this machine lacks: a row, not a crash
                row["status"] = common.error_status(error)
            speed = f"{row['tokens_per_s']:.0f} tok/s {row['ms']:.1f} ms peak {row['peak_mib']} MiB " \
                f"same tokens as fat5: {row['same_tokens_as_fat5']}" if timed(row) else ""
            print(f"  {row['implementation']:10s} {'own':15s} batch={row['batch']:<4d} {speed} {row['status']}",
                  flush=True)
    return rows


def timed(row):
    """Whether `row` has a speed: it ran, its tokens equal to FAT5's or not (the same number of them either way)."""
    return row["status"] == "ok" or row["status"].startswith("mismatch")


def best(rows, batch, prefix, cache=None):
    values = [r["tokens_per_s"] for r in rows if r["batch"] == batch and r["implementation"].startswith(prefix)
              and timed(r) and (cache is None or r["cache"] == cache)]
    return max(values) if values else None


def markdown(rows, args):
    ct2 = any(name in CT2 for name in args.impl)
    lines = common.markdown_head(
        "Generation",
        f"shape {args.shape}; {args.dtype} weights; encoder {args.encoder_length} tokens, {args.new_tokens} new "
        "tokens, greedy. Cells: generated tokens/s (`*`: mismatch, its tokens differ from FAT5's; the row's "
        "status in the JSON says where). Ratio: FAT5 over the best "
        "transformers T5 with the same cache; the `best` rows compare each side's best cache"
        + (" (and FAT5's best with CTranslate2's)." if ct2 else "."),
        ["batch", "cache", *args.impl, "fat5 / best T5", *(["fat5 / best ct2"] if ct2 else [])])
    for batch in args.batches:
        for cache in args.caches + (["own"] if ct2 else []):
            cells = []
            for name in args.impl:
                row = next((r for r in rows if (r["implementation"], r["cache"], r["batch"]) == (name, cache, batch)),
                           None)
                mark = "*" if row and row["status"].startswith("mismatch") else ""
                cells.append("-" if row is None else f"{row['tokens_per_s']:.4g}{mark}" if timed(row)
                             else row["status"].split(":")[0])
            speed = common.ratio(best(rows, batch, "fat5", cache), best(rows, batch, "t5_", cache))
            lines.append(f"| {batch} | {cache} | " + " | ".join(cells) + f" | {speed} |" + (" - |" if ct2 else ""))
        cells = [f"{best(rows, batch, name):.4g}" if best(rows, batch, name) else "-" for name in args.impl]
        speed = common.ratio(best(rows, batch, "fat5"), best(rows, batch, "t5_"))
        versus_ct2 = f" {common.ratio(best(rows, batch, 'fat5'), best(rows, batch, 'ct2'))} |" if ct2 else ""
        lines.append(f"| {batch} | best | " + " | ".join(cells) + f" | {speed} |" + versus_ct2)
    return "\n".join(lines) + "\n"


def plot(rows, args, path):
    plt = common.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(1, len(args.batches), figsize=(5 * len(args.batches), 4), squeeze=False)
    caches = args.caches + (["own"] if any(name in CT2 for name in args.impl) else [])
    for axis, batch in zip(axes[0], args.batches):
        for offset, name in enumerate(args.impl):
            speeds = [best(rows, batch, name, cache) or 0 for cache in caches]
            positions = [i + offset / (len(args.impl) + 1) for i in range(len(caches))]
            axis.bar(positions, speeds, width=1 / (len(args.impl) + 1), label=name)
        axis.set_xticks([i + (len(args.impl) - 1) / (2 * (len(args.impl) + 1)) for i in range(len(caches))],
                      caches)
        axis.set(ylabel="generated tokens/s", title=f"batch {batch}")
        axis.legend(fontsize=7)
    common.save_figure(figure, f"T5 generation, {common.device_name()}", path)


def build_parser():
    parser = common.argument_parser(__doc__)
    parser.add_argument("--encoder-length", type=common.positive_int, default=512, help="encoder input tokens")
    parser.add_argument("--new-tokens", type=common.positive_int, default=128,
                        help="tokens each generate call produces (min_new_tokens = max_new_tokens)")
    parser.add_argument("--batches", type=common.positive_ints, default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--impl", default=DEFAULT_IMPL,
                        help=f"implementations, comma-separated: fat5, transformers' "
                             f"{', '.join(common.T5_ATTENTION)}, CTranslate2's {', '.join(CT2)}")
    parser.add_argument("--caches", default=",".join(CACHES), help="caches, comma-separated")
    common.add_model_arguments(parser)
    parser.add_argument("--reps", type=common.positive_int, default=3, help="timed generate calls (the median is "
                                                                            "kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed generate calls before timing")
    parser.add_argument("--rounds", type=common.positive_int, default=1,
                        help="times the whole comparison runs, every other round in reverse order (FAT5 last); "
                             "each row keeps its median round, so that a shared machine's changing load does not "
                             "favour whichever implementation ran when it was lightest")
    common.add_allow_cpu_argument(parser)
    common.add_output_arguments(parser)
    return parser


def parse_args():
    parser = build_parser()
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
    unknown = [name for name in args.impl if name not in ("fat5", *common.T5_ATTENTION, *CT2)]
    unknown += [cache for cache in args.caches if cache not in CACHES]
    if unknown:
        parser.error(f"unknown --impl or --caches {unknown}; implementations: fat5, "
                     f"{', '.join(common.T5_ATTENTION)}, {', '.join(CT2)}; caches: {', '.join(CACHES)}")
    if "fat5" in args.impl:
        args.impl.remove("fat5")
        args.impl.insert(0, "fat5")  # first, so the others can be compared with its tokens
    common.require_gpu(args, "run --smoke (it checks the script), or --allow-cpu with smaller sizes")
    return args


def sweep(reference, batch, expected, args, fat5_tokens, reverse=False):
    """Rows of every implementation (fat5 first, or last when `reverse`: its tokens are then known already)."""
    steps = [name for name in args.impl if name not in CT2] + (["ct2"] if any(n in CT2 for n in args.impl) else [])
    rows = []
    for name in reversed(steps) if reverse else steps:
        if name == "ct2":
            rows += ct2_rows([name for name in args.impl if name in CT2], reference, args, fat5_tokens)
            continue
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
    return rows


def median_round(rounds):
    """Each row's median round by time (rows that did not run: the first round's), with every round's ms."""
    rows = []
    for first in rounds[0]:
        key = (first["implementation"], first["cache"], first["batch"])
        same = [row for sweep_rows in rounds for row in sweep_rows
                if (row["implementation"], row["cache"], row["batch"]) == key]
        ran = sorted((row for row in same if timed(row)), key=lambda row: row["ms"])
        rows.append(dict(ran[len(ran) // 2] if ran else first, rounds_ms=[row["ms"] for row in same]))
    return rows


def main():
    args = parse_args()
    reference, batch, expected = common.reference_and_check(args.shape)
    fat5_tokens = {}
    rounds = []
    for number in range(args.rounds):
        if args.rounds > 1:
            print(f"round {number + 1} of {args.rounds}", flush=True)
        rounds.append(sweep(reference, batch, expected, args, fat5_tokens, reverse=number % 2 == 1))
    rows = median_round(rounds)
    table = markdown(rows, args)
    settings = dict(shape=args.shape, dtype=args.dtype, encoder_length=args.encoder_length,
                    new_tokens=args.new_tokens, reps=args.reps, warmup=args.warmup, rounds=args.rounds)
    common.report("generate", rows, table, settings, args, plot)
    mismatches = [row for row in rows if row["status"].startswith("mismatch")]
    if mismatches:
        print(f"{len(mismatches)} of {len(rows)} rows generated other tokens than FAT5 (dynamic cache): "
              + "; ".join(f"{r['implementation']} {r['cache']} batch {r['batch']}: {r['status']}" for r in mismatches))


if __name__ == "__main__":
    main()
