import json

import pytest
import torch

from fuseml.bench import report
from fuseml.bench.harness import Case, Settings, run_cases
from fuseml.bench.summary import summarize
from fuseml.testing import requires_cuda


def _doc():
    meta = {
        "gpu": "Test GPU", "gpu_slug": "test-gpu", "torch": "2.x", "triton": "3.x",
        "commit": "abc", "date": "2026-01-01T00:00:00Z", "run": "quick",
    }  # fmt: skip
    rows = []
    for numel in (1_000_000, 16_777_216):
        for arm, ms in (("builtin", 0.02), ("compile", 0.021), ("triton", 0.019)):
            scale = numel / 1_000_000
            rows.append({
                "suite": "elementwise", "case": f"add/float32/{numel}", "arm": arm,
                "op": "add", "dtype": "float32", "numel": numel, "shape": [numel],
                "mode": "events", "p50_ms": ms * scale, "p20_ms": ms * scale,
                "p80_ms": ms * scale, "rate": 12e-3 * numel / (ms * scale) / 1e3,
                "rate_unit": "GB/s", "ceiling": "copy_gbps", "ceiling_value": 3000.0,
                "pct_of_ceiling": 80.0, "matches_ref": True if arm != "builtin" else None,
                **meta,
            })  # fmt: skip
    rows.append({**rows[0], "arm": "triton-op", "mode": "host", "host_us": 12.5})
    return {"format": 1, "suite": "elementwise", "meta": meta,
            "ceilings": {"copy_gbps": 3000.0, "matmul_bf16_tflops": 700.0}, "rows": rows}  # fmt: skip


def test_write_and_load_round_trip(tmp_path):
    doc = _doc()
    path = report.write_results("elementwise", doc["rows"], doc["ceilings"], doc["meta"], tmp_path)
    assert path == tmp_path / "test-gpu" / "elementwise.json"
    assert report.load_results(path)["rows"] == doc["rows"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="results format 99"):
        report.load_results(bad)


def test_write_results_merge_replaces_remeasured_rows(tmp_path):
    doc = _doc()
    report.write_results("elementwise", doc["rows"], doc["ceilings"], doc["meta"], tmp_path)
    again = [dict(r, p50_ms=1.0) for r in doc["rows"] if r["arm"] == "triton"]
    meta = {**doc["meta"], "run": "full"}
    path = report.write_results("elementwise", again, doc["ceilings"], meta, tmp_path, merge=True)
    merged = report.load_results(path)
    assert len(merged["rows"]) == len(doc["rows"])  # replaced, not duplicated
    triton = [r for r in merged["rows"] if r["arm"] == "triton"]
    assert triton and all(r["p50_ms"] == 1.0 for r in triton)
    others = [r for r in merged["rows"] if r["arm"] != "triton"]
    assert others == [r for r in doc["rows"] if r["arm"] != "triton"]
    assert merged["meta"]["run"] == "mixed"  # a quick file topped up by a full run
    # without merge the file holds only this run's rows
    path = report.write_results("elementwise", again, doc["ceilings"], meta, tmp_path)
    assert report.load_results(path)["rows"] == again


def test_results_of_a_case_subset_say_so(tmp_path):
    from fuseml.bench import readme

    doc = _doc()
    subset = {**doc["meta"], "cases": "^add/"}
    report.write_results("elementwise", doc["rows"], doc["ceilings"], subset, tmp_path)
    assert "only the cases matching `^add/`" in readme.suite_markdown("elementwise", tmp_path)
    # another subset merged in: both filters named
    more = {**doc["meta"], "cases": "^gelu/"}
    path = report.write_results("elementwise", doc["rows"], doc["ceilings"], more, tmp_path,
                                merge=True)  # fmt: skip
    assert report.load_results(path)["meta"]["cases"] == "^add/ | ^gelu/"
    path = report.write_results("elementwise", doc["rows"], doc["ceilings"], more, tmp_path,
                                merge=True)  # fmt: skip
    assert report.load_results(path)["meta"]["cases"] == "^add/ | ^gelu/"  # named once
    # a whole-suite file topped up with a subset stays a whole-suite file
    report.write_results("elementwise", doc["rows"], doc["ceilings"], doc["meta"], tmp_path)
    path = report.write_results("elementwise", doc["rows"], doc["ceilings"], subset, tmp_path,
                                merge=True)  # fmt: skip
    assert "cases" not in report.load_results(path)["meta"]
    assert "only the cases" not in readme.suite_markdown("elementwise", tmp_path)


