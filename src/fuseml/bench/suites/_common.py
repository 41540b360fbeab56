"""Helpers shared by the bench suites (the GEMM suites, softmax, elementwise)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fuseml.runtime import tf32_matmuls

# A case whose fastest plausible time (H100-class rates below) is under this many
# microseconds is launch-bound: it also gets CUDA-graph rows, which the tables use.
LAUNCH_BOUND_US = 50.0
_PEAK_TFLOPS = 600.0  # bf16 dense, a little under what the matmul ceiling measures
_PEAK_GBPS = 3000.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def launch_bound(flops: int, nbytes: int) -> bool:
    """Would the fastest kernel take under LAUNCH_BOUND_US (the roofline time)?"""
    seconds = max(flops / (_PEAK_TFLOPS * 1e12), nbytes / (_PEAK_GBPS * 1e9))
    return seconds * 1e6 < LAUNCH_BOUND_US


def no_tf32(fn: Callable) -> Callable:
    """``fn`` with float32 matmuls pinned to full fp32 (TF32 off), whatever the flag was.

    The fp32 rows compare the fp32 GEMMs of cuBLAS, Inductor and fuseml (all of which read
    torch.backends.cuda.matmul.allow_tf32); pinning it keeps them on the same precision.
    """

    def call(*args):
        with tf32_matmuls(False):
            return fn(*args)

    return call


def linear_params(
    n_out: int, n_in: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (n_out, n_in), bias (n_out,)) drawn as nn.Linear initialises them:
    U(-1/sqrt(n_in), 1/sqrt(n_in)) for both (kaiming_uniform with a=sqrt(5))."""
    bound = 1.0 / math.sqrt(n_in)
    w = torch.empty(n_out, n_in, device=device).uniform_(-bound, bound)
    b = torch.empty(n_out, device=device).uniform_(-bound, bound)
    return w.to(dtype), b.to(dtype)


_DIMS = ("BLOCK_M", ("BLOCK_N", "CHUNK"), "BLOCK_K")
_FLAGS = ("TMA", "STREAM", "OUT_SUB", "REG_PIPE")


def config_label(cfg: dict) -> str:
    """A candidate launch config as a short arm suffix: [kind/]BMxBNxBK/wW[/sS][/pP][/flags]
    (p: programs an SM; flags: the kernel variants a config selects)."""
    parts = [cfg["kind"]] if "kind" in cfg else []
    dims = [next((str(cfg[k]) for k in ((d,) if isinstance(d, str) else d) if k in cfg), "")
            for d in _DIMS]  # fmt: skip
    if any(dims):
        parts.append("x".join(dims))
    for key, tag in (("num_warps", "w"), ("num_stages", "s"), ("per_sm", "p")):
        if key in cfg:
            parts.append(f"{tag}{cfg[key]}")
    for key in _FLAGS:
        if cfg.get(key):
            parts.append(key.lower() + ("" if cfg[key] is True else str(cfg[key])))
    return "/".join(parts)


def unique_name(name: str, taken) -> str:
    """``name``, primed until it is not in ``taken`` (configs that differ in a field the
    label leaves out)."""
    while name in taken:
        name += "'"
    return name
