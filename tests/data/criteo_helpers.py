"""Helpers shared by the data tests: handwritten Criteo lines."""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path

# A valid line's fields: label, 13 counts (some empty, one negative), 26 categories.
INTS = ["1", "", "-2", "5", "", "0", "12", "3", "", "7", "", "", "9"]
CATS = ["68fd1e64", "", "0000000a"] + ["ffffffff"] * 23


def make_line(
    label: str | None = "1", ints: Sequence[str] = INTS, cats: Sequence[str] = CATS
) -> str:
    """One TSV line (without newline); label=None leaves out the label column."""
    fields = ([] if label is None else [label]) + list(ints) + list(cats)
    return "\t".join(fields)


def write_lines(
    path: Path, lines: Sequence[str], *, newline: str = "\n", final: bool = True
) -> Path:
    """Write lines (gzip if the name ends in .gz); ``final=False`` omits the last newline."""
    data = (newline.join(lines) + (newline if final else "")).encode()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path
