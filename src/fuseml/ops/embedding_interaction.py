"""``fuseml.ops.embedding_interaction``: DLRM's embedding gather and dot interaction in one
kernel, forward only.

Unfused, the model gathers T rows per sample into a (B, T, d) tensor, concatenates x in
front of it (another copy), multiplies it by its transpose into a (B, F, F) Gram (F = T + 1)
and indexes the lower triangle out of it, then concatenates x once more: five passes over
memory and three intermediates. Here one program per block of samples gathers the rows
into registers, forms each sample's Gram on chip, and writes the top MLP's input row
``[x, tril(Z Z^T), zero padding]`` once. The products accumulate in float32 and are rounded
once to x's dtype, as torch's bmm does.

Only one id per table and sample (a (B, T) tensor, Criteo's case); multi-hot bags take the
model's reference path for now.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuseml.ops._utils import (
    CompiledLaunches,
    aligned16,
    cdiv,
    check_same,
    check_tensor,
    compiled,
    fused_op,
    int_spec,
    launches_skipped,
    needs_dispatch,
    next_pow2,
)
from fuseml.runtime import resolve_backend, triton_interpreting

ID_DTYPES = (torch.int32, torch.int64)


def num_pairs(num_features: int, self_interaction: bool = False) -> int:
    """Entries of the kept triangle of an (F, F) Gram: F(F-1)/2, or F(F+1)/2 with the
    diagonal."""
    f = num_features
    return f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2


def embedding_interaction_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    *,
    self_interaction: bool = False,
    out_width: int | None = None,
) -> torch.Tensor:
    """Reference: the model's ConcatEmbeddingBags (one-hot ids) then DotInteraction, with
    the row padded with zeros to ``out_width`` columns."""
    n_features = ids.shape[1] + 1
    emb = F.embedding(ids.long() + table_offsets[:-1], weight)  # (B, T, d)
    z = torch.cat([x.unsqueeze(1), emb.to(x.dtype)], dim=1)  # (B, F, d)
    gram = torch.bmm(z, z.transpose(1, 2))  # (B, F, F)
    li, lj = torch.tril_indices(
        n_features, n_features, 0 if self_interaction else -1, device=x.device
    )
    out = torch.cat([x, gram[:, li, lj].to(x.dtype)], dim=1)  # (B, d + pairs)
    if out_width is not None and out_width > out.shape[1]:
        out = F.pad(out, (0, out_width - out.shape[1]))
    return out


# Per sample it reads the T ids (4 or 8 bytes each), the T gathered rows and x's row (d
# elements each) and writes one row of out_width elements; the table offsets are read once
# per program. Kaggle's shape (T = 26, d = 16, bf16, int32 ids, 368 columns): 968 bytes
# read and 736 written per sample.
@triton.jit
def _embedding_interaction_kernel(
    x_ptr,  # (B, D) the bottom MLP's output
    w_ptr,  # (rows, D) every table, concatenated
    toff_ptr,  # (T + 1,) first row of each table in w (int32 or int64)
    ids_ptr,  # (B, T) one id per table and sample, relative to its table
    out_ptr,  # (B, OUT_W) contiguous: [x, the kept triangle, zeros]
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
    BLOCK_B: tl.constexpr,  # samples per program
    F_PAD: tl.constexpr,  # next power of two >= F (>= 16 with USE_DOT)
    D_PAD: tl.constexpr,  # next power of two >= D (>= 16 with USE_DOT)
    Z_PAD: tl.constexpr,  # next power of two >= OUT_W - D - PAIRS: the zero columns
    UPCAST: tl.constexpr,  # interpreter only: dot float32 copies (see below)
):
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)  # (BLOCK_B,) int64 rows
    f = tl.arange(0, F_PAD)
    d = tl.arange(0, D_PAD)
    b_ok = b < n_rows
    d_ok = d < D

    # Z = [x, e_1..e_T] as a (BLOCK_B, F_PAD, D_PAD) tile: feature f >= 1 is row
    # table_offsets[f - 1] + ids[b, f - 1] of w, taken in int64 (tables past 2^31 rows)
    is_emb = (f >= 1) & (f < F)
    t = tl.where(is_emb, f - 1, 0)
    first_row = tl.load(toff_ptr + t * stride_t, mask=is_emb, other=0).to(tl.int64)
    id_mask = b_ok[:, None] & is_emb[None, :]
    ids = tl.load(ids_ptr + b[:, None] * stride_ib + t[None, :] * stride_it, mask=id_mask, other=0)
    rows = first_row[None, :] + ids.to(tl.int64)  # (BLOCK_B, F_PAD)
    e_mask = id_mask[:, :, None] & d_ok[None, None, :]
    e = tl.load(
        w_ptr + rows[:, :, None] * stride_w0 + d[None, None, :] * stride_w1, mask=e_mask, other=0.0
    )
    x_mask = b_ok[:, None] & d_ok[None, :]
    xv = tl.load(x_ptr + b[:, None] * stride_xb + d[None, :] * stride_xd, mask=x_mask, other=0.0)
    z = tl.where((f == 0)[None, :, None], xv[:, None, :], e)

    # Gram per sample (BLOCK_B, F_PAD, F_PAD), accumulated in float32
    if USE_DOT:
        if UPCAST:  # the CPU interpreter multiplies bfloat16 dots wrongly (numpy has none);
            z = z.to(tl.float32)  # products of 16-bit values are exact in float32
        zt = tl.trans(z, 0, 2, 1)
        if z.dtype == tl.float32:  # full float32 products, not TF32's 10-bit mantissas
            gram = tl.dot(z, zt, input_precision="ieee")
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
    tl.store(
        out_row[:, None, None] + D + col[None, :, :],
        gram.to(out_ptr.dtype.element_ty),
        mask=b_ok[:, None, None] & keep[None, :, :],
    )
    tl.store(out_row[:, None] + d[None, :], xv, mask=x_mask)
    if OUT_W > D + PAIRS:  # the padding columns: zeros
        z_col = D + PAIRS + tl.arange(0, Z_PAD)
        zeros = tl.zeros((BLOCK_B, Z_PAD), dtype=out_ptr.dtype.element_ty)
        tl.store(
            out_row[:, None] + z_col[None, :], zeros, mask=b_ok[:, None] & (z_col < OUT_W)[None, :]
        )


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


@functools.cache
def _plan(
    d: int,
    n_features: int,
    self_interaction: bool,
    out_width: int,
    block_b: int | None = None,
    num_warps: int | None = None,
) -> tuple:
    """(BLOCK_B, num_warps, constexprs) for one shape signature; ``block_b`` (a power of
    two) and ``num_warps`` override the defaults (sweeps)."""
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
        block_b, f_pad, d_pad, z_pad, triton_interpreting(),
    )  # fmt: skip
    return block_b, num_warps, consts


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    self_interaction: bool,
    out_width: int,
    traced: bool,
    block_b: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    n_rows, d = x.shape
    out = torch.empty((n_rows, out_width), dtype=x.dtype, device=x.device)
    if n_rows == 0 or launches_skipped():
        return out
    # (int(): d and T become constexprs, static under torch.compile's tracing too)
    block_b, num_warps, consts = _plan(
        int(d), int(ids.shape[1]) + 1, self_interaction, int(out_width), block_b, num_warps
    )
    grid = (cdiv(n_rows, block_b),)
    ints = (
        n_rows, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        table_offsets.stride(0), ids.stride(0), ids.stride(1),
    )  # fmt: skip
    args = (x, weight, table_offsets, ids, out, *ints, *consts)
    if traced:
        torch.library.wrap_triton(_embedding_interaction_kernel)[grid](*args, num_warps=num_warps)
        return out
    key = (x.dtype, table_offsets.dtype, ids.dtype, num_warps, consts, *map(int_spec, ints))
    aligned = aligned16(x, weight, table_offsets, ids, out)
    _launches(grid, key, aligned, args, {"num_warps": num_warps})
    return out


# Eager calls launch through the compiled kernel's own launcher (host time per call)
_launches = CompiledLaunches(_embedding_interaction_kernel)


# ------------------------------------------------------------- the gather alone
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


@fused_op("fuseml::embedding_interaction", mutates_args=())
def _embedding_interaction_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    self_interaction: bool,
    out_width: int,
    impl: str,
) -> torch.Tensor:
    return _forward(x, weight, table_offsets, ids, self_interaction, out_width, traced=True)


# ------------------------------------------------------------------------------ public
def _validate(op, x, weight, table_offsets, ids, self_interaction, out_width) -> int:
    """Check the arguments; the output's width."""
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight)
    check_same(op, "x", x, "weight", weight)
    check_tensor(op, "ids", ids, dtypes=ID_DTYPES)
    check_tensor(op, "table_offsets", table_offsets, dtypes=ID_DTYPES)
    for name, t in (("ids", ids), ("table_offsets", table_offsets)):
        if t.device != x.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but x is on {x.device}; "
                "all tensors must be on one device"
            )
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (B, d), got shape {tuple(x.shape)}")
    n_rows, d = x.shape
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(
            f"{op}: weight must be (rows, {d}) (x's width d), got shape {tuple(weight.shape)}"
        )
    if ids.dim() != 2 or ids.shape[0] != n_rows or ids.shape[1] < 1:
        raise ValueError(
            f"{op}: ids must be ({n_rows}, T) with T >= 1 (one id per sample of x and "
            f"table), got shape {tuple(ids.shape)}"
        )
    n_tables = ids.shape[1]
    if tuple(table_offsets.shape) != (n_tables + 1,):
        raise ValueError(
            f"{op}: table_offsets must have shape ({n_tables + 1},) (T + 1 for the {n_tables} "
            f"tables of ids), got {tuple(table_offsets.shape)}"
        )
    if not isinstance(self_interaction, bool):
        raise TypeError(f"{op}: self_interaction must be a bool, got {type(self_interaction)}")
    width = d + num_pairs(n_tables + 1, self_interaction)
    if out_width is None:
        return width
    if isinstance(out_width, bool) or not isinstance(out_width, int):
        raise TypeError(f"{op}: out_width must be an int or None, got {type(out_width)}")
    if out_width < width:
        raise ValueError(
            f"{op}: out_width must be at least {width} (d + pairs = {d} + {width - d}), "
            f"got {out_width}"
        )
    return out_width


