"""Compare two runs of the bench suites, case by case:
``python -m fuseml.bench.compare BEFORE AFTER [--arms triton,cuda] [--limit 1.02] [--write F]``.

BEFORE and AFTER are results folders of one GPU (``<out>/<gpu>/<suite>.json``, as
``fuseml bench --out`` writes them), made in one device call on one machine (a change
measured against the code before it). For every (suite, case, arm, mode) of the given
arms in both runs it lists the two medians and their ratio; a case is slower only when
AFTER's median is more than ``limit`` times BEFORE's and the two p20-p80 ranges do not
overlap (a difference the timing's own spread does not explain). Exit status 1 when a
case is slower, so a script can stop on it.

A change measured in one call, each suite's two runs back to back on one GPU, fuseml's
arms only (all arms, torch.compile's included, take about 3.5 minutes a quick elementwise
run on an H200: five suites twice do not fit a 10-minute call); trees from before the
``apps/`` move start the command line as ``python -m fuseml.cli``::

    git worktree add /tmp/before BASE_COMMIT
    run="python -m fuseml bench --quick --arms triton,cuda"
    for s in elementwise softmax linear mlp lora; do
        (cd /tmp/before && PYTHONPATH=src $run $s --out $OUT/before)
        PYTHONPATH=src $run $s --out $OUT/after
    done
    python -m fuseml.bench.compare $OUT/before $OUT/after --write $OUT/compare.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fuseml.bench.report import load_results

FUSED_ARMS = ("triton", "cuda", "fuseml")


def _rows(folder: Path, arms: tuple[str, ...]) -> dict[tuple, dict]:
    """(suite, case, arm, mode) -> row of every results file under ``folder``."""
    found = {}
    for path in sorted(folder.glob("**/*.json")):
        try:
            doc = load_results(path)
        except (ValueError, KeyError):
            continue  # not a results file (a tuning table, a summary)
        for r in doc.get("rows", []):
            if r.get("arm") in arms and r.get("p50_ms"):
                found[(doc["suite"], r["case"], r["arm"], r.get("mode", "events"))] = r
    return found


def compare(before: Path, after: Path, arms=FUSED_ARMS, limit: float = 1.02) -> list[dict]:
    """One entry per measurement in both runs: keys suite, case, arm, mode, before_us,
    after_us, ratio (after / before) and slower (see the module docstring)."""
    old, new = _rows(Path(before), tuple(arms)), _rows(Path(after), tuple(arms))
    out = []
    for key in sorted(old.keys() & new.keys()):
        a, b = old[key], new[key]
        ratio = b["p50_ms"] / a["p50_ms"]
        apart = b.get("p20_ms", b["p50_ms"]) > a.get("p80_ms", a["p50_ms"])
        suite, case, arm, mode = key
        out.append({
            "suite": suite, "case": case, "arm": arm, "mode": mode,
            "before_us": a["p50_ms"] * 1e3, "after_us": b["p50_ms"] * 1e3, "ratio": ratio,
            "slower": ratio > limit and apart,
        })  # fmt: skip
    return out


def markdown(entries: list[dict], before: str, after: str, limit: float) -> str:
    slower = [e for e in entries if e["slower"]]
    lines = [
        f"Compared: {len(entries)} measurements of fuseml's arms, {before} -> {after}; "
        f"slower (after / before > {limit:.2f} and the p20-p80 ranges apart): {len(slower)}.",
        "",
        "| suite | case | arm | mode | before us | after us | after / before | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        mark = "slower" if e["slower"] else ""
        lines.append(
            f"| {e['suite']} | {e['case']} | {e['arm']} | {e['mode']} | {e['before_us']:,.1f} "
            f"| {e['after_us']:,.1f} | {e['ratio']:.3f} | {mark} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuseml.bench.compare")
    parser.add_argument("before", type=Path, help="results folder of the run before")
    parser.add_argument("after", type=Path, help="results folder of the run after")
    parser.add_argument("--arms", default=",".join(FUSED_ARMS), help="arms compared")
    parser.add_argument("--limit", type=float, default=1.02, help="after / before above this")
    parser.add_argument("--write", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    for name, folder in (("before", args.before), ("after", args.after)):
        if not folder.is_dir():
            parser.error(f"{name}: {folder} is not a folder")
    entries = compare(args.before, args.after, tuple(args.arms.split(",")), args.limit)
    if not entries:
        parser.error("no measurement is in both runs (same suites, cases and arms?)")
    text = markdown(entries, str(args.before), str(args.after), args.limit)
    if args.write:
        tmp = args.write.with_name(args.write.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.write)
    print(text, end="")
    return 1 if any(e["slower"] for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
