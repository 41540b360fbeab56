"""Where a DLRM's inference time goes (``fuseml profile dlrm``).

Public API::

    result = profile_dlrm("kaggle", backend="eager", batch_size=2048, steps=10, out_dir="runs/profile")
    result.trace (Chrome trace JSON: chrome://tracing or https://ui.perfetto.dev)
    result.top (top kernels / ops by time), result.stages (time per DLRM stage)
    with stage_ranges(model): ...  # record_function + NVTX range per stage

Each stage (``bottom_mlp``, ``embeddings``, ``interaction``, ``top_mlp``; a FusedDLRM's
fused ``embedding_interaction`` in place of the middle two) is wrapped in a
``record_function`` range named ``dlrm.<stage>`` (and an NVTX range of the same name on
CUDA, for Nsight Systems) by forward hooks that exist only while profiling: the model's
forward is untouched and pays nothing otherwise. Under ``torch.compile`` the hooks would
break the graph at every stage boundary (and so change what is measured), so a compiled
model gets one range, ``dlrm.forward (compiled)``; its kernels carry inductor's names.

The top-10 table ranks by self device time (CUDA kernels) on a GPU and by self CPU time of
torch ops on the CPU, where device times do not exist.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from fuseml.apps.common import (
    DTYPES,
    MODEL_BACKENDS,
    OPTIMIZE_BACKENDS,
    check_model_backend,
    resolve_device,
)
from fuseml.data.errors import Flag, OptionError
from fuseml.models.bench_cases import random_inputs
from fuseml.models.dlrm import DLRM, DLRMConfig
from fuseml.nn.dlrm import STAGES, stage_ranges

__all__ = ["STAGES", "ProfileResult", "profile_dlrm", "stage_ranges"]

_PREFIX = "dlrm."
_COMPILED_RANGE = "dlrm.forward (compiled)"


BACKENDS = MODEL_BACKENDS  # auto, triton: the fuseml.optimize'd model


@dataclass
class ProfileResult:
    trace: Path
    device: torch.device
    top: list[dict[str, Any]]  # name, calls, total_us, per_call_us, percent
    stages: list[dict[str, Any]]  # name, calls, cpu_us, device_us (per step)
    step_ms: float  # wall time per step, profiler on


def _rows(events, key: str, keep) -> list[dict[str, Any]]:
    events = [e for e in events if keep(e.key) and getattr(e, key) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return [
        {
            "name": e.key,
            "calls": e.count,
            "total_us": getattr(e, key),
            "per_call_us": getattr(e, key) / e.count,
            "percent": 100.0 * getattr(e, key) / total,
        }
        for e in events
    ]


def profile_dlrm(
    config: str = "tiny",
    *,
    backend: str = "eager",
    batch_size: int = 2048,
    steps: int = 10,
    warmup: int = 3,
    out_dir: str | Path = "runs/profile",
    device: str | None = None,
    dtype: str = "fp32",
    max_cardinality: int | None = None,
    console: Console | None = None,
) -> ProfileResult:
    """Profile ``steps`` inference batches of a randomly initialised named DLRM."""
    console = console or Console()
    check_model_backend(backend)
    if steps < 1 or batch_size < 1 or warmup < 0:
        raise OptionError(
            "{} and {} must be at least 1, {} at least 0; got {}, {}, {}",
            Flag("steps"), Flag("batch_size"), Flag("warmup"), steps, batch_size, warmup,
        )  # fmt: skip
    if dtype not in DTYPES:
        raise OptionError("{} must be one of {}, got {!r}", Flag("dtype"), tuple(DTYPES), dtype)
    dev = resolve_device(device)
    gpu = dev.type == "cuda"
    cfg = DLRMConfig.from_name(config, max_cardinality=max_cardinality)
    torch.manual_seed(0)
    model = DLRM(cfg).to(dev, DTYPES[dtype]).eval()
    model.embeddings.check_ids = False  # the random ids are valid; keep the sync out
    dense, sparse = random_inputs(cfg, batch_size, dev, DTYPES[dtype])
    if backend in OPTIMIZE_BACKENDS:  # fused MLPs / linear layers, same stage names
        import fuseml

        model, _ = fuseml.optimize(model, backend=backend, inplace=True)
    run = torch.compile(model, dynamic=False) if backend == "compile" else model
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"dlrm-{config}-{backend}-{dtype}-bs{batch_size}-{dev.type}.json"
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def step() -> None:
        if backend == "compile":
            with torch.profiler.record_function(_COMPILED_RANGE):
                run(dense, sparse)
        else:
            run(dense, sparse)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ranges = stage_ranges(model) if backend != "compile" else contextlib.nullcontext()
    with torch.no_grad(), ranges:
        for _ in range(warmup):  # compilation, autotuning and caches stay out of the trace
            step()
        sync()
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            step_ms = (time.perf_counter() - start) * 1e3 / steps
    prof.export_chrome_trace(str(trace))

    events = prof.key_averages()
    mine = lambda name: name.startswith(_PREFIX)
    if gpu:
        top = _rows(events, "self_device_time_total", lambda n: not mine(n))[:10]
    else:
        top = _rows(events, "self_cpu_time_total", lambda n: not mine(n))[:10]
    stage_names = (*(_PREFIX + s for s in STAGES), _COMPILED_RANGE)
    stages = [
        {
            "name": e.key,
            "calls": e.count,
            "cpu_us": e.cpu_time_total / steps,
            "device_us": e.device_time_total / steps if gpu else None,
        }
        for name in stage_names
        for e in events
        if e.key == name
    ]
    result = ProfileResult(trace, dev, top, stages, step_ms)
    _report(console, result, cfg, backend, batch_size, steps, dtype)
    return result


def _report(
    console: Console,
    r: ProfileResult,
    cfg: DLRMConfig,
    backend: str,
    batch_size: int,
    steps: int,
    dtype: str,
) -> None:
    gpu = r.device.type == "cuda"
    what = "kernels by self CUDA time" if gpu else "ops by self CPU time"
    title = f"DLRM {cfg.name}, {backend}, {dtype}, batch {batch_size} on {r.device}: top {what}"
    top = Table(title=title)
    for col in ("kernel" if gpu else "op", "calls", "total ms", "us/call", "%"):
        top.add_column(col, justify="left" if col in ("kernel", "op") else "right")
    for row in r.top:
        name = row["name"] if len(row["name"]) <= 70 else row["name"][:67] + "..."
        top.add_row(
            name,
            str(row["calls"]),
            f"{row['total_us'] / 1e3:.2f}",
            f"{row['per_call_us']:.1f}",
            f"{row['percent']:.1f}",
        )
    console.print(top)
    stages = Table(title=f"per stage, per step (of {steps} profiled steps)")
    stages.add_column("range")
    stages.add_column("CPU us", justify="right")
    stages.add_column("device us" if gpu else "device us (needs a GPU)", justify="right")
    for row in r.stages:
        device = "--" if row["device_us"] is None else f"{row['device_us']:.1f}"
        stages.add_row(row["name"], f"{row['cpu_us']:.1f}", device)
    console.print(stages)
    console.print(
        f"{r.step_ms:.3g} ms per step with the profiler on; trace: {Path(r.trace).resolve()}",
        soft_wrap=True,
    )
    if backend == "compile":
        console.print(
            "[dim]compiled: inductor fuses across stage boundaries, so the stages have no "
            "separate ranges; kernel names show what was fused.[/dim]"
        )
    if not gpu:
        console.print(
            "Device (kernel) times need a CUDA GPU: on the CPU the table ranks torch ops by "
            "CPU time. Run this on a GPU machine for self CUDA time per kernel."
        )
