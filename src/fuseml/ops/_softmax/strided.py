"""Softmax over a non-last dim, reduced down the strided axis in place (no transposing
copy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseml.ops._math import LOG2E, _exp2, _pdl_begin, _rcp
from fuseml.ops._softmax.long_rows import _pdl_options
from fuseml.ops._utils import cdiv, fast_math, next_pow2


@triton.jit
def _softmax_strided_kernel(
    x_ptr,  # (outer, N, inner) input view, any strides
    out_ptr,  # (outer, N, inner) contiguous output
    n_red,  # N: the softmax dim
    n_inner,  # product of the dims after it
    stride_xo,
    stride_xn,
    stride_xi,
    LOG: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK_N covers N: one read, the tile stays in registers
    BLOCK_N: tl.constexpr,  # positions along N per step
    BLOCK_I: tl.constexpr,  # inner positions per program (the coalesced direction)
    FAST: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
):
    if PDL:
        _pdl_begin()
    # Softmax over a non-last dim without transposing: a program owns BLOCK_I neighbouring
    # inner positions of one outer index and reduces down the N axis of a
    # (BLOCK_N, BLOCK_I) tile, so each load is a run of BLOCK_I consecutive elements.
    # Longer N: running max and sum per inner position (as the online kernel), then a
    # second pass writes the output.
    pid = tl.program_id(0)
    n_iblocks = tl.cdiv(n_inner, BLOCK_I)
    o = (pid // n_iblocks).to(tl.int64)
    inner = (pid % n_iblocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = inner < n_inner
    inner64 = inner.to(tl.int64)
    x_base = x_ptr + o * stride_xo + inner64[None, :] * stride_xi
    out_base = out_ptr + o * n_red * n_inner + inner64[None, :]
    rs = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        r64 = rs.to(tl.int64)[:, None]
        mask = (rs < n_red)[:, None] & i_ok[None, :]
        x = tl.load(x_base + r64 * stride_xn, mask=mask, other=-float("inf")).to(tl.float32)
        z = x - tl.max(x, axis=0)[None, :]  # an all -inf column gives NaN, as torch
        e = _exp2(z * LOG2E, FAST)
        total = tl.sum(e, axis=0)[None, :]
        if LOG:
            y = z - tl.log(total)
        else:
            y = e * _rcp(total, FAST)
        tl.store(out_base + r64 * n_inner, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full([BLOCK_I], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK_I], tl.float32)
        for start in range(0, n_red, BLOCK_N):
            r = start + rs
            mask = (r < n_red)[:, None] & i_ok[None, :]
            x = tl.load(
                x_base + r.to(tl.int64)[:, None] * stride_xn, mask=mask, other=-float("inf")
            ).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # see the online kernel
            s = s * _exp2((m - shift) * LOG2E, FAST) + tl.sum(
                _exp2((x - shift[None, :]) * LOG2E, FAST), axis=0
            )
            m = m_new
        log_total = tl.log(s)
        inv_total = _rcp(s, FAST)
        for start in range(0, n_red, BLOCK_N):
            r = start + rs
            r64 = r.to(tl.int64)[:, None]
            mask = (r < n_red)[:, None] & i_ok[None, :]
            x = tl.load(x_base + r64 * stride_xn, mask=mask, other=0.0).to(tl.float32)
            z = x - m[None, :]
            if LOG:
                y = z - log_total[None, :]
            else:
                y = _exp2(z * LOG2E, FAST) * inv_total[None, :]
            tl.store(out_base + r64 * n_inner, y.to(out_ptr.dtype.element_ty), mask=mask)


# Tiles of at most STRIDED_TILE elements; one pass (the tile held in registers) where the
# whole softmax dim fits in a tile of STRIDED_ONE_PASS.
STRIDED_TILE = 4096
STRIDED_ONE_PASS = 8192


def _launch_strided(
    x3: torch.Tensor, out3: torch.Tensor, log: bool, traced: bool, tile: int | None = None
) -> None:
    """Softmax over dim 1 of (outer, N, inner) views; out3 contiguous. ``tile``: two
    passes over tiles of that many elements whatever N (tests, at small sizes)."""
    outer, n_red, n_inner = x3.shape
    block_i = min(next_pow2(n_inner), 128 if x3.element_size() == 2 else 64)
    one_pass = tile is None and next_pow2(n_red) * block_i <= STRIDED_ONE_PASS
    tile = tile or STRIDED_TILE
    block_n = next_pow2(n_red) if one_pass else max(1, tile // block_i)
    grid = (outer * cdiv(n_inner, block_i),)
    kernel = (
        torch.library.wrap_triton(_softmax_strided_kernel) if traced else _softmax_strided_kernel
    )
    kernel[grid](
        x3, out3, n_red, n_inner, x3.stride(0), x3.stride(1), x3.stride(2),
        LOG=log, ONE_PASS=one_pass, BLOCK_N=block_n, BLOCK_I=block_i, FAST=fast_math(x3),
        num_warps=8 if block_n * block_i > tile else 4, **_pdl_options(x3, traced),
    )  # fmt: skip


def _three_dim_view(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """x as (outer, N, inner) around ``dim`` without copying, or None if no such view."""
    outer = 1
    for size in x.shape[:dim]:
        outer *= size
    inner = 1
    for size in x.shape[dim + 1 :]:
        inner *= size
    try:
        return x.view(outer, x.shape[dim], inner)
    except RuntimeError:
        return None
