"""Compile the TMA GEMM kernel for sm_90 on a machine without a GPU (no timing).

    PYTHONPATH=src python scripts/offline_tma.py [--lora MODE] [--r R] [--rank RANK]
        [--tile BM-BN-BK-STAGES] [--warps W] [--expand E] [--n N] [--out-sub S]
        [--flatten] [--ptx FILE]

Prints the kernel's shared memory and what its PTX does with memory: global loads and
stores by width, cp.async copies and their waits, TMA copies, wgmma instructions. The
arguments carry the 16-divisibility the launcher's real arguments have (pointers, M, N,
K, strides): without it every pointer access compiles to 2-byte scalar loads and stores,
which is not what runs. Modes: 0 plain layer (``_linear_tma_kernel``), 4 expand, 5
joint, 6 spread (``_lora_tma_kernel``); R stacked columns of adapters of rank RANK
(R > RANK: a mixed batch with B read in place). Used to find why the spread mode's expand
loop waited on each step (NOTES.md, thirteenth round).
"""

from __future__ import annotations

import argparse
import collections
import re

from sm90 import compile_sm90

from fuseml.ops import _gemm
from fuseml.ops._utils import next_pow2

DIVISIBLE = ("M", "N", "K", "stride_rm", "stride_om", "stride_bn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora", type=int, default=6, choices=(0, 4, 5, 6))
    ap.add_argument("--r", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tile", default="64-128-128-4")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--expand", type=int, default=_gemm.SPREAD_EXPAND_STAGES)
    ap.add_argument("--n", type=int, default=4096, help="output columns (sets SLICE)")
    ap.add_argument(
        "--out-sub",
        type=int,
        default=0,
        choices=(0, 1, 2, 4),
        help="plain layer (--lora 0): TMA stores in this many slices (OUT_SUB)",
    )
    ap.add_argument("--flatten", action="store_true", help="FLATTEN the tile loop")
    ap.add_argument("--ptx", help="write the PTX here")
    a = ap.parse_args()
    bm, bn, bk, stages = (int(v) for v in a.tile.split("-"))
    lora, r, rank = a.lora, a.r, a.rank
    r_pad = max(16, next_pow2(r))
    r_block = min(r_pad, 64) if lora == 6 else min(r_pad, 64, rank)
    slice_w = _gemm.spread_slice(r_pad, a.n, bn) if lora == 6 else 16
    kernel = _gemm._linear_tma_kernel if lora == 0 else _gemm._lora_tma_kernel
    descs = {
        "x_desc": (bm, bk), "w_desc": (bn, bk),
        "a_desc": (slice_w, bk) if lora == 6 else (bm, r_block),
        "b_desc": (bn, r_block) if lora == 4 else (bm, bk),
        "o_desc": (bm, bn // a.out_sub) if a.out_sub else (bm, bk),
    }  # fmt: skip
    consts = dict(
        HAS_BIAS=True, HAS_RES=False, ACTIVATION=1, LORA=lora, MULTI=r > rank, R=r, RANK=rank,
        R_PAD=r_pad, R_BLOCK=r_block, PER_ADAPTER_SCALE=False, PRECISION="tf32",
        UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=128,
        FLATTEN=a.flatten, WARP_SPEC=False, OUT_SUB=a.out_sub, PDL=False, SHRINK_K=16, SHRINK_STAGES=1,
        SHRINK_SPLIT=1, B3D=r > rank, EXPAND_STAGES=a.expand, SLICE=slice_w, PHASE=0,
    )  # fmt: skip
    ptr_types = {"ids_ptr": "*i64", "sync_ptr": "*i32"}

    def arg_type(name: str) -> str:
        if name in descs:
            return f"tensordesc<bf16[{descs[name][0]}, {descs[name][1]}]>"
        if name.endswith("_ptr"):
            return ptr_types.get(name, "*bf16")
        return "fp32" if name in ("alpha", "lora_scale") else "i32"

    compiled = compile_sm90(
        kernel, consts, arg_type, lambda name: name.endswith("_ptr") or name in DIVISIBLE,
        num_warps=a.warps, num_stages=stages,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    if a.ptx:
        with open(a.ptx, "w") as f:
            f.write(ptx)
    print(f"LORA {lora}, tile {a.tile}, {a.warps} warps, R {r} (rank {rank}), SLICE {slice_w}, "
          f"expand buffers {a.expand}: shared memory {compiled.metadata.shared} bytes "
          f"(limit {_gemm.SMEM_LIMIT})")  # fmt: skip
    ops = collections.Counter(
        m.group(0)
        for m in re.finditer(
            r"\b(ld\.global[\w.]*|st\.global[\w.]*|cp\.async\.(?:cg|ca)\.shared\.global|"
            r"cp\.async\.wait_group\s+\d+|cp\.async\.bulk\.tensor[\w.:]*|wgmma\.mma_async[\w.]*)",
            ptx,
        )
    )
    for op, count in sorted(ops.items()):
        print(f"  {count:4d}  {' '.join(op.split())}")


if __name__ == "__main__":
    main()
