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
  the same bytes moved, no tensor cores (the loop's memory ceiling);
- ``hint``: the pointer loop or ``mem`` with x's loads marked evict-first (Triton 3.6
  drops the mark on loads it pipelines through cp.async) and the output's stores
  streaming (``.cs``);
- ``cuda rows`` / ``cuda read``: the memory floor outside Triton (PROBE_CUDA=1, the
  default; built with nvcc on first run): a grid-stride CUDA C++ kernel with 16-byte
  loads, eight threads a row, U rows a thread in flight, that writes each row's sum of
  its four column blocks (the same bytes as the layer) / reads x alone (the floor for
  its reads; 256 -> 64 only).

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

CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>

// Eight threads a row of 256 bf16 (32 16-byte vectors): thread j reads vectors j, j + 8,
// j + 16, j + 24 (its 8 columns of each 64-column block) and writes their sum, vector j
// of the row's 64 outputs. U rows a thread are loaded before any is summed. READ: no
// output but one word a thread, written only if the sums hit a value they cannot reach.
template <int U, bool READ>
__global__ void mem_rows(const uint4* __restrict__ x, uint4* __restrict__ out, long rows) {
  const long tid = blockIdx.x * (long)blockDim.x + threadIdx.x;
  const long groups = (long)gridDim.x * blockDim.x / 8;
  const int j = threadIdx.x % 8;
  __nv_bfloat162 keep = __float2bfloat162_rn(0.f);
  for (long r0 = tid / 8; r0 < rows; r0 += groups * U) {
    uint4 v[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long r = r0 + u * groups;
#pragma unroll
      for (int c = 0; c < 4; ++c)
        v[u][c] = r < rows ? __ldcs(x + r * 32 + c * 8 + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint4 s = v[u][0];
      auto* ps = reinterpret_cast<__nv_bfloat162*>(&s);
#pragma unroll
      for (int c = 1; c < 4; ++c) {
        const auto* pc = reinterpret_cast<const __nv_bfloat162*>(&v[u][c]);
#pragma unroll
        for (int e = 0; e < 4; ++e) ps[e] = __hadd2(ps[e], pc[e]);
      }
      const long r = r0 + u * groups;
      if (READ) {
        keep = __hadd2(keep, ps[0]);
      } else if (r < rows) {
        __stcs(out + r * 8 + j, s);
      }
    }
  }
  if (READ && __bfloat162float(keep.x) == 12345.f) out[tid % 8] = make_uint4(1, 1, 1, 1);
}

void mem_rows_launch(torch::Tensor x, torch::Tensor out, int64_t blocks, int64_t threads,
                     int64_t unroll, bool read) {
  TORCH_CHECK(x.size(1) == 256 && out.size(1) == 64, "x: (M, 256), out: (M, 64)");
  auto px = reinterpret_cast<const uint4*>(x.data_ptr());
  auto po = reinterpret_cast<uint4*>(out.data_ptr());
  auto stream = at::cuda::getCurrentCUDAStream();
  const long rows = x.size(0);
#define FUSEML_GO(U, R) mem_rows<U, R><<<blocks, threads, 0, stream>>>(px, po, rows)
  if (read) {
    if (unroll == 1) FUSEML_GO(1, true); else if (unroll == 2) FUSEML_GO(2, true);
    else FUSEML_GO(4, true);
  } else {
    if (unroll == 1) FUSEML_GO(1, false); else if (unroll == 2) FUSEML_GO(2, false);
    else FUSEML_GO(4, false);
  }
#undef FUSEML_GO
}
"""
CPP_DECL = (
    "void mem_rows_launch(torch::Tensor x, torch::Tensor out, int64_t blocks, "
    "int64_t threads, int64_t unroll, bool read);"
)


@triton.jit
def _stream_ptr(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    WLOOP: tl.constexpr, MEM: tl.constexpr, HINT: tl.constexpr = False,
):  # fmt: skip
    _pdl_begin()
    policy: tl.constexpr = "evict_first" if HINT else ""
    store_cache: tl.constexpr = ".cs" if HINT else ""
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
                acc += tl.load(x_rows + c * BLOCK_N, eviction_policy=policy).to(tl.float32)
        else:
            xt = tl.load(x_ptrs, eviction_policy=policy)
            if WLOOP:
                wt = tl.load(w_ptrs)
            acc = tl.dot(xt, wt)
        acc = tl.maximum(acc + bias[None, :], 0.0)
        o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(
            o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None],
            cache_modifier=store_cache,
        )  # fmt: skip


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

    def ptr_arm(bm, stages, warps, per_sm, wloop=False, mem=False, hint=False):
        grid = (min(triton.cdiv(m, bm), sms * per_sm),)
        smem = (stages * bm * k + (0 if wloop else n * k) + bm * n) * 2
        if wloop:
            smem += stages * n * k * 2
        if smem > SMEM_LIMIT:
            return
        tag = (f"{'mem' if mem else 'ptr'}{' wloop' if wloop else ''}{' hint' if hint else ''}"
               f" bm{bm} s{stages} w{warps} {per_sm}/SM")  # fmt: skip

        def run(i):
            _stream_ptr[grid](
                xs[i % 3], w, b, outs[i % 3], m, n, k, k, k, n, BLOCK_M=bm, BLOCK_N=n,
                BLOCK_K=k, STAGES=stages, WLOOP=wloop, MEM=mem, HINT=hint,
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
    for bm, per_sm, stages in ((64, 1, 3), (64, 2, 4), (32, 2, 4), (64, 2, 3)):
        ptr_arm(bm, stages, 4, per_sm, hint=True)
        ptr_arm(bm, stages, 4, per_sm, mem=True, hint=True)
    if os.environ.get("PROBE_CUDA", "1") == "1" and (k, n) == (256, 64):
        from torch.utils.cpp_extension import load_inline

        ext = load_inline(
            "fuseml_probe_stream", cpp_sources=CPP_DECL, cuda_sources=CUDA_SRC,
            functions=["mem_rows_launch"], extra_cuda_cflags=["-O3", "-arch=sm_90"],
        )  # fmt: skip
        for read in (False, True):
            for per_sm, threads in ((4, 256), (8, 256), (2, 512), (16, 128)):
                for unroll in (1, 2, 4):
                    tag = f"cuda {'read' if read else 'rows'} {per_sm}x{threads} U{unroll}"
                    arms[tag] = lambda i, a=(sms * per_sm, threads, unroll, read): (
                        ext.mem_rows_launch(xs[i % 3], outs[i % 3], *a)
                    )

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
