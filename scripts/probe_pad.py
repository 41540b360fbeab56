# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Linear layers with a K whose rows are not 16-byte aligned (the DLRM's 367 -> 512):
fuseml.ops.linear as is, against the same layer with x and W zero-padded to a K that is
(the padded W made once; x padded per call, timed with it and alone), and cuBLASLt.

    PYTHONPATH=src python scripts/probe_pad.py [K,N] [M ...]

GPU time per call from CUDA-graph replays (us), bf16, bias + ReLU.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton.testing

import fuseml


def main() -> None:
    k, n = (int(v) for v in (sys.argv[1] if sys.argv[1:] else "367,512").split(","))
    ms = [int(v) for v in sys.argv[2:]] or [1, 16, 64, 512, 4096, 65536]
    kp = -(-k // 16) * 16
    dt = torch.bfloat16
    w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dt)
    wp = F.pad(w, (0, kp - k))
    print(f"== K={k} (padded {kp}) N={n} bf16 relu, us per call (graph)")
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        xp = F.pad(x, (0, kp - k))
        arms = {
            "as is": lambda: fuseml.ops.linear(x, w, b, "relu"),
            "padded x, W": lambda: fuseml.ops.linear(xp, wp, b, "relu"),
            "pad x only": lambda: F.pad(x, (0, kp - k)),
            "pad x + linear": lambda: fuseml.ops.linear(F.pad(x, (0, kp - k)), wp, b, "relu"),
            "cublaslt": lambda: torch._addmm_activation(b, x, w.t()),
        }
        line = []
        for name, fn in arms.items():
            fn()  # tunes
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3
            line.append(f"{name} {us:7.1f}")
        print(f"  M={m:6d}  " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
