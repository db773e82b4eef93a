#!/usr/bin/env python3
"""Static profile of FAT5's Triton attention kernels for any NVIDIA chip, on a machine WITHOUT a GPU.

Compiles each kernel variant ahead of time for a compute capability (`--arch`, default 90: H100/H200's sm_90a;
nothing is launched), then reads what the compiler produced: registers, spills and shared memory against the
chip's limit per block, whether ptxas serialised Hopper's wgmma tensor-core ops (warning C7515), and the machine
instructions in each tensor-core loop body, with its exp2 (MUFU) count. These are proxies, not timings: a GPU
measurement always wins. They move with the things that decide flash-attention speed (spills, serialised wgmma,
instructions and exps per tile), and a kernel whose shared memory exceeds the chip's limit cannot launch there.

    python benchmarks/sm90_profile.py                      # every variant without dropout, sm_90a
    python benchmarks/sm90_profile.py t5_enc_d64 nobias_d64  # some variants
    python benchmarks/sm90_profile.py --dropout            # the attention-dropout variants and their baselines
    python benchmarks/sm90_profile.py --arch 86 --all      # every variant, dropout included, for an A10 / RTX 30xx
    python benchmarks/sm90_profile.py --arch all --all --summary  # every chip of CHIPS, one table per chip
    BLOCKS="fwd:128,64,8,3;dq:64,64,4,2" python ...          # try other (BLOCK_M, BLOCK_N, warps, stages)
                                                           # per kernel: fwd, dkdv, dq (bwd: dkdv and dq)
    python benchmarks/sm90_profile.py --kernel-variants "default;band_tiles" t5_enc_d64  # both

Works with the triton of the GPU image (3.6.0, paired with torch 2.11) and the newest (3.9): the registers and
spills are those of triton's own ptxas run (TRITON_DUMP_PTXAS_LOG), so the ptxas that triton picks for the chip
(3.9 ships two, the newer for sm_90 and up) and its options decide them, as on the GPU. A venv for another triton:
`pip install triton==3.6.0 torch`. Chips without bf16 (sm_75) compile the bf16 variants in fp16 (the kernel refuses
bf16 there). The kernel module must keep the names this tool reads: _forward_kernel, _backward_dkdv_kernel,
_backward_dq_kernel, chip_tiles(capability, kernel, head_dim, dropout, packed); adapt VARIANTS/arguments below when they
change.

Output: one JSON line per kernel (tag, arch, kernel, config, registers, spill_bytes, smem, smem_limit, fits, error,
...), then a table; loop bodies largest first; with --summary one compact table per chip (what the
tests/test_kernel_chips.py slow test and benchmarks/RESULTS.md read). The kernels run one loop per kind of tile:
forward and dQ over key tiles far-left, near band, far-right (T5); dK/dV over query tiles far-right, near band,
far-left; with ALiBi or no bias one loop, plus a causal-diagonal loop when causal. `far/ceiling` compares the
far-tile loop (the second largest when there are several: the largest is the near band or causal diagonal) with
the same loop of the variant's no-bias ceiling (same dtype, head dim and causality); `exp2/elem` is that loop's
MUFU count over the scores one thread holds (1 = one exp2 per score, plus the per-row rescale). Variants ending in
`_drop` compile attention dropout in (DROPOUT=True); `far/no-drop` compares their far loop with the same loop of
the variant without dropout. `--kernel-variants SETS` builds the chosen variants with each set of the kernel's
variants (`VARIANT_NAMES` of the kernel module: band_tiles, tma, fused_backward; tags get `+NAME`): the tma forward
on the launcher's tiles (the chip's "forward tma" ones, or its forward tiles with T5's gather and packed rows),
fused_backward's dK/dV kernel on its "fused" tiles alone (no dQ kernel runs); where the chip's table has no such
tiles, the default kernel, and said so (the variant does not run there). Each loop body also lists its global memory
instructions: `ldg` (LDG, loads through registers: the near band's gather), `cp.async` (LDGSTS, pipelined copies to
shared memory), `tma` (UTMALDG) and `atomics` (REDG, ATOMG), and each kernel its PTX counts (`cp.async.bulk.tensor`,
`ld.global`, `wgmma.wait_group`, `setmaxnreg`, `red`/`atom`).
"""
import argparse
import collections
import contextlib
import io
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
OUT = tempfile.mkdtemp(prefix="sm90_profile_")
# Triton runs ptxas (whose log this tool reads) only for kernels it has not compiled before: compile every time
# (sm_75's fp16 variants are its bf16 ones), in a cache of our own.
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
os.environ["TRITON_CACHE_DIR"] = os.path.join(OUT, "cache")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = os.environ.get("FAT5_SRC", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Skip fat5/__init__.py (it imports transformers): the kernel needs torch, triton and fat5/reference_fat5.py only.
package = types.ModuleType("fat5")
package.__path__ = [os.path.join(ROOT, "fat5")]
sys.modules["fat5"] = package
from fat5.kernels import flash_attention_t5 as K  # noqa: E402

# Compute capability: (GPUs, shared memory a block may use in bytes: the CUDA programming guide's opt-in maximum,
# which triton compares with a kernel's at its first launch). sm_75 has no bf16.
CHIPS = {
    75: ("T4, RTX 20xx", 64 * 1024),
    80: ("A100, A30", 163 * 1024),
    86: ("A10, A10G, A40, RTX 30xx", 99 * 1024),
    89: ("L4, L40S, RTX 40xx", 99 * 1024),
    90: ("H100, H200", 227 * 1024),
    100: ("B200, GB200", 227 * 1024),
    120: ("RTX 50xx, RTX PRO 6000", 99 * 1024),
}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTER = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
KERNELS = {"forward": "_forward_kernel", "dkdv": "_backward_dkdv_kernel", "dq": "_backward_dq_kernel"}


def blocks(arch, head_dim, kernel, dropout=False, packed=False):
    """The kernel's tiles ("forward", "dkdv", "dq", or a variant's "forward tma", "fused") on the chip, or the BLOCKS
    override of them."""
    override = os.environ.get("BLOCKS")
    if override:
        parts = dict(part.split(":") for part in override.split(";"))
        for key in {"forward": ("fwd",), "forward tma": ("fwd",), "dkdv": ("dkdv", "bwd"), "fused": ("dkdv", "bwd"),
                    "dq": ("dq", "bwd")}.get(kernel, ()):
            if key in parts:
                return tuple(int(x) for x in parts[key].split(","))
    return K.chip_tiles(arch, kernel, head_dim, dropout, packed)


# Global memory instructions a loop body is read for (SASS opcode -> name in the tables).
MEMORY_OPS = {"LDG": "ldg", "LDGSTS": "cp.async", "UTMALDG": "tma", "REDG": "atomics", "RED": "atomics",
              "ATOMG": "atomics"}
# Counted in each kernel's PTX.
PTX_OPS = ("cp.async.bulk.tensor", "cp.async.cg", "cp.async.ca", "ld.global", "wgmma.wait_group", "setmaxnreg",
           "red.", "atom.")


def loops(sass):
    """Instruction, MUFU (exp2), tensor-core (HGMMA, HMMA, UTC*MMA) and global memory (MEMORY_OPS) counts of each
    loop body (a backward branch) in a SASS listing; an outer loop's count includes its inner loops."""
    code = []
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if match:
            code.append((int(match.group(1), 16), match.group(2).strip()))
    # Code after the kernel's last unconditional EXIT is out-of-line stubs (TMA's barrier waits retry there and
    # branch back into the loop they came from): not loops.
    end = max((address for address, text in code if text == "EXIT"), default=None)
    found = []
    for address, text in code:
        branch = re.search(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`\()?(0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address and (end is None or address < end):
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            ops = collections.Counter(re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0].split(".")[0] for t in body)
            memory = collections.Counter()
            for op, name in MEMORY_OPS.items():
                memory[name] += ops.get(op, 0)
            found.append({"instructions": len(body), "mufu": ops.get("MUFU", 0),
                          "mma": sum(count for op, count in ops.items() if op.endswith("MMA")),
                          "memory": {name: count for name, count in memory.items() if count}})
    return sorted(found, key=lambda loop: -loop["instructions"])


def ptxas_reading(log):
    """Registers and spilled bytes (stores + loads) from a `ptxas -v` log."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(registers.group(1)) if registers else None,
            int(spills.group(1)) + int(spills.group(2)) if spills else None)


def build(arch, tag, fn, signature, constants, divisible, num_warps, num_stages):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in constants else signature[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names and n not in constants}
    info = dict(tag=tag, arch=arch, kernel=fn.__name__.strip("_"),
                config=f"{constants['BLOCK_M']}x{constants['BLOCK_N']} w{num_warps} s{num_stages}")
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True  # triton prints its ptxas -v log: the chip's own ptxas and options
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, sig, constexprs=constants, attrs=attrs),
                                    target=GPUTarget("cuda", arch, 32),
                                    options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as error:  # a compile failure is itself the finding
        return dict(info, error=f"{type(error).__name__}: {str(error).strip()[:300]}")
    finally:
        triton.knobs.nvidia.dump_ptxas_log = False
    base = os.path.join(OUT, f"{tag}_{arch}_{fn.__name__}")
    with open(base + ".cubin", "wb") as cubin:
        cubin.write(kernel.asm["cubin"])
    registers, spill_bytes = ptxas_reading(log.getvalue())
    limit = CHIPS.get(arch, (None, None))[1]
    info.update(elements=constants["BLOCK_M"] * constants["BLOCK_N"] // (32 * num_warps),
                registers=registers, spill_bytes=spill_bytes, smem=kernel.metadata.shared, smem_limit=limit,
                fits=limit is None or kernel.metadata.shared <= limit,
                wgmma_serialized="C7515" in log.getvalue())
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", base + ".cubin"], capture_output=True,
                          text=True).stdout
    found = loops(sass)
    info["loops"] = [loop for loop in found if loop["mma"]] or found  # the loops that run the tiles' dots
    ptx = kernel.asm["ptx"]
    info["ptx"] = {op.rstrip("."): len(re.findall(r"^\s*(?:@%p\d+\s+)?" + re.escape(op), ptx, re.M))
                   for op in PTX_OPS}
    return info


def variant(arch, tag, dtype="bf16", head_dim=64, bias=1, causal=False, kmask=False, varlen=False, dropout=False,
            kernel_variants=frozenset()):
    if dtype == "bf16" and arch < 80:
        dtype = "fp16"  # the chip has no bf16: the kernel refuses it there
    pointer = POINTER[dtype]
    common = dict(MAX_DIST=128 if bias == 1 else 1, BIAS_TYPE=bias, CAUSAL=causal, HAS_KMASK=kmask,
                  IS_VARLEN=varlen, HEAD_DIM=head_dim, DOT_PRECISION="tf32" if dtype != "fp32" else "ieee",
                  DROPOUT=dropout, BAND_TILES="band_tiles" in kernel_variants and bias == 1
                  and bool(K.chip_tiles(arch, "band tiles", head_dim)))
    fused = "fused_backward" in kernel_variants and not causal \
        and blocks(arch, head_dim, "fused", dropout, varlen) is not None
    if kernel_variants:
        tag += "".join(f"+{name}" for name in sorted(kernel_variants))
    # The dropout arguments: the (seed, stream) tensor, the 16-bit threshold and 1 / (1 - p).
    dropout_signature = dict(SEED="*i64", dropout_threshold="i32", dropout_scale="fp32")
    results = []
    for kernel, name in KERNELS.items():
        if kernel == "dq" and fused:
            continue
        fn = getattr(K, name)
        constants = dict(common)
        tiles = None
        if kernel == "forward":
            # As the launcher: TMA where the chip has "forward tma" tiles, wide ones unless T5's gather or packed rows.
            tma = "tma" in kernel_variants and blocks(arch, head_dim, "forward tma") is not None
            wide = (bias != 1 or common["BAND_TILES"]) and not varlen
            tiles = blocks(arch, head_dim, "forward tma" if wide else "forward", dropout) if tma else None
            constants["TMA"] = tiles is not None
        if kernel == "dkdv":
            constants["FUSED"] = fused
            tiles = blocks(arch, head_dim, "fused", dropout, varlen) if fused else None
        bm, bn, warps, stages = tiles or blocks(arch, head_dim, kernel, dropout, varlen)
        signature = {n: "i32" for n in fn.arg_names}
        signature.update({n: pointer for n in ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ")})
        signature.update(LSE="*fp32", DELTA="*fp32", DLUT="*fp32", LUT="*fp32", BAND="*fp32", SLOPES="*fp32",
                         KMASK="*fp32", CU_Q="*i32", CU_K="*i32", qk_scale="fp32", scale="fp32", **dropout_signature)
        if kernel == "dkdv":
            signature["DQ"] = "*fp32"  # fused_backward's fp32 sum of dQ
        # As a training call specialises them: q_offset 0, strides and lengths multiples of 16.
        divisible = [n for n in fn.arg_names if (n[0].isupper() and n not in constants) or
                     (n.startswith("stride") and n != "stride_lut_h")] + ["seqlen_q", "seqlen_k", "q_offset"]
        row = build(arch, tag, fn, signature, dict(constants, BLOCK_M=bm, BLOCK_N=bn), divisible, warps, stages)
        if "band_tiles" in kernel_variants and bias == 1 and not constants["BAND_TILES"]:
            row["note"] = "no band tiles on the chip: built with the gather"
        if "tma" in kernel_variants and constants.get("TMA") is False:
            row["note"] = "no forward tma tiles for the chip: built without TMA"
        if "fused_backward" in kernel_variants and kernel != "forward" and not fused:
            row["note"] = "no fused tiles for the chip, head dim and rows: two backward kernels"
        results.append(row)
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
# Head dim 32 (T5-small-like models with more heads): the d <= 64 tiles, fewer columns.
VARIANTS["t5_enc_d32"] = dict(head_dim=32, bias=1, kmask=True)
VARIANTS["t5_dec_d32"] = dict(head_dim=32, bias=1, causal=True)
# Attention dropout: each variant of issue 25's list against itself without dropout (`far/no-drop`).
DROPOUT_VARIANTS = ("t5_enc_d64", "t5_dec_d64", "t5_varlen_d64", "alibi_d64", "nobias_d64", "t5_enc_d128",
                    "t5_dec_d128", "t5_enc_d64_fp16")
for _tag in DROPOUT_VARIANTS:
    VARIANTS[_tag + "_drop"] = dict(VARIANTS[_tag], dropout=True)


def ceiling(tag):
    tag = tag.split("+")[0]
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


def arch_name(arch):
    return f"sm_{arch}{'a' if arch >= 90 else ''}"


def print_details(arch, rows):
    found = {(r["tag"], r["kernel"]): r for r in rows if "error" not in r}
    print(f"\ntriton {triton.__version__}, {arch_name(arch)}, BLOCKS={os.environ.get('BLOCKS', 'kernel default')}")
    print(f"{'variant':20} {'kernel':22} {'tiles':12} {'regs':>4} {'spill':>6} {'smem':>6} {'serial':>6} "
          f"{'far/ceiling':>11} {'far/no-drop':>11} {'exp2/elem':>9}  loop bodies (instructions/exp2)")
    for r in rows:
        if "error" in r:
            print(f"{r['tag']:20} {r['kernel']:22} COMPILE ERROR {r['error'][:80]}")
            continue
        bodies = ", ".join(f"{loop['instructions']}/{loop['mufu']}" + (
            " (" + " ".join(f"{name} {count}" for name, count in loop["memory"].items()) + ")" if loop["memory"]
            else "") for loop in r["loops"])
        ptx = r.get("ptx", {})
        bodies += "; PTX " + ", ".join(f"{op} {count}" for op, count in ptx.items() if count) if ptx else ""
        far = far_loop(r["tag"], r)
        reference = found.get((ceiling(r["tag"]), r["kernel"]))
        reference = far_loop(ceiling(r["tag"]), reference) if reference else None
        ratio = f"{far['instructions'] / reference['instructions']:.2f}" if far and reference else "-"
        without = found.get((r["tag"].removesuffix("_drop"), r["kernel"])) if r["tag"].endswith("_drop") else None
        without = far_loop(None, without) if without else None
        dropout_ratio = f"{far['instructions'] / without['instructions']:.2f}" if far and without else "-"
        per_element = f"{far['mufu'] / r['elements']:.2f}" if far else "-"
        print(f"{r['tag']:20} {r['kernel']:22} {r['config']:12} {r['registers']!s:>4} {r['spill_bytes']!s:>6} "
              f"{r['smem']:>6} {str(r['wgmma_serialized']):>6} {ratio:>11} {dropout_ratio:>11} {per_element:>9}  "
              f"{bodies}")


def cell(row):
    """One kernel in the summary: tiles, registers, spilled bytes, shared memory in KiB, and what breaks."""
    if row is None:
        return "-"
    if "error" in row:
        return f"{row['config']} ERROR"
    text = f"{row['config']} {row['registers']}r"
    if row["spill_bytes"]:
        text += f" **spill {row['spill_bytes']}**"
    text += f" {row['smem'] / 1024:.0f}K"
    return text + ("" if row["fits"] else " **> limit**")


def print_summary(arch, rows):
    """The chip's table: one line per variant, each kernel's tiles, registers, spills and shared memory."""
    gpus, limit = CHIPS.get(arch, ("?", None))
    by = {(r["tag"], r["kernel"]): r for r in rows}
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    spilled = [r for r in rows if r.get("spill_bytes")]
    print(f"\n{arch_name(arch)} ({gpus}; {limit // 1024 if limit else '?'} KiB shared memory a block), triton "
          f"{triton.__version__}: {len(rows)} kernels, {sum('error' in r for r in rows)} errors, "
          f"{sum(not r.get('fits', True) for r in rows)} over the shared-memory limit, {len(spilled)} spilling"
          + (" (bf16 variants compiled in fp16: the chip has no bf16)" if arch < 80 else ""))
    print("\n| variant | forward | dK/dV | dQ |\n|---|---|---|---|")
    for tag in tags:
        print(f"| {tag} | " + " | ".join(cell(by.get((tag, name.strip("_")))) for name in KERNELS.values()) + " |")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", metavar="VARIANT",
                        help=f"variants to compile (default: every one without dropout): {', '.join(VARIANTS)}")
    parser.add_argument("--dropout", action="store_true",
                        help="also the attention-dropout variants and the same variants without dropout")
    parser.add_argument("--all", action="store_true", help="every variant, the attention-dropout ones included")
    parser.add_argument("--arch", default="90",
                        help=f"compute capability to compile for, or a comma-separated list, or 'all' "
                             f"({', '.join(map(str, CHIPS))}); default 90 (H100, H200)")
    parser.add_argument("--kernel-variants", default="default", metavar="SETS",
                        help=f"build with these sets of the kernel's variants: names comma-separated, sets "
                             f"semicolon-separated, 'default' the default kernel (e.g. "
                             f"'default;band_tiles;band_tiles,tma'); names: {', '.join(K.VARIANT_NAMES)}")
    parser.add_argument("--summary", action="store_true",
                        help="print one compact table per chip (tiles, registers, spills, shared memory) instead of "
                             "the loop-body table")
    args = parser.parse_args()
    unknown = [tag for tag in args.variants if tag not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        args.arch = list(CHIPS) if args.arch == "all" else [int(arch) for arch in args.arch.split(",")]
    except ValueError:
        parser.error(f"--arch takes compute capabilities such as 80 or 80,86 or 'all', got {args.arch!r}")
    try:
        args.kernel_variants = [K.kernel_variants("" if names.strip() == "default" else names)
                                for names in args.kernel_variants.split(";")]
    except ValueError as error:
        parser.error(str(error))
    return args


if __name__ == "__main__":
    args = parse_args()
    chosen = list(args.variants)
    if args.dropout:
        chosen += [tag for base in DROPOUT_VARIANTS for tag in (base, base + "_drop") if tag not in chosen]
    if args.all:
        chosen += [tag for tag in VARIANTS if tag not in chosen]
    chosen = chosen or [tag for tag in VARIANTS if not VARIANTS[tag].get("dropout")]
    for arch in args.arch:
        rows = []
        for kernel_variants in args.kernel_variants:
            for tag in chosen:
                for row in variant(arch, tag, **VARIANTS[tag], kernel_variants=kernel_variants):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        (print_summary if args.summary else print_details)(arch, rows)
