"""Arms timed side by side in CUDA graphs, interleaved over rounds: the part the GPU
probes probe_stream.py and probe_tma_store.py share (imported by them, not run)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def relu_layer_sets(
    m: int, k: int, n: int, dtype: torch.dtype, sets: int = 3
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A bias + ReLU layer's inputs for arms over rotating input sets (seed 0): ``sets``
    inputs x (m, k), W (n, k), the bias (n,), ``sets`` outputs (m, n), and the float64
    reference of set 0."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    xs = [torch.randn(m, k, device=dev, dtype=dtype) for _ in range(sets)]
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(n, device=dev, dtype=dtype)
    outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in range(sets)]
    ref = torch.relu(xs[0].double() @ w.double().t() + b.double())
    return xs, w, b, outs, ref


def graph_us(fn: Callable[[int], object], calls: int, rounds: int = 10) -> list[float]:
    """Per-call us of ``fn(i)`` for i in 0..calls-1 captured in one graph, per replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return times


def time_arms(
    arms: dict[str, Callable[[int], object]],
    checked: set[str],
    out: torch.Tensor,
    ref: torch.Tensor,
    rounds: int,
    calls: int,
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """(us per call of each arm over every replay, why each failed arm failed). An arm is
    ``fn(i)`` for input set i; its first call (set 0) must build and run, and those in
    ``checked`` must write ``out`` within 1e-2 of ``ref`` (relative to its largest
    value). The rest are timed in ``rounds`` rounds, the order rotating each round."""
    arms = dict(arms)
    failed = {}
    for tag, fn in list(arms.items()):
        try:
            out.fill_(float("nan"))
            fn(0)
            torch.cuda.synchronize()
        except Exception as e:  # a variant this Triton / GPU cannot build or run
            failed[tag] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            del arms[tag]
            continue
        if tag in checked:
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                failed[tag] = f"wrong result: max error {err:.3g} of the largest output"
                del arms[tag]
    times = {tag: [] for tag in arms}
    for r in range(rounds):
        names = list(arms)
        for tag in names[r % len(names) :] + names[: r % len(names)]:
            times[tag] += graph_us(arms[tag], calls)
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return times, failed


def report(
    times: dict[str, list[float]], failed: dict[str, str], peer: str,
    rate: Callable[[float], str], width: int,
) -> None:  # fmt: skip
    """One line per arm, fastest first: median us, p20 / p80, ``rate(us)``, the ratio to
    arm ``peer``; then the failed arms."""
    peer_us = statistics.median(times[peer])
    for med, tag in sorted((statistics.median(t), tag) for tag, t in times.items()):
        t = sorted(times[tag])
        p20, p80 = t[len(t) // 5], t[len(t) * 4 // 5]
        print(f"  {tag:{width}s} {med:8.2f} us  (p20 {p20:7.2f}, p80 {p80:7.2f})  "
              f"{rate(med)}  {peer_us / med:5.3f}x {peer}")  # fmt: skip
    for tag, why in failed.items():
        print(f"  {tag:{width}s} failed: {why}")
