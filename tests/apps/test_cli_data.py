"""`fuseml data prepare | synth` from the command line: defaults that size tables to the
data, one-line errors naming the file (and line) or the flag, output for people."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from fuseml.apps.cli import app
from fuseml.data import load_metadata, synth

runner = CliRunner()


def _ok(args: list[str]) -> str:
    """Run a command that must succeed; its output."""
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _error(args: list[str]) -> str:
    """Run a command that must fail as a user error: exit 2, one line, no traceback."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output + repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    """A small synthetic Criteo file whose tables have at most 7 distinct values."""
    return synth(3000, tmp_path / "raw.txt", seed=3, max_cardinality=7, progress=False).path


def _distinct_train_values(data: Path) -> list[int]:
    return load_metadata(data)["distinct_values"]


# -- 1. no flags needed; tables sized to the data --------------------------------------------


def test_prepare_with_no_flags_sizes_every_table_to_its_data(tmp_path: Path, raw: Path) -> None:
    out = _ok(["data", "prepare", str(raw), "--out", str(tmp_path / "d"), "--no-progress"])
    meta = load_metadata(tmp_path / "d")
    assert meta["options"]["mode"] == "vocab" and meta["options"]["min_freq"] == 1
    assert meta["options"]["max_ind_range"] is None
    distinct = meta["distinct_values"]
    # A table: missing + unseen-in-training + one id per distinct training value.
    assert meta["cardinalities"] == [2 + d for d in distinct]
    assert max(distinct) <= 7 and max(meta["cardinalities"]) <= 9
    train = pq.read_table(tmp_path / "d" / "train")
    for t, card in enumerate(meta["cardinalities"]):
        assert pa.compute.max(train.column(f"C{t + 1}")).as_py() < card
    # One summary line, numbers for people.
    (line,) = out.strip().splitlines()
    assert line.startswith(f"wrote {tmp_path / 'd'}: 3,000 rows (train ")
    assert "vocab mode" in line and "rows/s" in line
    assert not re.search(r"\d\.\d{4,}", line)  # no long fractions


def test_max_ind_range_is_an_upper_bound(tmp_path: Path, raw: Path) -> None:
    _ok(["data", "prepare", str(raw), "--out", str(tmp_path / "d"), "--max-ind-range", "6", "--no-progress"])  # fmt: skip
    meta = load_metadata(tmp_path / "d")
    assert meta["options"]["max_ind_range"] == [6] * 26
    # Tables with few values stay small; the others keep their 4 most frequent values.
    assert meta["cardinalities"] == [min(6, 2 + d) for d in meta["distinct_values"]]
    assert min(meta["distinct_values"]) < 4 < max(meta["distinct_values"])

    # A cap far above the data changes nothing.
    _ok(["data", "prepare", str(raw), "--out", str(tmp_path / "big"), "--max-ind-range", "10000000", "--no-progress"])  # fmt: skip
    assert load_metadata(tmp_path / "big")["cardinalities"] == [
        2 + d for d in meta["distinct_values"]
    ]


def test_hash_mode_still_needs_its_size(tmp_path: Path, raw: Path) -> None:
    line = _error(["data", "prepare", str(raw), "--out", str(tmp_path / "d"), "--mode", "hash"])
    assert "--mode hash needs --max-ind-range" in line and "max_ind_range" not in line
    _ok(["data", "prepare", str(raw), "--out", str(tmp_path / "d"), "--mode", "hash", "--max-ind-range", "11", "--no-progress"])  # fmt: skip
    assert load_metadata(tmp_path / "d")["cardinalities"] == [11] * 26


def test_option_errors_name_flags(tmp_path: Path, raw: Path) -> None:
    out = tmp_path / "d"
    _ok(["data", "prepare", str(raw), "--out", str(out), "--no-progress"])
    line = _error(["data", "prepare", str(raw), "--out", str(out)])
    assert f"{out} already exists; pass --overwrite to replace it" in line
    assert "overwrite=True" not in line
    line = _error(["data", "prepare", str(raw), "--out", str(tmp_path / "e"), "--min-freq", "0"])
    assert "--min-freq must be at least 1" in line
    line = _error(["data", "prepare", str(raw), "--out", str(tmp_path / "e"), "--mode", "bloom"])
    assert "--mode must be hash or vocab" in line
    line = _error(["data", "prepare", str(raw), "--out", str(tmp_path / "e"), "--val-fraction", "0.6", "--test-fraction", "0.5"])  # fmt: skip
    assert "--val-fraction, --test-fraction" in line
    line = _error(["data", "synth", "--rows", "0", "--out", str(tmp_path / "s.tsv")])
    assert "--rows must be at least 1" in line
    line = _error(["data", "synth", "--rows", "5", "--out", str(tmp_path)])
    assert f"--out {tmp_path} is a folder" in line


# -- 2. every input fault: one line naming the file (and line) ------------------------------


def _prepare_error(src: Path, tmp_path: Path) -> str:
    return _error(["data", "prepare", str(src), "--out", str(tmp_path / "out"), "--no-progress"])


def test_truncated_gzip(tmp_path: Path, raw: Path) -> None:
    whole = gzip.compress(raw.read_bytes())
    src = tmp_path / "cut.txt.gz"
    src.write_bytes(whole[: len(whole) // 2])
    line = _prepare_error(src, tmp_path)
    assert f"{src}: truncated gzip file" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.tmp").exists()


def test_corrupt_gzip(tmp_path: Path, raw: Path) -> None:
    data = bytearray(gzip.compress(raw.read_bytes()))
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xff" * 64
    src = tmp_path / "bad.gz"
    src.write_bytes(bytes(data))
    line = _prepare_error(src, tmp_path)
    assert line.startswith(f"error: {src}") and "gzip" in line


def test_directory_given_as_a_file(tmp_path: Path) -> None:
    (tmp_path / "days").mkdir()
    line = _prepare_error(tmp_path / "days", tmp_path)
    assert f"{tmp_path / 'days'}: is a directory" in line and "not found" not in line


def test_missing_file(tmp_path: Path) -> None:
    assert f"{tmp_path / 'nope.txt'}: no such file" in _prepare_error(
        tmp_path / "nope.txt", tmp_path
    )


def test_unreadable_file(tmp_path: Path, raw: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() == 0:  # root reads files whatever their mode: pretend it cannot
        monkeypatch.setattr("fuseml.data.errors.os.access", lambda path, mode: False)
    raw.chmod(0)
    try:
        assert f"{raw}: cannot be read (permission denied)" in _prepare_error(raw, tmp_path)
    finally:
        raw.chmod(0o644)


def test_parquet_passed_as_tsv(tmp_path: Path) -> None:
    src = tmp_path / "part.parquet"
    pq.write_table(pa.table({"label": [0, 1, 0]}), src)
    line = _prepare_error(src, tmp_path)
    assert f"{src}: is not Criteo TSV: it is a parquet file" in line


def test_comma_separated_text(tmp_path: Path, raw: Path) -> None:
    src = tmp_path / "train.csv"
    src.write_text(raw.read_text().replace("\t", ","))
    line = _prepare_error(src, tmp_path)
    assert f"{src}, line 1:" in line and "comma-separated" in line


def test_malformed_line_names_file_and_line(tmp_path: Path, raw: Path) -> None:
    lines = raw.read_text().splitlines()
    lines[1233] = lines[1233].replace("\t", "\tNA", 1)
    raw.write_text("\n".join(lines) + "\n")
    line = _prepare_error(raw, tmp_path)
    assert f"{raw}, line 1234: I1 must be an integer or empty, got 'NA" in line


def test_empty_file(tmp_path: Path) -> None:
    src = tmp_path / "empty.txt"
    src.write_bytes(b"")
    assert f"{src}: holds no data rows" in _prepare_error(src, tmp_path)


# -- 3. output for people; help with text and defaults --------------------------------------


def test_synth_prints_its_result_once(tmp_path: Path) -> None:
    out = _ok(["data", "synth", "--rows", "2000", "--out", str(tmp_path / "s.tsv"), "--max-cardinality", "9", "--no-progress"])  # fmt: skip
    (line,) = out.strip().splitlines()
    assert re.fullmatch(
        rf"wrote {re.escape(str(tmp_path / 's.tsv'))}: 2,000 rows, \d+\.\d% positive, best "
        r"achievable AUC 0\.\d{4} \(true probabilities in .*s\.tsv\.probs\.npy\)",
        line,
    ), line
    summary = json.loads((tmp_path / "s.tsv.summary.json").read_text())
    assert summary["rows"] == 2000


def test_prepare_progress_counts_rows(tmp_path: Path, raw: Path) -> None:
    from fuseml.data._progress import human_count, human_rate, row_progress

    with row_progress(True) as bar:
        task = bar.add_task("x", total=10, rows=123_456)
        column = bar.columns[3]
        bar.tasks[0].start_time = bar.get_time() - 2.0
        text = column.render(bar.tasks[0]).plain
    assert text == "123,456 rows  61.7k rows/s" and task == 0
    assert human_count(45_840_617) == "45.8M" and human_rate(1234.5678) == "1.23k"


@pytest.mark.parametrize("command", ["prepare", "synth"])
def test_every_option_has_help_and_default(command: str) -> None:
    cmd = get_command(app).commands["data"].commands[command]  # type: ignore[attr-defined]
    for param in cmd.params:
        if param.param_type_name != "option" or param.name == "help":
            continue
        assert param.help, f"{command} --{param.name} has no help"
        # A default shown as is, or described (None stands for a choice made from the data).
        shown = param.show_default is not False and param.default is not None
        assert param.required or shown or isinstance(param.show_default, str), param.name
    text = " ".join(runner.invoke(app, ["data", command, "--help"]).output.split())
    assert "``" not in text
    n_defaults = sum(1 for p in cmd.params if not p.required and p.name != "help")
    assert text.count("[default: ") == n_defaults
