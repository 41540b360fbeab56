"""Generate the results pages and the README's headline table from benchmarks/results.

``fuseml bench readme`` writes one page per GPU, ``benchmarks/results/<gpu>/README.md``,
with every suite's full tables, and fills the README's ``<!-- fuseml:headline -->``
section: whole-model DLRM rows, then one row per op family. Nothing here is typed by
hand: every number comes from the committed results files, and ``check=True`` reports
the files that differ from what the results give (so a test can keep them in step).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fuseml.bench import report
from fuseml.bench.suites import SUITES

PAGE = "README.md"

# Per-GPU page sections, in page order: (key, title). "fusion" is the GELU / softmax
# side-by-side table; the others are suites.
SECTIONS = (
    ("dlrm", "DLRM inference"),
    ("models", "MLP and LoRA models"),
    ("interaction", "DLRM gather + interaction"),
    ("elementwise", "Elementwise"),
    ("fusion", "Fusion, side by side"),
    ("softmax", "Softmax"),
    ("linear", "Fused linear layers"),
    ("mlp", "Whole-MLP fusion"),
    ("lora", "LoRA"),
    ("overhead", "Time per eager call"),
    ("tuning", "Tuning latency"),
)

INTROS = {
    "dlrm": (
        "Samples/s per batch size for the kaggle and mlperf configs (the full Kaggle tables, "
        "33.8M rows; runs dated before 2026-11-28 capped each table at 1M rows), fp32, "
        "fp32 with TF32 and bf16: eager PyTorch, torch.compile, max-autotune (bf16) and "
        "`fuseml.optimize(model)` (every precision from 2026-11-29 on, bf16 before), each "
        "called eagerly and replayed as a CUDA graph (`+graph`)."
    ),
    "models": (
        "Whole models as users run them (the DLRM kaggle top MLP as an `nn.Sequential`; a "
        "4096-wide 3-layer MLP with peft's default LoRA): called eagerly (wall time per "
        "call) and replayed from a CUDA graph, against torch.compile and, for peft, the "
        "merged weights; `fuseml-compile` is `torch.compile(fuseml.optimize(model))`."
    ),
    "overhead": (
        "Wall time per eager call at host-bound sizes: every public op and "
        "`fuseml.optimize`d models against their torch equivalents, in one run."
    ),
    "interaction": (
        "`fuseml.ops.embedding_interaction` alone: 26 ids a row gathered from the full "
        "Kaggle tables and `[x, tril(Z Z^T)]` written padded to the top MLP's aligned width. "
        "Arms: `torch` is what the model runs (embedding, cat, bmm, the triangle's index, "
        "cat, pad), `compile` its torch.compile, `gather` a kernel that only reads the same "
        "rows at the same ids and writes them out (the floor of any gather; a reference)."
    ),
    "elementwise": (
        "Arms: `manual` is the unfused torch chain a user would write, `builtin` torch's own "
        "op (`torch.add`, `F.gelu`), `compile` `torch.compile` of the reference, `triton` and "
        "`cuda` fuseml's kernels, `copy` a device copy of the same bytes (for reference)."
    ),
    "fusion": (
        "The same op written five ways: the unfused chain in PyTorch, PyTorch's built-in "
        "kernel, fuseml's CUDA C++ and Triton kernels, and torch.compile. GELU comes from "
        "the elementwise suite, softmax from the softmax suite."
    ),
    "softmax": (
        "`fuseml.ops.softmax` and `log_softmax` over M = 4096 rows. Arms: `manual` is the "
        "five-step chain (max, subtract, exp, sum, divide), `torch` is `torch.softmax`, "
        "`copy` a device copy of the same bytes (for reference)."
    ),
    "linear": (
        "Arms: `eager` is `F.linear` + the activation, `cublaslt` `torch._addmm_activation` "
        "(bias and activation in cuBLASLt's epilogue), `compile` and `compile-max` "
        "(`max-autotune-no-cudagraphs`) `torch.compile` of the reference, `triton` "
        "`fuseml.ops.linear`, `triton-ptr` the same op on its pointer-load kernel (for "
        "reference). Shapes: the DLRM layers and two large ones."
    ),
    "mlp": (
        "The DLRM bottom and top MLPs through `fuseml.ops.mlp`, against eager PyTorch (also "
        "as a CUDA graph), `torch.compile` and max-autotune."
    ),
    "lora": (
        "Hidden size 4096, ranks 8 / 16 / 64: unmerged eager (peft's chain), the merged "
        "weight (`W + s B A` computed once, then cuBLAS), `torch.compile` of the unmerged "
        "chain, and the fused kernel; multi-adapter batches against a per-adapter loop."
    ),
    "tuning": (
        "Time of the first fuseml call of a new shape in a fresh process: `cold` (nothing "
        "cached), `tune` (compiled kernels on disk, tuning cache empty) and `warm` (the "
        "persisted tuning cache)."
    ),
}

# Headline rows, one per op family: the family's main case (a filter on the rows of the
# suite's first table) and the rule that picks its representative row: the largest size
# (numel) of that case at which the fused arm and at least one peer were both timed.
FAMILIES = (
    ("elementwise", "elementwise: bias + GELU", "elementwise",
     {"op": "bias_gelu", "dtype": "bfloat16"}),
    ("softmax", "softmax", "softmax", {"op": "softmax", "dtype": "bfloat16"}),
    ("linear", "linear (GEMM + GELU-tanh)", "linear",
     {"layer": "4096->4096", "dtype": "bfloat16"}),
    ("mlp", "MLP chain: DLRM kaggle bottom", "mlp", {"mlp": "kaggle-bottom"}),
    ("lora", "LoRA: one adapter, rank 16", "lora", {"kind": "single", "rank": 16}),
)  # fmt: skip

# Whole-model rows: per DLRM config, the headline batches at which fuseml.optimize and
# torch.compile were timed (eager call and CUDA-graph replay), against these peers.
DLRM_PEERS = (
    ("eager", "PyTorch"), ("compile", "torch.compile"), ("compile-max", "max-autotune"),
)  # fmt: skip
DLRM_FUSED = "fuseml"
DLRM_HEADLINE_BATCHES = (64, 4096, 65536)
DLRM_HEADLINE_PRECISION = "bf16"  # (the suite's other precisions: its page)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def _gpu_dirs(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and any(p.glob("*.json")))


# ------------------------------------------------------------------ per-suite tables
def doc_markdown(suite: str, doc: dict, png: str | None) -> str:
    """One GPU's tables of one suite (titled where the suite has several), its host
    overhead table, and its plot when ``png`` (a link) is given."""
    meta = doc["meta"]
    partial = ", cut short: not every case ran" if meta.get("complete") is False else ""
    if meta.get("cases"):
        partial += f"; only the cases matching `{meta['cases']}`"
    parts = [f"**{meta['gpu']}** ({meta['run']} run{partial})\n"]
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
    if png:
        parts.append(f"\n![{suite} on {meta['gpu']}]({png})\n")
    return "\n".join(parts)


def suite_markdown(suite: str, root: Path) -> str | None:
    """Every GPU's tables of one suite (plots linked from the repository root)."""
    files = sorted(Path(root).glob(f"*/{suite}.json"))
    if not files:
        return None
    parts = []
    for path in files:
        png = path.with_suffix(".png")
        doc = report.load_results(path)
        parts.append(doc_markdown(suite, doc, png.as_posix() if png.exists() else None))
    return "\n".join(parts)


