"""``fuseml.ops.softmax`` / ``log_softmax``: one read and one write per element.

The naive chain (max, subtract, exp, sum, divide) reads the matrix five times and writes
it three times. Here a row that fits on chip is loaded once into registers, reduced and
written once: one program per row (or tile of short rows), or for the longest such rows a
persistent grid sized from the compiled kernel's register and shared-memory use. A row
too long for that is split over several programs that each hold a chunk in registers
and exchange their chunks' (max, sum) through a small scratch buffer (still one read and
one write); past 64 chunks a row is streamed twice (statistics with a running max and
sum, then the output). exp(x) is never materialised in memory.

Math in float32 whatever the storage dtype; the output has the input's dtype.
"""

from __future__ import annotations

import torch

from fuseml import _cuda_ext
from fuseml.ops import _fastcall
from fuseml.ops._softmax.long_rows import launch_long_rows
from fuseml.ops._softmax.rows import MAX_ONCHIP_COLS, _launch_rows
from fuseml.ops._softmax.strided import _launch_strided, _three_dim_view
from fuseml.ops._utils import check_tensor, compiled, fused_op, launches_skipped, needs_dispatch
from fuseml.runtime import resolve_backend


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reference: torch's softmax (float32 math for 16-bit inputs, like the kernels)."""
    return torch.softmax(x, dim)


def log_softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(x, dim)


def _forward(
    x: torch.Tensor,
    dim: int,
    log: bool,
    impl: str,
    traced: bool,
    *,
    path: str | None = None,
    block: int | None = None,
    split: tuple[int, int] | None = None,
    pairs: bool = True,
    strided_tile: int | None = None,
) -> torch.Tensor:
    """Softmax along ``dim`` with the Triton or CUDA kernels; output contiguous.

    The keywords force a Triton kernel where a test must (the defaults are the rules):
    ``path`` (one of long_rows.LONG_ROW_PATHS) sends every row to that long-row kernel,
    with ``block``, ``split`` and ``pairs`` as in launch_long_rows (ignored without
    ``path``); ``strided_tile`` runs a non-last ``dim`` in two passes over tiles of that
    many elements.
    """
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    long_rows = (
        None if path is None else {"path": path, "block": block, "split": split, "pairs": pairs}
    )
    if dim == x.dim() - 1 and x.is_contiguous():
        # The common case, with the fewest host-side tensor operations: the eager path's
        # per-call cost is what small softmaxes are made of.
        n = x.shape[-1]
        out = torch.empty_like(x)
        if not launches_skipped():
            _dispatch(x.view(-1, n), out.view(-1, n), log, impl, traced, long_rows)
        return out
    if impl == "triton" and x.dim() > 0 and dim < x.dim() - 1:
        x3 = _three_dim_view(x, dim)
        if x3 is not None:  # no transposing copy: reduce down the strided dim in place
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            if not launches_skipped():
                _launch_strided(x3, out.view(x3.shape), log, traced, strided_tile)
            return out
    moved = x.movedim(dim, -1) if x.dim() else x.reshape(1)
    # The CUDA twin (and a layout with no (outer, N, inner) view) pays one transposing
    # copy for a non-last dim; the last dim of a row-strided view costs nothing.
    x2 = moved.reshape(-1, moved.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out_moved = torch.empty(moved.shape, dtype=x.dtype, device=x.device)
    out = out_moved.movedim(-1, dim) if x.dim() else out_moved.reshape(())
    if launches_skipped():
        return out.contiguous() if x.dim() else out
    _dispatch(x2, out_moved.view(-1, moved.shape[-1]), log, impl, traced, long_rows)
    return out.contiguous() if x.dim() else out


def _dispatch(
    x2: torch.Tensor,
    out2: torch.Tensor,
    log: bool,
    impl: str,
    traced: bool,
    long_rows: dict | None = None,
) -> None:
    """The path choice for (M, N) rows: the CUDA twin, the on-chip kernel up to
    MAX_ONCHIP_COLS columns, else the long-row kernels. ``long_rows``: keywords of
    launch_long_rows that send every row there (see _forward)."""
    if impl == "cuda":
        _cuda_ext.require("log_softmax" if log else "softmax")
        torch.ops.fuseml.softmax_cuda_out(x2, log, out2)
    elif long_rows is None and x2.shape[1] <= MAX_ONCHIP_COLS:
        _launch_rows(x2, out2, log, traced)
    else:
        launch_long_rows(x2, out2, log, traced, **(long_rows or {}))


# ------------------------------------------------------------------------ registration
@fused_op("fuseml::softmax")
def _softmax_op(x: torch.Tensor, dim: int, impl: str) -> torch.Tensor:
    return _forward(x, dim, False, impl, traced=True)


@fused_op("fuseml::log_softmax")
def _log_softmax_op(x: torch.Tensor, dim: int, impl: str) -> torch.Tensor:
    return _forward(x, dim, True, impl, traced=True)


def _setup(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    y32, g32 = y.float(), grad.float()
    dx = y32 * (g32 - (g32 * y32).sum(ctx.dim, keepdim=True))
    return dx.to(y.dtype), None, None


def _log_softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    g32 = grad.float()
    dx = g32 - torch.exp(y.float()) * g32.sum(ctx.dim, keepdim=True)
    return dx.to(y.dtype), None, None


torch.library.register_autograd("fuseml::softmax", _softmax_backward, setup_context=_setup)
torch.library.register_autograd("fuseml::log_softmax", _log_softmax_backward, setup_context=_setup)


# ---------------------------------------------------------------------------- public
def _normalize_dim(op: str, x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    rank = max(x.dim(), 1)
    if not -rank <= dim < rank:
        raise ValueError(
            f"{op}: dim must be in [{-rank}, {rank - 1}] for a {x.dim()}-d x, got {dim}"
        )
    return dim % rank


def _public(op: str, x, dim, backend: str, log: bool) -> torch.Tensor:
    fast = _fastcall.loaded()  # a repeat call launched from C++ (see fuseml.ops._fastcall)
    plain = fast is not None and type(x) is torch.Tensor and type(dim) is int
    call = _fastcall.entry(fast, backend) if plain else None
    if call is not None:
        out = call(_fastcall.SOFTMAX_ROWS, int(log), x, None, None, 1.0, dim)
        if out is not None:
            return out
    check_tensor(op, "x", x)
    dim = _normalize_dim(op, x, dim)
    backend = resolve_backend(backend, x.device, op)
    ref = log_softmax_ref if log else softmax_ref
    if backend == "eager":
        return ref(x, dim)
    if backend == "compile":
        return compiled(ref)(x, dim)
    if needs_dispatch(x):
        return (torch.ops.fuseml.log_softmax if log else torch.ops.fuseml.softmax)(x, dim, backend)
    return _forward(x, dim, log, backend, traced=False)


def softmax(x: torch.Tensor, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """Softmax of a float32/float16/bfloat16 tensor along ``dim``, float32 math.

    backend: auto (triton on CUDA tensors, eager otherwise) | eager | compile | triton | cuda.
    """
    return _public("softmax", x, dim, backend, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """log(softmax(x)) along ``dim``, computed as x - max - log(sum(exp(x - max)))."""
    return _public("log_softmax", x, dim, backend, log=True)
