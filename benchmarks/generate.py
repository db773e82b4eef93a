"""Generation, FAT5 against transformers' T5, side by side in one process with the same weights.

    python benchmarks/generate.py --update-results   # GPU: v1.1-base shape, bf16, encoder 512, 128 new tokens
    python benchmarks/generate.py --impl fat5,t5_sdpa --caches dynamic,graph --encoder-lengths 512,4096
    python benchmarks/generate.py --impl t5_sdpa --caches static+compile --batches 1   # a compiling peer alone
    python benchmarks/generate.py --smoke            # CPU: tiny shapes, checks the script end to end
    python benchmarks/generate.py --allow-cpu --shape d_model=256,num_heads=4,d_ff=1024,num_layers=4 --clock cpu ...
                                                     # CPU at sizes it can run (benchmarks/RESULTS.md)

Greedy decoding of exactly --new-tokens tokens (min_new_tokens = max_new_tokens) after an encoder input of each
--encoder-lengths, at each batch size. tokens/s counts generated tokens (batch x new tokens), encoder included in
the time; ms_per_token is the time of a generate call over its new tokens. Caches:
    dynamic          transformers' default DynamicCache, uncompiled
    static           cache_implementation="static", uncompiled (FAT5's captured step off)
    graph            FAT5 only: the static cache with FAT5's captured decode step (fat5/generation_fat5.py: on
                     CUDA each decode step after the first replays a CUDA graph; on CPU nothing is captured);
                     the row's captured_steps and graph_mib say what it holds
    static+compile   the static cache with the model's forward under torch.compile ("reduce-overhead" on CUDA:
                     CUDA graphs; the row's cuda_graph_skips counts the graphs Inductor did not capture)
transformers' automatic compilation is disabled so each row is what its name says. Each (implementation, cache,
encoder length, batch) starts with its own first generate call, timed on its own: first_call_s, and first_token_s,
the time from that call to its second new token (the first a decode step makes: the prefill's token is eager in
every row, the next step is where a compile or a capture happens), then the timed calls (--warmup counts the first
call). Before timing, every model's logits are compared with the eager T5's (fp32); each row also records whether
its tokens equal FAT5's (dynamic cache, eager) for the same inputs. Every row is written to the JSON lines in --out
the moment it is measured. FAT5 runs as users get it: on CUDA its decode steps run the decode kernel
(fat5/kernels/decode_attention_t5.py: a static cache's position stays on the device), on CPU SDPA.

On CPU each row also has cpu_ms, the process's CPU time per generate call (the median, as ms), which the other jobs
of a shared machine change much less than wall time; `--clock cpu` computes tokens/s and the table from it.
`--impl ...,ct2_fp32,ct2_int8` adds CTranslate2 (`pip install ctranslate2`), the engine a CPU user would pick: FAT5's
model exported by convert/ct2_fat5.py, run by `ctranslate2.Translator` with float32 or int8 compute, greedy,
exactly --new-tokens tokens, with its own cache (rows with cache "own"; the table's `best` rows compare it).
`--rounds N` runs the whole comparison N times, every other round in reverse order; the table keeps each row's
median round (every round's rows are in the JSON lines).

`--profile` times nothing: for each implementation, cache and batch, after one warm-up call (which captures or
compiles), one generate call runs under torch.profiler; `generate_profile_<device>_<date>.txt` in --out gets its
key_averages table (every op the call ran, with its count and self CPU time, by self CPU time) and a row per call
goes to the JSON lines: CUDA kernels run, kernel launches, device-to-host copies and synchronizations, and
tensor-to-Python reads (aten::_local_scalar_dense), in all and per generated token (the encoder pass included),
with the host's self CPU time. This is what explains a generation step's host time.
"""

import time

import torch

import common

CACHES = ("dynamic", "static", "graph", "static+compile")
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


