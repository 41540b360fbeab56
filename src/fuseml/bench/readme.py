"""Regenerate the README's result sections from benchmarks/results (never by hand)."""

from __future__ import annotations

from pathlib import Path

from fuseml.bench import report
from fuseml.bench.suites import SUITES


def suite_markdown(suite: str, root: Path) -> str | None:
    files = sorted(Path(root).glob(f"*/{suite}.json"))
    if not files:
        return None
    parts = []
    for path in files:
        doc = report.load_results(path)
        partial = ", cut short: not every case ran" if doc["meta"].get("complete") is False else ""
        if doc["meta"].get("cases"):
            partial += f"; only the cases matching `{doc['meta']['cases']}`"
        parts.append(f"**{doc['meta']['gpu']}** ({doc['meta']['run']} run{partial})\n")
        # README: one table spec, or a list of them (a titled table each, when it has rows).
        specs = SUITES[suite].README
        specs = [specs] if isinstance(specs, dict) else [s for s in specs
                                                         if report.shown_rows(doc, s)]  # fmt: skip
        for i, spec in enumerate(specs):
            if i:
                parts.append("")
            if spec.get("title"):
                parts.append(f"*{spec['title']}*\n")
            parts.append(report.markdown_table(doc, spec))
        overhead = report.overhead_table(doc)
        if overhead:
            parts.append("\n" + overhead)
        png = path.with_suffix(".png")
        if png.exists():
            parts.append(f"\n![{suite} on {doc['meta']['gpu']}]({png.as_posix()})\n")
    return "\n".join(parts)


FUSION_ARMS = (("manual", "manual PyTorch"), ("builtin", "PyTorch built-in"),
               ("cuda", "CUDA C++"), ("triton", "Triton"), ("compile", "torch.compile"))  # fmt: skip


def fusion_markdown(root: Path) -> str | None:
    """GELU (elementwise suite) and softmax side by side: the same op five ways, per GPU
    with results of either suite (a GPU without one of them says so)."""
    parts = []
    for gpu_dir in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        ew, sm = gpu_dir / "elementwise.json", gpu_dir / "softmax.json"
        present = [
            (path, op_key, builtin)
            for path, op_key, builtin in ((ew, "gelu", "builtin"), (sm, "softmax", "torch"))
            if path.exists()
        ]
        if not present:
            continue
        rows = []
        sources = [
            f"{op_key}: no {path.stem} results on this GPU yet"
            for path, op_key, _ in ((ew, "gelu", None), (sm, "softmax", None))
            if not path.exists()
        ]
        for path, op_key, builtin in present:
            doc = report.load_results(path)
            meta = doc["meta"]
            events = [r for r in doc["rows"] if r.get("mode") == "events" and r["op"] == op_key]
            sources.append(
                f"{op_key}: {meta.get('run', '?')} run of the {doc['suite']} suite, "
                f"{report.commits_note(events, meta)}"
            )
            graph = report.graph_rows(doc)
            by_case: dict[str, dict] = {}
            for r in events:
                # Launch-bound sizes: the CUDA-graph replay (GPU time), as in the suite tables.
                label = r["case"] + (" (graph)" if (r["case"], r["arm"]) in graph else "")
                by_case.setdefault(label, {})[r["arm"]] = graph.get((r["case"], r["arm"]), r)
            for case, arms in sorted(
                by_case.items(), key=lambda kv: next(iter(kv[1].values()))["numel"]
            ):
                cells = []
                for arm, _ in FUSION_ARMS:
                    r = arms.get(builtin if arm == "builtin" else arm)
                    cells.append(
                        ""
                        if r is None
                        else f"{r['p50_ms'] * 1e3:,.1f} us ({r['pct_of_ceiling']:.0f}%)"
                    )
                rows.append(f"| {case} | " + " | ".join(cells) + " |")
            gpu = doc["meta"]["gpu"]
        head = "| case | " + " | ".join(label for _, label in FUSION_ARMS) + " |"
        parts += [f"**{gpu}**: median time (% of the copy bandwidth measured in the same run)\n",
                  head, "|---" * (len(FUSION_ARMS) + 1) + "|", *rows,
                  "", "Sources: " + "; ".join(sources) + "."]  # fmt: skip
        png = gpu_dir / "softmax.png"
        if png.exists():
            parts.append(f"\n![softmax GB/s across N on {gpu}]({png.as_posix()})\n")
    return "\n".join(parts) if parts else None


def regenerate(readme: Path, root: Path) -> None:
    for suite in SUITES:
        text = suite_markdown(suite, root)
        if text is None:
            print(f"{suite}: no results under {root}")
            continue
        if report.update_readme(readme, f"results:{suite}", text):
            print(f"{suite}: README section updated")
        else:
            print(f"{suite}: README has no <!-- fuseml:results:{suite} --> section")
    fusion = fusion_markdown(root)
    if fusion and report.update_readme(readme, "fusion", fusion):
        print("fusion side by side: README section updated")
