"""Batches of torch tensors from a dataset written by :func:`fuseml.data.prepare`.

Public API::

    ds = CriteoDataset(root, "train", batch_size=2048, shuffle=True, seed=0)
    ds.set_epoch(epoch)       # a different (still seeded) order each epoch
    for batch in ds:          # CriteoBatch(dense (B, 13) float32, sparse (B, 26) int64,
        ...                   #             labels (B,) float32)
    ds.cardinalities          # embedding table sizes, from metadata.json

It is an ``IterableDataset`` that yields whole batches, so wrap it as
``DataLoader(ds, batch_size=None, num_workers=...)``; with workers, each one reads its own
share of the parquet row groups (or, when cached, of the batches; each worker then holds
its own copy of the cached split).

Memory: a split of at most ``max_cached_rows`` rows is decoded once and kept, and then
shuffled over all rows. A larger split is streamed one parquet row group at a time; with
``shuffle`` the row groups are visited in a random order and rows are shuffled within a
window of about ``shuffle_buffer_rows`` rows (the usual trade-off for data that does not
fit in memory).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fuseml.data.criteo import DENSE_COLUMNS, LABEL_COLUMN, SPARSE_COLUMNS
from fuseml.data.errors import Flag, OptionError
from fuseml.data.prepare import SPLITS, load_metadata

__all__ = ["CriteoBatch", "CriteoDataset"]


class CriteoBatch(NamedTuple):
    """One mini-batch: one category id per table and row (one-hot lookups)."""

    dense: torch.Tensor  # (B, 13) float32, log(x + 1) counts
    sparse: torch.Tensor  # (B, 26) int64 ids, sparse[:, t] < cardinalities[t]
    labels: torch.Tensor  # (B,) float32 in {0, 1}


class _Rows(NamedTuple):
    """Decoded rows as numpy arrays (the layout of CriteoBatch)."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray | slice) -> _Rows:
        return _Rows(self.dense[index], self.sparse[index], self.labels[index])

    @staticmethod
    def concat(parts: list[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        return _Rows(*(np.concatenate(arrays) for arrays in zip(*parts)))

    def to_batch(self) -> CriteoBatch:
        return CriteoBatch(
            torch.from_numpy(np.ascontiguousarray(self.dense)),
            torch.from_numpy(np.ascontiguousarray(self.sparse)),
            torch.from_numpy(np.ascontiguousarray(self.labels)),
        )


class CriteoDataset(IterableDataset[CriteoBatch]):
    """Iterate over one split of a prepared dataset in batches of torch tensors.

    Args:
        root: folder written by ``prepare``.
        split: "train", "validation" or "test".
        batch_size: rows per batch.
        shuffle: shuffle rows (seeded); defaults to True for "train" only.
        seed: seed of the shuffle; combined with the epoch set by :meth:`set_epoch`.
        drop_last: drop the final batch if it has fewer than ``batch_size`` rows.
        max_cached_rows: splits with at most this many rows are kept in memory.
        shuffle_buffer_rows: streaming only: rows shuffled together.
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        *,
        batch_size: int = 2048,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool = False,
        max_cached_rows: int = 2_000_000,
        shuffle_buffer_rows: int = 1_000_000,
    ) -> None:
        super().__init__()
        if split not in SPLITS:
            raise OptionError("{} must be one of {}, got {!r}", Flag("split"), SPLITS, split)
        if batch_size < 1:
            raise OptionError("{} must be at least 1, got {}", Flag("batch_size"), batch_size)
        self.root = Path(root)
        self.split = split
        self.metadata: dict[str, Any] = load_metadata(self.root)
        self.batch_size = batch_size
        self.shuffle = split == "train" if shuffle is None else shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.max_cached_rows = max_cached_rows
        self.shuffle_buffer_rows = shuffle_buffer_rows
        self.epoch = 0
        self.files = [self.root / name for name in self.metadata["splits"][split]["files"]]
        self.num_rows: int = self.metadata["splits"][split]["rows"]
        self._cache: _Rows | None = None

    @property
    def cardinalities(self) -> list[int]:
        """Number of ids of each of the 26 tables."""
        return list(self.metadata["cardinalities"])

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle order of the next iteration (as ``DistributedSampler`` does)."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches per iteration (exact without workers; with workers each has its own tail)."""
        if self.drop_last:
            return self.num_rows // self.batch_size
        return math.ceil(self.num_rows / self.batch_size)

    def __iter__(self) -> Iterator[CriteoBatch]:
        worker = get_worker_info()
        worker_id, n_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        rng = np.random.default_rng([self.seed, self.epoch]) if self.shuffle else None
        if self.num_rows <= self.max_cached_rows:
            yield from self._iter_cached(rng, worker_id, n_workers)
        else:
            yield from self._iter_streamed(rng, worker_id, n_workers)

    # -- implementation -------------------------------------------------------------------

    def _row_groups(self) -> list[tuple[pq.ParquetFile, int]]:
        groups = []
        for path in self.files:
            parquet = pq.ParquetFile(path)
            groups += [(parquet, i) for i in range(parquet.num_row_groups)]
        return groups

    def _read(self, parquet: pq.ParquetFile, group: int) -> _Rows:
        table = parquet.read_row_group(group)
        return _Rows(
            _row_major(table, DENSE_COLUMNS, np.float32),
            _row_major(table, SPARSE_COLUMNS, np.int64),
            table.column(LABEL_COLUMN).to_numpy().astype(np.float32),
        )

    def _iter_cached(
        self, rng: np.random.Generator | None, worker_id: int, n_workers: int
    ) -> Iterator[CriteoBatch]:
        if self._cache is None:
            parts = [self._read(parquet, i) for parquet, i in self._row_groups()]
            self._cache = _Rows.concat(parts) if parts else _empty_rows()
        rows = self._cache
        order = rng.permutation(len(rows)) if rng is not None else None
        for b in range(worker_id, len(self), n_workers):
            index = slice(b * self.batch_size, (b + 1) * self.batch_size)
            yield rows.take(order[index] if order is not None else index).to_batch()

    def _iter_streamed(
        self, rng: np.random.Generator | None, worker_id: int, n_workers: int
    ) -> Iterator[CriteoBatch]:
        groups = self._row_groups()[worker_id::n_workers]
        if rng is None:
            yield from self._iter_in_order(groups)
            return
        groups = [groups[i] for i in rng.permutation(len(groups))]
        # Rows are gathered until a window is full, shuffled together, and cut into
        # batches; the rows left over from a window go into the next one.
        window = self.shuffle_buffer_rows
        pending: list[_Rows] = []
        pending_rows = 0
        for parquet, group in groups:
            part = self._read(parquet, group)
            pending.append(part)
            pending_rows += len(part)
            if pending_rows >= max(window, self.batch_size):
                rest = yield from self._emit(_Rows.concat(pending), rng, keep_tail=True)
                pending, pending_rows = [rest], len(rest)
        if pending_rows:
            yield from self._emit(_Rows.concat(pending), rng, keep_tail=False)

    def _iter_in_order(self, groups: list[tuple[pq.ParquetFile, int]]) -> Iterator[CriteoBatch]:
        """Batches in file order. A batch inside one row group is a view of it; only a
        batch that spans groups is copied together (its pieces, not the whole groups)."""
        size = self.batch_size
        carry: list[_Rows] = []  # the rows after the last batch, fewer than ``size``
        carried = 0
        for parquet, group in groups:
            part = self._read(parquet, group)
            start = 0
            if carried:
                start = min(size - carried, len(part))
                carry.append(part.take(slice(0, start)))
                carried += start
                if carried < size:
                    continue
                yield _Rows.concat(carry).to_batch()
                carry, carried = [], 0
            while len(part) - start >= size:
                yield part.take(slice(start, start + size)).to_batch()
                start += size
            if start < len(part):
                carry, carried = [part.take(slice(start, None))], len(part) - start
        if carried and not self.drop_last:
            yield _Rows.concat(carry).to_batch()

    def _emit(
        self, rows: _Rows, rng: np.random.Generator, keep_tail: bool
    ) -> Generator[CriteoBatch, None, _Rows]:
        """Yield full batches of ``rows`` shuffled by ``rng``; returns the partial tail when
        ``keep_tail``.

        Without ``keep_tail`` the tail becomes a final short batch (unless ``drop_last``).
        """
        rows = rows.take(rng.permutation(len(rows)))
        n_full = len(rows) // self.batch_size
        for b in range(n_full):
            yield rows.take(slice(b * self.batch_size, (b + 1) * self.batch_size)).to_batch()
        tail = rows.take(slice(n_full * self.batch_size, None))
        if keep_tail:
            return tail
        if len(tail) and not self.drop_last:
            yield tail.to_batch()
        return _empty_rows()


# Rows per block when columns are interleaved into rows: a block's output stays in cache
# while each column's values are written into it.
_ROW_BLOCK = 4096


def _row_major(table, columns: tuple[str, ...] | list[str], dtype) -> np.ndarray:
    """The named columns of ``table`` as one C-ordered (rows, columns) array of ``dtype``,
    filled a block of rows at a time (one pass, no column-major intermediate)."""
    values = [table.column(c).to_numpy() for c in columns]
    out = np.empty((table.num_rows, len(columns)), dtype)
    for start in range(0, table.num_rows, _ROW_BLOCK):
        block = slice(start, start + _ROW_BLOCK)
        rows = out[block]
        for i, column in enumerate(values):
            rows[:, i] = column[block]
    return out


def _empty_rows() -> _Rows:
    return _Rows(
        np.empty((0, len(DENSE_COLUMNS)), dtype=np.float32),
        np.empty((0, len(SPARSE_COLUMNS)), dtype=np.int64),
        np.empty(0, dtype=np.float32),
    )
