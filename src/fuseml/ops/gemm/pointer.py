"""The pointer-load main loop (``_gemm_body``, any layout and GPU) and its kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from fuseml.ops._math import _pdl_begin
from fuseml.ops.gemm.common import (
    _bt_chunk,
    _epilogue,
    _tile_coords,
    _xs_tile,
    mma,
)


@triton.jit
def _gemm_body(
    pid,
    x_ptr,  # (M, K) input, any strides
    w_ptr,  # (N, K) weight (nn.Linear layout), any strides
    bias_ptr,  # (N,) contiguous, unused unless HAS_BIAS
    res_ptr,  # (M, N) residual, unit column stride, unused unless HAS_RES
    out_ptr,  # (M, N) output, unit column stride
    a_ptr,  # LoRA A stacked (R, K), unit K stride; used when LORA == 1
    b_ptr,  # LoRA B stacked (N, R), unit R stride; used when LORA > 0
    xa_ptr,  # (M, R) fp32 x @ A^T, contiguous; used when LORA == 2
    ids_ptr,  # (M,) int adapter id per row (-1: none); used when MULTI
    scale_ptr,  # (adapters,) fp32 scaling per adapter; used when PER_ADAPTER_SCALE
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_rm,  # residual row stride
    stride_om,  # output row stride
    stride_ar,  # A row stride (over R)
    stride_bn,  # B row stride (over N)
    alpha,  # scale of the residual
    lora_scale,  # single-adapter LoRA scaling (MULTI: per adapter from scale_ptr)
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACTIVATION: tl.constexpr,  # code from fuseml.ops._elementwise.ACTIVATIONS
    LORA: tl.constexpr,  # 0 none, 1 in-loop, 2 precomputed
    MULTI: tl.constexpr,  # per-row adapter ids
    R: tl.constexpr,  # total LoRA columns (adapters x rank)
    RANK: tl.constexpr,  # rank of one adapter (column c belongs to adapter c // RANK)
    R_PAD: tl.constexpr,  # R rounded up to a power of two >= 16 (tl.dot minimum)
    R_BLOCK: tl.constexpr,  # stacked columns per epilogue step (R_PAD when LORA == 1)
    PER_ADAPTER_SCALE: tl.constexpr,  # MULTI: scaling from scale_ptr, else lora_scale
    PRECISION: tl.constexpr,  # "tf32", "tf32x3" or "ieee" for fp32 inputs (see dot_precision)
    UPCAST: tl.constexpr,  # interpreter only: see mma()
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles per group of the grouped order
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks in the main loop
    PDL: tl.constexpr = False,  # programmatic dependent launch (LORA 3 / 4, see pdl_available)
    ONE_STEP: tl.constexpr = False,  # K <= BLOCK_K (LORA 0 only): see below
    B3D: tl.constexpr = False,  # B as (adapters, N, RANK), see _bt_chunk
    REG_PIPE: tl.constexpr = False,  # LORA 0: each step's loads a step early (see below)
):
    if LORA == 3 and PDL:  # shrink: let the expand launch start now (it waits for xs)
        tl.extra.cuda.gdc_launch_dependents()
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, n_tiles_m, n_tiles_n, GROUP_M, True)

    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows / columns read the last valid row / column instead of being
    # masked, so the main loop's loads carry no row or column mask; the store drops them.
    # (Clamped, not wrapped as `rows % M`: a 64-bit remainder is a software routine of
    # dozens of instructions per index, all ahead of the first load.)
    x_ptrs = x_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + tl.minimum(cols, N - 1)[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rs = tl.arange(0, R_PAD)
    xa = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)  # LORA 1: x @ A^T, else unused
    if LORA == 1:
        a_ptrs = a_ptr + rs[None, :] * stride_ar + ks[:, None]  # A^T tile (K, R_PAD)
    bias_v = 0.0
    res_v = 0.0
    b_v = 0.0  # LORA 1 / 4: the B^T chunk (R_PAD, BLOCK_N), prefetched where one step
    s_v = 0.0  # LORA 4 without PDL: the xs tile (BLOCK_M, R_PAD), prefetched likewise
    B_EARLY: tl.constexpr = (LORA == 1 or LORA == 4) and R_PAD == R_BLOCK
    # The epilogue's loads that do not wait on the loop (bias; LoRA's B tile, and xs where
    # no launch overlaps) go before it: a small-M kernel is a few round trips to memory
    # long, and a load issued after the loop adds one.
    if HAS_BIAS:
        bias_v = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    if B_EARLY:
        b_v = _bt_chunk(b_ptr, cols, N, stride_bn, rs, R, RANK, B3D)
        if LORA == 4 and not PDL:
            s_v = _xs_tile(xa_ptr, rows, M, rs, R)
    if ONE_STEP:
        # One masked step, with the epilogue's bias (and a small tile's residual) loaded
        # alongside x and W: a skinny layer's kernel is about one round trip to memory
        # long, and a load issued after the dot would add a second.
        if HAS_RES and BLOCK_M * BLOCK_N <= 64 * 64:
            res_v = tl.load(
                res_ptr + rows[:, None] * stride_rm + cols[None, :],
                mask=(rows < M)[:, None] & (cols < N)[None, :], other=0.0,
            )  # fmt: skip
        k_ok = ks < K
        xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = mma(xt, wt, acc, PRECISION, UPCAST)
    elif REG_PIPE:
        # Rows that are not 16-byte aligned (K = 367) get no asynchronous copies, and then
        # Triton's pipeliner leaves the loop as is: every step would wait for its own
        # loads. Here each step's loads go out a step early, into registers, and arrive
        # while the step before is multiplied (the last step's loads are all masked).
        k_ok = ks < K
        xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
            k_ok = ks < K - k0
            x_next = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w_next = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = mma(xt, wt, acc, PRECISION, UPCAST)
            xt = x_next
            wt = w_next
    else:
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wt = tl.load(w_ptrs)
            else:
                k_ok = ks < K - k0
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = mma(xt, wt, acc, PRECISION, UPCAST)
            if LORA == 1:
                if EVEN_K:
                    at = tl.load(a_ptrs, mask=rs[None, :] < R, other=0.0)
                else:
                    at = tl.load(a_ptrs, mask=k_ok[:, None] & (rs[None, :] < R), other=0.0)
                xa = mma(xt, at, xa, PRECISION, UPCAST)
                a_ptrs += BLOCK_K
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    if LORA == 4:  # expand: xs @ B^T as more K steps (xs scaled and masked by the shrink)
        if PDL:  # launched while the shrink runs: wait for its xs
            tl.extra.cuda.gdc_wait()
        for r0 in tl.static_range(0, R_PAD, R_BLOCK):
            rr = r0 + tl.arange(0, R_BLOCK)
            if B_EARLY and not PDL:
                st = s_v
            else:
                st = _xs_tile(xa_ptr, rows, M, rr, R)
            if B_EARLY:
                bt = b_v
            else:
                bt = _bt_chunk(b_ptr, cols, N, stride_bn, rr, R, RANK, B3D)
            acc = mma(st, bt, acc, PRECISION, UPCAST)

    _epilogue(
        acc, rows, cols, M, N, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
        stride_rm, stride_om, stride_bn, alpha, lora_scale, xa,
        HAS_BIAS, HAS_RES, ACTIVATION, LORA, MULTI, R, RANK, R_PAD, R_BLOCK, PER_ADAPTER_SCALE,
        PRECISION, UPCAST, bias_v, res_v, True,
        ONE_STEP and BLOCK_M * BLOCK_N <= 64 * 64, b_v, B_EARLY and LORA == 1, B3D,
    )  # fmt: skip


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,  # as in _gemm_body
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_om, alpha,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, ONE_STEP: tl.constexpr,
    PDL: tl.constexpr = False, REG_PIPE: tl.constexpr = False,
):  # fmt: skip
    """Plain linear layers: the GEMM body without the LoRA arguments (half the launch
    arguments, and Triton's host cost per launch grows with their number). ONE_STEP: K
    fits one BLOCK_K step (the DLRM's 13 -> 512 layer, 64 -> 16). PDL: launched with
    programmatic dependent launch (``pdl_launch``; not the body's LoRA PDL)."""
    if PDL:
        _pdl_begin()
    _gemm_body(
        tl.program_id(0), x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
        x_ptr, x_ptr, x_ptr, x_ptr, x_ptr,
        M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_om, 0, 0,
        alpha, 1.0,
        HAS_BIAS, HAS_RES, ACTIVATION, 0, False, 1, 1, 16, 16, False, PRECISION, UPCAST,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, False, ONE_STEP, False, REG_PIPE,
    )  # fmt: skip


@triton.jit
def _lora_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, a_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_om,
    stride_ar, stride_bn, alpha, lora_scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    LORA: tl.constexpr, MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr,
    R_PAD: tl.constexpr, R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, B3D: tl.constexpr,
):  # fmt: skip
    """LoRA layers (LORA 1 in-loop, 2 precomputed, 3 shrink, 4 expand): every argument of
    _gemm_body."""
    _gemm_body(
        tl.program_id(0), x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
        a_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
        M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_om,
        stride_ar, stride_bn, alpha, lora_scale,
        HAS_BIAS, HAS_RES, ACTIVATION, LORA, MULTI, R, RANK, R_PAD, R_BLOCK,
        PER_ADAPTER_SCALE, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, PDL,
        False, B3D,
    )  # fmt: skip
