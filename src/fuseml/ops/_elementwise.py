"""The fused elementwise epilogue shared by ``add``, ``gelu`` and ``bias_act``.

    out = act(x + bias + alpha * y)        computed in float32, rounded once

``add`` is the case (bias=None, alpha=1, act=none) and ``gelu`` the case (bias=None,
y=None, act=gelu). One Triton kernel and one CUDA C++ kernel serve all three, so the three
ops cannot drift apart; each op's file holds its reference, validation and registration.

Layouts. When every operand is dense with the same strides (contiguous, or the same
permutation of a dense block) and there is no bias, the kernel walks the storage as one
flat vector, and the output keeps that layout (like ``torch.empty_like``). Otherwise the
operands become (M, N) views with unit column stride and a per-operand row stride (a copy
only when no such view exists), and the bias is broadcast along rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuseml import _cuda_ext
from fuseml.ops import _fastcall
from fuseml.ops._activations import (  # noqa: F401 (the ops import the names from here)
    ACT_CODE,
    ACTIVATIONS,
    LEAKY_SLOPE,
    _activation,
    _activation_grad,
)
from fuseml.ops._math import _pdl_begin
from fuseml.ops._utils import (
    GRID_Y_MAX,
    CompiledLaunches,
    aligned16,
    as_rows,
    cdiv,
    fast_math,
    flat_storage_view,
    int_spec,
    is_dense,
    launches_skipped,
    next_pow2,
    pdl_launch,
    rows_view,
    vec_width,
)

_INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _tile(
    n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRID2D: tl.constexpr,
    WIDE: tl.constexpr,
):  # fmt: skip
    """Row and column offsets and the bounds mask of this program's tile. GRID2D: the grid
    is (column blocks, row blocks), so the tile needs no division of the program id (a
    software divide of ~25 instructions ahead of the first load); else one axis in
    row-major tile order. WIDE: int64 offsets (element offsets past int32), else int32
    (fewer instructions ahead of the first load: a tensor of one wave of programs is
    about one program's latency long)."""
    if GRID2D:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
        pid_m = pid // n_col_blocks
        pid_n = pid - pid_m * n_col_blocks
    if WIDE:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows, cols, mask


@triton.jit
def _load_pre(
    x_ptr, y_ptr, bias_ptr, rows, cols, mask, n_cols, stride_xm, stride_ym, alpha,
    HAS_Y: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """h = x + bias + alpha * y in float32 for one tile."""
    h = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
        h = h + b[None, :]
    if HAS_Y:
        y = tl.load(y_ptr + rows[:, None] * stride_ym + cols[None, :], mask=mask)
        # alpha arrives as fp32 from a direct launch but as fp64 from torch.compile, which
        # would silently promote the whole epilogue to fp64: pin it to fp32.
        h = h + tl.cast(alpha, tl.float32) * y.to(tl.float32)
    return h


@triton.jit
def _bias_act_kernel(
    x_ptr,  # (M, N) input, unit column stride
    y_ptr,  # (M, N) second operand (residual), unused unless HAS_Y
    bias_ptr,  # (N,) contiguous bias, unused unless HAS_BIAS
    out_ptr,  # (M, N) output, unit column stride; may be x itself (in place)
    n_rows,  # M (1 on the flat path)
    n_cols,  # N (all elements on the flat path)
    stride_xm,  # row strides, in elements
    stride_ym,
    stride_om,
    alpha,  # float32 scale of y
    HAS_Y: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # code from ACTIVATIONS
    BLOCK_M: tl.constexpr,  # rows per tile (1 on the flat path)
    BLOCK_N: tl.constexpr,  # columns per tile
    FAST: tl.constexpr,  # single-instruction exp2 / reciprocal (compiled CUDA launches)
    VEC: tl.constexpr,  # elements in 16 bytes where n_cols and the row strides are
    # multiples of it (the launcher checks), else 1
    FLAT: tl.constexpr = False,  # one packed run of n_cols elements (n_rows == 1)
    WIDE: tl.constexpr = True,  # offsets past int32: int64 index arithmetic (launcher)
    GRID2D: tl.constexpr = False,  # 2-D path: a (column blocks, row blocks) grid (_tile)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
):
    if PDL:
        _pdl_begin()
    if VEC > 1:
        # Widths like 1000 are not multiples of 16, so Triton's own specialisation cannot
        # tell that rows start on 16-byte boundaries and that masks change only between
        # vectors: every access would be one element wide. The launcher checked that these
        # are multiples of VEC, so (v // VEC) * VEC == v, and Triton's analysis sees that.
        n_cols = (n_cols // VEC) * VEC
        stride_xm = (stride_xm // VEC) * VEC
        stride_ym = (stride_ym // VEC) * VEC
        stride_om = (stride_om // VEC) * VEC
    if FLAT:
        # The first load depends only on the program id: no tile division (a 25-instruction
        # software divide on the critical path of every program) and int32 offsets unless
        # the tensor needs more.
        pid = tl.program_id(0)
        if WIDE:
            pid = pid.to(tl.int64)
        offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs < n_cols
        h = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        if HAS_Y:
            y = tl.load(y_ptr + offs, mask=mask)
            h = h + tl.cast(alpha, tl.float32) * y.to(tl.float32)
        out = _activation(h, ACTIVATION, FAST)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N, GRID2D, WIDE)
        h = _load_pre(
            x_ptr, y_ptr, bias_ptr, rows, cols, mask, n_cols, stride_xm, stride_ym, alpha,
            HAS_Y, HAS_BIAS,
        )  # fmt: skip
        out = _activation(h, ACTIVATION, FAST)
        offs = rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_backward_kernel(
    grad_ptr,  # (M, N) upstream gradient, unit column stride
    x_ptr,  # (M, N) forward input
    y_ptr,  # (M, N) forward residual, unused unless HAS_Y
    bias_ptr,  # (N,) forward bias, unused unless HAS_BIAS
    dh_ptr,  # (M, N) output: grad * act'(x + bias + alpha * y)
    n_rows,
    n_cols,
    stride_gm,  # row strides, in elements
    stride_xm,
    stride_ym,
    stride_dm,
    alpha,
    HAS_Y: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FAST: tl.constexpr,
    GRID2D: tl.constexpr = False,  # see _tile
):
    # Recomputes h instead of saving it: one extra read of x (and y) but no forward store
    # of an fp32 pre-activation, which is the better trade for inference-first kernels.
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N, GRID2D, True)
    h = _load_pre(
        x_ptr, y_ptr, bias_ptr, rows, cols, mask, n_cols, stride_xm, stride_ym, alpha,
        HAS_Y, HAS_BIAS,
    )  # fmt: skip
    g = tl.load(grad_ptr + rows[:, None] * stride_gm + cols[None, :], mask=mask).to(tl.float32)
    dh = g * _activation_grad(h, ACTIVATION, FAST)
    offs = rows[:, None] * stride_dm + cols[None, :]
    tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------- launch configs
# Flat path: one 16-byte vector a thread on 4 warps (TILE_BYTES a program: 512 fp32 or
# 1024 16-bit elements), the best or within 1% of the best tile from 1M to 268M elements
# (bf16 GELU at 268M: 355.7 against 362.0 us for 8 KiB tiles, H100).
# 2-D path (a bias, or rows with gaps): TILE_BYTES_2D an operand, 16-bit on 8 warps (one
# 16-byte vector a thread), within 3% of the best of 2-16 KiB x 2-8 warps. Its programs
# sit on two grid axes, (column blocks, row blocks), in the row-major order one axis would
# give them but with no divide of the program id (see _tile); more row blocks than the
# second axis takes (GRID_Y_MAX) go on one axis. docs/performance/elementwise.md.
TILE_BYTES = 2048
NUM_WARPS = 4
TILE_BYTES_2D = 4096
NUM_WARPS_2D = {4: 4, 2: 8}
# Flat path without an activation (add) from HALF_PACK_MIN_NUMEL elements: the same tile on
# twice the warps, 8 bytes a thread (bf16 add at 16M: 35.1 against 35.6 us, H100). Not
# below (no winner within 1%), nor for erf-GELU, whose ~23 instructions an element lose
# 4-6% on 8 warps.
HALF_PACK_MIN_NUMEL = 1 << 24
# Flat path with a transcendental activation (GELU, GELU-tanh, SiLU, sigmoid, tanh) from
# WIDE_FLAT_MIN_NUMEL elements: 4 KiB tiles on 8 warps, one 16-byte vector a thread in
# programs of twice the threads (fp32 GELU-tanh at 4M: 10.3 against 11.2 us, H100). At 1M
# the wider tile loses. SiLU, sigmoid and tanh take it by analogy (one exp2 and one
# reciprocal an element, as GELU-tanh).
WIDE_FLAT_MIN_NUMEL = 1 << 22
WIDE_FLAT_ACTIVATIONS = (3, 4, 5, 6, 7)
WIDE_TILE_BYTES = 4096
WIDE_FLAT_WARPS = 8
# 2-D path from HALF_PACK_2D_MIN_BYTES an operand, activations of a few instructions
# (none, ReLU, leaky ReLU): 2 KiB tiles on 8 warps, 8 bytes a thread, as torch.compile
# tunes its flat kernel there (fp32 bias + residual + ReLU 524288 x 512: 1043 against
# 1060 us for the 4 KiB tile, H100). Not for erf-GELU, which loses there as on the flat
# path.
HALF_PACK_2D_MIN_BYTES = 1 << 27
HALF_PACK_2D_ACTIVATIONS = (0, 1, 2)
HALF_TILE_BYTES_2D = 2048
HALF_PACK_2D_WARPS = 8


def launch_config(
    n_rows: int,
    n_cols: int,
    elem_size: int,
    activation: int | None = None,
    *,
    half_pack: bool | None = None,
    one_axis: bool = False,
) -> dict:
    """BLOCK_M, BLOCK_N, num_warps and the grid for an (n_rows, n_cols) problem
    (``activation``: its code, where it changes the launch; see HALF_PACK_MIN_NUMEL).

    ``half_pack`` forces the 2-D path's 8-bytes-a-thread tiles on (True) or off (False)
    whatever the size and activation (None: the rule, HALF_PACK_2D_MIN_BYTES);
    ``one_axis`` puts a 2-D launch on one grid axis, as for more row blocks than the
    second axis takes. Both for tests, passed to the launcher as its ``config``.

    Cached for concrete sizes: it runs on every call, and the eager launch path is worth
    every microsecond (symbolic sizes under torch.compile are not hashable).
    """
    if type(n_rows) is int and type(n_cols) is int:
        return _cached_config(n_rows, n_cols, elem_size, activation, half_pack, one_axis)
    return _config(n_rows, n_cols, elem_size, activation, half_pack, one_axis)


def _config(
    n_rows, n_cols, elem_size: int, activation=None, half_pack=None, one_axis=False
) -> dict:
    if n_rows == 1:
        block_n = min(TILE_BYTES // elem_size, next_pow2(n_cols))
        block_m = 1
        warps = NUM_WARPS
        if activation == 0 and n_cols >= HALF_PACK_MIN_NUMEL:
            warps = 2 * NUM_WARPS
        elif activation in WIDE_FLAT_ACTIVATIONS and n_cols >= WIDE_FLAT_MIN_NUMEL:
            block_n = min(WIDE_TILE_BYTES // elem_size, next_pow2(n_cols))
            warps = WIDE_FLAT_WARPS
    else:
        tile = TILE_BYTES_2D // elem_size
        warps = NUM_WARPS_2D[min(elem_size, 4)]
        if half_pack is None:
            half_pack = (
                activation in HALF_PACK_2D_ACTIVATIONS
                and n_rows * n_cols * elem_size >= HALF_PACK_2D_MIN_BYTES
            )
        if half_pack:
            tile, warps = HALF_TILE_BYTES_2D // elem_size, HALF_PACK_2D_WARPS
        block_n = min(next_pow2(n_cols), tile)
        block_m = min(max(1, tile // block_n), next_pow2(n_rows))
    row_blocks, col_blocks = cdiv(n_rows, block_m), cdiv(n_cols, block_n)
    if type(n_rows) is int and n_rows > 1 and not one_axis and row_blocks <= GRID_Y_MAX:
        grid = (col_blocks, row_blocks)
    else:
        grid = (row_blocks * col_blocks,)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "grid": grid}


_cached_config = functools.lru_cache(maxsize=4096)(_config)


# ----------------------------------------------------------------------------- launcher
def _same_layout(ref: torch.Tensor, *others: torch.Tensor | None) -> bool:
    return all(t is None or t.stride() == ref.stride() for t in others)


def bias_act_into(
    out: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    activation: int,
    *,
    impl: str = "triton",
    traced: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """Write act(x + bias + alpha * y) into ``out`` (same shape as x; may be x itself).

    Inputs must already be validated. ``traced`` routes Triton launches through
    ``torch.library.wrap_triton`` (inside a registered op, so torch.compile sees the
    kernel); direct launches skip that wrapper's cost. ``config`` (a launch_config
    dict) overrides the heuristic launch configuration (tests).
    """
    numel = x.numel()
    if numel == 0:
        return out
    if bias is None and is_dense(x) and _same_layout(x, y, out):
        # One flat pass over the storage block: no per-row index arithmetic. Triton only
        # needs the base pointers, which are the block starts; the C++ op takes 2-D views.
        xs, ys, outs = x, y, out
        if impl == "cuda":
            xs, outs = flat_storage_view(x).view(1, -1), flat_storage_view(out).view(1, -1)
            ys = None if y is None else flat_storage_view(y).view(1, -1)
        _launch(outs, xs, ys, None, alpha, activation, impl, traced, config, 1, numel, 0, 0, 0)
        return out
    xs = as_rows(x)
    ys = None if y is None else as_rows(y)
    bs = None if bias is None else bias.contiguous()
    outs = rows_view(out)
    target = outs
    if outs is None:  # an output with no (M, N) view: compute, then copy into place
        target = torch.empty(xs.shape, dtype=out.dtype, device=out.device)
    n_rows, n_cols = xs.shape
    _launch(
        target, xs, ys, bs, alpha, activation, impl, traced, config,
        n_rows, n_cols, xs.stride(0), 0 if ys is None else ys.stride(0), target.stride(0),
    )  # fmt: skip
    if outs is None:
        out.copy_(target.view(out.shape))
    return out


def _launch(
    out, x, y, bias, alpha, activation, impl, traced, config,
    n_rows, n_cols, stride_x, stride_y, stride_out,
) -> None:  # fmt: skip
    if launches_skipped():
        return
    if impl == "cuda":
        _cuda_ext.require("bias_act")
        torch.ops.fuseml.bias_act_cuda_out(x, y, bias, float(alpha), activation, out)
        return
    args_tail = (n_rows, n_cols, stride_x, stride_y, stride_out, float(alpha))
    ptrs = (x, x if y is None else y, x if bias is None else bias, out)
    if traced:
        grid, consts, warps = _plan(
            x.element_size(), fast_math(x), n_rows, n_cols, stride_x, stride_y, stride_out,
            y is not None, bias is not None, activation, False, config,
        )  # fmt: skip
        kernel = torch.library.wrap_triton(_bias_act_kernel)
        kernel[grid](*ptrs, *args_tail, *consts, num_warps=warps)
        return
    # Repeat launches through the compiled kernel's own launcher (host time: see
    # CompiledLaunches); x, y, bias and out share x's dtype (validated). The plan (grid,
    # constexprs, specialization key) is cached per dtype, sizes, strides and flags.
    flags = (x.dtype, fast_math(x), n_rows, n_cols, stride_x, stride_y, stride_out)
    pdl = pdl_launch(x)
    flags += (y is not None, bias is not None, activation, pdl)
    grid, consts, warps, key = _direct_plan(*flags) if config is None else _key(*flags, config)
    options = {"num_warps": warps, "launch_pdl": True} if pdl else {"num_warps": warps}
    args = (*ptrs, *args_tail, *consts)
    ck = _bias_act_launches(grid, key, aligned16(x, y, bias, out), args, options)
    if ck is not None and config is None:  # (a heuristic plan: what later calls would get)
        _fastcall.register(
            _fastcall.ELEMENTWISE, activation, x, y, bias, out, alpha, ck, grid, options, args
        )


def _plan(
    elem_size, fast, n_rows, n_cols, stride_x, stride_y, stride_out, has_y, has_bias,
    activation, pdl, config=None,
) -> tuple[tuple, tuple, int]:  # fmt: skip
    """(grid, the kernel's constexprs in order, num_warps) of one launch (pdl: the
    kernel's PDL, for a launch with launch_pdl)."""
    cfg = config or launch_config(n_rows, n_cols, elem_size, activation)
    grid = cfg.get("grid") or (cdiv(n_rows, cfg["BLOCK_M"]) * cdiv(n_cols, cfg["BLOCK_N"]),)
    flat = n_rows == 1 and not has_bias and cfg["BLOCK_M"] == 1
    wide = True  # int64 offsets unless the sizes are known to stay within int32
    sizes = (n_rows, n_cols, stride_x, stride_y, stride_out)
    if all(type(v) is int for v in sizes):  # (symbolic sizes would be guarded on)
        if flat:  # the last program's offsets reach n_cols + BLOCK_N
            span = n_cols + cfg["BLOCK_N"]
        else:  # its rows reach the last row block's end, its columns n_cols + BLOCK_N
            rows_end = cdiv(n_rows, cfg["BLOCK_M"]) * cfg["BLOCK_M"]
            span = rows_end * max(sizes[1:]) + n_cols + cfg["BLOCK_N"]
        wide = span > _INT32_MAX
    consts = (
        has_y, has_bias, activation, cfg["BLOCK_M"], cfg["BLOCK_N"], fast,
        vec_width(elem_size, n_cols, stride_x, stride_y, stride_out), flat, wide,
        len(grid) == 2, pdl,
    )  # fmt: skip
    return grid, consts, cfg["num_warps"]


def _key(
    dtype, fast, n_rows, n_cols, stride_x, stride_y, stride_out, has_y, has_bias, activation,
    pdl, config=None,
) -> tuple[tuple, tuple, int, tuple]:  # fmt: skip
    """_plan for a direct launch (concrete ints), with the CompiledLaunches key."""
    grid, consts, warps = _plan(
        dtype.itemsize, fast, n_rows, n_cols, stride_x, stride_y, stride_out, has_y, has_bias,
        activation, pdl, config,
    )  # fmt: skip
    ints = (n_rows, n_cols, stride_x, stride_y, stride_out)
    return grid, consts, warps, (dtype, consts, warps, *map(int_spec, ints))


_direct_plan = functools.lru_cache(maxsize=4096)(_key)  # the heuristic's plans (no config)


_bias_act_launches = CompiledLaunches(_bias_act_kernel)


def bias_act_backward_rows(
    grad: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    activation: int,
    *,
    traced: bool = False,
) -> torch.Tensor:
    """grad * act'(x + bias + alpha * y), shaped like x (contiguous)."""
    dh = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dh
    gs, xs = as_rows(grad), as_rows(x)
    ys = None if y is None else as_rows(y)
    bs = None if bias is None else bias.contiguous()
    ds = dh.view(-1, x.shape[-1]) if x.dim() else dh.view(1, 1)
    n_rows, n_cols = xs.shape
    cfg = launch_config(n_rows, n_cols, x.element_size())
    if launches_skipped():
        return dh
    kernel = (
        torch.library.wrap_triton(_bias_act_backward_kernel)
        if traced
        else _bias_act_backward_kernel
    )
    kernel[cfg["grid"]](
        gs, xs, xs if ys is None else ys, xs if bs is None else bs, ds,
        n_rows, n_cols,
        gs.stride(0), xs.stride(0), 0 if ys is None else ys.stride(0), ds.stride(0),
        float(alpha),
        HAS_Y=ys is not None, HAS_BIAS=bs is not None, ACTIVATION=activation,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], FAST=fast_math(xs),
        GRID2D=len(cfg["grid"]) == 2, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dh
