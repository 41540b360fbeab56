"""`fuseml train | predict | profile dlrm` from the command line: a synth -> prepare ->
train -> predict round trip, a profile, and clear errors."""

from __future__ import annotations

import json

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from fuseml.apps.cli import app
from fuseml.data import load_metadata, synth

runner = CliRunner()


def _ok(args: list[str]) -> str:
    """Run a command that must succeed; its output with line wrapping undone."""
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return _flat(result.output)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_synthetic_train_predict_round_trip(tmp_path, cache):
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--synthetic", "12000", "--max-cardinality", "20"]
    args += ["--optimizer", "adam", "--batch-size", "512", "--out", str(run), "--no-progress"]
    output = _ok(args)
    assert "best achievable AUC" in output and "DLRM training" in output
    checkpoint = run / "checkpoint.pt"
    assert f"checkpoint: {checkpoint.resolve()} " in output  # the full path
    assert checkpoint.is_file() and json.loads((run / "metrics.json").read_text())["test"]["auc"]
    (data_dir,) = (cache / "synthetic").glob("*/prepared")
    assert load_metadata(data_dir)["rows"] == 12000

    # resume for a second epoch
    _ok([*args, "--epochs", "2", "--resume", str(checkpoint)])
    assert len(json.loads((run / "metrics.json").read_text())["history"]) == 2

    # the prepared test split -> parquet
    out = tmp_path / "preds.parquet"
    output = _ok(["predict", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--out", str(out), "--no-progress"])  # fmt: skip
    assert "rows/s" in output
    test_rows = load_metadata(data_dir)["splits"]["test"]["rows"]
    assert pq.read_table(out).num_rows == test_rows

    # the raw TSV that was generated -> csv, every line
    (raw,) = (cache / "synthetic").glob("*/raw.txt")
    out = tmp_path / "preds.csv"
    _ok(["predict", "--checkpoint", str(checkpoint), "--data", str(raw), "--out", str(out), "--no-progress"])  # fmt: skip
    assert pa_csv.read_csv(out).num_rows == 12000


def test_data_synth_prepare_then_train_from_the_cli(tmp_path):
    raw = tmp_path / "raw.txt"
    _ok(["data", "synth", "--rows", "6000", "--out", str(raw), "--max-cardinality", "15"])
    _ok(["data", "prepare", str(raw), "--out", str(tmp_path / "data"), "--max-ind-range", "16"])
    assert load_metadata(tmp_path / "data")["options"]["max_ind_range"] == [16] * 26
    config = tmp_path / "mini.json"
    config.write_text(
        json.dumps({"name": "mini", "embedding_dim": 4, "bottom_mlp": [4], "top_mlp": [4, 1]})
    )
    _ok(["train", "--config", str(config), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


def test_profile_dlrm_writes_a_chrome_trace(tmp_path):
    output = _ok(["profile", "dlrm", "--config", "tiny", "--batch-size", "64", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])  # fmt: skip
    (trace,) = tmp_path.glob("dlrm-tiny-eager-fp32-bs64-cpu.json")
    assert f"trace: {trace.resolve()}" in output
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"dlrm.bottom_mlp", "dlrm.embeddings", "dlrm.interaction", "dlrm.top_mlp"} <= names
    assert "top ops by self CPU time" in output
    assert "Device (kernel) times need a CUDA GPU" in output


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_profile_dlrm_optimized_backend(tmp_path, backend):
    _ok(["profile", "dlrm", "--config", "tiny", "--backend", backend, "--batch-size", "64", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])  # fmt: skip
    (trace,) = tmp_path.glob(f"dlrm-tiny-{backend}-fp32-bs64-*.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"dlrm.bottom_mlp", "dlrm.top_mlp"} <= names  # stage ranges on the fused model
    # triton (the interpreter here): the fused gather + interaction, one range; auto on a
    # CPU: the DLRM's own forward, its two stages
    fused = "dlrm.embedding_interaction" in names
    assert fused == (backend == "triton")
    assert ({"dlrm.embeddings", "dlrm.interaction"} <= names) == (backend == "auto")


def test_errors_are_clear(tmp_path, cache):
    result = runner.invoke(app, ["train", "--config", "tiny"])
    assert result.exit_code == 2 and "exactly one of --data DIR and --synthetic ROWS" in _flat(
        result.output
    )
    result = runner.invoke(app, ["train", "--config", "tiny", "--synthetic", "-5"])
    assert result.exit_code == 2
    assert "error: --synthetic must be at least 1, got -5" in _flat(result.output)
    result = runner.invoke(
        app, ["train", "--config", "nope", "--synthetic", "3000", "--no-progress"]
    )
    assert result.exit_code == 2 and "neither a named config" in _flat(result.output)
    result = runner.invoke(app, ["predict", "--checkpoint", str(tmp_path / "x.pt"), "--data", str(tmp_path), "--out", "p.csv"])  # fmt: skip
    assert result.exit_code == 2 and "not found" in _flat(result.output)
    expected = "error: --backend must be one of ('auto', 'eager', 'compile', 'triton'), got 'tvm'"
    result = runner.invoke(app, ["profile", "dlrm", "--backend", "tvm"])
    assert result.exit_code == 2 and expected in _flat(result.output)
    result = runner.invoke(app, ["predict", "--checkpoint", str(tmp_path / "x.pt"), "--data", str(tmp_path), "--out", "p.csv", "--backend", "tvm"])  # fmt: skip
    assert result.exit_code == 2 and expected in _flat(result.output)


def test_backend_help_lists_every_model_backend():
    from fuseml.apps.common import MODEL_BACKENDS

    for command in (["predict"], ["profile", "dlrm"]):
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0
        help_text = _flat(result.output)
        assert all(name in help_text for name in MODEL_BACKENDS), help_text


def test_dlrm_demo_end_to_end_small(cache):
    from rich.console import Console

    from fuseml.apps.demo_dlrm import dlrm_demo

    console = Console(record=True, width=120)
    numbers = dlrm_demo(console, rows=20_000)
    assert 0.5 < numbers["test_auc"] < numbers["best_auc_test_split"]
    predictions = cache / "demo-dlrm" / "test-predictions.parquet"
    assert predictions.is_file()
    text = console.export_text()
    assert f"predictions: {predictions.resolve()}\n" in text  # the full path, not a bare name
    assert "DLRM demo summary" in text
    assert "fuseml.optimize" in text and "FusedMLP" in text  # the report of what it swapped
    assert numbers["checks"]["trained tiny model"]["ok"]
    assert "PASS optimized model vs float64" in _flat(text)


def test_eager_vs_compile_table_runs_on_cpu():
    import time

    from rich.console import Console

    from fuseml.apps.demo_dlrm import _eager_vs_compile

    def bench(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    console = Console(record=True, width=120)
    rates, checks = _eager_vs_compile(
        console, config="tiny", batch_sizes=(32,), device="cpu", dtype=torch.float32,
        max_cardinality=20, bench=bench,
    )  # fmt: skip
    assert set(rates[32]) == {"eager", "compile", "fused"} and rates[32]["fused"] > 0
    assert checks[32]["ok"] and checks[32]["tol"] == 1e-5
    assert "fuseml vs eager" in console.export_text()


class _Off(torch.nn.Module):
    """An optimized model whose probabilities are off by 0.5."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs) + 0.5


@pytest.fixture
def wrong_optimize(monkeypatch):
    import fuseml

    optimize = fuseml.optimize

    def wrong(model, **kwargs):
        fused, report = optimize(model, **kwargs)
        return _Off(fused), report

    monkeypatch.setattr(fuseml, "optimize", wrong)


def test_demo_check_passes_for_the_optimized_model_and_fails_for_a_wrong_one():
    from rich.console import Console

    import fuseml
    from fuseml.apps.demo_dlrm import check_optimized
    from fuseml.models import DLRM, DLRMConfig
    from fuseml.models.bench_cases import random_inputs

    model = DLRM(DLRMConfig.from_name("tiny", cardinalities=[4] * 26)).eval()
    dense, sparse = random_inputs(model.config, 64)
    fused, _ = fuseml.optimize(model)
    console = Console(record=True, width=200)
    check = check_optimized(console, model, fused, dense, sparse)
    assert check["ok"] and check["rel_err"] <= 1e-5 and check["max_diff"] <= 1e-4
    check = check_optimized(console, model, _Off(fused), dense, sparse)
    assert not check["ok"] and check["max_diff"] == pytest.approx(0.5, abs=1e-4)
    text = _flat(console.export_text())
    assert "eager model vs float64 (for context): relative error" in text
    assert "PASS optimized model vs float64: relative error" in text
    assert "FAIL: the optimized model's predictions are wrong: relative error" in text
    assert "worst probability difference 5.0e-01 (limit 1e-04)" in text


def test_eager_vs_compile_flags_a_wrong_fused_model(monkeypatch, wrong_optimize):
    from rich.console import Console

    from fuseml.apps.demo_dlrm import _eager_vs_compile

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # fast: not timed
    console = Console(record=True, width=200)
    _, checks = _eager_vs_compile(
        console, config="tiny", batch_sizes=(32,), device="cpu", dtype=torch.float32,
        max_cardinality=20, bench=lambda fn: 1.0,
    )  # fmt: skip
    assert not checks[32]["ok"]
    text = _flat(console.export_text())
    assert "WRONG" in text and "FAIL: at batch 32 the optimized model's predictions" in text


def test_cli_demo_exits_1_when_the_optimized_model_is_wrong(cache, monkeypatch, wrong_optimize):
    import functools

    import fuseml.apps.demo_dlrm
    import fuseml.apps.demo_elementwise
    import fuseml.apps.env

    # only the DLRM part, on few rows: the check is what is tested
    monkeypatch.setattr(fuseml.apps.env, "print_env", lambda **kwargs: None)
    monkeypatch.setattr(fuseml.apps.demo_elementwise, "elementwise_demo", lambda console: None)
    dlrm_demo = functools.partial(fuseml.apps.demo_dlrm.dlrm_demo, rows=5000)
    monkeypatch.setattr(fuseml.apps.demo_dlrm, "dlrm_demo", dlrm_demo)
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 1
    text = _flat(result.output)
    assert "FAIL: the optimized model's predictions are wrong" in text
    assert "DLRM demo summary" in text and "FAILED" in text  # printed before exiting
    last = result.output.rstrip().splitlines()[-1]  # one line, no traceback
    assert last.startswith("error: the optimized DLRM's predictions are wrong (trained tiny")
    assert "worst probability difference 5.0e-01 (limit 1e-04)" in last
    assert "Traceback" not in result.output


def test_data_prepare_reports_file_and_line_of_a_bad_line(tmp_path):
    raw = synth(50, tmp_path / "raw.txt", max_cardinality=5, progress=False).path
    lines = raw.read_text().splitlines()
    lines[6] = lines[6].replace("\t", "\tx", 1)  # a non-numeric count on line 7
    raw.write_text("\n".join(lines) + "\n")
    result = runner.invoke(app, ["data", "prepare", str(raw), "--out", str(tmp_path / "d"),
                                 "--max-ind-range", "8"])  # fmt: skip
    assert result.exit_code == 2
    assert "raw.txt" in _flat(result.output) and "line 7" in _flat(result.output)
    ok = runner.invoke(app, ["data", "prepare", str(raw), "--out", str(tmp_path / "d"),
                             "--max-ind-range", "8", "--skip-bad-lines"])  # fmt: skip
    assert ok.exit_code == 0, ok.output


def test_demo_fails_on_a_wrong_elementwise_result(monkeypatch):
    import fuseml.apps.demo
    import fuseml.apps.demo_dlrm
    import fuseml.apps.demo_elementwise
    import fuseml.apps.env

    monkeypatch.setattr(fuseml.apps.env, "print_env", lambda console: None)
    monkeypatch.setattr(fuseml.apps.demo_dlrm, "dlrm_demo", lambda console: {})
    monkeypatch.setattr(
        fuseml.apps.demo_elementwise, "elementwise_demo", lambda console: ["gelu (triton): ..."]
    )
    with pytest.raises(
        fuseml.apps.demo_dlrm.DemoCheckFailed, match=r"elementwise.*gelu \(triton\)"
    ):
        fuseml.apps.demo.run_demo()
