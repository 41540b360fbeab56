"""Committed rows a new run would not have kept as they are:
``python -m fuseml.bench.audit RESULTS.json ... [--write]``.

The harness times an arm again when its median is far from the same arm's committed runs
(``fuseml.bench.noise``); rows committed before that rule, or on a GPU no run has reached
since, were never checked. This reads each results file's earlier versions from git and
lists every row a table shows (``report.shown_rows`` of the suite's README tables: a
launch-bound case by its graph replays) of a peer's arm (torch, torch.compile, cuBLASLt,
...: fuseml's own arms change with the code, so their history says nothing) whose median
lies more than ``noise.HISTORY_MAX`` outside the range of that arm's medians in the
earlier versions: same case, mode and torch version, kernel events and graph replays only
(eager wall and host rows measure the host, which differs between machines). Runs are
told apart by their date; a row's own run is not its history.

``--write`` marks those rows ``noisy`` (why, and that they were not timed again), so that
the tables show them as "(noisy)", not as results, until a run on that GPU replaces them.
Exit status 1 when a row is listed and not written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from fuseml.bench import report
from fuseml.bench.commit import _git
from fuseml.bench.compare import FUSED_ARMS
from fuseml.bench.noise import HISTORY_MAX, plain_timing


def is_peer(arm: str) -> bool:
    """A peer's arm: not fuseml's (triton, cuda, fuseml, their -kernel / +graph / @config
    / :stage variants: triton-ptr, fuseml-compile, ...)."""
    base = arm.split("@")[0].split("+")[0].split(":")[0].split("-")[0]
    return base not in FUSED_ARMS


def _key(row: dict) -> tuple:
    return (row.get("case"), row.get("arm"), row.get("mode"), row.get("torch"))


def earlier_runs(path: Path) -> dict[tuple, dict[str, float]]:
    """(case, arm, mode, torch) -> {run date: median ms} over every committed version of
    the results file at ``path`` (empty outside a git checkout)."""
    path = Path(path).resolve()
    top = (_git(path.parent, "rev-parse", "--show-toplevel") or "").strip()
    if not top:
        return {}
    rel = path.relative_to(Path(top).resolve()).as_posix()
    runs: dict[tuple, dict[str, float]] = defaultdict(dict)
    for commit in (_git(Path(top), "log", "--format=%H", "--", rel) or "").split():
        text = _git(Path(top), "show", f"{commit}:{rel}")
        try:
            doc = json.loads(text or "")
        except json.JSONDecodeError:
            continue
        for row in doc.get("rows", []) if isinstance(doc, dict) else []:
            if plain_timing(row):
                runs[_key(row)][row.get("date")] = float(row["p50_ms"])
    return runs


def shown(doc: dict) -> set[tuple]:
    """(case, arm, mode) of every row the suite's README tables show (all rows for a file
    of no known suite)."""
    from fuseml.bench.suites import SUITES

    suite = SUITES.get(doc.get("suite"))
    specs = getattr(suite, "README", None)
    if specs is None:
        return {(r.get("case"), r.get("arm"), r.get("mode")) for r in doc.get("rows", [])}
    out = set()
    for spec in [specs] if isinstance(specs, dict) else specs:
        for r in report.shown_rows(doc, spec):
            if r.get("numel", 0) >= spec.get("min_numel", 0):
                out.add((r.get("case"), r.get("arm"), r.get("mode")))
    return out


def outliers(doc: dict, runs: dict[tuple, dict[str, float]]) -> list[tuple[int, str]]:
    """(index of the row in doc["rows"], why) of each shown peer row outside its history."""
    out = []
    visible = shown(doc)
    for i, row in enumerate(doc.get("rows", [])):
        if not plain_timing(row) or not is_peer(row.get("arm", "")):
            continue
        if (row.get("case"), row.get("arm"), row.get("mode")) not in visible:
            continue
        earlier = [ms for date, ms in runs.get(_key(row), {}).items() if date != row.get("date")]
        if not earlier:
            continue
        lo, hi, p50 = min(earlier), max(earlier), float(row["p50_ms"])
        if p50 > hi * (1 + HISTORY_MAX) or p50 < lo / (1 + HISTORY_MAX):
            out.append((i, (
                f"median {p50 * 1e3:,.1f} us, more than {HISTORY_MAX:.0%} outside this arm's "
                f"{len(earlier)} earlier committed run(s) ({lo * 1e3:,.1f}-{hi * 1e3:,.1f} us); "
                "not timed again since"
            )))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuseml.bench.audit")
    parser.add_argument("files", type=Path, nargs="+", help="committed results files")
    parser.add_argument("--write", action="store_true", help="mark the rows listed noisy")
    args = parser.parse_args(argv)
    listed = 0
    for path in args.files:
        if not path.is_file():
            parser.error(f"{path}: no such results file")
        doc = json.loads(path.read_text())
        found = outliers(doc, earlier_runs(path))
        for i, why in found:
            row = doc["rows"][i]
            print(f"{path}: {row['case']} | {row['arm']} | {row['mode']}: {why}")
            if args.write:
                row["noisy"] = why
        listed += len(found)
        if args.write and found:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(path)
    verb = "marked noisy" if args.write else "outside their history"
    print(f"{listed} rows {verb} in {len(args.files)} files")
    return 1 if listed and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
