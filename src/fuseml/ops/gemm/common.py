"""Jit helpers every GEMM kernel shares: the dot (``mma``), the epilogue, tile
coordinates, and the host-side choice of float32 dot precision."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseml import settings
from fuseml.ops._elementwise import _activation
from fuseml.ops._math import EPILOGUE_FAST


@triton.jit
def round_tf32(v):
    """Round float32 to the nearest tf32 (10-bit mantissa), NaN kept as NaN.

    Fed float32, the tensor cores drop the low 13 mantissa bits (truncation), about 2.5x
    the error of cuBLAS, which rounds. Adding half an ulp of tf32 to the bit pattern and
    clearing the low bits rounds to nearest (ties away from zero, as cvt.rna.tf32.f32 does).
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, v)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (set only under the interpreter): Triton's CPU interpreter
    multiplies bfloat16 dots wrongly (numpy has no bfloat16); products of 16-bit values
    are exact in float32, so upcasting first gives what the tensor cores give."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if PRECISION == "tf32" and a.dtype == tl.float32:
        return tl.dot(round_tf32(a), round_tf32(b), acc, input_precision="tf32")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _adapter_scale(
    t, rows, row_ok,  # (BLOCK_M, C) fp32 tile over stacked LoRA columns, its rows
    stacked, stacked_ok,  # (C,) stacked column indices (column c belongs to adapter c // RANK)
    ids_ptr, scale_ptr, lora_scale,
    MULTI: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr, RANK: tl.constexpr,
):  # fmt: skip
    """t scaled by its adapter's scaling; MULTI: each row keeps only its own adapter's
    columns (id -1: none)."""
    if MULTI:
        ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1)
        owner = stacked // RANK
        keep = ids[:, None] == owner[None, :]
        if PER_ADAPTER_SCALE:
            scale = tl.load(scale_ptr + owner, mask=stacked_ok, other=0.0)
            t = tl.where(keep, t * scale[None, :], 0.0)
        else:
            t = tl.where(keep, t * tl.cast(lora_scale, tl.float32), 0.0)
    else:
        t = t * tl.cast(lora_scale, tl.float32)
    return t