def _check_ids(op: str, weight: torch.Tensor, table_offsets: torch.Tensor, ids: torch.Tensor):
    """Every id inside its table and every table inside weight (host syncs)."""
    offsets = table_offsets.long()
    if (
        int(offsets[0]) < 0
        or int(offsets[-1]) > weight.shape[0]
        or bool((offsets.diff() < 0).any())
    ):
        raise ValueError(
            f"{op}: table_offsets must rise from >= 0 to at most weight's {weight.shape[0]} "
            f"rows, got {offsets.tolist()}"
        )
    if ids.shape[0] == 0:
        return
    sizes = offsets.diff()
    low, high = ids.amin(0).long(), ids.amax(0).long()  # (T,) each
    bad = (low < 0) | (high >= sizes)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{op}: ids of table {t} must be in [0, {int(sizes[t])}), got values in "
            f"[{int(low[t])}, {int(high[t])}]"
        )


def embedding_interaction(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    *,
    self_interaction: bool = False,
    out_width: int | None = None,
    check_ids: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """DLRM's gather + dot interaction: ``cat([x, tril(Z Z^T)])`` with Z = [x, e_1..e_T].

    x: (B, d) the bottom MLP's output, float32/float16/bfloat16.
    weight: (rows, d) every table concatenated, x's dtype and device.
    table_offsets: (T + 1,) int32/int64: table t is weight[table_offsets[t]:table_offsets[t+1]].
    ids: (B, T) int32/int64, one id per sample and table, relative to its table
        (``ConcatEmbeddingBags``' one-hot form; bags are not taken here).
    self_interaction: keep the Gram's diagonal (``tril_indices(F, F, 0)``) instead of the
        strictly lower triangle (``tril_indices(F, F, -1)``); row-major order either way.
    out_width: columns of the result, at least d + pairs; the columns past d + pairs are
        zeros (an aligned K for the top MLP's first GEMM). None: exactly d + pairs.
    check_ids: check on the host (a device sync) that every id lies in its table. Without
        it an id outside its table reads whatever row it addresses, as nn.Embedding does
        on CUDA. Skipped under torch.compile.
    backend: auto (triton on CUDA tensors, eager otherwise) | eager | compile | triton.

    Returns (B, out_width) in x's dtype; the dot products accumulate in float32. Forward
    only: the result carries no gradient on the triton backend.
    """
    op = "embedding_interaction"
    width = _validate(op, x, weight, table_offsets, ids, self_interaction, out_width)
    backend = resolve_backend(backend, x.device, op, cuda_twin=False)
    if check_ids and not torch.compiler.is_compiling():
        _check_ids(op, weight, table_offsets, ids)
    if backend in ("eager", "compile"):
        fn = (
            embedding_interaction_ref if backend == "eager" else compiled(embedding_interaction_ref)
        )
        return fn(x, weight, table_offsets, ids, self_interaction=self_interaction, out_width=width)
    if needs_dispatch(x, weight, table_offsets, ids):
        return torch.ops.fuseml.embedding_interaction(
            x, weight, table_offsets, ids, self_interaction, width, backend
        )
    return _forward(x, weight, table_offsets, ids, self_interaction, width, traced=False)
