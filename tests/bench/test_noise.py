"""Unsettled timings are timed again, and marked when they stay so (synthetic timings)."""

import json
import subprocess

import pytest

from fuseml.bench import noise, report
from fuseml.bench.noise import Timing, committed_history, history_from_rows, settle, unsettled


def _q(p50, spread=0.02):
    """(p50, p20, p80, p99) with the p20-p80 spread a fraction of the median."""
    return (p50, p50 * (1 - spread / 2), p50 * (1 + spread / 2), p50 * 1.3)


class Timer:
    """measure(names) that hands out the next synthetic timing of each arm and counts
    which arms it was asked for."""

    def __init__(self, **sequences):
        self.sequences = {k: list(v) for k, v in sequences.items()}
        self.asked: list[list[str]] = []

    def __call__(self, names):
        self.asked.append(list(names))
        return {n: self.sequences[n].pop(0) for n in names}


def test_spread_and_history_thresholds():
    assert unsettled(_q(0.1, 0.05), None) == []
    assert unsettled(_q(0.1, 0.099), None) == []  # just under the bound: settled
    (why,) = unsettled(_q(0.1, 0.2), None)
    assert "spread 20%" in why
    assert unsettled(_q(0.110), 0.1) == []  # 10% off the committed median
    (why,) = unsettled(_q(0.1172), 0.0850)  # compile's 117.2 us against 85.0 us before
    assert "+38% off the committed 85.0 us" in why
    (why,) = unsettled(_q(0.080), 0.1)  # faster counts as far too
    assert "-20%" in why
    assert len(unsettled(_q(0.2, 0.3), 0.1)) == 2


def test_settled_arms_are_timed_once():
    timer = Timer(eager=[_q(0.1)], compile=[_q(0.09)])
    kept = settle(timer, ["eager", "compile"], {"eager": 0.1, "compile": 0.095})
    assert timer.asked == [["eager", "compile"]]
    assert kept["eager"] == Timing(_q(0.1), 0, [])
    assert kept["compile"].fields() == {}


def test_an_outlier_is_timed_again_and_the_settled_timing_kept():
    timer = Timer(eager=[_q(0.1)], compile=[_q(0.1172), _q(0.0860)])
    kept = settle(timer, ["eager", "compile"], {"compile": 0.0850})
    assert timer.asked == [["eager", "compile"], ["compile"]]  # only the outlier again
    assert kept["compile"].quantiles == _q(0.0860)
    assert kept["compile"].fields() == {"reruns": 1}
    assert kept["eager"].fields() == {}


def test_a_noisy_spread_is_timed_again():
    timer = Timer(compile=[_q(0.1, 0.4), _q(0.1, 0.03)])
    kept = settle(timer, ["compile"])
    assert kept["compile"].quantiles == _q(0.1, 0.03)
    assert kept["compile"].fields() == {"reruns": 1}


def test_an_arm_that_stays_unsettled_is_marked_after_a_bounded_number_of_reruns():
    timer = Timer(compile=[_q(0.30), _q(0.25), _q(0.28), _q(0.09)])
    kept = settle(timer, ["compile"], {"compile": 0.1}, reruns_max=2)
    assert len(timer.asked) == 3  # the first timing and two re-runs, never the fourth
    t = kept["compile"]
    assert t.quantiles == _q(0.25)  # the attempt nearest to settled
    fields = t.fields()
    assert fields["reruns"] == 2
    assert "+150% off the committed 100.0 us" in fields["noisy"]


def test_a_worse_rerun_does_not_replace_a_better_timing():
    timer = Timer(compile=[_q(0.12, 0.12), _q(0.10, 0.5), _q(0.1, 0.04)])
    kept = settle(timer, ["compile"], reruns_max=2)
    assert kept["compile"].quantiles == _q(0.1, 0.04)
    assert kept["compile"].fields() == {"reruns": 2}


def test_a_timer_in_turns_may_time_every_arm_again():
    """Turns time all arms on each re-run; only the named arms' new timings count."""
    seq = iter([
        {"eager": _q(0.1), "compile": _q(0.2)},
        {"eager": _q(0.5), "compile": _q(0.1)},
    ])  # fmt: skip
    kept = settle(lambda names: next(seq), ["eager", "compile"], {"compile": 0.1})
    assert kept["eager"].quantiles == _q(0.1)  # settled at first: kept
    assert kept["compile"].quantiles == _q(0.1) and kept["compile"].reruns == 1


def test_history_from_rows_skips_failed_noisy_and_host_rows():
    rows = [
        {"case": "c", "arm": "compile", "mode": "events", "p50_ms": 0.09},
        {"case": "c", "arm": "compile", "mode": "graph", "p50_ms": 0.08},
        {"case": "c", "arm": "eager", "mode": "events", "p50_ms": 0.5, "noisy": "spread"},
        {"case": "c", "arm": "cuda", "mode": "events", "error": "RuntimeError: x"},
        {"case": "c", "arm": "triton-op", "mode": "host", "host_us": 5.0},
    ]
    assert history_from_rows(rows) == {("c", "compile", "events"): 0.09,
                                       ("c", "compile", "graph"): 0.08}  # fmt: skip


