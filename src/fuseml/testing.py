"""Test helpers: the one tolerance table, error norms, poisoning and device parameters.

The demo and the bench use this module in a plain install, without pytest: only the
helpers that build pytest marks (``requires_cuda``, ``fused_targets``) import it.
"""

from __future__ import annotations

import torch

from fuseml import runtime

# Relative error norm ||out - ref|| / ||ref|| against a float64 reference. One table for
# the whole project: never loosen it for one test.
TOL = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}
TOL_TF32 = 3e-4  # float32 through a tf32 tensor-core dot

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tolerance(dtype: torch.dtype, *, tf32: bool = False) -> float:
    if dtype == torch.float32 and tf32:
        return TOL_TF32
    return TOL[dtype]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in ``out`` gives inf. Computed on
    the reference's device (a GPU test's large outputs are not copied to the CPU)."""
    ref64 = ref.detach().to(torch.float64)
    out64 = out.detach().to(device=ref64.device, dtype=torch.float64)
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    finite = torch.isfinite(ref64)
    if not torch.equal(finite, torch.isfinite(out64)):
        return float("inf")  # a NaN/inf where the reference is finite, or the reverse
    if not finite.all():
        o, r = out64[~finite], ref64[~finite]
        if not ((o == r) | (torch.isnan(o) & torch.isnan(r))).all():
            return float("inf")  # +inf vs -inf, or inf vs NaN
    diff = torch.linalg.vector_norm(out64[finite] - ref64[finite])
    scale = torch.linalg.vector_norm(ref64[finite])
    if scale == 0:
        return float(diff)
    return float(diff / scale)


def assert_close_verbose(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, *, tf32: bool = False
) -> None:
    """Assert rel_err(out, ref) <= tolerance(dtype); the message shows where it is worst."""
    dtype = dtype or out.dtype
    tol = tolerance(dtype, tf32=tf32)
    err = rel_err(out, ref)
    if not err <= tol:
        out64 = out.detach().to(torch.float64).cpu()
        ref64 = ref.detach().to(torch.float64).cpu()
        absdiff = (out64 - ref64).abs().nan_to_num(nan=float("inf"))
        idx = int(absdiff.flatten().argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), out64.shape))
        raise AssertionError(
            f"relative error {err:.3e} > {tol:.1e} ({dtype}); worst at {where}: "
            f"out={out64.flatten()[idx].item()!r} ref={ref64.flatten()[idx].item()!r}; "
            f"NaNs in out: {int(torch.isnan(out64).sum())}"
        )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so that an element the kernel never writes fails the comparison."""
    return t.fill_(float("nan"))


# Block sizes the caching allocator hands back to later allocations: small-pool blocks
# (under 1 MiB) and large-pool ones, which later allocations may split.
_POISON_BYTES = (
    (64 << 10,) * 16 + (512 << 10,) * 16 + (2 << 20,) * 8 + (16 << 20,) * 4 + (256 << 20,)
)


def poison_allocator(device: torch.device | str = "cuda") -> None:
    """Fill memory that the CUDA caching allocator holds free with NaN bits (all bytes
    0xFF: NaN in float32, float16 and bfloat16), so that an op's output (``torch.empty``)
    that a kernel leaves partly unwritten, or a kept copy that was never written, shows
    as NaN instead of passing on stale values."""
    blocks = [torch.empty(n, dtype=torch.uint8, device=device) for n in _POISON_BYTES]
    for b in blocks:
        b.fill_(255)
    torch.cuda.synchronize(device)
    del blocks  # back to the allocator's free blocks, poisoned


def capture_graph(fn, warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output) of ``fn()`` captured as the PyTorch docs do: ``warmup`` calls on
    a side stream first, then the capture (under ``torch.no_grad``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with runtime.graph_capture(graph, collect=True), torch.no_grad():
        out = fn()
    return graph, out


def replay_poisoned(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the graph's output) filled with NaN, then the graph replayed: an element a
    replay does not write shows."""
    poison_(out)
    graph.replay()
    return out


def __getattr__(name: str):
    # requires_cuda: a pytest mark, so built on first use, when pytest is there
    if name == "requires_cuda":
        import pytest

        return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fused_targets(*, cuda_twin: bool = True) -> list:
    """(device, backend) pairs on which fused kernels are tested, as pytest params.

    ("cpu", "triton") under the Triton interpreter; ("cuda", "triton") and, for ops with a
    CUDA C++ twin, ("cuda", "cuda") carry the gpu marker and skip themselves without a GPU.
    """
    import pytest

    gpu_marks = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]
    targets = [
        pytest.param(
            "cpu",
            "triton",
            id="cpu-triton",
            marks=pytest.mark.skipif(
                not runtime.triton_interpreting(), reason="CPU Triton needs TRITON_INTERPRET=1"
            ),
        ),
        pytest.param("cuda", "triton", id="cuda-triton", marks=gpu_marks),
    ]
    if cuda_twin:
        targets.append(pytest.param("cuda", "cuda", id="cuda-cuda", marks=gpu_marks))
    return targets
