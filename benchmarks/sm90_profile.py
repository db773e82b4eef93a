#!/usr/bin/env python3
"""Static H100 (sm_90a) profile of FAT5's Triton attention kernels, on a machine WITHOUT a GPU.

Compiles each kernel variant ahead of time for sm_90a (nothing is launched), then reads what the compiler
produced: registers, spills, shared memory, whether ptxas serialised the wgmma tensor-core ops (warning C7515),
and the machine instructions in each loop body, with its exp2 (MUFU) count. These are proxies, not timings:
a GPU measurement always wins. They move with the things that decide flash-attention speed on Hopper (spills,
serialised wgmma, instructions and exps per tile), so a change can be judged before a GPU is at hand.

    python benchmarks/sm90_profile.py                      # every variant
    python benchmarks/sm90_profile.py t5_enc_d64 nobias_d64  # some variants
    python benchmarks/sm90_profile.py --dropout            # the attention-dropout variants and their baselines
    BLOCKS="fwd:128,64,8,3;dq:64,64,4,2" python ...          # try other (BLOCK_M, BLOCK_N, warps, stages)
                                                           # per kernel: fwd, dkdv, dq (bwd: dkdv and dq)

Use triton 3.6.0 (the version paired with torch 2.11 on the H100) in its own venv: `pip install triton==3.6.0 torch`.
The kernel module must keep the names this tool reads: _forward_kernel, _backward_dkdv_kernel,
_backward_dq_kernel, _blocks(head_dim, kernel, device, dropout); adapt VARIANTS/arguments below when they change.

Output: one JSON line per kernel, then a table; loop bodies largest first. The kernels run one loop per kind of
tile: forward and dQ over key tiles far-left, near band, far-right (T5); dK/dV over query tiles far-right, near
band, far-left; with ALiBi or no bias one loop, plus a causal-diagonal loop when causal. `far/ceiling` compares the
far-tile loop (the second largest when there are several: the largest is the near band or causal diagonal) with
the same loop of the variant's no-bias ceiling (same dtype, head dim and causality); `exp2/elem` is that loop's
MUFU count over the scores one thread holds (1 = one exp2 per score, plus the per-row rescale). Variants ending in
`_drop` compile attention dropout in (DROPOUT=True); `far/no-drop` compares their far loop with the same loop of
the variant without dropout.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import types

if os.environ.get("TRITON_INTERPRET") == "1":
    print("sm90_profile.py: unset TRITON_INTERPRET (env -u TRITON_INTERPRET python ...): this tool compiles for the "
          "GPU", file=sys.stderr)
    sys.exit(2)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = os.environ.get("FAT5_SRC", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Skip fat5/__init__.py (it imports transformers): the kernel needs torch, triton and fat5/reference_fat5.py only.
package = types.ModuleType("fat5")
package.__path__ = [os.path.join(ROOT, "fat5")]
sys.modules["fat5"] = package
from fat5.kernels import flash_attention_t5 as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTER = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
OUT = tempfile.mkdtemp(prefix="sm90_profile_")


class _Cuda:
    type = "cuda"


def blocks(head_dim, kernel, dropout=False):
    """The kernel's tiles ("forward", "dkdv" or "dq"), or the BLOCKS override of them."""
    override = os.environ.get("BLOCKS")
    if override:
        parts = dict(part.split(":") for part in override.split(";"))
        for key in {"forward": ("fwd",), "dkdv": ("dkdv", "bwd"), "dq": ("dq", "bwd")}[kernel]:
            if key in parts:
                return tuple(int(x) for x in parts[key].split(","))
    return K._blocks(head_dim, kernel, _Cuda(), dropout)