FUSION_ARMS = (("manual", "manual PyTorch"), ("builtin", "PyTorch built-in"),
               ("cuda", "CUDA C++"), ("triton", "Triton"), ("compile", "torch.compile"))  # fmt: skip


def fusion_gpu(gpu_dir: Path, *, plot: bool = True) -> str | None:
    """GELU (elementwise suite) and softmax side by side on one GPU: the same op five
    ways (a GPU without one of the suites says so), with the softmax plot if ``plot``."""
    ew, sm = gpu_dir / "elementwise.json", gpu_dir / "softmax.json"
    present = [(path, op_key, builtin)
               for path, op_key, builtin in ((ew, "gelu", "builtin"), (sm, "softmax", "torch"))
               if path.exists()]  # fmt: skip
    if not present:
        return None
    rows = []
    sources = [f"{op_key}: no {path.stem} results on this GPU yet"
               for path, op_key in ((ew, "gelu"), (sm, "softmax")) if not path.exists()]  # fmt: skip
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
                    "" if r is None else f"{r['p50_ms'] * 1e3:,.1f} us ({r['pct_of_ceiling']:.0f}%)"
                )
            rows.append(f"| {case} | " + " | ".join(cells) + " |")
        gpu = meta["gpu"]
    head = "| case | " + " | ".join(label for _, label in FUSION_ARMS) + " |"
    parts = [f"**{gpu}**: median time (% of the copy bandwidth measured in the same run)\n",
             head, "|---" * (len(FUSION_ARMS) + 1) + "|", *rows,
             "", "Sources: " + "; ".join(sources) + "."]  # fmt: skip
    png = gpu_dir / "softmax.png"
    if plot and png.exists():
        parts.append(f"\n![softmax GB/s across N on {gpu}]({png.as_posix()})\n")
    return "\n".join(parts)


