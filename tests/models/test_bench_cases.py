"""DLRM inference cases for the benchmark harness: callables, inputs and sizes."""

from __future__ import annotations

import torch

from fuseml.models import DLRMConfig
from fuseml.models.bench_cases import dlrm_inference_cases, dlrm_work, random_inputs


def test_cases_run_and_agree():
    cases = dlrm_inference_cases("tiny", [1, 33], torch.float32, "cpu", max_cardinality=40)
    assert [c.name for c in cases] == ["tiny/bs1/float32", "tiny/bs33/float32"]
    for case in cases:
        dense, sparse = case.inputs
        assert dense.shape == (case.batch_size, 13) and sparse.shape == (case.batch_size, 26)
        out = case.arms["eager"]()
        assert out.shape == (case.batch_size,) and ((out > 0) & (out < 1)).all()
        with torch.no_grad():
            ref = case.model.double()(dense.double(), sparse)
        case.model.float()
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        assert set(case.arms) == {"eager", "compile"}


def test_random_inputs_are_valid_and_seeded():
    cfg = DLRMConfig.from_name("kaggle")
    _dense, sparse = random_inputs(cfg, 4096, seed=1)
    cards = torch.tensor(cfg.cardinalities)
    assert (sparse >= 0).all() and (sparse < cards).all()
    assert sparse[:, 2].max() > 1_000_000  # the 10M-row table is covered, not only its head
    assert torch.equal(random_inputs(cfg, 4096, seed=1)[1], sparse)


def test_work_counts_kaggle():
    cfg = DLRMConfig.from_name("kaggle")
    flops, traffic = dlrm_work(cfg, 1, torch.float32)
    mlp = 13 * 512 + 512 * 256 + 256 * 64 + 64 * 16 + 367 * 512 + 512 * 256 + 256 * 1
    assert flops == 2 * mlp + 2 * 27 * 27 * 16
    biases = 512 + 256 + 64 + 16 + 512 + 256 + 1
    assert traffic == 4 * (mlp + biases + 26 * 16 + 13 + 1) + 8 * 26
