import importlib.util

import pytest
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


def test_measure_is_given_its_own_cases_committed_medians():
    case = next(models.cases(quick=True))
    seen = []
    case.measure = lambda settings: seen.append(settings.history) or {}
    history = {(case.name, "fuseml", "graph"): 0.5, ("other/B=1", "fuseml", "graph"): 9.0}
    harness._run_case(case, {}, harness.Settings(), None, META, 0, history)
    assert seen == [{("fuseml", "graph"): 0.5}]


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


def test_walls_time_the_arms_loops_in_turns_and_synchronize(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    # a fake clock: real sleeps on a busy host spread past the re-run threshold
    clock = {"now": 0.0}
    monkeypatch.setattr(_common.time, "perf_counter", lambda: clock["now"])
    calls = []

    def arm(name, seconds):
        def fn():
            calls.append(name)
            clock["now"] += seconds

        return fn

    fns = {"a": arm("a", 0.002), "b": arm("b", 0.001)}
    walls = _common.walls_in_turns(fns, {"a": 5, "b": 4}, repeats=3)
    timed = calls[20:]  # after ten warm-up calls of each arm
    assert calls[:20] == ["a"] * 10 + ["b"] * 10
    assert timed == (["a"] * 5 + ["b"] * 4) * 3  # each round: every arm's loop in turn
    assert len(syncs) == 12  # before and after each loop
    for name, floor_ms in (("a", 2.0), ("b", 1.0)):
        p50, p20, p80 = walls[name].quantiles
        assert p20 <= p50 <= p80 and p50 >= floor_ms  # milliseconds per call


def test_walls_time_again_an_arm_whose_spread_stays_wide(monkeypatch):
    """An arm whose loops keep landing far apart is timed again, every arm with it (in
    turns), at most twice, and its row says why; a steady arm's row carries nothing."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    clock = {"now": 0.0, "jumpy": 0}
    monkeypatch.setattr(_common.time, "perf_counter", lambda: clock["now"])

    def steady():
        clock["now"] += 1e-3

    def jumpy():  # after its ten warm-up calls, loops of three: 1 ms and 4 ms a call by turns
        loop = (clock["jumpy"] - 10) // 3
        clock["jumpy"] += 1
        clock["now"] += 4e-3 if loop % 2 else 1e-3

    walls = _common.walls_in_turns({"steady": steady, "jumpy": jumpy}, {"steady": 3,
                                   "jumpy": 3}, repeats=5)  # fmt: skip
    fields = _common.timing_fields(walls["jumpy"], iters=3)
    assert fields["reruns"] == 2 and "spread" in fields["noisy"]
    assert clock["jumpy"] == 10 + 3 * 5 * 3  # the first timing and two re-runs
    steady_fields = _common.timing_fields(walls["steady"])
    assert "reruns" not in steady_fields and steady_fields["p50_ms"] == pytest.approx(1.0)
    assert set(fields) >= {"p50_ms", "p20_ms", "p80_ms", "iters"}