def fusion_markdown(root: Path) -> str | None:
    """The side-by-side table of every GPU with elementwise or softmax results."""
    parts = [text for d in _gpu_dirs(root) if (text := fusion_gpu(d))]
    return "\n".join(parts) if parts else None


# ------------------------------------------------------------------- per-GPU pages
def gpu_page(gpu_dir: Path) -> str | None:
    """The page of one GPU: every section it has results for, plots linked beside it."""
    sections = []
    gpu = None
    for key, title in SECTIONS:
        if key == "fusion":
            body = fusion_gpu(gpu_dir, plot=False)  # the softmax section has it
        else:
            path = gpu_dir / f"{key}.json"
            if not path.exists():
                continue
            doc = report.load_results(path)
            gpu = doc["meta"]["gpu"]
            png = path.with_suffix(".png")
            body = doc_markdown(key, doc, png.name if png.exists() else None)
        if body:
            sections.append((title, f"## {title}\n\n{INTROS[key]}\n\n{body.rstrip()}\n"))
    if not sections:
        return None
    contents = " · ".join(f"[{t}](#{_anchor(t)})" for t, _ in sections)
    head = (
        f"# fuseml results: {gpu}\n\n"
        "Generated by `fuseml bench readme` from the results files in this folder (written "
        "by `fuseml bench SUITE`); do not edit by hand. How the suites time their arms: "
        "[Benchmarking](../../../README.md#benchmarking). A result within the peer's "
        "p20-p80 spread (kept in the results files) is a tie.\n\n"
        f"{contents}\n"
    )
    return "\n".join([head, *(text for _, text in sections)])


# ------------------------------------------------------------------ headline table
def _us(ms: float) -> str:
    us = ms * 1e3
    return f"{us:,.0f} us" if us >= 100 else f"{us:,.1f} us"


def _headline_gpu(root: Path) -> Path:
    """The GPU with results for the most suites (the first by name on a tie)."""
    return min(_gpu_dirs(root), key=lambda d: (-len(list(d.glob("*.json"))), d.name))


def _peers(spec: dict) -> list[str]:
    """The arms a suite table compares the fused arm with (as report.markdown_table)."""
    not_peers = {"triton", "cuda", "copy", spec.get("fused", "triton"),
                 *spec.get("reference_arms", ())}  # fmt: skip
    return [a for a in spec["arms"] if a not in not_peers]


def ratio(fused: dict, peer: dict) -> str:
    """'1.23x': the peer's median time over the fused arm's (above 1: fused is faster);
    '(tie)' where the fused median lies within the peer's p20-p80 spread, '(noisy)' where
    either row stayed unsettled when it was timed."""
    text = f"{peer['p50_ms'] / fused['p50_ms']:.2f}x"
    if peer.get("p20_ms") is not None and peer["p20_ms"] <= fused["p50_ms"] <= peer["p80_ms"]:
        text += " (tie)"
    return text + (" (noisy)" if fused.get("noisy") or peer.get("noisy") else "")


def family_row(doc: dict, where: dict) -> dict | None:
    """The representative case of an op family in one results file: among the rows of
    the suite's first table that match ``where``, the largest size (numel) at which the
    fused arm and at least one peer were timed (on equal sizes, the last case name).
    Returns the case, the fused row, the best peer's name and row, or None."""
    specs = SUITES[doc["suite"]].README
    spec = specs if isinstance(specs, dict) else specs[0]
    fused, peers = spec.get("fused", "triton"), _peers(spec)
    cases: dict[str, dict] = {}
    for r in report.shown_rows(doc, spec):
        if r.get("p50_ms") and report._matches(r, where):
            cases.setdefault(r["case"], {})[r["arm"]] = r
    best = None
    for case, arms in cases.items():
        timed = [a for a in peers if a in arms]
        if fused not in arms or not timed:
            continue
        key = (arms[fused]["numel"], report._numeric_key(case))
        if best is None or key > best[0]:
            peer = min(timed, key=lambda a: arms[a]["p50_ms"])
            best = (key, case, arms[fused], peer, arms[peer])
    if best is None:
        return None
    _, case, row, peer, peer_row = best
    graph = " (graph)" if row.get("_graph") else ""
    return {"case": case + graph, "fused": row, "peer": peer, "peer_row": peer_row}


