"""Softmax of rows too long to hold on chip in one program.

Split: a row is split over several programs that each hold a chunk in registers and
exchange their chunks' (max, sum) through a small scratch buffer (still one read and one
write). Online: past the split kernel's reach a row is streamed twice (statistics with a
running max and sum, then the output)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from fuseml.ops._math import LOG2E, _exp2, _pdl_begin, _rcp
from fuseml.ops._utils import (
    GRID_Y_MAX,
    CounterSlab,
    aligned16,
    cdiv,
    fast_math,
    next_pow2,
    pdl_launch,
    slab_counters,
    sm_count,
)
from fuseml.runtime import env_choice, env_flag, triton_interpreting


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
