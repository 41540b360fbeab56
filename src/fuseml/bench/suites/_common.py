"""Helpers shared by the bench suites (the GEMM suites, softmax, elementwise; the
overhead and models suites' eager wall time and whole models)."""

from __future__ import annotations

import collections
import copy
import math
import time
from collections.abc import Callable

import torch

from fuseml.bench.noise import Timing, settle
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


def walls_in_turns(
    fns: dict[str, Callable[[], object]],
    iters: dict[str, int],
    repeats: int,
) -> dict[str, Timing]:
    """Wall time per call of each arm, as ms quantiles (p50, p20, p80) in a noise.Timing:
    ``repeats`` rounds, each timing a loop of ``iters[arm]`` calls of every arm in turn,
    the GPU synchronized before and after each loop (a call whose GPU work outlasts its
    host time counts the GPU's). In turns, a host or board drifting during the case weighs
    on every arm alike, not on the arms timed last. An arm whose p20-p80 spread stays wide
    is timed again, every arm with it (noise.settle; no committed median is compared: wall
    times measure the host, see noise.history_from_rows)."""
    for fn in fns.values():  # warm: caches, clocks
        for _ in range(10):
            fn()

    def rounds(names: list[str]) -> dict[str, tuple[float, float, float]]:
        per_call: dict[str, list[float]] = {arm: [] for arm in fns}
        for _ in range(repeats):
            for arm, fn in fns.items():
                n = iters[arm]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
                per_call[arm].append((time.perf_counter() - t0) / n * 1e3)
        return {arm: _quantiles(v) for arm, v in per_call.items()}

    return settle(rounds, fns)


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """(p50, p20, p80) of a few samples (nearest rank)."""
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, round(q * (len(v) - 1)))]
    return at(0.5), at(0.2), at(0.8)


def timing_fields(t: Timing, **fields) -> dict:
    """A row's timing fields from a settled Timing (ms), with its re-runs and why it stayed
    unsettled where it did (noise.py)."""
    p50, p20, p80 = t.quantiles[:3]
    return {"p50_ms": p50, "p20_ms": p20, "p80_ms": p80, **fields, **t.fields()}


def mlp_top_model(dtype: torch.dtype) -> torch.nn.Module:
    """The DLRM kaggle top MLP (367-512-256-1) as users write it, on CUDA, eval mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(367, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
        torch.nn.ReLU(), torch.nn.Linear(256, 1),
    )  # fmt: skip
    return model.to("cuda", dtype).eval()


def peft_mlp_model(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the peft model, its merged copy): a 4096-wide 3-layer GELU MLP with peft's default
    LoRA (r = 16 on every Linear, float32 adapters over the ``dtype`` base), as users build
    it, lora_B drawn at random (peft starts it at zero: as trained instead); merged:
    peft's merge_and_unload() of a copy."""
    import peft

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        collections.OrderedDict(
            fc1=torch.nn.Linear(4096, 4096), act1=torch.nn.GELU(),
            fc2=torch.nn.Linear(4096, 4096), act2=torch.nn.GELU(),
            fc3=torch.nn.Linear(4096, 4096),
        )
    ).to("cuda", dtype)  # fmt: skip
    config = peft.LoraConfig(r=16, target_modules=["fc1", "fc2", "fc3"])
    pm = peft.get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return pm, copy.deepcopy(pm).merge_and_unload().eval()
