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
    sm_count,
)
from fuseml.runtime import triton_interpreting


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
    # however long the row. A program takes rows pid, pid + grid, ... (the grid may be
    # smaller than the rows).
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
        # aligned and every chunk at a multiple of 16 elements, so pairs never straddle.
        # The chunk's start goes into the scalar pointers and its length into a scalar
        # bound, so that the lanes' addresses are one base plus constants (with the start
        # in the offsets the kernel took 48 registers a thread instead of 32).
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
            # 16 in the last), so that the compiler cannot merge the unpacks and keep the
            # float32 values live from one pass to the next (one shared unpack doubled
            # the registers a thread, to 64).
            lo, hi = _pairs_f32(v, 16, DT)
            m = tl.maximum(tl.max(tl.maximum(lo, hi), axis=0), tl.max(x_edge, axis=0))
        else:
            m = tl.maximum(tl.max(x, axis=0), tl.max(x_edge, axis=0))
        shift = tl.where(m == -float("inf"), 0.0, m)  # an all -inf chunk: sum 0, not NaN
        # tl.exp here, not _exp2: the one-instruction exp2 in this phase costs registers
        # (64 a thread instead of 48: one block of 8 warps less per SM); in the output
        # phase it costs none.
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
            # v | z as well costs registers, 48 a thread instead of 32-36)
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


# ------------------------------------------------------------------------- online
# Online kernel: 16384 columns a step on 16 warps (against 4096 on 8: 527 against 551 us
# at 65536 bf16 columns, 4096 rows, H100); rows that the step does not divide take half
# of it, so that less of the last step is masked off. One program a row: a smaller,
# persistent grid was never faster. No software pipelining of the column loops: it made
# no difference. docs/performance/softmax.md has the sweeps.
ONLINE_BLOCK = 16384
ONLINE_WARPS = 16
ONLINE_STAGES = 1


def _pdl_options(x: torch.Tensor, traced: bool) -> dict:
    """A kernel's PDL constexpr and launch option for a launch on x (see pdl_launch). Off,
    the constexpr is still passed (torch.compile's wrap_triton takes no defaulted
    arguments) and no launch option (a traced launch takes none)."""
    return {"PDL": True, "launch_pdl": True} if pdl_launch(x, traced) else {"PDL": False}


def _online_block(n_cols: int, full: int = ONLINE_BLOCK) -> int:
    """Columns per step of the online kernel for rows of ``n_cols``: ``full`` where it
    divides the row, else half of it."""
    block = full if n_cols % full == 0 else full // 2 or 1
    return min(block, next_pow2(n_cols))


def _launch_online(
    x2: torch.Tensor,
    out2: torch.Tensor,
    log: bool,
    traced: bool,
    block: int | None = None,
    persistent: bool = False,
) -> None:
    """The online kernel over the rows of x2 -> out2: one program a row, or with
    ``persistent`` one a streaming multiprocessor (one on the CPU), each taking rows in
    turn. ``block``: columns a step instead of ONLINE_BLOCK (tests)."""
    n_rows, n_cols = x2.shape
    grid = n_rows
    if persistent:
        grid = min(n_rows, sm_count(x2.get_device()) if x2.is_cuda else 1)
    kernel = torch.library.wrap_triton(_softmax_online_kernel) if traced else _softmax_online_kernel
    kernel[(grid,)](
        x2, out2, n_rows, n_cols, x2.stride(0), out2.stride(0),
        LOG=log, BLOCK_N=_online_block(n_cols, block or ONLINE_BLOCK), FAST=fast_math(x2),
        NUM_STAGES=ONLINE_STAGES, num_warps=ONLINE_WARPS, **_pdl_options(x2, traced),
    )  # fmt: skip


# -------------------------------------------------------------------------- split
# Split kernel (rows longer than the on-chip kernel takes): SPLIT_BLOCK columns a program
# on one warp per SPLIT_COLS_PER_WARP columns; longer chunks (up to SPLIT_MAX_BLOCK) where
# a row would need more than SPLIT_MAX_CHUNKS programs, and never more than half the SMs'
# worth (a row's programs wait for each other: they must all be resident at once). Longer
# rows take the online kernel. 8192 columns on 8 warps reach 75-81% of the copy
# bandwidth from 50257 to 262144 columns (H100, bf16); docs/performance/softmax.md.
SPLIT_BLOCK = 8192
SPLIT_MAX_BLOCK = 16384
SPLIT_MAX_CHUNKS = 64
SPLIT_COLS_PER_WARP = 1024
# A row's columns are shared evenly over its programs (rounded up to 16 to keep chunk
# starts 16-byte aligned), and the block is halved (with its warps) where the halved
# chunks fill their programs' columns better by more than SPLIT_HALF_GAIN: masked-off
# columns hold registers and occupancy but move no bytes (50257 columns: 13 programs of
# 4096 use 95% of their columns, 7 of 8192 88%). Chunks held as int32 pairs keep the
# block: they need half the registers, so 8 warps of 8192 columns stay ahead.
SPLIT_HALF_GAIN = 0.05
# 16-bit chunks are held as int32 pairs of elements where _split_pairs allows (PAIRS):
# half the registers of float32 values, so more warps an SM in flight (bf16 65536
# columns: 379 against 430 us, H100).
_NEG_PAIR = {torch.bfloat16: -0x007F0080, torch.float16: -0x03FF0400}  # two -inf as int32

