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
        parts.append(f"**{doc['meta']['gpu']}** ({doc['meta']['run']} run)\n")
        parts.append(report.markdown_table(doc, SUITES[suite].README))
        overhead = report.overhead_table(doc)
        if overhead:
            parts.append("\n" + overhead)
        png = path.with_suffix(".png")
        if png.exists():
            parts.append(f"\n![{suite} on {doc['meta']['gpu']}]({png.as_posix()})\n")
    return "\n".join(parts)


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
