"""GPU probe of the 1M-element add gap: fuseml's flat kernels against torch.compile's at
the same launch shape, and lean kernels that differ from fuseml's in one thing each, to
find what the ~0.1 us (Triton) / ~0.15 us (CUDA twin) is. Timed as the suites time them
(CUDA-graph replay, inputs rotating past twice the L2, arms interleaved over rounds).

    PYTHONPATH=src python scripts/probe_add_gap.py

Triton arms, each one 16-byte vector a thread where the dtype allows (fp32: 512 elements
/ 4 warps as the library; bf16: 1024 / 4, torch.compile's config at 1M):
  lean, n runtime     three pointers and the element count (torch.compile's kernel, with
                      its element count passed instead of written into the source)
  lean, n constexpr   the same with the count a constexpr (torch.compile's kernel as built)
  lean + params       the lean body with fuseml's kernel's other arguments (bias pointer,
                      row count, strides, alpha) passed and unused
  lean + alpha fma    the lean body computing x + alpha * y, as fuseml's kernel does
CUDA arms (built inline): a lean kernel of three pointers and a count, and the same body
taking its arguments as one struct the size of the twin's (96 bytes).

PROBE_PLACEMENT=1 asks instead whether the gap follows the code or the output buffer's
place in memory: every arm writes into given buffers (torch.compile of torch.add with
out=, fuseml's bias_act with out= and no bias, which is its add, and the lean kernel at
fuseml's and at torch.compile's block). First each of PROBE_BUFFERS buffers in turn, the
same for every arm (the suites' graphs write one buffer call after call), then outputs
rotating with the inputs (one buffer an input set).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from probe_launch_bound import rotated, table

import fuseml

NUMEL = int(os.environ.get("PROBE_NUMEL", "1000000"))


@triton.jit
def _lean(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(x_ptr + offs, mask).to(tl.float32) + tl.load(y_ptr + offs, mask).to(tl.float32)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask)


@triton.jit
def _lean_const(x_ptr, y_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(x_ptr + offs, mask).to(tl.float32) + tl.load(y_ptr + offs, mask).to(tl.float32)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask)


@triton.jit
def _lean_params(
    x_ptr, y_ptr, b_ptr, out_ptr, n_rows, n, s_x, s_y, s_o, alpha, BLOCK: tl.constexpr
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(x_ptr + offs, mask).to(tl.float32) + tl.load(y_ptr + offs, mask).to(tl.float32)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask)


@triton.jit
def _lean_fma(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask).to(tl.float32)
    h = x + tl.cast(alpha, tl.float32) * tl.load(y_ptr + offs, mask).to(tl.float32)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask)


CUDA_SRC = r"""
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

struct Big {
  const float4* x; const float4* y; const float4* b; float4* out;
  long long s0, s1, s2, items, rows, tiles; int shift, tail, wide; float alpha;
};

