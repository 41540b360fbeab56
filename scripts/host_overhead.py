"""Host time per call of the fused linear path, broken down (GPU probe for dev work).

PYTHONPATH=src python scripts/host_overhead.py [mlp | elementwise | linear M,K,N]

``mlp``: the fused MLP's call path only, down to the compiled kernel's own launcher.
``elementwise``: GELU, bias_act and softmax per call, each backend, with the Triton
kernels' repeat launches through the compiled kernel's launcher and through Triton's own.
``linear M,K,N``: one bf16 + bias + ReLU layer's call (e.g. 512,367,512: K padded per call,
see fuseml.ops.linear), its host time and a cProfile of it.
"""

from __future__ import annotations

import cProfile
import importlib
import pstats
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fuseml
from fuseml.ops import _gemm
from fuseml.runtime import cuda_backend_status

lin_mod = importlib.import_module("fuseml.ops.linear")  # fuseml.ops.linear is also the function


@triton.jit
def _k1(a_ptr):
    pass


@triton.jit
def _k24(
    a0, a1, a2, a3, a4, i0, i1, i2, i3, i4, i5, i6, i7, i8, f0,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
    C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
):  # fmt: skip
    pass


def host_us(fn, n=3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def profile_calls(label: str, fn, top: int, calls: int = 1000) -> None:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by their own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"== cProfile: {label}, {calls} calls")
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main():
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(64, 256, device=dev, dtype=dt)
    w = torch.randn(64, 256, device=dev, dtype=dt)
    b = torch.randn(64, device=dev, dtype=dt)
    out = torch.empty(64, 64, device=dev, dtype=dt)
    cfg = _gemm.default_config(64, 64, 256, dt)
    fuseml.ops.linear(x, w, b, "relu")
    rows = {
        "torch F.linear + relu": lambda: torch.relu(F.linear(x, w, b)),
        "torch addmm_activation": lambda: torch._addmm_activation(b, x, w.t()),
        "fuseml.ops.linear": lambda: fuseml.ops.linear(x, w, b, "relu"),
        "linear_rows": lambda: lin_mod.linear_rows(x, w, b, None, 1.0, 1),
        "launch_linear": lambda: _gemm.launch_linear(out, x, w, b, None, 1.0, 1, cfg),
        "choose_config": lambda: _gemm.choose_config("linear", x, 64, 256, None),
        "fuseml.ops.bias_act": lambda: fuseml.ops.bias_act(out, b, None, 1.0, "relu"),
        "empty kernel 1 arg": lambda: _k1[(1,)](x),
        "empty kernel 15 args + 9 constexpr": lambda: _k24[(1,)](
            x,
            w,
            b,
            out,
            x,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            9,
            1.0,
            C0=1,
            C1=2,
            C2=3,
            C3=4,
            C4=5,
            C5=6,
            C6=7,
            C7=8,
            C8="tf32",
        ),
    }
    # TMA launches: host TensorDescriptors, encoded by Triton's launcher on every launch
    # (linear TMA: 2; LoRA expand: a shrink launch with 2 used, then a main launch with 4).
    from triton.tools.tensor_descriptor import TensorDescriptor

    xl = torch.randn(2048, 1024, device=dev, dtype=dt)
    wl = torch.randn(1024, 1024, device=dev, dtype=dt)
    bl = torch.randn(1024, device=dev, dtype=dt)
    al = torch.randn(16, 1024, device=dev, dtype=dt)
    bbl = torch.randn(1024, 16, device=dev, dtype=dt)
    fuseml.ops.lora_linear(xl, wl, bl, al, bbl, 2.0)  # tunes (expand mode at 2048 rows)
    fuseml.ops.lora_linear(xl[:64], wl, bl, al, bbl, 2.0)  # in-loop mode
    rows.update({
        "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(x, [16, 64]),
        "launch_linear, TMA kernel": lambda: _gemm.launch_linear(
            out, x, w, b, None, 1.0, 1, cfg, tma=True
        ),
        "lora_linear M=2048 (expand: 2 launches)": lambda: fuseml.ops.lora_linear(
            xl, wl, bl, al, bbl, 2.0
        ),
        "lora_linear M=64 (in-loop: 1 launch)": lambda: fuseml.ops.lora_linear(
            xl[:64], wl, bl, al, bbl, 2.0
        ),
    })  # fmt: skip
    # Modules and a whole model, as fuseml.optimize leaves them (parameters, no_grad).
    from fuseml.models.bench_cases import random_inputs
    from fuseml.models.dlrm import DLRM, DLRMConfig

    lin = fuseml.nn.FusedLinear(256, 64, activation="relu", device=dev, dtype=dt)
    mlp = fuseml.nn.FusedMLP([13, 512, 256, 64, 16], device=dev, dtype=dt)
    x13 = torch.randn(64, 13, device=dev, dtype=dt)
    cfg_d = DLRMConfig.from_name("kaggle", max_cardinality=100_000)
    with torch.device(dev):
        model = DLRM(cfg_d)
    model = model.to(dt).eval()
    model.embeddings.check_ids = False
    fused_model, _ = fuseml.optimize(model)
    dense, sparse = random_inputs(cfg_d, 1, dev, dt)
    with torch.no_grad():
        lin(x), mlp(x13), fused_model(dense, sparse)
    rows.update({
        "FusedLinear module (no_grad)": lambda: lin(x),
        "FusedMLP module 13-512-256-64-16": lambda: mlp(x13),
        "DLRM kaggle B=1 eager": lambda: model(dense, sparse),
        "DLRM kaggle B=1 fuseml.optimize": lambda: fused_model(dense, sparse),
    })  # fmt: skip
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"{name:40s} {host_us(fn):7.1f} us/call (host)", flush=True)
        for label, fn in (
            ("fuseml.ops.linear", lambda: fuseml.ops.linear(x, w, b, "relu")),
            ("fused DLRM forward", lambda: fused_model(dense, sparse)),
            ("lora_linear expand", lambda: fuseml.ops.lora_linear(xl, wl, bl, al, bbl, 2.0)),
        ):
            profile_calls(label, fn, 25)

    # TF32: how far is cuBLAS's own tf32 from float64 (the tolerance table's entry)?
    from fuseml.testing import rel_err

    xf = torch.randn(300, 512, device=dev)
    wf = torch.randn(256, 512, device=dev) / 512**0.5
    bf = torch.randn(256, device=dev)
    ref = torch.relu(F.linear(xf.double(), wf.double(), bf.double()))
    torch.backends.cuda.matmul.allow_tf32 = True
    print("tf32 rel err: cuBLAS", rel_err(torch.relu(F.linear(xf, wf, bf)), ref),
          "fuseml", rel_err(fuseml.ops.linear(xf, wf, bf, "relu"), ref))  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = False


