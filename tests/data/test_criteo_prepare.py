"""Tests of the DLRM preprocessing into parquet (fuseml.data.prepare)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from criteo_helpers import make_line, write_lines

from fuseml.data import (
    DENSE_COLUMNS,
    SPARSE_COLUMNS,
    CriteoFormatError,
    Vocabulary,
    load_metadata,
    prepare,
    synth,
)

# Six handwritten rows. C1 holds 0x0, 0xa (three times), 0xffffffff and one empty field,
# C2 is always empty, C3 alternates 0x1 / 0x2, C4..C26 are all 0x5.
C1 = ["00000000", "0000000a", "", "0000000a", "ffffffff", "0000000a"]
C3 = ["00000001", "00000002"] * 3
I1 = ["0", "1", "", "-3", "9", "1000"]
LABELS = ["1", "0", "0", "1", "0", "0"]


def _handwritten(tmp_path: Path) -> Path:
    lines = [
        make_line(LABELS[r], ints=[I1[r]] + ["2"] * 12, cats=[C1[r], "", C3[r]] + ["00000005"] * 23)
        for r in range(6)
    ]
    return write_lines(tmp_path / "train.txt", lines)


def _table(root: Path, split: str) -> dict[str, np.ndarray]:
    table = pq.read_table(root / split)
    return {name: table.column(name).to_numpy() for name in table.column_names}


ALL_TRAIN = {"val_fraction": 0.0, "test_fraction": 0.0, "progress": False}


def test_hash_mode_ids(tmp_path: Path) -> None:
    out = tmp_path / "out"
    meta = prepare(_handwritten(tmp_path), out, mode="hash", max_ind_range=10, **ALL_TRAIN)
    t = _table(out, "train")
    # id = 1 + value % 9, and 0 for missing; 0xffffffff = 4294967295 = 9 * 477218588 + 3.
    np.testing.assert_array_equal(t["C1"], [1, 2, 0, 2, 4, 2])
    np.testing.assert_array_equal(t["C2"], [0] * 6)
    np.testing.assert_array_equal(t["C3"], [2, 3] * 3)
    np.testing.assert_array_equal(t["C26"], [6] * 6)
    assert meta["cardinalities"] == [10] * 26
    assert meta["id_layout"] == {"missing": 0, "rare": None}
    assert t["C1"].dtype == np.int32 and meta["sparse_dtype"] == "int32"


def test_hash_mode_per_table_caps(tmp_path: Path) -> None:
    caps = [10] * 25 + [4]
    meta = prepare(
        _handwritten(tmp_path), tmp_path / "out", mode="hash", max_ind_range=caps, **ALL_TRAIN
    )
    assert meta["cardinalities"] == caps
    np.testing.assert_array_equal(_table(tmp_path / "out", "train")["C26"], [3] * 6)  # 1 + 5 % 3


def test_vocab_mode_ids(tmp_path: Path) -> None:
    src = _handwritten(tmp_path)
    meta = prepare(src, tmp_path / "f2", mode="vocab", min_freq=2, **ALL_TRAIN)
    t = _table(tmp_path / "f2", "train")
    # Only 0xa is seen twice or more: id 2; the others are rare (1); missing is 0.
    np.testing.assert_array_equal(t["C1"], [1, 2, 0, 2, 1, 2])
    np.testing.assert_array_equal(t["C2"], [0] * 6)
    np.testing.assert_array_equal(t["C3"], [2, 3] * 3)  # 0x1 and 0x2 are seen three times
    assert meta["cardinalities"] == [3, 2, 4] + [3] * 23
    assert meta["id_layout"] == {"missing": 0, "rare": 1}

    prepare(src, tmp_path / "f1", mode="vocab", min_freq=1, **ALL_TRAIN)
    # Every training value gets an id, in increasing order of value: 0x0, 0xa, 0xffffffff.
    np.testing.assert_array_equal(_table(tmp_path / "f1", "train")["C1"], [2, 3, 0, 3, 4, 3])
    vocab = Vocabulary.load(tmp_path / "f1" / "vocabulary.npz")
    np.testing.assert_array_equal(vocab.keys[0], [0, 10, 0xFFFFFFFF])
    assert vocab.cardinalities == load_metadata(tmp_path / "f1")["cardinalities"]


def test_vocab_cap_keeps_the_most_frequent_values(tmp_path: Path) -> None:
    meta = prepare(_handwritten(tmp_path), tmp_path / "out", max_ind_range=3, **ALL_TRAIN)
    assert meta["options"]["mode"] == "vocab" and meta["options"]["max_ind_range"] == [3] * 26
    t = _table(tmp_path / "out", "train")
    # Room for one value: C1 keeps 0xa (three times); C3's tie (0x1, 0x2) keeps the smaller.
    np.testing.assert_array_equal(t["C1"], [1, 2, 0, 2, 1, 2])
    np.testing.assert_array_equal(t["C3"], [2, 1] * 3)
    assert meta["cardinalities"] == [3, 2, 3] + [3] * 23  # C2 is always empty: 2 ids
    assert meta["distinct_values"] == [3, 0, 2] + [1] * 23


def test_dense_log_transform_and_labels(tmp_path: Path) -> None:
    prepare(_handwritten(tmp_path), tmp_path / "out", mode="hash", max_ind_range=10, **ALL_TRAIN)
    t = _table(tmp_path / "out", "train")
    # missing -> 0 and negative -> 0, then log(x + 1)
    expected = np.log(np.array([0, 1, 0, 0, 9, 1000], dtype=np.float64) + 1).astype(np.float32)
    np.testing.assert_array_equal(t["I1"], expected)
    np.testing.assert_array_equal(t["I2"], np.full(6, np.log(3), dtype=np.float32))
    assert t["I1"].dtype == np.float32
    np.testing.assert_array_equal(t["label"], [1, 0, 0, 1, 0, 0])
    assert set(t) == {"label", *DENSE_COLUMNS, *SPARSE_COLUMNS}


def test_metadata(tmp_path: Path) -> None:
    src = _handwritten(tmp_path)
    meta = prepare(src, tmp_path / "out", mode="vocab", min_freq=2, **ALL_TRAIN)
    assert load_metadata(tmp_path / "out") == json.loads(json.dumps(meta))
    assert meta["format_version"] == 1
    assert meta["rows"] == 6 and meta["positive_rate"] == pytest.approx(2 / 6)
    assert meta["splits"]["train"]["rows"] == 6
    assert meta["splits"]["train"]["files"] == ["train/part-00000.parquet"]
    assert meta["splits"]["test"]["rows"] == 0 and meta["splits"]["test"]["positive_rate"] is None
    assert meta["skipped_lines"] == 0
    assert meta["sources"][0]["name"] == "train.txt" and meta["sources"][0]["lines"] == 6
    assert meta["options"]["mode"] == "vocab" and meta["options"]["min_freq"] == 2
    # Empty splits still get a readable (empty) parquet file.
    assert pq.read_table(tmp_path / "out" / "test").num_rows == 0


def test_row_split_sizes_and_stability(tmp_path: Path) -> None:
    src = tmp_path / "synth.txt"
    synth(4000, src, seed=1, max_cardinality=500, progress=False)
    kwargs = {
        "mode": "hash",
        "max_ind_range": 1000,
        "val_fraction": 0.1,
        "test_fraction": 0.2,
        "progress": False,
    }
    meta = prepare(src, tmp_path / "a", chunk_rows=4000, **kwargs)
    sizes = {name: meta["splits"][name]["rows"] for name in ("train", "validation", "test")}
    assert sum(sizes.values()) == 4000
    # Binomial(4000, p) is within 5 standard deviations of its mean.
    for name, p in [("train", 0.7), ("validation", 0.1), ("test", 0.2)]:
        assert abs(sizes[name] - 4000 * p) < 5 * np.sqrt(4000 * p * (1 - p))

    # Same content with a different chunk size and several files per split.
    prepare(src, tmp_path / "b", chunk_rows=333, rows_per_file=1000, **kwargs)
    assert len(list((tmp_path / "b" / "train").glob("*.parquet"))) == 3
    for split in ("train", "validation", "test"):
        a, b = _table(tmp_path / "a", split), _table(tmp_path / "b", split)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])

    # Another seed gives another assignment.
    prepare(src, tmp_path / "c", seed=1, **kwargs)
    assert not np.array_equal(
        _table(tmp_path / "a", "test")["C1"], _table(tmp_path / "c", "test")["C1"]
    )


def test_day_split_last_day_halves(tmp_path: Path) -> None:
    day0 = write_lines(tmp_path / "day_0", [make_line("0", cats=["0000000a"] * 26)] * 4)
    day1_cats = [["0000000a"] * 26] * 2 + [["0000000b"] * 26] * 3  # 0xb is never in training
    day1 = write_lines(tmp_path / "day_1.gz", [make_line("1", cats=c) for c in day1_cats])
    meta = prepare([day0, day1], tmp_path / "out", mode="vocab", split="day", progress=False)
    # The last day's first half (rounded up) is test, the rest validation.
    assert {k: v["rows"] for k, v in meta["splits"].items()} == {
        "train": 4,
        "validation": 2,
        "test": 3,
    }
    np.testing.assert_array_equal(_table(tmp_path / "out", "test")["C1"], [2, 2, 1])
    np.testing.assert_array_equal(_table(tmp_path / "out", "validation")["C1"], [1, 1])
    assert [s["name"] for s in meta["sources"]] == ["day_0", "day_1.gz"]

    meta = prepare(
        [day0, day1],
        tmp_path / "all_test",
        split="day",
        val_fraction=0.0,
        mode="hash",
        max_ind_range=100,
        progress=False,
    )
    assert meta["splits"]["test"]["rows"] == 5 and meta["splits"]["validation"]["rows"] == 0


def test_skip_bad_lines_is_recorded(tmp_path: Path) -> None:
    lines = [make_line("0"), "garbage", make_line("1"), make_line("2"), make_line("0")]
    src = write_lines(tmp_path / "train.txt", lines)
    with pytest.raises(CriteoFormatError, match=r"train.txt, line 2: expected 40"):
        prepare(src, tmp_path / "strict", mode="hash", max_ind_range=10, progress=False)
    assert not (tmp_path / "strict").exists()
    assert not (tmp_path / ".strict.tmp").exists()

    meta = prepare(src, tmp_path / "out", mode="vocab", skip_bad_lines=True, **ALL_TRAIN)
    assert meta["skipped_lines"] == 2 and meta["rows"] == 3
    source = meta["sources"][0]
    assert (source["lines"], source["rows"], source["skipped_lines"]) == (5, 3, 2)
    assert "line 4: label must be 0 or 1" in source["skipped_examples"][1]


def test_rerun_over_stale_temporary_folder(tmp_path: Path) -> None:
    stale = tmp_path / ".out.tmp"
    (stale / "train").mkdir(parents=True)
    (stale / "train" / "part-00000.parquet").write_bytes(b"half-written by a killed run")
    (stale / "junk").write_text("x")
    prepare(_handwritten(tmp_path), tmp_path / "out", mode="hash", max_ind_range=10, **ALL_TRAIN)
    assert not stale.exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "metadata.json",
        "test",
        "train",
        "validation",
    ]
    assert _table(tmp_path / "out", "train")["label"].tolist() == [1, 0, 0, 1, 0, 0]


def test_existing_output_needs_overwrite_and_survives_failures(tmp_path: Path) -> None:
    src, out = _handwritten(tmp_path), tmp_path / "out"
    prepare(src, out, mode="hash", max_ind_range=10, **ALL_TRAIN)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        prepare(src, out, mode="hash", max_ind_range=10, **ALL_TRAIN)

    bad = write_lines(tmp_path / "bad.txt", [make_line(), "oops"])
    with pytest.raises(CriteoFormatError):
        prepare(bad, out, mode="hash", max_ind_range=20, overwrite=True, **ALL_TRAIN)
    assert load_metadata(out)["cardinalities"] == [10] * 26  # the old dataset is intact

    prepare(src, out, mode="hash", max_ind_range=20, overwrite=True, **ALL_TRAIN)
    assert load_metadata(out)["cardinalities"] == [20] * 26
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_deterministic(tmp_path: Path) -> None:
    src = tmp_path / "synth.txt"
    synth(1000, src, seed=2, max_cardinality=300, progress=False)
    metas = [
        prepare(src, tmp_path / name, mode="vocab", min_freq=2, seed=5, progress=False)
        for name in ("a", "b")
    ]
    assert metas[0] == metas[1]
    for split in ("train", "validation", "test"):
        a, b = _table(tmp_path / "a", split), _table(tmp_path / "b", split)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "hash"}, "needs max_ind_range"),
        ({"mode": "hash", "max_ind_range": 1}, "max_ind_range must be"),
        ({"mode": "hash", "max_ind_range": [10] * 3}, "max_ind_range must be"),
        ({"mode": "hash", "max_ind_range": 10, "min_freq": 3}, "min_freq is for"),
        ({"mode": "vocab", "min_freq": 0}, "min_freq"),
        ({"mode": "bloom"}, "mode must be"),
        ({"mode": "vocab", "val_fraction": 0.6, "test_fraction": 0.4}, "summing to < 1"),
        ({"mode": "vocab", "split": "day"}, "at least two day files"),
        ({"mode": "vocab", "split": "week"}, "split must be"),
    ],
)
def test_bad_options(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare(_handwritten(tmp_path), tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare(
            tmp_path / "nope.txt", tmp_path / "out", mode="hash", max_ind_range=10, progress=False
        )
