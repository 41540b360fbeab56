"""Test setup: on a machine without CUDA, Triton kernels run under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any
fuseml import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GEMM configs are not tuned per test shape (minutes of compiling on a GPU): tests run the
# default config, every candidate config has its own correctness test, and the tuning
# path is tested where it is switched back on.
os.environ.setdefault("FUSEML_AUTOTUNE", "0")

import pytest


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tuned_gemm_call(monkeypatch):
    """As on a Hopper GPU at decode-like rows (LOOP_TUNED): ``run(cfg, fn)`` calls ``fn``
    with the GEMM config forced to ``cfg`` and returns its output and the LoraLaunch of
    every TMA-kernel launch it made (None for a plain layer). For calls that take no
    ``loop=`` / ``config=`` of their own (plain layers: ``linear_rows`` takes both)."""
    from fuseml.ops import gemm

    monkeypatch.setattr(gemm.launch, "_tma_device", lambda t: True)
    launch = gemm.launch._launch_tma

    def run(cfg, fn):
        used = []
        monkeypatch.setattr(gemm.launch, "choose_config", lambda *a, **k: cfg)
        monkeypatch.setattr(
            gemm.launch, "_launch_tma", lambda *a, **k: used.append(a[-1]) or launch(*a, **k)
        )
        return fn(), used

    return run


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