def mlp_breakdown() -> None:
    """Host time of one fused MLP call, layer by layer of the call path, and of a launch
    through the compiled kernel's own launcher (CompiledKernel[grid](*args): Triton's
    argument binding and cache lookup skipped)."""
    import itertools

    mlp_mod = importlib.import_module("fuseml.ops.mlp")
    dev, dt = "cuda", torch.bfloat16
    widths = [13, 512, 256, 64, 16]
    ws = [torch.randn(n, k, device=dev, dtype=dt) for k, n in itertools.pairwise(widths)]
    bs = [torch.randn(n, device=dev, dtype=dt) for n in widths[1:]]
    x = torch.randn(256, 13, device=dev, dtype=dt)
    out = torch.empty(256, 16, device=dev, dtype=dt)
    codes = [1, 1, 1, 1]
    module = fuseml.nn.FusedMLP(widths, device=dev, dtype=dt)
    seq = module.to_sequential()
    cfg = mlp_mod._CHAIN_DEFAULT
    fuseml.ops.mlp(x, ws, bs, "relu")
    # the chain kernel's full argument list, as _launch_chain passes it
    n = len(ws)
    ds = widths + [1] * (9 - len(widths))
    ps = [mlp_mod._padded(d) for d in ds[2:]]
    args = [x, out, *ws, *[None] * (8 - n), *bs, *[None] * (8 - n), 256, 13, 16, *ds, *ps,
            16, 16, n, sum(c << (4 * i) for i, c in enumerate(codes)), (1 << n) - 1, "tf32",
            False, 64, 64, 16]  # fmt: skip
    opts = {"num_warps": 4, "num_stages": 3}
    compiled = mlp_mod._chain_kernel[(4,)](*args, **opts)
    fast = compiled[(4, 1, 1)]
    try:
        out.fill_(float("nan"))
        fast(*args)
        torch.cuda.synchronize()
        same = torch.equal(out, fuseml.ops.mlp(x, ws, bs, "relu", backend="triton"))
        print("CompiledKernel runner: same output as fuseml.ops.mlp:", same)
    except Exception as err:  # this Triton's launcher takes other arguments: say so
        print("CompiledKernel runner failed:", str(err).splitlines()[0])
        fast = None
    rows = {
        "nn.Sequential (eager) 13-512-256-64-16": lambda: seq(x),
        "FusedMLP module": lambda: module(x),
        "fuseml.ops.mlp": lambda: fuseml.ops.mlp(x, ws, bs, "relu"),
        "torch.ops.fuseml.mlp": lambda: torch.ops.fuseml.mlp(x, ws, bs, codes),
        "mlp_rows": lambda: mlp_mod.mlp_rows(x, ws, bs, codes),
        "_launch_chain": lambda: mlp_mod._launch_chain(x, out, ws, bs, codes, cfg, False),
        "_chain_kernel[grid](...)": lambda: mlp_mod._chain_kernel[(4,)](*args, **opts),
        "empty kernel 1 arg": lambda: _k1[(1,)](x),
    }
    if fast is not None:
        rows["CompiledKernel[grid](...)"] = lambda: compiled[(4, 1, 1)](*args)
        rows["CompiledKernel runner, bound once"] = lambda: fast(*args)
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"{name:40s} {host_us(fn):7.1f} us/call (host)", flush=True)
        profile_calls("FusedMLP module", lambda: module(x), 30)