def dlrm_rows(doc: dict) -> list[dict]:
    """Per config (bf16, uniform ids), the batches of DLRM_HEADLINE_BATCHES at which
    fuseml and torch.compile were both timed (else the smallest and the largest such),
    with the rows of fuseml and of each peer, eager call ("events") and graph replay. A
    batch run without torch.compile (a part run with fewer arms) would read "vs best"
    against eager PyTorch alone."""
    by = {(r["case"], r["arm"], r["mode"]): r for r in doc["rows"] if r.get("p50_ms")}
    timed = [r for r in doc["rows"] if r["arm"] == DLRM_FUSED and r["mode"] == "events"
             and r.get("p50_ms") and r.get("ids", "uniform") == "uniform"
             and r.get("precision", DLRM_HEADLINE_PRECISION) == DLRM_HEADLINE_PRECISION
             and (r["case"], "compile", "events") in by]  # fmt: skip
    out = []
    for config in dict.fromkeys(r["config"] for r in timed):
        rows = sorted((r for r in timed if r["config"] == config), key=lambda r: r["batch"])
        headline = [r for r in rows if r["batch"] in DLRM_HEADLINE_BATCHES]
        for r in headline or rows[:1] + rows[1:][-1:]:
            cells = {(arm, mode): by.get((r["case"], arm, mode))
                     for mode in ("events", "graph")
                     for arm in (DLRM_FUSED, *(a for a, _ in DLRM_PEERS))}  # fmt: skip
            out.append({"config": config, "precision": r["precision"], "batch": r["batch"],
                        "cells": cells})  # fmt: skip
    return out


def _vs_best(cells: dict, mode: str) -> str:
    fused = cells[(DLRM_FUSED, mode)]
    peers = [cells[(a, mode)] for a, _ in DLRM_PEERS if cells[(a, mode)]]
    return ratio(fused, min(peers, key=lambda r: r["p50_ms"])) if fused and peers else ""


def headline_markdown(root: Path, base: Path = Path(".")) -> str | None:
    """The README's headline: DLRM rows, then one row per op family, with links to the
    per-GPU pages (relative to ``base``, the README's folder)."""
    root = Path(root)
    if not _gpu_dirs(root):
        return None
    main = _headline_gpu(root)
    page = f"{Path(os.path.relpath(root, base)).as_posix()}/{{slug}}/{PAGE}"
    titles = dict(SECTIONS)
    meta_of = {}
    parts = []

    def sources(suite: str) -> list[Path]:
        # The headline GPU's results first, then the other GPUs' that have the suite.
        dirs = [main, *(d for d in _gpu_dirs(root) if d != main)]
        return [d / f"{suite}.json" for d in dirs if (d / f"{suite}.json").exists()]

    def newest(suite: str) -> Path | None:
        # The most recent run of the suite on any GPU (the whole-model headline shows the
        # model as it is now)
        found = [d / f"{suite}.json" for d in _gpu_dirs(root) if (d / f"{suite}.json").exists()]
        return max(
            found, key=lambda p: report.load_results(p)["meta"].get("date", ""), default=None
        )

    def link(path: Path, suite: str) -> str:
        slug = path.parent.name
        label = titles[suite] + ("" if path.parent == main else f", {meta_of[slug]}")
        return f"[{label}]({page.format(slug=slug)}#{_anchor(titles[suite])})"

    dlrm = newest("dlrm")
    if dlrm:
        doc = report.load_results(dlrm)
        meta_of[dlrm.parent.name] = doc["meta"]["gpu"]
        names = [n for _, n in DLRM_PEERS]
        head = (["model", "batch"] + [f"eager: {n}" for n in names]
                + ["eager: fuseml", "vs best"] + [f"graph: {n}" for n in names]
                + ["graph: fuseml", "vs best"])  # fmt: skip
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in dlrm_rows(doc):
            c = r["cells"]
            cells = [f"DLRM {r['config']}, {r['precision']}", f"{r['batch']:,}"]
            for mode in ("events", "graph"):
                for arm in (*(a for a, _ in DLRM_PEERS), DLRM_FUSED):
                    cells.append("" if c[(arm, mode)] is None else _us(c[(arm, mode)]["p50_ms"]))
                cells.append(_vs_best(c, mode))
            lines.append("| " + " | ".join(cells) + " |")
        parts += [
            f"Whole model on the {doc['meta']['gpu']} (torch {doc['meta']['torch']}, triton "
            f"{doc['meta']['triton']}): median time per batch; `eager` is a plain call, "
            "`graph` the forward captured once in a CUDA graph and replayed; fuseml is "
            "`fuseml.optimize(model)` (its eager calls replay a CUDA graph per repeated "
            "batch shape); max-autotune is torch.compile's, timed at the largest batches; "
            "`vs best` is the fastest peer's time over fuseml's (above 1.00x: fuseml is "
            "faster; (tie): within that peer's p20-p80 spread). All rows: "
            f"{link(dlrm, 'dlrm')}.\n",
            *lines,
            "",
        ]
    lines = ["| op family | case (largest measured) | fuseml | best peer | fuseml vs best peer "
             "| all rows |", "|---|---|---|---|---|---|"]  # fmt: skip
    for suite, label, _, where in FAMILIES:
        # the first GPU whose file has the family's case (a partial run may lack it)
        for path in sources(suite):
            doc = report.load_results(path)
            row = family_row(doc, where)
            if row is not None:
                break
        else:
            continue
        meta_of[path.parent.name] = doc["meta"]["gpu"]
        fused, peer = row["fused"], row["peer_row"]
        lines.append(
            f"| {label} | {row['case']} | {_us(fused['p50_ms'])} | {row['peer']} "
            f"{_us(peer['p50_ms'])} | {ratio(fused, peer)} | {link(path, suite)} |"
        )
    host_part = []
    host = newest("overhead")
    if host:
        doc = report.load_results(host)
        meta_of[host.parent.name] = doc["meta"]["gpu"]
        cut = (
            " (a run cut short: not every case ran)" if doc["meta"].get("complete") is False else ""
        )
        host_part = [
            f"Eager calls on the {doc['meta']['gpu']}{cut}: wall time per call at host-bound "
            "sizes, against the nearest torch equivalent. All rows: "
            f"{link(host, 'overhead')}.\n",
            report.markdown_table(doc, SUITES["overhead"].README),
            "",
        ]
    main_gpu = report.load_results(next(main.glob("*.json")))["meta"]["gpu"]
    parts += [
        f"Ops on the {main_gpu}: median time per call of the largest size measured of each "
        "family's main case, against the fastest peer in the same run (eager PyTorch, "
        "torch.compile, cuBLAS / cuBLASLt or the merged LoRA weight: the suite's page names "
        "them); (graph): timed as CUDA-graph replays.\n",
        *lines,
        "",
        *host_part,
        "Every table, per GPU: "
        + ", ".join(
            f"[{report.load_results(next(d.glob('*.json')))['meta']['gpu']}]"
            f"({page.format(slug=d.name)})"
            for d in _gpu_dirs(root)
        )
        + ".",
    ]
    return "\n".join(parts)


