"""LoRA modes of the GEMM kernels (constexpr LORA): the constants, the joint / spread /
segment pieces and their host-side sizing. Why each mode and where the tuner takes it:
docs/performance/lora.md.

  1  in-loop: x @ A^T accumulated in the main K loop from the x tiles already loaded, then
     one (BLOCK_M, R) x (R, BLOCK_N) dot. One launch; each column tile redoes the small
     product, which is free while the GEMM waits on memory (few rows).
  2  precomputed: xa = x @ A^T in float32 from a first launch; the epilogue adds
     (s * xa) @ B^T. Two launches, the better trade once the GEMM is compute-bound.
  3  shrink: the first launch of mode 4: x @ A^T with each row's scaling and adapter mask
     applied in the epilogue, stored in the input dtype (xs).
  4  expand (TMA kernel): xs and B tiles through their own descriptors after the K loop,
     one more dot adds xs @ B^T: an extra K step, no masking in the epilogue.
  5  joint (TMA kernel, one launch): the grid's first programs compute xs (as mode 3) on
     the SMs the GEMM's tiles leave free and post a flag per row tile; the tiles wait for
     their row tile's flag after the K loop (as mode 4). The last reader puts the flag
     back to zero, so no memset precedes the launch. The shrink programs are the lowest
     and the grid fits the SMs, so every wait ends. Where free SMs outnumber row tiles, K
     is split over them (float32 parts the tiles sum in order).
  6  spread (TMA kernel, one launch, one tile a program: the tiles must fit one wave):
     each row tile's first R_PAD / SLICE column tiles accumulate a slice of x @ A^T in
     their K loop and store it as xs; every tile waits for its row tile's slices and adds
     xs @ B^T (``_spread_expand``). No program streams all of K for the shrink alone.

Multi-adapter: A and B of every adapter are stacked along R (R = adapters x rank), and
each row keeps only the columns of its own adapter (id -1: none), scaled per adapter:
exact, since the other columns are multiplied by zero. A mixed batch's shrink may instead
run per adapter segment (``launch_shrink_segments``), timed by the tuner beside it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fuseml.ops._utils import CounterSlab, cdiv, next_pow2, slab_counters
from fuseml.ops.gemm.common import _adapter_scale, _bt_chunk, _xs_tile, mma
from fuseml.ops.gemm.configs import SMEM_LIMIT

LORA_NONE, LORA_IN_LOOP, LORA_PRECOMPUTED, LORA_SHRINK, LORA_EXPAND, LORA_JOINT = 0, 1, 2, 3, 4, 5
LORA_SPREAD = 6


class LoraLaunch(NamedTuple):
    """The LoRA part of one TMA-kernel launch (``_launch_tma``); the kernel takes its
    tensors and ints one by one."""

    mode: int  # LORA_IN_LOOP .. LORA_SPREAD
    a: torch.Tensor | None  # stacked A (R, K)
    b: torch.Tensor | None  # stacked B (N, R), or (adapters, N, rank) as given
    xa: torch.Tensor | None  # LORA_PRECOMPUTED: x @ A^T in float32; LORA_EXPAND: xs
    ids: torch.Tensor | None  # (M,) adapter id per row (-1: none), multi-adapter only
    scales: torch.Tensor | None  # (adapters,) float32 scaling per adapter, or None
    scale: float  # the scaling where scales is None
    rank: int  # one adapter's rank
    r_block: int  # stacked columns per step of the xs @ B^T product


# LORA 5: the fewest K steps of the joint shrink's loop that fit the GEMM's buffers (see
# _launch_tma)
JOINT_SHRINK_STAGES = 3
# LORA 5: the most parts K is split into for the shrink where free SMs outnumber row tiles
# (see _launch_tma)
JOINT_SPLIT = 4


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
    product does every adapter's columns for every row, 16x the FLOPs of this one with
    16 adapters. Programs past the list stop at once."""
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
    one descriptor box cannot: fewer, wider steps than the expand mode's descriptor
    takes, one adapter a step)."""
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


# Buffers of LORA_SPREAD's expand loop: with 2, each step waits for its own load (its dot is
# too short to hide the next one's); they reuse the main loop's shared memory, free by then
SPREAD_EXPAND_STAGES = 4


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


EXPAND_STAGES_MAX = 8  # the most buffers of the expand mode's xs @ B^T loop


def expand_stages(config: dict, r_pad: int, r_block: int, elem_size: int) -> int:
    """Buffers of the expand mode's xs @ B^T loop (R_PAD / R_BLOCK steps of R_BLOCK
    stacked columns): as many steps in flight as fit beside the main loop's buffers, up to
    EXPAND_STAGES_MAX. Each step is one small MMA on two TMA tiles, so with few buffers
    the loop waits on each load in turn (16 adapters read in place: 30.0 -> 28.0 us for
    up to 8 buffers instead of 3)."""
    steps = r_pad // r_block
    if steps <= 1:
        return 3
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    main = config["num_stages"] * (bm + bn) * bk * elem_size
    fit = (SMEM_LIMIT - main) // ((bm + bn) * r_block * elem_size)
    return max(2, min(steps, EXPAND_STAGES_MAX, fit))


JOINT_FLAG_SLAB = 1 << 18  # counters per device (1 MiB)
_flag_slab = CounterSlab(JOINT_FLAG_SLAB, "the joint LoRA launch's flags")


def reserve_joint_flags(x: torch.Tensor) -> None:
    """The joint flags' slab on x's (CUDA) device, allocated outside any capture: a layer
    whose eager calls take the in-loop launch may capture joint or spread launches later
    (tuned for graphs), and a capture cannot allocate the slab (each replay would zero its
    counters with a memset node between the layers' kernels)."""
    _flag_slab.reserve(x)


def joint_flags(x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters for a joint launch on x's device and current stream
    (see CounterSlab; the kernel puts them back to zero before it exits, _joint_wait)."""
    return slab_counters(_flag_slab, x, count)


def joint_flags_kept(flags: torch.Tensor) -> bool:
    """Are these joint flags a slice of the slab (which later launches may reuse), not a
    buffer zeroed for one launch?"""
    return _flag_slab.holds(flags)
