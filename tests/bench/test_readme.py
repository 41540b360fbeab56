"""`fuseml bench readme`: per-GPU pages, the README's headline table and its check mode,
on a small synthetic results folder."""

from pathlib import Path

from fuseml.bench import readme, report

CEILINGS = {"copy_gbps": 3000.0, "matmul_bf16_tflops": 700.0}
README = "# x\n\n<!-- fuseml:headline -->\nold\n<!-- /fuseml:headline -->\n\nend\n"


def _meta(gpu: str) -> dict:
    slug = gpu.lower().replace(" ", "-")
    return {"gpu": gpu, "gpu_slug": slug, "torch": "2.9", "triton": "3.6", "commit": "abc",
            "date": "2026-01-01", "run": "full"}  # fmt: skip


def _row(case: str, arm: str, us: float, mode: str = "events", **params) -> dict:
    return {"case": case, "arm": arm, "mode": mode, "p50_ms": us / 1e3, "rate": 1.0,
            "pct_of_ceiling": 50.0, "commit": "abc", "date": "2026-01-01", **params}  # fmt: skip


def _dlrm_rows() -> list[dict]:
    # fuseml timed at batches 1, 64 and 4096 of kaggle: the headline keeps 64 and 4096.
    rows = []
    times = {1: (100, 80, 120), 64: (110, 90, 100), 4096: (400, 200, 300)}
    for batch, (eager, compile_, fuseml) in times.items():
        case = f"kaggle/bf16/bs{batch}"
        p = {"config": "kaggle", "precision": "bf16", "batch": batch, "numel": batch}
        for arm, us in (("eager", eager), ("compile", compile_), ("fuseml", fuseml)):
            rows.append(_row(case, arm, us, **p))
            rows.append(_row(case, arm, us / 2, mode="graph", **p))
    # a batch without fuseml is never a headline row
    p = {"config": "kaggle", "precision": "bf16", "batch": 65536, "numel": 65536}
    rows += [_row("kaggle/bf16/bs65536", a, 900, **p) for a in ("eager", "compile")]
    # nor one without torch.compile ("vs best" would read against eager alone)
    p = {"config": "mlperf", "precision": "bf16", "batch": 64, "numel": 64}
    rows += [_row("mlperf/bf16/bs64", a, us, **p) for a, us in (("eager", 300), ("fuseml", 50))]
    # the headline is bf16's; fp32 rows are on the GPU's page
    p = {"config": "kaggle", "precision": "fp32", "batch": 64, "numel": 64}
    rows += [_row("kaggle/fp32/bs64", a, 500, **p) for a in ("eager", "compile", "fuseml")]
    return rows


def _elementwise_rows(scale: float = 1.0) -> list[dict]:
    rows = []
    for shape, numel, triton, compile_ in (
        ([4096, 512], 4096 * 512, 10.0, 12.0),
        ([65536, 512], 65536 * 512, 100.0, 150.0),
    ):
        case = f"bias_gelu/bfloat16/{shape[0]}x{shape[1]}"
        p = {"op": "bias_gelu", "dtype": "bfloat16", "shape": shape, "numel": numel}
        rows += [_row(case, "triton", triton * scale, **p), _row(case, "compile", compile_, **p)]
    # Larger, but only the fused arm ran: not a representative case.
    p = {"op": "bias_gelu", "dtype": "bfloat16", "shape": [65536, 4096], "numel": 65536 * 4096}
    rows.append(_row("bias_gelu/bfloat16/65536x4096", "triton", 500.0, **p))
    # Another op of the family: not its main case.
    p = {"op": "add", "dtype": "bfloat16", "shape": [1 << 28], "numel": 1 << 28}
    rows += [_row("add/bfloat16/268435456", a, 900.0, **p) for a in ("triton", "builtin")]
    return rows


def _results(root: Path) -> None:
    main, other = _meta("Big GPU"), _meta("Small GPU")
    report.write_results("dlrm", _dlrm_rows(), CEILINGS, main, root)
    report.write_results("elementwise", _elementwise_rows(), CEILINGS, main, root)
    report.write_results("elementwise", _elementwise_rows(2.0), CEILINGS, other, root)
    (root / "big-gpu" / "elementwise.png").write_bytes(b"png")


