# ruff: noqa: B023, RUF007  (closures are called inside the loop iteration that made them)
"""Quick GPU probe of the fused linear family while tuning kernels (not the benchmark).

    PYTHONPATH=src python scripts/probe_linear.py [linear|lora|mlp ...]

Prints, per shape, the GPU time (CUDA-graph replays) of torch and fuseml and their ratio, plus the time of
fuseml's first call (tuning + compilation) per shape. The committed numbers come from
`fuseml bench linear|mlp|lora`; this is for fast iteration on one GPU call.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

import fuseml
from fuseml.testing import rel_err

DT = torch.bfloat16
dev = "cuda"


def bench(fn) -> float:
    """GPU time per call (CUDA-graph replays: host launch cost excluded), in us."""
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


def first_call(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def row(name, peers: dict, ours, check_against=None):
    t_first = first_call(ours)
    times = {k: bench(f) for k, f in peers.items()}
    t_ours = bench(ours)
    best = min(times, key=times.get)
    err = ""
    if check_against is not None:
        err = f" err={rel_err(ours(), check_against()):.1e}"
    peer_txt = " ".join(f"{k}={v:8.1f}" for k, v in times.items())
    print(
        f"{name:34s} {peer_txt} fuseml={t_ours:8.1f}us  best/fuseml={times[best] / t_ours:5.2f}x"
        f" first={t_first:5.2f}s{err}",
        flush=True,
    )


def probe_linear():
    shapes = [
        (m, k, n)
        for m in (1, 64, 4096, 65536)
        for k, n in ((13, 512), (367, 512), (256, 64), (64, 16), (1024, 1024))
    ]
    shapes += [(m, 4096, n) for m in (1, 16, 512, 4096) for n in (4096, 11008)]
    for m, k, n in shapes:
        x = torch.randn(m, k, device=dev, dtype=DT)
        w = torch.randn(n, k, device=dev, dtype=DT) / k**0.5
        b = torch.randn(n, device=dev, dtype=DT)
        row(
            f"linear M={m} {k}->{n} relu",
            {
                "eager": lambda: torch.relu(F.linear(x, w, b)),
                "addmm_act": lambda: torch._addmm_activation(b, x, w.t()),
            },
            lambda: fuseml.ops.linear(x, w, b, "relu"),
            lambda: torch.relu(F.linear(x, w, b)),
        )


def probe_lora():
    k = n = 4096
    w = torch.randn(n, k, device=dev, dtype=DT) / k**0.5
    for r in (8, 16, 64):
        a = torch.randn(r, k, device=dev, dtype=DT) / k**0.5
        bb = torch.randn(n, r, device=dev, dtype=DT) / r**0.5
        merged = (w.float() + 0.5 * bb.float() @ a.float()).to(DT)
        for m in (1, 16, 256, 1024, 4096, 8192):
            x = torch.randn(m, k, device=dev, dtype=DT)
            row(
                f"lora r={r} M={m}",
                {
                    "unmerged": lambda: F.linear(x, w) + F.linear(F.linear(x, a), bb) * 0.5,
                    "merged": lambda: F.linear(x, merged),
                },
                lambda: fuseml.ops.lora_linear(x, w, None, a, bb, 0.5),
                lambda: F.linear(x, merged),
            )
    r = 16
    for n_ad in (4, 16):
        a = torch.randn(n_ad, r, k, device=dev, dtype=DT) / k**0.5
        bb = torch.randn(n_ad, n, r, device=dev, dtype=DT) / r**0.5
        for m in (16, 1024, 8192):
            x = torch.randn(m, k, device=dev, dtype=DT)
            ids = torch.randint(0, n_ad, (m,), device=dev)
            row(
                f"lora multi n={n_ad} r={r} M={m}",
                {"single": lambda: fuseml.ops.lora_linear(x, w, None, a[0], bb[0], 0.5)},
                lambda: fuseml.ops.lora_linear(
                    x, w, None, a, bb, 0.5, adapter_ids=ids, check_ids=False
                ),
            )


def probe_mlp():
    chains = {
        "kaggle-bottom": [13, 512, 256, 64, 16],
        "kaggle-top": [367, 512, 256, 1],
        "mlperf-top": [479, 1024, 1024, 512, 256, 1],
    }
    for name, widths in chains.items():
        ws = [
            torch.randn(o, i, device=dev, dtype=DT) / i**0.5
            for i, o in zip(widths[:-1], widths[1:])
        ]
        bs = [torch.randn(o, device=dev, dtype=DT) for o in widths[1:]]
        acts = ["relu"] * len(ws)
        for m in (64, 4096, 65536):
            x = torch.randn(m, widths[0], device=dev, dtype=DT)
            eager = lambda: fuseml.ops.mlp_ref(x, ws, bs, acts)
            comp = torch.compile(fuseml.ops.mlp_ref)
            comp(x, ws, bs, acts)
            row(
                f"mlp {name} B={m}",
                {"eager": eager, "compile": lambda: comp(x, ws, bs, acts)},
                lambda: fuseml.ops.mlp(x, ws, bs, acts),
                eager,
            )


if __name__ == "__main__":
    torch.manual_seed(0)
    which = sys.argv[1:] or ["linear", "lora", "mlp"]
    print(torch.cuda.get_device_name(), flush=True)
    for w in which:
        globals()[f"probe_{w}"]()
