"""Tests of the streaming Criteo TSV reader."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from criteo_helpers import CATS, INTS, make_line, write_lines

from fuseml.data import CriteoFormatError, CriteoReader, InputError, synth


def _read_all(path: Path, **kwargs) -> tuple[CriteoReader, dict[str, np.ndarray]]:
    """Read a file and concatenate its chunks' arrays."""
    reader = CriteoReader(path, **kwargs)
    chunks = list(reader)
    fields = ["line_numbers", "dense", "dense_missing", "sparse"]
    if reader.has_label:
        fields.append("labels")
    arrays = {f: np.concatenate([getattr(c, f) for c in chunks]) for f in fields}
    return reader, arrays


def test_reads_handwritten_lines(tmp_path: Path) -> None:
    lines = [
        make_line("1"),
        make_line("0", ints=[""] * 13, cats=[""] * 26),  # everything missing
        make_line("0", ints=["-1", "0", "123456789012"] + ["4"] * 10),
    ]
    path = write_lines(tmp_path / "train.txt", lines)
    reader, out = _read_all(path)

    assert reader.lines_read == reader.rows_read == 3
    assert reader.skipped_lines == 0
    np.testing.assert_array_equal(out["line_numbers"], [1, 2, 3])
    np.testing.assert_array_equal(out["labels"], [1, 0, 0])
    assert out["labels"].dtype == np.int8
    np.testing.assert_array_equal(out["dense"][0], [1, 0, -2, 5, 0, 0, 12, 3, 0, 7, 0, 0, 9])
    np.testing.assert_array_equal(out["dense_missing"][0], [v == "" for v in INTS])
    assert out["dense_missing"][1].all() and (out["dense"][1] == 0).all()
    np.testing.assert_array_equal(out["dense"][2, :3], [-1, 0, 123456789012])
    # Categories are their hex value as an integer; -1 marks an empty field.
    assert out["sparse"][0, 0] == 0x68FD1E64
    assert out["sparse"][0, 1] == -1
    assert out["sparse"][0, 2] == 10
    assert (out["sparse"][0, 3:] == 0xFFFFFFFF).all()
    assert (out["sparse"][1] == -1).all()


def test_gzip_reads_like_plain(tmp_path: Path) -> None:
    lines = [make_line(str(i % 2)) for i in range(10)]
    _, plain = _read_all(write_lines(tmp_path / "a.txt", lines), chunk_rows=3)
    reader, packed = _read_all(write_lines(tmp_path / "a.txt.gz", lines), chunk_rows=3)
    for key in plain:
        np.testing.assert_array_equal(plain[key], packed[key])
    assert reader.bytes_read == reader.size_bytes


def test_gzip_is_detected_by_content_not_name(tmp_path: Path) -> None:
    gz = write_lines(tmp_path / "a.gz", [make_line()])
    renamed = gz.rename(tmp_path / "day_0")
    _, out = _read_all(renamed)
    assert out["sparse"][0, 0] == 0x68FD1E64


def test_file_without_label_column(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "test.txt", [make_line(None), make_line(None)])
    reader = CriteoReader(path, has_label=False)
    (chunk,) = list(reader)
    assert chunk.labels is None
    assert chunk.dense.shape == (2, 13) and chunk.sparse.shape == (2, 26)
    # A labelled line has 40 fields, one too many here.
    path = write_lines(tmp_path / "bad.txt", [make_line(None), make_line("1")])
    with pytest.raises(
        CriteoFormatError, match=r"line 2: expected 39 tab-separated fields, got 40"
    ):
        list(CriteoReader(path, has_label=False))


def test_crlf_and_missing_final_newline(tmp_path: Path) -> None:
    lines = [make_line("1"), make_line("0", cats=[*CATS[:-1], ""])]
    _, expected = _read_all(write_lines(tmp_path / "lf.txt", lines))
    for name, kwargs in [("crlf.txt", {"newline": "\r\n"}), ("nofinal.txt", {"final": False})]:
        _, out = _read_all(write_lines(tmp_path / name, lines, **kwargs))
        for key in expected:
            np.testing.assert_array_equal(out[key], expected[key])


