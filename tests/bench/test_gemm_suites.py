"""The linear, mlp, lora and tuning suites without a GPU: their cases are well formed in
quick and full mode, their arms compute the reference's function (small shapes, Triton
interpreter on CPU), and report / README / summary / plot handle their rows."""

import math
import subprocess

import pytest
import torch

from fuseml import runtime
from fuseml.bench import harness, readme, report
from fuseml.bench.suites import SUITES, linear, lora, mlp, tuning
from fuseml.bench.summary import summarize
from fuseml.testing import rel_err, tolerance

NEW = ("linear", "mlp", "lora", "tuning")
CEILINGS = {"copy_gbps": 3000.0, "matmul_bf16_tflops": 700.0, "matmul_tf32_tflops": 350.0,
            "matmul_fp32_tflops": 50.0}  # fmt: skip
META = {"gpu": "Test GPU", "gpu_slug": "test-gpu", "torch": "2.x", "triton": "3.x",
        "commit": "abc", "date": "2026-01-01T00:00:00Z", "run": "quick"}  # fmt: skip


def _specs(module) -> list[dict]:
    return [module.README] if isinstance(module.README, dict) else list(module.README)


def test_new_suites_are_registered():
    # scripts/gpu-check.sh runs every suite in SUITES in quick mode.
    assert set(NEW) <= set(SUITES)
    assert all(SUITES[name] is mod for name, mod in zip(NEW, (linear, mlp, lora, tuning)))


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("name", NEW)
def test_cases_are_well_formed(name, quick):
    module = SUITES[name]
    cases = list(module.cases(quick=quick, cuda=False))  # lists on CPU: tensors come later
    assert cases
    assert len({c.name for c in cases}) == len(cases), "case names must be unique"
    needed = set()
    for spec in _specs(module):
        needed |= set(spec["rows"]) | set(spec.get("where", {}))
    if module.PLOT is not None:
        needed |= {module.PLOT["x"], *module.PLOT["panels"], *module.PLOT.get("where", {})}
    for case in cases:
        assert case.suite == name
        assert needed <= set(case.params), f"{case.name}: params lack {needed - set(case.params)}"
        if case.measure is not None:  # tuning: wall time of fresh processes
            assert case.arms == {} and not case.check
            continue
        assert next(iter(case.arms)) == "eager", "the first arm is the reference"
        assert "triton" in case.arms
        assert case.flops > 0 and case.bytes > 0
        assert case.ceiling in CEILINGS
        assert case.dtype in (torch.bfloat16, torch.float32)
        assert set(case.unchecked_arms) <= {"copy", "triton-single"}
        if case.overhead:
            assert case.graph, "host overhead only where the GPU keeps up (launch-bound)"
    if name != "tuning":
        shown = {a.removesuffix("+graph") for spec in _specs(module) for a in spec["arms"]}
        offered = {a for c in cases for a in c.arms}
        assert shown <= offered, f"README arms no case has: {shown - offered}"


def test_quick_runs_are_small():
    sizes = {n: (len(list(SUITES[n].cases(quick=True))), len(list(SUITES[n].cases())))
             for n in NEW}  # fmt: skip
    assert all(q < f for q, f in sizes.values()), sizes
    assert sum(q for n, (q, _) in sizes.items() if n != "tuning") <= 25
    # max-autotune compiles take tens of seconds each: a few in quick mode (the mlp
    # targets name max-autotune at two batches of the kaggle bottom MLP).
    autotuned = [c.name for n in ("linear", "mlp") for c in SUITES[n].cases(quick=True)
                 if "compile-max" in c.arms]  # fmt: skip
    assert 1 <= len(autotuned) <= 3, autotuned
    full = [c for n in ("linear", "mlp") for c in SUITES[n].cases() if "compile-max" in c.arms]
    assert len(full) <= 10