__global__ void __launch_bounds__(128) lean(const float4* x, const float4* y, float4* out, int n) {
  const int i = blockIdx.x * 128 + threadIdx.x;
  if (i >= n) return;
  const float4 a = x[i], b = y[i];
  out[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

__global__ void __launch_bounds__(128) big(const Big p) {
  const int i = blockIdx.x * 128 + threadIdx.x;
  if (i >= static_cast<int>(p.items)) return;
  const float4 a = p.x[i], b = p.y[i];
  p.out[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

void add_lean(torch::Tensor x, torch::Tensor y, torch::Tensor out, bool as_struct) {
  const int n = static_cast<int>(x.numel() / 4);
  const int blocks = (n + 127) / 128;
  auto stream = at::cuda::getCurrentCUDAStream();
  auto px = reinterpret_cast<const float4*>(x.data_ptr<float>());
  auto py = reinterpret_cast<const float4*>(y.data_ptr<float>());
  auto po = reinterpret_cast<float4*>(out.data_ptr<float>());
  if (as_struct) {
    Big p{px, py, px, po, 0, 0, 0, n, 0, 0, 0, 0, 0, 1.f};
    big<<<blocks, 128, 0, stream>>>(p);
  } else {
    lean<<<blocks, 128, 0, stream>>>(px, py, po, n);
  }
}
"""


CPP_DECL = "void add_lean(torch::Tensor x, torch::Tensor y, torch::Tensor out, bool as_struct);"


def main() -> None:
    from torch.utils.cpp_extension import load_inline

    ext = None
    if os.environ.get("PROBE_CUDA", "1") == "1":
        ext = load_inline(
            "fuseml_add_gap", cpp_sources=CPP_DECL, cuda_sources=CUDA_SRC, functions=["add_lean"],
            extra_cuda_cflags=["-O3", "-arch=sm_90"], verbose=False,
        )  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        es = torch.empty((), dtype=dtype).element_size()
        block = 2048 // es  # one 16-byte vector for each of 4 warps' threads
        grid = (triton.cdiv(NUMEL, block),)
        sets = rotated(
            lambda dtype=dtype: (
                torch.randn(NUMEL, device="cuda", dtype=dtype),
                torch.randn(NUMEL, device="cuda", dtype=dtype),
            ),
            3 * NUMEL * es,
        )

        def launch(kernel, *extra, grid=grid, block=block):
            def run(a, b):
                out = torch.empty_like(a)
                kernel[grid](a, b, out, *extra, BLOCK=block, num_warps=4)
                return out

            return run

        def params(a, b, grid=grid, block=block):
            out = torch.empty_like(a)
            _lean_params[grid](a, b, a, out, 1, NUMEL, 0, 0, 0, 1.0, BLOCK=block, num_warps=4)
            return out

        arms = {
            "compile": torch.compile(lambda a, b: a + b, dynamic=False),
            "torch.add": lambda a, b: a + b,
            "fuseml triton": lambda a, b: fuseml.ops.add(a, b, backend="triton"),
            "lean, n runtime": launch(_lean, NUMEL),
            "lean, n constexpr": launch(_lean_const, NUMEL),
            "lean + params": params,
            "lean + alpha fma": launch(_lean_fma, NUMEL, 1.0),
        }
        if ext is not None:
            arms["fuseml cuda"] = lambda a, b: fuseml.ops.add(a, b, backend="cuda")
            if dtype == torch.float32:
                for as_struct in (False, True):

                    def cuda_lean(a, b, as_struct=as_struct):
                        out = torch.empty_like(a)
                        ext.add_lean(a, b, out, as_struct)
                        return out

                    arms[f"cuda lean{', 96-byte struct' if as_struct else ''}"] = cuda_lean
        table(f"add {str(dtype)[6:]} {NUMEL} (block {block}, 4 warps)", arms, sets)
        if os.environ.get("PROBE_PROFILE") == "1":
            profile(arms, sets)


def placement() -> None:
    """Arms timed on the same output buffers (see the module docstring)."""
    dtype = torch.float32
    n_buf = int(os.environ.get("PROBE_BUFFERS", "6"))
    sets = rotated(
        lambda: (
            torch.randn(NUMEL, device="cuda", dtype=dtype),
            torch.randn(NUMEL, device="cuda", dtype=dtype),
        ),
        3 * NUMEL * 4,
    )
    outs = [torch.empty(NUMEL, device="cuda", dtype=dtype) for _ in range(max(n_buf, len(sets)))]

    def lean(block):
        def run(a, b, o):
            _lean[(triton.cdiv(NUMEL, block),)](a, b, o, NUMEL, BLOCK=block, num_warps=4)
            return o

        return run

    def fused(backend):
        def run(a, b, o):
            return fuseml.ops.bias_act(a, None, b, 1.0, "none", out=o, backend=backend)

        return run

    arms = {
        "compile out=": torch.compile(lambda a, b, o: torch.add(a, b, out=o), dynamic=False),
        "fuseml triton": fused("triton"),
        "fuseml cuda": fused("cuda"),
        "lean 512 / 4": lean(512),
        "lean 1024 / 4": lean(1024),
    }
    for j in range(n_buf):
        table(f"add fp32 {NUMEL}, output buffer {j} (every call)", arms,
              [(a, b, outs[j]) for a, b in sets])  # fmt: skip
    table(f"add fp32 {NUMEL}, outputs rotating with the inputs", arms,
          [(a, b, outs[i]) for i, (a, b) in enumerate(sets)])  # fmt: skip
    if os.environ.get("PROBE_PROFILE") == "1":
        profile(arms, [(a, b, outs[0]) for a, b in sets])


def profile(arms: dict, sets: list[tuple]) -> None:
    """Each arm's CUDA kernels in a replay of a graph of 8 calls (torch.profiler): the
    kernels a call launches and their mean GPU time, to tell a slower kernel from extra
    work around it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in arms.items():
        graph = torch.cuda.CUDAGraph()
        fn(*sets[0])
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for k in range(8):
                fn(*sets[k % len(sets)])
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
        rows = [
            e for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count > 0
        ]  # fmt: skip
        kernels = ", ".join(
            f"{e.key[:60]} x{e.count / 160:.2f} {e.device_time_total / e.count:.2f} us"
            for e in rows
        )
        print(f"  {name:24s} {kernels}")
        del graph


if __name__ == "__main__":
    placement() if os.environ.get("PROBE_PLACEMENT") == "1" else main()