def _with(index: int, value: str) -> str:
    """A valid line with field ``index`` (0 = label) replaced."""
    fields = make_line().split("\t")
    fields[index] = value
    return "\t".join(fields)


MALFORMED = {
    "too few fields": (make_line().rsplit("\t", 1)[0], "expected 40 tab-separated fields, got 39"),
    "too many fields": (make_line() + "\t1", "expected 40 tab-separated fields, got 41"),
    "empty line": ("", "empty line"),
    "word as count": (_with(1, "abc"), "I1 must be an integer or empty, got 'abc'"),
    "float count": (_with(5, "1.5"), "I5 must be an integer"),
    "hex count": (_with(2, "0x10"), "I2 must be an integer"),  # pyarrow alone accepts this
    "padded count": (_with(13, " 5"), "I13 must be an integer"),  # and this
    "NA count": (_with(3, "NA"), "I3 must be an integer"),
    "count overflow": (_with(4, "99999999999999999999"), "I4 does not fit in a 64-bit integer"),
    "non-hex category": (_with(14, "68fd1e6g"), "C1 must be 8 lowercase hex digits or empty"),
    "uppercase category": (_with(15, "68FD1E64"), "C2 must be 8 lowercase hex digits"),
    "short category": (_with(39, "68fd1e6"), "C26 must be 8 lowercase hex digits"),
    "negative category": (_with(20, "-1234567"), "C7 must be 8 lowercase hex digits"),
    "label 2": (_with(0, "2"), "label must be 0 or 1, got '2'"),
    "empty label": (_with(0, ""), "label must be 0 or 1, got ''"),
    "label word": (_with(0, "yes"), "label must be 0 or 1"),
    "stray carriage return": (_with(1, "1\r2"), "I1 must be an integer"),
}


@pytest.mark.parametrize("kind", MALFORMED)
@pytest.mark.parametrize("chunk_rows", [1, 2, 100])
def test_malformed_line_names_file_and_line(tmp_path: Path, kind: str, chunk_rows: int) -> None:
    bad, reason = MALFORMED[kind]
    path = write_lines(tmp_path / "train.txt", [make_line(), make_line(), bad, make_line()])
    with pytest.raises(CriteoFormatError) as info:
        list(CriteoReader(path, chunk_rows=chunk_rows))
    error = info.value
    assert isinstance(error, ValueError)
    assert error.line_number == 3 and error.path == path
    assert str(error).startswith(f"{path}, line 3: ")
    assert reason in str(error)


def test_first_bad_line_is_reported(tmp_path: Path) -> None:
    # A category error (found after parsing) before a field-count error (a parse error).
    lines = [make_line(), _with(14, "XXXXXXXX"), make_line()[:-9], make_line()]
    path = write_lines(tmp_path / "train.txt", lines)
    with pytest.raises(CriteoFormatError, match=r"line 2: C1 must be"):
        list(CriteoReader(path))


def test_skip_bad_lines_counts_and_keeps_the_rest(tmp_path: Path) -> None:
    lines = [make_line("0")] * 10
    bad_at = {3: MALFORMED["word as count"][0], 7: "", 8: MALFORMED["label 2"][0]}
    for line_number, bad in bad_at.items():
        lines[line_number - 1] = bad
    path = write_lines(tmp_path / "train.txt", lines)
    for chunk_rows in (1, 3, 100):
        reader, out = _read_all(path, chunk_rows=chunk_rows, skip_bad_lines=True)
        assert reader.skipped_lines == 3
        assert reader.lines_read == 10 and reader.rows_read == 7
        np.testing.assert_array_equal(out["line_numbers"], [1, 2, 4, 5, 6, 9, 10])
        assert "3 malformed lines skipped" in reader.summary()
        assert [m.split(":")[0] for m in reader.skipped_examples] == [
            f"{path}, line {n}" for n in bad_at
        ]


