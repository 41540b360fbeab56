"""Hardware ceilings measured on the device itself, so every result can say "% of what
this GPU can do" instead of "% of a datasheet".

* copy_gbps: a 1 GiB device-to-device copy, counting bytes read plus bytes written.
* matmul_bf16_tflops / matmul_tf32_tflops / matmul_fp32_tflops: 8192^3 products through
  torch (cuBLAS) on random data (zeros run faster and would flatter every kernel).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fuseml import runtime, settings

COPY_BYTES = 1 << 30
MATMUL_N = 8192


def _cache_path(slug: str) -> Path:
    return settings.cache_dir() / "ceilings" / f"{slug}.json"


def measure_ceilings(*, quick: bool = False) -> dict:
    """Measure the ceilings on CUDA device 0 now (about a second)."""
    from fuseml.bench.harness import Settings, bench_ms

    settings = Settings.for_mode(quick)
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy_ms, _, _ = bench_ms(lambda: dst.copy_(src), settings)
    src = dst = None  # free 2 GiB before the matmuls
    result = {"copy_gbps": round(2 * COPY_BYTES / (copy_ms * 1e-3) / 1e9, 1)}

    n = MATMUL_N
    flops = 2 * n**3
    for key, dtype, tf32 in (
        ("matmul_bf16_tflops", torch.bfloat16, False),
        ("matmul_tf32_tflops", torch.float32, True),
        ("matmul_fp32_tflops", torch.float32, False),
    ):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        with runtime.tf32_matmuls(tf32):
            ms, _, _ = bench_ms(lambda a=a, b=b: a @ b, settings)
        result[key] = round(flops / (ms * 1e-3) / 1e12, 1)
        del a, b
    torch.cuda.empty_cache()
    return result


def ceilings(*, remeasure: bool = False) -> dict:
    """Ceilings for device 0, cached per device (and torch version) on disk."""
    info = runtime.device_info()
    path = _cache_path(info["slug"])
    if not remeasure and path.exists():
        try:
            cached = json.loads(path.read_text())
            if cached.get("torch") == torch.__version__:
                return cached["ceilings"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: measure again and overwrite it
    measured = measure_ceilings()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"gpu": info["name"], "torch": torch.__version__, "ceilings": measured})
    )
    return measured
