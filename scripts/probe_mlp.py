"""GPU sweep of the fused MLP's launch configs (tuning work, not the benchmark).

    PYTHONPATH=src python scripts/probe_mlp.py [NAME:BATCH[:plans] ...]

For each DLRM MLP and batch (default: kaggle-bottom at 256, 4096 and 65536 rows, bf16):
the unfused chain (cuBLAS + activation kernels) and torch.compile of it, then every
candidate config of both fused kernels (the register-resident chain kernel where the
widths fit it, and the scratch kernel), each checked against the float64 reference. Times
are CUDA-graph replays (GPU time per call, L2 warm; triton.testing.do_bench_cudagraph),
median us, and TFLOP/s. NAME:BATCH:plans instead times splits of the chain: the first
layers through fuseml.ops.linear and the rest through the chain kernel, and every layer
through linear.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import torch
import triton.testing

import fuseml
from fuseml.bench.suites.mlp import MLPS
from fuseml.testing import rel_err

mlp_mod = importlib.import_module("fuseml.ops.mlp")  # the module (fuseml.ops.mlp: the op)


def graph_us(fn) -> float:
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3


def _problem(name: str, batch: int, dtype):
    """(widths, activations, weights, biases, x, activation codes, float64 reference,
    flops) of one MLP and batch; weights scaled as nn.Linear's, seeded."""
    widths, acts = MLPS[name]
    torch.manual_seed(0)
    layers = list(itertools.pairwise(widths))
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for k, n in layers]
    bs = [torch.randn(n, device="cuda", dtype=dtype) / 10 for _, n in layers]
    x = torch.randn(batch, widths[0], device="cuda", dtype=dtype)
    codes = [fuseml.ops.ACTIVATIONS.index(a) for a in acts]
    ref = fuseml.ops.mlp_ref(x.double(), [w.double() for w in ws], [b.double() for b in bs], acts)
    flops = 2 * batch * sum(k * n for k, n in layers)
    return widths, acts, ws, bs, x, codes, ref, flops


def probe(name: str, batch: int, dtype=torch.bfloat16) -> None:
    widths, acts, ws, bs, x, codes, ref, flops = _problem(name, batch, dtype)

    def show(label: str, us: float, err: float | None = None) -> None:
        e = "" if err is None else f" err={err:.1e}"
        print(f"  {label:44s} {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s{e}", flush=True)

    print(f"== {name} {'-'.join(map(str, widths))} B={batch} {str(dtype)[6:]}", flush=True)
    show("eager (graph)", graph_us(lambda: fuseml.ops.mlp_ref(x, ws, bs, acts)))
    compiled = torch.compile(lambda x: fuseml.ops.mlp_ref(x, ws, bs, acts), dynamic=False)
    compiled(x)
    show("compile (graph)", graph_us(lambda: compiled(x)))
    for cfg in mlp_mod.candidates(batch, widths, dtype):
        out = torch.empty(batch, widths[-1], device="cuda", dtype=dtype)
        label = " ".join(f"{k}={v}" for k, v in cfg.items() if k != "kind")
        label = f"{cfg.get('kind', 'scratch')} {label}"
        try:
            mlp_mod._launch_group(x, out, ws, bs, codes, cfg, False)
            err = rel_err(out, ref)
            us = graph_us(lambda cfg=cfg, out=out: mlp_mod._launch_group(
                x, out, ws, bs, codes, cfg, False))  # fmt: skip
        except Exception as e:  # a config that does not fit: say so, go on
            print(f"  {label:44s} failed: {str(e).splitlines()[0][:80]}", flush=True)
            continue
        show(label, us, err)


def plans(name: str, batch: int, dtype=torch.bfloat16) -> None:
    """Chains too wide for the chain kernel: every layer through fuseml.ops.linear, and
    linear for the first layers with the chain kernel (best config) for the rest."""
    from fuseml.ops.linear import linear_rows

    widths, _, ws, bs, x, codes, ref, flops = _problem(name, batch, dtype)
    n_layers = len(ws)
    print(f"== plans {name} {'-'.join(map(str, widths))} B={batch}", flush=True)

    def run(split: int, cfg: dict | None):
        h = x
        for i in range(split):
            h = linear_rows(h, ws[i], bs[i], None, 1.0, codes[i])
        if cfg is None:
            return h
        out = torch.empty(batch, widths[-1], device="cuda", dtype=dtype)
        mlp_mod._launch_group(h, out, ws[split:], bs[split:], codes[split:], cfg, False)
        return out

    for split in range(n_layers - 1):
        rest = widths[split:]
        if not mlp_mod.chain_fits(rest, dtype):
            continue
        for cfg in mlp_mod.candidates(batch, rest, dtype):
            err = rel_err(run(split, cfg), ref)
            us = graph_us(lambda split=split, cfg=cfg: run(split, cfg))
            label = " ".join(f"{k}={v}" for k, v in cfg.items() if k != "kind")
            print(f"  {split} linear + {cfg.get('kind', 'scratch')} {label:40s} {us:8.1f} us "
                  f"{flops / us / 1e6:6.1f} TFLOP/s err={err:.1e}", flush=True)  # fmt: skip
    err = rel_err(run(n_layers, None), ref)
    us = graph_us(lambda: run(n_layers, None))
    print(f"  every layer through linear {us:8.1f} us err={err:.1e}", flush=True)


def main(argv: list[str]) -> None:
    todo = argv or ["kaggle-bottom:256", "kaggle-bottom:4096", "kaggle-bottom:65536"]
    for item in todo:
        name, batch = item.split(":")[:2]
        if item.endswith(":plans"):
            plans(name, int(batch))
        else:
            probe(name, int(batch))


if __name__ == "__main__":
    main(sys.argv[1:])
