"""`fat5 pretrain`'s own training loop on the seed's configuration: the French FAT5-small that catie-aq/flashT5
pretrained with UL2 on one A100 at 79.7k tokens/s (419.4B tokens in 1,461 hours).

    python benchmarks/pretrain_seed.py            # GPU: the seed's shape, bf16, 512 input + 512 target tokens
    python benchmarks/pretrain_seed.py --smoke    # CPU: tiny shape, checks the script end to end

The seed's configuration (its configs/fr/fat5-fr-small.yaml): d_model 512, d_ff 2048 gated GELU, 8 heads of 64,
6 + 6 layers, a vocabulary of 32,768, examples of 512 input and 512 target tokens. The vocabulary here is a made-up
word-level tokenizer of exactly that size over a made-up corpus (no download; a T5 sentencepiece tokenizer costs the
loop nothing more), and the corpus is streamed, denoised with FAT5's UL2 mixture and packed by the command itself.
tokens/s is the command's own `tokens_per_second` (real input plus target tokens, padding excluded) after the first
log interval (which holds the compile of the first shapes); MFU counts each real token's share of a step's model
FLOPs (common.step_flops of one 512 + 512 example over 1,024 tokens).
"""

import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

SEED_SHAPE = dict(d_model=512, d_kv=64, d_ff=2048, num_heads=8, num_layers=6, num_decoder_layers=6,
                  feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False)
SEED_VOCABULARY = 32768
SEED_TOKENS_PER_S = 79700  # on one A100 (its README: 419.4B tokens in 1,461 hours)
# What fat5 pretrain adds to a tokenizer: T5's 100 sentinels and UL2's 3 mode tokens; the tokenizer's own specials.
ADDED, SPECIALS = 103, ("<pad>", "</s>", "<unk>")


def write_tokenizer(folder, vocabulary):
    """A word-level fast tokenizer whose length, once fat5 pretrain has added its sentinels and mode tokens, is
    `vocabulary` (so the model's vocabulary is exactly that)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{index}" for index in range(vocabulary - ADDED - len(SPECIALS))]
    table = {token: index for index, token in enumerate([*SPECIALS, *words])}
    tokenizer = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return words


def write_corpus(path, words, documents, seed=0):
    """`documents` lines of 200 to 2,000 words drawn from `words` (Zipf-like: a few words common, most rare)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 10) for rank in range(len(words))]
    with open(path, "w") as file:
        for _ in range(documents):
            file.write(" ".join(rng.choices(words, weights, k=rng.randint(200, 2000))) + "\n")


def run(args, folder):
    shape = dict(SEED_SHAPE)
    vocabulary, length, documents = SEED_VOCABULARY, 512, 3000
    if args.smoke:
        shape.update(d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, num_decoder_layers=2)
        vocabulary, length, documents = 384, 32, 200
    words = write_tokenizer(folder / "tokenizer", vocabulary)
    write_corpus(folder / "corpus.txt", words, documents)
    (folder / "config.json").write_text(json.dumps(shape))
    command = [sys.executable, "-m", "fat5.training.pretrain", "--config", folder / "config.json", "--tokenizer",
               folder / "tokenizer", "--train_files", folder / "corpus.txt", "--output_dir", folder / "run",
               "--max_input_length", length, "--max_target_length", length, "--per_device_train_batch_size",
               args.batch, "--max_steps", args.steps, "--logging_steps", args.logging_steps, "--save_steps",
               args.steps, "--disable_tqdm", "true", "--report_to", "none", "--dataloader_num_workers", args.workers]
    if not args.smoke:
        command += ["--bf16", "true"]
    process = subprocess.run([str(part) for part in command], cwd=common.ROOT, capture_output=True, text=True)
    if process.returncode != 0:
        return None, shape, vocabulary, length, f"error: {process.stderr.strip().splitlines()[-1][:300]}"
    state = json.loads((folder / "run" / f"checkpoint-{args.steps}" / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "tokens_per_second" in entry]
    return logs, shape, vocabulary, length, "ok"


def main():
    parser = common.argument_parser(__doc__, report=True)
    parser.add_argument("--batch", type=common.positive_int, default=64,
                        help="examples a step (--per_device_train_batch_size: packed into rows by the command)")
    parser.add_argument("--steps", type=common.positive_int, default=60, help="training steps")
    parser.add_argument("--logging-steps", type=common.positive_int, default=10, help="steps a log interval")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (--dataloader_num_workers)")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps, args.logging_steps, args.workers = 4, 4, 2, 0
    common.require_gpu(args)
    rows = common.Rows("pretrain_seed", {"batch": args.batch, "steps": args.steps}, args.out)
    with tempfile.TemporaryDirectory() as folder:
        logs, shape, vocabulary, length, status = run(args, Path(folder))
    steady = [entry["tokens_per_second"] for entry in (logs or [])[1:]] or \
        [entry["tokens_per_second"] for entry in logs or []]
    tokens_per_s = round(statistics.median(steady), 1) if steady else None
    flops_per_token = common.step_flops({**shape, "vocab_size": vocabulary}, 1, length, length) / (2 * length)
    rows.append(dict(implementation="fat5 pretrain", shape=shape, vocabulary=vocabulary, input_length=length,
                     target_length=length, batch=args.batch, steps=args.steps, tokens_per_s=tokens_per_s,
                     mfu=common.mfu(flops_per_token * tokens_per_s, 1e3) if tokens_per_s else None,
                     padding_fraction=logs[-1].get("padding_fraction") if logs else None,
                     seed_ratio=round(tokens_per_s / SEED_TOKENS_PER_S, 2) if tokens_per_s else None, status=status))
    row = rows[-1]
    table = "\n".join(common.markdown_head(
        "Pretraining, the seed's configuration",
        f"`fat5 pretrain` (UL2 mixture, packed rows, bf16) on the seed's shape ({shape['d_model']} wide, "
        f"{shape['num_layers']} + {shape['num_decoder_layers']} layers, vocabulary {vocabulary:,}), {length} + "
        f"{length} tokens an example, {args.batch} examples a step. tokens/s: real input + target tokens after the "
        f"first log interval; the seed: {SEED_TOKENS_PER_S:,} on one A100.",
        ["tokens/s", "MFU", "padding", "over the seed's", "status"]) + [
        f"| {row['tokens_per_s']} | {row['mfu']} | {row['padding_fraction']} | {row['seed_ratio']}x | "
        f"{row['status']} |"]) + "\n"
    common.report(rows, table, args)


if __name__ == "__main__":
    main()
