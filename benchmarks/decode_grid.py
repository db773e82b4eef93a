#!/usr/bin/env python3
"""Static readings of the decode kernel (fat5/kernels/decode_attention_t5.py), on a machine WITHOUT a GPU.

    python benchmarks/decode_grid.py                     # both readings, for an H100 (132 SMs, sm_90a)
    python benchmarks/decode_grid.py --sms 108 --arch 80  # an A100
    python benchmarks/decode_grid.py --arch 80 86 89 90 100 --no-grid

1. Programs per decode step: the grid `decode_grid` gives one decode call at batch 1 and 32, H = 12 heads, d = 64,
   Lk = 512 ... 8192 cached keys, on a chip of --sms SMs: (batch * heads) x key chunks, keys per chunk, and the
   training kernel's batch * heads programs for the same step (one 128-row tile per (batch, head)).
2. The build per chip: the chunk and merge kernels compiled ahead of time for each --arch (triton.compile for
   GPUTarget("cuda", arch, 32); nothing launched), with their registers and spilled bytes (the ptxas -v log that
   triton prints for the chip's own ptxas) and shared memory, for the decoder's T5 self-attention (causal, the
   position read from a tensor), the cross-attention (no bias, padded keys) and ALiBi, at d = 64 and 128, in bf16
   (fp16 on chips before sm_80) and fp32.
"""
import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import types

if os.environ.get("TRITON_INTERPRET") == "1":
    print("decode_grid.py: unset TRITON_INTERPRET (env -u TRITON_INTERPRET python ...): this tool compiles for the "
          "GPU", file=sys.stderr)
    sys.exit(2)
# A fresh cache: triton runs ptxas (whose log is read here) only for kernels it has not compiled before.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="decode_grid_")
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Skip fat5/__init__.py (it imports transformers): the kernel needs torch, triton, kernels/ and reference_fat5.py.
package = types.ModuleType("fat5")
package.__path__ = [os.path.join(ROOT, "fat5")]
sys.modules["fat5"] = package
from fat5.kernels import decode_attention_t5 as K  # noqa: E402

HEADS, HEAD_DIM = 12, 64
KEY_LENGTHS = (512, 1024, 2048, 4096, 8192)
POINTER = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# (tag: kernel options): what generation runs, per decoder layer and step.
VARIANTS = {
    "t5_self": dict(BIAS_TYPE=1, MAX_DIST=128, CAUSAL=True, HAS_KMASK=False, OFFSET_TENSOR=True),
    "cross": dict(BIAS_TYPE=0, MAX_DIST=1, CAUSAL=False, HAS_KMASK=True, OFFSET_TENSOR=False),
    "alibi_self": dict(BIAS_TYPE=2, MAX_DIST=1, CAUSAL=True, HAS_KMASK=False, OFFSET_TENSOR=True),
}


class _Cuda:
    type = "cuda"


def grid_rows(sms):
    block_n = K._blocks(HEAD_DIM, torch.bfloat16, _Cuda())[0]
    rows = []
    for batch in (1, 32):
        for key_length in KEY_LENGTHS:
            grid, chunk = K.decode_grid(batch, HEADS, key_length, block_n, sms)
            rows.append((batch, key_length, grid, chunk))
    return block_n, rows


def build(arch, fn, signature, constants, num_warps, num_stages):
    """(registers, spilled bytes, shared memory bytes) of `fn` compiled for sm_<arch>, or the compile error."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in constants else signature.get(n, "i32")) for n in names}
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, sig, constexprs=constants), target=GPUTarget("cuda", arch, 32),
                                    options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as error:  # a compile failure is itself the finding
        return f"error: {type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
    finally:
        triton.knobs.nvidia.dump_ptxas_log = False
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    return (int(registers.group(1)) if registers else None,
            int(spills.group(1)) + int(spills.group(2)) if spills else None, kernel.metadata.shared)


def build_rows(arch):
    rows = []
    for dtype in ("bf16", "fp32"):
        pointer = POINTER["fp16" if dtype == "bf16" and arch < 80 else dtype]
        for head_dim in (64, 128):
            block_n, warps, stages = K._blocks(head_dim, getattr(torch, DTYPES[dtype]), _Cuda())
            for tag, options in VARIANTS.items():
                for split in (True, False):
                    signature = dict(Q=pointer, K=pointer, V=pointer, Out=pointer, PartMax="*fp32", PartSum="*fp32",
                                     PartAcc="*fp32", LUT="*fp32", SLOPES="*fp32", KMASK="*fp32", QOFF="*i64",
                                     qk_scale="fp32")
                    constants = dict(options, SPLIT=split, HEAD_DIM=head_dim, BLOCK_M=K.DECODE_MAX_QUERIES,
                                     BLOCK_N=block_n, DOT_PRECISION="tf32" if dtype != "fp32" else "ieee")
                    reading = build(arch, K._decode_chunk_kernel, signature, constants, warps, stages)
                    rows.append((f"{tag} {'chunks' if split else 'one chunk'}", dtype, head_dim,
                                 f"16x{block_n} w{warps} s{stages}", reading))
            signature = dict(PartMax="*fp32", PartSum="*fp32", PartAcc="*fp32", Out=pointer)
            warps = 4 if head_dim >= 64 else 2
            reading = build(arch, K._decode_merge_kernel, signature,
                            dict(HEAD_DIM=head_dim, BLOCK_M=K.DECODE_MAX_QUERIES), warps, 1)
            rows.append(("merge", dtype, head_dim, f"16 w{warps}", reading))
    return rows


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", type=int, default=132, help="SMs of the chip for the grid (H100: 132)")
    parser.add_argument("--arch", type=int, nargs="*", default=[90],
                        help="compute capabilities to build for (90: H100/H200, 80: A100, 89: L4/L40S, ...)")
    parser.add_argument("--no-grid", action="store_true", help="only the builds")
    args = parser.parse_args()
    if args.sms < 1:
        parser.error(f"--sms must be positive, got {args.sms}")
    return args


def main():
    args = parse_args()
    print(f"triton {triton.__version__}")
    if not args.no_grid:
        block_n, rows = grid_rows(args.sms)
        print(f"\nPrograms per decode step, H = {HEADS}, d = {HEAD_DIM}, {args.sms} SMs, {block_n}-key tiles\n")
        print("| batch | Lk | decode grid (batch x heads, chunks) | keys per chunk | decode programs | "
              "training kernel programs |")
        print("| --- | --- | --- | --- | --- | --- |")
        for batch, key_length, grid, chunk in rows:
            print(f"| {batch} | {key_length} | {grid[0]} x {grid[1]} | {chunk} | {grid[0] * grid[1]} | "
                  f"{batch * HEADS} |")
    for arch in args.arch:
        print(f"\nBuild for sm_{arch}{'a' if arch >= 90 else ''}: registers, spilled bytes, shared memory bytes\n")
        print("| kernel | dtype | d | tiles | registers | spills | shared memory |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, dtype, head_dim, tiles, reading in build_rows(arch):
            cells = " | ".join(str(x) for x in reading) if isinstance(reading, tuple) else f"{reading} | | "
            print(f"| {name} | {dtype} | {head_dim} | {tiles} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