def test_pages_and_headline(tmp_path):
    root = tmp_path / "benchmarks" / "results"
    _results(root)
    (tmp_path / "README.md").write_text(README)
    written = readme.regenerate(tmp_path / "README.md", root)
    big, small = root / "big-gpu" / "README.md", root / "small-gpu" / "README.md"
    assert set(written) == {big, small, tmp_path / "README.md"}
    assert not list(tmp_path.rglob("*.tmp"))  # written through a temporary file, renamed

    # One page per GPU with that GPU's full tables; plots linked beside the page.
    page = big.read_text()
    assert page.startswith("# fuseml results: Big GPU")
    assert "## DLRM inference" in page and "## Elementwise" in page and "## LoRA" not in page
    assert page.index("## DLRM inference") < page.index("## Elementwise")
    assert "| config | precision | ids | batch | eager |" in page
    assert "| bias_gelu | bfloat16 | 65536x512 |" in page
    assert "](elementwise.png)" in page and "(#dlrm-inference)" in page
    assert "Small GPU" not in page and "DLRM" not in small.read_text()

    text = (tmp_path / "README.md").read_text()
    assert "old" not in text and text.startswith("# x\n") and text.endswith("\nend\n")
    # DLRM: the headline batches (64, 4096, 65536) fuseml ran, eager and graph, against
    # the fastest of eager and compile (64: 90 / 100 us; 4096: 200 / 300 us).
    assert "| DLRM kaggle, bf16 | 64 | 110 us | 90.0 us |  | 100 us | 0.90x |" in text
    assert "| DLRM kaggle, bf16 | 4,096 | 400 us | 200 us |  | 300 us | 0.67x |" in text
    assert "| 1 |" not in text and "65,536" not in text and "mlperf" not in text
    assert "fp32" not in text and "| kaggle | fp32 |  | 64 |" in page
    # Ops: the largest size of the main case with the fused arm and a peer timed, from
    # the GPU with the most suites, linked to its section of that GPU's page.
    line = next(x for x in text.splitlines() if x.startswith("| elementwise"))
    assert "bias_gelu/bfloat16/65536x512 | 100 us | compile 150 us | 1.50x |" in line
    assert "(benchmarks/results/big-gpu/README.md#elementwise)" in line
    assert text.index("DLRM kaggle") < text.index("| elementwise")
    assert "[Small GPU](benchmarks/results/small-gpu/README.md)" in text

    # Regenerating unchanged results changes nothing.
    assert readme.regenerate(tmp_path / "README.md", root) == []


def test_check_mode_reports_stale_files_and_writes_nothing(tmp_path):
    root = tmp_path / "results"
    _results(root)
    (tmp_path / "README.md").write_text(README)
    readme.regenerate(tmp_path / "README.md", root)
    assert readme.regenerate(tmp_path / "README.md", root, check=True) == []
    # New results on the small GPU: its page is stale, the README's headline is not.
    meta = _meta("Small GPU")
    report.write_results("elementwise", _elementwise_rows(3.0), CEILINGS, meta, root)
    before = (root / "small-gpu" / "README.md").read_text()
    stale = readme.regenerate(tmp_path / "README.md", root, check=True)
    assert stale == [root / "small-gpu" / "README.md"]
    assert (root / "small-gpu" / "README.md").read_text() == before
    # A hand edit of the headline is caught too.
    text = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(text.replace("1.50x", "1.60x"))
    stale = readme.regenerate(tmp_path / "README.md", root, check=True)
    assert tmp_path / "README.md" in stale


def test_family_row_from_another_gpu_where_the_headline_gpu_lacks_the_case(tmp_path):
    root = tmp_path / "results"
    _results(root)
    # The headline GPU's elementwise file holds another op only (a partial run).
    adds = [r for r in _elementwise_rows() if r["op"] == "add"]
    report.write_results("elementwise", adds, CEILINGS, _meta("Big GPU"), root)
    (tmp_path / "README.md").write_text(README)
    readme.regenerate(tmp_path / "README.md", root)
    line = next(x for x in (tmp_path / "README.md").read_text().splitlines()
                if x.startswith("| elementwise"))  # fmt: skip
    assert "bias_gelu/bfloat16/65536x512 | 200 us | compile 150 us | 0.75x |" in line
    assert "(benchmarks/results/small-gpu/README.md#elementwise)" not in line
    assert "Elementwise, Small GPU](" in line and "small-gpu/README.md#elementwise" in line


def test_family_row_rule():
    doc = {"suite": "elementwise", "meta": _meta("G"), "ceilings": CEILINGS,
           "rows": _elementwise_rows()}  # fmt: skip
    row = readme.family_row(doc, {"op": "bias_gelu", "dtype": "bfloat16"})
    assert row["case"] == "bias_gelu/bfloat16/65536x512" and row["peer"] == "compile"
    assert (row["fused"]["p50_ms"], row["peer_row"]["p50_ms"]) == (0.1, 0.15)
    # A launch-bound size timed as a CUDA graph: the graph row stands in, and says so.
    graph = [_row(r["case"], r["arm"], 5.0, mode="graph", **{k: r[k] for k in ("op", "dtype",
             "shape", "numel")}) for r in doc["rows"] if r["case"].endswith("65536x512")]  # fmt: skip
    row = readme.family_row({**doc, "rows": doc["rows"] + graph}, {"op": "bias_gelu"})
    assert row["case"] == "bias_gelu/bfloat16/65536x512 (graph)"
    assert row["fused"]["p50_ms"] == 0.005
    assert readme.family_row(doc, {"op": "gelu"}) is None


def test_committed_readme_and_pages_match_the_results():
    """README.md's headline and every benchmarks/results/<gpu>/README.md are what
    `fuseml bench readme` makes of the committed results."""
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "README.md").exists():
        return
    stale = readme.regenerate(repo / "README.md", repo / "benchmarks" / "results", check=True)
    assert stale == [], f"run `fuseml bench readme`: {stale} differ from the results"


def test_ratio_marks_ties_and_noisy_rows():
    fused = {"p50_ms": 1.0}
    assert readme.ratio(fused, {"p50_ms": 1.5, "p20_ms": 1.4, "p80_ms": 1.6}) == "1.50x"
    # within the peer's p20-p80 spread: a tie, whichever median is lower
    assert readme.ratio(fused, {"p50_ms": 0.99, "p20_ms": 0.95, "p80_ms": 1.02}) == "0.99x (tie)"
    assert readme.ratio({**fused, "noisy": True}, {"p50_ms": 2.0}) == "2.00x (noisy)"
