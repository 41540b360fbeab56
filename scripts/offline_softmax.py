"""Compile the split softmax kernel for sm_90 on a machine without a GPU (no timing) and
print its registers a thread and its PTX's memory instructions.

    PYTHONPATH=src python scripts/offline_softmax.py [--dtype bf16] [--block 8192]
        [--chunk 7184] [--chunks 7] [--warps 8] [--log] [--float] [--maxnreg N]

The registers come from ``ptxas -v`` run on the kernel's PTX with the ptxas that ships
with the installed triton, so they depend on the triton version: the GPU machines' triton
3.6 and a newer one differ (NOTES.md, seventeenth round). To predict the GPU's count,
run this from a scratch venv with ``triton==3.6.0`` (and a CPU torch). The arguments
carry the 16-divisibility the launcher's real pointers have. --float: the float32 path
(PAIRS off) instead of int32 pairs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from sm90 import compile_sm90

sm = importlib.import_module("fuseml.ops.softmax")  # the module, not the op
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--block", type=int, default=8192, help="BLOCK_N: columns a program")
    ap.add_argument("--chunk", type=int, default=7184, help="CHUNK: columns it takes")
    ap.add_argument("--chunks", type=int, default=7, help="programs a row")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--log", action="store_true", help="log_softmax")
    ap.add_argument("--float", action="store_true", help="float32 values, not int32 pairs")
    ap.add_argument("--maxnreg", type=int, help="register cap (the PTX's .maxnreg)")
    a = ap.parse_args()
    pairs = a.dtype != "fp32" and not a.float
    kernel = sm._softmax_split_kernel
    consts = dict(
        LOG=a.log, BLOCK_N=a.block, CHUNK=a.chunk, BLOCK_G=triton.next_power_of_2(a.chunks),
        VEC=16 // (4 if a.dtype == "fp32" else 2), PHASE=0, FAST=True, GRID2D=True,
        PDL=False, PAIRS=pairs, NEG_PAIR=sm._NEG_PAIR[DTYPES[a.dtype]] if pairs else 0,
    )  # fmt: skip
    ptr_types = {"x_ptr": f"*{a.dtype}", "out_ptr": f"*{a.dtype}", "stats_ptr": "*fp32",
                 "count_ptr": "*i32"}  # fmt: skip
    options = {"num_warps": a.warps}
    if a.maxnreg:
        options["maxnreg"] = a.maxnreg
    compiled = compile_sm90(
        kernel, consts, lambda name: ptr_types.get(name, "i32"), ptr_types.__contains__, **options
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "split.ptx")
        with open(path, "w") as f:
            # triton 3.9 writes PTX 9.x, which its own bundled ptxas (8.8) does not take
            f.write(re.sub(r"^\.version 9\.\d+", ".version 8.8", ptx, flags=re.M))
        info = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "split.cubin")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    print(f"triton {triton.__version__}, {a.dtype}, BLOCK_N {a.block}, CHUNK {a.chunk}, "
          f"{a.warps} warps, {'log_softmax' if a.log else 'softmax'}, "
          f"{'int32 pairs' if pairs else 'float32 values'}")  # fmt: skip
    for line in info.stderr.splitlines():
        if "registers" in line or "spill" in line or "error" in line:
            print(" ", line.strip())
    ops = collections.Counter(
        re.findall(r"\b(ld\.global[\w.]*|st\.global[\w.]*|atom[\w.]*|bar\.sync)", ptx)
    )
    for op, count in sorted(ops.items()):
        print(f"  {count:4d}  {op}")


if __name__ == "__main__":
    main()
