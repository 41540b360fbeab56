import importlib.util

from fuseml.bench import harness, readme, report
from fuseml.bench.suites import SUITES, overhead

META = {"gpu": "Test GPU", "gpu_slug": "test-gpu", "torch": "2.x", "triton": "3.x",
        "commit": "abc", "date": "2026-01-01T00:00:00Z", "run": "quick"}  # fmt: skip


def test_registered_and_every_public_op_has_a_case():
    assert SUITES["overhead"] is overhead
    cases = list(overhead.cases(quick=True))
    assert len({c.name for c in cases}) == len(cases)
    ops = {c.params["name"] for c in cases if c.params["kind"] == "op"}
    # every public op (log_softmax shares softmax's launcher)
    assert ops >= {"gelu", "softmax", "add", "bias_act relu", "linear", "mlp", "lora_linear",
                   "embedding_interaction"}  # fmt: skip
    assert any(c.params["kind"] == "model" and "DLRM" in c.params["name"] for c in cases)
    if importlib.util.find_spec("peft") is not None:  # the peft model as users build it
        assert any(c.params["name"] == "peft LoRA MLP" for c in cases)
    for case in cases:
        assert case.measure is not None and case.arms == {} and not case.check


def test_table_shows_host_time_and_compares_fuseml_with_the_best_peer():
    rows = []
    for i, case in enumerate(overhead.cases(quick=True)):
        for arm, us in (("torch", 10.0 + i), ("fuseml", 8.0 + i)):
            rows.append(harness._row(case, arm, META, {}, mode="host", p50_ms=us / 1e3,
                                     p20_ms=us / 1e3, p80_ms=us / 1e3, host_us=us))  # fmt: skip
    doc = {"format": 1, "suite": "overhead", "meta": META, "ceilings": {}, "rows": rows}
    table = report.markdown_table(doc, overhead.README)
    lines = table.splitlines()
    assert "| torch | fuseml | best peer |" in lines[0]
    gelu = next(line for line in lines if "| gelu |" in line)
    assert "10.0 us" in gelu and "8.0 us" in gelu and "1.25x" in gelu
    assert readme._peers(overhead.README) == ["torch", "cublaslt", "merged"]
