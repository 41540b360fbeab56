"""Turn Criteo TSV files into a DLRM-ready parquet dataset, the way the reference DLRM
(facebookresearch/dlrm) preprocesses them.

Public API::

    metadata = prepare(src, out_dir)  # vocab mode, every training value its own id
    metadata = prepare(src, out_dir, mode="vocab", min_freq=..., max_ind_range=..., ...)
    metadata = load_metadata(out_dir)
    transform_dense(dense, missing) -> float32 log(x + 1) features
    hash_sparse(values, max_ind_range) -> int64 ids
    Vocabulary: per-table value -> id map for "vocab" mode (saved as vocabulary.npz)

Transforms:

* dense: missing -> 0, negative -> 0, then ``log(x + 1)`` as float32.
* sparse, ``mode="vocab"`` (the default, as the reference DLRM): values seen at least
  ``min_freq`` times in the training split get ids ``2, 3, ...`` in increasing order of
  value; id 0 is "missing" and id 1 is "rare" (seen fewer than ``min_freq`` times, or never
  seen in training). Cardinality is ``2 + number of kept values``: each table is as large
  as its column needs, never larger. ``max_ind_range`` is an upper bound: a table whose
  column has more values keeps only its ``max_ind_range - 2`` most frequent ones. Needs two
  passes: count on training rows, then write.
* sparse, ``mode="hash"``: id 0 is "missing", a value v gets ``1 + v % (cap - 1)`` where
  ``cap`` is the table's ``max_ind_range``; every table then has cardinality ``cap``
  (one pass, no counting; for data whose distinct values do not fit in memory).

Splits:

* ``split="rows"``: each line goes to test with probability ``test_fraction``, to
  validation with ``val_fraction``, else to train, decided by a seeded hash of (file
  index, line number). The assignment is the same across runs, chunk sizes and skipped
  lines, and rows keep their file order within a split.
* ``split="day"``: ``src`` is a list of day files (day_0 ... day_N, in that order); all but
  the last are train; the last day's first lines are test and its final ``val_fraction``
  of lines validation (default 0.5: the halves used by the reference DLRM for Terabyte);
  ``val_fraction=0`` makes the whole last day test.

Output (``out_dir``)::

    metadata.json          format version, options (mode, caps), sources, rows and positive
                           rate per split, cardinalities (table sizes), distinct training
                           values per table (vocab mode), skipped lines
    vocabulary.npz         vocab mode only: the kept values of each table (C1..C26)
    train/part-00000.parquet, validation/..., test/...
        columns: label int8, I1..I13 float32 (transformed), C1..C26 int32 or int64 ids

The dataset is written into a temporary folder next to ``out_dir`` and renamed into place
only once complete; a temporary folder left by a killed run is removed at the start, so a
rerun never mixes old and new files.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.progress import Progress, TaskID

from fuseml.data import _hashing
from fuseml.data._progress import ROWS_FIELD, row_progress
from fuseml.data.criteo import (
    DEFAULT_CHUNK_ROWS,
    DENSE_COLUMNS,
    LABEL_COLUMN,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    CriteoChunk,
    CriteoReader,
    open_maybe_gzip,
)
from fuseml.data.errors import Flag, InputError, OptionError, OutputExistsError, check_input_file

__all__ = [
    "FORMAT_VERSION",
    "MISSING_ID",
    "RARE_ID",
    "SPLITS",
    "Vocabulary",
    "hash_sparse",
    "load_metadata",
    "prepare",
    "transform_dense",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
VOCABULARY_FILE = "vocabulary.npz"
SPLITS: tuple[str, ...] = ("train", "validation", "test")
MISSING_ID = 0  # id of an empty categorical field, in both modes
RARE_ID = 1  # vocab mode: id shared by values below min_freq or unseen in training
DEFAULT_ROWS_PER_FILE = 4_000_000
_TRAIN, _VALIDATION, _TEST = 0, 1, 2  # split codes, indices into SPLITS
_INT32_MAX = 2**31 - 1
_MAX_HASH_IDS = 2**32 + 1  # missing + one id per 32-bit value: a larger table is never used
_SPLIT_STREAM = 0x5350_4C49  # namespaces the row-split hash away from other hash users


# -- transforms ---------------------------------------------------------------------------


def transform_dense(dense: np.ndarray, missing: np.ndarray | None = None) -> np.ndarray:
    """DLRM's dense transform: missing and negative counts become 0, then log(x + 1)."""
    counts = np.maximum(dense, 0)
    if missing is not None:
        counts = np.where(missing, 0, counts)
    # log1p in float64 is exact for the small counts that dominate; stored as float32.
    return np.log1p(counts.astype(np.float64)).astype(np.float32)


