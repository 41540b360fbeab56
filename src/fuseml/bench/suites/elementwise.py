"""Suite ``elementwise``: add, GELU (erf and tanh) and the bias + residual + activation
epilogue, from 1e4 to 2.7e8 elements and at the epilogue shapes of DLRM and LoRA layers.

Arms
  manual    the unfused torch chain a user would write (one kernel per step)
  builtin   torch's own fused op where one exists (torch.add, F.gelu)
  compile   torch.compile of the reference (default mode), compiled outside the timing
  triton    fuseml.ops.* with backend="triton" (direct launch)
  cuda      fuseml.ops.* with backend="cuda" (CUDA C++ twin)
  triton-op torch.ops.fuseml.* through the dispatcher (host overhead only: same kernel)
  copy      a device-to-device copy of the input (GELU only): what moving the same bytes
            costs at that size, the practical ceiling there

Sweep (``--sweep``): the Triton kernel at every tile size (bytes of each operand a program
moves) and warp count of SWEEP_TILE_BYTES x SWEEP_WARPS, arms ``triton@<bytes>B/w<warps>``:
the sweep the launch heuristic (fuseml.ops._elementwise.launch_config) was picked from.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton

import fuseml
from fuseml.bench.harness import Case
from fuseml.bench.suites._common import launch_bound
from fuseml.ops import _elementwise as ew

SIZES_FULL = [10_000, 100_000, 1_000_000, 4_194_304, 16_777_216, 67_108_864, 268_435_456]
SIZES_QUICK = [10_000, 1_000_000, 16_777_216, 268_435_456]
# (rows, cols): DLRM hidden widths (512) and LoRA / transformer widths (4096).
SHAPES_FULL = [
    (4096, 512), (65536, 512), (2048, 512), (32768, 512), (524288, 512),
    (256, 4096), (4096, 4096), (65536, 4096),
]  # fmt: skip
SHAPES_QUICK = [(4096, 512), (65536, 512), (4096, 4096), (65536, 4096)]
DTYPES_FULL = [torch.float32, torch.bfloat16]
DTYPES_QUICK = [torch.float32, torch.bfloat16]
SQRT1_2 = 1.0 / math.sqrt(2.0)
SQRT_2_PI = math.sqrt(2.0 / math.pi)


SWEEP_TILE_BYTES = (2048, 4096, 8192, 16384, 32768)
SWEEP_WARPS = (4, 8)
# op -> (activation, alpha) of the one kernel every op of this suite launches
_KERNEL_ARGS = {
    "add": ("none", 1.0), "gelu": ("gelu", 1.0), "gelu_tanh": ("gelu_tanh", 1.0),
    "bias_residual_relu": ("relu", 0.5), "bias_gelu": ("gelu", 1.0),
}  # fmt: skip


def sweep_config(shape: tuple, elem_size: int, tile_bytes: int, warps: int) -> dict:
    """The launch config of a ``tile_bytes`` tile of each operand on ``warps`` warps: flat
    inputs one row of BLOCK_N, 2-D ones rows of up to the row's width."""
    rows = 1 if len(shape) == 1 else shape[0]
    cols = shape[-1]
    block_n = min(tile_bytes // elem_size, triton.next_power_of_2(cols))
    block_m = 1 if rows == 1 else min(max(1, tile_bytes // elem_size // block_n),
                                      triton.next_power_of_2(rows))  # fmt: skip
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps}


def _sweep(op: str, kind: str, shape: tuple, dtype: torch.dtype):
    """sweep() of one case: {"triton@<bytes>B/w<warps>": fn(*inputs)}."""
    act, alpha = _KERNEL_ARGS[op]
    code = ew.ACT_CODE[act]
    es = torch.empty((), dtype=dtype).element_size()

    def arm(cfg: dict):
        def call(*inputs):
            x = inputs[0]
            bias = inputs[1] if "b" in kind else None
            y = inputs[-1] if ("y" in kind or "r" in kind) else None
            return ew.bias_act_into(torch.empty_like(x), x, y, bias, alpha, code, config=cfg)

        return call

    def sweep() -> dict:
        return {
            f"triton@{tile}B/w{warps}": arm(sweep_config(shape, es, tile, warps))
            for tile in SWEEP_TILE_BYTES
            for warps in SWEEP_WARPS
        }

    return sweep


def _gelu_manual(x):
    # What a hand-written erf GELU costs in eager torch: one kernel per operator.
    return 0.5 * x * (1.0 + torch.erf(x * SQRT1_2))


def _gelu_tanh_manual(x):
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_PI * (x + 0.044715 * x * x * x)))


