"""The Triton GEMM behind ``linear`` and ``lora_linear``: out = epilogue(x @ W^T [+ LoRA]).

    h   = x @ W^T                                   (M, K) x (N, K)^T, fp32 accumulator
    h  += (s * (x @ A^T)) @ B^T                     LoRA, optional (see LORA modes)
    out = act(h + bias + alpha * residual)          rounded once to the output dtype

Two main loops share one epilogue (``_epilogue``), so plain and LoRA layers, and both
loops, compute the same thing: ``_gemm_body`` (pointer loads, any layout and GPU) and
``_tma_body`` (Hopper+: a persistent grid whose tiles the tensor-memory accelerator loads;
taken from ``TMA_MIN_M`` rows where rows are 16-byte aligned, tuned against the pointer
loop below that and for narrow outputs, see ``gemm_loop``). Where K fits one BLOCK_K step
the pointer loop is a single step (``ONE_STEP``, plain layers); for such skinny plain
layers at many rows the tuner also times ``_linear_stream_kernel`` (one column tile of W
kept on chip, row tiles streamed through it; same epilogue). Tiles are
visited in grouped order (GROUP_M row-tiles share each column strip of W while it is in
L2). Tile sizes come from ``fuseml.ops._tune``: measured once per device and shape bucket
and kept on disk.

LoRA modes (constexpr LORA):
  1  in-loop: the (BLOCK_M, R) product x @ A^T is accumulated inside the main K loop from
     the x tiles already loaded, then one (BLOCK_M, R) x (R, BLOCK_N) dot adds it to the
     tile. One launch; each column tile redoes the small product (R / BLOCK_N extra
     FLOPs), which is free while the GEMM waits on memory (small M).
  2  precomputed: xa = x @ A^T (fp32, M x R) comes from a first, small launch of this same
     kernel and the epilogue adds (s * xa) @ B^T. Two launches, R / N extra FLOPs in all:
     the better trade once the GEMM is compute-bound (large M). Pointer kernel, or TMA
     where the rank is not a multiple of 8.
  3  shrink: this launch *is* the first one of mode 4: x @ A^T with each row's scaling
     and adapter mask applied in the epilogue, stored in the input dtype (xs).
  4  expand (TMA kernel): xs and B tiles arrive through their own descriptors after the
     K loop and one more dot adds xs @ B^T to the accumulator: an extra K step over the
     stacked columns, no register-to-shared copies and no masking in the epilogue.
  5  joint (TMA kernel, one launch): the grid's first programs compute xs (as mode 3)
     on SMs the GEMM's tiles leave free, setting a flag per row tile of xs stored; the
     others run the GEMM tiles and, after the K loop, wait for their row tile's flag
     before adding xs @ B^T (as mode 4); the last tile to read a row tile's flag puts it
     back to zero, so no memset precedes the launch (``joint_flags``: 1.1-1.3 us a call
     in a CUDA graph at 64-512 rows, H100). The shrink's programs are the grid's lowest,
     which start first and wait on nothing, and the grid is no larger than the SM count,
     so the GEMM's wait always ends. Where every SM has tiles, the GEMM
     keeps as few programs as finish its tiles in the same rounds and the shrink takes
     the SMs left; where free SMs outnumber row tiles, K is split over them (float32
     parts the tiles sum in order). (H100, NOTES.md: against the overlapped pair,
     0.3-0.5 us less at 1 row, within noise at 64-1024 rows; at 4096 and 8192 rows,
     ranks 16 and 64, within 1-5% of fuseml's plain GEMM where expand in stream order
     took 8-12% more. The tuner picks per shape.)
  6  spread (TMA kernel, one launch, one tile a program: the tiles must fit one wave):
     each row tile's first R_PAD / SLICE column tiles also accumulate a SLICE-column
     slice of x @ A^T in their K loop, from the x tiles already loaded, and store it as
     xs (as mode 3), posting on the row tile's counter; every tile then waits for its
     row tile's slices and adds xs @ B^T (``_spread_expand``). No program streams all
     of K for the shrink, as the joint and overlapped modes' shrink programs do. For
     mixed batches of many adapters (16 x rank 16 at 256 rows, H100: 26.5 against 32.8
     us for the overlapped pair, NOTES.md).
Multi-adapter: A and B of every adapter are stacked along R (R = adapters x rank), and
each row keeps only the columns of its own adapter (id -1: none), scaled per adapter.
Exact, since the other columns are multiplied by zero. A mixed batch's shrink may
instead run per adapter segment (``launch_shrink_segments``: each row's own columns
only), timed by the tuner beside the stacked product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from fuseml.ops import _tune
from fuseml.ops._elementwise import _activation
from fuseml.ops._math import _pdl_begin
from fuseml.ops._utils import (
    CompiledLaunches,
    CounterSlab,
    aligned16,
    cdiv,
    grid_launch,
    int_spec,
    launches_skipped,
    next_pow2,
    pdl_launch,
    slab_counters,
    sm_count,
)
from fuseml.runtime import env_choice, env_flag, env_int, triton_interpreting

LORA_NONE, LORA_IN_LOOP, LORA_PRECOMPUTED, LORA_SHRINK, LORA_EXPAND, LORA_JOINT = 0, 1, 2, 3, 4, 5
LORA_SPREAD = 6

# Loads the epilogue needs that do not depend on the main loop (bias; LoRA's B tile, and xs
# where no launch overlaps) are issued before it, so their round trip to memory overlaps
# the loop instead of following it. FUSEML_GEMM_PREFETCH=0 issues them after the loop
# (probes; read at import).
PREFETCH = tl.constexpr(env_flag("FUSEML_GEMM_PREFETCH"))
# Tile coordinates without the grouped order's divisions where the output is one tile wide
# or tall (see _tile_coords). FUSEML_GEMM_TILE_SHORTCUT=0 keeps the divisions (probes;
# read at import).
TILE_SHORTCUT = tl.constexpr(env_flag("FUSEML_GEMM_TILE_SHORTCUT"))
# LORA 5: the fewest K steps of the joint shrink's loop that fit the GEMM's buffers (see
# _launch_tma; FUSEML_JOINT_SHRINK_STAGES, for probes)
JOINT_SHRINK_STAGES = env_int("FUSEML_JOINT_SHRINK_STAGES", 3, 1)
# LORA 5: the most parts K is split into for the shrink where free SMs outnumber row tiles
# (see _launch_tma; FUSEML_JOINT_SPLIT=1: no split, for probes)
JOINT_SPLIT = env_int("FUSEML_JOINT_SPLIT", 4, 1)


@triton.jit
def round_tf32(v):
    """Round float32 to the nearest tf32 (10-bit mantissa), NaN kept as NaN.

    Fed float32, the tensor cores drop the low 13 mantissa bits (truncation): on a
    512-term dot that gave 5.5e-4 relative error where cuBLAS, which rounds, gives 2.1e-4
    (H100). Adding half an ulp of tf32 to the bit pattern and clearing the low bits rounds
    to nearest (ties away from zero, as cvt.rna.tf32.f32 does).
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
    acc = _activation(acc, ACTIVATION)
    if STORE:
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    return acc