@triton.jit
def _bt_chunk(
    b_ptr, cols, N, stride_bn, rr, R: tl.constexpr, RANK: tl.constexpr, B3D: tl.constexpr
):
    """The B^T chunk (len(rr), len(cols)) of stacked B (N, R): zeros past R; columns past
    N read the last valid column, which the store drops. B3D: B as the caller gave it,
    (adapters, N, RANK) contiguous (stride_bn = RANK): stacked column c is column c % RANK
    of adapter c // RANK."""
    if B3D:
        roff = (rr // RANK).to(tl.int64) * N * RANK + rr % RANK
    else:
        roff = rr
    return tl.load(
        b_ptr + tl.minimum(cols, N - 1)[None, :] * stride_bn + roff[:, None],
        mask=(rr < R)[:, None],
        other=0.0,
    )  # fmt: skip


@triton.jit
def _xs_tile(xs_ptr, rows, M, rr, R: tl.constexpr):
    """Rows ``rows``, stacked columns ``rr`` of a row-major (M, R) buffer (xs / xa); zeros
    past M and R."""
    return tl.load(
        xs_ptr + rows[:, None] * R + rr[None, :], mask=(rows < M)[:, None] & (rr < R)[None, :],
        other=0.0,
    )  # fmt: skip


@triton.jit
def _epilogue(
    acc, rows, cols, M, N,  # (BLOCK_M, BLOCK_N) fp32 tile, its int64 row / column indices
    bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,  # as in _gemm_body
    stride_rm, stride_om, stride_bn, alpha, lora_scale,
    xa,  # (BLOCK_M, R_PAD) fp32 x @ A^T when LORA == 1 (accumulated in the main loop)
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    LORA: tl.constexpr, MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr,
    R_PAD: tl.constexpr, R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    bias_v=0.0, res_v=0.0,  # the bias (BLOCK_N,) / residual tile, when loaded earlier
    BIAS_LOADED: tl.constexpr = False, RES_LOADED: tl.constexpr = False,
    b_v=0.0, B_LOADED: tl.constexpr = False,  # LORA 1: the B^T chunk (R_BLOCK, BLOCK_N)
    B3D: tl.constexpr = False,  # B as (adapters, N, RANK), see _bt_chunk
    STORE: tl.constexpr = True,  # False: the caller stores the returned tile (_tma_store)
):  # fmt: skip
    """out = act(acc [+ (s * xa) @ B^T] + bias + alpha * residual), stored once (returned
    too, in float32). Shared by every GEMM kernel, so the epilogue cannot drift between
    them."""
    row_ok = rows < M
    col_ok = cols < N
    if LORA == 3:  # shrink: the tile's columns are stacked LoRA columns
        acc = _adapter_scale(
            acc, rows, row_ok, cols, col_ok, ids_ptr, scale_ptr, lora_scale,
            MULTI, PER_ADAPTER_SCALE, RANK,
        )  # fmt: skip
    if LORA == 1 or LORA == 2:
        # (s * xa) @ B^T, R_BLOCK stacked columns at a time (one step unless precomputed).
        for r0 in tl.static_range(0, R_PAD, R_BLOCK):
            rr = r0 + tl.arange(0, R_BLOCK)
            r_ok = rr < R
            if LORA == 2:
                t = _xs_tile(xa_ptr, rows, M, rr, R)
            else:
                t = xa
            t = _adapter_scale(
                t, rows, row_ok, rr, r_ok, ids_ptr, scale_ptr, lora_scale,
                MULTI, PER_ADAPTER_SCALE, RANK,
            )  # fmt: skip
            if B_LOADED:
                bt = b_v
            else:
                bt = _bt_chunk(b_ptr, cols, N, stride_bn, rr, R, RANK, B3D)
            # The rank-R term is rounded to the input dtype, as the unmerged chain rounds it.
            acc = mma(t.to(bt.dtype), bt, acc, PRECISION, UPCAST)

    if HAS_BIAS:
        if not BIAS_LOADED:
            bias_v = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += bias_v.to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RES:
        if not RES_LOADED:
            res_v = tl.load(
                res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0
            )
        # alpha arrives as fp64 under torch.compile: pin the epilogue to fp32.
        acc += tl.cast(alpha, tl.float32) * res_v.to(tl.float32)
    acc = _activation(acc, ACTIVATION, EPILOGUE_FAST)
    if STORE:
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    return acc


@triton.jit
def _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr, SHORTCUT: tl.constexpr):
    """(row tile, column tile) of tile number ``tile`` in grouped order (GROUP_M row tiles
    a group). SHORTCUT: where the output is one tile wide or one tile tall, the grouped
    order is the plain one, so the tile number is used as it is. The grouped order's
    runtime divisions (about 25 instructions each, three in a row) sit ahead of the first
    load, and a skinny layer's kernel is about one round trip to memory long."""
    if SHORTCUT:
        if n_tiles_n == 1:
            pid_m = tile
            pid_n = tile * 0
        elif n_tiles_m == 1:
            pid_m = tile * 0
            pid_n = tile
        else:
            pid_m, pid_n = _grouped_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
    else:
        pid_m, pid_n = _grouped_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
    return pid_m, pid_n


@triton.jit
def _grouped_coords(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * n_tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(n_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


FP32_DOTS = settings.FP32_DOTS


def fp32_dot() -> str:
    """FUSEML_FP32_DOT: how float32 dots are computed where TF32 is not allowed.

    tf32x3 (default): each operand is split into a TF32 part and a TF32 remainder and three
    tensor-core products are summed (the small x small one dropped); its error against a
    float64 reference is at or below cuBLAS's fp32 SGEMM at about twice its speed. ieee:
    plain fp32 FMA dots (about half of cuBLAS's speed; always the pointer-load kernel).
    """
    return settings.fp32_dot()


def lora_cols(lora_b: torch.Tensor) -> int:
    """R, the stacked LoRA columns of B: (N, R) stacked, or (adapters, N, rank) as given
    (contiguous, rank a power of two >= 16: see fuseml.ops.lora.stack_adapters)."""
    if lora_b.dim() == 2:
        return lora_b.shape[1]
    return lora_b.shape[0] * lora_b.shape[2]


def dot_precision(dtype: torch.dtype) -> str:
    """The dot's input precision: TF32 for fp32 inputs only when torch's own matmul flag
    allows it (as F.linear does), else fp32 accuracy (``fp32_dot``); 16-bit inputs ignore it."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return fp32_dot()
    return "tf32"