def cuda_graph_skips():
    """How many compiled graphs Inductor has run without capturing a CUDA graph so far (None if torch lacks the
    counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["inductor"]["cudagraph_skips"]


class TokenTimes:
    """A generate() streamer (transformers' BaseStreamer interface) that records when each put arrives: the decoder
    start, then every new token, each copied to the host by generate, so its time is when the token exists."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def first_call(model, options):
    """(first_token_s, first_call_s, tokens) of a bucket's first generate call: seconds from the call to its second
    new token (the first a decode step makes, the step that compiles or captures), and to its end."""
    streamer = TokenTimes()
    common.synchronize()
    started = time.perf_counter()
    tokens = model.generate(**options, streamer=streamer)
    common.synchronize()
    ended = time.perf_counter()
    second = streamer.times[2] - started if len(streamer.times) > 2 else None
    return (None if second is None else round(second, 3)), round(ended - started, 3), tokens


def caches_of(name, args):
    """The caches `name` runs: the captured step ("graph") is FAT5's own."""
    return [cache for cache in args.caches if cache != "graph" or name == "fat5"]


def new_row(name, cache, batch, encoder_length, args, status, round_):
    return dict(implementation=name, cache=cache, batch=batch, encoder_length=encoder_length,
                new_tokens=args.new_tokens, tokens_per_s=None, ms=None, ms_per_token=None, cpu_ms=None, peak_mib=None,
                first_token_s=None, first_call_s=None, same_tokens_as_fat5=None, cuda_graph_skips=None,
                captured_steps=None, graph_mib=None, status=status, round=round_)


def generate_rows(name, model, args, fat5_tokens, rows, status, round_=0):
    """Append to `rows` one row per (cache, encoder length, batch): generated tokens/s, ms per generate call and per
    new token, the first call's times, peak MiB, agreement with FAT5's tokens, status."""
    device = common.device()
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    eager_forward = model.forward
    graphs = getattr(model.config, "decode_cuda_graphs", None)
    for cache in caches_of(name, args):
        if cache == "static+compile":
            mode = "reduce-overhead" if device == "cuda" else None
            model.forward = torch.compile(eager_forward, mode=mode, dynamic=False)
        if graphs is not None:  # FAT5: its captured step in the "graph" rows only
            model.config.decode_cuda_graphs = max(graphs, 1) if cache == "graph" else 0
        for encoder_length in args.encoder_lengths:
            for batch in args.batches:
                options = generate_options(batch, encoder_length, cache, args, device)
                row = new_row(name, cache, batch, encoder_length, args, status, round_)
                skips = cuda_graph_skips()
                try:
                    outputs, cpu = [], []

                    def call():
                        started = time.process_time()
                        outputs.append(model.generate(**options))
                        cpu.append(time.process_time() - started)

                    with torch.no_grad(), common.peak_memory() as peak:
                        first_token_s, first_call_s, tokens = first_call(model, options)
                        ms = common.time_ms(call, args.reps, max(args.warmup - 1, 0), args.max_seconds)
                    if device == "cpu":
                        row["cpu_ms"] = round(sorted(cpu)[len(cpu) // 2] * 1e3, 3)
                    clock = row["cpu_ms"] if args.clock == "cpu" and row["cpu_ms"] else ms
                    row.update(ms=round(ms, 3), tokens_per_s=round(batch * args.new_tokens / clock * 1e3, 1),
                               ms_per_token=round(clock / args.new_tokens, 3), peak_mib=peak["mib"],
                               first_token_s=first_token_s, first_call_s=first_call_s)
                    if cache == "static+compile" and device == "cuda" and skips is not None:
                        row["cuda_graph_skips"] = cuda_graph_skips() - skips
                    if cache == "graph":
                        steps = model.captured_decode_steps()
                        row.update(captured_steps=len(steps), graph_mib=round(sum(
                            step["cache_mib"] + step["pool_mib"] for step in steps), 1))
                    tokens = outputs[-1] if outputs else tokens
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
                speed = f"{row['tokens_per_s']:.0f} tok/s {row['ms_per_token']:.2f} ms/token first token " \
                    f"{row['first_token_s']} s peak {row['peak_mib']} MiB same tokens as fat5: " \
                    f"{row['same_tokens_as_fat5']}" if timed(row) else ""
                print(f"  {name:10s} {cache:15s} encoder={encoder_length:<5d} batch={batch:<4d} {speed} "
                      f"{row['status']}", flush=True)
    model.forward = eager_forward
    if graphs is not None:
        model.config.decode_cuda_graphs = graphs
        model.release_decode_steps()


SYNCHRONIZATIONS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
                    "cuCtxSynchronize", "cuEventSynchronize")


def profile_counts(events, new_tokens):
    """What one profiled generate call did, from its profiler events: kernels, launches, syncs, copies to the host,
    tensor-to-Python reads, in all and per new token."""
    from torch.autograd import DeviceType

    device = [event for event in events if event.device_type == DeviceType.CUDA]
    host = [event for event in events if event.device_type != DeviceType.CUDA]
    counts = dict(
        kernels=sum(not event.name.startswith(("Memcpy", "Memset")) for event in device),
        launches=sum("LaunchKernel" in event.name for event in host),
        synchronizations=sum(event.name in SYNCHRONIZATIONS for event in host),
        device_to_host_copies=sum(event.name.startswith("Memcpy DtoH") for event in device),
        local_scalar_dense=sum(event.name == "aten::_local_scalar_dense" for event in host))
    return dict(counts, **{f"{key}_per_token": round(value / new_tokens, 2) for key, value in counts.items()})


def profile_rows(name, model, args, rows, report):
    """Append to `rows` one row per (encoder length, cache, batch): one generate call under torch.profiler after a
    warm-up call; `report(text)` gets its key_averages table."""
    from torch.profiler import ProfilerActivity, profile

    device = common.device()
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    graphs = getattr(model.config, "decode_cuda_graphs", None)
    for cache in caches_of(name, args):
        if graphs is not None:
            model.config.decode_cuda_graphs = max(graphs, 1) if cache == "graph" else 0
        for encoder_length in args.encoder_lengths:
            for batch in args.batches:
                options = generate_options(batch, encoder_length, cache, args, device)
                row = dict(implementation=name, cache=cache, batch=batch, encoder_length=encoder_length,
                           new_tokens=args.new_tokens, status="ok")
                try:
                    with torch.no_grad():
                        model.generate(**options)  # captures what captures
                        common.synchronize()
                        with profile(activities=activities) as profiler:
                            model.generate(**options)
                            common.synchronize()
                    averages = profiler.key_averages()
                    row.update(profile_counts(profiler.events(), args.new_tokens),
                               self_cpu_ms=round(sum(event.self_cpu_time_total for event in averages) / 1e3, 1),
                               top=[(event.key, round(event.self_cpu_time_total / 1e3, 2), event.count) for event in
                                    sorted(averages, key=lambda event: -event.self_cpu_time_total)[:10]])
                    report(f"## {name}, {cache} cache, batch {batch}, encoder {encoder_length}, {args.new_tokens} new "
                           f"tokens\n\n" + "\n".join(f"{key}: {row[key]}" for key in row if key.endswith(
                               ("_per_token", "self_cpu_ms"))) + "\n\n"
                           + averages.table(sort_by="self_cpu_time_total", row_limit=-1) + "\n")
                except Exception as error:  # a cache or peer that cannot run here: a row, not a crash
                    row["status"] = common.error_status(error)
                rows.append(row)
                common.release_memory()
                counts = " ".join(f"{key[:-10]} {row[key]}" for key in row if key.endswith("_per_token"))
                print(f"  {name:10s} {cache:15s} encoder={encoder_length:<5d} batch={batch:<4d} per token: {counts} "
                      f"{row['status']}", flush=True)
    if graphs is not None:
        model.config.decode_cuda_graphs = graphs
        model.release_decode_steps()


def generate_options(batch, encoder_length, cache, args, device):
    """generate()'s arguments for one row: a random unpadded encoder input, greedy, exactly --new-tokens tokens."""
    input_ids = encoder_input(batch, encoder_length, args).to(device)
    options = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                   max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, disable_compile=True)
    if cache != "dynamic":
        options["cache_implementation"] = "static"
    return options


def encoder_input(batch, length, args):
    """The (batch, length) input ids every implementation generates from at this batch size and length."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(2, args.shape["vocab_size"], (batch, length), generator=generator)


def ct2_export(reference, folder):
    """FAT5's model (`reference`'s weights) exported for CTranslate2 by convert/ct2_fat5.py into folder/ct2, with a
    word-level tokenizer of one token per id ("t<id>"); returns the ids' token strings, in id order."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from fat5.convert.ct2_fat5 import main as ct2_main

    vocabulary = ["<pad>", "</s>", "<unk>"] + [f"t{i}" for i in range(3, reference.config.vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocabulary)}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder / "fat5")
    common.build_model("fat5", reference).save_pretrained(folder / "fat5")
    if ct2_main([str(folder / "fat5"), str(folder / "ct2"), "--no-verify"]) != 0:
        raise RuntimeError("convert/ct2_fat5.py could not export FAT5's model (its error line is above)")
    return vocabulary


