"""The streaming kernel for skinny plain layers at many rows (one column tile of W
kept on chip, row tiles streamed through it)."""

from __future__ import annotations

import triton
import triton.language as tl

from fuseml.ops._math import _pdl_begin
from fuseml.ops.gemm.common import _epilogue, mma


@triton.jit
def _linear_stream_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,  # as in _gemm_body
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_om, alpha,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Skinny layers at many rows (K within one BLOCK_K step, a few column tiles): each
    program keeps one column tile of W and the bias on chip, loaded once, and streams row
    tiles through them, the next tiles' x loads issued while this one computes and stores
    (the loop is software-pipelined over STAGES buffers). Program p takes column tile
    p % n_tiles_n and every (programs / n_tiles_n)-th row tile from p // n_tiles_n; the
    launcher makes the grid a multiple of n_tiles_n (see ``stream_grid``). PDL: as in
    _linear_kernel."""
    if PDL:
        _pdl_begin()
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % n_tiles_n
    row_programs = tl.num_programs(0) // n_tiles_n
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + tl.minimum(cols, N - 1)[None, :] * stride_wn + ks[:, None] * stride_wk
    if EVEN_K:
        wt = tl.load(w_ptrs)
    else:
        wt = tl.load(w_ptrs, mask=(ks < K)[:, None], other=0.0)
    bias_v = 0.0
    if HAS_BIAS:
        bias_v = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    for tile_m in tl.range(pid // n_tiles_n, tl.cdiv(M, BLOCK_M), row_programs, num_stages=STAGES):
        # (tile_m * BLOCK_M < M fits int32; the int64 arange widens the offsets after it)
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + tile_m * BLOCK_M
        # clamped rows, as in _gemm_body: no row mask on the load, the store drops them
        x_ptrs = x_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm + ks[None, :] * stride_xk
        if EVEN_K:
            xt = tl.load(x_ptrs)
        else:
            xt = tl.load(x_ptrs, mask=(ks < K)[None, :], other=0.0)
        acc = mma(xt, wt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, UPCAST)
        _epilogue(
            acc, rows, cols, M, N, bias_ptr, res_ptr, out_ptr, x_ptr, x_ptr, x_ptr, x_ptr,
            stride_rm, stride_om, 0, alpha, 1.0, 0.0,
            HAS_BIAS, HAS_RES, ACTIVATION, 0, False, 1, 1, 16, 16, False, PRECISION, UPCAST,
            bias_v, 0.0, True,
        )  # fmt: skip
