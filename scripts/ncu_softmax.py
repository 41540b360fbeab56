"""Driver for Nsight Compute: the softmax split kernels (Triton and the CUDA twin) on
4096 bf16 rows of N columns, a few calls each, nothing else on the GPU.

    ncu -k regex:split --launch-skip 2 --launch-count 2 --section SpeedOfLight ... \\
        python scripts/ncu_softmax.py [N]
"""

from __future__ import annotations

import sys

import torch

import fuseml

n = int(sys.argv[1]) if sys.argv[1:] else 65536
x = 3 * torch.randn(4096, n, device="cuda", dtype=torch.bfloat16)
for backend in ("triton", "cuda"):
    for _ in range(3):
        fuseml.ops.softmax(x, backend=backend)
    torch.cuda.synchronize()
    print(backend, "done", flush=True)