def ct2_rows(names, reference, args, fat5_tokens, rows, round_=0):
    """Append to `rows` one row per (CTranslate2 compute type in `names`, encoder length, batch): FAT5's export
    generating as generate_rows' models do (greedy, exactly --new-tokens tokens, the same inputs), its own cache."""
    import tempfile
    from pathlib import Path

    pending = [new_row(name, "own", batch, length, args, "ok", round_)
               for name in names for length in args.encoder_lengths for batch in args.batches]
    with tempfile.TemporaryDirectory(prefix="generate_ct2_") as folder:
        try:
            import ctranslate2

            vocabulary = ct2_export(reference, Path(folder))
        except Exception as error:  # no ctranslate2, or an export it refuses: rows, not a crash
            rows.extend({**row, "status": common.error_status(error)} for row in pending)
            return
        index = {token: i for i, token in enumerate(vocabulary)}
        for row in pending:
            batch, length = row["batch"], row["encoder_length"]
            try:
                translator = ctranslate2.Translator(str(Path(folder) / "ct2"), device=common.device(),
                                                    compute_type=CT2[row["implementation"]],
                                                    intra_threads=torch.get_num_threads())
                source = [[vocabulary[i] for i in ids] for ids in encoder_input(batch, length, args).tolist()]
                options = dict(beam_size=1, max_decoding_length=args.new_tokens,
                               min_decoding_length=args.new_tokens, max_input_length=0, return_end_token=True)
                outputs = []
                with common.peak_memory() as peak:
                    ms = common.time_ms(lambda: outputs.append(translator.translate_batch(source, **options)),
                                        args.reps, args.warmup, args.max_seconds)
                row.update(ms=round(ms, 3), tokens_per_s=round(batch * args.new_tokens / ms * 1e3, 1),
                           ms_per_token=round(ms / args.new_tokens, 3), peak_mib=peak["mib"])
                tokens = torch.tensor([[index[token] for token in result.hypotheses[0]] for result in outputs[-1]])
                if (length, batch) in fat5_tokens:
                    mismatch = token_mismatch(tokens, fat5_tokens[(length, batch)][:, 1:].cpu())
                    row["same_tokens_as_fat5"] = mismatch is None
                    row["status"] = mismatch or "ok"
            except Exception as error:  # a compute type this machine lacks: a row, not a crash
                row["status"] = common.error_status(error)
            rows.append(row)
            speed = f"{row['tokens_per_s']:.0f} tok/s {row['ms_per_token']:.2f} ms/token peak {row['peak_mib']} " \
                f"MiB same tokens as fat5: {row['same_tokens_as_fat5']}" if timed(row) else ""
            print(f"  {row['implementation']:10s} {'own':15s} encoder={length:<5d} batch={batch:<4d} {speed} "
                  f"{row['status']}", flush=True)