def test_markdown_table_and_readme_update(tmp_path):
    from fuseml.bench.suites import elementwise

    table = report.markdown_table(_doc(), elementwise.README)
    assert "| op | dtype | shape | builtin | compile | triton |" in table
    assert "1.05x" in table  # best peer (builtin, 0.020 ms) over triton (0.019 ms)
    assert "copy 3,000 GB/s" in table
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- fuseml:results:x -->\nold\n<!-- /fuseml:results:x -->\nb\n")
    assert report.update_readme(readme, "results:x", table)
    text = readme.read_text()
    assert "old" not in text and table in text and text.startswith("a\n")
    assert not report.update_readme(readme, "results:missing", table)


def test_first_call_times_in_the_footer():
    doc = _doc()
    for r, secs in zip((r for r in doc["rows"] if r["arm"] == "compile"), (2.0, 4.5)):
        r["compile_s"] = secs
    spec = {**_elementwise_spec(), "first_call_arms": ("compile", "triton")}
    table = report.markdown_table(doc, spec)
    assert table.endswith("First calls, outside the timing: compile 2.0-4.5 s (2 cases).")
    assert "First calls" not in report.markdown_table(doc, _elementwise_spec())


def _elementwise_spec():
    from fuseml.bench.suites import elementwise

    return elementwise.README


def test_overhead_table_and_summary():
    doc = _doc()
    assert "| add/float32/1000000 | triton-op | 12.5 |" in report.overhead_table(doc)
    lines = summarize(doc)
    assert any("output mismatches vs reference: 0" in line for line in lines)
    assert any("worst 1.05x" in line for line in lines)


def test_summary_says_which_slower_cases_are_within_the_spread():
    """A fused arm below 1.00x of the fastest peer: the summary says whether its p20-p80
    spread meets the peer's (a tie within the run's noise) or not."""
    base = {"suite": "s", "mode": "events", "numel": 1 << 24}
    rows = [
        {**base, "case": "tie", "arm": "builtin", "p50_ms": 1.00, "p20_ms": 0.99, "p80_ms": 1.01},
        {**base, "case": "tie", "arm": "triton", "p50_ms": 1.005, "p20_ms": 1.0, "p80_ms": 1.02},
        {**base, "case": "gap", "arm": "builtin", "p50_ms": 1.00, "p20_ms": 0.99, "p80_ms": 1.01},
        {**base, "case": "gap", "arm": "triton", "p50_ms": 1.05, "p20_ms": 1.04, "p80_ms": 1.06},
        {**base, "case": "won", "arm": "builtin", "p50_ms": 1.00, "p20_ms": 0.99, "p80_ms": 1.01},
        {**base, "case": "won", "arm": "triton", "p50_ms": 0.90, "p20_ms": 0.89, "p80_ms": 0.91},
    ]
    lines = summarize({"suite": "s", "meta": {"gpu": "Test GPU"}, "rows": rows})
    head = next(line for line in lines if "fastest peer" in line)
    assert "1/3 cases >= 1.00x (1 of the 2 below within the peer's p20-p80)" in head
    assert "    0.95x gap" in lines
    assert "    1.00x tie (p20-p80 spreads overlap)" in lines