def test_shapes_follow_the_models_and_the_issue():
    assert linear.KAGGLE_TOP_IN == 367
    names = [c.name for c in linear.cases()]
    for k, n in [(13, 512), (367, 512), (512, 256), (256, 64), (64, 16), (1024, 1024),
                 (4096, 4096), (4096, 11008)]:  # fmt: skip
        for m in (1, 16, 64, 512, 4096, 65536):
            assert any(c.startswith(f"{k}x{n}/") and c.endswith(f"/bfloat16/m{m}") for c in names)
    assert linear.activation_of(4096, 11008) == "gelu_tanh"
    assert linear.activation_of(13, 512) == "relu"
    assert mlp.MLPS["kaggle-bottom"] == ((13, 512, 256, 64, 16), ("relu",) * 4)
    assert mlp.MLPS["kaggle-top"] == ((367, 512, 256, 1), ("relu", "relu", "sigmoid"))
    assert mlp.MLPS["mlperf-bottom"] == ((13, 512, 256, 128), ("relu",) * 3)
    assert mlp.MLPS["mlperf-top"][0] == (479, 1024, 1024, 512, 256, 1)
    assert mlp.MLPS["mlperf-top"][1][-1] == "sigmoid"
    full = list(lora.cases())
    single = {(c.params["rank"], c.params["m"]) for c in full if c.params["kind"] == "single"}
    assert single == {(r, m) for r in (8, 16, 64) for m in lora.M_FULL}
    multi = {c.params["adapters"] for c in full if c.params["kind"] == "multi"}
    assert multi == {1, 4, 16}


# ------------------------------------------------------------- arms vs the reference
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not runtime.triton_available(DEVICE), reason="Triton (or its interpreter) unavailable"
)


def _check_arms(case):
    """Run every arm but the compiled ones (same reference, slow to build on CPU) on one
    input set and compare with the reference arm as the harness does."""
    inputs = case.make_inputs()
    ref = None
    checked = []
    for arm, fn in {**case.arms, **case.overhead_arms}.items():
        if arm in case.compile_arms:
            continue
        out = fn(*inputs)
        if ref is None:
            ref = out
            continue
        if arm in case.unchecked_arms:
            assert out.shape == ref.shape
            continue
        if arm == "cublaslt" and DEVICE == "cpu" and case.params["act"] != "relu":
            continue  # torch's CPU _addmm_activation uses the erf GELU; CUDA's the tanh one
        err = rel_err(out, ref)
        assert err <= tolerance(case.dtype, tf32=case.tf32), f"{case.name} {arm}: {err:.2e}"
        checked.append(arm)
    return checked


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_arms_match_reference(dtype, monkeypatch):
    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    monkeypatch.setattr(linear, "LARGE_LAYERS", [(32, 48)])  # a small GELU layer
    relu = linear.linear_case(13, 40, 5, dtype, device=DEVICE, overhead=True)
    assert _check_arms(relu) == ["cublaslt", "triton", "triton-op"]
    gelu = linear.linear_case(32, 48, 7, dtype, device=DEVICE)
    assert gelu.params["act"] == "gelu_tanh"
    assert "triton" in _check_arms(gelu)


@needs_triton
@pytest.mark.parametrize("name", list(mlp.MLPS))
def test_mlp_arms_match_reference(name, monkeypatch):
    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    dtype = torch.float32 if name == "kaggle-top" else torch.bfloat16
    case = mlp.mlp_case(name, 6, dtype, device=DEVICE)
    assert _check_arms(case) == ["triton", "triton-op"]


@needs_triton
def test_lora_arms_match_reference(monkeypatch):
    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    monkeypatch.setattr(lora, "HIDDEN", 64)
    # merged (W + s B A rounded to bf16) passes the bf16 check: it stays checked.
    assert _check_arms(lora.single_case(9, 8, device=DEVICE)) == ["merged", "triton", "triton-op"]
    for adapters in (1, 4, 16):
        case = lora.multi_case(16, adapters, device=DEVICE)
        ids = case.make_inputs()[-1]
        assert int((ids == -1).sum()) == 16 // lora.NO_ADAPTER_EVERY
        assert int(ids.max()) < adapters
        assert _check_arms(case) == ["triton"]


