"""Fine-tuning on packed rows against the same run padded: FAT5 (T5-base shape) training on the same examples,
one a row padded to the batch's longest (what transformers' DataCollatorForSeq2Seq gives) or packed into rows with
segment ids (the recipes' --packing: fat5.training.packing.PackedSeq2SeqCollator).

    python benchmarks/packed_step.py            # GPU: v1.1-base shape, bf16 autocast
    python benchmarks/packed_step.py --smoke    # CPU: tiny shapes, checks the script end to end

The length mix (documented, not a dataset's): inputs lognormal with median 180 tokens and sigma 0.7, cut to 8..512;
targets lognormal with median 40 and sigma 0.7, cut to 2..128 (summaries and answers of a fine-tuning set, whose
examples often fill 40-60% of a 512-token cap). Each step trains on --examples examples (forward, backward, AdamW);
both runs see the same batches. The figure is useful (real, non-padding) target tokens per second; rows also give
real input + target tokens per second and the padding share.
"""

import math
import random

import torch

import common
from fat5.training.packing import PackedSeq2SeqCollator

MIX = dict(input_median=180, input_sigma=0.7, input_range=(8, 512), target_median=40, target_sigma=0.7,
           target_range=(2, 128))


def lengths(rng, median, sigma, bounds):
    return min(max(round(rng.lognormvariate(math.log(median), sigma)), bounds[0]), bounds[1])


def examples(count, vocab_size, mix, seed):
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(2, vocab_size) for _ in range(lengths(rng, mix["input_median"],
                                                                                 mix["input_sigma"],
                                                                                 mix["input_range"]) - 1)] + [1],
             "labels": [rng.randrange(2, vocab_size) for _ in range(lengths(rng, mix["target_median"],
                                                                          mix["target_sigma"],
                                                                          mix["target_range"]) - 1)] + [1]}
            for _ in range(count)]


def padded(batch):
    """One example a row, padded to the batch's longest (a multiple of 8), labels -100 on padding."""
    def pad(rows, value, multiple=8):
        width = -(-max(len(row) for row in rows) // multiple) * multiple
        return torch.tensor([row + [value] * (width - len(row)) for row in rows])

    input_ids = pad([example["input_ids"] for example in batch], 0)
    labels = pad([example["labels"] for example in batch], -100)
    return dict(input_ids=input_ids, attention_mask=(input_ids != 0).long(), labels=labels)


def run(name, model, batches, args, rows):
    device = common.device()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")

    def step(batch):
        with common.autocast(args.dtype):
            loss = model(**{key: value.to(device) for key, value in batch.items()}).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[:args.warmup]:
        step(batch)
    seconds = common.time_ms(lambda: [step(batch) for batch in batches[args.warmup:]], 1, 0) / 1e3
    timed = batches[args.warmup:]
    target = sum(int((batch["labels"] != -100).sum()) for batch in timed)
    real = target + sum(int(batch["attention_mask"].sum()) for batch in timed)
    total = sum(batch["labels"].numel() + batch["input_ids"].numel() for batch in timed)
    rows.append(dict(implementation=name, steps=len(timed), examples=args.examples,
                     target_tokens_per_s=round(target / seconds, 1), tokens_per_s=round(real / seconds, 1),
                     padding=round(1 - real / total, 4), rows_per_step=round(sum(len(b["input_ids"]) for b in timed)
                                                                             / len(timed), 1), status="ok"))
    row = rows[-1]
    print(f"  {name:12s} {row['target_tokens_per_s']:.0f} target tok/s, {row['tokens_per_s']:.0f} tok/s, padding "
          f"{row['padding']:.0%}, {row['rows_per_step']} rows a step", flush=True)


def main():
    parser = common.argument_parser(__doc__, model="autocast dtype (default: bfloat16 on CUDA, float32 on CPU)",
                                    allow_cpu=True, report=True)
    parser.add_argument("--examples", type=common.positive_int, default=64, help="examples a step")
    parser.add_argument("--steps", type=common.positive_int, default=12, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles and allocates)")
    args = parser.parse_args()
    mix = dict(MIX)
    base = common.V11_BASE
    if args.smoke:
        base, args.examples, args.steps, args.warmup, args.dtype = common.SMOKE_SHAPE, 8, 2, 1, "float32"
        mix.update(input_median=12, input_range=(2, 32), target_median=4, target_range=(2, 8))
    shape = common.parse_shape(args.shape, base)
    common.require_gpu(args, "run --smoke (it checks the script), or --allow-cpu with smaller sizes")
    print(common.header(), flush=True)
    data = examples(args.examples * (args.steps + args.warmup), shape["vocab_size"], mix, seed=0)
    chunks = [data[i:i + args.examples] for i in range(0, len(data), args.examples)]
    packer = PackedSeq2SeqCollator(0, 0, mix["input_range"][1], mix["target_range"][1], pad_to_multiple_of=8)
    rows = common.Rows("packed_step", dict(shape=shape, dtype=args.dtype, mix=mix, examples=args.examples,
                                           steps=args.steps), args.out)
    reference = common.t5_reference(shape)
    for name, collate in (("fat5 padded", padded), ("fat5 packed", packer)):
        model = common.build_model("fat5", reference).to(common.device()).train()
        run(name, model, [collate(chunk) for chunk in chunks], args, rows)
        del model
        common.release_memory()
    ratio = common.ratio(rows[1]["target_tokens_per_s"], rows[0]["target_tokens_per_s"])
    table = "\n".join(common.markdown_head(
        "Packed fine-tuning against padded",
        f"FAT5, shape {shape}, {args.dtype}; {args.examples} examples a step, lengths: {mix}. Useful target tokens/s "
        "(real ones), all real tokens/s, padding share, rows a step.",
        ["run", "target tokens/s", "tokens/s", "padding", "rows a step"]) + [
        f"| {row['implementation']} | {row['target_tokens_per_s']} | {row['tokens_per_s']} | {row['padding']:.0%} | "
        f"{row['rows_per_step']} |" for row in rows] + [f"\npacked / padded (useful target tokens/s): {ratio}"]) + "\n"
    common.report(rows, table, args)


if __name__ == "__main__":
    main()
