"""GPU sweep of the streaming skinny-layer kernel's loop (tuning work, not the benchmark).

    PYTHONPATH=src:scripts python scripts/probe_stream.py [M,K,N]   (default 65536,256,64)

A plain 16-bit layer + bias + ReLU whose K fits one step and whose output is one column
tile: the case where ``_linear_stream_kernel`` runs (NOTES.md: 256 -> 64 at 65536 rows,
80% of copy, 1.2x cuBLASLt needs 91%). Variants of its loop, written here, each launched
with PDL as the library launches it:

- ``ptr``: as the library kernel (W loaded once before the loop, x by pointers);
- ``ptr wloop``: W's tile loaded in the loop with x (from L2), so that the first x tiles
  do not wait behind W's round trip;
- ``tma``: x through a tensor descriptor (TMA), the output stored through one;
- ``mem``: the pointer loop with the dot replaced by a sum of x's K / N column blocks:
  the same bytes moved, no tensor cores (the loop's memory ceiling).

Next to them: fuseml's tuned layer, cuBLASLt's fused epilogue (the suite's peer), torch's
copy of the same bytes. Every arm runs in CUDA graphs of calls over 3 input sets in turn
(past the L2, as the suite's graph rows), interleaved over PROBE_ROUNDS rounds (3, the order rotating); the
table gives each arm's median per call, its spread over rounds, and GB/s.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from graph_arms import relu_layer_sets, report, time_arms
from triton.tools.tensor_descriptor import TensorDescriptor

import fuseml.ops
from fuseml.ops._gemm import SMEM_LIMIT
from fuseml.ops._math import _pdl_begin

DT = torch.bfloat16
CALLS = 24  # calls a graph; 3 input sets in turn


@triton.jit
def _stream_ptr(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    WLOOP: tl.constexpr, MEM: tl.constexpr,
):  # fmt: skip
    _pdl_begin()
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]
    if not WLOOP:
        wt = tl.load(w_ptrs)
    bias = tl.load(b_ptr + cols).to(tl.float32)
    for tile_m in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + tile_m * BLOCK_M
        x_ptrs = x_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm + ks[None, :]
        if MEM:  # the same bytes in BLOCK_N-column blocks, summed (no layout change)
            x_rows = x_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm + cols[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c in tl.static_range(BLOCK_K // BLOCK_N):
                acc += tl.load(x_rows + c * BLOCK_N).to(tl.float32)
        else:
            xt = tl.load(x_ptrs)
            if WLOOP:
                wt = tl.load(w_ptrs)
            acc = tl.dot(xt, wt)
        acc = tl.maximum(acc + bias[None, :], 0.0)
        o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None])


@triton.jit
def _stream_tma(
    x_desc, w_ptr, b_ptr, out_desc, M, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    _pdl_begin()
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    wt = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None])
    bias = tl.load(b_ptr + cols).to(tl.float32)
    for tile_m in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
        xt = x_desc.load([tile_m * BLOCK_M, 0])
        acc = tl.maximum(tl.dot(xt, wt) + bias[None, :], 0.0)
        out_desc.store([tile_m * BLOCK_M, 0], acc.to(out_desc.dtype))


def main() -> None:
    m, k, n = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "65536,256,64").split(","))
    rounds = int(os.environ.get("PROBE_ROUNDS", "3"))
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    xs, w, b, outs, ref = relu_layer_sets(m, k, n, DT)
    nbytes = (m * k + m * n) * 2
    half = nbytes // 4  # a copy of nbytes / 2 moves nbytes
    src = [torch.empty(half, device=dev, dtype=torch.int16) for _ in range(3)]
    dst = [torch.empty(half, device=dev, dtype=torch.int16) for _ in range(3)]

    arms = {
        "fuseml.ops.linear (tuned)": lambda i: fuseml.ops.linear(
            xs[i % 3], w, b, activation="relu"),
        "cuBLASLt fused epilogue": lambda i: torch._addmm_activation(b, xs[i % 3], w.t()),
        "copy of the same bytes": lambda i: dst[i % 3].copy_(src[i % 3]),
        "torch.sum of K / N column blocks": lambda i: torch.sum(
            xs[i % 3].view(m, k // n, n), 1, out=outs[i % 3]),
    }  # fmt: skip
    checked = set()  # arms whose output is compared with the reference

    def ptr_arm(bm, stages, warps, per_sm, wloop=False, mem=False):
        grid = (min(triton.cdiv(m, bm), sms * per_sm),)
        smem = (stages * bm * k + (0 if wloop else n * k) + bm * n) * 2
        if wloop:
            smem += stages * n * k * 2
        if smem > SMEM_LIMIT:
            return
        tag = f"{'mem' if mem else 'ptr'}{' wloop' if wloop else ''} bm{bm} s{stages} w{warps} {per_sm}/SM"

        def run(i):
            _stream_ptr[grid](
                xs[i % 3], w, b, outs[i % 3], m, n, k, k, k, n, BLOCK_M=bm, BLOCK_N=n,
                BLOCK_K=k, STAGES=stages, WLOOP=wloop, MEM=mem,
                num_warps=warps, num_stages=stages, launch_pdl=True,
            )  # fmt: skip

        arms[tag] = run
        if not mem:
            checked.add(tag)

    def tma_arm(bm, stages, warps, per_sm):
        grid = (min(triton.cdiv(m, bm), sms * per_sm),)
        if (stages * bm * k + n * k + 2 * bm * n) * 2 > SMEM_LIMIT:
            return
        xd = [TensorDescriptor.from_tensor(x, [bm, k]) for x in xs]
        od = [TensorDescriptor.from_tensor(o, [bm, n]) for o in outs]
        tag = f"tma bm{bm} s{stages} w{warps} {per_sm}/SM"

        def run(i):
            _stream_tma[grid](
                xd[i % 3], w, b, od[i % 3], m, k, BLOCK_M=bm, BLOCK_N=n, BLOCK_K=k,
                STAGES=stages, num_warps=warps, num_stages=stages, launch_pdl=True,
            )  # fmt: skip

        arms[tag] = run
        checked.add(tag)

    for bm, per_sm in ((64, 1), (32, 2), (64, 2), (128, 1), (32, 1)):
        for stages in (2, 3, 4, 5):
            ptr_arm(bm, stages, 4, per_sm)
            ptr_arm(bm, stages, 4, per_sm, wloop=True)
            tma_arm(bm, stages, 4, per_sm)
            ptr_arm(bm, stages, 4, per_sm, mem=True)
    for stages in (3, 4):
        ptr_arm(128, stages, 8, 1)
        tma_arm(128, stages, 8, 1)

    only = os.environ.get("PROBE_ONLY")
    if only:
        keep = set(list(arms)[:4]) | {t for t in arms if any(p in t for p in only.split(","))}
        arms = {t: f for t, f in arms.items() if t in keep}
    print(f"{torch.cuda.get_device_name(dev)}: {m} x {k} -> {n} bf16 + bias + ReLU, "
          f"{nbytes / 1e6:.1f} MB a call; {len(arms)} arms x {rounds} rounds", flush=True)  # fmt: skip
    times, failed = time_arms(arms, checked, outs[0], ref, rounds, CALLS)
    report(times, failed, "cuBLASLt fused epilogue",
           lambda us: f"{nbytes / us / 1e3:7.0f} GB/s", 34)  # fmt: skip


if __name__ == "__main__":
    main()