def hash_sparse(values: np.ndarray, max_ind_range: Sequence[int]) -> np.ndarray:
    """Hash-mode ids for (n, 26) hex values (-1 = missing): 0 if missing, else 1 + v % (cap - 1)."""
    caps = np.asarray(max_ind_range, dtype=np.int64)
    if caps.shape != (values.shape[1],):
        raise OptionError("need one {} per table ({}), got {}", Flag("max_ind_range"),
                          values.shape[1], caps.shape)  # fmt: skip
    ids = 1 + values % (caps - 1)
    ids[values < 0] = MISSING_ID
    return ids


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """Values that get their own id, per table, sorted (``keys[t][i]`` has id ``2 + i``)."""

    keys: tuple[np.ndarray, ...]
    min_freq: int

    @property
    def cardinalities(self) -> list[int]:
        """Number of ids of each table, including the missing and rare ids."""
        return [2 + len(keys) for keys in self.keys]

    def lookup(self, values: np.ndarray) -> np.ndarray:
        """Map (n, 26) hex values (-1 = missing) to ids."""
        ids = np.full(values.shape, RARE_ID, dtype=np.int64)
        for t, keys in enumerate(self.keys):
            column = values[:, t]
            if len(keys):
                pos = np.searchsorted(keys, column)
                found = keys[np.minimum(pos, len(keys) - 1)] == column
                ids[found, t] = pos[found] + 2
            ids[column < 0, t] = MISSING_ID
        return ids

    def save(self, path: str | Path) -> None:
        """Write the kept values of each table (uint32, as in the hex strings)."""
        arrays = {name: keys.astype(np.uint32) for name, keys in zip(SPARSE_COLUMNS, self.keys)}
        np.savez(path, min_freq=np.int64(self.min_freq), **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Read a vocabulary written by :meth:`save`."""
        with np.load(path) as data:
            keys = tuple(data[name].astype(np.int64) for name in SPARSE_COLUMNS)
            return cls(keys=keys, min_freq=int(data["min_freq"]))


class _ValueCounter:
    """Exact per-table counts of category values, kept as sorted numpy arrays.

    Per-chunk counts are buffered and merged once the buffer outgrows the merged
    counts, so a table with millions of values is not re-sorted after every chunk.
    """

    def __init__(self, n_tables: int) -> None:
        self._keys = [np.empty(0, dtype=np.int64) for _ in range(n_tables)]
        self._counts = [np.empty(0, dtype=np.int64) for _ in range(n_tables)]
        self._pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_tables)]
        self._pending_size = [0] * n_tables

    def update(self, values: np.ndarray) -> None:
        """Count the values of an (n, n_tables) array; -1 (missing) is not counted."""
        for t in range(values.shape[1]):
            column = values[:, t]
            keys, counts = np.unique(column[column >= 0], return_counts=True)
            self._pending[t].append((keys, counts))
            self._pending_size[t] += len(keys)
            if self._pending_size[t] > max(len(self._keys[t]), 1 << 20):
                self._merge(t)

    def _merge(self, t: int) -> None:
        keys = np.concatenate([self._keys[t], *(k for k, _ in self._pending[t])])
        counts = np.concatenate([self._counts[t], *(c for _, c in self._pending[t])])
        self._pending[t], self._pending_size[t] = [], 0
        if len(keys) == 0:
            return
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        self._keys[t], self._counts[t] = keys[starts], np.add.reduceat(counts, starts)

    def distinct(self) -> list[int]:
        """Distinct values counted in each table."""
        for t in range(len(self._keys)):
            if self._pending[t]:
                self._merge(t)
        return [len(keys) for keys in self._keys]

    def vocabulary(self, min_freq: int, caps: Sequence[int] | None = None) -> Vocabulary:
        """Keep the values counted at least ``min_freq`` times; with ``caps``, at most
        ``cap - 2`` of them per table (the most frequent; ties go to the smaller value)."""
        self.distinct()  # merges what is pending
        kept = []
        for t, (keys, counts) in enumerate(zip(self._keys, self._counts)):
            frequent = counts >= min_freq
            keys, counts = keys[frequent], counts[frequent]
            room = None if caps is None else caps[t] - 2
            if room is not None and len(keys) > room:
                top = np.lexsort((keys, -counts))[:room]  # by count down, then value up
                keys = np.sort(keys[top])
            kept.append(keys)
        return Vocabulary(keys=tuple(kept), min_freq=min_freq)


# -- splitting ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Splitter:
    """Assigns the rows of a chunk to train / validation / test."""

    split: Literal["rows", "day"]
    val_fraction: float
    test_fraction: float
    seed: int
    n_files: int
    last_day_test_lines: int  # day split: lines of the last day that go to test

    def __call__(self, file_index: int, line_numbers: np.ndarray) -> np.ndarray:
        codes = np.full(len(line_numbers), _TRAIN, dtype=np.uint8)
        if self.split == "rows":
            key = _hashing.derive_key(_SPLIT_STREAM, self.seed, file_index)
            u = _hashing.uniform(key, line_numbers)
            codes[u < self.test_fraction + self.val_fraction] = _VALIDATION
            codes[u < self.test_fraction] = _TEST
        elif file_index == self.n_files - 1:
            codes[:] = _VALIDATION
            codes[line_numbers <= self.last_day_test_lines] = _TEST
        return codes


def split_of_lines(
    metadata: dict[str, Any], file_index: int, line_numbers: np.ndarray
) -> np.ndarray:
    """Index into SPLITS of the split each (1-based) line of source file ``file_index`` went
    to, for a dataset with this ``metadata`` (row split only; skipped lines included).

    Lets a caller line up per-row side data (say the generator's true probabilities) with
    the prepared splits without re-reading the source.
    """
    options = metadata["options"]
    if options["split"] != "rows":
        raise ValueError(f"split_of_lines needs a dataset split by rows, not {options['split']!r}")
    splitter = _Splitter(
        split="rows",
        val_fraction=options["val_fraction"],
        test_fraction=options["test_fraction"],
        seed=options["seed"],
        n_files=len(metadata["sources"]),
        last_day_test_lines=0,
    )
    return splitter(file_index, np.asarray(line_numbers, dtype=np.int64))


def _count_lines(path: Path) -> int:
    """Number of lines of a (possibly gzipped) file, counting a final unterminated line."""
    lines, last = 0, b"\n"
    with open_maybe_gzip(path) as (_, stream):
        while piece := stream.read(1 << 24):
            lines += piece.count(b"\n")
            last = piece[-1:]
    return lines + (last != b"\n")


# -- writing ------------------------------------------------------------------------------


class _SplitWriter:
    """Appends tables to ``directory/part-NNNNN.parquet`` files of at most ``rows_per_file`` rows."""

    def __init__(self, directory: Path, schema: pa.Schema, rows_per_file: int) -> None:
        self.directory = directory
        self.schema = schema
        self.rows_per_file = rows_per_file
        self.files: list[str] = []
        self.rows = 0
        self.positives = 0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0
        directory.mkdir(parents=True)

    def _open_next(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"part-{len(self.files):05d}.parquet"
        self.files.append(name)
        self._writer = pq.ParquetWriter(self.directory / name, self.schema)
        self._rows_in_file = 0

    def write(self, table: pa.Table, positives: int) -> None:
        self.rows += table.num_rows
        self.positives += positives
        while table.num_rows:
            if self._writer is None or self._rows_in_file >= self.rows_per_file:
                self._open_next()
            assert self._writer is not None
            part = table.slice(0, self.rows_per_file - self._rows_in_file)
            self._writer.write_table(part)
            self._rows_in_file += part.num_rows
            table = table.slice(part.num_rows)

    def close(self) -> None:
        if self._writer is None:
            self._open_next()  # an empty split still gets one (empty) file with the schema
        assert self._writer is not None
        self._writer.close()
        self._writer = None


def _schema(sparse_dtype: np.dtype) -> pa.Schema:
    sparse_type = pa.from_numpy_dtype(sparse_dtype)
    return pa.schema(
        [pa.field(LABEL_COLUMN, pa.int8(), nullable=False)]
        + [pa.field(name, pa.float32(), nullable=False) for name in DENSE_COLUMNS]
        + [pa.field(name, sparse_type, nullable=False) for name in SPARSE_COLUMNS]
    )


def _chunk_table(
    schema: pa.Schema, labels: np.ndarray, dense: np.ndarray, ids: np.ndarray
) -> pa.Table:
    """Arrow table of transformed rows: labels (n,), dense (n, 13), ids (n, 26) of the schema's type."""
    # Transposed copies make each column contiguous, so pyarrow wraps it without copying.
    dense_t = np.ascontiguousarray(dense.T)
    ids_t = np.ascontiguousarray(ids.T)
    arrays = [pa.array(labels, type=pa.int8())]
    arrays += [pa.array(column) for column in dense_t]
    arrays += [pa.array(column) for column in ids_t]
    return pa.Table.from_arrays(arrays, schema=schema)


# -- the pipeline -------------------------------------------------------------------------


def _read_all(
    readers: Sequence[CriteoReader], advance: Callable[[int, int], None]
) -> Iterator[tuple[int, CriteoChunk]]:
    """Chunks of all readers in order, with the reader's index; reports (bytes, rows) read.

    The bar's length is in bytes, the only size known before reading (for the time left);
    it shows rows and rows/s, the numbers a user can compare with their data.
    """
    for file_index, reader in enumerate(readers):
        done = 0
        for chunk in reader:
            advance(reader.bytes_read - done, chunk.num_rows)
            done = reader.bytes_read
            yield file_index, chunk
        advance(reader.bytes_read - done, 0)


def _advancer(bar: Progress, task: TaskID) -> Callable[[int, int], None]:
    rows = 0

    def advance(n_bytes: int, n_rows: int) -> None:
        nonlocal rows
        rows += n_rows
        bar.update(task, advance=n_bytes, **{ROWS_FIELD: rows})

    return advance


def prepare(
    src: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    *,
    mode: Literal["hash", "vocab"] = "vocab",
    max_ind_range: int | Sequence[int] | None = None,
    min_freq: int = 1,
    split: Literal["rows", "day"] = "rows",
    val_fraction: float | None = None,
    test_fraction: float | None = None,
    seed: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Preprocess Criteo TSV file(s) into a parquet dataset in ``out_dir``; see the module doc.

    Args:
        src: one file, or several (for ``split="day"``: the days in order).
        mode: "vocab" (default: every training value seen ``min_freq`` times gets its own
            id, tables sized to the data) or "hash" (needs ``max_ind_range``).
        max_ind_range: ids per table, one int for all or one per table (>= 2). Vocab: an
            upper bound (the most frequent values are kept); hash: every table's size.
        min_freq: vocab mode: training occurrences a value needs to get its own id.
        split: "rows" (seeded per-line assignment) or "day" (last file is val/test).
        val_fraction: rows: share of lines for validation (default 0.05); day: share of the
            last day, taken from its end, for validation (default 0.5).
        test_fraction: rows only: share of lines for test (default 0.05).
        seed: seed of the row split.
        chunk_rows: lines per chunk read (bounds memory; does not change the output).
        rows_per_file: maximum rows per parquet file.
        skip_bad_lines: skip and count malformed lines instead of raising.
        overwrite: replace an existing ``out_dir``.
        progress: show a progress bar.

    Returns:
        The metadata written to ``out_dir/metadata.json``.

    Raises:
        InputError: a source that is missing, a directory, unreadable, truncated gzip, not
            Criteo TSV, or (unless ``skip_bad_lines``) has a malformed line.
        OptionError: options that cannot work together.
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is false.
    """
    sources = [Path(src)] if isinstance(src, (str, Path)) else [Path(p) for p in src]
    out_dir = Path(out_dir)
    options = _check_options(
        sources,
        mode,
        max_ind_range,
        min_freq,
        split,
        val_fraction,
        test_fraction,
        chunk_rows,
        rows_per_file,
    )
    options.update(seed=seed, chunk_rows=chunk_rows, skip_bad_lines=skip_bad_lines)
    for path in sources:
        if (path / METADATA_FILE).is_file():
            raise InputError(path, "is a prepared dataset already, not a Criteo TSV file")
        check_input_file(path)
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(
            "{} already exists; pass {} to replace it", out_dir, Flag("overwrite", True)
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise OptionError("{} {} is a file, not a dataset folder", Flag("out_dir"), out_dir)

    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp_dir.exists():
        logger.warning("removing %s left over from an interrupted run", tmp_dir)
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    try:
        metadata = _prepare_into(tmp_dir, sources, options, progress)
        _move_into_place(tmp_dir, out_dir)
    except BaseException:
        # Also on KeyboardInterrupt: leave no half-written dataset behind.
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return metadata


def _check_options(
    sources: Sequence[Path],
    mode: str,
    max_ind_range: int | Sequence[int] | None,
    min_freq: int,
    split: str,
    val_fraction: float | None,
    test_fraction: float | None,
    chunk_rows: int,
    rows_per_file: int,
) -> dict[str, Any]:
    """Validate the arguments of ``prepare``; returns the resolved options."""
    if not sources:
        raise OptionError("{} names no files", Flag("src"))
    if chunk_rows < 1 or rows_per_file < 1:
        raise OptionError("{} and {} must be at least 1", Flag("chunk_rows"), Flag("rows_per_file"))
    if mode not in ("hash", "vocab"):
        raise OptionError("{} must be hash or vocab, got {!r}", Flag("mode"), mode)
    options: dict[str, Any] = {"mode": mode, "split": split, "rows_per_file": rows_per_file}
    caps: list[int] | None = None
    if max_ind_range is not None:
        if isinstance(max_ind_range, (int, np.integer)):
            max_ind_range = [int(max_ind_range)] * NUM_SPARSE
        caps = [int(c) for c in max_ind_range]
        if len(caps) != NUM_SPARSE or min(caps) < 2:
            raise OptionError(
                "{} must be one int >= 2 or {} of them (ids per table)",
                Flag("max_ind_range"),
                NUM_SPARSE,
            )
        # Ids beyond one per 32-bit value (+ missing) could never be used.
        caps = [min(c, _MAX_HASH_IDS) for c in caps]
    if mode == "hash":
        if caps is None:
            raise OptionError(
                "{} needs {} (ids per table); or leave out {} to size each table to its data",
                Flag("mode", "hash"),
                Flag("max_ind_range"),
                Flag("mode"),
            )
        if min_freq != 1:
            raise OptionError("{} is for {}", Flag("min_freq"), Flag("mode", "vocab"))
        options["max_ind_range"] = caps
    else:
        if min_freq < 1:
            raise OptionError("{} must be at least 1, got {}", Flag("min_freq"), min_freq)
        options.update(min_freq=min_freq, max_ind_range=caps)

    if split == "rows":
        val = 0.05 if val_fraction is None else val_fraction
        test = 0.05 if test_fraction is None else test_fraction
        if val < 0 or test < 0 or val + test >= 1:
            raise OptionError(
                "need {}, {} >= 0 summing to < 1, got {}, {}",
                Flag("val_fraction"),
                Flag("test_fraction"),
                val,
                test,
            )
        options.update(val_fraction=float(val), test_fraction=float(test))
    elif split == "day":
        if len(sources) < 2:
            raise OptionError(
                "{} needs at least two day files (all but the last train)", Flag("split", "day")
            )
        if test_fraction is not None:
            raise OptionError(
                "{} is for {}; by day, test is the last day",
                Flag("test_fraction"),
                Flag("split", "rows"),
            )
        val = 0.5 if val_fraction is None else val_fraction
        if not 0 <= val < 1:
            raise OptionError("{} must be in [0, 1), got {}", Flag("val_fraction"), val)
        options.update(val_fraction=float(val), test_fraction=None)
    else:
        raise OptionError("{} must be rows or day, got {!r}", Flag("split"), split)
    return options


def _prepare_into(
    out: Path, sources: Sequence[Path], options: dict[str, Any], show_progress: bool
) -> dict[str, Any]:
    """Run both passes, writing the dataset and its metadata into ``out``."""
    last_day_test_lines = 0
    if options["split"] == "day":
        n_last = _count_lines(sources[-1])
        last_day_test_lines = n_last - math.floor(n_last * options["val_fraction"])
    splitter = _Splitter(
        split=options["split"],
        val_fraction=options["val_fraction"],
        test_fraction=options["test_fraction"] or 0.0,
        seed=options["seed"],
        n_files=len(sources),
        last_day_test_lines=last_day_test_lines,
    )
    readers = [
        CriteoReader(p, chunk_rows=options["chunk_rows"], skip_bad_lines=options["skip_bad_lines"])
        for p in sources
    ]
    total_bytes = sum(r.size_bytes for r in readers)

    with row_progress(show_progress) as bar:
        vocabulary: Vocabulary | None = None
        distinct: list[int] | None = None
        if options["mode"] == "vocab":
            vocabulary, distinct = _count_vocabulary(readers, splitter, options, bar, total_bytes)
            vocabulary.save(out / VOCABULARY_FILE)
            cardinalities = vocabulary.cardinalities
        else:
            cardinalities = list(options["max_ind_range"])

        # Ids are < cardinality; int32 halves the size on disk whenever it can hold them.
        sparse_dtype = np.dtype(np.int32 if max(cardinalities) - 1 <= _INT32_MAX else np.int64)
        schema = _schema(sparse_dtype)
        writers = [_SplitWriter(out / name, schema, options["rows_per_file"]) for name in SPLITS]
        task = bar.add_task("writing parquet", total=total_bytes, **{ROWS_FIELD: 0})
        for file_index, chunk in _read_all(readers, _advancer(bar, task)):
            assert chunk.labels is not None  # readers are created with has_label=True
            codes = splitter(file_index, chunk.line_numbers)
            dense = transform_dense(chunk.dense, chunk.dense_missing)
            if vocabulary is not None:
                ids = vocabulary.lookup(chunk.sparse)
            else:
                ids = hash_sparse(chunk.sparse, options["max_ind_range"])
            ids = ids.astype(sparse_dtype, copy=False)
            for code, writer in enumerate(writers):
                rows = np.flatnonzero(codes == code)
                if len(rows):
                    labels = chunk.labels[rows]
                    table = _chunk_table(schema, labels, dense[rows], ids[rows])
                    writer.write(table, positives=int(labels.sum()))
        for writer in writers:
            writer.close()

    if sum(w.rows for w in writers) == 0:
        if len(sources) == 1:
            raise InputError(sources[0], "holds no data rows")
        raise OptionError("{} hold no data rows", ", ".join(map(str, sources)))
    if writers[_TRAIN].rows == 0:
        raise OptionError(
            "no training rows in {} rows: lower {}",
            sum(w.rows for w in writers),
            Flag("val_fraction") if options["split"] == "day" else Flag("test_fraction"),
        )
    metadata = _metadata(sources, readers, writers, options, cardinalities, sparse_dtype)
    metadata["distinct_values"] = distinct
    (out / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return metadata


def _count_vocabulary(
    readers: Sequence[CriteoReader],
    splitter: _Splitter,
    options: dict[str, Any],
    bar: Progress,
    total_bytes: int,
) -> tuple[Vocabulary, list[int]]:
    """First pass of vocab mode: count category values over the training rows.

    Returns the vocabulary and the number of distinct training values of each table.
    """
    counter = _ValueCounter(NUM_SPARSE)
    task: TaskID = bar.add_task("counting categories", total=total_bytes, **{ROWS_FIELD: 0})
    for file_index, chunk in _read_all(readers, _advancer(bar, task)):
        train = splitter(file_index, chunk.line_numbers) == _TRAIN
        counter.update(chunk.sparse[train])
    vocabulary = counter.vocabulary(options["min_freq"], options["max_ind_range"])
    return vocabulary, counter.distinct()


def _metadata(
    sources: Sequence[Path],
    readers: Sequence[CriteoReader],
    writers: Sequence[_SplitWriter],
    options: dict[str, Any],
    cardinalities: Sequence[int],
    sparse_dtype: np.dtype,
) -> dict[str, Any]:
    rows = sum(w.rows for w in writers)
    positives = sum(w.positives for w in writers)
    return {
        "format_version": FORMAT_VERSION,
        "label_column": LABEL_COLUMN,
        "dense_columns": list(DENSE_COLUMNS),
        "sparse_columns": list(SPARSE_COLUMNS),
        "num_dense": NUM_DENSE,
        "num_sparse": NUM_SPARSE,
        "sparse_dtype": sparse_dtype.name,
        "cardinalities": [int(c) for c in cardinalities],
        "id_layout": {
            "missing": MISSING_ID,
            "rare": RARE_ID if options["mode"] == "vocab" else None,
        },
        "rows": rows,
        "positive_rate": positives / rows if rows else None,
        "skipped_lines": sum(r.skipped_lines for r in readers),
        "splits": {
            name: {
                "rows": w.rows,
                "positives": w.positives,
                "positive_rate": w.positives / w.rows if w.rows else None,
                "files": [f"{name}/{f}" for f in w.files],
            }
            for name, w in zip(SPLITS, writers)
        },
        "sources": [
            {
                "name": path.name,
                "path": str(path.resolve()),
                "bytes": path.stat().st_size,
                "lines": reader.lines_read,
                "rows": reader.rows_read,
                "skipped_lines": reader.skipped_lines,
                "skipped_examples": reader.skipped_examples,
            }
            for path, reader in zip(sources, readers)
        ],
        "options": options,
    }


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp_dir`` to ``out_dir``, replacing an older dataset."""
    if not out_dir.exists():
        tmp_dir.rename(out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old")
    if old.exists():
        shutil.rmtree(old)
    out_dir.rename(old)
    tmp_dir.rename(out_dir)
    shutil.rmtree(old)


def load_metadata(root: str | Path) -> dict[str, Any]:
    """Read ``metadata.json`` of a prepared dataset, checking its format version."""
    path = Path(root) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{root} is not a prepared dataset (no {METADATA_FILE}): prepare one with "
            "fuseml data prepare"
        )
    metadata = json.loads(path.read_text())
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{root} has dataset format version {version}, this code reads {FORMAT_VERSION}: "
            "prepare it again"
        )
    return metadata
