import importlib.util
import time

import torch

from fuseml.bench import harness, report
from fuseml.bench.suites import SUITES, _common, models

META = {"gpu": "Test GPU", "gpu_slug": "test-gpu", "torch": "2.x", "triton": "3.x",
        "commit": "abc", "date": "2026-01-01T00:00:00Z", "run": "quick"}  # fmt: skip


def test_registered_with_the_mlp_and_the_peft_model_at_their_row_counts():
    assert SUITES["models"] is models
    cases = list(models.cases())
    assert len({c.name for c in cases}) == len(cases)
    by_model = {}
    for c in cases:
        assert c.measure is not None and c.samples == c.params["batch"]
        by_model.setdefault(c.params["model"], []).append(c.params["batch"])
    assert by_model["MLP kaggle top"] == [64, 4096, 65536]
    if importlib.util.find_spec("peft") is not None:
        assert by_model["peft LoRA MLP"] == [16, 512, 4096]
    assert {c.name for c in models.cases(quick=True)} <= {c.name for c in cases}


def test_measure_rows_of_several_modes_become_one_row_each():
    case = next(models.cases(quick=True))
    fields = {"torch": [{"mode": "wall", "p50_ms": 0.2}, {"mode": "graph", "p50_ms": 0.1}],
              "fuseml": {"mode": "wall", "p50_ms": 0.1}}  # fmt: skip
    case.measure = lambda settings: fields
    rows = harness._run_case(case, {}, harness.Settings(), None, META, 0)
    assert [(r["arm"], r["mode"]) for r in rows] == [
        ("torch", "wall"),
        ("torch", "graph"),
        ("fuseml", "wall"),
    ]
    assert rows[0]["rate"] == case.samples / 0.2e-3  # samples/s from the row's own time
    rows = harness._run_case(case, {}, harness.Settings(), {"fuseml"}, META, 0)
    assert [(r["arm"], r["mode"]) for r in rows] == [("fuseml", "wall")]


def test_tables_eager_wall_time_and_graph_replays_apart():
    rows = []
    for case in models.cases(quick=True):
        for arm, wall, graph in (
            ("torch", 300.0, 90.0),
            ("compile", 400.0, 80.0),
            ("fuseml", 150.0, 60.0),
            ("fuseml-compile", 390.0, 70.0),
        ):
            for mode, us in (("wall", wall), ("graph", graph)):
                rows.append(harness._row(case, arm, META, {}, mode=mode, p50_ms=us / 1e3,
                                         p20_ms=us / 1e3, p80_ms=us / 1e3))  # fmt: skip
    doc = {"format": 1, "suite": "models", "meta": META, "ceilings": {}, "rows": rows}
    eager, graph = (report.markdown_table(doc, spec) for spec in models.README)
    line = next(x for x in eager.splitlines() if "| MLP kaggle top | 64 |" in x)
    assert "300.0 us" in line and "150.0 us" in line and "2.00x" in line  # vs torch
    line = next(x for x in graph.splitlines() if "| MLP kaggle top | 64 |" in x)
    assert "90.0 us" in line and "60.0 us" in line and "1.33x" in line  # vs compile's 80
    assert "fuseml-compile" in eager.splitlines()[0]  # shown, not a peer of fuseml


def test_wall_time_counts_the_loop_and_synchronizes(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    p50, p20, p80 = _common.wall_us(fn, iters=5, repeats=3)
    assert len(calls) == 10 + 15  # a warm-up, then three loops of five
    assert len(syncs) == 6  # before and after each loop
    assert p20 <= p50 <= p80 and p50 >= 2000  # microseconds per call, at least the sleep
