"""Softmax of rows that fit on chip: each row is loaded once into registers, reduced and
written once. One program per row (or per tile of short rows); for the longest such rows a
persistent grid sized from the compiled kernel's register and shared-memory use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from fuseml.ops import _fastcall
from fuseml.ops._math import LOG2E, _exp2, _pdl_begin, _rcp
from fuseml.ops._utils import (
    CompiledLaunches,
    aligned16,
    cdiv,
    fast_math,
    int_spec,
    next_pow2,
    pdl_launch,
    sm_count,
    vec_width,
)
from fuseml.runtime import triton_interpreting


# One read and one write of every element: the row (or a tile of short rows) is loaded
# into registers, reduced, and written.
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


# ---------------------------------------------------------------------- launch configs
# Rows up to this many columns stay in registers (one program per row, 8-16 warps): 32768
# columns = 128 KiB of fp32 per row, half of an H100/H200 SM's register file.
MAX_ONCHIP_COLS = 32768

# Short rows (under 1024 columns): ROWS rows a program, so that each thread of its 4 warps
# holds one 16-byte vector of the tile (SHORT_TILE_BYTES a program: 8 x 128 bf16, 4 x 128
# fp32, ..., 1 x 512 fp32), as the flat elementwise path does (bf16 4096 x 128: 2.87 us
# against 3.20 for 4 KiB tiles, H100, graph replay). From 1024 columns one row a program.
# A tile of one row (float32 512) would leave one warp to a program: it takes
# SHORT_PAIR_ROWS rows on SHORT_PAIR_WARPS warps with 2 stages instead, and launches
# without PDL (PDL_MIN_WARPS). docs/performance/softmax.md has the sweeps.
SHORT_TILE_BYTES = 2048
MAX_ROWS = 16
SHORT_PAIR_ROWS = 2
SHORT_PAIR_WARPS = 2
# Stages: a program of the non-persistent grid takes one row block, so its row loop runs
# once and software pipelining only adds code: one stage. Row tiles of
# TWO_STAGE_MIN_BYTES or more (float32 16384) take 2 all the same: with one stage that
# kernel takes more registers (70 a thread against 60), so one program an SM fits
# instead of two (132 against 152 us, H200).
TWO_STAGE_MIN_BYTES = 64 * 1024

# Grid: one program per ROWS rows below PERSISTENT_MIN_BLOCK columns (2-5% faster there);
# from there the occupancy-sized persistent grid, rows looped inside each program and the
# next row's load pipelined through shared memory PERSISTENT_STAGES deep (bf16 4096 x
# 32768: 195 against 205 us, H100). Where shared memory caps the stages below that
# (float32 at 32768 columns: 2 on an H100 / H200) one program per row with one stage is
# faster.
PERSISTENT_MIN_BLOCK = 32768
PERSISTENT_STAGES = 3

# Warps from 1024 columns: one per 512 columns (16 values a thread), up to 16; float32
# rows take at least FP32_MIN_WARPS, and rows of a 4096-wide block (2049-4096 columns)
# WARPS_4096, 32 values a thread (bf16 4096 x 3000: 16.7 against 17.1 us on 8, H100).
FP32_MIN_WARPS = 4
WARPS_4096 = 4

# Shared memory: the pipelined row loop keeps NUM_STAGES - 1 row tiles (ROWS x BLOCK_N
# elements each) in flight in shared memory, beside Triton's own scratch (64 bytes on
# sm_90). Stages are capped so that the tiles fit the device's shared memory per block
# less SMEM_RESERVE: float32 rows of 32768 columns (128 KiB a tile) get 2 on an H100 /
# H200 (227 KiB a block), and so take one program per row instead of the persistent grid.
SMEM_RESERVE = 1024

# Under programmatic dependent launch (pdl_launch) a grid's programs are resident and
# waiting before the kernel ahead of them ends; where that kernel does not take part
# (torch's own), many one-row programs of 1 or 2 warps cost more than a plain launch
# (1.4 us at 4096 rows, against 0.2-0.4 for programs of 4 warps or more). So under PDL
# one-row programs of fewer than PDL_MIN_WARPS warps (16-bit 1024) take two rows and
# twice the warps, and programs still under PDL_MIN_WARPS warps (float32 512's pairs)
# launch without it.
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
    args = (x2, out2, *ints, *consts)
    ck = _rows_launches(grid, key, aligned16(x2, out2), args, options)
    if ck is not None:
        _fastcall.register(
            _fastcall.SOFTMAX_ROWS, int(log), x2, None, None, out2, 1.0, ck, grid, options, args
        )


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
