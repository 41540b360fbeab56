# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""fp32 linear with TF32 off: cuBLAS against fuseml's kernels per dot precision.

    PYTHONPATH=src python scripts/probe_fp32.py [M,K,N ...]

Per shape: GPU time (CUDA-graph replay) and relative error against a float64 reference
for F.linear + ReLU (cuBLAS SGEMM), and fuseml.ops.linear with the pointer or TMA kernel
(FUSEML_GEMM) and the dot precision "ieee" (FMA) or "tf32x3" (three TF32 products).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton.testing

import fuseml
from fuseml.testing import rel_err


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = sys.argv[1:] or ["64,512,256", "4096,512,256", "64,1024,1024", "4096,1024,1024"]
    for spec in shapes:
        m, k, n = (int(v) for v in spec.split(","))
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") / k**0.5
        b = torch.randn(n, device="cuda")
        ref = F.relu(F.linear(x.double(), w.double(), b.double()))
        print(f"== M={m} K={k} N={n} fp32, ReLU")
        arms = {"cublas": lambda: F.relu(F.linear(x, w, b))}
        for loop in ("ptr", "tma"):
            for prec in ("ieee", "tf32x3"):

                def run(loop=loop, prec=prec):
                    os.environ["FUSEML_GEMM"] = loop
                    os.environ["FUSEML_FP32_DOT"] = prec
                    return fuseml.ops.linear(x, w, b, "relu", backend="triton")

                arms[f"{loop}-{prec}"] = run
        for name, fn in arms.items():
            try:
                out = fn()  # tunes
                torch.cuda.synchronize()
                us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
                print(f"  {name:12s} {us:9.2f} us  rel err {rel_err(out, ref):.2e}", flush=True)
            except Exception as e:
                print(f"  {name:12s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
