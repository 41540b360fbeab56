"""Results files, terminal tables, PNG plots and the README tables generated from them.

Results live in ``benchmarks/results/<gpu>/<suite>.json``; the README's tables are
regenerated from those files (``fuseml bench readme``), never typed by hand.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from fuseml.bench.commit import commit_label

RESULTS_DIR = Path("benchmarks/results")
FORMAT_VERSION = 1


def results_path(suite: str, gpu_slug: str, root: Path = RESULTS_DIR) -> Path:
    return Path(root) / gpu_slug / f"{suite}.json"


CASES_SEP = " | "  # between the --cases patterns of a file's merged runs


def write_results(
    suite: str,
    rows: list[dict],
    ceilings: dict,
    meta: dict,
    root: Path = RESULTS_DIR,
    *,
    merge: bool = False,
) -> Path:
    """Write the suite's results file (atomically: a reader never sees half a file).

    merge: keep the rows of an existing file that this run did not measure again (same
    case, arm and mode are replaced), so a long suite can be run in parts (--cases).
    Each row carries its own commit and date; the file's meta is this run's.
    """
    path = results_path(suite, meta["gpu_slug"], root)
    path.parent.mkdir(parents=True, exist_ok=True)
    if merge and path.exists():
        old = load_results(path)
        fresh = {(r["case"], r["arm"], r.get("mode")) for r in rows}
        kept = [r for r in old["rows"] if (r["case"], r["arm"], r.get("mode")) not in fresh]
        rows = kept + list(rows)
        if old["meta"].get("run") != meta.get("run"):
            meta = {**meta, "run": "mixed"}
        if "cases" in meta and "cases" not in old["meta"]:
            # merged into a file of the whole suite: the file is no longer a subset
            meta = {k: v for k, v in meta.items() if k != "cases"}
        elif "cases" in meta:  # each run's pattern once (a run writes after every case)
            parts = old["meta"]["cases"].split(CASES_SEP)
            if meta["cases"] not in parts:
                parts.append(meta["cases"])
            meta = {**meta, "cases": CASES_SEP.join(parts)}
    doc = {
        "format": FORMAT_VERSION,
        "suite": suite,
        "meta": meta,
        "ceilings": ceilings,
        "rows": rows,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_results(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: results format {doc.get('format')!r}, expected {FORMAT_VERSION}")
    return doc


def graph_rows(doc: dict) -> dict[tuple[str, str], dict]:
    """(case, arm) -> CUDA-graph row. Launch-bound cases have one; there the event timing
    includes host time the L2 flush did not hide, so kernels are compared on the graph
    replay (GPU time) instead."""
    return {(r["case"], r["arm"]): r for r in doc["rows"] if r.get("mode") == "graph"}


def _fmt_us(ms: float | None) -> str:
    return "" if ms is None else f"{ms * 1e3:,.1f}"


def _matches(row: dict, where: dict) -> bool:
    """Does ``row`` have every param of ``where`` (value or tuple of allowed values)?"""
    return all(
        row.get(k) in (v if isinstance(v, (tuple, list)) else (v,)) for k, v in where.items()
    )


def shown_rows(doc: dict, spec: dict) -> list[dict]:
    """The rows a table or plot of ``spec`` shows.

    Rows of mode spec['mode'] (default "events") whose params match spec['where'] (if
    any). By default a case's CUDA-graph row stands in for its events row (launch-bound
    sizes), marked ``_graph``. With spec['graph_arms'] nothing is replaced: the graph rows
    of those arms are shown as arms of their own, named "<arm>+graph".
    """
    where = spec.get("where", {})
    rows = [
        r for r in doc["rows"] if r.get("mode") == spec.get("mode", "events") and _matches(r, where)
    ]
    if "graph_arms" not in spec:
        graph = graph_rows(doc)
        return [
            {**graph[(r["case"], r["arm"])], "_graph": True}
            if (r["case"], r["arm"]) in graph
            else r
            for r in rows
        ]
    extra = [
        {**r, "arm": f"{r['arm']}+graph"}
        for r in doc["rows"]
        if r.get("mode") == "graph" and r["arm"] in spec["graph_arms"] and _matches(r, where)
    ]
    return rows + extra


def _numeric_key(value) -> tuple:
    """Natural sort key: numbers inside the text compare as numbers ("64 (graph)" < "4096",
    "4096->4096" < "4096->11008")."""
    parts = re.split(r"(\d+)", str(value))
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts if p)


# ------------------------------------------------------------------------ terminal table
def print_table(rows: list[dict], title: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title, show_lines=False)
    for col in ("case", "arm", "mode", "p50 us", "p20-p80 us", "rate", "% ceil", "host us", "ok"):
        table.add_column(col, justify="left" if col in ("case", "arm", "mode") else "right")
    for r in rows:
        spread = f"{r['p20_ms'] * 1e3:,.1f}-{r['p80_ms'] * 1e3:,.1f}" if r.get("p20_ms") else ""
        rate = f"{r['rate']:,.0f} {r['rate_unit']}" if r.get("rate") else ""
        pct = f"{r['pct_of_ceiling']:.0f}%" if r.get("pct_of_ceiling") is not None else ""
        ok = {True: "yes", False: "NO", None: ""}[r.get("matches_ref")] + _noisy_mark(r)
        host = f"{r['host_us']:.1f}" if r.get("host_us") is not None else ""
        table.add_row(
            r["case"], r["arm"], r["mode"], _fmt_us(r.get("p50_ms")), spread, rate, pct, host, ok
        )
    console.print(table)


# ----------------------------------------------------------------------------- plots
def plot_suite(doc: dict, spec: dict, out_png: Path) -> Path | None:
    """One panel per combination of spec['panels'], rate vs spec['x'], one line per arm.
    None, writing nothing, when no row of ``doc`` is one the plot shows (a run of cases
    outside it, e.g. ``--cases multi`` where the LoRA plot shows single adapters).

    Optional keys: "y": "time" plots the median time (us) instead of the rate; "logy";
    "arms": only these arms, in this order; "where" and "graph_arms" as in
    :func:`shown_rows`; "panel_label": titles "param=value" instead of bare values;
    "sort": "numeric" orders panels by their leading numbers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_time = spec.get("y") == "time"
    rows = [r for r in shown_rows(doc, spec) if r.get("p50_ms" if by_time else "rate")]
    if spec.get("arms"):
        rows = [r for r in rows if r["arm"] in spec["arms"]]
    panels = {tuple(r.get(k, "") for k in spec["panels"]) for r in rows}
    if spec.get("sort") == "numeric":
        panels = sorted(panels, key=lambda p: tuple(_numeric_key(v) for v in p))
    else:
        panels = sorted(panels)
    if not panels:
        return None
    arm_names = list(dict.fromkeys(r["arm"] for r in rows))
    if spec.get("arms"):
        arm_names = [a for a in spec["arms"] if a in arm_names]
    colors = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(arm_names)}
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows + 0.8), squeeze=False)
    unit = "median time (us)" if by_time else rows[0]["rate_unit"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        sel = [r for r in rows if tuple(r.get(k, "") for k in spec["panels"]) == panel]
        by_arm = defaultdict(list)
        for r in sel:
            y = r["p50_ms"] * 1e3 if by_time else r["rate"]
            by_arm[r["arm"]].append((r[spec["x"]], y))
        for arm, pts in by_arm.items():
            pts.sort()
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=arm,
                color=colors[arm],
            )  # fmt: skip
        ceiling = None if by_time else sel[0].get("ceiling_value")
        if ceiling:
            ax.axhline(ceiling, color="gray", ls="--", lw=1, label=f"{sel[0]['ceiling']}")
        if spec.get("logx"):
            ax.set_xscale("log")
        if spec.get("logy"):
            ax.set_yscale("log")
        if spec.get("panel_label"):
            title = ", ".join(f"{k}={v}" for k, v in zip(spec["panels"], panel))
        else:
            title = " / ".join(map(str, panel))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(spec.get("xlabel", spec["x"]))
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors[a], marker="o", ms=3, label=a) for a in arm_names]
    if not by_time:
        kinds = sorted({r.get("ceiling") for r in rows if r.get("ceiling_value")})
        label = "measured copy ceiling"
        if kinds and kinds != ["copy_gbps"]:
            label = "measured ceiling (" + ", ".join(kinds) + ")"
        handles.append(plt.Line2D([], [], color="gray", ls="--", label=label))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9,
               bbox_to_anchor=(0.5, 0.975), frameon=False)  # fmt: skip
    meta = doc["meta"]
    how = "launch-bound sizes as CUDA-graph replays"
    if "graph_arms" in spec:
        how = "'+graph': CUDA-graph replays of back-to-back calls"
    fig.suptitle(
        f"fuseml {doc['suite']} on {meta['gpu']} (torch {meta['torch']}, triton "
        f"{meta['triton']}); {how}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


# ---------------------------------------------------------------------- README tables
DEFAULT_CELLS_NOTE = (
    "Cells: median time, % of copy bandwidth. (graph): a launch-bound size, timed as "
    "CUDA-graph replays of back-to-back calls (GPU time per call); host time per call is in "
    "the overhead table."
)
_CEILING_LABELS = {"matmul_tf32_tflops": "tf32 matmul", "matmul_fp32_tflops": "fp32 matmul"}


def _cell(r: dict, spec: dict) -> str:
    if r.get("p50_ms") is None:
        return "failed" if r.get("error") else ""
    if spec.get("cell") == "samples":  # model suites: throughput, then latency
        p99 = f" / {r['p99_ms'] * 1e3:,.0f}" if r.get("p99_ms") is not None else ""
        return f"{r['rate']:,.0f}/s ({r['p50_ms'] * 1e3:,.0f}{p99} us)"
    if spec.get("unit") == "s":
        text = f"{r['p50_ms'] / 1e3:,.3f} s"
    else:
        text = f"{r['p50_ms'] * 1e3:,.1f} us"
    pct = r.get(spec.get("pct", "pct_of_ceiling"))
    return text + (f", {pct:.0f}%" if pct is not None else "") + _noisy_mark(r)


def _noisy_mark(*rows: dict) -> str:
    """' (noisy)' where a row's timing is unsettled (noise.py: after its re-runs; audit.py:
    found so against its history later)."""
    return " (noisy)" if any(r.get("noisy") for r in rows) else ""


NOISY_NOTE = (
    " (noisy): unsettled (p20-p80 spread over 10% of the median, or median over 15% off the "
    "arm's committed runs), after re-runs or found so later (python -m fuseml.bench.audit); "
    "not a result to rely on."
)


def markdown_table(doc: dict, spec: dict, *, footer: bool = True) -> str:
    """Rows = spec['rows'] keys, columns = arms: 'p50 us (GB/s, % of ceiling)'.

    Optional keys besides those of :func:`shown_rows`: "pct" (row field shown as the
    percentage, default pct_of_ceiling), "unit" ("s" for seconds), "cell": "samples"
    (samples/s with p50 / p99 latency), "sort": "numeric",
    "compare": False (no best-peer columns), "fused" (the arm compared with its peers,
    default triton), "reference_arms" (shown, never peers), "extra_ceilings" (named in the
    footer besides copy and bf16 matmul), "ceilings": False (none named), "note" (the
    footer's last sentences), "first_call_arms" (arms whose first-call time, compile_s,
    the footer reports as a range).
    """
    rows = [r for r in shown_rows(doc, spec) if r.get("numel", 0) >= spec.get("min_numel", 0)]
    arms = [a for a in spec["arms"] if any(r["arm"] == a for r in rows)]
    keyed = defaultdict(dict)
    for r in rows:
        key = tuple(
            "x".join(map(str, r[k])) if isinstance(r.get(k), list) else r.get(k, "")
            for k in spec["rows"]
        )
        if r.get("_graph"):
            key = (*key[:-1], f"{key[-1]} (graph)")
        keyed[key][r["arm"]] = r
    compare = spec.get("compare", True)
    head = [*spec["rows"], *arms] + (["best peer", "fused vs best peer"] if compare else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    not_peers = ("triton", "cuda", "copy", spec.get("fused", "triton"),
                 *spec.get("reference_arms", ()))  # fmt: skip
    peers = [a for a in arms if a not in not_peers]
    if spec.get("sort") == "numeric":
        order = sorted(keyed, key=lambda k: tuple(_numeric_key(v) for v in k))
    else:
        order = sorted(keyed, key=lambda k: tuple(str(v).zfill(12) for v in k))
    for key in order:
        cells = list(map(str, key))
        by_arm = keyed[key]
        for a in arms:
            r = by_arm.get(a)
            cells.append("" if r is None else _cell(r, spec))
        if compare:
            peer_times = [
                (by_arm[a]["p50_ms"], a) for a in peers if by_arm.get(a, {}).get("p50_ms")
            ]
            fused = by_arm.get(spec.get("fused", "triton"))
            if peer_times and fused and fused.get("p50_ms"):
                best_ms, best = min(peer_times)
                ratio = f"{best_ms / fused['p50_ms']:.2f}x" + _noisy_mark(by_arm[best], fused)
                cells += [best, ratio]
            else:
                cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    if not footer:
        return "\n".join(lines)
    meta, ceil = doc["meta"], doc["ceilings"]
    extra = "".join(
        f", {_CEILING_LABELS.get(k, k)} {ceil.get(k, 0):,.0f} TFLOP/s"
        for k in spec.get("extra_ceilings", ())
    )
    ceilings = (
        f"Ceilings measured in the same run: copy {ceil.get('copy_gbps', 0):,.0f} GB/s, bf16 "
        f"matmul {ceil.get('matmul_bf16_tflops', 0):,.0f} TFLOP/s{extra}. "
    )
    lines.append("")
    lines.append(
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"{commits_note(rows, meta)}. "
        + (ceilings if spec.get("ceilings", True) else "")
        + spec.get("note", DEFAULT_CELLS_NOTE)
        + _first_calls(rows, spec)
        + (NOISY_NOTE if any(r.get("noisy") for r in rows) else "")
    )
    return "\n".join(lines)


def commits_note(rows: list[dict], meta: dict) -> str:
    """'commit X, date' when the rows come from one commit; with rows merged from several
    runs ('--merge'), each commit and how many of the rows it measured."""
    counts: dict[str, int] = {}
    for r in rows:
        c = commit_label(r.get("commit", meta.get("commit", "?")), r.get("src_tree"))
        counts[c] = counts.get(c, 0) + 1
    if len(counts) <= 1:
        # the rows' own date (a subset of a merged file may predate its last run)
        date = max((r["date"] for r in rows if r.get("date")), default=meta.get("date", "?"))
        return f"commit {next(iter(counts), meta.get('commit', '?'))}, {date}"
    parts = ", ".join(f"{c} ({n} rows)" for c, n in counts.items())
    return f"rows from commits {parts}; last run {meta.get('date', '?')}"


def _first_calls(rows: list[dict], spec: dict) -> str:
    """' First calls (outside the timing): arm a-b s, ...' for spec['first_call_arms']."""
    parts = []
    for arm in spec.get("first_call_arms", ()):
        secs = [r["compile_s"] for r in rows if r["arm"] == arm and r.get("compile_s")]
        if secs:
            lo, hi = min(secs), max(secs)
            span = f"{lo:.1f} s" if len(secs) == 1 else f"{lo:.1f}-{hi:.1f} s"
            parts.append(f"{arm} {span} ({len(secs)} case{'s' if len(secs) > 1 else ''})")
    return " First calls, outside the timing: " + ", ".join(parts) + "." if parts else ""


def update_readme(readme: Path, section: str, text: str) -> bool:
    """Replace the text between <!-- fuseml:NAME --> and <!-- /fuseml:NAME -->."""
    content = readme.read_text()
    pattern = re.compile(
        rf"(<!-- fuseml:{re.escape(section)} -->\n).*?(<!-- /fuseml:{re.escape(section)} -->)",
        re.S,
    )
    if not pattern.search(content):
        return False
    new = pattern.sub(lambda m: m.group(1) + text.rstrip() + "\n" + m.group(2), content)
    readme.write_text(new)
    return True


def overhead_table(doc: dict) -> str | None:
    """Per-call host overhead and graph-replay time at the smallest size of each op."""
    host = [r for r in doc["rows"] if r.get("host_us") is not None]
    if not host:
        return None
    graph = graph_rows(doc)
    events = {(r["case"], r["arm"]): r for r in doc["rows"] if r.get("mode") == "events"}
    lines = [
        "| case | arm | host us / call | GPU us / call (events) | GPU us / call (CUDA graph) |",
        "|---|---|---|---|---|",
    ]
    for r in host:
        key = (r["case"], r["arm"])
        ev, gr = events.get(key), graph.get(key)
        ev_us = "" if ev is None else f"{ev['p50_ms'] * 1e3:.1f}"
        gr_us = "" if gr is None else f"{gr['p50_ms'] * 1e3:.1f}"
        lines.append(f"| {r['case']} | {r['arm']} | {r['host_us']:.1f} | {ev_us} | {gr_us} |")
    return "\n".join(lines)
