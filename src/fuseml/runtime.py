"""Device and backend discovery.

Nothing here runs at import time: every probe is a function, so ``import fuseml`` never
initialises CUDA or compiles anything.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import re
import sys

import torch

from fuseml._cuda_ext import cuda_toolchain_available, ninja_available, nvcc_path

log = logging.getLogger("fuseml")
__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "cuda_available",
    "cuda_backend_status",
    "cuda_toolchain_available",
    "device_info",
    "enable_triton_key_cache",
    "gpu_slug",
    "ninja_available",
    "nvcc_path",
    "resolve_backend",
    "tf32_matmuls",
    "triton_available",
    "triton_interpreting",
    "triton_version",
    "versions",
]

BACKENDS = ("auto", "eager", "compile", "triton", "cuda")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_INTERPRETING: list = []  # read once: kernels are bound to the mode when they are defined


@contextlib.contextmanager
def tf32_matmuls(allow: bool):
    """torch's TF32 matmul flag (``torch.backends.cuda.matmul.allow_tf32``) set for the
    block and restored after it."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@contextlib.contextmanager
def gc_paused(collect: bool = False):
    """Python's cyclic garbage collector paused for the block (``collect``: run once
    first), for CUDA-graph captures. A collection inside a capture runs the finalizers of
    whatever cyclic garbage is pending; a CUDA graph freed there destroys its executable,
    which no capture permits, and the capture fails ("operation failed due to a previous
    error during capture"). torch.cuda.graph no longer collects before capturing (unless
    torch.compiler.config.force_cudagraph_gc)."""
    if collect:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def graph_capture(graph, *, collect: bool = False, **kwargs):
    """``torch.cuda.graph(graph, **kwargs)`` with the collector paused (``gc_paused``):
    every capture fuseml makes goes through here."""
    with gc_paused(collect), torch.cuda.graph(graph, **kwargs):
        yield


def triton_interpreting() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter.

    Triton reads TRITON_INTERPRET when a kernel is defined (fuseml.ops import time), so a
    later change of the variable does not change the mode: read it once.
    """
    if not _INTERPRETING:
        _INTERPRETING.append(os.environ.get("TRITON_INTERPRET", "0") == "1")
    return _INTERPRETING[0]


_TRITON_VERSION: list = []  # filled on first use; a plain list so torch.compile can trace it


def triton_version() -> str | None:
    if not _TRITON_VERSION:
        if importlib.util.find_spec("triton") is None:
            _TRITON_VERSION.append(None)
        else:
            import triton

            _TRITON_VERSION.append(triton.__version__)
    return _TRITON_VERSION[0]


def cuda_available() -> bool:
    # torch.cuda.is_available() asks the driver for a device count; it creates no context.
    return torch.cuda.is_available()


def triton_available(device: torch.device | str) -> bool:
    """Can a Triton kernel run on tensors of ``device``?

    CUDA tensors: compiled Triton (not under the interpreter, which copies to the host).
    CPU tensors: only under the interpreter (TRITON_INTERPRET=1).
    """
    if triton_version() is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_available() and not triton_interpreting()
    if device.type == "cpu":
        return triton_interpreting()
    return False


def cuda_backend_status(device: torch.device | str) -> tuple[bool, str]:
    """(usable, reason) for the CUDA C++ backend on ``device``; builds the extension lazily."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the CUDA C++ backend runs on CUDA tensors, got a tensor on {device}"
    if not cuda_available():
        return False, "no CUDA device is visible to torch"
    from fuseml import _cuda_ext

    return _cuda_ext.status()


def resolve_backend(backend: str, device: torch.device, op: str, *, cuda_twin: bool = True) -> str:
    """Turn ``backend`` into a concrete one for tensors on ``device`` or raise ValueError.

    auto = triton on CUDA tensors (when Triton is installed), eager otherwise. An explicit
    backend that cannot run here raises: nothing falls back silently to another result.
    ``cuda_twin=False``: the op has no CUDA C++ twin, so backend='cuda' is refused.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if torch.compiler.is_compiling():
        # (traced: a constant, without the cache: dynamo would guard on the cache's
        # contents and replay its fill, so the second call compiled the caller again)
        return _resolve_constant(backend, device.type, op, cuda_twin)
    key = (backend, device.type, cuda_twin)
    resolved = _RESOLVED.get(key)
    if resolved is None:
        resolved = _resolve_constant(backend, device.type, op, cuda_twin)
        _RESOLVED[key] = resolved  # only successes: a failure raises every time
    return resolved


_RESOLVED: dict = {}  # (backend, device type, cuda_twin) -> backend: this runs on every call


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (about
    1 s) at fuseml's import: that decorator only marks ``fn`` with this attribute, which
    dynamo reads when it meets a call of ``fn``."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _resolve_constant(backend: str, device_type: str, op: str, cuda_twin: bool) -> str:
    # The first resolution may happen while torch.compile traces a caller (a model compiled
    # before any eager fuseml call): run it eagerly there and keep the answer as a constant,
    # since it looks up modules and builds the CUDA extension under a lock, neither of which
    # dynamo traces (fullgraph=True would fail).
    return _resolve(backend, torch.device(device_type), op, cuda_twin)


def _resolve(backend: str, device: torch.device, op: str, cuda_twin: bool) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available(device) else "eager"
    if backend == "triton" and not triton_available(device):
        why = (
            "Triton is not installed"
            if triton_version() is None
            else f"tensors on {device} need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors"
        )
        raise ValueError(f"{op}: backend='triton' is unavailable here: {why}")
    if backend == "cuda":
        if not cuda_twin:
            raise ValueError(
                f"{op}: backend='cuda' is not offered (no CUDA C++ twin); use auto, eager, "
                "compile or triton"
            )
        ok, reason = cuda_backend_status(device)
        if not ok:
            raise ValueError(f"{op}: backend='cuda' is unavailable here: {reason}")
    return backend


def enable_triton_key_cache() -> bool:
    """Keep Triton's installation hash on disk (under FUSEML_CACHE) instead of recomputing
    it in every process: 0.4 s of the first launch on an H100 host. Opt-in, since it
    replaces ``triton_key`` in every loaded Triton module (Inductor's callers too); the
    command line calls it. Idempotent; True where installed (see fuseml._triton_key)."""
    from fuseml import _triton_key

    return _triton_key.install()


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (used for results folders)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_info(index: int = 0) -> dict:
    """Name, SM count, memory, L2 and compute capability of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    return {
        "name": p.name,
        "slug": gpu_slug(p.name),
        "sm_count": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
        "capability": f"{p.major}.{p.minor}",
    }


def versions() -> dict:
    import platform

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version(),
    }