# --------------------------------------------------------------------------- writing
def _write(path: Path, text: str) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _fill(content: str, section: str, text: str) -> str | None:
    """``content`` with the text between <!-- fuseml:SECTION --> and its end marker
    replaced, or None without the markers."""
    pattern = re.compile(
        rf"(<!-- fuseml:{re.escape(section)} -->\n).*?(<!-- /fuseml:{re.escape(section)} -->)",
        re.S,
    )
    if not pattern.search(content):
        return None
    return pattern.sub(lambda m: m.group(1) + text.rstrip() + "\n" + m.group(2), content)


def regenerate(readme: Path, root: Path, *, check: bool = False) -> list[Path]:
    """Write every GPU's page and the README's headline (and any
    ``<!-- fuseml:results:SUITE -->`` or ``fusion`` section it has) from the results
    under ``root``. With ``check``, write nothing. Returns the files whose text differs
    from what the results give (with ``check``: the stale ones)."""
    readme, root = Path(readme), Path(root)
    wanted: dict[Path, str] = {}
    for gpu_dir in _gpu_dirs(root):
        text = gpu_page(gpu_dir)
        if text:
            wanted[gpu_dir / PAGE] = text
    content = readme.read_text() if readme.exists() else ""
    sections = {"headline": headline_markdown(root, readme.parent), "fusion": fusion_markdown(root)}
    sections.update({f"results:{suite}": suite_markdown(suite, root) for suite in SUITES})
    new, missing = content, False
    for name, text in sections.items():
        filled = _fill(new, name, text) if text else None
        if filled is not None:
            new = filled
        elif name == "headline" and text:
            print(f"{readme}: no <!-- fuseml:headline --> section to fill")
            missing = True
    if readme.exists():
        wanted[readme] = new
    changed = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if check and missing and readme not in changed:
        changed.append(readme)  # stale: it cannot show the headline
    for path in changed:
        print(f"{path}: {'out of date' if check else 'written'}")
        if not check:
            _write(path, wanted[path])
    return changed