def timed(row):
    """Whether `row` has a speed: it ran, its tokens equal to FAT5's or not (the same number of them either way)."""
    return row["status"] == "ok" or row["status"].startswith("mismatch")


def best(rows, batch, prefix, cache=None, encoder_length=None):
    values = [r["tokens_per_s"] for r in rows if r["batch"] == batch and r["implementation"].startswith(prefix)
              and timed(r) and cache in (None, r["cache"]) and encoder_length in (None, r["encoder_length"])]
    return max(values) if values else None


def speed_cell(row):
    """tokens/s, `*` when its tokens differ from FAT5's, then (first_token_s) when measured."""
    mark = "*" if row["status"].startswith("mismatch") else ""
    first = f" ({row['first_token_s']:.3g} s)" if row.get("first_token_s") is not None else ""
    return f"{row['tokens_per_s']:.4g}{mark}{first}"


def markdown(rows, args):
    ct2 = any(name in CT2 for name in args.impl)
    clock = " from the process's CPU time" if args.clock == "cpu" else ""
    lines = common.markdown_head(
        "Generation",
        f"shape {args.shape}; {args.dtype} weights; {args.new_tokens} new tokens, greedy. Cells: generated "
        f"tokens/s{clock} (`*`: mismatch, its tokens differ from FAT5's; the row's status in the JSON says where), "
        "then in brackets first_token_s, the seconds from the first call to its second token (a capture or a compile "
        "included). Ratio: FAT5 over the best transformers T5 with the same cache; the `best` rows compare each "
        "side's best cache" + (" (and FAT5's best with CTranslate2's)." if ct2 else "."),
        ["encoder", "batch", "cache", *args.impl, "fat5 / best T5", *(["fat5 / best ct2"] if ct2 else [])])
    for length in args.encoder_lengths:
        for batch in args.batches:
            for cache in args.caches + (["own"] if ct2 else []):
                cells = []
                for name in args.impl:
                    row = next((r for r in rows if (r["implementation"], r["cache"], r["batch"], r["encoder_length"])
                                == (name, cache, batch, length)), None)
                    cells.append("-" if row is None else speed_cell(row) if timed(row) else row["status"].split(":")[0])
                speed = common.ratio(best(rows, batch, "fat5", cache, length), best(rows, batch, "t5_", cache, length))
                lines.append(f"| {length} | {batch} | {cache} | " + " | ".join(cells) + f" | {speed} |"
                             + (" - |" if ct2 else ""))
            bests = [best(rows, batch, name, encoder_length=length) for name in args.impl]
            speed = common.ratio(best(rows, batch, "fat5", None, length), best(rows, batch, "t5_", None, length))
            ours, theirs = best(rows, batch, "fat5", None, length), best(rows, batch, "ct2", None, length)
            versus_ct2 = f" {common.ratio(ours, theirs)} |" if ct2 else ""
            lines.append(f"| {length} | {batch} | best | " + " | ".join(f"{b:.4g}" if b else "-" for b in bests)
                         + f" | {speed} |" + versus_ct2)
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
    parser.add_argument("--encoder-lengths", type=common.positive_ints, default="512",
                        help="encoder input tokens, comma-separated")
    parser.add_argument("--new-tokens", type=common.positive_int, default=128,
                        help="tokens each generate call produces (min_new_tokens = max_new_tokens)")
    parser.add_argument("--batches", type=common.positive_ints, default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--impl", default=DEFAULT_IMPL,
                        help=f"implementations, comma-separated: fat5, transformers' "
                             f"{', '.join(common.T5_ATTENTION)}, CTranslate2's {', '.join(CT2)}")
    parser.add_argument("--caches", default=",".join(CACHES), help="caches, comma-separated")
    common.add_model_arguments(parser)
    common.add_timing_arguments(parser, reps=3, warmup=1, seconds=20.0)
    parser.add_argument("--rounds", type=common.positive_int, default=1,
                        help="times the whole comparison runs, every other round in reverse order (FAT5 last); "
                             "the table keeps each row's median round, so that a shared machine's changing load "
                             "does not favour whichever implementation ran when it was lightest")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="what tokens/s and the table are computed from: wall time, or (CPU only) the process's "
                             "CPU time, which the other jobs of a shared machine change much less")
    parser.add_argument("--profile", action="store_true",
                        help="time nothing: profile one generate call of each implementation, cache and batch "
                             "(torch.profiler: the top ops by self CPU time, kernel launches and syncs per token)")
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
            args.caches = "dynamic,static,graph"
    args.shape = common.parse_shape(args.shape, base)
    args.impl = [name.strip() for name in args.impl.split(",")]
    args.caches = [cache.strip() for cache in args.caches.split(",")]
    unknown = [name for name in args.impl if name not in ("fat5", *common.T5_ATTENTION, *CT2)]
    unknown += [cache for cache in args.caches if cache not in CACHES]
    if unknown:
        parser.error(f"unknown --impl or --caches {unknown}; implementations: fat5, "
                     f"{', '.join(common.T5_ATTENTION)}, {', '.join(CT2)}; caches: {', '.join(CACHES)}")
    if args.profile and "static+compile" in args.caches:
        parser.error("--profile profiles generation without torch.compile: --caches dynamic, static and/or graph")
    if "fat5" in args.impl:
        args.impl.remove("fat5")
        args.impl.insert(0, "fat5")  # first, so the others can be compared with its tokens
    common.require_gpu(args, "run --smoke (it checks the script), or --allow-cpu with smaller sizes")
    return args


