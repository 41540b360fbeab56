import pytest
import torch
import torch.nn.functional as F

from fuseml.bench import harness, readme, report
from fuseml.bench.suites import SUITES, interaction
from fuseml.ops._interaction_kernels import gather_rows
from fuseml.runtime import triton_interpreting


def test_registered_and_well_formed():
    assert SUITES["interaction"] is interaction
    assert "cuda" not in next(interaction.cases(quick=True, cuda=False)).arms
    for quick in (True, False):
        cases = list(interaction.cases(quick=quick))
        assert len({c.name for c in cases}) == len(cases)
        for case in cases:
            assert list(case.arms) == ["torch", "compile", "triton", "cuda", "gather"]
            assert case.unchecked_arms == ("gather",) and case.bytes > 0 and case.flops > 0
            assert {"config", "dtype", "batch"} <= set(case.params)
            assert case.params["shape"][1] % 16 == 0  # the top MLP's aligned width
        dtypes = {(c.params["config"], c.params["dtype"]) for c in cases}
        assert dtypes == {("kaggle", "bfloat16"), ("mlperf", "bfloat16"), ("mlperf", "float32")}


def test_table_has_every_arm_and_the_gather_floor_is_not_a_peer():
    meta = {"gpu": "Test GPU", "gpu_slug": "test-gpu", "torch": "2.x", "triton": "3.x",
            "commit": "abc", "date": "2026-01-01T00:00:00Z", "run": "quick"}  # fmt: skip
    ceilings = {"copy_gbps": 3000.0}
    rows = []
    for i, case in enumerate(interaction.cases(quick=True)):
        for j, arm in enumerate(case.arms):
            ms = 0.01 * (1 + i) * (1 + 0.1 * j)
            rows.append(harness._row(case, arm, meta, ceilings, mode="events", p50_ms=ms,
                                     p20_ms=ms, p80_ms=ms))  # fmt: skip
    doc = {"format": 1, "suite": "interaction", "meta": meta, "ceilings": ceilings, "rows": rows}
    table = report.markdown_table(doc, interaction.README)
    header = table.splitlines()[0]
    assert all(f" {arm} |" in header for arm in interaction.README["arms"])
    body = [line for line in table.splitlines() if line.startswith(("| kaggle", "| mlperf"))]
    assert len(body) == len(list(interaction.cases(quick=True)))
    assert "gather" not in readme._peers(interaction.README)


@pytest.mark.skipif(not triton_interpreting(), reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("d", [16, 128])
def test_gather_rows_reads_the_rows_of_the_ids(d):
    cards = torch.tensor([5, 9, 3])
    offsets = torch.zeros(4, dtype=torch.int64)
    offsets[1:] = cards.cumsum(0)
    weight = torch.randn(int(offsets[-1]), d).to(torch.bfloat16)
    ids = (torch.rand(7, 3) * cards).long().to(torch.int32)
    out = gather_rows(weight, offsets, ids)
    assert torch.equal(out, F.embedding(ids.long() + offsets[:-1], weight))


@pytest.mark.skipif(not triton_interpreting(), reason="CPU Triton needs TRITON_INTERPRET=1")
def test_sweep_arms_compute_the_op():
    """Every --sweep arm (a samples-per-program x warps pair, or a looping variant) gives
    the op's result."""
    from fuseml.ops.embedding_interaction import embedding_interaction_ref

    case = next(interaction.cases(quick=True))
    arms = case.sweep()
    assert len(arms) == len(interaction.SWEEP) + len(interaction.VARIANTS)
    cards = torch.tensor([5, 9, 3] + [4] * 23)
    offsets = torch.zeros(27, dtype=torch.int64)
    offsets[1:] = cards.cumsum(0)
    weight = torch.randn(int(offsets[-1]), 16)
    x = torch.randn(3, 16)
    ids = (torch.rand(3, 26) * cards).long().to(torch.int32)
    ref = embedding_interaction_ref(x, weight, offsets, ids, out_width=368)
    for name in ("triton@b1w1", "triton@b16w8", "triton@b1w1i4pf", "triton@b2w2i4p"):
        torch.testing.assert_close(arms[name](x, weight, offsets, ids), ref)