def _doc(p50):
    return {"format": 1, "rows": [{"case": "c", "arm": "eager", "mode": "events", "p50_ms": p50}]}


def test_committed_history_reads_the_committed_file_not_this_runs_writes(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    path = tmp_path / "benchmarks/results/gpu/suite.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_doc(0.1)))
    git("init", "-q")
    git("add", ".")
    git("-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "-m", "r")
    path.write_text(json.dumps(_doc(0.5)))  # rewritten by a run, not committed
    assert committed_history(path) == {("c", "eager", "events"): 0.1}


def test_committed_history_without_git_reads_the_file_and_without_a_file_is_empty(
    tmp_path, monkeypatch
):
    path = tmp_path / "gpu" / "suite.json"
    assert committed_history(path) == {}
    path.parent.mkdir()
    path.write_text(json.dumps(_doc(0.2)))
    monkeypatch.setenv("PATH", "")  # a copied tree on a machine without git
    assert committed_history(path) == {("c", "eager", "events"): 0.2}
    path.write_text("{not json")
    assert committed_history(path) == {}


@pytest.mark.parametrize("noisy_arm", ["compile", "triton"])
def test_report_marks_a_noisy_cell_and_the_ratio_it_feeds(noisy_arm):
    meta = {"gpu": "G", "gpu_slug": "g", "torch": "2", "triton": "3", "commit": "abc",
            "date": "2026-01-01T00:00:00Z", "run": "quick"}  # fmt: skip
    rows = []
    for arm, ms in (("eager", 0.2), ("compile", 0.1172), ("triton", 0.08)):
        row = {"suite": "s", "case": "c", "arm": arm, "mode": "events", "op": "gelu",
               "numel": 1, "dtype": "float32", "p50_ms": ms}  # fmt: skip
        if arm == noisy_arm:
            row.update(reruns=2, noisy="median +38% off the committed 85.0 us")
        rows.append(row)
    doc = {"meta": meta, "ceilings": {}, "rows": rows}
    spec = {"rows": ("op", "dtype"), "arms": ("eager", "compile", "triton")}
    text = report.markdown_table(doc, spec)
    assert "(noisy)" in text.splitlines()[2]
    assert "1.46x (noisy)" in text
    assert noise.RERUNS_MAX >= 1 and "not a result to rely on" in text


def test_harness_reruns_an_outlier_arm_before_writing_its_row(monkeypatch):
    """_run_case end to end with synthetic timings in place of the GPU timers."""
    import torch

    from fuseml.bench import harness

    timings = {
        "eager": iter([_q(0.2)]),
        "compile": iter([_q(0.1172), _q(0.1150), _q(0.1201)]),  # stays 35-41% off
        "triton": iter([_q(0.08, 0.3), _q(0.081)]),  # noisy once
    }
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness, "spin_up", lambda fn, inputs, ms=50.0: 0.01)
    monkeypatch.setattr(harness, "bench_ms_p99", lambda fn, settings: next(timings[fn()]))
    case = harness.Case(
        suite="s", name="c", params={}, make_inputs=lambda: (),
        arms={arm: (lambda arm=arm: arm) for arm in timings}, check=False,
    )  # fmt: skip
    history = {("c", "compile", "events"): 0.085, ("c", "eager", "events"): 0.2}
    rows = harness._run_case(case, {}, harness.Settings.for_mode(True), None, {}, 0, history)
    by_arm = {r["arm"]: r for r in rows}
    assert "reruns" not in by_arm["eager"] and "noisy" not in by_arm["eager"]
    assert by_arm["triton"]["reruns"] == 1 and "noisy" not in by_arm["triton"]
    assert by_arm["triton"]["p50_ms"] == 0.081
    assert by_arm["compile"]["reruns"] == noise.RERUNS_MAX
    assert by_arm["compile"]["p50_ms"] == 0.1150  # the nearest to settled of three
    assert "off the committed 85.0 us" in by_arm["compile"]["noisy"]


def test_summary_counts_noisy_rows_and_the_wins_that_rest_on_them():
    from fuseml.bench.summary import summarize

    base = {"suite": "s", "mode": "events", "numel": 1 << 24}
    rows = [
        {**base, "case": "a", "arm": "compile", "p50_ms": 0.1172, "reruns": 2,
         "noisy": "median +38% off the committed 85.0 us"},
        {**base, "case": "a", "arm": "triton", "p50_ms": 0.08},
        {**base, "case": "b", "arm": "compile", "p50_ms": 0.09},
        {**base, "case": "b", "arm": "triton", "p50_ms": 0.08},
    ]  # fmt: skip
    lines = summarize({"suite": "s", "meta": {"gpu": "Test GPU"}, "rows": rows})
    assert "  noisy rows (timed again, still unsettled): 1" in lines
    assert "    a compile (events): median +38% off the committed 85.0 us" in lines
    head = next(line for line in lines if "fastest peer" in line)
    assert "2/2 cases >= 1.00x; a noisy row in 1 of them" in head