def elementwise_breakdown() -> None:
    """Host time per call of the elementwise and softmax ops: torch's kernels, the CUDA
    twin, the Triton kernels with repeat launches through CompiledLaunches (the default)
    and through Triton's ordinary launch, and the custom op through the dispatcher."""
    ew = importlib.import_module("fuseml.ops._elementwise")
    sm = importlib.import_module("fuseml.ops.softmax")
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4096, 512, device=dev, dtype=dt)
    b = torch.randn(512, device=dev, dtype=dt)
    r = torch.randn(4096, 512, device=dev, dtype=dt)
    xf = torch.randn(1 << 20, device=dev)
    s = torch.randn(4096, 1024, device=dev, dtype=dt)
    cuda = cuda_backend_status(dev)[0]
    rows = {
        "torch F.gelu, 1M fp32": lambda: F.gelu(xf),
        "torch bias + residual + relu (3 kernels)": lambda: torch.relu(x + b + 0.5 * r),
        "torch.softmax 4096 x 1024": lambda: torch.softmax(s, -1),
    }
    for backend in ("triton", "cuda") if cuda else ("triton",):
        rows.update({
            f"fuseml gelu 1M fp32, {backend}": lambda be=backend: fuseml.ops.gelu(xf, backend=be),
            f"fuseml bias_act 4096 x 512, {backend}": lambda be=backend: fuseml.ops.bias_act(
                x, b, r, 0.5, "relu", backend=be
            ),
            f"fuseml softmax 4096 x 1024, {backend}": lambda be=backend: fuseml.ops.softmax(
                s, backend=be
            ),
        })  # fmt: skip
    rows.update({
        "torch.ops.fuseml.bias_act (dispatcher)": lambda: torch.ops.fuseml.bias_act(
            x, b, r, 0.5, "relu", "triton"
        ),
        "torch.ops.fuseml.softmax (dispatcher)": lambda: torch.ops.fuseml.softmax(s, -1, "triton"),
    })  # fmt: skip
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"{name:45s} {host_us(fn):7.1f} us/call (host)", flush=True)
        for launches in (ew._bias_act_launches, sm._rows_launches):
            launches.enabled = False
        for name in [n for n in rows if n.startswith("fuseml") and n.endswith("triton")]:
            print(f"{name + ', ordinary launch':45s} {host_us(rows[name]):7.1f} us/call (host)")
        for launches in (ew._bias_act_launches, sm._rows_launches):
            launches.enabled = True
        profile_calls(
            "fuseml.ops.bias_act (triton)",
            lambda: fuseml.ops.bias_act(x, b, r, 0.5, "relu", backend="triton"),
            20,
        )


def linear_breakdown(shape: str) -> None:
    m, k, n = (int(v) for v in shape.split(","))
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    b = torch.randn(n, device=dev, dtype=dt)

    def fn():
        return fuseml.ops.linear(x, w, b, "relu")

    print(torch.cuda.get_device_name(), f"{m} x {k} -> {n}: {host_us(fn, 2000):.1f} us/call (host)")
    profile_calls(f"fuseml.ops.linear {m} x {k} -> {n}", fn, 20)


if __name__ == "__main__":
    import sys

    modes = {"mlp": mlp_breakdown, "elementwise": elementwise_breakdown}
    if sys.argv[1:2] == ["linear"]:
        linear_breakdown(sys.argv[2] if sys.argv[2:] else "512,367,512")
    else:
        modes.get(sys.argv[1] if sys.argv[1:] else "", main)()
