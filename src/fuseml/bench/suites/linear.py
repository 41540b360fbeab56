"""Suite ``linear``: one layer with its epilogue, act(x @ W^T + b), at the DLRM layer
shapes (ReLU) and two transformer-sized ones (GELU), M = 1 to 65,536 rows.

Arms
  eager        fuseml.ops.linear_ref: F.linear (cuBLAS, bias fused) + one activation kernel
  cublaslt     torch._addmm_activation: bias + ReLU/GELU in cuBLASLt's GEMM epilogue (torch
               itself falls back to addmm + activation where Lt does not take the problem)
  compile      torch.compile of the reference (default mode)
  compile-max  torch.compile(mode="max-autotune-no-cudagraphs"), a few shapes only (each
               compile autotunes for tens of seconds)
  triton       fuseml.ops.linear(backend="triton"): Triton GEMM with the epilogue in registers
               (on Hopper, from 512 rows with 16-byte aligned rows: the persistent TMA kernel)
  triton-op    torch.ops.fuseml.linear, the dispatcher path (host overhead rows only)
  triton-ptr   the pointer-load kernel forced (loop="ptr") where `triton` takes the TMA
               kernel: a reference column, to show what TMA gains

The GELU is the tanh form ("gelu_tanh"): that is the one cuBLASLt's epilogue computes, so
all arms compute one function and every output is checked against the reference.

Sweep (``--sweep``): the Triton GEMM at every candidate config its tuner times for the
shape (fuseml.ops.gemm.candidates, on the main loop the layer takes), arms
``triton@BMxBNxBK/wW/sS[/flags]``: for keeping the candidate table, not for the tables.
Rows as given: where the library pads K per call (an unaligned K at many rows), the
sweep times the kernel on the unpadded rows.

Rate: TFLOP/s at 2 M N K FLOPs against the matmul ceiling of the dtype (fp32: TF32 off).
Rows also carry GB/s for the fewest bytes a call moves (x, W, b read, out written once)
and % of the roofline (the larger of the two percentages): small M is bound by the
weight read, not by the tensor cores. Launch-bound cases are also timed as CUDA-graph
replays, and the smallest M of a shape measures host time per call.
"""

from __future__ import annotations

import importlib

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
from fuseml.ops import gemm as _gemm
from fuseml.ops._elementwise import ACT_CODE
from fuseml.ops.gemm import TMA_MIN_M, TMA_TUNED_MAX_M

linear_mod = importlib.import_module("fuseml.ops.linear")  # (fuseml.ops.linear: the function)

# (in, out) = (K, N). DLRM (kaggle bottom 13-512-256-64-16, top input 367 -> 512, mlperf's
# 1024-wide top layers) with ReLU; a 4096 hidden layer and a LLaMA-7B up-projection with GELU.
KAGGLE_TOP_IN = DLRMConfig.from_name("kaggle").interaction_dim  # 16 + 27 * 26 / 2 = 367
DLRM_LAYERS = [(13, 512), (KAGGLE_TOP_IN, 512), (512, 256), (256, 64), (64, 16), (1024, 1024)]
LARGE_LAYERS = [(4096, 4096), (4096, 11008)]
M_FULL = [1, 16, 64, 512, 4096, 65536]
# fp32 (TF32 off) on ReLU layers only: whether cuBLASLt's GELU epilogue stays within fp32's
# 1e-5 of torch's tanh GELU is unknown, and a rounding-only mismatch would only be noise.
FP32_FULL = {(512, 256): [64, 4096], (1024, 1024): [64, 4096, 65536]}
MAX_AUTOTUNE_FULL = {
    (KAGGLE_TOP_IN, 512): [4096], (1024, 1024): [4096], (4096, 4096): [16, 4096],
    (4096, 11008): [4096],
}  # fmt: skip
# Quick: a few minutes for linear + mlp + lora together on an H100, compiles included.
QUICK = {(13, 512): [64, 65536], (4096, 4096): [1, 4096], (4096, 11008): [4096]}
MAX_AUTOTUNE_QUICK = {(4096, 4096): [4096]}
CEILINGS = {torch.bfloat16: "matmul_bf16_tflops", torch.float32: "matmul_fp32_tflops"}


def activation_of(k: int, n: int) -> str:
    return "gelu_tanh" if (k, n) in LARGE_LAYERS else "relu"


def _ptr_arm(act: str):
    """fuseml.ops.linear with the pointer-load kernel forced (``linear_rows``'s loop="ptr"),
    its arguments checked as ``linear`` checks them, so that both arms pay the same."""
    code = ACT_CODE[act]

    def call(x, w, b):
        linear_mod.check_linear_args("linear", x, w, b, None, 1.0, act)
        return linear_mod.linear_rows(x, w, b, None, 1.0, code, loop="ptr")

    return call


def _describe(make, act: str, dtype: torch.dtype):
    """describe(arm) of one case: the fused arms' rows record the launch config (and
    kernel) their calls take, asked of ``linear_choice`` with tensors of the arm's layout
    (after the first call: a lookup of the tuning memo)."""

    def describe(arm: str) -> dict:
        if arm not in _FUSED_LOOPS:
            return {}
        x, w, b = make()  # shapes, strides and alignment decide the loop and the tuning key

        def choice():
            return linear_mod.linear_choice(x, w, b, act, loop=_FUSED_LOOPS[arm])

        # (the arms pin fp32 to TF32 off: the precision is part of the tuning key)
        chosen = no_tf32(choice)() if dtype == torch.float32 else choice()
        return {} if chosen is None else {"config": chosen}

    return describe


_FUSED_LOOPS = {"triton": "auto", "triton-ptr": "ptr"}  # fused arm -> linear_rows' loop


