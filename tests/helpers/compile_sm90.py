"""Compiles the Triton kernels whose GPU paths change most often for sm_90 (Hopper: the H200)
without a GPU: Triton's frontend, MLIR passes and ptxas, the path the interpreter never takes.
Run as a script with TRITON_INTERPRET unset (the test suite sets it, and kernels defined under it
cannot be compiled); prints one line per variant and exits 1 if any failed, 2 (with the reason)
if this machine cannot compile for sm_90 at all (no ptxas in the Triton install).
`--counts "gemv M16"` prints PTX instruction counts and registers of the matching variants instead."""
from __future__ import annotations

import inspect
import itertools
import os
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from specdec.kernels import fused, gemv, sampling, triton_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


# Integer arguments (besides every stride_*) that are multiples of 16 in the servers' launches.
DIVISIBLE = {"N", "K", "k_per_split"}


def compile_kernel(fn, types: dict[str, str], constexprs: dict, warps: int, stages: int):
    """types: argument name -> Triton type for the non-constexpr arguments (default i32).

    A launch on the GPU specializes what it is given: pointers 16-byte aligned and integers
    divisible by 16 (Triton's tt.divisibility), which is what selects vectorized and cp.async loads
    (without it a GEMV tile loads 2 bytes at a time and compiles to other code). So these compiles
    take the same for every pointer, every stride_* and the names in DIVISIBLE."""
    # constexpr parameters left out take their defaults, as a launch would (else they'd be i32 arguments)
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty},
                  **constexprs}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n.startswith("stride") or n in DIVISIBLE)}
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=dict(num_warps=warps, num_stages=stages))