# The split kernel's row counters come from a slab zeroed once per device (the kernel
# leaves them at zero): a per-call memset would be a launch of its own before every split
# launch (a node in a CUDA graph).
SPLIT_COUNTER_SLAB = 1 << 20  # counters per device (4 MiB)
_split_slab = CounterSlab(SPLIT_COUNTER_SLAB, "the split softmax's row counters")


def split_counters(x2: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``n_rows`` zeroed int32 counters for a split launch on x2's device and current
    stream, from the slab (CounterSlab), else (CPU, torch.compile tracing, a spent slab)
    a fresh zeroed buffer."""
    if x2.is_cuda and not is_fake(x2):
        piece = _split_slab.take(x2, n_rows)
        if piece is not None:
            return piece
    return torch.zeros(n_rows, dtype=torch.int32, device=x2.device)


def _split_config(
    x2: torch.Tensor, pairs: bool = False, block: int | None = None
) -> tuple[int, int] | None:
    """(columns a program, programs a row) of the split-row kernel for ``x2``, or None
    where it does not apply (a row that fits one program, or too many programs a row).
    ``pairs``: the chunks are held as int32 pairs (_split_pairs), which keeps the block.
    ``block``: the columns a program instead of SPLIT_BLOCK (tests, at small sizes)."""
    n_cols = x2.shape[1]
    base = block or SPLIT_BLOCK
    block = max(base, min(SPLIT_MAX_BLOCK, next_pow2(cdiv(n_cols, SPLIT_MAX_CHUNKS))))
    limit = SPLIT_MAX_CHUNKS
    if x2.is_cuda:
        limit = min(limit, sm_count(x2.get_device()) // 2)
    half = block // 2
    if (
        not pairs
        and block == base
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
    """Whether the split kernel can hold ``x2``'s chunks as int32 pairs: 16-bit elements,
    data 16-byte aligned and rows of x and out lined up, so that every chunk's body starts
    16-byte aligned in both. Not for fake tensors (torch.compile tracing), whose pointers
    are not known."""
    return (
        x2.dtype in _NEG_PAIR
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
    grid2d: bool = True,
) -> None:
    """The split kernel with ``config`` (see _split_config) over x2 -> out2; ``grid2d``
    False puts (row, chunk) on one grid axis, as for more rows than the second takes."""
    n_rows, n_cols = x2.shape
    block, chunks = config
    # CHUNK is a constexpr, so each long-row width compiles its own kernel: as a runtime
    # argument it cost registers (58 a thread instead of 48: one block an SM less).
    chunk_cols = min(block, _balanced_chunk(n_cols, chunks))
    vec = 16 // x2.element_size()
    aligned = (x2.stride(0) - out2.stride(0)) % vec == 0  # rows of x and out line up
    stats = torch.empty((n_rows, chunks, 2), dtype=torch.float32, device=x2.device)
    count = split_counters(x2, n_rows)
    kernel = torch.library.wrap_triton(_softmax_split_kernel) if traced else _softmax_split_kernel
    # (chunks, rows) on two grid axes where the rows fit the second (65535): blocks start
    # in the same order as on one axis, and a program finds its row and chunk without a
    # division (see the elementwise kernel's 2-D tiles)
    grid2d = grid2d and type(n_rows) is int and n_rows <= GRID_Y_MAX
    grid = (chunks, n_rows) if grid2d else (n_rows * chunks,)
    # The interpreter runs one program after another, so a program cannot wait for the
    # next: there the statistics and the output are two launches.
    for phase in (1, 2) if triton_interpreting() else (0,):
        kernel[grid](
            x2, out2, stats, count, n_cols, x2.stride(0), out2.stride(0), chunks,
            LOG=log, BLOCK_N=block, CHUNK=chunk_cols, BLOCK_G=next_pow2(chunks),
            VEC=vec if aligned else 1,
            PHASE=phase, FAST=fast_math(x2), GRID2D=grid2d,
            PAIRS=pairs, NEG_PAIR=_NEG_PAIR[x2.dtype] if pairs else 0, sixteen=16,
            num_warps=max(1, min(16, block // SPLIT_COLS_PER_WARP)), **_pdl_options(x2, traced),
        )  # fmt: skip


# ----------------------------------------------------------------------- path choice
LONG_ROW_PATHS = ("split", "split-1d", "online", "online-persistent")


def launch_long_rows(
    x2: torch.Tensor,
    out2: torch.Tensor,
    log: bool,
    traced: bool,
    *,
    path: str = "split",
    block: int | None = None,
    split: tuple[int, int] | None = None,
    pairs: bool = True,
) -> None:
    """Softmax of long rows x2 -> out2: the split kernel where _split_config allows, else
    the online kernel.

    The keywords force a kernel where a test must (the defaults are the library's rule):
    ``path`` one of LONG_ROW_PATHS ("split-1d": the split kernel on one grid axis;
    "online": the online kernel whatever the width; "online-persistent": the same on one
    program an SM); ``block`` the columns of a split chunk and of an online step, so that
    short rows take several; ``split`` a fixed (columns, programs) a row; ``pairs`` False
    keeps 16-bit chunks as float32 values.
    """
    if path not in LONG_ROW_PATHS:
        raise ValueError(f"path must be one of {LONG_ROW_PATHS}, got {path!r}")
    if path in ("split", "split-1d"):
        pairs = pairs and _split_pairs(x2, out2)
        config = split or _split_config(x2, pairs, block)
        if config:
            _launch_split(x2, out2, config, log, traced, pairs, grid2d=path == "split")
            return
    _launch_online(x2, out2, log, traced, block, persistent=path == "online-persistent")
