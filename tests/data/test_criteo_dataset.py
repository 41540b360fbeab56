"""Tests of the torch loader of prepared datasets (fuseml.data.CriteoDataset)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from fuseml.data import CriteoDataset, prepare, synth

ROWS = 3000


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small vocab-mode dataset with several files and row groups per split."""
    tmp = tmp_path_factory.mktemp("dataset")
    synth(ROWS, tmp / "synth.txt", seed=7, max_cardinality=2000, progress=False)
    prepare(
        tmp / "synth.txt",
        tmp / "prepared",
        mode="vocab",
        min_freq=2,
        chunk_rows=500,
        rows_per_file=900,
        progress=False,
    )
    return tmp / "prepared"


def _rows_of(batches: list) -> np.ndarray:
    """All rows of the batches as one (n, 40) array: label, dense, sparse."""
    return np.concatenate(
        [torch.cat([b.labels[:, None], b.dense, b.sparse.float()], dim=1).numpy() for b in batches]
    )


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def _parquet_rows(root: Path, split: str) -> np.ndarray:
    table = pq.read_table(root / split)
    return np.stack([table.column(c).to_numpy().astype(np.float32) for c in table.column_names], 1)


def test_batches_shapes_and_dtypes(prepared: Path) -> None:
    ds = CriteoDataset(prepared, "train", batch_size=256)
    batch = next(iter(ds))
    assert batch.dense.shape == (256, 13) and batch.dense.dtype == torch.float32
    assert batch.sparse.shape == (256, 26) and batch.sparse.dtype == torch.int64
    assert batch.labels.shape == (256,) and batch.labels.dtype == torch.float32
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    cards = torch.tensor(ds.cardinalities)
    assert len(cards) == 26
    assert ((batch.sparse >= 0) & (batch.sparse < cards)).all()


@pytest.mark.parametrize("max_cached_rows", [10**9, 0], ids=["cached", "streamed"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_exactly_once(prepared: Path, max_cached_rows: int, shuffle: bool) -> None:
    ds = CriteoDataset(
        prepared,
        "train",
        batch_size=100,
        shuffle=shuffle,
        max_cached_rows=max_cached_rows,
        shuffle_buffer_rows=700,
    )
    batches = list(ds)
    assert len(batches) == len(ds) == -(-ds.num_rows // 100)
    assert all(len(b.labels) == 100 for b in batches[:-1])
    rows, expected = _rows_of(batches), _parquet_rows(prepared, "train")
    if shuffle:
        assert not np.array_equal(rows, expected)
        rows, expected = _sorted_rows(rows), _sorted_rows(expected)
    np.testing.assert_array_equal(rows, expected)


@pytest.mark.parametrize("batch_size", [1, 7, 400, 450, 1000, 10**6])
@pytest.mark.parametrize("drop_last", [False, True])
def test_streamed_batches_across_row_groups(
    prepared: Path, batch_size: int, drop_last: bool
) -> None:
    # row groups of 500 and 400 rows: batches inside a group, across two, across several
    # (1000), and one batch of everything; every batch row-major and of the stated dtypes
    ds = CriteoDataset(
        prepared,
        "train",
        batch_size=batch_size,
        shuffle=False,
        drop_last=drop_last,
        max_cached_rows=0,
    )
    batches = list(ds)
    expected = _parquet_rows(prepared, "train")
    kept = len(expected) // batch_size * batch_size if drop_last else len(expected)
    assert len(batches) == len(ds)
    assert [len(b.labels) for b in batches] == [
        min(batch_size, kept - start) for start in range(0, kept, batch_size)
    ]
    for b in batches:
        assert b.dense.dtype == torch.float32 and b.sparse.dtype == torch.int64
        assert b.labels.dtype == torch.float32
        assert b.dense.is_contiguous() and b.sparse.is_contiguous()
    if batches:
        np.testing.assert_array_equal(_rows_of(batches), expected[:kept])


@pytest.mark.parametrize("max_cached_rows", [10**9, 0], ids=["cached", "streamed"])
def test_drop_last(prepared: Path, max_cached_rows: int) -> None:
    ds = CriteoDataset(
        prepared, "train", batch_size=128, drop_last=True, max_cached_rows=max_cached_rows
    )
    batches = list(ds)
    assert len(batches) == len(ds) == ds.num_rows // 128
    assert all(len(b.labels) == 128 for b in batches)


@pytest.mark.parametrize("max_cached_rows", [10**9, 0], ids=["cached", "streamed"])
def test_shuffle_is_seeded_and_changes_with_epoch(prepared: Path, max_cached_rows: int) -> None:
    def order(seed: int, epoch: int) -> np.ndarray:
        ds = CriteoDataset(
            prepared,
            "train",
            batch_size=500,
            seed=seed,
            max_cached_rows=max_cached_rows,
            shuffle_buffer_rows=1000,
        )
        ds.set_epoch(epoch)
        return _rows_of(list(ds))

    np.testing.assert_array_equal(order(0, 0), order(0, 0))
    assert not np.array_equal(order(0, 0), order(0, 1))
    assert not np.array_equal(order(0, 0), order(1, 0))


def test_eval_splits_are_not_shuffled_by_default(prepared: Path) -> None:
    for split in ("validation", "test"):
        ds = CriteoDataset(prepared, split, batch_size=64)
        assert not ds.shuffle
        np.testing.assert_array_equal(_rows_of(list(ds)), _parquet_rows(prepared, split))


def test_dataloader_workers_share_the_rows(prepared: Path) -> None:
    for max_cached_rows in (10**9, 0):
        ds = CriteoDataset(prepared, "train", batch_size=100, max_cached_rows=max_cached_rows)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        rows = _sorted_rows(_rows_of(list(loader)))
        np.testing.assert_array_equal(rows, _sorted_rows(_parquet_rows(prepared, "train")))


def test_bad_arguments(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        CriteoDataset(prepared, "dev")
    with pytest.raises(ValueError, match="batch_size"):
        CriteoDataset(prepared, batch_size=0)
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        CriteoDataset(tmp_path)