def test_chunk_that_is_entirely_bad_is_skipped(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "train.txt", [make_line(), "x", "y", make_line()])
    reader = CriteoReader(path, chunk_rows=2, skip_bad_lines=True)
    assert [c.line_numbers.tolist() for c in reader] == [[1], [4]]
    assert reader.skipped_lines == 2


def test_chunk_size_does_not_change_the_result(tmp_path: Path) -> None:
    path = tmp_path / "synth.txt"
    synth(500, path, seed=3, max_cardinality=1000, progress=False)
    _, expected = _read_all(path, chunk_rows=1_000_000)
    for chunk_rows in (1, 7, 64):
        reader, out = _read_all(path, chunk_rows=chunk_rows)
        assert reader.rows_read == 500
        for key in expected:
            np.testing.assert_array_equal(out[key], expected[key])


def test_empty_file_gives_no_chunks(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    reader = CriteoReader(path)
    assert list(reader) == [] and reader.rows_read == 0


def test_missing_file_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        CriteoReader(tmp_path / "nope.txt")
    path = write_lines(tmp_path / "a.txt", [make_line()])
    with pytest.raises(ValueError, match="chunk_rows"):
        CriteoReader(path, chunk_rows=0)


def test_format_error_survives_pickling(tmp_path: Path) -> None:
    error = CriteoFormatError(tmp_path / "x.txt", 12, "label must be 0 or 1, got '2'")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.line_number, copy.reason, str(copy)) == (
        error.path,
        error.line_number,
        error.reason,
        str(error),
    )


def _corrupt(line: str, kind: int) -> str:
    """A surely malformed variant of a valid line (kind selects how)."""
    fields = line.split("\t")
    if kind == 0:
        return "\t".join(fields[:-1])  # a field short
    if kind == 1:
        fields[1 + kind] = "x1"  # a count that is not a number
    elif kind == 2:
        fields[20] = "zzzzzzzz"  # a category that is not hex
    elif kind == 3:
        fields[0] = "3"  # a label that is not 0/1
    elif kind == 4:
        return ""  # an empty line
    else:
        fields[5] = " " + fields[5]  # padding, which pyarrow alone would accept
    return "\t".join(fields)


def test_random_bad_lines_are_skipped_exactly(tmp_path: Path) -> None:
    clean = tmp_path / "clean.txt"
    synth(300, clean, seed=4, max_cardinality=100, progress=False)
    good_lines = clean.read_text().splitlines()
    rng = np.random.default_rng(0)
    lines, good_numbers = [], []
    for line in good_lines:
        while rng.random() < 0.15:
            lines.append(_corrupt(line, int(rng.integers(6))))
        lines.append(line)
        good_numbers.append(len(lines))
    path = write_lines(tmp_path / "dirty.txt", lines)
    _, expected = _read_all(clean)
    for chunk_rows in (1, 5, 16, 37, 1000):
        reader, out = _read_all(path, chunk_rows=chunk_rows, skip_bad_lines=True)
        assert reader.skipped_lines == len(lines) - len(good_lines)
        np.testing.assert_array_equal(out["line_numbers"], good_numbers)
        for key in ("labels", "dense", "dense_missing", "sparse"):
            np.testing.assert_array_equal(out[key], expected[key])


def test_truncated_gzip_names_file_and_last_good_line(tmp_path: Path) -> None:
    import gzip

    # More than one read of the decompressed stream (16 MiB), so some lines come first.
    whole = gzip.compress(("\n".join([make_line()] * 100_000) + "\n").encode(), compresslevel=1)
    path = tmp_path / "cut.gz"
    path.write_bytes(whole[: len(whole) - 20])  # loses the end of the stream
    with pytest.raises(InputError, match=r"cut.gz: truncated gzip file: it ends too early") as info:
        list(CriteoReader(path, chunk_rows=10_000))
    assert re.search(r", after line \d0,000$", str(info.value)), str(info.value)


def test_binary_file_is_not_criteo(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(InputError, match="blob.bin: is not Criteo TSV: it holds binary data"):
        list(CriteoReader(path))