@triton.jit
def _tma_store(
    o_desc, y, off_m, off_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """The output tile y (BLOCK_M, BLOCK_N, float32) stored through o_desc (block (BLOCK_M,
    BLOCK_N // SUB)) in SUB column slices, 1, 2 or 4: each slice goes from registers to
    shared memory and out by the TMA (which drops what lies past M and N) while the next
    is converted. Against pointer stores from registers: 1024 -> 1024 at 4096 rows, bf16
    + bias + ReLU, 128 x 256 x 64 tiles with 3 stages, 4 slices, the tile loop flattened,
    15.40 us in the linear suite against 17.10 for the tuned pointer-store tile before and
    cuBLASLt's 15.38 (H100, NOTES.md; scripts/probe_tma_store.py sweeps the forms)."""
    if SUB == 1:
        o_desc.store([off_m, off_n], y.to(o_desc.dtype))
    elif SUB == 2:
        # (BLOCK_M, BLOCK_N) -> (BLOCK_M, BLOCK_N / 2, 2): the last axis picks the half
        halves = tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        h0, h1 = tl.split(halves)
        o_desc.store([off_m, off_n], h0.to(o_desc.dtype))
        o_desc.store([off_m, off_n + BLOCK_N // 2], h1.to(o_desc.dtype))
    else:
        # (BLOCK_M, 2, 2, BLOCK_N / 4) [m, a, b, j] = y[m, a * BLOCK_N / 2 + b * BLOCK_N / 4
        # + j] -> [m, j, b, a]: split a (the half), then b (the quarter within it)
        q = tl.permute(tl.reshape(y, (BLOCK_M, 2, 2, BLOCK_N // 4)), (0, 3, 2, 1))
        first, second = tl.split(q)
        q0, q1 = tl.split(first)
        q2, q3 = tl.split(second)
        o_desc.store([off_m, off_n], q0.to(o_desc.dtype))
        o_desc.store([off_m, off_n + BLOCK_N // 4], q1.to(o_desc.dtype))
        o_desc.store([off_m, off_n + BLOCK_N // 2], q2.to(o_desc.dtype))
        o_desc.store([off_m, off_n + 3 * BLOCK_N // 4], q3.to(o_desc.dtype))


@triton.jit
def _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr, SHORTCUT: tl.constexpr):
    """(row tile, column tile) of tile number ``tile`` in grouped order (GROUP_M row tiles
    a group). SHORTCUT: where the output is one tile wide or one tile tall, the grouped
    order is the plain one, so the tile number is used as it is. The grouped order's
    runtime divisions (about 25 instructions each, three in a row) sit ahead of the first
    load, and a skinny layer's kernel is about one round trip to memory long."""
    if SHORTCUT and TILE_SHORTCUT:
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
    B_EARLY: tl.constexpr = (PREFETCH and (LORA == 1 or LORA == 4)) and R_PAD == R_BLOCK
    # The epilogue's loads that do not wait on the loop go before it (see PREFETCH): a
    # small-M kernel is a few round trips to memory long, and one after the loop adds one.
    if HAS_BIAS and (ONE_STEP or PREFETCH):
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
        PRECISION, UPCAST, bias_v, res_v, ONE_STEP or PREFETCH,
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


@triton.jit
def _joint_shrink(
    x_desc, a_desc, xs_ptr, ids_ptr, scale_ptr, sync_ptr, M, K, lora_scale, n_tiles_m,
    n_shrink,
    MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr,
    PER_ADAPTER_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """LORA 5's shrink programs: xs = x @ A^T for row tiles pid, pid + n_shrink, ... (the
    order the GEMM's grouped tiles reach them), scaled and masked per adapter and stored
    in xs's dtype (as LORA 3 stores it); after each row tile, a release-add on that row
    tile's flag, which the GEMM's tiles of those rows wait for. x_desc / a_desc have their
    own K step (BLOCK_K) and STAGES: a few programs read all of x while the GEMM streams
    W, so each keeps as many bytes in flight as the GEMM's buffers hold. SPLIT > 1 (free
    SMs past the row tiles): work item i is part i % SPLIT of K for row tile i // SPLIT,
    stored in float32 at xs_ptr + part * M * R; the tiles wait for SPLIT adds and sum
    the parts in order (``_joint_xs``)."""
    rs = tl.arange(0, R_PAD)
    k_part = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    for item in range(tl.program_id(0), n_tiles_m * SPLIT, n_shrink):
        tm = item // SPLIT
        part = item % SPLIT
        off_m = tm * BLOCK_M
        xa = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        k_lo = part * k_part
        for k0 in tl.range(k_lo, tl.minimum(K, k_lo + k_part), BLOCK_K, num_stages=STAGES):
            xt = x_desc.load([off_m, k0])
            at = a_desc.load([0, k0])
            xa = mma(xt, at.T, xa, PRECISION, UPCAST)
        rows = off_m + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        xa = _adapter_scale(
            xa, rows, row_ok, rs, rs < R, ids_ptr, scale_ptr, lora_scale,
            MULTI, PER_ADAPTER_SCALE, RANK,
        )  # fmt: skip
        tl.store(
            xs_ptr + part.to(tl.int64) * M * R + rows[:, None] * R + rs[None, :],
            xa.to(xs_ptr.dtype.element_ty), mask=row_ok[:, None] & (rs < R)[None, :],
        )  # fmt: skip
        # Every thread's stores of this tile before the one release that publishes them
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + tm, 1, sem="release", scope="gpu")


@triton.jit
def _segment_rows_kernel(ids_ptr, rows_ptr, counts_ptr, M, CHUNK: tl.constexpr):
    """Program a lists adapter a's rows in order: rows_ptr[a * M + p] = the p-th row whose
    id is a, counts_ptr[a] = how many (ids -1 or past the adapters: in no list). A row's
    place is a running count, so the lists do not depend on scheduling."""
    adapter = tl.program_id(0)
    seen = 0
    for c0 in range(0, M, CHUNK):
        rr = c0 + tl.arange(0, CHUNK)
        mine = (tl.load(ids_ptr + rr, mask=rr < M, other=-1) == adapter).to(tl.int32)
        place = seen + tl.cumsum(mine, 0) - 1
        tl.store(rows_ptr + adapter.to(tl.int64) * M + place, rr, mask=mine == 1)
        seen += tl.sum(mine, 0)
    tl.store(counts_ptr + adapter, seen)


@triton.jit
def _shrink_segment_kernel(
    x_ptr, a_ptr, xs_ptr, rows_ptr, counts_ptr, scale_ptr,  # see launch_shrink_segments
    M, K, stride_xm, stride_xk, stride_ar, lora_scale,
    R: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    PER_ADAPTER_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Multi-adapter LoRA's shrink by adapter segments: program (a, b) computes xs for the
    b-th block of BLOCK_M rows of adapter a's list (``_segment_rows_kernel``), from those
    rows of x and adapter a's RANK rows of A only; xs (zeroed by the caller) keeps zeros
    in every other adapter's columns, as LORA 3's masked product does. The stacked
    product does every adapter's columns for every row: 16 adapters x rank 16 at 1024
    rows is 2.1 GFLOP, where this does 0.13. Programs past the list stop at once."""
    if PDL:  # the overlapped expand launch may start now (it waits for xs)
        tl.extra.cuda.gdc_launch_dependents()
    adapter = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    count = tl.load(counts_ptr + adapter)
    if first < count:
        slots = first + tl.arange(0, BLOCK_M)
        valid = slots < count
        rows = tl.load(rows_ptr + adapter.to(tl.int64) * M + slots, mask=valid, other=0)
        ks = tl.arange(0, BLOCK_K)
        cs = tl.arange(0, RANK_PAD)
        col_ok = cs < RANK
        cols = adapter * RANK + cs
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
        a_ptrs = a_ptr + (cols % R)[None, :] * stride_ar + ks[:, None]  # A^T (BLOCK_K, RANK_PAD)
        acc = tl.zeros((BLOCK_M, RANK_PAD), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            xt = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = mma(xt, at, acc, PRECISION, UPCAST)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
        if PER_ADAPTER_SCALE:
            acc = acc * tl.load(scale_ptr + adapter)
        else:
            acc = acc * tl.cast(lora_scale, tl.float32)
        tl.store(
            xs_ptr + rows.to(tl.int64)[:, None] * R + cols[None, :],
            acc.to(xs_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :],
        )  # fmt: skip


@triton.jit
def _joint_wait(sync_ptr, pid_m, n_tiles_m, n_tiles_n, SPLIT: tl.constexpr):
    """LORA 5's tiles: wait until the shrink has posted all SPLIT parts of row tile pid_m
    of xs (acquire).

    The flags clean up after themselves: each of the row tile's n_tiles_n readers counts
    itself in (sync_ptr + n_tiles_m + pid_m) once past the wait, and the last one puts
    both counters back to zero. Every reader has passed the wait by then, and every
    shrink add has landed, so a buffer zeroed once serves every later launch on its
    stream (see joint_flags)."""
    done = tl.atomic_add(sync_ptr + pid_m, 0, sem="acquire", scope="gpu")
    while done < SPLIT:
        done = tl.atomic_add(sync_ptr + pid_m, 0, sem="acquire", scope="gpu")
    seen = tl.atomic_add(sync_ptr + n_tiles_m + pid_m, 1, sem="relaxed", scope="gpu")
    if seen == n_tiles_n - 1:
        tl.atomic_xchg(sync_ptr + pid_m, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + n_tiles_m + pid_m, 0, sem="relaxed", scope="gpu")


@triton.jit
def _joint_xs(
    xa_ptr, off_m, M,
    R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """LORA 5's tiles, once past _joint_wait: their row tile of xs (BLOCK_M, R_PAD) in
    DTYPE, zeros past M and R; several parts are float32 sums over K, added in order and
    rounded once, as one sum is."""
    rows = off_m + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, R_PAD)
    if SPLIT == 1:
        st = _xs_tile(xa_ptr, rows, M, rs, R)
    else:
        st = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for part in tl.static_range(SPLIT):
            st += _xs_tile(xa_ptr + part * M * R, rows, M, rs, R)
    return st.to(DTYPE)


@triton.jit
def _spread_expand(
    acc, xa, a_row, pid_m, pid_n, off_m, off_n, b_ptr, xs_ptr, ids_ptr, scale_ptr, sync_ptr,
    M, N, stride_bn, lora_scale, n_tiles_m, n_tiles_n, b_v,
    MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr,
    R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLICE: tl.constexpr,
    SLICES: tl.constexpr, B3D: tl.constexpr, B_EARLY: tl.constexpr,
    EXPAND_STAGES: tl.constexpr, PHASE: tl.constexpr,
):  # fmt: skip
    """LORA 6 after a tile's K loop, which also accumulated xa = x @ A^T over stacked
    columns a_row .. a_row + SLICE: a producing tile (pid_n < SLICES) stores that slice
    of xs (scaled and masked per adapter, in B's dtype, as LORA 3 stores it) and posts
    it on its row tile's counter; every tile then waits for the row tile's SLICES posts
    (``_joint_wait``, which also puts the counters back to zero) and returns acc + xs @
    B^T: B (R_PAD, BLOCK_N) loaded before the K loop where it is one step (b_v), else
    steps of R_BLOCK stacked columns. Pointer loads (xs: after the acquire, its stores
    came from other SMs; B: a step spans several adapters of a B read in place, which
    one descriptor box cannot: 4 steps of 64 columns for 16 adapters x rank 16 where the
    expand mode's descriptor takes 16 of 16, each waiting on its load)."""
    rows = off_m + tl.arange(0, BLOCK_M)
    if PHASE != 2 and pid_n < SLICES:
        rs = a_row + tl.arange(0, SLICE)
        row_ok = rows < M
        t = _adapter_scale(
            xa, rows, row_ok, rs, rs < R, ids_ptr, scale_ptr, lora_scale,
            MULTI, PER_ADAPTER_SCALE, RANK,
        )  # fmt: skip
        tl.store(
            xs_ptr + rows[:, None] * R + rs[None, :], t.to(xs_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (rs < R)[None, :],
        )  # fmt: skip
        # Every thread's stores of this slice before the one release that publishes them
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + pid_m, 1, sem="release", scope="gpu")
    if PHASE != 1:
        _joint_wait(sync_ptr, pid_m, n_tiles_m, n_tiles_n, SLICES)
        if R_PAD == R_BLOCK:
            rs = tl.arange(0, R_PAD)
            st = _xs_tile(xs_ptr, rows, M, rs, R).to(b_ptr.dtype.element_ty)
            if B_EARLY:
                bt = b_v
            else:
                cn = off_n + tl.arange(0, BLOCK_N)
                bt = _bt_chunk(b_ptr, cn, N, stride_bn, rs, R, RANK, B3D)
            acc = mma(st, bt, acc, PRECISION, UPCAST)
        else:
            cn = off_n + tl.arange(0, BLOCK_N)
            for r0 in tl.range(0, R_PAD, R_BLOCK, num_stages=EXPAND_STAGES):
                rs = r0 + tl.arange(0, R_BLOCK)
                st = _xs_tile(xs_ptr, rows, M, rs, R).to(b_ptr.dtype.element_ty)
                bt = _bt_chunk(b_ptr, cn, N, stride_bn, rs, R, RANK, B3D)
                acc = mma(st, bt, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _tma_body(
    x_desc,  # TensorDescriptor over x (M, K), block (BLOCK_M, BLOCK_K)
    w_desc,  # TensorDescriptor over W (N, K), block (BLOCK_N, BLOCK_K)
    a_desc,  # LORA 1: over stacked A (R, K), block (R_PAD, BLOCK_K) (LORA 5: (R_PAD,
    # SHRINK_K)); LORA 4: over xs (M, R)
    b_desc,  # LORA 4: over stacked B (N, R), block (BLOCK_N, R_BLOCK); LORA 5: x, block
    # (BLOCK_M, SHRINK_K)
    bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,  # as in _gemm_body
    sync_ptr,  # LORA 5: 2 int32 counters per row tile, zero at launch and again at exit
    # (xs stored; tiles that have read it: see _joint_wait)
    M, N, K, stride_rm, stride_om, stride_bn, alpha, lora_scale,
    n_shrink,  # LORA 5: the grid's first n_shrink programs compute xs
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    LORA: tl.constexpr, MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr,
    R_PAD: tl.constexpr, R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr, PDL: tl.constexpr,
    SHRINK_K: tl.constexpr = 16, SHRINK_STAGES: tl.constexpr = 1,  # LORA 5, see _joint_shrink
    SHRINK_SPLIT: tl.constexpr = 1,
    B3D: tl.constexpr = False,  # B as (adapters, N, RANK): see _bt_chunk; LORA 4's b_desc
    # is then over its (adapters * N, RANK) view, with R_BLOCK <= RANK
    EXPAND_STAGES: tl.constexpr = 3,  # LORA 4 with R_PAD > R_BLOCK: buffers of its xs @ B^T
    # loop (see expand_stages)
    SLICE: tl.constexpr = 16,  # LORA 6: stacked columns of xs each producing tile computes
    PHASE: tl.constexpr = 0,  # LORA 6 under the interpreter (programs run one after the
    # other, so no tile can wait for a later one): 1 = K loops and xs slices only, 2 = the
    # rest, in a second launch; 0 = both (one launch)
    o_desc=None,  # OUT_SUB > 0: a TensorDescriptor over out (M, N), block (BLOCK_M,
    # BLOCK_N // OUT_SUB)
    OUT_SUB: tl.constexpr = 0,  # 0: pointer stores; else TMA stores in OUT_SUB slices
):  # fmt: skip
    """Hopper+ (see gemm_loop): a persistent grid (one program per SM, tiles in grouped
    order) whose tiles are loaded by the tensor-memory accelerator (TMA), which zero-fills
    past K, M and N: no masks or index math in the main loop. FLATTEN lets Triton pipeline
    the tile and K loops as one (faster on H100: NOTES.md). LORA 1: x @ A^T accumulated
    from the x tiles already in shared memory (A's rows past R arrive as zeros); LORA 2:
    precomputed xa read by the epilogue; LORA 4: xs @ B^T as one more K step; LORA 5:
    the first n_shrink programs compute xs, the rest the tiles; LORA 6: each row tile's
    first R_PAD / SLICE column tiles compute a slice of its xs in the K loop (see the
    module docstring). PDL: as in _gemm_body."""
    if LORA == 3 and PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Prefetch (see PREFETCH) only where the tile loop is not flattened into the K loop:
    # flattened, the pipeliner keeps one copy of each such load per stage in registers
    # (64 x 128 x 64 tile, 8 stages: 140 -> 229 registers, sm_90, Triton 3.6)
    EARLY: tl.constexpr = PREFETCH and not FLATTEN
    B_EARLY: tl.constexpr = (EARLY and (LORA == 1 or LORA >= 4)) and (R_PAD == R_BLOCK)
    XA_W: tl.constexpr = SLICE if LORA == 6 else R_PAD  # columns of the in-loop product
    SLICES: tl.constexpr = R_PAD // SLICE  # LORA 6: producing column tiles per row tile
    # The tile's coordinates without the grouped order's divisions where the output is one
    # tile wide or tall (see _tile_coords); not where the tile loop is flattened into the K
    # loop or warp-specialized (probes), whose pipelining was measured without a branch
    SHORTCUT: tl.constexpr = not (FLATTEN or WARP_SPEC)
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    xa = tl.zeros((BLOCK_M, XA_W), dtype=tl.float32)
    first = tl.program_id(0)
    if LORA == 5:
        if first < n_shrink:
            _joint_shrink(
                b_desc, a_desc, xa_ptr, ids_ptr, scale_ptr, sync_ptr, M, K, lora_scale,
                n_tiles_m, n_shrink, MULTI, R, RANK, R_PAD, PER_ADAPTER_SCALE, PRECISION,
                UPCAST, BLOCK_M, SHRINK_K, SHRINK_STAGES, SHRINK_SPLIT,
            )  # fmt: skip
            first = n_tiles_m * n_tiles_n  # no GEMM tiles for this program
        else:
            first -= n_shrink
    for tile in tl.range(
        first, n_tiles_m * n_tiles_n, NUM_PROGRAMS, flatten=FLATTEN,
        warp_specialize=WARP_SPEC,
    ):  # fmt: skip
        pid_m, pid_n = _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M, SHORTCUT)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA == 1 or LORA == 6:
            xa = tl.zeros((BLOCK_M, XA_W), dtype=tl.float32)
        # LORA 6: this tile's slice of xs (column tiles past SLICES compute one again, so
        # the K loop has no branch; only the first SLICES store theirs)
        a_row = (pid_n % SLICES) * SLICE
        # Loads of the epilogue that do not wait on the main loop go before it (EARLY):
        # pointer loads, which block nothing until their use (a descriptor load waits for
        # its data where it is issued); int32 indices and the input dtype, since they are
        # held in registers across the loop
        bias_v = 0.0
        b_v = 0.0
        s_v = 0.0
        if HAS_BIAS and EARLY:
            cn = off_n + tl.arange(0, BLOCK_N)
            bias_v = tl.load(bias_ptr + cn, mask=cn < N, other=0.0)
        if B_EARLY:  # the B^T chunk (R_PAD, BLOCK_N); LORA 4 without PDL: xs too
            cn = off_n + tl.arange(0, BLOCK_N)
            rs = tl.arange(0, R_PAD)
            b_v = _bt_chunk(b_ptr, cn, N, stride_bn, rs, R, RANK, B3D)
            if LORA == 4 and not PDL:  # (LORA 5: xs only after the wait)
                s_v = _xs_tile(xa_ptr, off_m + tl.arange(0, BLOCK_M), M, rs, R)
        for k0 in range(0, K, BLOCK_K):
            xt = x_desc.load([off_m, k0])
            wt = w_desc.load([off_n, k0])
            acc = mma(xt, wt.T, acc, PRECISION, UPCAST)
            if LORA == 1:
                at = a_desc.load([0, k0])
                xa = mma(xt, at.T, xa, PRECISION, UPCAST)
            if LORA == 6:
                at = a_desc.load([a_row, k0])
                xa = mma(xt, at.T, xa, PRECISION, UPCAST)
        if LORA == 6:
            acc = _spread_expand(
                acc, xa, a_row, pid_m, pid_n, off_m, off_n, b_ptr, xa_ptr, ids_ptr, scale_ptr,
                sync_ptr, M, N, stride_bn, lora_scale, n_tiles_m, n_tiles_n, b_v,
                MULTI, R, RANK, R_PAD, R_BLOCK, PER_ADAPTER_SCALE, PRECISION, UPCAST,
                BLOCK_M, BLOCK_N, SLICE, SLICES, B3D, B_EARLY, EXPAND_STAGES, PHASE,
            )  # fmt: skip
        if LORA == 5:  # wait until the shrink programs have stored this row tile of xs
            _joint_wait(sync_ptr, pid_m, n_tiles_m, n_tiles_n, SHRINK_SPLIT)
            st = _joint_xs(
                xa_ptr, off_m, M, R, R_PAD, BLOCK_M, SHRINK_SPLIT, b_ptr.dtype.element_ty
            )  # fmt: skip
            if B_EARLY:
                bt_t = b_v
            else:
                cn = off_n + tl.arange(0, BLOCK_N)
                bt_t = _bt_chunk(b_ptr, cn, N, stride_bn, tl.arange(0, R_PAD), R, RANK, B3D)
            acc = mma(st, bt_t, acc, PRECISION, UPCAST)
        if LORA == 4:
            if PDL:
                tl.extra.cuda.gdc_wait()
            if R_PAD > R_BLOCK:  # several steps: one set of buffers, not one per step
                for r0 in tl.range(0, R_PAD, R_BLOCK, num_stages=EXPAND_STAGES):
                    st = a_desc.load([off_m, r0])
                    if B3D:  # adapter r0 // RANK's rows of the (adapters * N, RANK) view
                        bt = b_desc.load([(r0 // RANK) * N + off_n, r0 % RANK])
                    else:
                        bt = b_desc.load([off_n, r0])
                    acc = mma(st, bt.T, acc, PRECISION, UPCAST)
            else:
                if B_EARLY:
                    bt_t = b_v
                else:
                    bt_t = b_desc.load([off_n, 0]).T
                if B_EARLY and not PDL:
                    st = s_v
                else:
                    st = a_desc.load([off_m, 0])
                acc = mma(st, bt_t, acc, PRECISION, UPCAST)
        rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        cols = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        if PHASE != 1:
            y = _epilogue(
                acc, rows, cols, M, N, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr,
                scale_ptr, stride_rm, stride_om, stride_bn, alpha, lora_scale, xa,
                HAS_BIAS, HAS_RES, ACTIVATION, LORA, MULTI, R, RANK, R_PAD, R_BLOCK,
                PER_ADAPTER_SCALE, PRECISION, UPCAST, bias_v, 0.0, EARLY, False,
                b_v, B_EARLY and LORA == 1, B3D, OUT_SUB == 0,
            )  # fmt: skip
            if OUT_SUB > 0:
                _tma_store(o_desc, y, off_m, off_n, BLOCK_M, BLOCK_N, OUT_SUB)


@triton.jit
def _linear_tma_kernel(
    x_desc, w_desc, bias_ptr, res_ptr, out_ptr,  # as in _tma_body
    M, N, K, stride_rm, stride_om, alpha,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr = True, WARP_SPEC: tl.constexpr = False, PDL: tl.constexpr = False,
    o_desc=None, OUT_SUB: tl.constexpr = 0,  # as in _tma_body (o_desc: x_desc where unused)
):  # fmt: skip
    """Plain linear layers through _tma_body (the fewest launch arguments). PDL: as in
    _linear_kernel."""
    if PDL:
        _pdl_begin()
    _tma_body(
        x_desc, w_desc, x_desc, x_desc, bias_ptr, res_ptr, out_ptr, out_ptr, out_ptr, out_ptr,
        out_ptr, out_ptr,
        M, N, K, stride_rm, stride_om, 0, alpha, 1.0, 0,
        HAS_BIAS, HAS_RES, ACTIVATION, 0, False, 1, 1, 16, 16, False, PRECISION, UPCAST,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, FLATTEN, WARP_SPEC, False,
        o_desc=o_desc, OUT_SUB=OUT_SUB,
    )  # fmt: skip


@triton.jit
def _lora_tma_kernel(
    x_desc, w_desc, a_desc, b_desc, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
    sync_ptr, M, N, K, stride_rm, stride_om, stride_bn, alpha, lora_scale, n_shrink,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    LORA: tl.constexpr, MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr,
    R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr = True, WARP_SPEC: tl.constexpr = False, PDL: tl.constexpr = False,
    SHRINK_K: tl.constexpr = 16, SHRINK_STAGES: tl.constexpr = 1,
    SHRINK_SPLIT: tl.constexpr = 1, B3D: tl.constexpr = False, EXPAND_STAGES: tl.constexpr = 3,
    SLICE: tl.constexpr = 16, DEP: tl.constexpr = False, PHASE: tl.constexpr = 0,
):  # fmt: skip
    """LoRA layers (LORA 1 in-loop, 2 precomputed, 3 shrink, 4 expand, 5 joint, 6 spread)
    through _tma_body. DEP: launched with programmatic dependent launch behind whatever
    kernel came before (``pdl_launch``; not the expand launch's PDL, whose programs read x
    and W before they wait, only for xs: the shrink before it waits at its top)."""
    if DEP:
        _pdl_begin()
    _tma_body(
        x_desc, w_desc, a_desc, b_desc, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
        sync_ptr, M, N, K, stride_rm, stride_om, stride_bn, alpha, lora_scale, n_shrink,
        HAS_BIAS, HAS_RES, ACTIVATION, LORA, MULTI, R, RANK, R_PAD, R_BLOCK, PER_ADAPTER_SCALE,
        PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, FLATTEN,
        WARP_SPEC, PDL, SHRINK_K, SHRINK_STAGES, SHRINK_SPLIT, B3D, EXPAND_STAGES, SLICE, PHASE,
    )  # fmt: skip


TMA_MIN_M = 512  # rows from which plain linear layers default to the TMA kernel (below:
# few tiles per SM, and the measured win is on the compute-bound shapes; see NOTES.md)
TMA_TUNED_MAX_M = 256  # up to this many rows the tuner chooses TMA or pointer loads: with
# narrow tiles the TMA kernel read W at up to 1.16x cuBLAS (H100, M = 16, NOTES.md); at
# M = 256 the pointer kernel's best tile took 23.4 us against cuBLAS's 20.4 (4096 x 4096)
TMA_TUNED_N = 64  # from TMA_MIN_M rows, outputs this narrow are tuned over both kernels:
# the pointer kernel's smaller tiles won at 64 -> 16 (H100 suite, 512 / 4096 / 65536 rows:
# 2.6 / 2.9 / 6.3 us against the TMA kernel's 2.9 / 3.2 / 6.5), the TMA kernel at 256 -> 64
LOOP_PTR, LOOP_TMA, LOOP_TUNED = 0, 1, 2  # gemm_loop's answers


def gemm_mode() -> str:
    """FUSEML_GEMM: auto (TMA kernel where it applies, see gemm_loop), tma or ptr (force)."""
    return env_choice("FUSEML_GEMM", "auto", ("auto", "tma", "ptr"))


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # Hopper and later


def _tma_device(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_tma(x.get_device())


def gemm_loop(x: torch.Tensor, weight: torch.Tensor, traced: bool) -> int:
    """Which main loop a linear call takes: LOOP_TMA (``_tma_body``), LOOP_PTR
    (``_gemm_body``) or LOOP_TUNED (the tuned config's "TMA" flag decides, see
    ``takes_tma``). Only direct launches take TMA (the op traced by torch.compile keeps
    the pointer kernel), only for TMA-compatible layouts; by default on Hopper+ GPUs from
    TMA_MIN_M rows, tuned up to TMA_TUNED_MAX_M rows and for outputs at most TMA_TUNED_N
    wide (FUSEML_GEMM=tma / ptr force it)."""
    if traced:
        return LOOP_PTR
    mode = gemm_mode()
    if mode == "auto":  # cheapest checks first: this runs on every call
        m = x.shape[0]
        if TMA_TUNED_MAX_M < m < TMA_MIN_M or not (_tma_device(x) and tma_eligible(x, weight)):
            return LOOP_PTR
        if x.dtype == torch.float32 and dot_precision(x.dtype) == "ieee":
            return LOOP_PTR  # FMA dots: the TMA kernel's large tiles spill (H100: 12 ms vs 0.33)
        return LOOP_TMA if m >= TMA_MIN_M and weight.shape[0] > TMA_TUNED_N else LOOP_TUNED
    return LOOP_TMA if mode == "tma" and tma_eligible(x, weight) else LOOP_PTR


def pdl_available(x: torch.Tensor, traced: bool) -> bool:
    """Can LoRA's expand launch overlap its shrink launch (programmatic dependent launch,
    see ``pdl_launch``)? FUSEML_PDL=0 turns it off (then small batches take the one-launch
    in-loop mode, see fuseml.ops.lora)."""
    return pdl_launch(x, traced)


def takes_tma(loop: int, config: dict) -> bool:
    """Does a launch with this loop choice and config take the TMA kernel?"""
    if config.get("STREAM"):  # the streaming kernel has pointer loads of its own
        return False
    return loop == LOOP_TMA or (loop == LOOP_TUNED and config.get("TMA", False))


def loop_key(loop: int) -> str:
    """The tuning-key suffix of a loop choice: each has its own entries (best tiles differ)."""
    return ("", "tma", "tmatuned")[loop]


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """TMA needs unit inner strides, 16-byte aligned row strides and base pointers."""
    for t in tensors:  # (a plain loop: this runs on every call)
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _launch_tma(
    out, x, weight, bias, residual, alpha, activation, config, lora=None, *, pdl=None,
    flatten=None, warp_spec=False,
) -> None:  # fmt: skip
    """One launch of the TMA kernel. lora: None, or (mode, lora_a, lora_b, xa, ids,
    scales, lora_scale, rank, r_block) with mode LORA_IN_LOOP (lora_a read through its own
    descriptor), LORA_PRECOMPUTED (xa = x @ A^T given), LORA_SHRINK (weight is A),
    LORA_EXPAND (xa is xs, read with lora_b through descriptors) or LORA_JOINT (xa unused:
    its first programs fill an xs buffer made here, whose shape depends on the K split;
    lora_a through a descriptor) or LORA_SPREAD (xa unused: an xs buffer made here; lora_a
    through a descriptor of SLICE rows; one tile a program, which needs the tiles to fit
    one wave). pdl (LoRA only): the
    kernel's PDL flag, and for LORA_EXPAND with pdl the launch may start early. flatten,
    warp_spec: the kernels' FLATTEN / WARP_SPEC (for probes; flatten None: where a
    program has more than one tile; see ``_tma_body``).

    Repeat launches go through the compiled kernel's launcher (``CompiledLaunches``): a
    host descriptor specializes on its dtype and block shape only, both fixed by the
    constexprs below, so the key holds no descriptor. Triton's launcher still encodes
    each descriptor (cuTensorMapEncodeTiled) on every launch.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    sms = persistent_programs(x)
    programs = tiles if sms is None else min(tiles, sms)
    joint = lora is not None and lora[0] == LORA_JOINT
    spread = lora is not None and lora[0] == LORA_SPREAD
    n_shrink = 0
    if spread:
        # Every tile may wait for others of its row tile: all must be resident at once
        if sms is not None and tiles > sms:
            raise ValueError(
                f"launch_linear: the spread LoRA mode needs one tile a program, got {tiles} "
                f"tiles of {bm} x {bn} for {sms} SMs"
            )
        programs = tiles
    if joint:
        # xs's programs first: one per SM the tiles leave free, at most one per row tile.
        # Where every SM has tiles, the GEMM takes as few programs as finish its tiles in
        # the same number of rounds (512 tiles on 132 SMs: 128 programs of 4), and at most
        # all SMs but one (CPU: two programs more than the tiles)
        free_sms = programs + 2 if sms is None else sms
        if tiles >= free_sms:
            programs = min(cdiv(tiles, cdiv(tiles, free_sms)), free_sms - 1)
        row_tiles = cdiv(m, bm)
    if flatten is None:
        # One tile a program: nothing to flatten, and the epilogue's loads go before the
        # main loop (see _tma_body); unless the config says (the TMA-store tiles, measured
        # flattened, _TMA_STORE)
        flatten = config.get("FLATTEN", tiles > programs)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    bias_arg = out if bias is None else bias
    res_arg = out if residual is None else residual
    ints = (m, n, k, 0 if residual is None else residual.stride(0), out.stride(0))
    common = (
        bias is not None, residual is not None, activation, dot_precision(x.dtype),
        triton_interpreting(), bm, bn, bk, config["GROUP_M"], programs, flatten, warp_spec,
    )  # fmt: skip
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    ptrs = (bias_arg, res_arg, out)
    if lora is None:  # (only direct launches take TMA, see gemm_loop)
        dep = pdl_launch(x)
        if dep:
            options["launch_pdl"] = True
        # TMA stores where the config asks and out's layout allows (else pointer stores of
        # the same values); x_desc stands in for an unused o_desc
        sub = config.get("OUT_SUB", 0)
        if sub and not tma_eligible(out):
            sub = 0
        o_desc = TensorDescriptor.from_tensor(out, [bm, bn // sub]) if sub else x_desc
        args = (x_desc, w_desc, *ptrs, *ints, float(alpha), *common, dep, o_desc, sub)
        key = (x.dtype, out.dtype, common, dep, sub, *options.values(), *map(int_spec, ints))
        _linear_tma_launches((programs,), key, aligned16(*ptrs), args, options)
        return
    mode, lora_a, lora_b, xa, ids, scales, lora_scale, rank, r_block = lora
    r = 1 if lora_b is None else lora_cols(lora_b)
    b3d = lora_b is not None and lora_b.dim() == 3
    r_pad = max(16, next_pow2(r))
    a_desc = b_desc = x_desc
    sync, shrink_k, shrink_stages, split = out, 16, 1, 1
    # (SLICE is a constexpr: the other modes keep one value, so no N compiles them again)
    slice_w = spread_slice(r_pad, n, bn) if spread else 16
    if mode == LORA_IN_LOOP:
        a_desc = TensorDescriptor.from_tensor(lora_a, [r_pad, bk])
    if joint:
        # Two counters per row tile, zero (see joint_flags). The shrink's loop reads x
        # and A in K steps of up to 512 bytes, in the GEMM's buffers: shorter steps where
        # fewer than JOINT_SHRINK_STAGES of them fit (a 128 x 256 x 64 tile with 3 stages
        # holds one 512-byte step of a 128-row tile at rank 64: each step waited for its
        # load)
        sync = joint_flags(x, 2 * row_tiles)
        es = x.element_size()
        budget = config["num_stages"] * (bm + bn) * bk * es
        shrink_k = max(16, min(512 // es, next_pow2(k)))
        while shrink_k > 32 and budget // ((bm + r_pad) * shrink_k * es) < JOINT_SHRINK_STAGES:
            shrink_k //= 2
        shrink_stages = max(1, min(8, budget // ((bm + r_pad) * shrink_k * es)))
        # More free SMs than row tiles (decode-like rows: 1 row tile, 4 free SMs on an
        # H100): K split over them, so that no one SM streams a whole row tile of x and A
        split = max(1, min(JOINT_SPLIT, (free_sms - programs) // row_tiles, cdiv(k, shrink_k)))
        n_shrink = min(row_tiles, free_sms - programs) * split
        a_desc = TensorDescriptor.from_tensor(lora_a, [r_pad, shrink_k])
        b_desc = TensorDescriptor.from_tensor(x, [bm, shrink_k])
        # xs, or its float32 parts where K is split (see _joint_shrink)
        shape, dtype = ((split, m, r), torch.float32) if split > 1 else ((m, r), x.dtype)
        xa = torch.empty(shape, dtype=dtype, device=x.device)
    elif spread:  # A's slice for the K loop; xs (written by the tiles) and its counters;
        # B through pointers (see _spread_expand)
        a_desc = TensorDescriptor.from_tensor(lora_a, [slice_w, bk])
        xa = torch.empty((m, r), dtype=x.dtype, device=x.device)
        sync = joint_flags(x, 2 * cdiv(m, bm))
    elif mode == LORA_EXPAND:
        a_desc = TensorDescriptor.from_tensor(xa, [bm, r_block])
        b2 = lora_b.reshape(-1, lora_b.shape[-1]) if b3d else lora_b  # (adapters * N, rank)
        b_desc = TensorDescriptor.from_tensor(b2, [bn, r_block])
    expand = 3
    if spread:
        expand = SPREAD_EXPAND_STAGES
    elif mode == LORA_EXPAND:
        expand = expand_stages(config, r_pad, r_block, x.element_size())
    if pdl and mode == LORA_EXPAND:
        options["launch_pdl"] = True
    # PDL behind the kernel before (see _lora_tma_kernel's DEP): not for the expand launch
    # (above), the spread mode's cooperative one, nor the joint mode, whose programs wait
    # for each other: with it, rank 64 at 256 / 512 rows took 23.2 / 30.6 us in the lora
    # suite's graph rows (H100, 1bf0d27), against 21.2 / 28.4 in the rows before and
    # 21.2 / 30.1 at c30880f without it (NOTES.md, "Fifteenth round")
    dep = mode in (LORA_IN_LOOP, LORA_PRECOMPUTED, LORA_SHRINK) and pdl_launch(x)
    if dep:
        options["launch_pdl"] = True
    if spread and not triton_interpreting():
        # A cooperative launch: the driver starts it only with every program resident at
        # once. Its tiles wait for each other, so two such launches on two streams that
        # each got part of the SMs could otherwise wait on each other for ever.
        options["launch_cooperative_grid"] = True
    more = (
        out if lora_b is None else lora_b, out if xa is None else xa,
        out if ids is None else ids, out if scales is None else scales, sync,
    )  # fmt: skip
    ints += (0 if lora_b is None else lora_b.stride(-2),)
    consts = (
        mode, ids is not None, r, max(rank, 1), r_pad, r_block, scales is not None,
    )  # fmt: skip
    args = (
        x_desc, w_desc, a_desc, b_desc, *ptrs, *more, *ints, float(alpha), float(lora_scale),
        n_shrink, *common[:3], *consts, *common[3:], bool(pdl), shrink_k, shrink_stages, split,
        b3d, expand, slice_w, dep,
    )  # fmt: skip
    key = (
        x.dtype, out.dtype, common, consts, bool(pdl), shrink_k, shrink_stages, split, b3d, expand,
        slice_w, dep, tuple(options.items()),
        tuple(t.dtype for t in more), *map(int_spec, ints), int_spec(n_shrink),
    )  # fmt: skip
    aligned = aligned16(*ptrs, *more)
    if spread and triton_interpreting():
        # Programs run one after the other here: the K loops and xs slices first, then
        # the rest (waits already met) in a second launch; one launch on a GPU
        for phase in (1, 2):
            _lora_tma_launches((programs,), (*key, phase), aligned, (*args, phase), options)
        return
    _lora_tma_launches((programs + n_shrink,), (*key, 0), aligned, (*args, 0), options)


SPREAD_EXPAND_STAGES = 4  # buffers of LORA_SPREAD's expand loop: up to 4 steps of 64
# stacked columns in flight at once (cp.async; with 2, each step waited for its own load:
# its dot is too short to hide the next one's). They take the main loop's shared memory,
# free by then (Triton 3.9, sm_90, offline: 213,056 bytes for 64 x 128 x 128 / 4 stages
# with 2 or 4 of them, the main loop's buffers and A's slice alone)


def spread_slice(r_pad: int, n: int, block_n: int) -> int:
    """LORA_SPREAD: stacked columns of xs each producing tile computes, so that no more
    tiles produce than a row tile has (a power of two, at least 16: a dot's least N)."""
    return min(r_pad, max(16, next_pow2(cdiv(r_pad, cdiv(n, block_n)))))


def spread_fits(config: dict, m: int, n: int, r_pad: int, elem_size: int, sms: int | None) -> bool:
    """Can LORA_SPREAD launch this config: one tile a program for at most ``sms`` programs
    (its tiles wait for each other, so all must be resident at once), and the main loop's
    buffers with A's slice beside them within SMEM_LIMIT? (The expand loop's come after
    them.)"""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if sms is not None and cdiv(m, bm) * cdiv(n, bn) > sms:
        return False
    smem = config["num_stages"] * (bm + bn + spread_slice(r_pad, n, bn)) * bk * elem_size
    return smem <= SMEM_LIMIT


def expand_stages_max() -> int:
    """FUSEML_EXPAND_STAGES_MAX (default 8): the most buffers of the expand mode's xs @ B^T
    loop (for probes)."""
    return env_int("FUSEML_EXPAND_STAGES_MAX", 8, 2)


def expand_stages(config: dict, r_pad: int, r_block: int, elem_size: int) -> int:
    """Buffers of the expand mode's xs @ B^T loop (R_PAD / R_BLOCK steps of R_BLOCK
    stacked columns): as many steps in flight as fit beside the main loop's buffers, up to
    expand_stages_max(). Each step is one small MMA on two TMA tiles, so with few buffers
    the loop waits on each load in turn. 16 adapters read in place (16 steps of 16
    columns), 4096 x 4096 at 256 rows: the main launch 30.0 us with 3 buffers, 28.0 with
    up to 8 (H100, scripts/probe_gemm.py timeline; one adapter's whole layer: 18.8; the
    rest is the wait for the shrink, NOTES.md)."""
    steps = r_pad // r_block
    if steps <= 1:
        return 3
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    main = config["num_stages"] * (bm + bn) * bk * elem_size
    fit = (SMEM_LIMIT - main) // ((bm + bn) * r_block * elem_size)
    return max(2, min(steps, expand_stages_max(), fit))


JOINT_FLAG_SLAB = 1 << 18  # counters per device (1 MiB)
_flag_slab = CounterSlab(JOINT_FLAG_SLAB, "the joint LoRA launch's flags")


def joint_flags(x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters for a joint launch on x's device and current stream
    (see CounterSlab; the kernel puts them back to zero before it exits, _joint_wait).
    FUSEML_JOINT_FLAGS=zeros: a fresh zeroed buffer per call (probes)."""
    return slab_counters(_flag_slab, x, count, "FUSEML_JOINT_FLAGS")


def persistent_programs(x: torch.Tensor) -> int | None:
    """Programs of the TMA kernel's persistent grid: x's SM count (None on the CPU, where
    the interpreter runs one program per tile; tests set it to exercise several tiles a
    program)."""
    return sm_count(x.get_device()) if x.is_cuda else None


_linear_tma_launches = CompiledLaunches(_linear_tma_kernel)
_lora_tma_launches = CompiledLaunches(_lora_tma_kernel)
_linear_launches = CompiledLaunches(_linear_kernel)  # plain linear layers' repeat launches
_stream_launches = CompiledLaunches(_linear_stream_kernel)


@triton.jit
def _pad_tile(src, dst, n_rows, sm, sk, tile, K, KP, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    ok = (rows < n_rows)[:, None]
    v = tl.load(src + rows[:, None] * sm + cols[None, :] * sk, mask=ok & (cols < K)[None, :])
    tl.store(dst + rows[:, None] * KP + cols[None, :], v, mask=ok & (cols < KP)[None, :])


@triton.jit
def _pad_k_kernel(
    a_ptr, a_out, rows_a, stride_am, stride_ak, b_ptr, b_out, rows_b, stride_bm, stride_bk,
    K, KP, tiles_a, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[:, :K] = src, out[:, K:KP] = 0 for one or two (rows, K) tensors, each out
    contiguous (rows, KP): programs below tiles_a take a's row tiles, the rest b's."""
    pid = tl.program_id(0)
    if pid < tiles_a:
        _pad_tile(a_ptr, a_out, rows_a, stride_am, stride_ak, pid, K, KP, BLOCK_R, BLOCK_C)
    else:
        _pad_tile(
            b_ptr, b_out, rows_b, stride_bm, stride_bk, pid - tiles_a, K, KP, BLOCK_R, BLOCK_C
        )  # fmt: skip


_pad_launches = CompiledLaunches(_pad_k_kernel)
PAD_BLOCK_ELEMS = 8192  # elements a program of _pad_k_kernel copies (rows x padded K)


def pad_k(kp: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (rows, K) tensor (one or two, one dtype and device, any strides) copied into a
    new contiguous (rows, kp) one whose last kp - K columns are zeros, in one launch
    (inside a CUDA graph, where the padded weight cannot be kept, x's and W's copies are
    one node, not the four of two F.pad calls)."""
    if not 1 <= len(tensors) <= 2:
        raise ValueError(f"pad_k: takes one or two tensors, got {len(tensors)}")
    a = tensors[0]
    b = tensors[-1]
    k = a.shape[1]
    if b.shape[1] != k or b.dtype != a.dtype or b.device != a.device or kp < k:
        raise ValueError(
            f"pad_k: tensors of one K, dtype and device, padded to kp >= K; got shapes "
            f"{[tuple(t.shape) for t in tensors]}, dtypes {[t.dtype for t in tensors]}, kp {kp}"
        )
    outs = tuple(torch.empty((t.shape[0], kp), dtype=t.dtype, device=t.device) for t in tensors)
    if launches_skipped():
        return outs
    block_c = next_pow2(kp)
    block_r = max(1, PAD_BLOCK_ELEMS // block_c)
    rows_b = b.shape[0] if len(tensors) == 2 else 0
    tiles_a = cdiv(a.shape[0], block_r)
    grid = (tiles_a + cdiv(rows_b, block_r),)
    if grid[0] == 0:
        return outs
    ints = (
        a.shape[0], a.stride(0), a.stride(1), rows_b, b.stride(0), b.stride(1), k, kp, tiles_a
    )  # fmt: skip
    args = (a, outs[0], *ints[:3], b, outs[-1], *ints[3:], block_r, block_c)
    key = (a.dtype, block_r, block_c, *map(int_spec, ints))
    _pad_launches(grid, key, aligned16(a, b, *outs), args, {"num_warps": 4})
    return outs


FP32_DOTS = ("tf32x3", "ieee")


def fp32_dot() -> str:
    """FUSEML_FP32_DOT: how float32 dots are computed where TF32 is not allowed.

    tf32x3 (default): each operand is split into a TF32 part and a TF32 remainder and three
    tensor-core products are summed (the small x small one dropped); its error against a
    float64 reference was at or below cuBLAS's fp32 SGEMM on every shape measured (H100,
    K = 512 / 1024: 1.1-2.4e-7 against 1.3-4.0e-7) at 1.6-2.4x its speed. ieee: plain fp32
    FMA dots (Triton's, about half of cuBLAS's speed; always the pointer-load kernel).
    """
    return env_choice("FUSEML_FP32_DOT", "tf32x3", FP32_DOTS)


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


def launch_linear(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    activation: int,
    config: dict,
    *,
    lora: int = LORA_NONE,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    xa: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    rank: int = 1,
    traced: bool = False,
    tma: bool = False,
    pdl: bool = False,
) -> None:
    """One launch of ``_linear_kernel``; x (M, K), weight (N, K), out (M, N), all validated.

    lora_a (R, K) and lora_b (N, R) are the stacked adapters; ``rank`` the per-adapter rank.
    tma: through the TMA kernel (the caller checked ``gemm_loop``; for LORA_IN_LOOP also that
    lora_a can be read through a descriptor: see ``fuseml.ops.lora``). pdl (LORA_SHRINK and
    the LORA_EXPAND launch right after it; see ``pdl_available``): the expand launch starts while
    the shrink runs and waits for xs only before its last K steps.
    """
    if launches_skipped():
        return
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return
    r = 0 if lora == LORA_NONE else 1 if lora_b is None else lora_cols(lora_b)
    r_pad = max(16, next_pow2(max(r, 1)))
    r_block = r_pad if lora == LORA_IN_LOOP else min(r_pad, 64)
    b3d = lora_b is not None and lora_b.dim() == 3
    if b3d and lora not in (LORA_IN_LOOP, LORA_SPREAD):  # the expand mode's descriptor
        r_block = min(r_block, rank)  # steps through a 3-D B one adapter (or part) at a time
    grid = (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)
    even_k = k % config["BLOCK_K"] == 0
    precision = dot_precision(x.dtype)
    upcast = triton_interpreting()
    pdl = pdl and not upcast  # a launch-order hint: the interpreter runs launches in order
    if lora in (LORA_JOINT, LORA_SPREAD) and not tma:
        raise ValueError(
            "launch_linear: the joint and spread LoRA modes run on the TMA kernel only"
        )
    if tma:
        extra = None
        if lora != LORA_NONE:
            extra = (lora, lora_a, lora_b, xa, ids, scales, lora_scale, rank, r_block)
        _launch_tma(out, x, weight, bias, residual, alpha, activation, config, extra, pdl=pdl)
        return
    # LoRA launches' PDL flag (passed even when False: torch.compile's wrap_triton takes no
    # defaulted arguments); the expand launch may start while the shrink runs
    variant = {"PDL": pdl, "launch_pdl": True} if pdl and lora == LORA_EXPAND else {"PDL": pdl}
    if lora == LORA_NONE:
        b_arg = x if bias is None else bias
        r_arg = x if residual is None else residual
        ints = (
            m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            0 if residual is None else residual.stride(0), out.stride(0),
        )  # fmt: skip
        dep = pdl_launch(x, traced)  # programmatic dependent launch (not LoRA's pdl)
        if config.get("STREAM"):
            flags = (bias is not None, residual is not None, activation, precision, upcast)
            _launch_stream(out, x, weight, b_arg, r_arg, ints, alpha, flags, config, traced, dep)
            return
        consts = (
            bias is not None, residual is not None, activation, precision, upcast,
            config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["GROUP_M"], even_k,
            k <= config["BLOCK_K"], dep, bool(config.get("REG_PIPE")),
        )  # fmt: skip
        tensors = (x, weight, b_arg, r_arg, out)
        _launch_plain(
            _linear_kernel, _linear_launches, grid, tensors, ints, alpha, consts, config, dep,
            traced,
        )  # fmt: skip
        return
    kernel = torch.library.wrap_triton(_lora_kernel) if traced else _lora_kernel
    dummy = x
    grid_launch(kernel, grid)(
        x, weight,
        dummy if bias is None else bias,
        dummy if residual is None else residual,
        out,
        dummy if lora_a is None else lora_a,
        dummy if lora_b is None else lora_b,
        dummy if xa is None else xa,
        dummy if ids is None else ids,
        dummy if scales is None else scales,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        0 if residual is None else residual.stride(0), out.stride(0),
        0 if lora_a is None else lora_a.stride(0), 0 if lora_b is None else lora_b.stride(-2),
        float(alpha), float(lora_scale),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACTIVATION=activation,
        LORA=lora, MULTI=ids is not None, R=r, RANK=max(rank, 1), R_PAD=r_pad, R_BLOCK=r_block,
        PER_ADAPTER_SCALE=scales is not None, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"], EVEN_K=even_k, B3D=b3d,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **variant,
    )  # fmt: skip


def stream_grid(m: int, n: int, config: dict, sms: int | None) -> tuple[int]:
    """``_linear_stream_kernel``'s grid: every column tile times as many row programs as
    ``config["STREAM"]`` programs an SM allow (at most one a row tile). Without an SM
    count (the interpreter) two row programs, so that tests see several tiles a program."""
    tiles_n = cdiv(n, config["BLOCK_N"])
    tiles_m = cdiv(m, config["BLOCK_M"])
    rows = 2 if sms is None else max(1, sms * config["STREAM"] // tiles_n)
    return (tiles_n * min(tiles_m, rows),)


def _launch_stream(
    out, x, weight, b_arg, r_arg, ints, alpha, flags, config, traced, dep=False
) -> None:  # fmt: skip
    """One launch of ``_linear_stream_kernel`` (a "STREAM" config; plain layers only); dep:
    with programmatic dependent launch (``pdl_launch``)."""
    m, n, k = ints[:3]
    grid = stream_grid(m, n, config, persistent_programs(x))
    consts = (
        *flags, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
        k == config["BLOCK_K"], config["num_stages"], dep,
    )  # fmt: skip
    tensors = (x, weight, b_arg, r_arg, out)
    _launch_plain(
        _linear_stream_kernel, _stream_launches, grid, tensors, ints, alpha, consts, config, dep,
        traced,
    )  # fmt: skip


def _launch_plain(kernel, launches, grid, tensors, ints, alpha, consts, config, dep, traced):
    """One launch of a plain-layer kernel (``_linear_kernel`` or ``_linear_stream_kernel``):
    tensors (x, weight, bias, residual, out), the ints, alpha and the constexprs in the
    kernel's order; dep: with programmatic dependent launch. Traced launches go through
    wrap_triton, the others repeat through ``launches`` (CompiledLaunches)."""
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    if dep:
        options["launch_pdl"] = True
    args = (*tensors, *ints, float(alpha), *consts)
    if traced:
        grid_launch(torch.library.wrap_triton(kernel), grid)(*args, **options)
        return
    # out's dtype too: LoRA's x @ A^T launch writes float32 from 16-bit x and W
    key = (
        tensors[0].dtype, tensors[-1].dtype, consts, options["num_warps"],
        options["num_stages"], *map(int_spec, ints),
    )  # fmt: skip
    launches(grid, key, aligned16(*tensors), args, options)


def launch_shrink_segments(
    xs: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, ids: torch.Tensor,
    scales: torch.Tensor | None, lora_scale: float, rank: int, config: dict, *,
    traced: bool = False, pdl: bool = False,
) -> None:  # fmt: skip
    """Multi-adapter LoRA's shrink into xs (M, R), zeroed here: each adapter's rows listed
    (``_segment_rows_kernel``), then ``_shrink_segment_kernel``. x (M, K), a_stacked (R,
    K) with R = adapters x rank, ids (M,) per row (-1, or any id past the adapters: no
    adapter, as the stacked product masks them). config from ``SEGMENT_CONFIGS``."""
    if launches_skipped():
        return
    m, k = x.shape
    r = a_stacked.shape[0]
    xs.zero_()
    if m == 0:
        return
    adapters = r // rank
    rows = torch.empty((adapters, m), dtype=torch.int32, device=x.device)
    counts = torch.empty(adapters, dtype=torch.int32, device=x.device)
    wrap = torch.library.wrap_triton if traced else (lambda kernel: kernel)
    grid_launch(wrap(_segment_rows_kernel), (adapters,))(
        ids, rows, counts, m, CHUNK=max(16, min(next_pow2(m), 2048)), num_warps=4
    )  # fmt: skip
    upcast = triton_interpreting()
    grid_launch(wrap(_shrink_segment_kernel), (adapters, cdiv(m, config["BLOCK_M"])))(
        x, a_stacked, xs, rows, counts, xs if scales is None else scales,
        m, k, x.stride(0), x.stride(1), a_stacked.stride(0), float(lora_scale),
        R=r, RANK=rank, RANK_PAD=max(16, next_pow2(rank)), PER_ADAPTER_SCALE=scales is not None,
        PRECISION=dot_precision(x.dtype), UPCAST=upcast, BLOCK_M=config["BLOCK_M"],
        BLOCK_K=config["BLOCK_K"], PDL=pdl and not upcast,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip


# ------------------------------------------------------------------------ configs
def _cfg(bm, bn, bk, warps, stages, group=8) -> dict:
    return {
        "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip


# Candidates for 16-bit inputs (fp32 halves BLOCK_K). Large M: the tiles of the Triton
# matmul tutorial's Hopper list plus two narrower ones; small M (decode-like, the weight
# read dominates): narrow N tiles so that N / BLOCK_N programs cover the SMs, long K steps.
_LARGE = [
    _cfg(128, 256, 64, 8, 3), _cfg(128, 256, 64, 8, 4), _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 4, 4), _cfg(64, 256, 64, 8, 4),
    _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4),
    # 6 stages: 512 rows of 4096 x 4096 bf16 (TMA kernel, W rotating past the L2, H100)
    # 29.8 us against 31.0 for 4 stages and cuBLAS's 30.3 (with a separate GELU)
    _cfg(128, 128, 64, 4, 6),
]  # fmt: skip
_SMALL = [  # (BLOCK_N, BLOCK_K, warps, stages); BLOCK_M from M. Narrow N tiles and long K
    # steps keep more of W in flight per SM when a few rows leave the tensor cores idle.
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 5),
    (128, 64, 4, 4), (128, 128, 8, 3),
]  # fmt: skip
_SMALL_TMA = [  # the same for the TMA kernel (LOOP_TUNED): the best of a wider sweep,
    # H100, 4096 -> 4096 bf16 at M = 1, 16, 64 (scripts/probe_gemm.py small, NOTES.md).
    # The last two keep 192 KiB in flight at 64 rows, where the 5-stage tiles above do not
    # fit: 15.4 / 15.8 us against 16.4 for 32 x 256 / 3 stages (W rotating; cuBLAS 17.4)
    (64, 256, 4, 5), (64, 256, 4, 3), (32, 512, 4, 5), (32, 256, 4, 5), (32, 256, 4, 3),
    (32, 256, 4, 4), (32, 128, 4, 8),
]  # fmt: skip


_MID_TMA = [  # TMA-kernel candidates for 65 to TMA_TUNED_MAX_M rows (LOOP_TUNED): tiles
    # that give 128-256 programs at M = 256, N = 4096, beside the pointer kernel's _LARGE.
    # The deep ones keep 128-192 KiB of x and W in flight per SM: at 256 rows the loop
    # waits on W streaming from HBM, not on the tensor cores (H100, 4096 x 4096 bf16, W
    # rotating past the L2: 64 x 128 x 128 with 4 stages 19.6 us, 64 x 128 x 64 with 8
    # stages 20.5, against 25.2 for 4 stages of 64 and cuBLAS's 21.9; NOTES.md)
    _cfg(64, 128, 64, 4, 4), _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 128, 4, 4),
    _cfg(64, 128, 128, 4, 4), _cfg(64, 128, 64, 4, 8), _cfg(128, 64, 128, 4, 4),
]  # fmt: skip


_SKINNY_N = [  # (BLOCK_M, BLOCK_K, warps, stages) for many rows and N <= 256 (LoRA's
    # x @ A^T; BLOCK_N at most 64): short row tiles, so that the programs cover the SMs
    # (H100, M = 4096, N = 16: 64 x 16 tiles left half the SMs idle, 23 us for a 32 MiB
    # read; M = 1024, 16 adapters x rank 16 = 256 columns: 64 x 128 tiles made 32 programs)
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3),
    # Few, tall tiles: LoRA's shrink overlapped with the main launch (see
    # fuseml.ops.lora._overlapped_expand) must leave the SMs to it (1024 rows: 4 programs)
    (256, 64, 8, 4), (256, 128, 8, 3),
]  # fmt: skip
_NARROW_N = [  # (BLOCK_M, BLOCK_K, warps, stages) with 32-column tiles, for many rows and
    # 33-64 output columns (the DLRM's 256 -> 64): 64-row tiles of all 64 columns make
    # one program per 64 rows, 64 of them at 4096 rows on 132 SMs. H100, 256 -> 64 at 4096
    # rows, bias + GELU-tanh, 45 weight sets rotating past the L2 (scripts/probe_gemm.py
    # cands, NOTES.md): TMA 64 x 32 x 128 / 3 stages 3.8 us, 64 x 32 x 256 / 2 stages 3.9,
    # against 4.1 for the best 64-column tile (cuBLAS F.linear + GELU 5.9)
    (64, 128, 4, 3), (64, 256, 4, 2),
]  # fmt: skip
_SHORT_K = [  # (BLOCK_M, BLOCK_N, warps, stages) for many rows and a K of one step (the
    # DLRM's 13 -> 512, 64 -> 16): the kernel is about one round trip to memory long, so
    # more, smaller tiles (H100, 13 -> 512 at 512 rows: 64 x 128 tiles, 32 programs, took
    # 5.4 us against cuBLASLt's 4.3)
    (64, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2), (128, 32, 4, 2),
]  # fmt: skip
_REG_PIPE = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps) of the pointer loop with its loads a
    # step early (REG_PIPE), for rows that are not 16-byte aligned (no asynchronous copies,
    # so Triton does not pipeline the loop). H100, 367 -> 512 bf16 + bias + ReLU at 4096
    # rows, graph replay (scripts/probe_unaligned.py): 128 x 128 x 32 / 8 warps 11.3 us
    # against 13.2 without; 128 x 64 x 64 16.9 against 61.6; cuBLASLt 27.7. Some tiles
    # lose with it (128 x 128 x 64: 20.0 against 13.6), so both are timed
    (128, 128, 32, 8), (128, 64, 64, 4), (128, 64, 32, 4), (64, 128, 32, 4), (64, 64, 64, 4),
]  # fmt: skip
_FEW_TILES = [  # 65+ rows where 128 x 128 tiles would not fill one wave (FEW_TILES_WAVE
    # programs): 64 x 64 tiles, 4x the programs. H100, 1024 -> 1024 at 512 rows, bias +
    # GELU-tanh, weights rotating over 8 sets (scripts/probe_gemm.py cands): TMA 64 x 64 x
    # 128 / 4 stages 5.4 us, 64 x 64 x 64 / 6 stages 6.3, against 7.6 for the best tile
    # before (128 x 64) and cuBLAS's 7.3 (F.linear + GELU); 32 programs of 128 x 128: 9.4
    _cfg(64, 64, 128, 4, 4), _cfg(64, 64, 64, 4, 6), _cfg(64, 64, 64, 4, 4),
]  # fmt: skip
_TMA_STORE = [  # TMA-kernel tiles whose epilogue stores through a descriptor in OUT_SUB
    # column slices (see _tma_store), the tile loop flattened (FLATTEN) even where a
    # program has one tile: plain layers from TMA_MIN_M rows (LOOP_TMA). H100, 1024 ->
    # 1024 at 4096 rows, bf16 + bias + ReLU, inputs rotating past the L2, graph replay
    # (scripts/probe_tma_store.py): 128 x 256 x 64 / 4 stages / 4 slices 15.4 us, 2 slices
    # 15.6, 3 stages 15.9; 256 x 128 17.0; 128 x 128 17.7; against 16.9 for the tuned
    # pointer-store tile (64 x 256 x 64 / 4 stages) and cuBLASLt's 15.4. The 4-stage 128 x
    # 256 tile does not fit beside a residual's tile (245,792 bytes, H100): the candidate
    # filter leaves it out of layers with one (see candidates)
    dict(_cfg(128, 256, 64, 8, 4), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(128, 256, 64, 8, 3), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(256, 128, 64, 8, 3), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(128, 128, 64, 8, 4), OUT_SUB=4, FLATTEN=True),
]  # fmt: skip
_STREAM = [  # (BLOCK_M, warps, stages, programs an SM) of _linear_stream_kernel, for many
    # rows, a K of one step up to STREAM_MAX_K and outputs up to STREAM_MAX_N wide, 16-bit:
    # the weight tile stays on chip and row tiles stream through it; BLOCK_N is min(N, 64).
    # The two of a sweep of eight that were fastest somewhere (H100, bias + GELU-tanh,
    # inputs rotating past the L2, graph replay; scripts/probe_gemm.py cands): 65536 x
    # 256 -> 64 17.5 us (64 rows, 1 an SM) against 17.7 for the best pointer tile; 4096 x
    # 13 -> 512 4.3 (32 rows, 4 an SM) against 4.6. Behind at 4096 x 256 -> 64 (4.7-5.8
    # against 3.8) and 65536 x 64 -> 16 (5.8-8.5 against 5.2), so the tuner decides.
    (64, 4, 3, 1), (32, 4, 3, 4),
]  # fmt: skip
STREAM_MIN_M = 512
STREAM_MAX_K = 256
STREAM_MAX_N = 512
SHORT_ROWS_MAX_N = 512  # outputs up to this wide also get 16-row tiles at 17-64 rows
FEW_TILES_WAVE = 132  # an H100 SXM's SM count: the candidate list is device-independent
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on Hopper (the largest)


def candidates(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    loop: int = LOOP_PTR,
    *,
    plain: bool = False,
    residual: bool = False,
    unaligned: bool = False,
) -> list[dict]:
    """Shape-pruned candidate configs (tile dims never far above the problem's, pipeline
    buffers within SMEM_LIMIT); with LOOP_TUNED also TMA-kernel configs (flagged "TMA")
    up to TMA_TUNED_MAX_M rows. plain (plain layers, not LoRA's launches): also
    ``_linear_stream_kernel``'s configs (flagged "STREAM", programs an SM) where the shape
    is one it serves, and with LOOP_TMA the tiles that store through a descriptor
    (``_TMA_STORE``); residual: the layer adds one (its tile's layout change takes shared
    memory beside a TMA-store tile's); unaligned: x's or W's rows are not 16-byte aligned
    (then the pointer loop also times the ``_REG_PIPE`` tiles)."""
    mb = max(16, _tune.m_bucket(m))
    cap_n = max(16, next_pow2(n))
    cap_k = max(16, next_pow2(k))
    if mb <= 64:
        # A narrow output at 17-64 rows: tiles of all the rows make N / BLOCK_N programs
        # (256 -> 64 at 64 rows: 1-4), so also 16-row tiles (4x more)
        rows = (mb, 16) if mb > 16 and n <= SHORT_ROWS_MAX_N else (mb,)
        base = [_cfg(bm, bn, bk, w, s) for bm in rows for bn, bk, w, s in _SMALL]
        if loop == LOOP_TUNED:
            base += [dict(_cfg(mb, bn, bk, w, s), TMA=True) for bn, bk, w, s in _SMALL_TMA]
    else:
        base = list(_LARGE)
        if cdiv(mb, 128) * cdiv(n, 128) < FEW_TILES_WAVE:
            base += _FEW_TILES
        if cap_n <= 256:
            base += [_cfg(bm, min(cap_n, 64), bk, w, s) for bm, bk, w, s in _SKINNY_N]
        if cap_n == 64:
            base += [_cfg(bm, 32, bk, w, s) for bm, bk, w, s in _NARROW_N]
        if cap_k <= 64:
            base += [_cfg(bm, bn, cap_k, w, s) for bm, bn, w, s in _SHORT_K]
        if unaligned and loop == LOOP_PTR and cap_k > 64:
            base += [dict(_cfg(bm, bn, bk, w, 1), REG_PIPE=True) for bm, bn, bk, w in _REG_PIPE]
        if loop == LOOP_TUNED and mb <= TMA_TUNED_MAX_M:
            base += [dict(c, TMA=True) for c in _MID_TMA]
        elif loop == LOOP_TUNED and n <= TMA_TUNED_N:  # from TMA_MIN_M rows: both kernels
            base += [dict(c, TMA=True) for c in base]
        if loop == LOOP_TMA and plain and dtype != torch.float32:
            # (16-bit only: measured there; a float32 layer with a residual asked for 311,352
            # bytes of shared memory on an H100, with one of these tiles or the same tile's
            # pointer stores: the failing test did not tell which)
            base += _TMA_STORE
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for c in base:
        c = dict(c)
        if dtype == torch.float32:
            c["BLOCK_K"] = max(16, c["BLOCK_K"] // 2)
        c["BLOCK_M"] = min(c["BLOCK_M"], mb)
        c["BLOCK_N"] = min(c["BLOCK_N"], cap_n)
        c["BLOCK_K"] = min(c["BLOCK_K"], cap_k)
        smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * es
        if c.get("OUT_SUB"):
            # slices of at least 16 columns; one slice's buffer (the output is x's dtype)
            # and the barriers beside the main loop's (offline, sm_90: 213,536 bytes for
            # 128 x 256 x 64 / 4 stages / 4 slices in bf16)
            c["OUT_SUB"] = max(1, min(c["OUT_SUB"], c["BLOCK_N"] // 16))
            smem += c["BLOCK_M"] * c["BLOCK_N"] // c["OUT_SUB"] * es + 1024
            if residual:  # 245,792 bytes with one for 128 x 256 x 64 / 4 stages (H100)
                smem += c["BLOCK_M"] * c["BLOCK_N"] * es // 2
        if c not in out and smem <= SMEM_LIMIT:
            out.append(c)
    if plain and es == 2 and m >= STREAM_MIN_M and cap_k <= STREAM_MAX_K and n <= STREAM_MAX_N:
        bn, bk = min(cap_n, 64), cap_k
        for bm, warps, stages, per_sm in _STREAM:
            # x's buffers, W's tile and the epilogue's layout change (a float32 tile, the
            # measured allocations: 245,760 bytes for 128 x 64 x 256 / 3 stages in bf16),
            # for every program an SM
            bm = min(bm, mb)
            if per_sm * ((stages * bm + bn) * bk * es + bm * bn * 4) <= SMEM_LIMIT:
                out.append(dict(_cfg(bm, bn, bk, warps, stages), STREAM=per_sm))
    return out


SEGMENT_CONFIGS = [  # launch_shrink_segments: short row blocks (each adapter's rows are
    # a fraction of the batch) and long, deep K steps: few programs each stream a long
    # run of x (16 rows x 4096 bf16: 128 KiB) and their adapter's A
    {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "SEGMENTS": True}
    for bm, bk, w, st in ((16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4))
]


def default_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """The untuned config: tuning off, interpreter, or torch.compile tracing."""
    bk = 32 if dtype == torch.float32 else 64
    return _cfg(
        min(128, max(16, _tune.m_bucket(m))),
        min(128, max(16, next_pow2(n))),
        min(bk, max(16, next_pow2(k))),
        4,
        3,
    )


def choose_config(
    op: str,
    x: torch.Tensor,
    n: int,
    k: int,
    launch: Callable[[dict], None],
    extra: str = "",
    loop: int = LOOP_PTR,
    *,
    tma_only: bool = False,
    more: list[dict] = (),
    fits: Callable[[dict], bool] | None = None,
    plain: bool = False,
    residual: bool = False,
    unaligned: bool = False,
) -> dict:
    """The launch config of an (M, N, K) problem; ``launch(cfg)`` runs it (for tuning).
    tma_only: only the candidates that take the TMA kernel (LoRA's joint mode). more:
    candidates beside the GEMM's own (LoRA's segmented shrink). fits: only the candidates
    it accepts (LoRA's spread mode: one wave); the untuned default may not be one.
    plain: plain layers, which also time the streaming kernel's and the TMA-store tiles
    (see candidates); residual: the layer adds one, unaligned: its rows are not 16-byte
    aligned (see candidates; the caller keys its tuning on both through ``extra``).

    See ``fuseml.ops._tune.choose``: memo, then the on-disk table, then tuning.
    """
    m = x.shape[0]
    if type(m) is not int or type(n) is not int or type(k) is not int:
        # Symbolic sizes (torch.compile with dynamic shapes): no bucket to look up.
        hint = m if type(m) is int else 64
        return default_config(
            hint, int(n) if type(n) is int else 128, int(k) if type(k) is int else 128, x.dtype
        )
    precision = dot_precision(x.dtype)
    bucket = _tune.m_bucket(m)
    memo_key = (op, x.dtype, precision, bucket, n, k, extra, x.device)
    cfg = _tune.memoized(memo_key)  # every call: keep this path short
    if cfg is not None:
        return cfg

    def text_key() -> str:
        return (
            f"{op}:{str(x.dtype)[6:]}:{precision}:m{bucket}:n{n}:k{k}{':' + extra if extra else ''}"
        )

    def bench(c: dict) -> float:
        return _tune.gpu_time_ms(lambda: launch(c))

    def listed() -> list[dict]:
        own = [
            c for c in candidates(
                m, n, k, x.dtype, loop, plain=plain, residual=residual, unaligned=unaligned
            )
            if not tma_only or takes_tma(loop, c)
        ]  # fmt: skip
        return [c for c in own if fits is None or fits(c)] + list(more)

    return _tune.choose(
        memo_key,
        x.device,
        text_key,
        listed,
        bench,
        default_config(m, n, k, x.dtype),
        can_time=x.is_cuda and not is_fake(x),
        run=launch,
    )
