"""Streaming reader for Criteo click logs in their original TSV format.

Every line of the Kaggle Display Advertising ``train.txt`` and of the Terabyte
``day_N`` files holds 40 tab-separated fields::

    label \\t I1 ... I13 \\t C1 ... C26

``label`` is 0 or 1; ``I1..I13`` are integer counts, possibly empty and occasionally
negative; ``C1..C26`` are categorical values written as 8-digit lowercase hex hashes
(``68fd1e64``), possibly empty. Kaggle's ``test.txt`` has no label column (39 fields):
pass ``has_label=False``. Files may be plain or gzip-compressed (recognised by content,
not by name); line endings may be LF or CRLF.

Public API::

    reader = CriteoReader(path, has_label=True, chunk_rows=262_144, skip_bad_lines=False)
    for chunk in reader:  # CriteoChunk: numpy arrays for up to `chunk_rows` lines
        chunk.labels, chunk.dense, chunk.dense_missing, chunk.sparse, chunk.line_numbers
    reader.skipped_lines, reader.summary()

A malformed line (wrong field count, non-integer count, category that is not 8 lowercase
hex digits, label other than 0/1) raises :class:`CriteoFormatError`, which names the file,
the 1-based line number and the problem. With ``skip_bad_lines=True`` such lines are
dropped instead; the reader counts them (``skipped_lines``), keeps the first few messages
(``skipped_examples``) and logs a warning, so nothing disappears silently.

How it works: the (decompressed) byte stream is cut into blocks of exactly ``chunk_rows``
lines, so the line number of every row is known, and memory stays bounded by one block.
Each block is parsed by ``pyarrow.csv.read_csv`` (multi-threaded, explicit column types:
label int8, I* nullable int64, C* string). A single ``pyarrow.csv.open_csv`` stream over
the whole file would be as fast but can neither say which line failed nor resume after
one. Only when pyarrow rejects a block, or a vectorised check of its result fails, is that
block re-scanned line by line by a strict pure-Python validator, which finds the exact
line or, when skipping, removes the bad lines before parsing the rest again.
"""

from __future__ import annotations

import gzip
import logging
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from fuseml.data.errors import Flag, InputError, OptionError, check_input_file

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DENSE_COLUMNS",
    "LABEL_COLUMN",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_COLUMNS",
    "CriteoChunk",
    "CriteoFormatError",
    "CriteoReader",
]

logger = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_SPARSE = 26
LABEL_COLUMN = "label"
DENSE_COLUMNS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_COLUMNS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
DEFAULT_CHUNK_ROWS = 262_144

