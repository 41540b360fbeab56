"""Test setup: on a machine without CUDA, Triton kernels run under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any
fuseml import.

Tests leave nothing behind: files go to ``tmp_path`` (pytest removes the folders of passing
runs: see the Makefile), torch.compile's cache to a folder removed when the run ends, and
the run ends with a note naming what else appeared in the temporary folder.
"""

import os
import shutil
import tempfile
from pathlib import Path

from gpu_workers import worker_gpu

# A GPU check over several GPUs (CHECK_GPUS, see gpu_workers): this worker's one GPU, set
# before torch first asks the driver, which fixes the visible devices for the process.
if _gpu := worker_gpu(os.environ.get("CHECK_GPUS", ""), os.environ.get("PYTEST_XDIST_WORKER", "")):
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpu

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GEMM configs are not tuned per test shape (minutes of compiling on a GPU): tests run the
# default config, every candidate config has its own correctness test, and the tuning
# path is tested where it is switched back on.
os.environ.setdefault("FUSEML_AUTOTUNE", "0")

import pytest

_SCRATCH = "fuseml_test_scratch"  # config.stash would not reach xdist workers; env does


def _controller(config) -> bool:
    """The process that runs the session (not an xdist worker)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config):
    if not _controller(config):
        return
    tmp = Path(tempfile.gettempdir())
    config._fuseml_tmp_before = {p.name for p in tmp.iterdir()}
    # torch.compile's cache (300 MB after a run) would otherwise stay in /tmp; the workers
    # inherit these variables. A cache the user chose is left alone.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        scratch = tempfile.mkdtemp(prefix="fuseml-tests-")
        os.environ[_SCRATCH] = scratch
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(scratch) / "torchinductor")


def pytest_runtest_logreport(report):
    """With CHECK_TIMES set (scripts/gpu-check.sh sets it), each test phase's seconds are
    appended to that file as it ends, by every worker: a run stopped at a time limit still
    says where its time went (pytest's --durations prints only at the end)."""
    path = os.environ.get("CHECK_TIMES")
    forwarded = getattr(report, "node", None) is not None  # (xdist's copy in the controller)
    if path and not forwarded and report.duration >= 0.01:
        with open(path, "a") as f:  # (one short line a write: appends do not interleave)
            f.write(f"{report.duration:.2f} {report.when} {report.nodeid}\n")


def pytest_unconfigure(config):
    if not _controller(config):
        return
    scratch = os.environ.pop(_SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").startswith(scratch):
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]


def pytest_terminal_summary(terminalreporter, config):
    """Name what appeared in the temporary folder during the run (pytest's own folder and
    other processes' files aside), so that a test leaving files behind is noticed."""
    before = getattr(config, "_fuseml_tmp_before", None)
    if before is None:
        return
    scratch = os.environ.get(_SCRATCH)
    new = []
    for p in Path(tempfile.gettempdir()).iterdir():
        if p.name in before or p.name.startswith("pytest-of-") or str(p) == scratch:
            continue
        try:
            if p.lstat().st_uid == os.getuid():
                new.append(p)
        except OSError:  # removed meanwhile
            pass
    if new:
        names = ", ".join(sorted(p.name for p in new)[:10])
        terminalreporter.write_line(
            f"files that appeared in {tempfile.gettempdir()} during the tests (a test that "
            f"does not use tmp_path?): {names}",
            yellow=True,
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tma_launches(monkeypatch):
    """As on a Hopper GPU at decode-like rows (LOOP_TUNED): ``record(fn)`` calls ``fn`` and
    returns its output and the LoraLaunch of every TMA-kernel launch it made (None for a
    plain layer)."""
    from fuseml.ops import gemm

    monkeypatch.setattr(gemm.launch, "_tma_device", lambda t: True)
    launch = gemm.launch._launch_tma

    def record(fn):
        used = []
        monkeypatch.setattr(
            gemm.launch, "_launch_tma", lambda *a, **k: used.append(a[-1]) or launch(*a, **k)
        )
        return fn(), used

    return record


@pytest.fixture
def fresh_tuning(tmp_path, monkeypatch):
    """Tuning on, as users run it, with an empty cache in ``tmp_path`` (returned) and
    nothing remembered from earlier tests of this process."""
    from fuseml.ops import _tune

    monkeypatch.setenv("FUSEML_AUTOTUNE", "1")
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setattr(_tune, "_memo", {})
    monkeypatch.setattr(_tune, "_tables", {})
    monkeypatch.setattr(_tune, "_capture_misses", set())  # (warned once per key)
    return tmp_path
