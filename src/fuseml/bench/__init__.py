"""Benchmark harness: ``fuseml bench SUITE [--quick] [--arms ...] [--cases REGEX] [--sweep]``.

See harness.py for how timing works, noise.py for when an arm is timed again, commit.py
for the commit each row is stamped with, roofline.py for the ceilings and report.py for
the files, plots and README tables.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("fuseml")


def run_suite(
    name: str,
    *,
    quick: bool = False,
    arms: list[str] | None = None,
    cases: str | None = None,
    merge: bool = False,
    out_root: Path | None = None,
    console=None,
    turns: bool = False,
    sweep: bool = False,
) -> tuple[Path, Path | None]:
    """Run suite ``name`` on CUDA device 0; write results JSON + PNG; print the table.

    cases: a regular expression; only cases whose name it matches (re.search) run.
    merge: add to / replace rows in the existing results file instead of starting anew.
    The file is rewritten after every case (meta "complete": false until the last), so a
    run cut short keeps what it measured; rerun the rest with --cases ... --merge.
    turns: every case's arms timed in turns, graph rows too (see harness.Settings).
    sweep: only the cases with a sweep (harness.Case.sweep), each with one more arm per
    candidate launch config of fuseml's kernel, every output checked; written to
    ``<suite>-sweep.json`` beside the suite's results, never into them.
    Returns (results path, plot path or None: a suite without a plot, or a run none of
    whose rows the plot shows).
    """
    import re

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from fuseml import runtime
    from fuseml.bench import report
    from fuseml.bench.harness import Settings, run_cases, run_metadata
    from fuseml.bench.noise import committed_history
    from fuseml.bench.roofline import measure_ceilings
    from fuseml.bench.suites import SUITES
    from fuseml.data.errors import Flag, OptionError

    if name not in SUITES:
        raise ValueError(f"suite must be one of {sorted(SUITES)}, got {name!r}")
    console = console or Console()
    suite = SUITES[name]
    settings = Settings.for_mode(quick, turns=turns)
    pattern = None
    if cases:
        try:
            pattern = re.compile(cases)
        except re.error as err:
            raise OptionError(
                "{} is not a regular expression ({}): {!r}", Flag("cases"), err, cases
            ) from err
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"fuseml bench {name}: timings need a CUDA GPU; none is visible here "
            "(the tests check correctness on CPU)"
        )
    cuda_ok, why = runtime.cuda_backend_status("cuda")
    if not cuda_ok:
        console.print(f"[yellow]cuda arm skipped: {why}[/yellow]")
    case_list = list(suite.cases(quick=quick, cuda=cuda_ok))
    if pattern is not None:
        case_list = [c for c in case_list if pattern.search(c.name)]
        if not case_list:
            raise OptionError("{} {!r} matches no case of suite {}", Flag("cases"), cases, name)
    if arms:
        check_arms(arms, case_list, name)
    if sweep:
        case_list = with_sweeps(case_list, name)
        arms = arms and sweep_arms(arms, case_list)
    console.print(f"measuring ceilings on {torch.cuda.get_device_name()} ...")
    ceilings = measure_ceilings(quick=quick)
    # Rows time a process past its start: the eager fast path (built in the background on
    # a process's first launches) loaded
    from fuseml.ops import _fastcall

    if not _fastcall.wait(timeout=900):
        console.print(f"eager fast path off: {_fastcall.status()[1]}")
    console.print(
        f"copy {ceilings['copy_gbps']:,.0f} GB/s, bf16 matmul "
        f"{ceilings['matmul_bf16_tflops']:,.0f} TFLOP/s"
    )
    root = Path(out_root) if out_root else report.RESULTS_DIR
    # the committed timings of this suite on this GPU, read before this run writes any
    history = committed_history(report.results_path(name, runtime.device_info()["slug"]))
    meta = run_metadata() | {"run": "quick" if quick else "full", "complete": False}
    if cases:
        meta["cases"] = cases  # a subset of the suite (merged into a whole file, dropped)
    if sweep:
        meta["sweep"] = True
        name, history = f"{name}-sweep", {}
    rows: list[dict] = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console
    ) as bar:
        task = bar.add_task(f"{name}", total=len(case_list))

        def progress(case):
            bar.update(task, description=f"{name}: {case.name}")

        for case in case_list:
            torch._dynamo.reset()  # see suites: one static compilation per case
            rows.extend(run_cases([case], ceilings=ceilings, settings=settings, arms=arms,
                                  progress=progress, history=history))  # fmt: skip
            bar.advance(task)
            report.write_results(name, rows, ceilings, meta, root, merge=merge)
    meta["complete"] = True
    path = report.write_results(name, rows, ceilings, meta, root, merge=merge)
    png = None  # a suite without PLOT (e.g. tuning latency) is a table only
    if suite.PLOT is not None and not sweep:
        png = report.plot_suite(report.load_results(path), suite.PLOT, path.with_suffix(".png"))
        if png is None:
            stale = path.with_suffix(".png")
            if stale.exists():  # (it would show rows the results file no longer holds)
                stale.unlink()
            console.print(f"no plot: none of the rows in {path} is one the {name} plot shows")
    report.print_table(rows, f"{name} on {meta['gpu']}", console)
    for r in rows:
        if r.get("noisy"):
            console.print(
                f"[yellow]NOISY[/yellow] {r['case']} arm {r['arm']} ({r['mode']}), timed "
                f"{1 + r.get('reruns', 0)} times: {r['noisy']}"
            )
    bad = [r for r in rows if r.get("matches_ref") is False]
    for r in bad:
        console.print(
            f"[red]MISMATCH[/red] {r['case']} arm {r['arm']}: rel err {r['rel_err_vs_ref']:.2e}"
        )
    for r in rows:
        if r.get("error"):
            console.print(f"[red]FAILED[/red] {r['case']} arm {r['arm']}: {r['error']}")
    written = f"{path} and {png}" if png else str(path)
    console.print(f"wrote {written} ({len(rows)} rows, {len(bad)} mismatches)")
    return path, png


def with_sweeps(case_list: list, suite: str) -> list:
    """The cases that have a sweep, its arms added to theirs (ValueError if none has)."""
    swept = [c for c in case_list if c.sweep is not None]
    if not swept:
        raise ValueError(
            f"--sweep: no selected case of suite {suite} has a sweep of launch configs"
        )
    for case in swept:
        case.arms = {**case.arms, **case.sweep()}
    return swept


def check_arms(arms: list[str], case_list: list, suite: str) -> None:
    """OptionError naming ``arms`` when one of them is no arm of any selected case. Suites
    that measure a case whole (``Case.measure``) name their arms as they run: not checked."""
    from fuseml.data.errors import Flag, OptionError

    if any(c.measure is not None for c in case_list):
        return
    known = {a for c in case_list for a in (*c.arms, *c.overhead_arms)}
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise OptionError(
            "{} {} {} not an arm of the selected cases of suite {}; they have {}",
            Flag("arms"), ", ".join(map(repr, unknown)), "is" if len(unknown) == 1 else "are",
            suite, sorted(known),
        )  # fmt: skip


def sweep_arms(arms: list[str], case_list: list) -> list[str]:
    """``arms`` and the sweep arms of the named arms ("triton" brings "triton@...")."""
    named = set(arms)
    extra = {a for c in case_list for a in c.arms if "@" in a and a.split("@", 1)[0] in named}
    return [*arms, *sorted(extra)]