_READ_BYTES = 1 << 24  # bytes per read() from the (decompressed) stream
_MAX_EXAMPLES = 10  # skipped-line messages kept on the reader and logged one by one
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-f]{8}")
# All bytes a well-formed file can contain (\r only inside CRLF, checked separately).
# pyarrow's integer parser is laxer than the format: it reads "0x1f" as 31 and " 5" as 5.
# A block containing any other byte is therefore handed to the strict validator.
_FORMAT_BYTES = b"0123456789abcdef-\t\n\r"
# Hex digit value of each byte, 255 for bytes that are not lowercase hex digits.
_HEX_VALUE = np.full(256, 255, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class CriteoFormatError(InputError):
    """A line of a Criteo TSV file that does not follow the format.

    Attributes: ``path``, ``line_number`` (1-based; also ``line``) and ``reason``.
    """

    def __init__(self, path: str | Path, line_number: int, reason: str) -> None:
        super().__init__(path, reason, line=line_number)
        self.line_number = line_number

    def __reduce__(self) -> tuple[type[CriteoFormatError], tuple[Path, int, str]]:
        return (type(self), (self.path, self.line_number, self.reason))


@dataclass(frozen=True, eq=False)
class CriteoChunk:
    """Parsed rows of one block of lines; all arrays are row-aligned.

    ``dense`` holds the raw integer counts with missing values stored as 0 and flagged in
    ``dense_missing``; ``sparse`` holds each category's hex value as an int (0..2**32-1),
    or -1 where the field was empty.
    """

    path: Path
    line_numbers: np.ndarray  # (n,) int64, 1-based line of each row in the file
    labels: np.ndarray | None  # (n,) int8 in {0, 1}; None when the file has no labels
    dense: np.ndarray  # (n, 13) int64
    dense_missing: np.ndarray  # (n, 13) bool
    sparse: np.ndarray  # (n, 26) int64

    @property
    def num_rows(self) -> int:
        """Number of rows in the chunk."""
        return len(self.line_numbers)


class CriteoReader:
    """Iterate over a Criteo TSV file (plain or .gz) in chunks of ``chunk_rows`` lines.

    Each iteration re-reads the file from the start and resets the counters
    (``lines_read``, ``rows_read``, ``skipped_lines``, ``skipped_examples``,
    ``bytes_read``); ``bytes_read`` counts bytes of the file on disk (compressed for .gz)
    so it can drive a progress bar against ``size_bytes``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        has_label: bool = True,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        skip_bad_lines: bool = False,
    ) -> None:
        if chunk_rows < 1:
            raise OptionError("{} must be at least 1, got {}", Flag("chunk_rows"), chunk_rows)
        self.path = Path(path)
        self.has_label = has_label
        self.chunk_rows = chunk_rows
        self.skip_bad_lines = skip_bad_lines
        self.num_fields = int(has_label) + NUM_DENSE + NUM_SPARSE
        self.size_bytes = check_input_file(self.path).stat().st_size  # fail early, naming why

        names = ([LABEL_COLUMN] if has_label else []) + [*DENSE_COLUMNS, *SPARSE_COLUMNS]
        types: dict[str, pa.DataType] = {LABEL_COLUMN: pa.int8()} if has_label else {}
        types.update({name: pa.int64() for name in DENSE_COLUMNS})
        types.update({name: pa.string() for name in SPARSE_COLUMNS})
        # 4 MiB parse blocks: still many per chunk for the threads to share, but fewer
        # (larger) arrays per column to decode than with the 1 MiB default.
        self._read_options = pa_csv.ReadOptions(
            column_names=names, use_threads=True, block_size=1 << 22
        )
        self._parse_options = pa_csv.ParseOptions(
            delimiter="\t",
            quote_char=False,  # the format has no quoting; '"' is simply an invalid byte
            double_quote=False,
            escape_char=False,
            newlines_in_values=False,
            ignore_empty_lines=False,  # an empty line is malformed and must not shift lines
        )
        self._convert_options = pa_csv.ConvertOptions(
            column_types=types,
            null_values=[""],  # only an empty field is missing; "NA", "nan" etc. are errors
            strings_can_be_null=True,
        )
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.lines_read = 0
        self.rows_read = 0
        self.skipped_lines = 0
        self.skipped_examples: list[str] = []
        self.bytes_read = 0

    def summary(self) -> str:
        """One line describing the last pass over the file."""
        text = f"{self.path}: {self.rows_read} rows from {self.lines_read} lines"
        if self.skip_bad_lines:
            text += f", {self.skipped_lines} malformed lines skipped"
        return text

    def __iter__(self) -> Iterator[CriteoChunk]:
        self._reset_counters()
        with open_maybe_gzip(self.path) as (raw, stream):
            first_line = 1
            for block, n_lines in self._blocks(stream):
                if first_line == 1:
                    _check_looks_like_text(self.path, block)
                self.bytes_read = raw.tell()
                chunk = self._parse_block(block, n_lines, first_line)
                first_line += n_lines
                self.lines_read += n_lines
                if chunk is not None:
                    self.rows_read += chunk.num_rows
                    yield chunk
            self.bytes_read = self.size_bytes
        if self.skipped_lines:
            logger.warning(self.summary())

    def _blocks(self, stream: _Readable) -> Iterator[tuple[bytes, int]]:
        """``_line_blocks``, with a read error naming the last line read before it."""
        blocks = _line_blocks(stream, self.chunk_rows)
        while True:
            try:
                item = next(blocks, None)
            except InputError as err:
                where = f", after line {self.lines_read:,}" if self.lines_read else ""
                raise InputError(err.path, err.reason + where) from err
            if item is None:
                return
            yield item

    # -- parsing ---------------------------------------------------------------------------

    def _parse_block(self, block: bytes, n_lines: int, first_line: int) -> CriteoChunk | None:
        """Parse one block; returns None when every line of it was skipped."""
        line_numbers = np.arange(first_line, first_line + n_lines, dtype=np.int64)
        table = self._arrow_parse(block, n_lines)
        chunk = None if table is None else self._to_chunk(table, line_numbers)
        if chunk is not None:
            return chunk

        # Slow path: something in the block is malformed. Find it line by line; this
        # raises in strict mode and drops (and counts) the bad lines otherwise.
        good, line_numbers = self._validate_lines(block, first_line)
        if not good:
            return None
        table = self._arrow_parse(b"\n".join(good) + b"\n", len(good))
        chunk = None if table is None else self._to_chunk(table, line_numbers)
        if chunk is None:  # the validator and the fast path disagree: a bug, not bad data
            raise RuntimeError(
                f"{self.path}, lines {first_line}-{first_line + n_lines - 1}: lines accepted "
                "by the line validator were rejected by the pyarrow parser"
            )
        return chunk

    def _arrow_parse(self, block: bytes, n_lines: int) -> pa.Table | None:
        """Parse a block with pyarrow; None if it needs the line-by-line validator."""
        if block.translate(None, _FORMAT_BYTES):
            return None  # bytes that cannot occur in a well-formed file
        n_cr = block.count(b"\r")
        if n_cr and n_cr != block.count(b"\r\n"):
            return None  # pyarrow would treat a lone \r as a line break and shift lines
        if block.count(b"\t") != n_lines * (self.num_fields - 1):
            return None  # pyarrow reads an empty line as an all-null row instead of failing
        try:
            table = pa_csv.read_csv(
                pa.py_buffer(block),
                read_options=self._read_options,
                parse_options=self._parse_options,
                convert_options=self._convert_options,
            )
        except pa.ArrowInvalid:
            return None
        return table if table.num_rows == n_lines else None

    def _to_chunk(self, table: pa.Table, line_numbers: np.ndarray) -> CriteoChunk | None:
        """Convert a parsed block to numpy; None if a label or category is malformed."""
        n = table.num_rows
        labels = None
        if self.has_label:
            column = table.column(LABEL_COLUMN)
            if column.null_count:
                return None
            labels = column.to_numpy().astype(np.int8, copy=False)
            if np.any((labels != 0) & (labels != 1)):
                return None
        dense = np.empty((n, NUM_DENSE), dtype=np.int64)
        dense_missing = np.empty((n, NUM_DENSE), dtype=bool)
        for j, name in enumerate(DENSE_COLUMNS):
            column = table.column(name)
            dense_missing[:, j] = column.is_null().to_numpy()
            dense[:, j] = pc.fill_null(column, 0).to_numpy()
        sparse = np.empty((n, NUM_SPARSE), dtype=np.int64)
        for j, name in enumerate(SPARSE_COLUMNS):
            values = _decode_hex_column(table.column(name))
            if values is None:
                return None
            sparse[:, j] = values
        return CriteoChunk(self.path, line_numbers, labels, dense, dense_missing, sparse)

    def _validate_lines(self, block: bytes, first_line: int) -> tuple[list[bytes], np.ndarray]:
        """Check each line; raise on the first bad one, or drop bad ones when skipping.

        Returns the good lines and their line numbers.
        """
        lines = block.split(b"\n")
        if block.endswith(b"\n"):
            lines.pop()  # the split leaves an empty string after the final newline
        good: list[bytes] = []
        numbers: list[int] = []
        for offset, line in enumerate(lines):
            reason = self._check_line(line)
            if reason is None:
                good.append(line)
                numbers.append(first_line + offset)
                continue
            error = CriteoFormatError(self.path, first_line + offset, reason)
            if not self.skip_bad_lines:
                raise error
            self.skipped_lines += 1
            if len(self.skipped_examples) < _MAX_EXAMPLES:
                self.skipped_examples.append(str(error))
                logger.warning("skipping malformed line: %s", error)
        return good, np.asarray(numbers, dtype=np.int64)

    def _check_line(self, line: bytes) -> str | None:
        """Return what is wrong with one line (without its newline), or None if valid."""
        if line.endswith(b"\r"):
            line = line[:-1]  # CRLF line ending
        fields = line.split(b"\t")
        if len(fields) != self.num_fields:
            if not line:
                return f"empty line (expected {self.num_fields} tab-separated fields)"
            reason = f"expected {self.num_fields} tab-separated fields, got {len(fields)}"
            if line.count(b",") == self.num_fields - 1:
                reason += " (the line looks comma-separated; Criteo files are tab-separated)"
            return reason
        if self.has_label:
            label = fields.pop(0)
            if not (_INT_RE.fullmatch(label) and int(label) in (0, 1)):
                return f"label must be 0 or 1, got {_show(label)}"
        for name, field in zip(DENSE_COLUMNS, fields[:NUM_DENSE]):
            if not field:
                continue
            if not _INT_RE.fullmatch(field):
                return f"{name} must be an integer or empty, got {_show(field)}"
            if not _INT64_MIN <= int(field) <= _INT64_MAX:
                return f"{name} does not fit in a 64-bit integer: {_show(field)}"
        for name, field in zip(SPARSE_COLUMNS, fields[NUM_DENSE:]):
            if field and not _HEX_RE.fullmatch(field):
                return f"{name} must be 8 lowercase hex digits or empty, got {_show(field)}"
        return None


@contextmanager
def open_maybe_gzip(path: Path) -> Iterator[tuple[BinaryIO, _Readable]]:
    """Open a file for binary reading, decompressing it if it is gzip (by magic number).

    Yields ``(raw, stream)``: ``raw.tell()`` is the position in the file on disk and
    ``stream`` gives the decompressed bytes. A file that cannot be opened or read, or gzip
    data that is truncated or corrupt, raises :class:`InputError` naming the file.
    """
    try:
        raw = path.open("rb")
    except OSError as err:
        raise InputError(path, f"cannot be opened ({err.strerror or err})") from err
    with raw:
        is_gzip = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        yield raw, _GuardedStream(path, gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip else raw)


class _GuardedStream:
    """A byte stream whose read errors become :class:`InputError` naming the file."""

    def __init__(self, path: Path, stream: _Readable) -> None:
        self.path = path
        self.stream = stream

    def read(self, size: int = -1, /) -> bytes:
        try:
            return self.stream.read(size)
        except EOFError as err:  # gzip: the file ends inside a compressed member
            raise InputError(self.path, "truncated gzip file: it ends too early") from err
        except (gzip.BadGzipFile, zlib.error) as err:
            raise InputError(self.path, f"corrupt gzip data: {err}") from err
        except OSError as err:
            raise InputError(self.path, f"cannot be read ({err.strerror or err})") from err


# Leading bytes of file formats that are sometimes passed by mistake.
_OTHER_FORMATS = {
    b"PAR1": "a parquet file (a dataset prepared already? give its folder to the command "
    "that reads prepared data)",
    b"PK\x03\x04": "a zip archive (unpack it first)",
    b"BZh": "bzip2-compressed (decompress it, or recompress it with gzip)",
    b"\xfd7zXZ": "xz-compressed (decompress it, or recompress it with gzip)",
    b"\x28\xb5\x2f\xfd": "zstd-compressed (decompress it, or recompress it with gzip)",
}


def _check_looks_like_text(path: Path, block: bytes) -> None:
    """Raise InputError if the first bytes show a binary file rather than Criteo TSV."""
    for magic, what in _OTHER_FORMATS.items():
        if block.startswith(magic):
            raise InputError(path, f"is not Criteo TSV: it is {what}")
    if b"\x00" in block[:65536]:
        raise InputError(path, "is not Criteo TSV: it holds binary data (NUL bytes)")


def _show(field: bytes, limit: int = 40) -> str:
    """Printable, truncated form of a field for error messages."""
    text = field.decode("utf-8", errors="backslashreplace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _line_blocks(stream: _Readable, lines_per_block: int) -> Iterator[tuple[bytes, int]]:
    """Yield ``(block, n_lines)``: consecutive blocks of ``lines_per_block`` whole lines.

    The last block may be shorter, and its last line may lack a final newline.
    """
    pieces: list[bytes] = []  # bytes of the block being assembled
    pending = 0  # complete lines in `pieces`
    while piece := stream.read(_READ_BYTES):
        n_newlines = piece.count(b"\n")
        if pending + n_newlines < lines_per_block:
            pieces.append(piece)
            pending += n_newlines
            continue
        newlines = np.flatnonzero(np.frombuffer(piece, dtype=np.uint8) == ord("\n"))
        start = 0
        k = lines_per_block - pending - 1  # index in `newlines` that completes the block
        while k < n_newlines:
            end = int(newlines[k]) + 1
            pieces.append(piece[start:end])
            yield b"".join(pieces), lines_per_block
            pieces, start = [], end
            k += lines_per_block
        pending = n_newlines - (k - lines_per_block + 1)
        if start < len(piece):
            pieces.append(piece[start:])
    rest = b"".join(pieces)
    if rest:
        yield rest, pending + (0 if rest.endswith(b"\n") else 1)


def _decode_hex_column(column: pa.ChunkedArray) -> np.ndarray | None:
    """Hex strings to ints (-1 where missing); None if any value is not 8 hex digits."""
    parts = []
    for array in column.chunks:
        values = _decode_hex_array(array)
        if values is None:
            return None
        parts.append(values)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _decode_hex_array(array: pa.StringArray) -> np.ndarray | None:
    """Vectorised decoding of one string array, working on its raw Arrow buffers."""
    n = len(array)
    values = np.full(n, -1, dtype=np.int64)
    if array.null_count == n:
        return values
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset : array.offset + n + 1]
    lengths = np.diff(offsets)
    if np.any(lengths[valid] != 8):
        return None
    data = np.frombuffer(array.buffers()[2], dtype=np.uint8)
    if np.any(lengths[~valid]):
        # Null slots normally take no bytes; if they do, gather the valid values one by one.
        raw = data[offsets[:-1][valid, None] + np.arange(8)]
    else:
        raw = data[offsets[0] : offsets[-1]].reshape(-1, 8)
    digits = _HEX_VALUE[raw]
    if np.any(digits == 255):
        return None
    # Two hex digits per byte, then the four bytes read as one big-endian uint32.
    packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
    values[valid] = packed.view(">u4").ravel()
    return values
