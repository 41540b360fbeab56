"""Softmax of rows that fit on chip: each row is loaded once into registers, reduced and
written once. One program per row (or per tile of short rows); for the longest such rows a
persistent grid sized from the compiled kernel's register and shared-memory use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

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
