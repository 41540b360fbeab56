"""Suite ``lora``: a LoRA-adapted 4096 x 4096 projection, out = x @ W^T + b + s (x @ A^T) @ B^T,
bf16, M = 1 to 8,192 rows; ranks 8, 16, 64; and mixed batches over 1, 4 or 16 adapters.

Single adapter (kind "single")
  eager    fuseml.ops.lora_linear_ref, the unmerged peft chain: three GEMMs and an add
  merged   F.linear with W' = W + s B A, merged outside the timing (one cuBLAS GEMM; the
           function differs from the unmerged one only by rounding W' to bf16, well inside
           the bf16 tolerance of the output check)
  compile  torch.compile of the reference (default mode)
  triton   fuseml.ops.lora_linear(backend="triton"): the rank-r term inside the GEMM tiles
  triton-op  torch.ops.fuseml.lora_linear, the dispatcher path (host overhead rows only)

Multi-adapter (kind "multi", rank 16): every row picks one adapter at random, 1 row in 8
none (id -1)
  eager          fuseml.ops.lora_linear_ref with adapter_ids: one masked pass per adapter
                 (peft's mixed-batch loop; each pass syncs with the host)
  triton         fuseml.ops.lora_linear with adapter_ids, check_ids=False: one launch
  triton-single  the fused single-adapter layer at the same M (adapter 0 on every row): a
                 reference row for what the mixing costs, not checked (another function)

A and B are drawn like peft's A (uniform, 1/sqrt(in)) and a random B (peft starts B at
zero, which would make the adapter term vanish and the output check blind to it).
Rate: TFLOP/s of the unmerged layer (2 M N K + 2 M r (K + N), rows without an adapter not
counted) for every arm, against the bf16 matmul ceiling; rows also carry GB/s for x, W, b,
A, B and out moved once, and % of the roofline.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import fuseml
from fuseml.bench.harness import Case
from fuseml.bench.suites._common import dtype_name, launch_bound, linear_params

HIDDEN = 4096  # in = out
SCALING = 2.0  # peft's lora_alpha / r with lora_alpha = 2 r
DTYPE = torch.bfloat16
RANKS_FULL = [8, 16, 64]
M_FULL = [1, 16, 64, 256, 512, 1024, 4096, 8192]
ADAPTERS_FULL = [1, 4, 16]
MULTI_M_FULL = [16, 256, 1024, 4096]
MULTI_RANK = 16
RANKS_QUICK = [16, 64]
M_QUICK = [1, 256, 4096]
ADAPTERS_QUICK = [4, 16]
MULTI_M_QUICK = [1024]
NO_ADAPTER_EVERY = 8  # multi-adapter batches: M // 8 rows get id -1 (base weight only)


def _adapter(rank: int, n_adapters: int | None, device: str):
    """peft-style A (r, in) / B (out, r), stacked (adapters, ...) when n_adapters is set."""
    lead = () if n_adapters is None else (n_adapters,)
    bound = 1.0 / math.sqrt(HIDDEN)
    a = torch.empty(*lead, rank, HIDDEN, device=device).uniform_(-bound, bound)
    b = torch.randn(*lead, HIDDEN, rank, device=device) / math.sqrt(rank)
    return a.to(DTYPE), b.to(DTYPE)


def _params(kind: str, rank: int, adapters: int, m: int) -> dict:
    return {"op": "lora_linear", "kind": kind, "rank": rank, "adapters": adapters,
            "dtype": dtype_name(DTYPE), "m": m, "numel": m * HIDDEN,
            "shape": [m, HIDDEN, HIDDEN]}  # fmt: skip


def single_case(m: int, rank: int, *, overhead: bool = False, device: str = "cuda") -> Case:
    k = n = HIDDEN
    es = torch.empty((), dtype=DTYPE).element_size()

    def make():
        x = torch.randn(m, k, device=device, dtype=DTYPE)
        w, b = linear_params(n, k, DTYPE, device)
        a, bb = _adapter(rank, None, device)
        merged = (w.float() + SCALING * (bb.float() @ a.float())).to(DTYPE)
        return x, w, b, a, bb, merged

    def eager(x, w, b, a, bb, merged):
        return fuseml.ops.lora_linear_ref(x, w, b, a, bb, SCALING)

    arms = {
        "eager": eager,
        "merged": lambda x, w, b, a, bb, merged: F.linear(x, merged, b),
        "compile": torch.compile(lambda *t: eager(*t), dynamic=False),
        "triton": lambda x, w, b, a, bb, merged: fuseml.ops.lora_linear(
            x, w, b, a, bb, SCALING, backend="triton"
        ),
    }
    overhead_arms = {
        "triton-op": lambda x, w, b, a, bb, merged: torch.ops.fuseml.lora_linear(
            x, w, b, a, bb, rank, SCALING, None, None, "none"
        )
    }
    flops = 2 * m * n * k + 2 * m * rank * (k + n)
    nbytes = (m * k + n * k + n + rank * (k + n) + m * n) * es
    return Case(
        suite="lora",
        name=f"single/r{rank}/m{m}",
        params=_params("single", rank, 1, m),
        make_inputs=make,
        arms=arms,
        bytes=nbytes,
        flops=flops,
        ceiling="matmul_bf16_tflops",
        # Graph rows at every M: the fused layer's two launches above the in-loop rows
        # (shrink, then the main GEMM) leave the GPU idle while the host prepares the
        # second, which event timing with a flushed L2 shows (H100: 287 us events vs 219
        # us of GPU time at M = 4096); graph replays give the GPU time beside it.
        graph=True,
        overhead=overhead and launch_bound(flops, nbytes),  # else the loop waits on the GPU
        overhead_arms=overhead_arms,
        dtype=DTYPE,
    )


def multi_case(m: int, adapters: int, *, device: str = "cuda") -> Case:
    k = n = HIDDEN
    rank = MULTI_RANK
    es = torch.empty((), dtype=DTYPE).element_size()
    without = m // NO_ADAPTER_EVERY

    def make():
        x = torch.randn(m, k, device=device, dtype=DTYPE)
        w, b = linear_params(n, k, DTYPE, device)
        a, bb = _adapter(rank, adapters, device)
        ids = torch.randint(0, adapters, (m,), device=device)
        ids[torch.randperm(m, device=device)[:without]] = -1
        return x, w, b, a, bb, ids

    arms = {
        "eager": lambda x, w, b, a, bb, ids: fuseml.ops.lora_linear_ref(
            x, w, b, a, bb, SCALING, adapter_ids=ids
        ),
        "triton": lambda x, w, b, a, bb, ids: fuseml.ops.lora_linear(
            x, w, b, a, bb, SCALING, adapter_ids=ids, check_ids=False, backend="triton"
        ),
        "triton-single": lambda x, w, b, a, bb, ids: fuseml.ops.lora_linear(
            x, w, b, a[0], bb[0], SCALING, backend="triton"
        ),
    }
    flops = 2 * m * n * k + 2 * (m - without) * rank * (k + n)
    nbytes = (m * k + n * k + n + adapters * rank * (k + n) + m * n) * es + m * 8  # int64 ids
    return Case(
        suite="lora",
        name=f"multi/a{adapters}/r{rank}/m{m}",
        params=_params("multi", rank, adapters, m),
        make_inputs=make,
        arms=arms,
        bytes=nbytes,
        flops=flops,
        ceiling="matmul_bf16_tflops",
        # CUDA-graph rows for the fused arms (GPU time, the two launches of a stacked rank
        # over 64 being host-bound per eager call); the per-adapter loop reads the ids on
        # the host (a sync per adapter) and cannot be captured.
        graph=("triton", "triton-single"),
        dtype=DTYPE,
        compile_arms=(),
        unchecked_arms=("triton-single",),
    )


def cases(quick: bool = False, cuda: bool = True):  # cuda: no CUDA C++ twin of lora_linear
    ranks, ms = (RANKS_QUICK, M_QUICK) if quick else (RANKS_FULL, M_FULL)
    for rank in ranks:
        for m in ms:
            yield single_case(m, rank, overhead=m == min(ms))
    adapters, multi_ms = (ADAPTERS_QUICK, MULTI_M_QUICK) if quick else (ADAPTERS_FULL, MULTI_M_FULL)
    for n_adapters in adapters:
        for m in multi_ms:
            yield multi_case(m, n_adapters)


_NOTE = (
    "Cells: median time, % of the roofline (the larger of % of the bf16 matmul ceiling at "
    "the unmerged layer's FLOPs and % of copy bandwidth for x, W, b, A, B and out moved "
    "once). (graph): timed as CUDA-graph replays of back-to-back calls (GPU time per "
    "call; runs from this suite's current version have them at every M, and the table "
    "below keeps the per-call event timings of the large sizes); host time per call is in "
    "the overhead table."
)
# How report.py draws and tabulates this suite: LoRA time across M, one panel per rank.
PLOT = {"y": "time", "x": "m", "panels": ("rank",), "where": {"kind": "single"},
        "arms": ("eager", "merged", "compile", "triton"), "xlabel": "rows (M)",
        "logx": True, "logy": True, "panel_label": True}  # fmt: skip
README = [
    {
        "title": f"Single adapter, {HIDDEN} x {HIDDEN}, bf16 (merged: W + s B A precomputed)",
        "where": {"kind": "single"},
        "rows": ("rank", "m"),
        "arms": ("eager", "merged", "compile", "triton"),
        "min_numel": 0,
        "pct": "pct_of_roofline",
        "sort": "numeric",
        "note": _NOTE,
    },
    {
        "title": (
            "Single adapter from 1024 rows, per eager call (event timing, L2 flushed before "
            "each call: host time between the fused layer's two launches shows here)"
        ),
        "where": {"kind": "single"},
        "graph_arms": (),  # the event rows themselves, not the graph rows above
        "rows": ("rank", "m"),
        "arms": ("eager", "merged", "compile", "triton"),
        "min_numel": 1024 * HIDDEN,
        "pct": "pct_of_roofline",
        "sort": "numeric",
        "note": _NOTE.split(" (graph)")[0],
    },
    {
        "title": (
            f"Mixed batches over several adapters, rank {MULTI_RANK} (eager: one masked pass "
            "per adapter; triton-single: the fused single-adapter layer at the same M, for "
            "reference)"
        ),
        "where": {"kind": "multi"},
        "graph_arms": ("triton", "triton-single"),
        "rows": ("adapters", "m"),
        "arms": ("eager", "triton", "triton-single", "triton+graph", "triton-single+graph"),
        "reference_arms": ("triton-single", "triton+graph", "triton-single+graph"),
        "min_numel": 0,
        "pct": "pct_of_roofline",
        "sort": "numeric",
        "note": _NOTE.split(" (graph)")[0],
    },
]