def loops(sass):
    """Instruction, MUFU (exp2) and HGMMA counts of each loop body (a backward branch) in a SASS listing;
    an outer loop's count includes its inner loops."""
    code = []
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if match:
            code.append((int(match.group(1), 16), match.group(2).strip()))
    found = []
    for address, text in code:
        branch = re.search(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`\()?(0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            ops = collections.Counter(re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0].split(".")[0] for t in body)
            found.append({"instructions": len(body), "mufu": ops.get("MUFU", 0), "hgmma": ops.get("HGMMA", 0)})
    return sorted(found, key=lambda loop: -loop["instructions"])


def build(tag, fn, signature, constants, divisible, num_warps, num_stages):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in constants else signature[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names and n not in constants}
    try:
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constants, attrs=attrs), target=TARGET,
                                options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as error:  # a compile failure is itself the finding
        return dict(tag=tag, kernel=fn.__name__, error=f"{type(error).__name__}: {str(error)[:300]}")
    base = os.path.join(OUT, f"{tag}_{fn.__name__}")
    open(base + ".ptx", "w").write(kernel.asm["ptx"])
    open(base + ".cubin", "wb").write(kernel.asm["cubin"])
    info = dict(tag=tag, kernel=fn.__name__.strip("_"),
                elements=constants["BLOCK_M"] * constants["BLOCK_N"] // (32 * num_warps),
                config=f"{constants['BLOCK_M']}x{constants['BLOCK_N']} w{num_warps} s{num_stages}",
                smem=kernel.metadata.shared)
    ptxas = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", base + ".ptx", "-o",
                            "/dev/null"], capture_output=True, text=True)
    registers = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas.stderr)
    info.update(registers=int(registers.group(1)) if registers else None,
                spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None,
                wgmma_serialized="C7515" in ptxas.stderr)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", base + ".cubin"], capture_output=True,
                          text=True).stdout
    info["loops"] = [loop for loop in loops(sass) if loop["hgmma"]]  # the loops that run tensor-core tiles
    return info


def variant(tag, dtype="bf16", head_dim=64, bias=1, causal=False, kmask=False, varlen=False, dropout=False):
    pointer = POINTER[dtype]
    common = dict(MAX_DIST=128 if bias == 1 else 1, BIAS_TYPE=bias, CAUSAL=causal, HAS_KMASK=kmask,
                  IS_VARLEN=varlen, HEAD_DIM=head_dim, DOT_PRECISION="tf32" if dtype != "fp32" else "ieee",
                  DROPOUT=dropout)
    # The dropout arguments: the (seed, stream) tensor, the 16-bit threshold and 1 / (1 - p).
    dropout_signature = dict(SEED="*i64", dropout_threshold="i32", dropout_scale="fp32")
    results = []
    bm, bn, warps, stages = blocks(head_dim, "forward", dropout)
    fn = K._forward_kernel
    signature = {n: "i32" for n in fn.arg_names}
    signature.update(Q=pointer, K=pointer, V=pointer, Out=pointer, LSE="*fp32", LUT="*fp32", SLOPES="*fp32",
                     KMASK="*fp32", CU_Q="*i32", CU_K="*i32", qk_scale="fp32", **dropout_signature)
    divisible = [n for n in fn.arg_names if (n[0].isupper() and n not in common) or
                 (n.startswith("stride") and n != "stride_lut_h")] + ["seqlen_q", "seqlen_k"]
    results.append(build(tag, fn, signature, dict(common, BLOCK_M=bm, BLOCK_N=bn), divisible, warps, stages))
    for fn, kernel in ((K._backward_dkdv_kernel, "dkdv"), (K._backward_dq_kernel, "dq")):
        bm, bn, warps, stages = blocks(head_dim, kernel, dropout)
        signature = {n: "i32" for n in fn.arg_names}
        signature.update({n: pointer for n in ("Q", "K", "V", "DO", "DK", "DV", "DQ")})
        signature.update(LSE="*fp32", DELTA="*fp32", DLUT="*fp32", LUT="*fp32", SLOPES="*fp32", KMASK="*fp32",
                         CU_Q="*i32", CU_K="*i32", qk_scale="fp32", scale="fp32", **dropout_signature)
        divisible = [n for n in fn.arg_names if (n[0].isupper() and n not in common) or
                     (n.startswith("stride") and n != "stride_lut_h")] + ["seqlen_q", "seqlen_k"]
        results.append(build(tag, fn, signature, dict(common, BLOCK_M=bm, BLOCK_N=bn), divisible, warps, stages))
    return results


# (tag: options). Each bias variant is read against the no-bias ceiling of the same dtype, head dim and causality.
VARIANTS = {}
for _dim in (64, 128):
    VARIANTS[f"t5_enc_d{_dim}"] = dict(head_dim=_dim, bias=1, kmask=True)
    VARIANTS[f"t5_dec_d{_dim}"] = dict(head_dim=_dim, bias=1, causal=True)
    VARIANTS[f"nobias_d{_dim}"] = dict(head_dim=_dim, bias=0)
    VARIANTS[f"nobias_causal_d{_dim}"] = dict(head_dim=_dim, bias=0, causal=True)
VARIANTS["alibi_d64"] = dict(bias=2, kmask=True)
VARIANTS["t5_varlen_d64"] = dict(bias=1, varlen=True)
for _tag in ("t5_enc_d64", "t5_dec_d64", "nobias_d64", "nobias_causal_d64"):
    VARIANTS[_tag + "_fp16"] = dict(VARIANTS[_tag], dtype="fp16")
# Attention dropout: each variant of issue 25's list against itself without dropout (`far/no-drop`).
DROPOUT_VARIANTS = ("t5_enc_d64", "t5_dec_d64", "t5_varlen_d64", "alibi_d64", "nobias_d64", "t5_enc_d128",
                    "t5_dec_d128", "t5_enc_d64_fp16")
for _tag in DROPOUT_VARIANTS:
    VARIANTS[_tag + "_drop"] = dict(VARIANTS[_tag], dropout=True)


def ceiling(tag):
    options = VARIANTS[tag]
    if options.get("dropout"):
        return ceiling(tag.removesuffix("_drop"))
    suffix = "_fp16" if options.get("dtype") == "fp16" else ""
    causal = "_causal" if options.get("causal") else ""
    return f"nobias{causal}_d{options.get('head_dim', 64)}{suffix}"


def far_loop(tag, row):
    """A kernel's loop over tiles that need no gather and no causal mask: with two or more loops the second
    largest (the largest is the near band's gather or the causal diagonal's mask), else the only one."""
    loops = row["loops"]
    return loops[1] if len(loops) >= 2 else (loops[0] if loops else None)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", metavar="VARIANT",
                        help=f"variants to compile (default: every one without dropout): {', '.join(VARIANTS)}")
    parser.add_argument("--dropout", action="store_true",
                        help="also the attention-dropout variants and the same variants without dropout")
    args = parser.parse_args()
    unknown = [tag for tag in args.variants if tag not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


if __name__ == "__main__":
    args = parse_args()
    chosen = list(args.variants)
    if args.dropout:
        chosen += [tag for base in DROPOUT_VARIANTS for tag in (base, base + "_drop") if tag not in chosen]
    chosen = chosen or [tag for tag in VARIANTS if not VARIANTS[tag].get("dropout")]
    rows = []
    for tag in chosen:
        for row in variant(tag, **VARIANTS[tag]):
            print(json.dumps(row), flush=True)
            rows.append(row)
    found = {(r["tag"], r["kernel"]): r for r in rows if "error" not in r}
    print(f"\ntriton {triton.__version__}, sm_90a, BLOCKS={os.environ.get('BLOCKS', 'kernel default')}")
    print(f"{'variant':20} {'kernel':22} {'tiles':12} {'regs':>4} {'spill':>6} {'smem':>6} {'serial':>6} "
          f"{'far/ceiling':>11} {'far/no-drop':>11} {'exp2/elem':>9}  loop bodies (instructions/exp2)")
    for r in rows:
        if "error" in r:
            print(f"{r['tag']:20} {r['kernel']:22} COMPILE ERROR {r['error'][:80]}")
            continue
        bodies = ", ".join(f"{loop['instructions']}/{loop['mufu']}" for loop in r["loops"])
        far = far_loop(r["tag"], r)
        reference = found.get((ceiling(r["tag"]), r["kernel"]))
        reference = far_loop(ceiling(r["tag"]), reference) if reference else None
        ratio = f"{far['instructions'] / reference['instructions']:.2f}" if far and reference else "-"
        without = found.get((r["tag"].removesuffix("_drop"), r["kernel"])) if r["tag"].endswith("_drop") else None
        without = far_loop(None, without) if without else None
        dropout_ratio = f"{far['instructions'] / without['instructions']:.2f}" if far and without else "-"
        per_element = f"{far['mufu'] / r['elements']:.2f}" if far else "-"
        print(f"{r['tag']:20} {r['kernel']:22} {r['config']:12} {r['registers']:>4} {r['spill_bytes']:>6} "
              f"{r['smem']:>6} {str(r['wgmma_serialized']):>6} {ratio:>11} {dropout_ratio:>11} {per_element:>9}  "
              f"{bodies}")