# ------------------------------------------------------------------- rows and reports
def _fake_doc(name: str) -> dict:
    """Rows the harness would write for the quick cases, with made-up times."""
    rows = []
    for i, case in enumerate(SUITES[name].cases(quick=True)):
        if case.measure is not None:
            for arm, ms in (("cold", 8000.0), ("tune", 900.0), ("warm", 150.0)):
                built = 2 if arm == "warm" and i == 0 else 0  # one warm call that compiled
                rows.append(harness._row(case, arm, META, CEILINGS, mode="wall", p50_ms=ms,
                                         p20_ms=ms, p80_ms=ms, target_ms=tuning.TARGET_MS[arm],
                                         meets_target=ms < tuning.TARGET_MS[arm],
                                         built_entries=built))  # fmt: skip
            continue
        for j, arm in enumerate(case.arms):
            ms = 0.01 * (1 + i) * (1 + 0.1 * j)
            rows.append(harness._row(case, arm, META, CEILINGS, mode="events", p50_ms=ms,
                                     p20_ms=ms, p80_ms=ms,
                                     matches_ref=None if j == 0 else True))  # fmt: skip
            if case.graph:
                rows.append(harness._row(case, arm, META, CEILINGS, mode="graph",
                                         p50_ms=ms / 2, p20_ms=ms / 2, p80_ms=ms / 2))  # fmt: skip
            if case.overhead:
                rows.append(harness._row(case, arm, META, CEILINGS, mode="host", host_us=9.0))
    return {"format": 1, "suite": name, "meta": META, "ceilings": CEILINGS, "rows": rows}


def test_gemm_rows_carry_tflops_gbps_and_roofline():
    case = linear.linear_case(4096, 4096, 16, torch.bfloat16)
    row = harness._row(case, "triton", META, CEILINGS, mode="events", p50_ms=0.02)
    assert row["rate_unit"] == "TFLOP/s" and row["ceiling"] == "matmul_bf16_tflops"
    assert row["rate"] == pytest.approx(2 * 16 * 4096 * 4096 / 0.02e-3 / 1e12, rel=1e-3)
    assert row["gbps"] == pytest.approx(case.bytes / 0.02e-3 / 1e9, rel=1e-3)
    assert row["pct_of_roofline"] == max(row["pct_of_ceiling"], row["pct_of_copy"])
    assert row["pct_of_roofline"] == row["pct_of_copy"]  # M = 16: the weight read bounds it
    fp32 = linear.linear_case(512, 256, 64, torch.float32)
    assert fp32.ceiling == "matmul_fp32_tflops"
    # Existing suites keep GB/s against the copy ceiling and get no extra fields.
    from fuseml.bench.suites import softmax

    sm = next(softmax.cases(quick=True))
    row = harness._row(sm, "triton", META, CEILINGS, mode="events", p50_ms=0.02)
    assert row["rate_unit"] == "GB/s" and "gbps" not in row and "pct_of_roofline" not in row
    # No bytes, no FLOPs (tuning): no rate at all.
    tune = next(tuning.cases(quick=True))
    assert "rate" not in harness._row(tune, "cold", META, CEILINGS, mode="wall", p50_ms=5.0)