def sweep(reference, batch, expected, args, fat5_tokens, rows, round_=0):
    """Append the rows of every implementation (fat5 first, or last in odd rounds: its tokens are known then)."""
    steps = [name for name in args.impl if name not in CT2] + (["ct2"] if any(n in CT2 for n in args.impl) else [])
    for name in reversed(steps) if round_ % 2 else steps:
        if name == "ct2":
            ct2_rows([name for name in args.impl if name in CT2], reference, args, fat5_tokens, rows, round_)
            continue
        model, status = common.checked_model(name, reference, batch, expected, args.dtype)
        if model is not None:
            generate_rows(name, model, args, fat5_tokens, rows, status, round_)
        else:
            rows.extend(new_row(name, cache, size, length, args, status, round_) for cache in caches_of(name, args)
                        for length in args.encoder_lengths for size in args.batches)
        del model
        common.release_memory()


def median_round(rows, clock="wall"):
    """Each (implementation, cache, batch, encoder length)'s row of its median round by time (`clock` "cpu": by CPU
    time where rows have it; one that did not run: its first round's), with every round's ms (and cpu_ms)."""
    groups = {}
    for row in rows:
        groups.setdefault((row["implementation"], row["cache"], row["batch"], row["encoder_length"]), []).append(row)
    summary = []
    for same in groups.values():
        ran = sorted((row for row in same if timed(row)),
                     key=lambda row: row["cpu_ms"] if clock == "cpu" and row.get("cpu_ms") else row["ms"])
        rounds = dict(rounds_ms=[row["ms"] for row in same])
        if any(row.get("cpu_ms") for row in same):
            rounds["rounds_cpu_ms"] = [row.get("cpu_ms") for row in same]
        summary.append(dict(ran[len(ran) // 2] if ran else same[0], **rounds))
    return summary


def profile_main(args):
    """--profile: a row and a key_averages table per implementation, cache and batch (no timing, no ct2)."""
    settings = dict(shape=args.shape, dtype=args.dtype, new_tokens=args.new_tokens)
    rows = common.Rows("generate_profile", settings, args.out)
    text = rows.path.with_suffix(".txt")
    text.write_text(f"# generate.py --profile: {common.header()}\n\n")

    def report(section):
        with open(text, "a") as file:
            file.write(section + "\n")

    reference, batch, expected = common.reference_and_check(args.shape, args.dtype)
    for name in (name for name in args.impl if name not in CT2):
        model, status = common.checked_model(name, reference, batch, expected, args.dtype)
        if model is None:
            rows.append(dict(implementation=name, status=status))
            continue
        profile_rows(name, model, args, rows, report)
        del model
        common.release_memory()
    print(f"profiles: {text}", flush=True)


def main():
    args = parse_args()
    if args.profile:
        profile_main(args)
        return
    settings = dict(shape=args.shape, dtype=args.dtype, new_tokens=args.new_tokens, reps=args.reps,
                    warmup=args.warmup, max_seconds=args.max_seconds, rounds=args.rounds)
    rows, fat5_tokens = common.Rows("generate", settings, args.out), {}
    reference, batch, expected = common.reference_and_check(args.shape, args.dtype)
    for number in range(args.rounds):
        if args.rounds > 1:
            print(f"round {number + 1} of {args.rounds}", flush=True)
        sweep(reference, batch, expected, args, fat5_tokens, rows, number)
    summary = median_round(rows, args.clock) if args.rounds > 1 else rows
    common.report(rows, markdown(summary, args), args, lambda _, options, path: plot(summary, options, path))
    mismatches = [row for row in summary if row["status"].startswith("mismatch")]
    if mismatches:
        print(f"{len(mismatches)} of {len(summary)} rows generated other tokens than FAT5 (dynamic cache): "
              + "; ".join(f"{r['implementation']} {r['cache']} encoder {r['encoder_length']} batch {r['batch']}: "
                          f"{r['status']}" for r in mismatches))


if __name__ == "__main__":
    main()
