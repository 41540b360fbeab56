"""`fuseml env | bench` on a machine without a GPU: clear reports and clear refusals."""

import torch
from typer.testing import CliRunner

from fuseml.apps.cli import app

runner = CliRunner()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_env_reports_versions_and_backends():
    result = runner.invoke(app, ["env", "--no-build-cuda"])
    assert result.exit_code == 0, result.output
    out = _flat(result.output)
    assert torch.__version__ in out
    assert "backend triton (interpreter)" in out and "backend cuda (C++ twins)" in out
    if not torch.cuda.is_available():
        assert "CPU only" in out and "measured on a GPU only" in out
        assert "GEMM main loop" in out and "pointer-load kernel" in out
    assert "Triton install hash" in out and "triton-key" in out


def test_env_names_the_tuning_l2_mode(monkeypatch):
    monkeypatch.delenv("FUSEML_AUTOTUNE", raising=False)
    monkeypatch.setenv("FUSEML_TUNE_L2", "warm")
    assert "timings with the L2 warm" in _flat(
        runner.invoke(app, ["env", "--no-build-cuda"]).output
    )
    monkeypatch.setenv("FUSEML_TUNE_L2", "tepid")
    assert "FUSEML_TUNE_L2 must be" in _flat(runner.invoke(app, ["env", "--no-build-cuda"]).output)


def test_env_lists_every_setting_and_names_a_bad_value(monkeypatch):
    from fuseml import settings

    monkeypatch.setenv("FUSEML_PDL", "0")
    monkeypatch.setenv("FUSEML_COMPILE_THREADS", "many")
    out = _flat(runner.invoke(app, ["env", "--no-build-cuda"]).output)
    for row in settings.describe():
        assert row.name in out
    assert "0 (env)" in out
    assert "FUSEML_COMPILE_THREADS must be" in out and "'many'" in out


def test_bench_refuses_unknown_suite_and_cpu_timing():
    result = runner.invoke(app, ["bench", "nope"])
    assert result.exit_code == 2
    assert "suite must be one of" in _flat(result.output)
    if not torch.cuda.is_available():
        result = runner.invoke(app, ["bench", "elementwise", "--quick"])
        assert result.exit_code == 2
        assert "timings need a CUDA GPU" in _flat(result.output)
    result = runner.invoke(app, ["bench", "dlrm", "--cases", "kaggle/(bf16"])
    assert result.exit_code == 2
    assert "error: --cases is not a regular expression (missing ), unterminated subpattern" in (
        _flat(result.output)
    )


def test_bench_readme_regenerates_from_results(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "benchmarks", tmp_path / "benchmarks")
    (tmp_path / "README.md").write_text(
        "x\n<!-- fuseml:results:elementwise -->\nold\n<!-- /fuseml:results:elementwise -->\n"
    )
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["bench", "readme"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "README.md").read_text()
    assert "old" not in text and "| op | dtype | shape |" in text
