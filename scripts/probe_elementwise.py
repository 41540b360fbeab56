"""Time the elementwise epilogue's CUDA twin under both grid policies, next to the Triton
kernel and a same-size copy, on the GPU.

The CUDA launcher reads FUSEML_EW_CUDA_GRID once per process ("wave": one resident wave of
blocks striding over the tensor; default: one block per tile), so each policy runs in a
child process of its own. Medians of triton.testing.do_bench (L2 flushed), GB/s counted
as one read of each input and one write.

Usage (GPU machine): PYTHONPATH=src python3 scripts/probe_elementwise.py
"""

import os
import subprocess
import sys

CASES = (  # op, dtype, shape, bias, residual
    ("add", "float32", (1 << 28,), False, True),
    ("add", "bfloat16", (1 << 28,), False, True),
    ("gelu", "float32", (1 << 28,), False, False),
    ("gelu", "bfloat16", (1 << 28,), False, False),
    ("gelu", "bfloat16", (1 << 24,), False, False),
    ("gelu_tanh", "bfloat16", (1 << 28,), False, False),
    ("gelu", "bfloat16", (65536, 4096), True, False),
    ("relu", "bfloat16", (4096, 4096), True, True),
    ("relu", "bfloat16", (65536, 4096), True, True),
    ("gelu", "bfloat16", (4096, 4096), True, False),
)


def time_case(policy, op, dtype_name, shape, has_bias, has_y) -> str:
    import torch
    import triton.testing

    from fuseml.ops import _elementwise as ew

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    y = torch.randn_like(x) if has_y else None
    b = torch.randn(shape[-1], device="cuda", dtype=dtype) if has_bias else None
    out = torch.empty_like(x)
    act = ew.ACT_CODE["none" if op == "add" else op]
    nbytes = (2 + has_y) * x.numel() * x.element_size()
    cells = []
    impls = ("cuda", "triton") if policy == "full" else ("cuda",)
    for impl in impls:
        t = ms(lambda impl=impl: ew.bias_act_into(out, x, y, b, 1.0, act, impl=impl))
        cells.append(f"{impl} {t * 1e3:8.1f} us {nbytes / t / 1e6:7.0f} GB/s")
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    cells.append(f"copy {t * 1e3:8.1f} us")
    return f"[{policy:4}] {op:9} {dtype_name:8} {shape!s:14} " + " | ".join(cells)


def child(policy: str) -> None:
    from fuseml.runtime import cuda_backend_status

    ok, why = cuda_backend_status("cuda")  # builds / loads the CUDA twin
    if not ok:
        raise SystemExit(f"CUDA twin unavailable: {why}")
    for case in CASES:
        print(time_case(policy, *case), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    for policy in ("full", "wave"):
        env = dict(os.environ)
        env.pop("FUSEML_EW_CUDA_GRID", None)
        if policy == "wave":
            env["FUSEML_EW_CUDA_GRID"] = "wave"
        subprocess.run([sys.executable, __file__, "--child", policy], env=env, check=True)


if __name__ == "__main__":
    main()
