"""Usage: python scripts/host_overhead.py [elementwise | linear [M,K,N] | mlp | lora | dlrm | all]
    [--profile N] [--calls 3000]

Host time per call (what dispatch and launch cost the CPU; the inputs are small, so the
GPU keeps up) of fuseml's public entry points, layer by layer of a call: torch's own
kernels, ``fuseml.ops.*`` per backend, the registered op through the dispatcher
(``torch.ops.fuseml.*``: the path torch.compile takes), the nn modules and a whole DLRM as
``fuseml.optimize`` leaves it; an empty Triton kernel is the floor of a Triton launch.
--profile N also prints a cProfile of each group's fuseml call: the N functions by their
own time. Needs a CUDA GPU. Default: all groups; ``linear`` takes one bf16 + bias + ReLU
layer's shape (default 512,367,512: K padded per call).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import sys
import time

import torch
import torch.nn.functional as F
import triton

import fuseml
from fuseml.runtime import cuda_backend_status

DEV, DT = "cuda", torch.bfloat16


@triton.jit
def _empty(a_ptr):
    pass


def host_us(fn, calls: int) -> float:
    """Host microseconds per call of ``fn``: the loop's wall time, the GPU not waited on."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def report(title: str, rows: dict, calls: int, profile: int, profiled: str | None) -> None:
    print(f"== {title}")
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"  {name:48s} {host_us(fn, calls):7.1f} us/call (host)", flush=True)
        if profile and profiled:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(1000):
                rows[profiled]()
            pr.disable()
            torch.cuda.synchronize()
            print(f"== cProfile: {profiled}, 1000 calls")
            pstats.Stats(pr).sort_stats("tottime").print_stats(profile)


def _backends() -> tuple[str, ...]:
    return ("triton", "cuda") if cuda_backend_status(DEV)[0] else ("triton",)


def elementwise() -> tuple[dict, str]:
    x = torch.randn(4096, 512, device=DEV, dtype=DT)
    b = torch.randn(512, device=DEV, dtype=DT)
    r = torch.randn(4096, 512, device=DEV, dtype=DT)
    xf = torch.randn(1 << 20, device=DEV)
    s = torch.randn(4096, 1024, device=DEV, dtype=DT)
    rows = {
        "torch F.gelu, 1M fp32": lambda: F.gelu(xf),
        "torch bias + residual + relu (3 kernels)": lambda: torch.relu(x + b + 0.5 * r),
        "torch.softmax 4096 x 1024": lambda: torch.softmax(s, -1),
        "empty Triton kernel, 1 argument": lambda: _empty[(1,)](x),
    }
    for be in _backends():
        rows[f"fuseml gelu 1M fp32, {be}"] = lambda be=be: fuseml.ops.gelu(xf, backend=be)
        rows[f"fuseml bias_act 4096 x 512, {be}"] = lambda be=be: fuseml.ops.bias_act(
            x, b, r, 0.5, "relu", backend=be
        )
        rows[f"fuseml softmax 4096 x 1024, {be}"] = lambda be=be: fuseml.ops.softmax(s, backend=be)
    rows["torch.ops.fuseml.bias_act (dispatcher)"] = lambda: torch.ops.fuseml.bias_act(
        x, b, r, 0.5, "relu", "triton"
    )
    rows["torch.ops.fuseml.softmax (dispatcher)"] = lambda: torch.ops.fuseml.softmax(
        s, -1, "triton"
    )
    return rows, "fuseml bias_act 4096 x 512, triton"


