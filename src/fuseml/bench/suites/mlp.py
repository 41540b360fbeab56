"""Suite ``mlp``: the DLRM MLPs as one chain, act(... act(x @ W1^T + b1) ...), batch 64 to
65,536, bf16 and fp32 (TF32 off).

MLPs (widths from fuseml.models.dlrm's named configs, activations as the model applies them)
  kaggle-bottom   13-512-256-64-16          ReLU after every layer
  kaggle-top      367-512-256-1             ReLU, sigmoid on the last (the model's forward
                                             applies sigmoid to the top MLP's logit)
  mlperf-bottom   13-512-256-128            ReLU after every layer
  mlperf-top      479-1024-1024-512-256-1   ReLU, sigmoid on the last
Weights and biases drawn as nn.Linear initialises them.

Arms
  eager        fuseml.ops.mlp_ref: F.linear (cuBLAS) + one activation kernel per layer
  compile      torch.compile of the reference (default mode)
  compile-max  torch.compile(mode="max-autotune-no-cudagraphs"), B = 4096 in bf16 (kaggle
               bottom: also 65536)
  triton       fuseml.ops.mlp(backend="triton"): the chain kernel (kaggle / mlperf bottom:
               one launch, intermediates in registers), or what tuning chose for the top
               MLPs (the layers one by one through fuseml.ops.linear)
  triton-op    torch.ops.fuseml.mlp, the dispatcher path (host overhead rows only)
Every case is also timed as CUDA-graph replays (rows with mode "graph"); the tables and
the plot show those of eager and triton as arms of their own, "eager+graph" (eager + CUDA
graph: what capturing the unfused chain buys without fusing) and "triton+graph". The
smallest batch of each MLP also measures host time per call.

Sweep (``--sweep``): the fused MLP at every candidate config its tuner times for the
batch (fuseml.ops._mlp_plan.candidates: chain and scratch kernels, and the layers one by one),
arms ``triton@<kind>/BMxBNxBK/...``.

Rate: TFLOP/s (2 B sum(in x out)) against the dtype's matmul ceiling; rows also carry GB/s
for weights + x + out moved once and % of the roofline (the larger of the two).
"""

from __future__ import annotations

import importlib
import itertools

import torch

import fuseml
from fuseml.bench.harness import Case
from fuseml.bench.suites._common import (
    config_label,
    dtype_name,
    launch_bound,
    linear_params,
    no_tf32,
    unique_name,
)
from fuseml.models.dlrm import DLRMConfig
from fuseml.ops import _mlp_plan

mlp_mod = importlib.import_module("fuseml.ops.mlp")  # (fuseml.ops.mlp: the function)

BATCHES_FULL = [64, 256, 4096, 32768, 65536]
CEILINGS = {torch.bfloat16: "matmul_bf16_tflops", torch.float32: "matmul_fp32_tflops"}


def dlrm_mlps() -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """name -> (widths, activations) of the kaggle and mlperf bottom and top MLPs."""
    out = {}
    for config_name in ("kaggle", "mlperf"):
        c = DLRMConfig.from_name(config_name)
        bottom = (c.num_dense, *c.bottom_mlp)
        top = (c.interaction_dim, *c.top_mlp)
        out[f"{config_name}-bottom"] = (bottom, ("relu",) * (len(bottom) - 1))
        out[f"{config_name}-top"] = (top, ("relu",) * (len(top) - 2) + ("sigmoid",))
    return out


MLPS = dlrm_mlps()
QUICK = {"kaggle-bottom": [256, 4096, 65536], "kaggle-top": [4096], "mlperf-top": [4096]}
MAX_AUTOTUNE_BATCH = 4096  # compile-max at this batch, bf16 (kaggle-bottom only when quick)
# and at 65536 for kaggle-bottom (the MLP the targets name)


def _sweep(widths: tuple, batch: int, dtype: torch.dtype, codes: list[int]):
    """sweep() of one case: one arm per candidate config of the fused MLP for this batch
    (none where the chain is not one fused group)."""

    def sweep() -> dict:
        if max(widths) > mlp_mod.MAX_WIDTH or len(widths) - 1 > mlp_mod.MAX_FUSED_LAYERS:
            return {}
        arms = {}
        for cfg in _mlp_plan.candidates(batch, widths, dtype):

            def call(x, ws, bs, cfg=cfg):
                return _mlp_plan._run_group(x, ws, bs, codes, cfg, False)

            name = unique_name(f"triton@{config_label(cfg)}", arms)
            arms[name] = no_tf32(call) if dtype == torch.float32 else call
        return arms

    return sweep


