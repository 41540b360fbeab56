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
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from fuseml import _cuda_ext
from fuseml.ops._math import LOG2E, _exp2, _pdl_begin, _rcp
from fuseml.ops._utils import (
    GRID_Y_MAX,
    CompiledLaunches,
    CounterSlab,
    aligned16,
    cdiv,
    check_tensor,
    compiled,
    fast_math,
    fused_op,
    int_spec,
    launches_skipped,
    needs_dispatch,
    next_pow2,
    pdl_launch,
    slab_counters,
    sm_count,
    vec_width,
)
from fuseml.runtime import env_choice, env_flag, resolve_backend, triton_interpreting


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reference: torch's softmax (float32 math for 16-bit inputs, like the kernels)."""
    return torch.softmax(x, dim)


def log_softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(x, dim)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _softmax_rows_kernel(
    x_ptr,  # (M, N) input, unit column stride
    out_ptr,  # (M, N) output, unit column stride
    n_rows,
    n_cols,
    stride_xm,  # row strides, in elements
    stride_om,
    LOG: tl.constexpr,  # log_softmax instead of softmax
    ROWS: tl.constexpr,  # rows per step: a (ROWS, BLOCK_N) tile (short rows take several)
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row in registers
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the row loop
    FAST: tl.constexpr,  # one-instruction exp2 / reciprocal (ops/_math.py)
    VEC: tl.constexpr = 1,  # elements in 16 bytes where n_cols and both row strides are
    # multiples of it (the launcher checks; ops/_utils.vec_width), else 1
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
):
    if PDL:
        _pdl_begin()
    if VEC > 1:
        # 16-byte accesses for widths such as 1000 (see vec_width): (v // VEC) * VEC == v.
        n_cols = (n_cols // VEC) * VEC
        stride_xm = (stride_xm // VEC) * VEC
        stride_om = (stride_om // VEC) * VEC
    # A program per block of ROWS rows, or (PERSISTENT in the launcher: the longest rows)
    # a grid of what fits on the GPU at once, each program striding over the blocks so
    # that the loads of block i + grid (NUM_STAGES deep) overlap the math of block i.
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    local = tl.arange(0, ROWS)
    n_blocks = tl.cdiv(n_rows, ROWS)
    for blk in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tl.cast(blk, tl.int64) * ROWS + local
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=-float("inf")
        ).to(tl.float32)
        z = x - tl.max(x, axis=1)[:, None]  # a row of all -inf gives NaN, as torch does
        e = _exp2(z * LOG2E, FAST)  # z first: x - max is exact near the max
        s = tl.sum(e, axis=1)[:, None]
        if LOG:
            y = z - tl.log(s)
        else:
            y = e * _rcp(s, FAST)
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _softmax_online_kernel(
    x_ptr,  # (M, N) input, unit column stride
    out_ptr,  # (M, N) output
    n_rows,
    n_cols,
    stride_xm,
    stride_om,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per step
    FAST: tl.constexpr,
    NUM_STAGES: tl.constexpr = 1,  # software pipelining depth of both column loops
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
):
    if PDL:
        _pdl_begin()
    # Rows too long for registers. Pass 1 keeps a running max m and sum s of the row, one
    # chunk at a time (online softmax: s <- s * exp(m_old - m_new) + sum(exp(x - m_new)),
    # with m_new the max over the chunk and m_old: one exp per element, not two as a
    # per-lane running max needs); pass 2 writes the output. Two reads and one write,
    # however long the row; the grid may be smaller than the rows (a program takes
    # rows pid, pid + grid, ...) so that fewer rows are in flight between the two reads.
    cols = tl.arange(0, BLOCK_N)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * stride_xm
        m = tl.full([], -float("inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
            offs = start + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # While every value so far is -inf, shift by 0 rather than by -inf (-inf - -inf
            # would be NaN), so the sum stays 0.
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * _exp2((m - shift) * LOG2E, FAST) + tl.sum(
                _exp2((x - shift) * LOG2E, FAST), axis=0
            )
            m = m_new
        log_total = tl.log(s)
        inv_total = _rcp(s, FAST)
        out_row = out_ptr + row64 * stride_om
        for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            z = x - m  # NaN for an all -inf row, as torch
            if LOG:
                y = z - log_total
            else:
                y = _exp2(z * LOG2E, FAST) * inv_total
            tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_stats(stats_row, chunks, BLOCK_G: tl.constexpr, FAST: tl.constexpr):
    """A split row's max and sum of exp(x - max), from the (max, sum) pairs its `chunks`
    programs posted at stats_row (read from L2: other programs wrote them)."""
    g = tl.arange(0, BLOCK_G)
    g_ok = g < chunks
    ms = tl.load(stats_row + 2 * g, mask=g_ok, other=-float("inf"), cache_modifier=".cg")
    ss = tl.load(stats_row + 2 * g + 1, mask=g_ok, other=0.0, cache_modifier=".cg")
    m_row = tl.max(ms, axis=0)
    shift = tl.where(m_row == -float("inf"), 0.0, m_row)  # a chunk of only -inf adds 0
    return m_row, tl.sum(ss * _exp2((ms - shift) * LOG2E, FAST), axis=0)


@triton.jit
def _pairs_f32(w, sh, DT: tl.constexpr):
    """(low, high) 16-bit elements (storage dtype DT) of the int32 pairs ``w``, as float32;
    ``sh`` is 16."""
    lo = w.to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    hi = (w >> sh).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pair_pack(lo, hi, DT: tl.constexpr, FAST: tl.constexpr):
    """float32 lo / hi rounded to the 16-bit DT and packed into int32 pairs (lo in the low
    half), as the pairs are stored."""
    if FAST:
        if DT.is_bf16():
            v = tl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                is_pure=True, pack=1,
            )  # fmt: skip
        else:
            v = tl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                is_pure=True, pack=1,
            )  # fmt: skip
    else:
        v_lo = lo.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        v = (hi.to(DT).to(tl.int16, bitcast=True).to(tl.int32) << 16) | v_lo
    return v


@triton.jit
def _softmax_split_kernel(
    x_ptr,  # (M, N) input, unit column stride
    out_ptr,  # (M, N) output
    stats_ptr,  # (M, chunks, 2) float32 scratch: each chunk's (max, sum of exp(x - max))
    count_ptr,  # (M,) int32, zero at launch: chunks of the row whose statistics are
    # posted; zero again when the launch ends (PHASE 0)
    n_cols,
    stride_xm,
    stride_om,
    chunks,  # programs per row
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per program: a power of two >= CHUNK
    CHUNK: tl.constexpr,  # columns a program takes (<= BLOCK_N, a multiple of 16 if less)
    BLOCK_G: tl.constexpr,  # next power of two >= chunks
    VEC: tl.constexpr,  # elements in 16 bytes where rows of x and out share their
    # alignment (the launcher checks), else 1
    PHASE: tl.constexpr,  # 0: whole op, the row's programs wait for each other; 1 / 2:
    # statistics / output only, as two launches (the interpreter runs programs one by one)
    FAST: tl.constexpr,
    GRID2D: tl.constexpr = False,  # the grid is (chunks, rows): no division of the
    # program id ahead of the first load (blocks still start in row-major order)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
    PAIRS: tl.constexpr = False,  # 16-bit x loaded, held through the wait and stored as
    # int32 pairs of elements: half the registers of float32 values (VEC > 1 only)
    NEG_PAIR: tl.constexpr = 0,  # with PAIRS: two -inf of the storage dtype as one int32
    sixteen=16,  # with PAIRS: a runtime 16 (see the statistics phase)
):
    if PDL:  # (every program of this grid is resident before the next PDL launch begins)
        _pdl_begin()
    # Long rows split over `chunks` programs, each holding its chunk in registers: one read
    # and one write per element, however long the row. A program reduces its chunk to
    # (max, sum), posts them, waits until every chunk of its row has posted, combines
    # the `chunks` pairs into the row's max and sum, and writes its chunk. The programs of a
    # row have consecutive ids and each waits only on them, so the wait ends if blocks
    # start in id order and `chunks` of them fit on the GPU at once (the assumption CUB's
    # single-pass scan makes); the launcher keeps `chunks` well under that.
    #
    # Rows whose start is not 16-byte aligned (odd widths: 50257) would load one element
    # at a time; so the chunks tile the row from its first 16-byte boundary ("lead"
    # elements in) in whole 16-byte groups, and the last chunk also takes the unaligned
    # head and tail (fewer than VEC elements each) as a small separate piece.
    if GRID2D:
        row = tl.cast(tl.program_id(1), tl.int64)
        chunk = tl.program_id(0)
    else:
        pid = tl.program_id(0)
        row = tl.cast(pid // chunks, tl.int64)
        chunk = pid % chunks
    x_off = row * stride_xm
    o_off = row * stride_om
    x_row = x_ptr + x_off
    out_row = out_ptr + o_off
    lead = (VEC - x_off % VEC) % VEC  # the launcher checks o_off + lead is aligned too
    body = tl.maximum(((n_cols - lead) // VEC) * VEC, 0)  # elements in whole groups
    rel = chunk * CHUNK + tl.arange(0, BLOCK_N)
    if CHUNK < BLOCK_N:
        mask = rel < tl.minimum(tl.multiple_of(body, VEC), (chunk + 1) * CHUNK)
    else:
        mask = rel < tl.multiple_of(body, VEC)
    x_body = x_ptr + tl.multiple_of(x_off + lead, VEC)  # 16-byte aligned where x is
    out_body = out_ptr + tl.multiple_of(o_off + lead, VEC)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if PAIRS:
        # element pairs (2i, 2i + 1) of the body as int32 i: the body starts 16-byte
        # aligned and every chunk at a multiple of 16 elements, so pairs never straddle
        # (the chunk's start goes into the scalar pointers and its length into a scalar
        # bound, so that the lanes' addresses are one base plus constants: with the
        # start in the offsets, 7184- and 3872-column chunks took 48 registers, not 32;
        # triton 3.6, sm_90, offline)
        start2 = chunk * (CHUNK // 2)
        rel2 = tl.arange(0, BLOCK_N // 2)
        left2 = tl.multiple_of(body // 2, VEC // 2) - start2  # pairs of the body left
        if CHUNK < BLOCK_N:
            left2 = tl.minimum(left2, CHUNK // 2)
        mask2 = rel2 < left2
        x_pairs = x_body.to(tl.pointer_type(tl.int32)) + start2
        out_pairs = out_body.to(tl.pointer_type(tl.int32)) + start2
        v = tl.load(x_pairs + rel2, mask=mask2, other=NEG_PAIR)
    else:
        x = tl.load(x_body + rel, mask=mask, other=-float("inf")).to(tl.float32)
    # head [0, lead) and tail [lead + body, n_cols), in the last chunk only
    e = tl.arange(0, 2 * VEC)
    edge = tl.where(e < VEC, e, lead + body + e - VEC)
    edge_ok = (tl.where(e < VEC, e < lead, True) & (edge < n_cols)) & (chunk == chunks - 1)
    x_edge = tl.load(x_row + edge, mask=edge_ok, other=-float("inf")).to(tl.float32)
    stats_row = stats_ptr + row * (2 * chunks)
    if PHASE != 2:
        if PAIRS:
            # The pairs are unpacked afresh for each pass (max, sum, output), each from a
            # different expression of them (v, v ^ 0, v | 0 with a runtime 0; a runtime
            # 16 in the last), so that the compiler cannot merge the unpacks and keep 32
            # float32 values a thread live from one pass to the next (with one unpack
            # shared by the passes the pairs kernel took 64 registers; now 32 at 8192
            # columns / 8 warps with triton 3.6, 36 at 4096 / 4 with triton 3.9; sm_90,
            # offline)
            lo, hi = _pairs_f32(v, 16, DT)
            m = tl.maximum(tl.max(tl.maximum(lo, hi), axis=0), tl.max(x_edge, axis=0))
        else:
            m = tl.maximum(tl.max(x, axis=0), tl.max(x_edge, axis=0))
        shift = tl.where(m == -float("inf"), 0.0, m)  # an all -inf chunk: sum 0, not NaN
        # tl.exp here, not _exp2: with the one-instruction exp2 in this phase ptxas gives
        # the kernel 64 registers instead of 48 (4 blocks of 8 warps per SM, not 5;
        # triton 3.9, sm_90, offline); in the output phase it costs none.
        if PAIRS:
            lo, hi = _pairs_f32(v ^ (sixteen - 16), 16, DT)
            s = tl.sum(tl.exp(lo - shift) + tl.exp(hi - shift), axis=0)
        else:
            s = tl.sum(tl.exp(x - shift), axis=0)
        s += tl.sum(tl.exp(x_edge - shift), axis=0)
        tl.store(stats_row + 2 * chunk, m)
        tl.store(stats_row + 2 * chunk + 1, s)
        if PHASE == 0:
            # release: the stores above are visible to whoever sees the new count;
            # acquire: the other chunks' statistics are visible once the count is full
            # (the polling add of 0 compiles to an acquire load, sm_90). The last chunk to
            # post puts the counter back to zero (release), so no memset precedes the
            # next launch (split_counters). A poll that reads 0 therefore also means
            # "all posted": this chunk's own add keeps the count above 0 until then.
            posted = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") + 1
            if posted == chunks:
                tl.atomic_xchg(count_ptr + row, 0, sem="release")
            while (posted != 0) & (posted < chunks):
                posted = tl.atomic_add(count_ptr + row, 0, sem="acquire")
    if PHASE != 1:
        m_row, total = row_stats(stats_row, chunks, BLOCK_G, FAST)
        z_edge = x_edge - m_row  # NaN for an all -inf row, as torch
        if LOG:
            log_total = tl.log(total)
            y_edge = z_edge - log_total
        else:
            inv_total = _rcp(total, FAST)
            y_edge = _exp2(z_edge * LOG2E, FAST) * inv_total
        if PAIRS:
            # (written out, not _pairs_f32(v | z, sixteen): taking the high half from
            # v | z as well gave 48 registers instead of 32-36, triton 3.6 and 3.9 offline)
            lo = (v | (sixteen - 16)).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
            hi = (v >> sixteen).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
            z_lo = lo - m_row
            z_hi = hi - m_row
            if LOG:
                y_lo = z_lo - log_total
                y_hi = z_hi - log_total
            else:
                y_lo = _exp2(z_lo * LOG2E, FAST) * inv_total
                y_hi = _exp2(z_hi * LOG2E, FAST) * inv_total
            tl.store(out_pairs + rel2, _pair_pack(y_lo, y_hi, DT, FAST), mask=mask2)
        else:
            z = x - m_row
            if LOG:
                y = z - log_total
            else:
                y = _exp2(z * LOG2E, FAST) * inv_total
            tl.store(out_body + rel, y.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + edge, y_edge.to(out_ptr.dtype.element_ty), mask=edge_ok)


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


# ---------------------------------------------------------------------- launch configs
# Rows up to this many bytes of float32 math stay in registers (one program per row, 8-16
# warps): 32768 columns = 128 KiB of fp32 per row, half of an H100/H200 SM's register file.
MAX_ONCHIP_COLS = 32768


# Short rows (under 1024 columns): ROWS rows a program, so that each of its 4 warps' threads
# holds one 16-byte vector of the tile (SHORT_TILE_BYTES of the row tile a program: 8 x 128
# bf16, 4 x 128 fp32, ..., 1 x 512 fp32), as the flat elementwise path does. H100, CUDA-graph
# replay with inputs rotating past the L2, M = 4096 (scripts/probe_launch_bound.py rules,
# 6a125d9; us, against 4 KiB tiles, the rule before them, the CUDA twin's warp per row and
# torch.softmax):
#
#   N, dtype        2 KiB tiles   4 KiB tiles (before)   CUDA twin   torch
#   128 bf16           2.87          3.20                  3.01       3.86
#   256 bf16           3.59          4.45                  3.64       4.62
#   512 bf16           4.82          5.56                  4.93       7.09
#   128 fp32           3.48          3.96                  3.64       3.96
#   256 fp32           4.78          5.50                  5.03       5.13
#   512 fp32           6.94          7.73 (6.74 as 2 x 512)  7.22       7.54
#
# (An older events-timed sweep put 16 rows x 128 at 5.6 us against 19.6 for one row a
# program.) From 1024 columns one row a program.
#
# A tile of one row under 1024 columns (float32 512) would leave one warp to a program
# (four vectors a thread, its reductions inside the warp, the CUDA twin's warp per row);
# it takes SHORT_PAIR_ROWS rows on SHORT_PAIR_WARPS warps instead, with 2 stages, and
# launches without PDL (PDL_MIN_WARPS, below). H100, 4096 x 512 float32, fuseml.ops itself
# in CUDA-graph replay at the suite's settings, inputs rotating, arms interleaved
# (scripts/probe_pdl.py shapes, 640cde6; us alone / a (torch.neg, op) pair; softmax, then
# log_softmax):
#
#   rows / warps / stages, PDL    softmax          log_softmax
#   1 / 1 / 2, off (before PDL)   6.23 / 10.48     6.23 / 10.48
#   1 / 1 / 2, on                 5.69 / 11.95     5.68 / 11.90
#   2 / 2 / 2, off (the rule)     6.24 / 10.35     6.24 / 10.39
#   2 / 2 / 2, on (e40a95e)       6.36 / 10.28     6.31 / 10.29
#   4 / 4 / 1, on                 6.35 / 10.68     6.46 / 10.75
#   torch.compile                 6.52 / 10.64     6.34 / 10.45
#   torch                         7.12 / 11.32     6.32 / 10.58
#
# (The suite at 911e6c6: 2 / 2 / 2 with PDL 6.64 / 6.54 us, 1 / 1 / 2 without 6.26 / 6.26,
# torch.compile 6.54 / 6.41, torch 6.74 / 6.34.) Before PDL, one warp against 4 (fp32,
# PROBE_LOG=1, 4fea208; us, rows / warps / stages): log_softmax 1 / 1 / 2 6.61, 1 / 1 / 1
# 6.73, 1 / 2 / 2 6.68, 1 / 4 / 1 6.96, 2 / 4 / 1 6.75; torch 6.80, torch.compile 6.92.
SHORT_TILE_BYTES = 2048
MAX_ROWS = 16
SHORT_PAIR_ROWS = 2
SHORT_PAIR_WARPS = 2
# Stages: a program of the non-persistent grid takes one row block, so the row loop runs
# once and software pipelining only adds code: one stage (same probe: fp32 2048 23.7 us
# against 24.8 with 4 stages, bf16 1000 6.78 against 6.88, fp32 1000 11.20 against
# 11.44). Up to 41f3aef rows from 4096 columns took 2 stages, 0.4-0.6% ahead of one at
# 4096 bf16; at widths whose block they fill less it cost far more. H100, graph replay,
# bf16 (probe_launch_bound.py sweep, 41f3aef; us, warps 1 stage / 2 stages):
#
#   N       4 warps         8 warps (the rule)   copy
#   3000    16.71 / 18.48   17.06 / 18.86        16.05
#   4096    23.53 / 23.47   23.69 / 23.64        23.48
#
# (float32 8192: 91.49 / 91.33 at 8 warps, 91.66 / 91.45 at 16; float32 32768, one
# program a row: 363.4 / 364.2; on an H200, log_softmax float32 8192, 16 warps: 66.86 /
# 68.68.) The one-row short tile (above) keeps 2, and so do row tiles of TWO_STAGE_MIN_BYTES
# or more (float32 16384 at 16 warps): with one stage that kernel takes 70 registers a
# thread, with two 60 (offline, triton 3.9, sm_90), so one program an SM fits instead of
# two; H200, 41f3aef / 724fedb: 151.6 us against 132.3 (8 warps, one stage: 132.9).
TWO_STAGE_MIN_BYTES = 64 * 1024

# Grid: one program per ROWS rows below PERSISTENT_MIN_BLOCK columns, the occupancy-sized
# persistent grid (rows looped inside each program, the next row's load pipelined through
# shared memory, PERSISTENT_STAGES deep) from there. H100, bf16, rows chosen so that each
# case moves 64-128 MiB (scripts/probe_softmax.py PROBE_ROWS, 5237fab; us, library warps
# and stages unless noted):
#
#   N (rows)                      128 (262144)  1024 (32768)  4096 (16384)  16384 (4096)  32768 (4096)
#   persistent grid                   53.4          51.8          99.3          99.2          203.4
#   one program per row               49.5          49.6          94.1          95.0          205.2 (3 stages)
#   persistent, 3 stages                -             -             -             -           194.9
#   same-size copy                    49.4          49.3          93.6          94.0          182.0
#
# (1000 and 2048 columns, 8192, and log_softmax at 1024 and 32768 alike: one program per
# row 2-5% faster up to 16384 columns; at 32768 the 3-stage persistent grid 4% faster,
# 4 stages level with 3, 32 warps 196.0.)
#
# The persistent grid needs its PERSISTENT_STAGES: where shared memory caps the stages
# below that (float32 at 32768 columns: 2 on an H100 / H200) one program per row with one
# stage is faster. H100, log_softmax float32 4096 x 32768 (probe_launch_bound.py wide,
# 4fea208; us): persistent 2 stages 385.1, one program a row 1 stage 363.4, 2 stages 364.2,
# 32 warps 364.8; torch.compile 371.1. (At 4092 rows, 31 a program for every SM: 383.4
# and 363.1, so not the 4 rows a 32nd round takes.)
PERSISTENT_MIN_BLOCK = 32768
PERSISTENT_STAGES = 3

# Warps from 1024 columns: one per 512 columns (16 values a thread), up to 16; float32
# rows take at least FP32_MIN_WARPS. H100, graph replay, inputs rotating, M = 4096
# (scripts/probe_launch_bound.py fp32, 52a6be2; us, warps of a one-row program):
#
#   float32 N     1 warp   2 warps   4 warps   8 warps   torch.compile
#   1024          11.48    11.51     11.17     11.56     11.31
#   2048          23.31    23.06     22.89     23.68     25.86
#
# Rows of a 4096-wide block (2049-4096 columns) take WARPS_4096 = 4 (32 values a thread):
# H100, graph replay, one stage (probe_launch_bound.py sweep, 41f3aef; us, 4 / 8 warps):
# bf16 3000 16.71 / 17.06, bf16 4096 23.53 / 23.69; H200 (724fedb): log_softmax bf16 3000
# 13.71 / 15.07, float32 3000 25.57 / 25.82. At other widths the sweep found 4 warps no
# better (H200, bf16, 4 / 8 / 16 warps: 8192 34.43 / 34.70 / 34.56, 16384 78.54 / 70.11 /
# 70.38; 2048, 2 / 4 warps: 9.57 / 9.58).
FP32_MIN_WARPS = 4
WARPS_4096 = 4

# Shared memory: the pipelined row loop keeps NUM_STAGES - 1 row tiles (ROWS x BLOCK_N
# elements each) in flight in shared memory, beside 64 bytes of Triton's own scratch
# (compiled for sm_90: 3 stages of 32768 bf16 columns take 131136 bytes). Stages are capped
# so that the tiles fit the device's shared memory per block less SMEM_RESERVE: float32
# rows of 32768 columns (128 KiB a tile) would get 2 on an H100 / H200 (227 KiB a block),
# where 3 would need 256 KiB and fail to launch, and so take one program per row instead
# of the persistent grid (above).
SMEM_RESERVE = 1024


# Under programmatic dependent launch (pdl_launch) a grid's programs are resident and
# waiting before the kernel ahead of them ends; where that kernel does not take part
# (torch's own), 4096 one-row programs of 1 or 2 warps (float32 512 columns, 16-bit 1024;
# 31 an SM, the SM's block limit) cost 1.4-1.5 us more than a plain launch, against 0.2-0.4
# us for programs of 4 warps or more. So under PDL one-row programs of fewer than
# PDL_MIN_WARPS warps (16-bit 1024) take two rows and twice the warps, and programs still
# under PDL_MIN_WARPS warps (float32 512's pairs, above) launch without it: there PDL
# gained nothing even after a fuseml kernel (the table above). H100, 4096 rows, graph
# replay, inputs rotating (scripts/probe_pdl.py widths, NOTES.md "Fifteenth round"; us
# alone / a (torch.neg, softmax) pair):
#
#   bf16 1024     1 row / 2 warps: PDL off 6.76 / 11.14, on 6.30 / 12.55
#                 2 rows / 4 warps, on 6.33 / 11.45 (2 rows / 2 warps 6.81 / 11.22)
#
# (From 2048 columns, and float32 1024 at 4 warps, one-row programs cost 0.2-0.4 us after
# torch.neg, two-row ones no less: left as they are.)
PDL_MIN_WARPS = 4


def _rows_config(
    n_cols: int, elem_size: int, smem_bytes: int | None = None, pdl: bool = False
) -> dict:
    """Tile / num_warps / stages / grid kind for the on-chip kernel: ~16 fp32 values per
    thread (32 for a 4096-wide block); rows shorter than 1024 go ROWS at a time
    (SHORT_TILE_BYTES; float32 512: SHORT_PAIR_ROWS). ``smem_bytes``: the device's shared
    memory per block (None: no limit, the interpreter). ``pdl``: PDL is on for the launch
    (see PDL_MIN_WARPS: the launch takes it only with that many warps)."""
    block = next_pow2(n_cols)
    short_pair = False
    if block < 1024:
        rows = min(MAX_ROWS, SHORT_TILE_BYTES // (block * elem_size))
        warps = 4
        if rows <= 1:
            rows, warps, short_pair = SHORT_PAIR_ROWS, SHORT_PAIR_WARPS, True
    else:
        rows = 1
        warps = WARPS_4096 if block == 4096 else min(16, block // 512)
        if elem_size == 4:
            warps = max(warps, FP32_MIN_WARPS)
    persistent = block >= PERSISTENT_MIN_BLOCK
    if persistent:
        stages = PERSISTENT_STAGES
    elif short_pair or block * elem_size >= TWO_STAGE_MIN_BYTES:
        stages = 2
    else:
        stages = 1
    if pdl and rows == 1 and warps < PDL_MIN_WARPS:  # (stages as measured: see above)
        rows, warps = 2, 2 * warps
    if smem_bytes is not None:
        in_flight = (smem_bytes - SMEM_RESERVE) // (rows * block * elem_size)
        stages = max(1, min(stages, 1 + in_flight))
    if persistent and stages < PERSISTENT_STAGES:
        persistent, stages = False, 1
    return {
        "ROWS": rows, "BLOCK_N": block, "num_warps": warps, "NUM_STAGES": stages,
        "PERSISTENT": persistent,
    }  # fmt: skip


def _smem_per_block(t: torch.Tensor) -> int | None:
    """Shared memory a block of ``t``'s device may use (opt-in limit), None off CUDA."""
    if not t.is_cuda:
        return None
    props = torch.cuda.get_device_properties(t.get_device())  # cached by torch
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


_PROGRAMS: dict[tuple, int] = {}


def _persistent_programs(x2: torch.Tensor, out2: torch.Tensor, cfg: dict, log: bool) -> int | None:
    """Programs of the on-chip kernel that fit on the whole GPU at once, or None if unknown.

    From the compiled kernel itself (registers, shared memory) and the device's limits
    (threads, registers and shared memory per SM, SM count), as in the Triton fused-softmax
    tutorial. Cached per dtype / config / VEC (the variant launched: VEC changes the compiled
    kernel); computed on real tensors only (a fake tensor under torch.compile has no data
    pointer to specialise on).
    """
    device = x2.get_device()
    vec = _rows_vec(x2, out2)
    key = (
        x2.dtype, cfg["ROWS"], cfg["BLOCK_N"], cfg["num_warps"], cfg["NUM_STAGES"], log, vec,
        device,
    )  # fmt: skip
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    if triton_interpreting() or device < 0 or type(x2) is not torch.Tensor or is_fake(x2):
        return None
    k = _softmax_rows_kernel.warmup(
        x2, out2, x2.shape[0], x2.shape[1], x2.stride(0), out2.stride(0),
        LOG=log, ROWS=cfg["ROWS"], BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"],
        FAST=fast_math(x2), VEC=vec, num_warps=cfg["num_warps"], grid=(1,),
    )  # fmt: skip
    k._init_handles()
    props = torch.cuda.get_device_properties(device)
    threads = cfg["num_warps"] * 32
    by_threads = props.max_threads_per_multi_processor // threads
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, k.n_regs * threads)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem // k.metadata.shared if k.metadata.shared else by_threads
    per_sm = max(1, min(by_threads, by_regs, by_smem))
    _PROGRAMS[key] = per_sm * sm_count(device)
    return _PROGRAMS[key]


def _launch_rows(x2: torch.Tensor, out2: torch.Tensor, log: bool, traced: bool) -> None:
    n_rows, n_cols = x2.shape
    ints = (n_rows, n_cols, x2.stride(0), out2.stride(0))
    if traced:
        grid, consts, warps = _rows_plan(x2, out2, log, False)
        kernel = torch.library.wrap_triton(_softmax_rows_kernel)
        kernel[(grid,)](x2, out2, *ints, *consts, num_warps=warps)
        return
    # Repeat launches through the compiled kernel's own launcher (host time: see
    # CompiledLaunches); out2 has x2's dtype. The plan (grid, constexprs, launch options,
    # specialization key) is kept per dtype, sizes, strides, log, device and PDL.
    pdl = pdl_launch(x2)
    pkey = (x2.dtype, log, *ints, x2.get_device(), pdl)
    plan = _ROWS_PLANS.get(pkey)
    if plan is None:
        grid, consts, warps = _rows_plan(x2, out2, log, pdl)
        pdl = consts[-1]  # (not for programs of under PDL_MIN_WARPS warps)
        options = {"num_warps": warps, "launch_pdl": True} if pdl else {"num_warps": warps}
        plan = ((grid,), consts, options, (x2.dtype, consts, warps, *map(int_spec, ints)))
        if len(_ROWS_PLANS) < 4096:
            _ROWS_PLANS[pkey] = plan
    grid, consts, options, key = plan
    _rows_launches(grid, key, aligned16(x2, out2), (x2, out2, *ints, *consts), options)


_ROWS_PLANS: dict[tuple, tuple] = {}


def _rows_plan(
    x2: torch.Tensor, out2: torch.Tensor, log: bool, pdl: bool
) -> tuple[int, tuple, int]:
    """(programs, the on-chip kernel's constexprs in order, num_warps) for x2 -> out2 (pdl:
    PDL is on; the last constexpr, the kernel's PDL, says whether the launch takes it,
    with launch_pdl: not with fewer than PDL_MIN_WARPS warps)."""
    n_rows, n_cols = x2.shape
    cfg = _rows_config(n_cols, x2.element_size(), _smem_per_block(x2), pdl)
    pdl = pdl and cfg["num_warps"] >= PDL_MIN_WARPS
    programs = _persistent_programs(x2, out2, cfg, log) if cfg["PERSISTENT"] else None
    blocks = cdiv(n_rows, cfg["ROWS"])
    grid = blocks if programs is None else min(blocks, programs)
    consts = (
        log, cfg["ROWS"], cfg["BLOCK_N"], cfg["NUM_STAGES"], fast_math(x2), _rows_vec(x2, out2),
        pdl,
    )  # fmt: skip
    return grid, consts, cfg["num_warps"]


_rows_launches = CompiledLaunches(_softmax_rows_kernel)


def _rows_vec(x2: torch.Tensor, out2: torch.Tensor) -> int:
    """The on-chip kernel's VEC: 8 (16-bit) or 4 (fp32) where the width and both row
    strides allow 16-byte accesses, else 1 (see vec_width)."""
    return vec_width(x2.element_size(), x2.shape[1], x2.stride(0), out2.stride(0))


# Online kernel launch: columns per step, warps, and programs per SM (0: one program per
# row). H100, bf16, 4096 rows (scripts/probe_softmax.py and the quick suite, NOTES.md):
# 16384 columns a step and 16 warps took 527 us at 65536 columns and 2172 at 262144
# against 551 / 2214 for 4096 / 8 (a sweep over 4096-16384 columns, 8-32 warps, 0 or 2
# programs per SM; persistent grids were never faster). Rows it does not divide take half
# the step (less of the last step masked off): at 50257, 8192 / 16 took 481 us, 16384 572,
# 4096 / 8 512.
ONLINE_BLOCK = 16384
ONLINE_WARPS = 16
ONLINE_PER_SM = 0
# Software pipelining of its column loops: 1 (none); pipelined or not it took 495-557 us
# at float32 32768 in a probe (H100, probe_launch_bound.py, NOTES.md), the stages a knob
# of that probe
ONLINE_STAGES = 1


def _pdl_options(x: torch.Tensor, traced: bool) -> dict:
    """A kernel's PDL constexpr and launch option for a launch on x (see pdl_launch). Off,
    the constexpr is still passed (torch.compile's wrap_triton takes no defaulted
    arguments) and no launch option (a traced launch takes none)."""
    return {"PDL": True, "launch_pdl": True} if pdl_launch(x, traced) else {"PDL": False}


def _online_block(n_cols: int) -> int:
    """Columns per step of the online kernel for rows of ``n_cols`` (see ONLINE_BLOCK)."""
    block = ONLINE_BLOCK if n_cols % ONLINE_BLOCK == 0 else ONLINE_BLOCK // 2 or 1
    return min(block, next_pow2(n_cols))


def _launch_online(x2: torch.Tensor, out2: torch.Tensor, log: bool, traced: bool) -> None:
    n_rows, n_cols = x2.shape
    grid = n_rows
    if ONLINE_PER_SM:  # a persistent grid (CPU, for the tests: one "SM")
        grid = min(n_rows, ONLINE_PER_SM * (sm_count(x2.get_device()) if x2.is_cuda else 1))
    kernel = torch.library.wrap_triton(_softmax_online_kernel) if traced else _softmax_online_kernel
    kernel[(grid,)](
        x2, out2, n_rows, n_cols, x2.stride(0), out2.stride(0),
        LOG=log, BLOCK_N=_online_block(n_cols), FAST=fast_math(x2), NUM_STAGES=ONLINE_STAGES,
        num_warps=ONLINE_WARPS, **_pdl_options(x2, traced),
    )  # fmt: skip


# Split-row kernel (rows longer than MAX_ONCHIP_COLS): SPLIT_BLOCK columns a program
# with one warp per SPLIT_COLS_PER_WARP columns, more columns (up to SPLIT_MAX_BLOCK)
# where a row would need more than SPLIT_MAX_CHUNKS programs, and never more than half the
# SMs' worth (a row's programs wait for each other: they must all fit on the GPU at once).
# Longer rows take the online kernel. H100, bf16, 4096 rows (scripts/probe_softmax.py,
# e0f1c30, NOTES.md), us by columns / warps a program; the online kernel from earlier
# runs of the same probe and suite:
#
#   N        2048/2   4096/4   8192/8   16384/16   online kernel   torch.softmax
#   50257     398.3    366.8    366.5     424.5        481.3           394.2
#   65536     523.1    458.6    446.5     471.1        527.3           683.4
#   262144      -     1861.6   1851.4    1946.3       2172.3          2889.1
#
# 8192 / 8: 75%, 81% and 77% of the copy ceiling at 50257 / 65536 / 262144.
SPLIT_BLOCK = 8192
SPLIT_MAX_BLOCK = 16384
SPLIT_MAX_CHUNKS = 64
SPLIT_COLS_PER_WARP = 1024
# Evict-first loads / stores (each element is used once) were 6% slower at 50257 and 65536
# (H100, a4487fc); not an option any more.
SPLIT_BALANCED = True  # equal chunks per row (scripts/probe_softmax.py compares both)
# Half the block (and warps) where its chunks fill their programs' columns by more than
# this much better: masked-off columns hold registers and occupancy but move no bytes.
# H100, bf16, 4096 rows (95ca12a, probe_softmax.py, balanced chunks): 50257 columns as 13
# programs of 4096 (3872 used, 95%) 347.7 us against 7 of 8192 (7184, 88%) 350.5; where
# both fill their columns (65536, 262144) 8192 stays ahead: 436.5 / 1787.1 us against
# 444.7 / 1835.3. Not for chunks held as int32 pairs: at 50257 columns 7 x 7184 on 8 warps
# took 305.6 us against 346.0 for 13 x 3872 on 4 (32 registers against 48, triton 3.6).
SPLIT_HALF_GAIN = 0.05
# 16-bit chunks are held as int32 pairs of elements (PAIRS; _split_pairs says where):
# 32 registers a thread at 8192 columns / 8 warps instead of 48, so 64 warps an SM in
# flight instead of 40 (triton 3.6, sm_90; 4096 / 4 warps stays at 48 there). H100, bf16,
# 4096 rows (probe_softmax.py, f7cfe82 suite): 50257 columns 305 us against 347 (as 7 x
# 7184: pairs keep the block, see SPLIT_HALF_GAIN), 65536 379 against 430, 131072 779
# against 866, 262144 level (1711 against 1697). FUSEML_SOFTMAX_PAIRS=0 turns it off
# (probes; read at import).
SPLIT_PAIRS = env_flag("FUSEML_SOFTMAX_PAIRS")
# Two -inf of each 16-bit dtype as one int32 (the pairs' masked-off lanes)
_NEG_PAIR = {torch.bfloat16: -0x007F0080, torch.float16: -0x03FF0400}
# (chunks, rows) on two grid axes where the rows fit the second (GRID_Y_MAX), else one
# axis (FUSEML_SOFTMAX_GRID=1d: always, for probes; read at import)
SPLIT_GRID_2D = env_choice("FUSEML_SOFTMAX_GRID", "2d", ("1d", "2d")) == "2d"
# Tried and taken out: a persistent grid of resident programs taking (row, chunk) items in
# turn and loading the next before the wait (scripts/probe_softmax_pipelined.py's scheme,
# in this kernel with 4096-column items, H100, 621f360): 50256 columns 333.6 us against
# 348.8 (aligned rows, a 72-register cap), 65536 425.7 against 431.5, 262144 2013.8
# against ~1790, log_softmax 65536 433.2 against 412.1, and on unaligned rows (50257,
# with the head and tail piece) 346.6 against 346.9: too little for the extra kernel.


# The split kernel's row counters come from a slab zeroed once per device (the kernel
# leaves them at zero): the per-call memset was a launch of its own before every split
# launch (a node in a CUDA graph).
SPLIT_COUNTER_SLAB = 1 << 20  # counters per device (4 MiB)
_split_slab = CounterSlab(SPLIT_COUNTER_SLAB, "the split softmax's row counters")


def split_counters(x2: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``n_rows`` zeroed int32 counters for a split launch on x2's device and current
    stream (CounterSlab). FUSEML_SOFTMAX_COUNTERS=zeros: a fresh zeroed buffer per call
    (probes)."""
    return slab_counters(_split_slab, x2, n_rows, "FUSEML_SOFTMAX_COUNTERS")


def _split_config(x2: torch.Tensor, pairs: bool = False) -> tuple[int, int] | None:
    """(columns a program, programs a row) of the split-row kernel for ``x2``, or None
    where it does not apply (a row that fits one program, or too many programs a row).
    ``pairs``: the chunks are held as int32 pairs (_split_pairs), which keeps the block."""
    n_cols = x2.shape[1]
    if SPLIT_MAX_CHUNKS < 2:  # off
        return None
    block = max(SPLIT_BLOCK, min(SPLIT_MAX_BLOCK, next_pow2(cdiv(n_cols, SPLIT_MAX_CHUNKS))))
    limit = SPLIT_MAX_CHUNKS
    if x2.is_cuda:
        limit = min(limit, sm_count(x2.get_device()) // 2)
    half = block // 2
    if (
        SPLIT_BALANCED
        and not pairs
        and block == SPLIT_BLOCK
        and cdiv(n_cols, half) <= limit
        and _lanes_used(n_cols, half) > _lanes_used(n_cols, block) + SPLIT_HALF_GAIN
    ):
        block = half  # same columns a warp, so half the warps
    chunks = cdiv(n_cols, block)
    return (block, chunks) if 1 < chunks <= limit else None


def _balanced_chunk(n_cols: int, chunks: int) -> int:
    """Columns each of a row's ``chunks`` programs takes when they share it evenly, rounded
    up to 16 so that chunk starts keep 16-byte alignment."""
    return cdiv(cdiv(n_cols, chunks), 16) * 16


def _lanes_used(n_cols: int, block: int) -> float:
    """The fraction of a program's BLOCK_N columns that hold the row (balanced chunks)."""
    return _balanced_chunk(n_cols, cdiv(n_cols, block)) / block


def _split_pairs(x2: torch.Tensor, out2: torch.Tensor) -> bool:
    """Whether the split kernel holds ``x2``'s chunks as int32 pairs (SPLIT_PAIRS): 16-bit
    elements, data 16-byte aligned and rows of x and out lined up, so that every chunk's
    body starts 16-byte aligned in both. Not for fake tensors (torch.compile tracing),
    whose pointers are not known."""
    return (
        SPLIT_PAIRS
        and x2.dtype in _NEG_PAIR
        and type(x2) is torch.Tensor
        and not is_fake(x2)
        and (x2.stride(0) - out2.stride(0)) % 8 == 0  # 16 bytes of 16-bit elements
        and aligned16(x2, out2)
    )


def _launch_split(
    x2: torch.Tensor,
    out2: torch.Tensor,
    config: tuple[int, int],
    log: bool,
    traced: bool,
    pairs: bool = False,
) -> None:
    n_rows, n_cols = x2.shape
    block, chunks = config
    # Balanced: the row's columns shared evenly over its programs (rounded up to 16, so
    # that chunk starts keep 16-byte alignment), rather than `block` each and the rest to
    # the last one (50257 = 6 x 8192 + 1105: one program in seven nearly idle). CHUNK is a
    # constexpr, so each long-row width compiles its own kernel: as a runtime argument
    # the kernel took 58 registers instead of 48 (4 blocks per SM, not 5; offline, sm_90).
    chunk_cols = min(block, _balanced_chunk(n_cols, chunks)) if SPLIT_BALANCED else block
    vec = 16 // x2.element_size()
    aligned = (x2.stride(0) - out2.stride(0)) % vec == 0  # rows of x and out line up
    stats = torch.empty((n_rows, chunks, 2), dtype=torch.float32, device=x2.device)
    count = split_counters(x2, n_rows)
    kernel = torch.library.wrap_triton(_softmax_split_kernel) if traced else _softmax_split_kernel
    # The interpreter runs one program after another, so a program cannot wait for the
    # next: there the statistics and the output are two launches.
    # (chunks, rows) on two grid axes where the rows fit the second (65535): blocks start
    # in the same order as on one axis, and a program finds its row and chunk without a
    # division (see the elementwise kernel's 2-D tiles)
    grid2d = SPLIT_GRID_2D and type(n_rows) is int and n_rows <= GRID_Y_MAX
    grid = (chunks, n_rows) if grid2d else (n_rows * chunks,)
    for phase in (1, 2) if triton_interpreting() else (0,):
        kernel[grid](
            x2, out2, stats, count, n_cols, x2.stride(0), out2.stride(0), chunks,
            LOG=log, BLOCK_N=block, CHUNK=chunk_cols, BLOCK_G=next_pow2(chunks),
            VEC=vec if aligned else 1,
            PHASE=phase, FAST=fast_math(x2), GRID2D=grid2d,
            PAIRS=pairs, NEG_PAIR=_NEG_PAIR[x2.dtype] if pairs else 0, sixteen=16,
            num_warps=max(1, min(16, block // SPLIT_COLS_PER_WARP)), **_pdl_options(x2, traced),
        )  # fmt: skip


# Strided (non-last dim) kernel: tiles of at most STRIDED_TILE elements; one pass when the
# whole softmax dim fits in one tile.
STRIDED_TILE = 4096
STRIDED_ONE_PASS = 8192


def _launch_strided(x3: torch.Tensor, out3: torch.Tensor, log: bool, traced: bool) -> None:
    """Softmax over dim 1 of (outer, N, inner) views; out3 contiguous."""
    outer, n_red, n_inner = x3.shape
    block_i = min(next_pow2(n_inner), 128 if x3.element_size() == 2 else 64)
    one_pass = next_pow2(n_red) * block_i <= STRIDED_ONE_PASS
    block_n = next_pow2(n_red) if one_pass else max(1, STRIDED_TILE // block_i)
    grid = (outer * cdiv(n_inner, block_i),)
    kernel = (
        torch.library.wrap_triton(_softmax_strided_kernel) if traced else _softmax_strided_kernel
    )
    kernel[grid](
        x3, out3, n_red, n_inner, x3.stride(0), x3.stride(1), x3.stride(2),
        LOG=log, ONE_PASS=one_pass, BLOCK_N=block_n, BLOCK_I=block_i, FAST=fast_math(x3),
        num_warps=8 if block_n * block_i > STRIDED_TILE else 4, **_pdl_options(x3, traced),
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


def _forward(x: torch.Tensor, dim: int, log: bool, impl: str, traced: bool) -> torch.Tensor:
    """Softmax along ``dim`` with the Triton or CUDA kernels; output contiguous."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dim == x.dim() - 1 and x.is_contiguous():
        # The common case, with the fewest host-side tensor operations: the eager path's
        # per-call cost is what small softmaxes are made of.
        n = x.shape[-1]
        out = torch.empty_like(x)
        if not launches_skipped():
            _dispatch(x.view(-1, n), out.view(-1, n), log, impl, traced)
        return out
    if impl == "triton" and x.dim() > 0 and dim < x.dim() - 1:
        x3 = _three_dim_view(x, dim)
        if x3 is not None:  # no transposing copy: reduce down the strided dim in place
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            if not launches_skipped():
                _launch_strided(x3, out.view(x3.shape), log, traced)
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
    _dispatch(x2, out_moved.view(-1, moved.shape[-1]), log, impl, traced)
    return out.contiguous() if x.dim() else out


def _dispatch(x2: torch.Tensor, out2: torch.Tensor, log: bool, impl: str, traced: bool) -> None:
    if impl == "cuda":
        _cuda_ext.require("log_softmax" if log else "softmax")
        torch.ops.fuseml.softmax_cuda_out(x2, log, out2)
    elif x2.shape[1] <= MAX_ONCHIP_COLS:
        _launch_rows(x2, out2, log, traced)
    elif config := _split_config(x2, pairs := _split_pairs(x2, out2)):
        _launch_split(x2, out2, config, log, traced, pairs)
    else:
        _launch_online(x2, out2, log, traced)


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
