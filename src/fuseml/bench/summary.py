"""Short speed summary of results files: ``python -m fuseml.bench.summary DIR``."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from fuseml.bench.report import graph_rows, load_results

FUSED = ("triton", "cuda")
# Shown for reference, never a peer: the lora suite's fused single-adapter row in its
# multi-adapter cases (another function), and the experimental TMA GEMM (fuseml itself).
REFERENCE_ARMS = ("copy", "triton-single", "triton-tma", "triton-ptr")


def summarize(doc: dict) -> list[str]:
    rows = [r for r in doc["rows"] if r.get("mode") == "events" and r.get("p50_ms")]
    graph = graph_rows(doc)
    timed = [graph.get((r["case"], r["arm"]), r) for r in rows]
    lines = [f"{doc['suite']} on {doc['meta']['gpu']}: {len(doc['rows'])} rows"]
    bad = [r for r in doc["rows"] if r.get("matches_ref") is False]
    lines.append(f"  output mismatches vs reference: {len(bad)}")
    failed = [r for r in doc["rows"] if r.get("error") and r.get("mode") != "wall"]
    if failed:  # (the tuning suite's failed first calls are counted per arm below)
        lines.append(f"  failed arms: {len(failed)}")
        lines.extend(f"    {r['case']} {r['arm']}: {r['error']}" for r in failed)
    noisy = [r for r in doc["rows"] if r.get("noisy")]
    if noisy:  # timed again and still unsettled (noise.py): no result to rest a claim on
        lines.append(f"  noisy rows (timed again, still unsettled): {len(noisy)}")
        lines.extend(f"    {r['case']} {r['arm']} ({r['mode']}): {r['noisy']}" for r in noisy)
    by_case = defaultdict(dict)
    for r in timed:
        by_case[r["case"]][r["arm"]] = r
    for arm in FUSED:
        by_ceiling = defaultdict(list)
        for c in by_case.values():
            if arm in c and c[arm].get("numel", 0) >= 16_000_000 and c[arm].get("pct_of_ceiling"):
                by_ceiling[c[arm]["ceiling"]].append(c[arm]["pct_of_ceiling"])
        for ceiling, pcts in sorted(by_ceiling.items()):
            what = "copy bandwidth" if ceiling == "copy_gbps" else f"the {ceiling} ceiling"
            lines.append(
                f"  {arm}: % of {what} at >= 16M elements: min {min(pcts):.0f}%, "
                f"median {sorted(pcts)[len(pcts) // 2]:.0f}%"
            )
        vs_copy = [
            (100 * c["copy"]["p50_ms"] / c[arm]["p50_ms"], case)
            for case, c in by_case.items()
            if arm in c and "copy" in c and c[arm].get("numel", 0) >= 16_000_000
        ]
        if vs_copy:
            worst = min(vs_copy)
            lines.append(
                f"  {arm}: speed as % of a plain copy of the same bytes at >= 16M elements: "
                f"min {worst[0]:.0f}% ({worst[1]})"
            )
        ratios = []
        overlap = set()  # cases below 1.00x whose p20-p80 spread meets the fastest peer's
        unsettled = set()  # cases whose ratio rests on a noisy row (ours or the peer's)
        for case, arms in by_case.items():
            peers = [r for a, r in arms.items() if a not in (*FUSED, *REFERENCE_ARMS)]
            if arm in arms and peers and arms[arm].get("numel", 0) >= 1_000_000:
                ours, peer = arms[arm], min(peers, key=lambda r: r["p50_ms"])
                ratios.append((peer["p50_ms"] / ours["p50_ms"], case))
                if ours.get("noisy") or peer.get("noisy"):
                    unsettled.add(case)
                if ours.get("p20_ms", ours["p50_ms"]) <= peer.get("p80_ms", peer["p50_ms"]):
                    overlap.add(case)
        if ratios:
            worst = min(ratios)
            below = [case for r, case in ratios if r < 1.0]
            spread = sum(case in overlap for case in below)
            lines.append(
                f"  {arm}: speed vs fastest peer at >= 1M elements (graph replay where "
                f"launch-bound): worst {worst[0]:.2f}x ({worst[1]}), "
                f"{len(ratios) - len(below)}/{len(ratios)} cases >= 1.00x"
                + (
                    f" ({spread} of the {len(below)} below within the peer's p20-p80)"
                    if below
                    else ""
                )
                + (f"; a noisy row in {len(unsettled)} of them" if unsettled else "")
            )
            slow = sorted(ratios)[:5]
            lines += [
                f"    {r:.2f}x {case}" + (" (p20-p80 spreads overlap)" if case in overlap else "")
                for r, case in slow
                if r < 1.0
            ]
    # First-call (tuning) latency rows: wall time of a fresh process's first call.
    wall = [r for r in doc["rows"] if r.get("mode") == "wall"]
    for arm in dict.fromkeys(r["arm"] for r in wall):
        done = [r for r in wall if r["arm"] == arm and r.get("p50_ms") is not None]
        failed = sum(1 for r in wall if r["arm"] == arm and r.get("error"))
        if done:
            worst = max(done, key=lambda r: r["p50_ms"])
            met = sum(bool(r.get("meets_target")) for r in done)
            lines.append(
                f"  first call, {arm}: worst {worst['p50_ms'] / 1e3:.2f} s ({worst['case']}), "
                f"{met}/{len(done)} under the {worst.get('target_ms', 0) / 1e3:g} s target"
                + (f", {failed} failed" if failed else "")
            )
            if arm == "warm":  # a warm first call should find every kernel on disk
                built = [r for r in done if r.get("built_entries")]
                lines += [
                    f"    {r['case']}: {r['built_entries']} Triton cache entries built"
                    for r in built
                ]
        elif failed:
            lines.append(f"  first call, {arm}: {failed} failed")
    return lines


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "benchmarks/results")
    files = sorted(root.glob("*/*.json"))
    if not files:
        print(f"no results under {root}")
        return 1
    for path in files:
        print("\n".join(summarize(load_results(path))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
