"""The CLI for real users: predict never leaves a partial file, a user's error is one line
naming the flag or file (exit 2; -v shows the traceback), every option has help, training
refuses a model too big for memory, and results name full paths."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

import fuseml.apps.predict
import fuseml.apps.train
from fuseml.apps.cli import app
from fuseml.apps.common import RateColumn, check_fits_in_memory, human_bytes, training_bytes
from fuseml.apps.train import TrainOptions, train
from fuseml.data import prepare, synth
from fuseml.models import DLRMConfig

runner = CliRunner()
ROWS = 3000


def _flat(text: str) -> str:
    return " ".join(text.split())


def _error_line(result) -> str:
    """The last line of a failed command, checked to be its only error output."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Aborted" not in result.output
    return result.output.rstrip().splitlines()[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DLRM trained for one epoch on 3000 synthetic rows (vocab mode)."""
    root = tmp_path_factory.mktemp("cli-errors")
    raw = synth(ROWS, root / "raw.txt", seed=0, max_cardinality=5, progress=False).path
    prepare(raw, root / "prepared", mode="vocab", progress=False)
    options = TrainOptions(batch_size=512, out_dir=root / "run", progress=False)
    result = train("tiny", root / "prepared", options, console=Console(quiet=True))
    return raw, root / "prepared", result.checkpoint


def _predict(checkpoint, data, out, *extra: str):
    args = ["predict", "--checkpoint", str(checkpoint), "--data", str(data), "--out", str(out)]
    return runner.invoke(app, [*args, "--no-progress", *extra])


def _partials(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_predict_leaves_no_file_after_a_bad_line_part_way(trained, tmp_path, monkeypatch, suffix):
    checkpoint, raw = trained[2], trained[0]
    lines = raw.read_text().splitlines()
    lines[2499] = lines[2499].replace("\t", "\tx", 1)  # a non-numeric count on line 2500
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines) + "\n")
    # read 1000 rows at a time: two chunks (four batches) are scored and written first
    monkeypatch.setattr(fuseml.apps.predict, "_TSV_CHUNK_ROWS", 1000)
    written = []
    write = fuseml.apps.predict._Writer.write
    monkeypatch.setattr(
        fuseml.apps.predict._Writer, "write", lambda self, *a: written.append(1) or write(self, *a)
    )
    out = tmp_path / "out" / f"preds{suffix}"
    line = _error_line(_predict(checkpoint, bad, out, "--batch-size", "500"))
    assert len(written) == 4  # the failure came after rows were written
    assert "bad.txt" in line and "2500" in line, line
    assert not out.exists() and _partials(out.parent) == []

    # a killed earlier run's temporary goes; a later run writes every row
    stale = out.parent / f".{out.name}.{_dead_pid()}.partial"
    stale.write_bytes(b"half a file")
    result = _predict(checkpoint, raw, out, "--batch-size", "500")
    assert result.exit_code == 0, result.output
    assert _partials(out.parent) == []
    read = pq.read_table if suffix == ".parquet" else pa_csv.read_csv
    assert read(out).num_rows == ROWS
    # one result line, with the full path
    assert result.output.rstrip().splitlines()[-1] == f"wrote {out.resolve()} ({ROWS:,} rows)"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
def test_predict_killed_part_way_leaves_no_file(trained, tmp_path, sig):
    raw, _, checkpoint = trained
    out = tmp_path / "preds.csv"
    # The command as users run it, with every batch written slowly: killed part-way.
    code = (
        "import sys, time\n"
        "import fuseml.apps.predict as p\n"
        "write = p._Writer.write\n"
        "p._Writer.write = lambda self, *a: (write(self, *a), time.sleep(0.5))\n"
        "from fuseml.apps.cli import main\n"
        f"sys.argv = ['fuseml', 'predict', '--checkpoint', {str(checkpoint)!r}, '--data', "
        f"{str(raw)!r}, '--out', {str(out)!r}, '--batch-size', '100', '--no-progress']\n"
        "main()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    partial = tmp_path / f".{out.name}.{proc.pid}.partial"
    try:
        deadline = time.monotonic() + 120
        while not (partial.is_file() and partial.stat().st_size > 1000):  # rows, not a header
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no rows written in 120 s"
            time.sleep(0.1)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        assert code == (-sig if sig == signal.SIGKILL else 128 + sig), proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert not out.exists()  # rows were written, but not under --out
    # SIGTERM: removed on the way out; SIGKILL: left, and removed by the next run
    assert partial.is_file() == (sig == signal.SIGKILL)
    assert _predict(checkpoint, raw, out).exit_code == 0
    assert _partials(tmp_path) == [] and pa_csv.read_csv(out).num_rows == ROWS


def test_predict_to_a_folder_is_one_line_and_leaves_nothing(trained, tmp_path):
    folder = tmp_path / "preds.csv"
    folder.mkdir()
    line = _error_line(_predict(trained[2], trained[0], folder))
    assert str(folder) in line and _partials(tmp_path) == []


def test_predict_keeps_a_live_runs_temporary(trained, tmp_path):
    out = tmp_path / "preds.csv"
    live = tmp_path / f".{out.name}.{os.getppid()}.partial"  # the parent process: alive
    live.write_bytes(b"")
    assert _predict(trained[2], trained[0], out).exit_code == 0
    assert live.exists() and out.is_file()


def test_truncated_gzip_is_one_line_naming_the_file(trained, tmp_path):
    raw, _, checkpoint = trained
    packed = gzip.compress(raw.read_bytes())
    truncated = tmp_path / "day.txt.gz"
    truncated.write_bytes(packed[: len(packed) // 2])
    out = tmp_path / "p.csv"
    line = _error_line(_predict(checkpoint, truncated, out))
    assert line.startswith("error: ") and str(truncated) in line, line
    assert not out.exists() and _partials(tmp_path) == []

    result = runner.invoke(
        app,
        ["data", "prepare", str(truncated), "--out", str(tmp_path / "d"), "--max-ind-range", "8"],
    )
    assert str(truncated) in _error_line(result)

    # -v, before or after the command, shows the traceback as well
    args = ["predict", "--checkpoint", str(checkpoint), "--data", str(truncated)]
    args += ["--out", str(out), "--no-progress"]
    for verbose in (["-v", *args], [*args, "-v"], [*args, "--verbose"]):
        result = runner.invoke(app, verbose)
        assert result.exit_code == 2 and "Traceback" in result.output, verbose
        assert "EOFError" in result.output
        assert str(truncated) in result.output.rstrip().splitlines()[-1]
    assert "Traceback" not in runner.invoke(app, args).output  # and not the next time


class _InputError(ValueError):
    """As a data reader's error type: the file and line as attributes."""

    def __init__(self, message, path, line=None):
        super().__init__(message)
        self.path, self.line = path, line


class _Refusal(RuntimeError):
    """Not a ValueError, but meant for the user: it says so with ``user_message``."""

    user_message = "the accelerator is busy: try again later"


def test_errors_of_other_layers_show_as_one_line(trained, tmp_path, monkeypatch):
    raw, _, checkpoint = trained
    errors = [
        (
            _InputError("3 fields, not 40 or 39", raw, 7),
            f"error: {raw}, line 7: 3 fields, not 40 or 39",
        ),
        (_InputError(f"{raw}: line 7: 3 fields", raw, 7), f"error: {raw}: line 7: 3 fields"),
        (_Refusal("internal words"), "error: the accelerator is busy: try again later"),
    ]
    for err, expected in errors:

        def fail(*args, err=err, **kwargs):
            raise err

        monkeypatch.setattr(fuseml.apps.predict, "predict", fail)
        assert _error_line(_predict(checkpoint, raw, tmp_path / "p.csv")) == expected
    # anything else is a bug: its traceback is shown, exit code 1
    monkeypatch.setattr(fuseml.apps.predict, "predict", lambda *a, **k: 1 / 0)
    result = _predict(checkpoint, raw, tmp_path / "p.csv")
    assert result.exit_code == 1 and isinstance(result.exception, ZeroDivisionError)


def test_messages_name_flags_not_parameters(trained, tmp_path):
    _, data_dir, checkpoint = trained
    line = _error_line(_predict(checkpoint, data_dir, tmp_path / "p.csv", "--batch-size", "0"))
    assert "--batch-size must be at least 1, got 0" in line and "batch_size" not in line
    line = _error_line(
        runner.invoke(app, ["train", "--config", "tiny", "--synthetic", "100", "--lr", "-1"])
    )
    assert "--lr must be positive" in line
    line = _error_line(
        runner.invoke(app, ["train", "--config", "tiny", "--synthetic", "100", "--batch-size", "0"])
    )
    assert "--batch-size must be at least 1" in line
    (tmp_path / "emptydir").mkdir()
    line = _error_line(_predict(checkpoint, tmp_path / "emptydir", tmp_path / "p.csv"))
    assert "emptydir is not a prepared dataset" in line and "fuseml data prepare" in line, line

    # the messages name flags through OptionError, as the running command spells them
    line = _error_line(
        runner.invoke(app, ["train", "--config", "tiny", "--synthetic", "100", "--epochs", "0"])
    )
    assert "--epochs must be at least 1, got 0" in line
    line = _error_line(_predict(checkpoint, data_dir, tmp_path / "p.txt"))
    assert "--out must end in .parquet or .csv, got 'p.txt'" in line, line
    line = _error_line(runner.invoke(app, ["profile", "dlrm", "--steps", "0"]))
    assert "--steps and --batch-size must be at least 1, --warmup at least 0" in line


def test_option_errors_in_python_name_parameters():
    """Called from Python, the same errors name the function's parameters."""
    from fuseml.apps.train import TrainOptions
    from fuseml.data.errors import OptionError

    with pytest.raises(OptionError, match="^epochs must be at least 1, got 0$"):
        TrainOptions(epochs=0)


def _options(command) -> list:
    return [p for p in command.params if p.param_type_name == "option" and p.name != "help"]


def _commands(group, path=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_option_has_help_and_shows_its_default():
    group = typer.main.get_command(app)
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "``" not in result.output and "--verbose" in result.output
    assert all(p.help for p in _options(group))
    missing = []
    for path, command in _commands(group):
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, path
        assert "``" not in result.output, (path, result.output)  # no RST in --help
        for param in _options(command):
            if not param.help or not param.show_default:
                missing.append(f"{' '.join(path)} {param.opts[0]}")
    assert not missing


def test_training_refuses_a_model_too_big_for_memory(trained, tmp_path, monkeypatch):
    _, data_dir, _ = trained
    huge = tmp_path / "huge"
    huge.mkdir()
    for f in data_dir.iterdir():
        (huge / f.name).symlink_to(f)
    meta = json.loads((data_dir / "metadata.json").read_text())
    meta["cardinalities"] = [1_000_000_000] * 26  # 26 billion ids: terabytes to train
    (huge / "metadata.json").unlink()
    (huge / "metadata.json").write_text(json.dumps(meta))

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(fuseml.apps.train, "DLRM", no_model)
    args = ["train", "--config", "tiny", "--data", str(huge), "--out", str(tmp_path / "run")]
    line = _error_line(runner.invoke(app, [*args, "--no-progress"]))
    params, _ = training_bytes(DLRMConfig.from_name("tiny", cardinalities=meta["cardinalities"]))
    assert f"{params:,} parameters" in line, line
    assert "GB" in line and "--config" in line and "--max-ind-range" in line
    assert not (tmp_path / "run").exists()  # no empty run folder either


def test_memory_check_counts_what_training_keeps():
    import torch

    from fuseml.models import DLRM

    config = DLRMConfig.from_name("tiny", cardinalities=[7] * 26)
    params, need = training_bytes(config, "adam")
    assert params == sum(p.numel() for p in DLRM(config).parameters())
    assert need > params * 4 * 4  # weights, gradients, two moments and a margin
    assert check_fits_in_memory(config, torch.device("cpu"), "adam") == need
    with pytest.raises(ValueError, match=r"needs about 278 kB, but cpu has 100 kB free"):
        check_fits_in_memory(config, torch.device("cpu"), "adam", free=10**5)
    assert [human_bytes(n) for n in (0, 999, 1234, 2.5e9, 1.6e12, 2.4e15)] == [
        "0 B", "999 B", "1.23 kB", "2.5 GB", "1.6 TB", "2,400 TB"
    ]  # fmt: skip


def test_rates_name_their_unit():
    class Task:
        finished_speed, speed, elapsed, fields = None, 1234.4, 2.0, {"rows": 5000}

    assert RateColumn("samples").render(Task()).plain == "1,234 samples/s"
    assert RateColumn("rows", field="rows").render(Task()).plain == "2,500 rows/s"
