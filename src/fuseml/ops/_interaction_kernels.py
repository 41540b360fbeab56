"""The kernels of ``fuseml.ops.embedding_interaction``: the gather + dot interaction (one-hot
ids or bags), its launch plan and launch, and a gather-only kernel (the ``interaction``
bench suite's floor)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from fuseml import _cuda_ext
from fuseml.ops._math import _pdl_begin
from fuseml.ops._utils import (
    CompiledLaunches,
    aligned16,
    cdiv,
    int_spec,
    launches_skipped,
    next_pow2,
    pdl_launch,
)
from fuseml.ops.gemm.common import dot_precision, round_tf32
from fuseml.runtime import triton_interpreting


def num_pairs(num_features: int, self_interaction: bool = False) -> int:
    """Entries of the kept triangle of an (F, F) Gram: F(F-1)/2, or F(F+1)/2 with the
    diagonal."""
    f = num_features
    return f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2


@triton.jit
def _round_to(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 v rounded to dtype, to nearest. The CPU interpreter truncates float32 to
    bfloat16 (numpy has no bfloat16), a bias a two-rounding path (bags) makes visible:
    there the rounding is done on the bits, the result an exact bfloat16 in float32."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _load_ids(ids_ptr, b, b_ok, t, is_emb, stride_ib, stride_it):
    """(BLOCK_B, F_PAD) one-hot ids of samples b (0 where not ``b_ok`` or not a table)."""
    ok = b_ok[:, None] & is_emb[None, :]
    return tl.load(ids_ptr + b[:, None] * stride_ib + t[None, :] * stride_it, mask=ok, other=0)


@triton.jit
def _gather(
    x_ptr, w_ptr, bad_ptr, ids, b, b_ok, t, is_emb, d, first_row, size, stride_xb, stride_xd,
    stride_w0, stride_w1, D: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """(e, x) of samples b where ``b_ok``: their T table rows (BLOCK_B, F_PAD, D_PAD), row
    table_offsets[t] + ids[b, t] of w taken in int64 (tables past 2^31 rows), and x's rows.
    CHECK: an id outside its table sets the table's flag and reads nothing."""
    d_ok = d < D
    ok = b_ok[:, None] & is_emb[None, :]
    if CHECK:
        bad = ok & ((ids < 0) | (ids.to(tl.int64) >= size[None, :]))
        tl.store(bad_ptr + t[None, :] + tl.zeros_like(ids).to(tl.int32), 1, mask=bad)
        ok = ok & ~bad
    rows = first_row[None, :] + ids.to(tl.int64)
    e = tl.load(
        w_ptr + rows[:, :, None] * stride_w0 + d[None, None, :] * stride_w1,
        mask=ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )
    xv = tl.load(
        x_ptr + b[:, None] * stride_xb + d[None, :] * stride_xd,
        mask=b_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    return e, xv


@triton.jit
def _interact_store(
    out_ptr, b, e, xv, f, d, n_rows, D: tl.constexpr, F: tl.constexpr, PAIRS: tl.constexpr,
    OUT_W: tl.constexpr, SELF: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_B: tl.constexpr,
    F_PAD: tl.constexpr, Z_PAD: tl.constexpr, UPCAST: tl.constexpr, FLAT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Z = [x, e_1..e_T] of samples b, its Gram per sample, and the output rows: x, the kept
    triangle, the zero columns. PRECISION: float32 Z's dot, as ``dot_precision`` picks it."""
    b_ok = b < n_rows
    d_ok = d < D
    z = tl.where((f == 0)[None, :, None], xv[:, None, :], e)

    # Gram per sample (BLOCK_B, F_PAD, F_PAD), accumulated in float32
    if USE_DOT:
        if UPCAST:  # the CPU interpreter multiplies bfloat16 dots wrongly (numpy has none);
            z = z.to(tl.float32)  # products of 16-bit values are exact in float32
        zt = tl.trans(z, 0, 2, 1)
        if z.dtype == tl.float32 and PRECISION == "tf32":  # (as torch allows for its bmm)
            gram = tl.dot(round_tf32(z), round_tf32(zt), input_precision="tf32")
        elif z.dtype == tl.float32:  # float32 accuracy: tf32x3 on the tensor cores, or FMAs
            gram = tl.dot(z, zt, input_precision=PRECISION)
        else:  # 16-bit inputs: tensor cores, float32 accumulator
            gram = tl.dot(z, zt)
    else:
        zf = z.to(tl.float32)
        gram = tl.sum(zf[:, :, None, :] * zf[:, None, :, :], axis=3)

    # Gram entry (i, j) of the kept triangle goes to column D + i(i-1)/2 + j (row-major
    # tril_indices order; with the diagonal, D + i(i+1)/2 + j), stored straight from the
    # accumulator: no shuffle of the Gram, only the kept entries written.
    gi = f[:, None]
    gj = f[None, :]
    if SELF:
        keep = (gj <= gi) & (gi < F)
        col = gi * (gi + 1) // 2 + gj
    else:
        keep = (gj < gi) & (gi < F)
        col = gi * (gi - 1) // 2 + gj
    out_row = out_ptr + b * OUT_W  # (BLOCK_B,)
    g = _round_to(gram, out_ptr.dtype.element_ty, UPCAST).to(out_ptr.dtype.element_ty)
    if FLAT:  # through a (BLOCK_B, F_PAD^2) layout: consecutive lanes, consecutive columns
        cols = tl.reshape(col, (F_PAD * F_PAD,))
        kept = tl.reshape(keep, (F_PAD * F_PAD,))
        tl.store(
            out_row[:, None] + D + cols[None, :],
            tl.reshape(g, (BLOCK_B, F_PAD * F_PAD)),
            mask=b_ok[:, None] & kept[None, :],
        )
    else:
        tl.store(
            out_row[:, None, None] + D + col[None, :, :], g,
            mask=b_ok[:, None, None] & keep[None, :, :],
        )  # fmt: skip
    tl.store(out_row[:, None] + d[None, :], xv, mask=b_ok[:, None] & d_ok[None, :])
    if OUT_W > D + PAIRS:  # the padding columns: zeros
        z_col = D + PAIRS + tl.arange(0, Z_PAD)
        zeros = tl.zeros((BLOCK_B, Z_PAD), dtype=out_ptr.dtype.element_ty)
        tl.store(
            out_row[:, None] + z_col[None, :], zeros, mask=b_ok[:, None] & (z_col < OUT_W)[None, :]
        )


# Per sample it reads the T ids (4 or 8 bytes each), the T gathered rows and x's row (d
# elements each) and writes one row of out_width elements; the table offsets are read once
# per program. Kaggle's shape (T = 26, d = 16, bf16, int32 ids, 368 columns): 968 bytes
# read and 736 written per sample.
@triton.jit
def _embedding_interaction_kernel(
    x_ptr,  # (B, D) the bottom MLP's output
    w_ptr,  # (rows, D) every table, concatenated
    toff_ptr,  # (T + 1,) first row of each table in w (int32 or int64)
    ids_ptr,  # (B, T) one id per table and sample, or (BAGS) every bag's ids, flat; each
    # relative to its table
    starts_ptr,  # BAGS: (T * B + 1,) where bag t * B + b starts in ids (CSR)
    out_ptr,  # (B, OUT_W) contiguous: [x, the kept triangle, zeros]
    bad_ptr,  # CHECK: (T,) int32, bad[t] set to 1 where an id of table t lies outside it
    n_rows,  # B
    stride_xb,
    stride_xd,
    stride_w0,
    stride_w1,
    stride_t,
    stride_ib,
    stride_it,
    D: tl.constexpr,  # embedding dim
    F: tl.constexpr,  # features that interact: x and the T tables
    PAIRS: tl.constexpr,  # kept Gram entries per sample
    OUT_W: tl.constexpr,  # columns of out (>= D + PAIRS)
    SELF: tl.constexpr,  # keep the Gram's diagonal
    USE_DOT: tl.constexpr,  # Gram through tl.dot (else a broadcast multiply-sum)
    BLOCK_B: tl.constexpr,  # samples per group
    F_PAD: tl.constexpr,  # next power of two >= F (>= 16 with USE_DOT)
    D_PAD: tl.constexpr,  # next power of two >= D (>= 16 with USE_DOT)
    Z_PAD: tl.constexpr,  # next power of two >= OUT_W - D - PAIRS: the zero columns
    UPCAST: tl.constexpr,  # interpreter only: dot float32 copies (see _interact_store)
    ITERS: tl.constexpr,  # groups of BLOCK_B samples per program, one after another
    PREFETCH: tl.constexpr,  # one-hot: the next group's rows (and the ids of the one after)
    # loaded before this group's Gram
    FLAT: tl.constexpr,  # the triangle stored from a flattened layout (see _interact_store)
    PRECISION: tl.constexpr,  # float32 tables: the Gram's dot precision (see dot_precision)
    BAGS: tl.constexpr,  # multi-hot: each table's row the sum of its bag's rows
    CHECK: tl.constexpr,  # ids checked against their tables (bad_ptr); a bad one reads zeros
    PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl_launch)
):
    if PDL:
        _pdl_begin()
    pid = tl.program_id(0)
    first_b = pid.to(tl.int64) * (BLOCK_B * ITERS)
    lanes = tl.arange(0, BLOCK_B)
    f = tl.arange(0, F_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D

    # feature f >= 1 is table f - 1, its rows from table_offsets[f - 1]
    is_emb = (f >= 1) & (f < F)
    t = tl.where(is_emb, f - 1, 0)
    first_row = tl.load(toff_ptr + t * stride_t, mask=is_emb, other=0).to(tl.int64)
    size = first_row
    if CHECK:
        size = tl.load(toff_ptr + (t + 1) * stride_t, mask=is_emb, other=0).to(tl.int64)
        size = size - first_row
    if BAGS:  # sum pooling in float32, rounded once to the table's dtype (as embedding_bag)
        for it in range(ITERS):
            b = first_b + it * BLOCK_B + lanes
            b_ok = b < n_rows
            id_mask = b_ok[:, None] & is_emb[None, :]
            bag = t[None, :].to(tl.int64) * n_rows + b[:, None]  # (BLOCK_B, F_PAD)
            first = tl.load(starts_ptr + bag, mask=id_mask, other=0).to(tl.int64)
            count = tl.load(starts_ptr + bag + 1, mask=id_mask, other=0).to(tl.int64) - first
            acc = tl.zeros((BLOCK_B, F_PAD, D_PAD), dtype=tl.float32)
            for k in range(0, tl.max(tl.max(count, 1), 0)):
                ok = id_mask & (k < count)
                ids = tl.load(ids_ptr + first + k, mask=ok, other=0)
                if CHECK:
                    bad = ok & ((ids < 0) | (ids.to(tl.int64) >= size[None, :]))
                    flags = bad_ptr + t[None, :] + tl.zeros((BLOCK_B, 1), dtype=tl.int32)
                    tl.store(flags, 1, mask=bad)
                    ok = ok & ~bad
                rows = first_row[None, :] + ids.to(tl.int64)
                acc += tl.load(
                    w_ptr + rows[:, :, None] * stride_w0 + d[None, None, :] * stride_w1,
                    mask=ok[:, :, None] & d_ok[None, None, :],
                    other=0.0,
                ).to(tl.float32)
            e = _round_to(acc, w_ptr.dtype.element_ty, UPCAST)
            xv = tl.load(
                x_ptr + b[:, None] * stride_xb + d[None, :] * stride_xd,
                mask=b_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            _interact_store(
                out_ptr, b, e, xv, f, d, n_rows, D, F, PAIRS, OUT_W, SELF, USE_DOT, BLOCK_B,
                F_PAD, Z_PAD, UPCAST, FLAT, PRECISION,
            )  # fmt: skip
    elif PREFETCH:
        # Each group's rows are loaded one group ahead, and its ids two ahead, so the
        # loads of the next group are in flight while this group's Gram is formed and
        # stored (a gather of 32-byte rows is bound by latency, not bandwidth).
        b = first_b + lanes
        b_ok = b < n_rows
        ids = _load_ids(ids_ptr, b, b_ok, t, is_emb, stride_ib, stride_it)
        e, xv = _gather(
            x_ptr, w_ptr, bad_ptr, ids, b, b_ok, t, is_emb, d, first_row, size, stride_xb,
            stride_xd, stride_w0, stride_w1, D, CHECK,
        )  # fmt: skip
        bn = b + BLOCK_B
        ok_next = (bn < n_rows) & (ITERS > 1)
        ids_next = _load_ids(ids_ptr, bn, ok_next, t, is_emb, stride_ib, stride_it)
        for it in range(ITERS):
            bn = b + BLOCK_B
            e_next, x_next = _gather(
                x_ptr, w_ptr, bad_ptr, ids_next, bn, ok_next, t, is_emb, d, first_row, size,
                stride_xb, stride_xd, stride_w0, stride_w1, D, CHECK,
            )  # fmt: skip
            b2 = bn + BLOCK_B
            ok_next = (b2 < n_rows) & (it + 2 < ITERS)
            ids_next = _load_ids(ids_ptr, b2, ok_next, t, is_emb, stride_ib, stride_it)
            _interact_store(
                out_ptr, b, e, xv, f, d, n_rows, D, F, PAIRS, OUT_W, SELF, USE_DOT, BLOCK_B,
                F_PAD, Z_PAD, UPCAST, FLAT, PRECISION,
            )  # fmt: skip
            b = bn
            e = e_next
            xv = x_next
    else:
        for it in range(ITERS):
            b = first_b + it * BLOCK_B + lanes
            b_ok = b < n_rows
            ids = _load_ids(ids_ptr, b, b_ok, t, is_emb, stride_ib, stride_it)
            e, xv = _gather(
                x_ptr, w_ptr, bad_ptr, ids, b, b_ok, t, is_emb, d, first_row, size, stride_xb,
                stride_xd, stride_w0, stride_w1, D, CHECK,
            )  # fmt: skip
            _interact_store(
                out_ptr, b, e, xv, f, d, n_rows, D, F, PAIRS, OUT_W, SELF, USE_DOT, BLOCK_B,
                F_PAD, Z_PAD, UPCAST, FLAT, PRECISION,
            )  # fmt: skip


# Samples and warps per program of the tensor-core form: 2 samples on 2 warps was the best
# of 2-32 samples on 2-8 warps at d = 16 and d = 128, 4096 and 65536 rows (H200; kaggle
# d = 16 at 65536 rows: 56 us against 66-124 for the others): many small programs keep
# the most gathers in flight (docs/performance/dlrm.md).
_DOT_BLOCK_B = 2
_DOT_WARPS = 2
# The broadcast form (fewer than 9 features): samples per program so that its largest
# tile (the (F, F, d) product) fills about 64 float32 registers a thread on 4 warps.
_TILE_ELEMS = 8192
_MAX_BLOCK_B = 64


@dataclass(frozen=True)
class Variant:
    """How the kernel walks its samples, for sweeps and their tests (the defaults: the
    planned launch). block_b: samples per group (a power of two), num_warps: warps per
    program, iters: groups per program, prefetch: (one-hot ids) each group's rows loaded
    while the group before is formed and stored, flat: the triangle stored from a
    flattened layout."""

    block_b: int | None = None
    num_warps: int | None = None
    iters: int = 1
    prefetch: bool = False
    flat: bool = False


PLANNED = Variant()
# One-hot ids, the tensor-core form, d <= 16, from 4096 rows: one sample a warp, four a
# program, each sample's rows loaded while the one before is stored. Kaggle (d = 16,
# bf16, H200, graph replays): 47.0 us against 52.5 at 65536 rows, 5.2 against 5.5 at
# 4096 (benchmarks/results/nvidia-h200/interaction-sweep.json). Not measured at d > 16.
LOOPED = Variant(block_b=1, num_warps=1, iters=4, prefetch=True)
LOOPED_MIN_ROWS = 4096
LOOPED_MAX_D = 16
# float32 Grams of wide rows run on the tensor cores (TF32 where torch allows it, else
# tf32x3: fp32 accuracy): on FMAs the mlperf Gram (d = 128) took 4,161 us at 65536 rows,
# H200; narrow ones keep exact FMAs, cheap next to the gather (docs/performance/dlrm.md).
TENSOR_CORE_F32_MIN_D = 32
# One-hot float32 tables from TENSOR_CORE_F32_MIN_D: one sample on one warp a program, the
# best of 11 variants (mlperf tf32x3, 65536 rows: 881 against 1,322 us for 2 samples on 2
# warps, H200; TF32's in docs/performance/dlrm.md).
WIDE_F32 = Variant(block_b=1, num_warps=1)


def default_variant(
    n_rows, d: int, n_features: int, bags: bool, dtype: torch.dtype = torch.bfloat16
) -> Variant:
    """The launch the op takes when no variant is asked for (see LOOPED, WIDE_F32)."""
    wide_f32 = dtype == torch.float32 and d >= TENSOR_CORE_F32_MIN_D
    if wide_f32 and not bags and next_pow2(n_features) >= 16:
        return WIDE_F32
    if (
        bags
        or not isinstance(n_rows, int)  # (a symbolic batch under torch.compile: no guard)
        or n_rows < LOOPED_MIN_ROWS
        or d > LOOPED_MAX_D
        or next_pow2(n_features) < 16  # the broadcast form
    ):
        return PLANNED
    return LOOPED


def gram_precision(dtype: torch.dtype, d: int) -> str:
    """The Gram's dot precision for tables of ``dtype`` and width ``d`` (16-bit: unused)."""
    if dtype == torch.float32 and d < TENSOR_CORE_F32_MIN_D:
        return "ieee"
    return dot_precision(dtype)


@functools.cache
def _plan(
    d: int,
    n_features: int,
    self_interaction: bool,
    out_width: int,
    variant: Variant = PLANNED,
    precision: str = "tf32",
) -> tuple:
    """(samples per program, num_warps, constexprs) for one shape signature; ``variant``
    overrides the defaults (sweeps); ``precision``: float32's dot (``dot_precision``)."""
    block_b, num_warps = variant.block_b, variant.num_warps
    f_pad = next_pow2(n_features)
    use_dot = f_pad >= 16
    d_pad = max(next_pow2(d), 16) if use_dot else next_pow2(d)
    pairs = num_pairs(n_features, self_interaction)
    z_pad = next_pow2(max(1, out_width - d - pairs))
    if block_b is None:
        if use_dot:
            block_b = _DOT_BLOCK_B
        else:
            per_sample = max(f_pad * f_pad * d_pad, z_pad)
            block_b = max(1, min(_MAX_BLOCK_B, _TILE_ELEMS // per_sample))
            block_b = 1 << (block_b.bit_length() - 1)  # a power of two
    if num_warps is None:
        num_warps = _DOT_WARPS if use_dot else 4
    consts = (
        d, n_features, pairs, out_width, int(self_interaction), use_dot,
        block_b, f_pad, d_pad, z_pad, triton_interpreting(), variant.iters, variant.prefetch,
        variant.flat, precision,
    )  # fmt: skip
    return block_b * variant.iters, num_warps, consts


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    bag_starts: torch.Tensor | None,
    self_interaction: bool,
    out_width: int,
    traced: bool,
    variant: Variant | None = None,
    impl: str = "triton",
    bad_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The launch (impl "triton", or "cuda": the CUDA C++ twin). ids: (B, T) one-hot, or
    with ``bag_starts`` (T * B + 1,) the flat ids of every bag (see ``pack_bags``);
    ``bad_ids`` ((T,) int32): flags set for tables with an id outside them; ``variant``:
    see ``Variant`` (prefetch is for one-hot ids: bags load theirs as they sum them),
    None: ``default_variant``."""
    n_rows, d = x.shape
    out = torch.empty((n_rows, out_width), dtype=x.dtype, device=x.device)
    if n_rows == 0 or launches_skipped():
        return out
    if impl == "cuda":
        _cuda_ext.require("embedding_interaction")
        torch.ops.fuseml.embedding_interaction_cuda_out(
            x, weight, table_offsets, ids, bag_starts, self_interaction, out, bad_ids
        )
        return out
    # (int(): d and T become constexprs, static under torch.compile's tracing too)
    n_tables = int(table_offsets.shape[0]) - 1
    bags = bag_starts is not None
    if variant is None:
        variant = default_variant(n_rows, int(d), n_tables + 1, bags, x.dtype)
    if bags and variant.prefetch:
        variant = replace(variant, prefetch=False)
    per_program, num_warps, consts = _plan(
        int(d), n_tables + 1, self_interaction, int(out_width), variant, gram_precision(x.dtype, d)
    )
    grid = (cdiv(n_rows, per_program),)
    id_strides = (ids.stride(0), 0) if bags else (ids.stride(0), ids.stride(1))
    ints = (
        n_rows, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        table_offsets.stride(0), *id_strides,
    )  # fmt: skip
    starts = bag_starts if bags else ids  # (not read without bags)
    check = bad_ids is not None
    flag = bad_ids if check else out  # (not written without a flag)
    pdl = pdl_launch(x, traced)
    args = (x, weight, table_offsets, ids, starts, out, flag, *ints, *consts, bags, check, pdl)
    options = {"num_warps": num_warps, "launch_pdl": True} if pdl else {"num_warps": num_warps}
    if traced:
        torch.library.wrap_triton(_embedding_interaction_kernel)[grid](*args, num_warps=num_warps)
        return out
    key = (
        x.dtype, table_offsets.dtype, ids.dtype, starts.dtype, num_warps, consts, bags, check,
        pdl, *map(int_spec, ints),
    )  # fmt: skip
    aligned = aligned16(x, weight, table_offsets, ids, starts, out, bad_ids)
    _launches(grid, key, aligned, args, options)
    return out


# Eager calls launch through the compiled kernel's own launcher (host time per call)
_launches = CompiledLaunches(_embedding_interaction_kernel)


# ---------------------------------------------------------------------- the gather alone
@triton.jit
def _gather_rows_kernel(
    w_ptr, toff_ptr, ids_ptr, out_ptr, n_ids, T: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """out[k] = w[toff[k % T] + ids[k]] for the flat (b, t) index k: the gather alone."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = k < n_ids
    ids = tl.load(ids_ptr + k, mask=ok, other=0)
    row = tl.load(toff_ptr + k % T, mask=ok, other=0) + ids.to(tl.int64)
    d = tl.arange(0, D)
    v = tl.load(w_ptr + row[:, None] * D + d[None, :], mask=ok[:, None])
    tl.store(out_ptr + k[:, None] * D + d[None, :], v, mask=ok[:, None])


def gather_rows(weight, table_offsets, ids) -> torch.Tensor:
    """(B, T, d): row table_offsets[t] + ids[b, t] of ``weight`` (contiguous tensors, ids
    valid), nothing computed: the floor of any gather at these ids (the ``interaction``
    bench suite's reference), not a user op."""
    n, t = ids.shape
    d = weight.shape[1]
    out = torch.empty((n, t, d), dtype=weight.dtype, device=weight.device)
    block = max(16, 2048 // d)
    _gather_rows_kernel[(triton.cdiv(n * t, block),)](
        weight, table_offsets, ids, out, n * t, t, d, block, num_warps=4
    )
    return out