def _sweep(make, m: int, n: int, k: int, dtype: torch.dtype, act: str):
    """sweep() of one case: one arm per candidate config of the GEMM for this shape."""

    def sweep() -> dict:
        x, w, _ = make()  # (the main loop the layer takes depends on its tensors' layout)
        loop = _gemm.gemm_loop(x, w, False)
        unaligned = loop == _gemm.LOOP_PTR and not _gemm.tma_eligible(x, w)
        configs = _gemm.candidates(m, n, k, dtype, loop, plain=True, unaligned=unaligned)
        code = ACT_CODE[act]
        arms = {}
        for cfg in configs:

            def call(x, w, b, cfg=cfg):
                out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                tma = _gemm.takes_tma(loop, cfg)
                _gemm.launch_linear(out, x, w, b, None, 1.0, code, cfg, tma=tma)
                return out

            arms[unique_name(f"triton@{config_label(cfg)}", arms)] = (
                no_tf32(call) if dtype == torch.float32 else call
            )
        return arms

    return sweep


def linear_case(
    k: int,
    n: int,
    m: int,
    dtype: torch.dtype,
    *,
    autotune: bool = False,
    overhead: bool = False,
    device: str = "cuda",
) -> Case:
    """One (M, K, N) problem; tensors are made only when the harness asks (make_inputs)."""
    act = activation_of(k, n)
    es = torch.empty((), dtype=dtype).element_size()

    def make():
        x = torch.randn(m, k, device=device, dtype=dtype)
        w, b = linear_params(n, k, dtype, device)
        return x, w, b

    def eager(x, w, b):
        return fuseml.ops.linear_ref(x, w, b, act)

    arms = {
        "eager": eager,
        "cublaslt": lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=act != "relu"),
        # Two lambdas, two code objects: dynamo keeps its compiled code per code object.
        "compile": torch.compile(lambda x, w, b: eager(x, w, b), dynamic=False),
    }
    if autotune:
        arms["compile-max"] = torch.compile(
            lambda x, w, b: eager(x, w, b), dynamic=False, mode="max-autotune-no-cudagraphs"
        )
    arms["triton"] = lambda x, w, b: fuseml.ops.linear(x, w, b, act, backend="triton")
    # Where `triton` takes (or may take) the TMA kernel: the pointer kernel beside it.
    if (m >= TMA_MIN_M or m <= TMA_TUNED_MAX_M) and (k * es) % 16 == 0:
        arms["triton-ptr"] = _ptr_arm(act)
    overhead_arms = {"triton-op": lambda x, w, b: torch.ops.fuseml.linear(x, w, b, None, 1.0, act)}
    if dtype == torch.float32:
        arms = {name: no_tf32(fn) for name, fn in arms.items()}
        overhead_arms = {name: no_tf32(fn) for name, fn in overhead_arms.items()}
    flops = 2 * m * n * k
    nbytes = (m * k + n * k + n + m * n) * es
    dname = dtype_name(dtype)
    return Case(
        suite="linear",
        name=f"{k}x{n}/{act}/{dname}/m{m}",
        params={
            "op": "linear",
            "layer": f"{k}->{n}",
            "act": act,
            "dtype": dname,
            "m": m,
            "k": k,
            "n": n,
            "numel": m * n,
            "shape": [m, k, n],
        },
        make_inputs=make,
        arms=arms,
        bytes=nbytes,
        flops=flops,
        ceiling=CEILINGS[dtype],
        graph=launch_bound(flops, nbytes),
        overhead=overhead and launch_bound(flops, nbytes),  # else the loop waits on the GPU
        overhead_arms=overhead_arms,
        dtype=dtype,
        compile_arms=("compile", "compile-max"),
        describe=_describe(make, act, dtype),
        sweep=_sweep(make, m, n, k, dtype, act),
    )


def _grid(quick: bool) -> list[tuple[int, int, torch.dtype, list[int], dict]]:
    if quick:
        return [(k, n, torch.bfloat16, ms, MAX_AUTOTUNE_QUICK) for (k, n), ms in QUICK.items()]
    grid = [
        (k, n, torch.bfloat16, M_FULL, MAX_AUTOTUNE_FULL) for k, n in DLRM_LAYERS + LARGE_LAYERS
    ]
    grid += [(k, n, torch.float32, ms, {}) for (k, n), ms in FP32_FULL.items()]
    return grid


def cases(quick: bool = False, cuda: bool = True):  # cuda: no CUDA C++ twin of linear
    for k, n, dtype, ms, autotuned in _grid(quick):
        for m in ms:
            yield linear_case(
                k, n, m, dtype, autotune=m in autotuned.get((k, n), ()), overhead=m == min(ms)
            )


_ARMS = ("eager", "cublaslt", "compile", "compile-max", "triton", "triton-ptr")
# How report.py draws and tabulates this suite: TFLOP/s across M, one panel per layer.
PLOT = {"x": "m", "panels": ("layer", "dtype"), "xlabel": "rows (M)", "logx": True,
        "logy": True, "sort": "numeric", "arms": _ARMS}  # fmt: skip
README = {
    "rows": ("dtype", "layer", "act", "m"),
    "arms": _ARMS,
    "min_numel": 0,
    "pct": "pct_of_roofline",
    "sort": "numeric",
    "reference_arms": ("triton-ptr",),  # fuseml's own other kernel: not a peer
    "extra_ceilings": ("matmul_fp32_tflops",),
    "note": (
        "Cells: median time, % of the roofline (the larger of % of the dtype's matmul "
        "ceiling at 2MNK FLOPs and % of copy bandwidth for x, W, b and out moved once; fp32 "
        "rows with TF32 off). (graph): a launch-bound size, timed as CUDA-graph replays of "
        "back-to-back calls (GPU time per call); host time per call is in the overhead table."
    ),
}
