"""``fuseml.ops.embedding_interaction``: DLRM's embedding gather and dot interaction in one
kernel, forward only.

Unfused, the model gathers T rows per sample into a (B, T, d) tensor, concatenates x in
front of it (another copy), multiplies it by its transpose into a (B, F, F) Gram (F = T + 1)
and indexes the lower triangle out of it, then concatenates x once more: five passes over
memory and three intermediates. Here one program per block of samples gathers the rows
into registers, forms each sample's Gram on chip, and writes the top MLP's input row
``[x, tril(Z Z^T), zero padding]`` once. The products accumulate in float32 and are rounded
once to x's dtype, as torch's bmm does.

Ids come one per table and sample (a (B, T) tensor, Criteo's case) or as multi-hot bags
(T ``(indices, offsets)`` pairs, sum-pooled in the kernel).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fuseml.ops._interaction_kernels import _forward, num_pairs
from fuseml.ops._utils import check_same, check_tensor, compiled, fused_op, needs_dispatch
from fuseml.runtime import _assume_constant_result, cuda_backend_status, resolve_backend

log = logging.getLogger("fuseml")

ID_DTYPES = (torch.int32, torch.int64)

# auto takes the CUDA twin from this many rows on where its fragment form serves (one-hot
# 16-bit ids, d = 16, at most 32 rows of Z: kaggle's shape): each lane loads its 8 bytes of
# Z's rows straight into the MMA operands, where Triton's kernel stages Z through shared
# memory and converts the Gram's layout. H200, graph replay, kaggle: 37.5 against 46.6 us at
# 65,536 rows (the gather alone 30.7), 12.2 against 14.3 at 16,384, 6.5 against 5.1 at
# 4,096 (docs/performance/dlrm.md). The twin's kFragMinRows (csrc/interaction_frag.cuh)
# is the same bound.
TWIN_MIN_ROWS = 8192
TWIN_D = 16
TWIN_MAX_ROWS_OF_Z = 32


def embedding_interaction_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    self_interaction: bool = False,
    out_width: int | None = None,
) -> torch.Tensor:
    """Reference: the model's ConcatEmbeddingBags (one-hot ids, or T (indices, offsets)
    bags, sum-pooled) then DotInteraction, with the row padded with zeros to
    ``out_width`` columns."""
    n_features = table_offsets.shape[0]
    if isinstance(ids, torch.Tensor):
        emb = F.embedding(ids.long() + table_offsets[:-1], weight)  # (B, T, d)
    else:  # one embedding_bag call for all tables: bag t * B + b is bag b of table t
        rows = torch.cat([idx.long() + table_offsets[t] for t, (idx, _) in enumerate(ids)])
        starts, base = [], 0
        for idx, off in ids:
            starts.append(off.long() + base)
            base += idx.shape[0]
        pooled = F.embedding_bag(rows, weight, torch.cat(starts), mode="sum")  # (T * B, d)
        emb = pooled.view(n_features - 1, x.shape[0], -1).transpose(0, 1)
    z = torch.cat([x.unsqueeze(1), emb.to(x.dtype)], dim=1)  # (B, F, d)
    gram = torch.bmm(z, z.transpose(1, 2))  # (B, F, F)
    li, lj = torch.tril_indices(
        n_features, n_features, 0 if self_interaction else -1, device=x.device
    )
    out = torch.cat([x, gram[:, li, lj].to(x.dtype)], dim=1)  # (B, d + pairs)
    if out_width is not None and out_width > out.shape[1]:
        out = F.pad(out, (0, out_width - out.shape[1]))
    return out


def pack_bags(
    op: str, bags, n_rows: int, n_tables: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """T ``(indices, offsets)`` bags (as for nn.EmbeddingBag, one pair per table) checked
    for shape, dtype and device, and packed as the kernel reads them: (every bag's ids in
    one flat tensor, table by table; (T * B + 1,) int64 starts, bag t * B + b being
    ids[starts[t * B + b]:starts[t * B + b + 1]])."""
    if not isinstance(bags, (list, tuple)) or len(bags) != n_tables:
        got = len(bags) if isinstance(bags, (list, tuple)) else type(bags).__name__
        raise ValueError(
            f"{op}: ids must be a ({n_rows}, {n_tables}) tensor or {n_tables} (indices, "
            f"offsets) bags, one per table of table_offsets; got {got}"
        )
    flat, starts, base = [], [], 0
    for t, pair in enumerate(bags):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{op}: ids[{t}] must be an (indices, offsets) pair")
        for name, v in zip(("indices", "offsets"), pair):
            check_tensor(op, f"ids[{t}] {name}", v, dtypes=ID_DTYPES)
            if v.device != device:
                raise ValueError(f"{op}: ids[{t}] {name} is on {v.device} but x is on {device}")
        idx, off = pair
        if idx.dim() != 1 or off.dim() != 1 or off.shape[0] != n_rows:
            raise ValueError(
                f"{op}: ids[{t}] must be 1-D indices and 1-D offsets of length {n_rows} (the "
                f"batch), got shapes {tuple(idx.shape)} and {tuple(off.shape)}"
            )
        flat.append(idx)
        starts.append(off.long() + base if base else off.long())
        base += idx.shape[0]
    starts.append(torch.full((1,), base, dtype=torch.int64, device=device))
    return torch.cat(flat), torch.cat(starts)


@fused_op("fuseml::embedding_interaction", mutates_args=())
def _embedding_interaction_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    bag_starts: torch.Tensor | None,
    self_interaction: bool,
    out_width: int,
    impl: str,
) -> torch.Tensor:
    return _forward(
        x, weight, table_offsets, ids, bag_starts, self_interaction, out_width, traced=True,
        impl=impl,
    )  # fmt: skip


# With the device-side id check: the flags are mutated (a separate op, so that the common
# call has no mutable argument for torch.compile to functionalize).
@fused_op("fuseml::embedding_interaction_checked", mutates_args=("bad_ids",))
def _embedding_interaction_checked_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor,
    bag_starts: torch.Tensor | None,
    self_interaction: bool,
    out_width: int,
    impl: str,
    bad_ids: torch.Tensor,
) -> torch.Tensor:
    return _forward(
        x, weight, table_offsets, ids, bag_starts, self_interaction, out_width, traced=True,
        impl=impl, bad_ids=bad_ids,
    )  # fmt: skip


def _check_flag(op: str, bad_ids, n_tables: int, device: torch.device) -> None:
    if not isinstance(bad_ids, torch.Tensor):
        raise TypeError(f"{op}: bad_ids must be a tensor or None, got {type(bad_ids).__name__}")
    if (
        bad_ids.dtype != torch.int32
        or tuple(bad_ids.shape) != (n_tables,)
        or bad_ids.device != device
        or not bad_ids.is_contiguous()
    ):
        raise ValueError(
            f"{op}: bad_ids must be a contiguous int32 tensor of shape ({n_tables},) (one flag "
            f"per table) on {device}, got {bad_ids.dtype} of shape {tuple(bad_ids.shape)} on "
            f"{bad_ids.device}"
        )


def _flag_bad_ids(bad_ids: torch.Tensor, table_offsets: torch.Tensor, ids):
    """The eager backends' form of the kernels' check: bad_ids[t] set where an id of
    table t lies outside it (torch ops, no sync), and such ids replaced by 0 (in range) in
    the ids returned."""
    sizes = table_offsets.long().diff()
    if isinstance(ids, torch.Tensor):
        bad = (ids < 0) | (ids.long() >= sizes)  # (B, T)
        bad_ids.bitwise_or_(bad.any(0).to(torch.int32))
        return ids.masked_fill(bad, 0)
    cleaned = []
    for t, (idx, off) in enumerate(ids):
        bad = (idx < 0) | (idx.long() >= sizes[t])
        bad_ids[t].bitwise_or_(bad.any().to(torch.int32))
        cleaned.append((idx.masked_fill(bad, 0), off))
    return cleaned


# ------------------------------------------------------------------------------ public
def twin_serves(
    x: torch.Tensor, weight: torch.Tensor, table_offsets: torch.Tensor, one_hot: bool
) -> bool:
    """Whether auto takes the CUDA twin for this (validated) call: the shapes where its
    fragment form runs and beats the Triton kernel, rows 8-byte aligned (under
    torch.compile the pointers are unknown: the twin checks them too, its other forms
    serving unaligned rows)."""
    return (
        one_hot
        and x.is_cuda
        and x.shape[0] >= TWIN_MIN_ROWS
        and x.shape[1] == TWIN_D
        and x.dtype in (torch.float16, torch.bfloat16)
        and table_offsets.shape[0] <= TWIN_MAX_ROWS_OF_Z
        and x.stride(1) == 1
        and x.stride(0) % 4 == 0
        and weight.stride() == (TWIN_D, 1)
        and (
            torch.compiler.is_compiling() or (x.data_ptr() % 8 == 0 and weight.data_ptr() % 8 == 0)
        )
    )


@_assume_constant_result
def _twin_ready(device_type: str, index: int | None) -> bool:
    """Whether the CUDA twin runs its fragment form on this device (tensor cores: sm_80 and
    later), building the extension on the first call; else False, said once. (Traced, a
    constant: dynamo runs it eagerly.)"""
    return _twin_status(device_type, index)


@functools.cache
def _twin_status(device_type: str, index: int | None) -> bool:
    device = torch.device(device_type, index)
    ok, reason = cuda_backend_status(device)
    if ok and torch.cuda.get_device_capability(device)[0] < 8:
        ok, reason = False, "its tensor-core form needs sm_80 or later"
    if not ok:
        log.warning(
            "embedding_interaction: the CUDA twin is unavailable (%s); batches of %d rows "
            "or more take the Triton kernel (about 1.25x the time at 65,536 rows)",
            reason, TWIN_MIN_ROWS,
        )  # fmt: skip
    return ok


def _validate(op, x, weight, table_offsets, ids, self_interaction, out_width) -> int:
    """Check the arguments (bags: all but the bags, see ``pack_bags``); the output's
    width."""
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight)
    check_same(op, "x", x, "weight", weight)
    check_tensor(op, "table_offsets", table_offsets, dtypes=ID_DTYPES)
    one_hot = isinstance(ids, torch.Tensor)
    if one_hot:
        check_tensor(op, "ids", ids, dtypes=ID_DTYPES)
    for name, t in (("ids", ids if one_hot else None), ("table_offsets", table_offsets)):
        if t is not None and t.device != x.device:
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
    if one_hot and (ids.dim() != 2 or ids.shape[0] != n_rows or ids.shape[1] < 1):
        raise ValueError(
            f"{op}: ids must be ({n_rows}, T) with T >= 1 (one id per sample of x and "
            f"table), got shape {tuple(ids.shape)}"
        )
    if one_hot:
        n_tables = ids.shape[1]
        if tuple(table_offsets.shape) != (n_tables + 1,):
            raise ValueError(
                f"{op}: table_offsets must have shape ({n_tables + 1},) (T + 1 for the "
                f"{n_tables} tables of ids), got {tuple(table_offsets.shape)}"
            )
    elif table_offsets.dim() != 1 or table_offsets.shape[0] < 2:
        raise ValueError(
            f"{op}: table_offsets must have shape (T + 1,) with T >= 1 tables, got "
            f"{tuple(table_offsets.shape)}"
        )
    n_tables = table_offsets.shape[0] - 1
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


def _check_ids(op: str, weight: torch.Tensor, table_offsets: torch.Tensor, ids) -> None:
    """Every table inside weight, every id inside its table and (bags) every table's
    offsets rising from 0 to at most its number of indices (host syncs)."""
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
    sizes = offsets.diff()
    if isinstance(ids, torch.Tensor):
        if ids.shape[0] == 0:
            return
        low, high = ids.amin(0).long(), ids.amax(0).long()  # (T,) each
        bad = (low < 0) | (high >= sizes)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{op}: ids of table {t} must be in [0, {int(sizes[t])}), got values in "
                f"[{int(low[t])}, {int(high[t])}]"
            )
        return
    for t, (idx, off) in enumerate(ids):
        if off.shape[0] and (
            int(off[0]) != 0 or int(off[-1]) > idx.shape[0] or bool((off.diff() < 0).any())
        ):
            raise ValueError(
                f"{op}: ids[{t}] offsets must start at 0, never decrease and not exceed its "
                f"{idx.shape[0]} indices"
            )
        if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= int(sizes[t])):
            raise ValueError(
                f"{op}: ids[{t}] indices must be in [0, {int(sizes[t])}), got values in "
                f"[{int(idx.min())}, {int(idx.max())}]"
            )


def embedding_interaction(
    x: torch.Tensor,
    weight: torch.Tensor,
    table_offsets: torch.Tensor,
    ids: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    self_interaction: bool = False,
    out_width: int | None = None,
    check_ids: bool = False,
    bad_ids: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """DLRM's gather + dot interaction: ``cat([x, tril(Z Z^T)])`` with Z = [x, e_1..e_T].

    x: (B, d) the bottom MLP's output, float32/float16/bfloat16.
    weight: (rows, d) every table concatenated, x's dtype and device.
    table_offsets: (T + 1,) int32/int64: table t is weight[table_offsets[t]:table_offsets[t+1]].
    ids: (B, T) int32/int64, one id per sample and table, relative to its table; or T
        ``(indices, offsets)`` int32/int64 pairs, one per table as for nn.EmbeddingBag
        (offsets (B,) the bag starts from 0; sum pooling in float32, an empty bag zeros),
        as ``ConcatEmbeddingBags`` takes them.
    self_interaction: keep the Gram's diagonal (``tril_indices(F, F, 0)``) instead of the
        strictly lower triangle (``tril_indices(F, F, -1)``); row-major order either way.
    out_width: columns of the result, at least d + pairs; the columns past d + pairs are
        zeros (an aligned K for the top MLP's first GEMM). None: exactly d + pairs.
    check_ids: check on the host (a device sync) that every id lies in its table (and
        bags' offsets are in order). Without it an id outside its table reads whatever row
        it addresses, as nn.Embedding does on CUDA. Skipped under torch.compile.
    bad_ids: the check without a sync (e.g. inside a CUDA graph): a (T,) int32 tensor of
        flags on x's device; the kernel sets bad_ids[t] to 1 when an id of table t lies
        outside it (a bag's offsets are not checked) and reads no memory for that id (its
        row's share of the result is unspecified: read the flags, e.g. after the batch,
        and drop the batch). The flags are only ever set, never cleared.
    backend: auto | eager | compile | triton | cuda (the CUDA C++ twin, built on first
        use). auto: eager on CPU tensors; on CUDA the Triton kernel, or the twin where it
        is the faster (one-hot 16-bit ids, d = 16, at least ``TWIN_MIN_ROWS`` rows; built
        on the first such call; where it cannot be built, Triton, said once).

    Returns (B, out_width) in x's dtype; the dot products accumulate in float32. Forward
    only: the result carries no gradient on the triton backend.
    """
    op = "embedding_interaction"
    width = _validate(op, x, weight, table_offsets, ids, self_interaction, out_width)
    one_hot = isinstance(ids, torch.Tensor)
    if (
        backend == "auto"
        and twin_serves(x, weight, table_offsets, one_hot)
        and _twin_ready(x.device.type, x.device.index)
    ):
        backend = "cuda"
    else:
        backend = resolve_backend(backend, x.device, op)
    if one_hot:
        flat, starts = ids, None
    else:
        flat, starts = pack_bags(op, ids, x.shape[0], table_offsets.shape[0] - 1, x.device)
    if check_ids and not torch.compiler.is_compiling():
        _check_ids(op, weight, table_offsets, ids)
    if bad_ids is not None:
        _check_flag(op, bad_ids, table_offsets.shape[0] - 1, x.device)
    if backend in ("eager", "compile"):
        if bad_ids is not None:
            ids = _flag_bad_ids(bad_ids, table_offsets, ids)
        fn = (
            embedding_interaction_ref if backend == "eager" else compiled(embedding_interaction_ref)
        )
        return fn(x, weight, table_offsets, ids, self_interaction=self_interaction, out_width=width)
    if needs_dispatch(x, weight, table_offsets, flat):
        if bad_ids is not None:
            return torch.ops.fuseml.embedding_interaction_checked(
                x, weight, table_offsets, flat, starts, self_interaction, width, backend, bad_ids
            )
        return torch.ops.fuseml.embedding_interaction(
            x, weight, table_offsets, flat, starts, self_interaction, width, backend
        )
    return _forward(
        x, weight, table_offsets, flat, starts, self_interaction, width, traced=False,
        impl=backend, bad_ids=bad_ids,
    )  # fmt: skip