def variants():
    gemv_types = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32",
                  "R": "*bf16", "SS": "*fp32", "NW": "*bf16", "RW": "*bf16", "eps": "fp32"}
    for (bm, bn, bk, warps, stages), split, glu in itertools.product(
            [(1, 8, 512, 8, 3), (16, 32, 128, 4, 5), (64, 32, 128, 4, 5)], [1, 4], [False, True]):
        c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, HAS_BIAS=glu, EVEN_K=split == 1,
                 UPCAST=False, USE_PDL=True, GLU=glu, RES_OUT=False, NORM_IN=False, BLOCK_P=16)
        yield f"gemv M{bm} split{split} glu={glu}", gemv._gemv_kernel, gemv_types, c, warps, stages
    for (bm, bn, bk, warps, stages), (glu, res) in itertools.product(
            [(1, 8, 512, 8, 3), (16, 32, 128, 4, 5), (64, 32, 128, 4, 5)],
            [(False, False), (True, False), (False, True)]):
        c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=4, HAS_BIAS=glu, EVEN_K=False, UPCAST=False,
                 USE_PDL=True, GLU=glu, RES_OUT=res, NORM_IN=False, BLOCK_P=16, INLINE_REDUCE=True)
        yield f"gemv M{bm} split4 inline reduce glu={glu} residual={res}", gemv._gemv_kernel, gemv_types, c, warps, stages
    for (bm, bn, bk, warps, stages), (res, norm, glu) in itertools.product(
            [(1, 8, 512, 8, 3), (16, 32, 128, 4, 5)], [(True, False, False), (False, True, False),
                                                       (False, True, True)]):
        c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=1, HAS_BIAS=False, EVEN_K=True, UPCAST=False,
                 USE_PDL=True, GLU=glu, RES_OUT=res, NORM_IN=norm, BLOCK_P=gemv.PARTS_AHEAD[bm])
        yield f"gemv M{bm} residual={res} norm={norm} glu={glu}", gemv._gemv_kernel, gemv_types, c, warps, stages
    for (bm, bn, bk, warps, stages), (res, norm, glu), split in itertools.product(   # the norm weighed ahead
            [(1, 8, 512, 8, 3), (16, 32, 128, 4, 5)], [(True, False, False), (False, True, False),
                                                       (False, True, True)], [1, 4]):
        c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, HAS_BIAS=False, EVEN_K=True, UPCAST=False,
                 USE_PDL=True, GLU=glu, RES_OUT=res, NORM_IN=norm, BLOCK_P=gemv.PARTS_AHEAD[bm],
                 INLINE_REDUCE=split > 1, RES_WEIGHTED=res, NORM_W=False)
        yield (f"gemv M{bm} split{split} ahead residual={res} norm={norm} glu={glu}", gemv._gemv_kernel, gemv_types,
               c, warps, stages)
    for split in (1, 4):   # a wide stream's 2..16-row norm consumer: launched without PDL, late trigger
        c = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT=split, HAS_BIAS=False, EVEN_K=True, UPCAST=False,
                 USE_PDL=False, GLU=False, RES_OUT=False, NORM_IN=True, BLOCK_P=gemv.PARTS_AHEAD[16],
                 INLINE_REDUCE=split > 1, NORM_W=False, LATE_TRIGGER=True)
        yield f"gemv M16 split{split} norm consumer late trigger", gemv._gemv_kernel, gemv_types, c, 4, 5
    for split, res in ((1, False), (4, False), (4, True)):   # 40 rows in three 16-row tiles
        c = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT=split, HAS_BIAS=False, EVEN_K=True, UPCAST=False,
                 USE_PDL=True, GLU=False, RES_OUT=res, NORM_IN=False, BLOCK_P=16, INLINE_REDUCE=split > 1,
                 M_TILES=3)
        yield f"gemv M16 x3 tiles split{split} residual={res}", gemv._gemv_kernel, gemv_types, c, 4, 5
    for glu, res, weighted in ((False, False, False), (True, False, False), (False, True, False), (False, True, True)):
        c = dict(SPLIT=4, HAS_BIAS=True, BLOCK=1024, USE_PDL=True, GLU=glu, RES_OUT=res, RES_WEIGHTED=weighted)
        yield (f"splitk_reduce glu={glu} residual={res} weighted={weighted}", gemv._splitk_reduce_kernel, gemv_types,
               c, 4, 1)
    attn_types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Part": "*fp32",
                  "Counters": "*i32", "BlockTables": "*i32", "ContextLens": "*i32",
                  "QueryStart": "*i32", "scale_log2": "fp32"}
    for ahead, (bm, bn, g), (split, inline), order in itertools.product(
            [False, True], [(16, 64, 1), (16, 128, 1), (4, 64, 4)], [(False, False), (True, True)],
            [(True, True), (False, False)]):
        c = dict(G=g, QT=max(1, bm // g), PAGE=16, HEAD_DIM=128, D_PAD=128, BLOCK_M=bm, BLOCK_N=bn,
                 SPLIT=split, INLINE_MERGE=inline, UPCAST=False, USE_PDL=True, PAGE_AHEAD=ahead,
                 HEADS_FIRST=order[0], EARLY_LOADS=order[1], ONE_LOOP=True)
        yield (f"attention BM{bm} BN{bn} G{g} split={split} page_ahead={ahead} heads_first/early={order}",
               triton_attention._paged_attention_kernel, attn_types, c, 4, 3)
    c = dict(G=1, QT=16, PAGE=16, HEAD_DIM=128, D_PAD=128, BLOCK_M=16, BLOCK_N=64, SPLIT=False,
             INLINE_MERGE=False, UPCAST=False, USE_PDL=True, PAGE_AHEAD=True, HEADS_FIRST=True, EARLY_LOADS=True,
             ONE_LOOP=False)
    yield "attention BM16 BN64 two key loops (single_key_loop off)", \
        triton_attention._paged_attention_kernel, attn_types, c, 4, 3
    c = dict(G=1, QT=16, PAGE=16, HEAD_DIM=128, D_PAD=128, BLOCK_M=16, BLOCK_N=32, SPLIT=True,
             INLINE_MERGE=False, UPCAST=False, USE_PDL=True, PAGE_AHEAD=True, HEADS_FIRST=True, EARLY_LOADS=True,
             ONE_LOOP=True)
    yield "attention BM16 BN32 split, 2 warps (tile_config's small split tile)", \
        triton_attention._paged_attention_kernel, attn_types, c, 2, 3
    merge_types = {"Out": "*bf16", "Part": "*fp32"}
    # triton_attention.merge_num_warps: 1, 1, 1, 1 and 4 warps
    for s_pad, d_pad in ((8, 128), (16, 128), (8, 256), (32, 64), (64, 128)):
        warps = triton_attention.merge_num_warps(s_pad, d_pad)
        c = dict(HEAD_DIM=d_pad, D_PAD=d_pad, S_PAD=s_pad, USE_PDL=True)
        yield (f"merge_splits S{s_pad} D{d_pad} warps={warps}", triton_attention._merge_splits_kernel, merge_types,
               c, warps, 1)
    rope_types = {n: "*bf16" for n in ("Q", "K", "V", "Cos", "Sin", "QOut", "KCache", "VCache")}
    rope_types["Slots"] = "*i64"
    for early in (True, False):
        c = dict(PAGE=16, HALF=64, HALF_PAD=64, HQ_PAD=32, HK_PAD=8, USE_PDL=True, EARLY_LOADS=early)
        yield f"rope_store early={early}", fused._rope_store_kernel, rope_types, c, 4, 1
    for mode, out, step in [(sampling.MODE_FP16, "*fp16", True), (sampling.MODE_BF16, "*bf16", False),
                            (sampling.MODE_PROBS, "*fp32", False)]:
        types = {"Logits": "*fp32", "Temp": "*fp32", "TopK": "*i64", "TopP": "*fp32", "MinP": "*fp32",
                 "Greedy": "*i1", "U": "*fp64", "Out": out, "Tok": "*i64", "Step": "*i64"}
        c = dict(MODE=mode, HAS_STEP=step, CHUNK=sampling.CHUNK)
        yield f"sample mode={mode} step={step}", sampling._sample_kernel, types, c, sampling.NUM_WARPS, 1


@triton.jit
def _probe(X):
    tl.store(X, 1)


PTX_COUNTS = {"cp.async": r"cp\.async\.c[ag]\.", "ld.global": r"ld\.global", "ld.shared": r"ld\.shared",
              "st.shared": r"st\.shared", "ldmatrix": r"ldmatrix", "bar.sync": r"bar\.sync",
              "mma.sync": r"mma\.sync", "wgmma": r"wgmma\.mma_async"}


def ptx_counts(substring: str) -> int:
    """Instruction counts of the PTX of every variant whose name contains `substring`, ptxas's
    register / spill report and the shared memory a program takes (what bounds the programs per
    SM): a first look at what a kernel change does to the code, without a GPU."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    for name, fn, types, c, warps, stages in variants():
        if substring not in name:
            continue
        kernel = compile_kernel(fn, types, c, warps, stages)
        ptx = kernel.asm["ptx"]
        counts = " ".join(f"{k}={len(re.findall(v, ptx))}" for k, v in PTX_COUNTS.items())
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.ptx").write_text(ptx)
            run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(Path(d, "k.ptx")), "-o",
                                  str(Path(d, "k.cubin"))], capture_output=True, text=True)
        regs = re.findall(r"Used (\d+) registers", run.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", run.stderr)
        print(f"{name}: registers={regs[0] if regs else '?'} spill_stores={spills[0] if spills else '?'} "
              f"shared_bytes={kernel.metadata.shared} {counts}")
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--counts":
        return ptx_counts(sys.argv[2])
    try:
        compile_kernel(_probe, {"X": "*i32"}, {}, 1, 1)
    except Exception as e:  # noqa: BLE001 - the toolchain, not our kernels
        print(f"SKIP cannot compile for sm_90 here: {e!r}"[:500], flush=True)
        return 2
    failed = 0
    for name, fn, types, c, warps, stages in variants():
        try:
            compile_kernel(fn, types, c, warps, stages)
            print("ok", name, flush=True)
        except Exception as e:  # noqa: BLE001 - report every variant
            failed += 1
            print("FAIL", name, repr(e)[:500], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