def test_plot_suite_writes_png(tmp_path):
    from fuseml.bench.suites import elementwise

    png = report.plot_suite(_doc(), elementwise.PLOT, tmp_path / "x.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_suite_with_no_row_it_shows_writes_nothing(tmp_path):
    """A run of cases outside the plot (here only a host-time row, which has no rate)
    gets no PNG instead of an error after its results were written."""
    from fuseml.bench.suites import elementwise

    doc = _doc()
    doc["rows"] = [r for r in doc["rows"] if r["mode"] == "host"]
    assert report.plot_suite(doc, elementwise.PLOT, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


@requires_cuda
@pytest.mark.gpu
def test_run_cases_times_and_checks_on_gpu():
    def make():
        return (torch.randn(1 << 16, device="cuda"),)

    case = Case(
        suite="t", name="neg", params={"numel": 1 << 16}, make_inputs=make,
        arms={"eager": torch.neg, "wrong": torch.clone}, bytes=8 << 16,
        graph=True, overhead=True,
    )  # fmt: skip
    rows = run_cases([case], ceilings={"copy_gbps": 1000.0}, settings=Settings.for_mode(True))
    modes = {(r["arm"], r["mode"]) for r in rows}
    assert {("eager", "events"), ("eager", "graph"), ("wrong", "events")} <= modes
    wrong = next(r for r in rows if r["arm"] == "wrong" and r["mode"] == "events")
    assert wrong["matches_ref"] is False
    assert all(r["p50_ms"] > 0 for r in rows if "p50_ms" in r)


def test_an_arm_that_raises_is_a_failed_row_not_an_aborted_run():
    # e.g. a kernel that asks for more shared memory than the device has: the run goes on
    # and the table says "failed" for that arm
    from fuseml.bench import harness

    def out_of_resources(x):
        raise RuntimeError("out of resource: shared memory, Required: 262208\nmore detail")

    def keyerror(x):
        raise KeyError("cfg")

    case = Case(
        suite="t", name="t/1", params={"numel": 2}, make_inputs=lambda: (torch.zeros(2),),
        arms={"triton": out_of_resources, "cuda": keyerror}, check=False,
    )  # fmt: skip
    rows = harness._run_case(case, {"copy_gbps": 1.0}, Settings.for_mode(True), None, {}, 0)
    assert [(r["arm"], r["mode"], r["error"]) for r in rows] == [
        ("triton", "events", "RuntimeError: out of resource: shared memory, Required: 262208"),
        ("cuda", "events", "KeyError: 'cfg'"),
    ]
    assert all("p50_ms" not in r for r in rows)
    assert report._cell(rows[0], {}) == "failed"
    doc = {"suite": "t", "meta": {"gpu": "Test GPU"}, "rows": rows}
    assert "  failed arms: 2" in summarize(doc)


def test_describe_fields_land_in_each_arms_row(monkeypatch):
    """Case.describe(arm) is asked right after the arm's first call; its fields (the
    linear suite: the launch config the tuner chose) are in that arm's timed row."""
    from fuseml.bench import harness

    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda *a: None)  # (no GPU)
    monkeypatch.setattr(harness, "spin_up", lambda fn, inputs, ms=50.0: 0.01)
    monkeypatch.setattr(harness, "bench_ms_p99", lambda fn, settings: (1.0, 0.9, 1.1, 1.2))
    calls = []

    def triton_arm(x):
        calls.append("triton")
        return -x

    def describe(arm):
        # asked after this arm's first call, before any other arm's
        assert calls == (["triton"] if arm == "triton" else [])
        return {"config": {"BLOCK_M": 16, "kernel": "ptr"}} if arm == "triton" else {}

    case = Case(
        suite="t", name="t/2", params={"numel": 2}, make_inputs=lambda: (torch.ones(2),),
        arms={"eager": torch.neg, "triton": triton_arm}, describe=describe,
    )  # fmt: skip
    rows = harness._run_case(case, {"copy_gbps": 1.0}, Settings.for_mode(True), None, {}, 0)
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["triton"]["config"] == {"BLOCK_M": 16, "kernel": "ptr"}
    assert "config" not in by_arm["eager"] and by_arm["triton"]["matches_ref"] is True


def test_heavy_arms_are_timed_in_turns():
    """bench_turns_ms: every arm gets a slice of each round, the first arm of round r is arm
    r (mod arms), slices hold rep_ms / rounds of calls (at least 2), and the quantiles are
    taken over all of an arm's calls."""
    from fuseml.bench import harness

    order = []

    def timer(fn, calls):
        order.append((fn(), calls))
        return [float(fn())] * calls

    fns = {"eager": lambda: 1, "cublaslt": lambda: 2, "triton": lambda: 3}
    per_call = {"eager": 4.0, "cublaslt": 2.0, "triton": 50.0}
    settings = Settings(rep_ms=100.0)
    out = harness.bench_turns_ms(fns, per_call, settings, timer, rounds=4)
    firsts = [order[i][0] for i in range(0, len(order), 3)]
    assert firsts == [1, 2, 3, 1]  # the order rotates
    assert sorted({(arm, n) for arm, n in order}) == [(1, 6), (2, 12), (3, 2)]
    assert out["cublaslt"] == (2.0, 2.0, 2.0, 2.0)
    assert harness.quantiles_ms([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((3.0, 1.8, 4.2, 4.96))


@requires_cuda
@pytest.mark.gpu
def test_run_cases_in_turns_on_gpu(monkeypatch):
    from fuseml.bench import harness

    monkeypatch.setattr(harness, "TURNS_MIN_MS", 0.0)  # every case counts as heavy
    case = Case(
        suite="t", name="neg", params={"numel": 1 << 16},
        make_inputs=lambda: (torch.randn(1 << 16, device="cuda"),),
        arms={"eager": torch.neg, "other": lambda x: -x}, bytes=8 << 16,
    )  # fmt: skip
    rows = run_cases([case], ceilings={"copy_gbps": 1000.0}, settings=Settings.for_mode(True))
    assert {r["arm"] for r in rows} == {"eager", "other"}
    for r in rows:
        assert r["turns"] == harness.TURNS_ROUNDS and r["mode"] == "events"
        assert 0 < r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"] <= r["p99_ms"]


@requires_cuda
@pytest.mark.gpu
def test_run_cases_every_case_in_turns_on_gpu():
    """Settings.turns (``fuseml bench --turns``): a light case's events rows and its graph
    rows are timed in turns too."""
    from fuseml.bench import harness

    case = Case(
        suite="t", name="neg", params={"numel": 1 << 12},
        make_inputs=lambda: (torch.randn(1 << 12, device="cuda"),),
        arms={"eager": torch.neg, "other": lambda x: -x}, bytes=8 << 12, graph=True,
    )  # fmt: skip
    settings = Settings.for_mode(True, turns=True)
    rows = run_cases([case], ceilings={"copy_gbps": 1000.0}, settings=settings)
    assert sorted((r["arm"], r["mode"]) for r in rows) == [
        ("eager", "events"), ("eager", "graph"), ("other", "events"), ("other", "graph")
    ]  # fmt: skip
    for r in rows:
        assert r["turns"] == harness.TURNS_ROUNDS
        assert 0 < r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"]
    graph = {r["arm"]: r["p50_ms"] for r in rows if r["mode"] == "graph"}
    events = {r["arm"]: r["p50_ms"] for r in rows if r["mode"] == "events"}
    assert all(graph[a] < events[a] for a in graph)  # per call, without launch gaps


def test_turns_setting_reaches_the_suite_runner(monkeypatch):
    """``fuseml bench SUITE --turns`` asks run_suite for Settings with turns on."""
    from typer.testing import CliRunner

    import fuseml.bench
    from fuseml.apps.cli import app

    assert not Settings.for_mode(False).turns and Settings.for_mode(True, turns=True).turns
    assert Settings.for_mode(True, turns=True).rep_ms == Settings.for_mode(True).rep_ms
    seen = {}
    monkeypatch.setattr(fuseml.bench, "run_suite", lambda suite, **kw: seen.update(kw, suite=suite))
    result = CliRunner().invoke(app, ["bench", "add-x", "--turns", "--quick"])
    assert result.exit_code == 0, result.output
    assert seen["turns"] is True and seen["quick"] is True and seen["suite"] == "add-x"
    CliRunner().invoke(app, ["bench", "add-x"])
    assert seen["turns"] is False


def test_fusion_side_by_side_names_its_sources(tmp_path):
    """The README's fusion table: GELU and softmax rows of one GPU, five arms, and the
    run, commit and date each suite's rows come from."""
    from fuseml.bench import readme

    meta = {
        "gpu": "Test GPU",
        "gpu_slug": "test-gpu",
        "commit": "abc",
        "date": "2026-01-01",
        "run": "quick",
    }
    row = {"mode": "events", "p50_ms": 0.01, "pct_of_ceiling": 50.0, "numel": 1 << 20}
    gelu = [{**row, "case": "gelu/bfloat16/1048576", "arm": a, "op": "gelu"}
            for a in ("manual", "builtin", "cuda", "triton", "compile")]  # fmt: skip
    meta_sm = {**meta, "commit": "def"}
    soft = [{**row, "case": "softmax/bfloat16/4096x256", "arm": a, "op": "softmax"}
            for a in ("manual", "torch", "cuda", "triton", "compile")]  # fmt: skip
    for suite, rows, m in (("elementwise", gelu, meta), ("softmax", soft, meta_sm)):
        report.write_results(suite, rows, {"copy_gbps": 3000.0}, m, tmp_path)
    text = readme.fusion_markdown(tmp_path)
    assert "| gelu/bfloat16/1048576 | 10.0 us (50%) |" in text
    assert "| softmax/bfloat16/4096x256 | 10.0 us (50%) |" in text
    assert "gelu: quick run of the elementwise suite, commit abc" in text
    assert "softmax: quick run of the softmax suite, commit def" in text
    # A second GPU with softmax results only: its own table, which says GELU is missing
    meta2 = {**meta_sm, "gpu": "Other GPU", "gpu_slug": "other-gpu"}
    report.write_results("softmax", soft, {"copy_gbps": 3000.0}, meta2, tmp_path)
    text = readme.fusion_markdown(tmp_path)
    assert "**Other GPU**" in text and "**Test GPU**" in text
    assert "gelu: no elementwise results on this GPU yet" in text
    assert text.count("| softmax/bfloat16/4096x256 |") == 2


def test_commits_note_names_every_commit_of_merged_rows():
    meta = {"commit": "bbb", "date": "2026-01-02"}
    assert report.commits_note([{"commit": "bbb"}] * 2, meta) == "commit bbb, 2026-01-02"
    # rows of one commit carry their own date: a subset of a merged file may be older
    older = [{"commit": "aaa", "date": "2025-12-30"}, {"commit": "aaa", "date": "2025-12-31"}]
    assert report.commits_note(older, meta) == "commit aaa, 2025-12-31"
    rows = [{"commit": "aaa"}, {"commit": "bbb"}, {"commit": "aaa"}]
    assert report.commits_note(rows, meta) == (
        "rows from commits aaa (2 rows), bbb (1 rows); last run 2026-01-02"
    )
