"""The Triton kernels of ``fuseml.ops.mlp``: the register-resident chain kernel and the
persistent scratch kernel (see that module for when each runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from fuseml.ops._elementwise import _activation
from fuseml.ops._math import EPILOGUE_FAST, _pdl_begin
from fuseml.ops.gemm import mma


@triton.jit
def _pick(i: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """The i-th argument, chosen at compile time."""
    if i == 0:
        r = v0
    elif i == 1:
        r = v1
    elif i == 2:
        r = v2
    elif i == 3:
        r = v3
    elif i == 4:
        r = v4
    elif i == 5:
        r = v5
    elif i == 6:
        r = v6
    else:
        r = v7
    return r


@triton.jit
def _mlp_layer(
    src_ptr, src_rows, src_ok,  # input block: base, (BLOCK_M,) row offsets, row mask
    w_ptr, b_ptr,  # (N, K) contiguous weight, (N,) bias
    dst_ptr, dst_rows, dst_ok,  # output block, as for the input
    K, N,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dst = act(src @ W^T + b) for one block of BLOCK_M rows, BLOCK_N columns at a time."""
    ks = tl.arange(0, BLOCK_K)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(
                src_ptr + src_rows[:, None] + kk[None, :],
                mask=src_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * K + kk[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc = mma(a, w, acc, PRECISION, UPCAST)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # A bare name, not ew._activation: torch.compile re-parses user Triton kernels and
        # resolves only plain global names (the attribute form failed under inductor).
        acc = _activation(acc, ACT, EPILOGUE_FAST)
        tl.store(
            dst_ptr + dst_rows[:, None] + cols[None, :],
            acc.to(dst_ptr.dtype.element_ty),
            mask=dst_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _mlp_kernel(
    x_ptr,  # (M, D0) input, unit column stride
    out_ptr,  # (M, D_L) output, contiguous
    scratch_ptr,  # (programs, 2, BLOCK_M, MAX_W) per-program ping-pong buffers
    w0, w1, w2, w3, w4, w5, w6, w7,  # (D_{i+1}, D_i) contiguous weights (unused: any)
    b0, b1, b2, b3, b4, b5, b6, b7,  # (D_{i+1},) biases
    d0, d1, d2, d3, d4, d5, d6, d7, d8,  # widths: D0 in, D_{i+1} out of layer i
    M,
    stride_xm,
    stride_om,
    NUM_LAYERS: tl.constexpr,
    ACTS: tl.constexpr,  # activation code of layer i in bits [4i, 4i + 4)
    BIASES: tl.constexpr,  # bit i: layer i has a bias
    MAX_W: tl.constexpr,  # widest intermediate (scratch row length)
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    s0 = scratch_ptr + pid.to(tl.int64) * (2 * BLOCK_M * MAX_W)
    s1 = s0 + BLOCK_M * MAX_W
    local = tl.arange(0, BLOCK_M)
    s_rows = local.to(tl.int64) * MAX_W
    s_ok = local < BLOCK_M
    for rb in range(pid, tl.cdiv(M, BLOCK_M), n_prog):
        rows = (rb * BLOCK_M + local).to(tl.int64)
        row_ok = rows < M
        for i in tl.static_range(NUM_LAYERS):
            w = _pick(i, w0, w1, w2, w3, w4, w5, w6, w7)
            b = _pick(i, b0, b1, b2, b3, b4, b5, b6, b7)
            k = _pick(i, d0, d1, d2, d3, d4, d5, d6, d7)
            n = _pick(i, d1, d2, d3, d4, d5, d6, d7, d8)
            if i == 0:
                src, src_rows, src_ok = x_ptr, rows * stride_xm, row_ok
            elif i % 2 == 1:
                src, src_rows, src_ok = s0, s_rows, s_ok
            else:
                src, src_rows, src_ok = s1, s_rows, s_ok
            if i == NUM_LAYERS - 1:
                dst, dst_rows, dst_ok = out_ptr, rows * stride_om, row_ok
            elif i % 2 == 0:
                dst, dst_rows, dst_ok = s0, s_rows, s_ok
            else:
                dst, dst_rows, dst_ok = s1, s_rows, s_ok
            _mlp_layer(
                src, src_rows, src_ok, w, b, dst, dst_rows, dst_ok, k, n,
                (BIASES >> i) & 1, (ACTS >> (4 * i)) & 15, PRECISION, UPCAST,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            # The block's threads wrote what all of them read next (and the next row block
            # overwrites the buffers): one CTA barrier per layer.
            tl.debug_barrier()


@triton.jit
def _chain_layer(
    h, w_ptr, b_ptr,
    K: tl.constexpr, N: tl.constexpr, PK: tl.constexpr, PN: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """act(h @ W^T + b) for a (BLOCK_M, PK) register tile h: the whole (K, N) weight in one
    dot (PK, PN <= 256), padded rows and columns zero."""
    ks = tl.arange(0, PK)
    ns = tl.arange(0, PN)
    w = tl.load(
        w_ptr + ns[None, :] * K + ks[:, None],
        mask=(ks[:, None] < K) & (ns[None, :] < N),
        other=0.0,
    )
    acc = mma(h, w, tl.zeros((BLOCK_M, PN), dtype=tl.float32), PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
    return _activation(acc, ACT, EPILOGUE_FAST)


@triton.jit
def _chain_kernel(
    x_ptr,  # (M, D0) input, unit column stride
    out_ptr,  # (M, D_L) output
    w0, w1, w2, w3, w4, w5, w6, w7,  # (D_{i+1}, D_i) contiguous weights (unused: None)
    b0, b1, b2, b3, b4, b5, b6, b7,  # (D_{i+1},) biases (absent: None)
    M,
    stride_xm,
    stride_om,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    D4: tl.constexpr, D5: tl.constexpr, D6: tl.constexpr, D7: tl.constexpr, D8: tl.constexpr,
    P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
    P6: tl.constexpr, P7: tl.constexpr, P8: tl.constexpr,  # padded widths (powers of 2, >= 16)
    D_OUT: tl.constexpr, P_OUT: tl.constexpr,  # the last layer's width, padded
    NUM_LAYERS: tl.constexpr,
    ACTS: tl.constexpr,  # activation code of layer i in bits [4i, 4i + 4)
    BIASES: tl.constexpr,  # bit i: layer i has a bias
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # layer 0's output columns per step (= layer 1's K step)
    BLOCK_K: tl.constexpr,  # layer 0's K step
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
):  # fmt: skip
    """Every layer of the chain for BLOCK_M rows, all intermediates in registers.

    Layers 0 and 1 run as one stream: CHUNK columns of layer 0's output at a time, each
    activated, rounded to the input dtype and at once multiplied into layer 1's (BLOCK_M,
    P2) accumulator as its next K step, so layer 0's output (up to 1024 wide) is never
    held whole. Layers 2 on take their input whole from registers (widths <= 256).
    """
    if PDL:
        _pdl_begin()
    dt = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    n2 = tl.arange(0, P2)
    n2_ok = n2 < D2
    if D0 <= BLOCK_K:  # the input row block fits one K step: load it once
        k0 = tl.arange(0, BLOCK_K)
        xa = tl.load(x_rows + k0[None, :], mask=row_ok[:, None] & (k0[None, :] < D0), other=0.0)
    acc = tl.zeros((BLOCK_M, P2), dtype=tl.float32)
    for j in range(0, D1, CHUNK):
        n1 = j + tl.arange(0, CHUNK)
        n1_ok = n1 < D1
        c = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)
        if D0 <= BLOCK_K:
            w = tl.load(
                w0 + n1[None, :] * D0 + k0[:, None],
                mask=(k0[:, None] < D0) & n1_ok[None, :],
                other=0.0,
            )
            c = mma(xa, w, c, PRECISION, UPCAST)
        else:
            for k in range(0, D0, BLOCK_K):
                kk = k + tl.arange(0, BLOCK_K)
                k_ok = kk < D0
                a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(
                    w0 + n1[None, :] * D0 + kk[:, None],
                    mask=k_ok[:, None] & n1_ok[None, :],
                    other=0.0,
                )
                c = mma(a, w, c, PRECISION, UPCAST)
        if BIASES & 1:
            c += tl.load(b0 + n1, mask=n1_ok, other=0.0).to(tl.float32)[None, :]
        c = _activation(c, ACTS & 15, EPILOGUE_FAST)
        w = tl.load(
            w1 + n2[None, :] * D1 + n1[:, None],
            mask=n1_ok[:, None] & n2_ok[None, :],
            other=0.0,
        )
        acc = mma(c.to(dt), w, acc, PRECISION, UPCAST)
    if (BIASES >> 1) & 1:
        acc += tl.load(b1 + n2, mask=n2_ok, other=0.0).to(tl.float32)[None, :]
    h = _activation(acc, (ACTS >> 4) & 15, EPILOGUE_FAST)
    # Layers 2 to 7 written out: each has its own constexpr widths, and a jit helper picking
    # the i-th of them (as _pick does for pointers) returns a runtime value, which tl.arange
    # refuses.
    if NUM_LAYERS > 2:
        h = _chain_layer(
            h.to(dt), w2, b2, D2, D3, P2, P3, (BIASES >> 2) & 1, (ACTS >> 8) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 3:
        h = _chain_layer(
            h.to(dt), w3, b3, D3, D4, P3, P4, (BIASES >> 3) & 1, (ACTS >> 12) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 4:
        h = _chain_layer(
            h.to(dt), w4, b4, D4, D5, P4, P5, (BIASES >> 4) & 1, (ACTS >> 16) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 5:
        h = _chain_layer(
            h.to(dt), w5, b5, D5, D6, P5, P6, (BIASES >> 5) & 1, (ACTS >> 20) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 6:
        h = _chain_layer(
            h.to(dt), w6, b6, D6, D7, P6, P7, (BIASES >> 6) & 1, (ACTS >> 24) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 7:
        h = _chain_layer(
            h.to(dt), w7, b7, D7, D8, P7, P8, (BIASES >> 7) & 1, (ACTS >> 28) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    cols = tl.arange(0, P_OUT)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        h.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols[None, :] < D_OUT),
    )
