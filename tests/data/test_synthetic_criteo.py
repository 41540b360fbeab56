"""Tests of the synthetic Criteo generator (fuseml.data.synth)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fuseml.data import KAGGLE_CARDINALITIES, CriteoReader, synth, synthetic_cardinalities


def _read(path: Path) -> dict[str, np.ndarray]:
    reader = CriteoReader(path, chunk_rows=5000)
    chunks = list(reader)
    assert reader.skipped_lines == 0
    return {
        f: np.concatenate([getattr(c, f) for c in chunks])
        for f in ("labels", "dense", "dense_missing", "sparse")
    }


@pytest.fixture(scope="module")
def synth20k(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    path = tmp_path_factory.mktemp("synth") / "train.txt"
    summary = synth(20_000, path, seed=0, scale=0.01, progress=False)
    return summary, _read(path)


def test_round_trips_through_the_reader(synth20k: tuple) -> None:
    summary, data = synth20k
    assert len(data["labels"]) == summary.rows == 20_000
    assert summary.positives == int(data["labels"].sum())
    probs = np.load(summary.probs_path)
    assert probs.shape == (20_000,) and probs.dtype == np.float32
    assert ((probs > 0) & (probs < 1)).all()
    # The reported best AUC is that of the sidecar probabilities against the file's labels.
    assert summary.best_auc == pytest.approx(roc_auc_score(data["labels"], probs))
    record = json.loads(summary.path.with_name("train.txt.summary.json").read_text())
    assert record["rows"] == 20_000 and record["best_auc"] == summary.best_auc


def test_positive_rate_and_best_auc(synth20k: tuple) -> None:
    summary, _ = synth20k
    assert summary.positive_rate == pytest.approx(0.25, abs=0.02)
    # Labels are predictable but noisy, like real click data (Criteo models reach ~0.80).
    assert 0.7 < summary.best_auc < 0.9


def test_realistic_statistics(synth20k: tuple) -> None:
    _, data = synth20k
    dense_missing = data["dense_missing"].mean(axis=0)
    sparse_missing = (data["sparse"] < 0).mean(axis=0)
    assert dense_missing[11] == pytest.approx(0.77, abs=0.03)  # I12
    assert dense_missing[1] == 0  # I2 is never missing
    assert sparse_missing[21] == pytest.approx(0.76, abs=0.03)  # C22
    assert sparse_missing[0] == 0  # C1
    negative = (data["dense"] < 0).mean(axis=0)
    assert 0.02 < negative[1] < 0.06  # I2
    assert negative[[0, *range(2, 8), *range(9, 13)]].sum() == 0  # only I2 and I9
    assert data["dense"][:, 4].max() > 10_000  # heavy-tailed counts (I5)
    # Zipf-like categories: C3 (huge table) has a long tail but a frequent head.
    c3 = data["sparse"][:, 2]
    _, counts = np.unique(c3[c3 >= 0], return_counts=True)
    assert counts.max() > 0.01 * len(c3) and (counts == 1).sum() > 1000


def test_cardinalities_respect_scale_and_cap(tmp_path: Path) -> None:
    assert synthetic_cardinalities() == list(KAGGLE_CARDINALITIES)
    assert synthetic_cardinalities(0.001)[:3] == [1, 1, 10131]
    cards = synthetic_cardinalities(0.1, max_cardinality=50)
    assert max(cards) == 50 and cards[8] == 1 and cards[5] == 2
    summary = synth(5000, tmp_path / "s.txt", seed=1, scale=0.1, max_cardinality=50, progress=False)
    assert summary.cardinalities == cards
    sparse = _read(tmp_path / "s.txt")["sparse"]
    for t, card in enumerate(cards):
        column = sparse[:, t]
        assert len(np.unique(column[column >= 0])) <= card
    with pytest.raises(ValueError, match="scale"):
        synthetic_cardinalities(0)
    with pytest.raises(ValueError, match="max_cardinality"):
        synthetic_cardinalities(1.0, max_cardinality=0)


def test_deterministic_and_independent_of_chunking(tmp_path: Path) -> None:
    kwargs = {"scale": 0.01, "progress": False}
    synth(3000, tmp_path / "a.txt", seed=5, **kwargs)
    synth(3000, tmp_path / "b.txt", seed=5, chunk_rows=777, **kwargs)
    synth(1000, tmp_path / "prefix.txt", seed=5, **kwargs)
    synth(3000, tmp_path / "other.txt", seed=6, **kwargs)
    a = (tmp_path / "a.txt").read_bytes()
    assert a == (tmp_path / "b.txt").read_bytes()
    assert a.startswith((tmp_path / "prefix.txt").read_bytes())
    assert a != (tmp_path / "other.txt").read_bytes()
    np.testing.assert_array_equal(
        np.load(tmp_path / "a.txt.probs.npy"), np.load(tmp_path / "b.txt.probs.npy")
    )


def test_gzip_output(tmp_path: Path) -> None:
    kwargs = {"seed": 2, "scale": 0.01, "progress": False}
    synth(500, tmp_path / "plain.txt", **kwargs)
    synth(500, tmp_path / "packed.txt.gz", gzip=True, **kwargs)
    synth(500, tmp_path / "again.txt.gz", gzip=True, **kwargs)
    packed = (tmp_path / "packed.txt.gz").read_bytes()
    assert gzip.decompress(packed) == (tmp_path / "plain.txt").read_bytes()
    assert packed == (tmp_path / "again.txt.gz").read_bytes()  # no timestamp or name inside
    assert len(_read(tmp_path / "packed.txt.gz")["labels"]) == 500


def test_no_temporary_files_left(tmp_path: Path) -> None:
    synth(100, tmp_path / "sub" / "s.txt", scale=0.01, progress=False)
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [
        "s.txt",
        "s.txt.probs.npy",
        "s.txt.summary.json",
    ]
    with pytest.raises(ValueError, match="rows"):
        synth(0, tmp_path / "t.txt", progress=False)
