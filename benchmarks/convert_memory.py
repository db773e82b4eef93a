"""Peak memory of `python -m convert.flan_to_fat5` on a sharded checkpoint of at least 1 GB, against its bounds.

    python benchmarks/convert_memory.py [--gb 1.2] [--shard-size 300MB]

Builds a random FLAN-T5-style checkpoint (untied head, gated-GELU) in a temporary folder, converts it in a
fresh process without and with verification, and reads each process's peak resident set size
(getrusage RUSAGE_CHILDREN of a wrapper process). Bounds: unverified <= largest shard + 1 GB; verified <=
1.25 x model + 1 GB. Nothing is kept on disk.
"""

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

import common

REPO = Path(__file__).resolve().parent.parent
GB = 10**9
# Runs one command and prints its peak RSS in bytes (ru_maxrss is in KiB on Linux).
MEASURE = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)")


def init_std(name, config):
    """T5's initialisation scales (as transformers' T5 uses), so the random model's logits stay well conditioned
    and the parity check compares like with like."""
    if name == "shared.weight":
        return 1.0
    if name.endswith(".q.weight"):
        return (config.d_model * config.d_kv) ** -0.5
    if name.endswith(".o.weight"):
        return (config.num_heads * config.d_kv) ** -0.5
    if name.endswith("wo.weight"):
        return config.d_ff**-0.5
    return config.d_model**-0.5


def build_checkpoint(folder, target_bytes, shard_bytes):
    """A random T5 checkpoint of about `target_bytes` (fp32), in shards of at most `shard_bytes`."""
    d_model, d_ff, vocab = 1024, 2816, 32128
    per_layer = 4 * (12 * d_model * d_model + 6 * d_model * d_ff)  # an encoder and a decoder block, fp32
    layers = max(1, round((target_bytes - 2 * 4 * vocab * d_model) / per_layer))
    config = transformers.T5Config(vocab_size=vocab, d_model=d_model, d_kv=64, d_ff=d_ff, num_layers=layers,
                                   num_heads=16, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                   decoder_start_token_id=0)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    names = {name: tuple(t.shape) for name, t in model.state_dict().items()
             if name not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
    names["lm_head.weight"] = (vocab, d_model)
    shards, current, size = [], {}, 0
    generator = torch.Generator().manual_seed(0)
    for name, shape in names.items():
        tensor = torch.randn(shape, generator=generator) * init_std(name, config) if len(shape) > 1 \
            else torch.ones(shape)
        if current and size + tensor.numel() * 4 > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += tensor.numel() * 4
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map, total, largest = {}, 0, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        largest = max(largest, (folder / file).stat().st_size)
        total += (folder / file).stat().st_size
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    config.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(tie_word_embeddings=False, transformers_version="4.57.6")  # a FLAN-T5 as the Hub has it
    saved.pop("scale_decoder_outputs", None)
    (folder / "config.json").write_text(json.dumps(saved))
    return total, largest, len(shards)


def peak_rss(args, cwd):
    result = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "convert.flan_to_fat5", *args],
                            cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"conversion failed: {result.stderr.strip().splitlines()[-1]}")
    return int(result.stdout.strip().splitlines()[-1])


def main():
    parser = common.argument_parser(__doc__)
    parser.add_argument("--gb", type=float, default=1.2, help="model size in GB (fp32), at least 1")
    parser.add_argument("--shard-size", default="300MB", help="source shard size, in MB")
    args = parser.parse_args()
    shard_bytes = int(float(args.shard_size.upper().removesuffix("MB")) * 10**6)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "src").mkdir()
        total, largest, count = build_checkpoint(scratch / "src", int(args.gb * GB), shard_bytes)
        print(f"checkpoint: {total / GB:.2f} GB in {count} shards, largest {largest / GB:.3f} GB")
        print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
              f"torch {torch.__version__}, transformers {transformers.__version__}")
        for label, extra, bound in (("unverified", ["--no-verify"], largest + GB),
                                    ("verified", [], 1.25 * total + GB)):
            peak = peak_rss([str(scratch / "src"), str(scratch / label), *extra], REPO)
            verdict = "within" if peak <= bound else "ABOVE"
            print(f"{label:>10}: peak RSS {peak / GB:.2f} GB ({peak / total:.2f} x model), bound {bound / GB:.2f} GB "
                  f"-> {verdict}")


if __name__ == "__main__":
    main()