def mlp_case(
    name: str,
    batch: int,
    dtype: torch.dtype,
    *,
    autotune: bool = False,
    overhead: bool = False,
    device: str = "cuda",
) -> Case:
    widths, acts = MLPS[name]
    codes = [fuseml.ops.ACTIVATIONS.index(a) for a in acts]
    es = torch.empty((), dtype=dtype).element_size()

    def make():
        x = torch.randn(batch, widths[0], device=device, dtype=dtype)
        params = [linear_params(n, k, dtype, device) for k, n in itertools.pairwise(widths)]
        return x, [w for w, _ in params], [b for _, b in params]

    def eager(x, ws, bs):
        return fuseml.ops.mlp_ref(x, ws, bs, acts)

    arms = {
        "eager": eager,
        # Two lambdas, two code objects: dynamo keeps its compiled code per code object.
        "compile": torch.compile(lambda x, ws, bs: eager(x, ws, bs), dynamic=False),
    }
    if autotune:
        arms["compile-max"] = torch.compile(
            lambda x, ws, bs: eager(x, ws, bs), dynamic=False, mode="max-autotune-no-cudagraphs"
        )
    arms["triton"] = lambda x, ws, bs: fuseml.ops.mlp(x, ws, bs, acts, backend="triton")
    overhead_arms = {"triton-op": lambda x, ws, bs: torch.ops.fuseml.mlp(x, ws, bs, codes)}
    if dtype == torch.float32:
        arms = {arm: no_tf32(fn) for arm, fn in arms.items()}
        overhead_arms = {arm: no_tf32(fn) for arm, fn in overhead_arms.items()}
    layers = list(itertools.pairwise(widths))
    flops = 2 * batch * sum(k * n for k, n in layers)
    nbytes = (batch * widths[0] + sum(k * n + n for k, n in layers) + batch * widths[-1]) * es
    dname = dtype_name(dtype)
    return Case(
        suite="mlp",
        name=f"{name}/{dname}/b{batch}",
        params={
            "mlp": name,
            "widths": "-".join(map(str, widths)),
            "dtype": dname,
            "batch": batch,
            "numel": batch * max(widths),  # elements of the widest activation
        },
        make_inputs=make,
        arms=arms,
        bytes=nbytes,
        flops=flops,
        ceiling=CEILINGS[dtype],
        graph=True,
        overhead=overhead and launch_bound(flops, nbytes),  # else the loop waits on the GPU
        overhead_arms=overhead_arms,
        dtype=dtype,
        compile_arms=("compile", "compile-max"),
        sweep=_sweep(tuple(widths), batch, dtype, codes),
    )


def cases(quick: bool = False, cuda: bool = True):  # cuda: no CUDA C++ twin of mlp
    if quick:
        for name, batches in QUICK.items():
            for b in batches:
                yield mlp_case(
                    name, b, torch.bfloat16,
                    autotune=name == "kaggle-bottom" and b in (MAX_AUTOTUNE_BATCH, 65536),
                    overhead=b == min(batches),
                )  # fmt: skip
        return
    for dtype in (torch.bfloat16, torch.float32):
        for name in MLPS:
            for b in BATCHES_FULL:
                yield mlp_case(
                    name, b, dtype,
                    autotune=dtype == torch.bfloat16
                    and (b == MAX_AUTOTUNE_BATCH or (name == "kaggle-bottom" and b == 65536)),
                    overhead=b == min(BATCHES_FULL),
                )  # fmt: skip


_ARMS = ("eager", "eager+graph", "compile", "compile-max", "triton", "triton+graph")
# How report.py draws and tabulates this suite.
PLOT = {"y": "time", "x": "batch", "panels": ("mlp", "dtype"), "xlabel": "batch (rows)",
        "logx": True, "logy": True, "graph_arms": ("eager", "triton"), "arms": _ARMS}  # fmt: skip
README = {
    "rows": ("mlp", "dtype", "batch"),
    "arms": _ARMS,
    "graph_arms": ("eager", "triton"),
    "reference_arms": ("triton+graph",),
    "min_numel": 0,
    "pct": "pct_of_roofline",
    "sort": "numeric",
    "extra_ceilings": ("matmul_fp32_tflops",),
    "note": (
        "Cells: median time, % of the roofline (the larger of % of the dtype's matmul "
        "ceiling and % of copy bandwidth for weights, x and out moved once; fp32 with TF32 "
        "off). eager+graph, triton+graph: the same arm as CUDA-graph replays of back-to-back "
        "calls (GPU time per call, no launch gaps). 'fused vs best peer' compares triton "
        "without a graph with the fastest of the other arms, eager+graph included. Host "
        "time per call is in the overhead table."
    ),
}