def linear(shape: str) -> tuple[dict, str]:
    m, k, n = (int(v) for v in shape.split(","))
    x = torch.randn(m, k, device=DEV, dtype=DT)
    w = torch.randn(n, k, device=DEV, dtype=DT) / k**0.5
    b = torch.randn(n, device=DEV, dtype=DT)
    lin = fuseml.nn.FusedLinear(k, n, activation="relu", device=DEV, dtype=DT)
    name = f"fuseml.ops.linear {m} x {k} -> {n}"
    rows = {
        "torch F.linear + relu": lambda: torch.relu(F.linear(x, w, b)),
        "torch addmm_activation (cuBLASLt epilogue)": lambda: torch._addmm_activation(b, x, w.t()),
        name: lambda: fuseml.ops.linear(x, w, b, "relu"),
        "torch.ops.fuseml.linear (dispatcher)": lambda: torch.ops.fuseml.linear(
            x, w, b, None, 1.0, "relu"
        ),
        "FusedLinear module": lambda: lin(x),
        "empty Triton kernel, 1 argument": lambda: _empty[(1,)](x),
    }
    return rows, name


def mlp() -> tuple[dict, str]:
    widths = [13, 512, 256, 64, 16]
    ws = [torch.randn(n, k, device=DEV, dtype=DT) for k, n in itertools.pairwise(widths)]
    bs = [torch.randn(n, device=DEV, dtype=DT) for n in widths[1:]]
    x = torch.randn(256, 13, device=DEV, dtype=DT)
    module = fuseml.nn.FusedMLP(widths, device=DEV, dtype=DT)
    seq = module.to_sequential()
    rows = {
        "nn.Sequential (eager) 13-512-256-64-16": lambda: seq(x),
        "fuseml.ops.mlp": lambda: fuseml.ops.mlp(x, ws, bs, "relu"),
        "torch.ops.fuseml.mlp (dispatcher)": lambda: torch.ops.fuseml.mlp(x, ws, bs, [1] * 4),
        "FusedMLP module": lambda: module(x),
    }
    return rows, "FusedMLP module"


def lora() -> tuple[dict, str]:
    x = torch.randn(2048, 1024, device=DEV, dtype=DT)
    w = torch.randn(1024, 1024, device=DEV, dtype=DT)
    b = torch.randn(1024, device=DEV, dtype=DT)
    a = torch.randn(16, 1024, device=DEV, dtype=DT)
    bb = torch.randn(1024, 16, device=DEV, dtype=DT)
    rows = {
        "lora_linear_ref (peft chain) M=64": lambda: fuseml.ops.lora_linear_ref(
            x[:64], w, b, a, bb, 2.0
        ),
        "fuseml.ops.lora_linear M=64": lambda: fuseml.ops.lora_linear(x[:64], w, b, a, bb, 2.0),
        "fuseml.ops.lora_linear M=2048": lambda: fuseml.ops.lora_linear(x, w, b, a, bb, 2.0),
    }
    return rows, "fuseml.ops.lora_linear M=2048"


def dlrm() -> tuple[dict, str]:
    from fuseml.models.bench_cases import random_inputs
    from fuseml.models.dlrm import DLRM, DLRMConfig

    cfg = DLRMConfig.from_name("kaggle", max_cardinality=100_000)
    with torch.device(DEV):
        model = DLRM(cfg)
    model = model.to(DT).eval()
    model.embeddings.check_ids = False  # valid ids by construction: no host check a call
    fused, _ = fuseml.optimize(model)
    dense, sparse = random_inputs(cfg, 1, DEV, DT)
    rows = {
        "DLRM kaggle B=1 eager": lambda: model(dense, sparse),
        "DLRM kaggle B=1 fuseml.optimize": lambda: fused(dense, sparse),
    }
    return rows, "DLRM kaggle B=1 fuseml.optimize"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("group", nargs="?", default="all",
                    choices=("elementwise", "linear", "mlp", "lora", "dlrm", "all"))  # fmt: skip
    ap.add_argument("shape", nargs="?", default="512,367,512", help="linear: M,K,N")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py: needs a CUDA GPU")
    groups = {
        "elementwise": elementwise, "linear": lambda: linear(a.shape), "mlp": mlp,
        "lora": lora, "dlrm": dlrm,
    }  # fmt: skip
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    for name in groups if a.group == "all" else (a.group,):
        with torch.no_grad():
            rows, profiled = groups[name]()
            for fn in rows.values():  # first calls (compilation, tuning) before any timing
                fn()
        report(name, rows, a.calls, a.profile, profiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
