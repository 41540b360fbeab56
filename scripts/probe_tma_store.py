"""GPU sweep: a persistent TMA GEMM whose epilogue stores through a tensor descriptor
(tuning work, not the benchmark).

    PYTHONPATH=src:scripts python scripts/probe_tma_store.py [M,K,N ...]   (default 4096,1024,1024)

fuseml's TMA kernel (``_tma_body``) loads x and W through descriptors but stores its
output tile with pointer stores from registers. Here the output tile goes to shared memory
and out through a TMA store, whole or in SUB column slices (each slice's store in flight
while the next is converted), in a persistent tile loop with or without ``flatten`` /
``warp_specialize``. bf16 + bias + ReLU (the linear suite's 1024 -> 1024 rows), launched
with PDL as fuseml's layers are. Next to it: cuBLASLt's fused epilogue (the suite's peer)
and fuseml's tuned layer. Every arm runs in CUDA graphs of calls over input sets in turn
(past twice the L2, as the suite's graph rows), interleaved over PROBE_ROUNDS rounds (3).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from graph_arms import report, time_arms
from triton.tools.tensor_descriptor import TensorDescriptor

import fuseml.ops
from fuseml.ops._gemm import _grouped_coords, _tma_store
from fuseml.ops._math import _pdl_begin

DT = torch.bfloat16
CALLS = 20


@triton.jit
def _gemm_tma_store(
    x_desc, w_desc, o_desc, b_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, SUB: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    _pdl_begin()
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(
        tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN, warp_specialize=WS
    ):
        pid_m, pid_n = _grouped_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_steps):
            a = x_desc.load([off_m, kk * BLOCK_K])
            b = w_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        cols = off_n + tl.arange(0, BLOCK_N)
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc = tl.maximum(acc + bias[None, :], 0.0)
        _tma_store(o_desc, acc, off_m, off_n, BLOCK_M, BLOCK_N, SUB)  # fuseml's slices


def sweep(m: int, k: int, n: int, rounds: int) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    per_set = (m * k + n * k + m * n) * 2
    nsets = max(2, -(-2 * 50 * 2**20 // per_set) + 1)
    torch.manual_seed(0)
    sets = [
        (torch.randn(m, k, device=dev, dtype=DT), torch.randn(n, k, device=dev, dtype=DT) / k**0.5,
         torch.randn(n, device=dev, dtype=DT), torch.empty(m, n, device=dev, dtype=DT))
        for _ in range(nsets)
    ]  # fmt: skip
    x0, w0, b0, o0 = sets[0]
    ref = torch.relu(x0.double() @ w0.double().t() + b0.double())
    arms = {
        "fuseml.ops.linear (tuned)": lambda i: fuseml.ops.linear(
            sets[i % nsets][0], sets[i % nsets][1], sets[i % nsets][2], activation="relu"),
        "cuBLASLt fused epilogue": lambda i: torch._addmm_activation(
            sets[i % nsets][2], sets[i % nsets][0], sets[i % nsets][1].t()),
    }  # fmt: skip
    checked = set()
    only = os.environ.get("PROBE_ONLY")
    specs = os.environ.get(
        "PROBE_TILES",
        "128-256-64-8-3,128-256-64-8-4,64-256-64-8-4,128-128-64-8-4,256-128-64-8-3",
    )
    for spec in specs.split(","):
        bm, bn, bk, warps, stages = (int(v) for v in spec.split("-"))
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        programs = min(tiles, sms)
        descs = [
            (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]))
            for x, w, _, _ in sets
        ]  # fmt: skip
        for sub in (1, 2, 4):
            od = [TensorDescriptor.from_tensor(o, [bm, bn // sub]) for *_, o in sets]
            for flatten, ws in ((False, False), (True, False), (False, True)):
                tag = (f"tma-store {bm}x{bn}x{bk} w{warps} s{stages} sub{sub}"
                       f"{' flat' if flatten else ''}{' ws' if ws else ''}")  # fmt: skip
                if only and not any(p in tag for p in only.split(",")):
                    continue

                def run(i, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, sub=sub, od=od,
                        descs=descs, programs=programs, flatten=flatten, ws=ws):  # fmt: skip
                    j = i % nsets
                    _gemm_tma_store[(programs,)](
                        descs[j][0], descs[j][1], od[j], sets[j][2], m, n, k,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PROGRAMS=programs,
                        SUB=sub, FLATTEN=flatten, WS=ws, num_warps=warps, num_stages=stages,
                        launch_pdl=True,
                    )  # fmt: skip

                arms[tag] = run
                checked.add(tag)
    print(f"{torch.cuda.get_device_name(dev)}: {m} x {k} -> {n} bf16 + bias + ReLU, "
          f"{2 * m * n * k / 1e9:.2f} GFLOP; {nsets} input sets; {len(arms)} arms x {rounds} "
          "rounds", flush=True)  # fmt: skip
    times, failed = time_arms(arms, checked, o0, ref, rounds, CALLS)
    report(times, failed, "cuBLASLt fused epilogue",
           lambda us: f"{2 * m * n * k / us / 1e6:6.0f} TFLOP/s", 44)  # fmt: skip


def main() -> None:
    rounds = int(os.environ.get("PROBE_ROUNDS", "3"))
    for shape in sys.argv[1:] or ["4096,1024,1024"]:
        sweep(*(int(v) for v in shape.split(",")), rounds)


if __name__ == "__main__":
    main()