def _ops(cuda: bool):
    """op name -> (reference, extra arms, fused call, dispatcher call, inputs kind)."""

    def fused(fn, **kw):
        return lambda *a: fn(*a, backend="triton", **kw)

    def cuda_arm(fn, **kw):
        return lambda *a: fn(*a, backend="cuda", **kw)

    specs = {
        "add": dict(
            arms={"builtin": torch.add},
            fn=fuseml.ops.add,
            kw={},
            op=lambda x, y: torch.ops.fuseml.add(x, y, "triton"),
            inputs="xy",
        ),
        "gelu": dict(
            arms={"manual": _gelu_manual, "builtin": F.gelu},
            fn=fuseml.ops.gelu,
            kw={},
            op=lambda x: torch.ops.fuseml.gelu(x, "none", "triton"),
            inputs="x",
        ),
        "gelu_tanh": dict(
            arms={"manual": _gelu_tanh_manual, "builtin": lambda x: F.gelu(x, approximate="tanh")},
            fn=fuseml.ops.gelu,
            kw={"approximate": "tanh"},
            op=lambda x: torch.ops.fuseml.gelu(x, "tanh", "triton"),
            inputs="x",
        ),
        "bias_residual_relu": dict(
            arms={"manual": lambda x, b, r: fuseml.ops.bias_act_ref(x, b, r, 0.5, "relu")},
            fn=fuseml.ops.bias_act,
            kw={"alpha": 0.5, "activation": "relu"},
            op=lambda x, b, r: torch.ops.fuseml.bias_act(x, b, r, 0.5, "relu", "triton"),
            inputs="xbr",
        ),
        "bias_gelu": dict(
            arms={"manual": lambda x, b: fuseml.ops.bias_act_ref(x, b, None, 1.0, "gelu")},
            fn=fuseml.ops.bias_act,
            kw={"activation": "gelu"},
            op=lambda x, b: torch.ops.fuseml.bias_act(x, b, None, 1.0, "gelu", "triton"),
            inputs="xb",
        ),
    }
    for name, spec in specs.items():
        ref = next(iter(spec["arms"].values()))
        if name in ("gelu", "gelu_tanh"):
            # What a plain copy of the same bytes takes at this size: the practical ceiling
            # for a one-in, one-out op (the copy_gbps ceiling is measured at 1 GiB).
            spec["arms"]["copy"] = lambda x: torch.empty_like(x).copy_(x)
        spec["arms"]["compile"] = lambda *a, ref=ref: ref(*a)  # compiled per case: _arms()
        spec["arms"]["triton"] = fused(spec["fn"], **spec["kw"])
        if cuda:
            spec["arms"]["cuda"] = cuda_arm(spec["fn"], **spec["kw"])
    return specs


def _make_inputs(kind: str, shape: tuple, dtype: torch.dtype):
    def make():
        x = torch.randn(shape, device="cuda", dtype=dtype)
        out = [x]
        if "y" in kind or "r" in kind:
            out.append(torch.randn(shape, device="cuda", dtype=dtype))
        if "b" in kind:
            out.insert(1, torch.randn(shape[-1], device="cuda", dtype=dtype))
        return tuple(out)

    return make


def _bytes(kind: str, shape: tuple, dtype: torch.dtype) -> int:
    n = math.prod(shape)
    tensors = 2 + ("y" in kind or "r" in kind)  # x (+ y/residual) read, out written
    bias = shape[-1] if "b" in kind else 0
    return (n * tensors + bias) * torch.empty((), dtype=dtype).element_size()


def _arms(spec: dict) -> dict:
    arms = dict(spec["arms"])
    # A fresh compiled function per case; the runner resets dynamo before each case, so
    # each case compiles statically for its own shape (no dynamic-shape kernels, and no
    # silent fallback to eager once dynamo's recompile limit is reached).
    arms["compile"] = torch.compile(arms["compile"], dynamic=False)
    return arms


def cases(quick: bool = False, cuda: bool = True):
    sizes = SIZES_QUICK if quick else SIZES_FULL
    shapes = SHAPES_QUICK if quick else SHAPES_FULL
    dtypes = DTYPES_QUICK if quick else DTYPES_FULL
    specs = _ops(cuda)
    for name, spec in specs.items():
        if name.startswith("bias"):
            grid = [(shape, math.prod(shape)) for shape in shapes]
        else:
            grid = [((n,), n) for n in sizes]
        for dtype in dtypes:
            for shape, numel in grid:
                dname = str(dtype).replace("torch.", "")
                yield Case(
                    suite="elementwise",
                    name=f"{name}/{dname}/{'x'.join(map(str, shape))}",
                    params={"op": name, "dtype": dname, "numel": numel, "shape": list(shape)},
                    make_inputs=_make_inputs(spec["inputs"], shape, dtype),
                    arms=_arms(spec),
                    bytes=_bytes(spec["inputs"], shape, dtype),
                    # CUDA-graph rows where the kernel would take under 50 us: a Triton
                    # launch's host time (30-40 us) otherwise leaks into the events timing
                    graph=launch_bound(0, _bytes(spec["inputs"], shape, dtype)),
                    overhead=numel == min(n for _, n in grid),
                    overhead_arms={"triton-op": spec["op"]},
                    dtype=dtype,
                    sweep=_sweep(name, spec["inputs"], shape, dtype),
                )


# How report.py draws and tabulates this suite.
PLOT = {"x": "numel", "panels": ("op", "dtype"), "xlabel": "elements", "logx": True}
README = {
    "rows": ("op", "dtype", "shape"),
    "arms": ("manual", "builtin", "compile", "triton", "cuda", "copy"),
    "min_numel": 1_000_000,
}