@pytest.mark.parametrize("name", NEW)
def test_tables_plots_readme_and_summary(name, tmp_path):
    doc = _fake_doc(name)
    module = SUITES[name]
    tables = [report.markdown_table(doc, spec) for spec in _specs(module)]
    for spec, table in zip(_specs(module), tables):
        header = table.splitlines()[0]
        for arm in spec["arms"]:
            assert f" {arm} |" in header, (arm, header)
        assert ("best peer" in header) == spec.get("compare", True)
        assert len(table.splitlines()) > 4
    if name == "linear":
        assert "(graph)" in tables[0] and "fp32 matmul 50 TFLOP/s" in tables[0]
        assert "% of the roofline" in tables[0]
    if name == "mlp":
        assert "eager+graph" in tables[0] and "(graph)" not in tables[0]
    if name == "lora":
        single, per_call, multi = tables
        assert "| rank | m | eager | merged | compile | triton |" in single
        assert "4096 (graph)" in single  # graph rows at every M stand in for events
        # The per-call table: the event rows themselves, only from 1024 rows.
        assert "(graph)" not in per_call and "| 4096 |" in per_call and "| 1 |" not in per_call
        assert "| adapters | m | eager | triton | triton-single |" in multi
    if name == "tuning":
        assert "8.000 s" in tables[0] and "0.150 s" in tables[0]
        assert "Ceilings measured" not in tables[0]
    if module.PLOT is not None:
        png = report.plot_suite(doc, module.PLOT, tmp_path / f"{name}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = report.write_results(name, doc["rows"], doc["ceilings"], doc["meta"], tmp_path)
    text = readme.suite_markdown(name, tmp_path)
    assert text and all(t in text for t in tables)
    if name == "lora":
        assert "*Single adapter" in text and "*Mixed batches" in text
    assert path.exists()
    lines = summarize(doc)
    assert any("output mismatches vs reference: 0" in line for line in lines)
    if name == "tuning":
        warm = next(line for line in lines if "first call, warm" in line)
        assert (
            "worst 0.15 s" in warm
            and f"{len(tuning.QUICK)}/{len(tuning.QUICK)} under the 0.2 s target" in warm
        )
        built = [line for line in lines if "Triton cache entries built" in line]
        assert built == [f"    {tuning.QUICK[0]}: 2 Triton cache entries built"]
    if name == "linear":
        assert not any("copy bandwidth" in line for line in lines)


def test_lora_plot_is_time_across_m_per_rank(tmp_path):
    spec = lora.PLOT
    assert spec["y"] == "time" and spec["x"] == "m" and spec["panels"] == ("rank",)
    assert spec["logx"] and spec["logy"]
    assert spec["arms"] == ("eager", "merged", "compile", "triton")
    doc = _fake_doc("lora")
    rows = [r for r in report.shown_rows(doc, spec) if r["arm"] in spec["arms"]]
    assert {r["kind"] for r in rows} == {"single"}
    assert {r["rank"] for r in rows} == set(lora.RANKS_QUICK)


# ------------------------------------------------------------------ tuning latency
def test_tuning_measure_fields(monkeypatch):
    calls, pycaches = [], []

    def fake_child(spec, fuseml_cache, triton_cache, pycache):
        calls.append((fuseml_cache.rsplit("/", 1)[1], triton_cache.rsplit("/", 1)[1]))
        pycaches.append(pycache)
        arm = {0: "cold", 1: "tune", 2: "warm"}[(len(calls) - 1) % 3]
        if arm == "tune" and len(calls) > 3:
            raise tuning.ChildFailed("exit 1: boom")
        first = {"cold": 9.0, "tune": 1.0, "warm": 0.1}[arm] * len(calls)
        built = {"cold": 7, "tune": 0, "warm": 2 * (len(calls) > 3)}[arm]  # 2nd warm run: 2
        return {
            "first_s": first, "second_s": 0.001, "tuned_entries": int(arm != "warm"),
            "built": built,
        }  # fmt: skip

    monkeypatch.setattr(tuning, "_run_child", fake_child)
    out = tuning.measure(tuning.PROBLEMS[tuning.QUICK[0]], runs=2)
    # cold fills folder a and the Triton cache; tune: a new tuning folder; warm: a again.
    assert calls[:3] == [("a", "triton"), ("b", "triton"), ("a", "triton")]
    # one bytecode folder a run (cold writes, tune and warm read), a new one the next run
    assert len(set(pycaches[:3])) == 1 and pycaches[3] != pycaches[0]
    cold, tune, warm = out["cold"], out["tune"], out["warm"]
    assert cold["mode"] == "wall" and cold["runs"] == 2
    assert cold["p50_ms"] == pytest.approx((9.0 + 36.0) / 2 * 1e3)
    assert (cold["p20_ms"], cold["p80_ms"]) == (9000.0, 36000.0)
    assert cold["meets_target"] is False and cold["tuned_entries"] == 1
    assert tune["runs"] == 1 and tune["error"] == "exit 1: boom"
    assert warm["tuned_entries"] == 0 and warm["meets_target"] is (warm["p50_ms"] < 200)
    assert math.isclose(warm["second_call_ms"], 1.0)
    # Triton cache entries a first call built: the most over the runs
    assert (cold["built_entries"], warm["built_entries"]) == (7, 2)


def test_tuning_child_counts_the_triton_cache_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert tuning._triton_entries() == 0
    (tmp_path / "k1").mkdir()
    (tmp_path / "k2").mkdir()
    assert tuning._triton_entries() == 2
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none"))
    assert tuning._triton_entries() == 0  # no cache folder yet


def test_measure_cases_skip_the_timing_loop():
    case = next(tuning.cases(quick=True))
    case.measure = lambda settings: {"cold": {"mode": "wall", "p50_ms": 5.0}, "warm": {}}
    rows = harness._run_case(case, CEILINGS, harness.Settings.for_mode(True), {"cold"}, META, 0)
    assert [(r["arm"], r["p50_ms"], r["problem"]) for r in rows] == [("cold", 5.0, tuning.QUICK[0])]


def test_tuning_cache_entries_counts_every_table(tmp_path):
    (tmp_path / "a.json").write_text('{"x": {}, "y": {}}')
    (tmp_path / "b.json").write_text('{"z": {}}')
    (tmp_path / "c.json").write_text("{half")
    from fuseml.ops import _tune

    assert _tune.entry_count(tmp_path) == (3, 3)  # 3 entries; the half-written file counts 0


def test_tuning_child_runs_in_a_fresh_process(tmp_path):
    """The subprocess finds this fuseml and reports; without a GPU it fails, and says why."""
    spec = {"op": "linear", "m": 16, "k": 32, "n": 48, "act": "relu"}
    dirs = str(tmp_path / "a"), str(tmp_path / "triton"), str(tmp_path / "py")
    if not torch.cuda.is_available():
        with pytest.raises(tuning.ChildFailed, match="exit 1: .*CUDA"):
            tuning._run_child(spec, *dirs)
        return
    got = tuning._run_child(spec, *dirs)
    assert got["first_s"] > 0 and got["second_s"] > 0 and got["tuned_entries"] >= 1
    assert got["built"] >= 1  # the kernels compiled into the empty Triton cache
    again = tuning._run_child(spec, *dirs)
    assert again["tuned_entries"] == 0 and again["built"] == 0  # everything on disk


@pytest.mark.parametrize("forbidden", [True, False])
def test_tuning_child_bytecode_folder(monkeypatch, tmp_path, forbidden):
    """Where the environment forbids writing bytecode, the child writes it to the run's
    folder instead (PYTHONPYCACHEPREFIX); otherwise its environment is left as it is."""
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0, tuning._MARK + '{"first_s": 1}', "")

    monkeypatch.setattr(tuning.subprocess, "run", fake_run)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    if forbidden:
        monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    else:
        monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    spec = {"op": "linear", "m": 16, "k": 32, "n": 48, "act": "relu"}
    assert tuning._run_child(spec, "a", "t", str(tmp_path / "py")) == {"first_s": 1}
    assert "PYTHONDONTWRITEBYTECODE" not in seen
    assert seen.get("PYTHONPYCACHEPREFIX") == (str(tmp_path / "py") if forbidden else None)
