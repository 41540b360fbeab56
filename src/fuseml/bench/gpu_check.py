"""The summary of one ``scripts/gpu-check.sh`` run, machine-written:

    python -m fuseml.bench.gpu_check OUTDIR [OUTDIR ...] [--commit SHA] [--write FILE]
    python -m fuseml.bench.gpu_check --relabel FILE

Reads what the script left in OUTDIR (``tests.xml``: pytest's JUnit report of the GPU
tests, or where pytest was cut short its verbose log ``tests.txt``; ``demo.rc``: ``fuseml
demo``'s exit code; ``results/``: the quick suites' files),
writes ``OUTDIR/gpu-check.txt`` (atomically) and prints it. Committed per GPU as
``benchmarks/gpu-checks/<gpu>.txt``: a record of which commit passed where. A GPU
machine's copy of the history may predate the tree it ran (its commit line then reads
``<commit>+dirty`` with the ``src/`` tree id below it): ``--relabel FILE``, run where the
history is whole, names the local commit with that src/ tree, as the results tables do.
The parts of a split check, fetched and summed on another machine, keep the device, torch,
triton and commit their own summaries name.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

from fuseml.bench.commit import DIRTY, commit_label, git_commit, source_tree


def test_counts(xml_path: Path) -> dict[str, float] | None:
    """{tests, passed, failed, errors, skipped, time} from a JUnit report, or None."""
    if not xml_path.is_file():
        return None
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: 0.0 for k in ("tests", "failures", "errors", "skipped", "time")}
    for s in suites:
        for k in counts:
            counts[k] += float(s.get(k, 0))
    tests, failed, errors, skipped = (
        int(counts[k]) for k in ("tests", "failures", "errors", "skipped")
    )
    return {
        "tests": tests,
        "passed": tests - failed - errors - skipped,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
        "time": counts["time"],
    }


_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_NODE = re.compile(r"(\S+\.py::\S+)")
_PERCENT = re.compile(r"\[\s*(\d+)%\]")


def logged_counts(log_path: Path) -> dict | None:
    """{passed, failed, errors, skipped, percent, failed_ids} from pytest's verbose log
    (``-v``, with or without xdist) of a run that wrote no report, e.g. one stopped at a
    time limit: each test's last outcome line, and the last progress percentage. None
    without a log."""
    if not log_path.is_file():
        return None
    last: dict[str, str] = {}
    percent = 0
    for line in log_path.read_text(errors="replace").splitlines():
        outcome, node = _OUTCOME.search(line), _NODE.search(line)
        if outcome and node:
            last[node.group(1)] = outcome.group(1)
            found = _PERCENT.search(line)
            percent = int(found.group(1)) if found else percent
    outcomes = list(last.values())
    return {
        "passed": outcomes.count("PASSED") + outcomes.count("XFAIL"),
        "failed": outcomes.count("FAILED") + outcomes.count("XPASS"),
        "errors": outcomes.count("ERROR"),
        "skipped": outcomes.count("SKIPPED"),
        "percent": percent,
        "failed_ids": [n for n, o in last.items() if o in ("FAILED", "ERROR", "XPASS")],
    }


def failed_tests(xml_path: Path, limit: int = 20) -> list[str]:
    """Node ids of the failed or erroring tests in a JUnit report (at most ``limit``)."""
    if not xml_path.is_file():
        return []
    out = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return out[:limit]


def _commit(given: str | None) -> str:
    """The commit tested: given on the command line, else asked of git (full sha)."""
    return given or git_commit(short=False)


def _device() -> tuple[str, str, str]:
    import torch
    import triton

    name = "no CUDA device"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        name = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
    return name, torch.__version__, triton.__version__


_HEADER = ("device", "torch", "triton", "commit", "src/")  # src/: only where dirty
_FIELD = re.compile(rf"^({'|'.join(map(re.escape, (*_HEADER, 'date')))}):\s+(.*?)\s*$", re.M)


def recorded_header(parts: list[Path]) -> dict[str, str] | None:
    """The machine and code the parts ran on, as the GPU machine wrote them in each part's
    own ``gpu-check.txt`` (device, torch, triton, commit, src/ tree; date: the latest),
    or None where no part has one. A split check summed on another machine (its logs
    fetched) takes these, not that machine's. Parts that ran on different machines or
    trees raise ValueError naming them."""
    seen: dict[Path, dict[str, str]] = {}
    for part in parts:
        summary = part / "gpu-check.txt"
        if not summary.is_file():
            continue
        fields = dict(_FIELD.findall(summary.read_text()))
        if set(_HEADER) - {"src/"} <= fields.keys():
            seen[part] = fields
    if not seen:
        return None
    first, *rest = seen.items()
    for part, fields in rest:
        differ = [k for k in _HEADER if fields.get(k) != first[1].get(k)]
        if differ:
            raise ValueError(
                f"out_dirs: {first[0]} and {part} ran on different machines or code "
                f"({', '.join(differ)} differ): summarize each apart"
            )
    header = dict(first[1])
    dates = [f["date"] for f in seen.values() if "date" in f]
    if dates:
        header["date"] = max(dates)
    return header


def report(out_dirs: Path | list[Path], commit: str | None = None, device=None) -> str:
    """The summary text of the run in ``out_dirs`` (one folder, or one per part of a split
    check: see scripts/gpu-check.sh); its last line: PASS or FAIL. device (name, torch,
    triton) and commit: given, else as the parts recorded them (``recorded_header``), else
    this machine's."""
    parts = [out_dirs] if isinstance(out_dirs, Path) else list(out_dirs)
    header = recorded_header(parts) or {}
    name, torch_v, triton_v = device or (
        (header["device"], header["torch"], header["triton"]) if header else _device()
    )
    tested = commit or header.get("commit") or _commit(None)
    lines = [
        "fuseml gpu-check",
        f"device:  {name}",
        f"torch:   {torch_v}",
        f"triton:  {triton_v}",
        f"commit:  {tested}",
    ]
    if commit is None and tested.endswith(DIRTY):  # the code tested (see commit.py)
        lines.append(f"src/:    {header.get('src/') or f'tree {source_tree()}'}")
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines.append(f"date:    {header.get('date', now)}")
    ok, ran, demo, suites = True, False, [], []
    for part in parts:
        counts = test_counts(part / "tests.xml")
        listed = part / "tests.paths"
        paths = listed.read_text().strip() if listed.is_file() else "tests"
        if counts is None:
            # (a paths file without a report: pytest did not finish, e.g. cut by a time limit)
            if listed.is_file():
                logged = logged_counts(part / "tests.txt")
                so_far = ""
                if logged is not None:
                    so_far = (
                        f"; cut at {logged['percent']}%: {logged['passed']} passed, "
                        f"{logged['failed']} failed, {logged['errors']} errors, "
                        f"{logged['skipped']} skipped so far"
                    )
                lines.append(f"tests:   pytest -m gpu {paths}: NO REPORT (did not finish{so_far})")
                lines += [f"  failed: {t}" for t in (logged or {}).get("failed_ids", [])[:20]]
                ok = False
            continue
        ran = True
        lines.append(
            f"tests:   {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} "
            f"errors, {counts['skipped']} skipped of {counts['tests']} (pytest -m gpu "
            f"{paths}; {counts['time']:.0f} s of test time)"
        )
        ok = ok and counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
        lines += [f"  failed: {t}" for t in failed_tests(part / "tests.xml")]
    if not any(line.startswith("tests:") for line in lines):
        lines.append("tests:   not run")
    for part in parts:
        rc_file = part / "demo.rc"
        if rc_file.is_file():
            demo.append(int(rc_file.read_text().strip() or 1))
        suites += sorted(p.stem for p in (part / "results").glob("*/*.json"))
    if demo:
        rc = max(demo, key=abs)
        lines.append(f"demo:    {'passed' if rc == 0 else 'FAILED'} (fuseml demo, exit {rc})")
        ok = ok and rc == 0
    else:
        lines.append("demo:    not run")
    lines.append(f"suites:  {', '.join(suites) + ' (quick)' if suites else 'none run'}")
    ok = ok and (ran or bool(demo) or bool(suites))  # nothing ran: FAIL
    lines.append(f"result:  {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines) + "\n"


def relabel(text: str, where: Path | str | None = None) -> str:
    """``text`` (a summary) with its ``commit:`` line naming the local commit whose src/
    tree the ``src/:`` line gives (``commit_label``); unchanged where there is none."""
    commit = re.search(r"^commit:\s+(\S+)", text, re.M)
    tree = re.search(r"^src/:\s+tree\s+([0-9a-f]+)", text, re.M)
    if not commit or not tree:
        return text
    label = commit_label(commit.group(1), tree.group(1), where)
    if label.startswith(commit.group(1)):  # (a clean commit, or no local match)
        return text
    return text[: commit.start(1)] + label + text[commit.end(1) :]


def _write(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuseml.bench.gpu_check")
    parser.add_argument(
        "out_dirs", type=Path, nargs="*",
        help="the folder scripts/gpu-check.sh wrote (several: the parts of a split check)",
    )  # fmt: skip
    parser.add_argument("--commit", help="the commit tested (default: asked of git)")
    parser.add_argument("--write", type=Path, help="summary file (default: OUT_DIR/gpu-check.txt)")
    parser.add_argument(
        "--relabel", type=Path, metavar="FILE",
        help="rewrite a summary's commit line from its src/ tree (see the module's doc)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.relabel is not None:
        if args.out_dirs:
            parser.error("--relabel: takes a summary file alone, no OUTDIR")
        if not args.relabel.is_file():
            parser.error(f"--relabel: {args.relabel} is not a file")
        text = relabel(args.relabel.read_text(), args.relabel.parent)
        _write(args.relabel, text)
        print(text, end="")
        return 0
    if not args.out_dirs:
        parser.error("out_dirs: give the folder scripts/gpu-check.sh wrote")
    for d in args.out_dirs:
        if not d.is_dir():
            parser.error(f"out_dirs: {d} is not a folder")
    try:
        text = report(args.out_dirs, args.commit)
    except ValueError as e:
        parser.error(str(e))
    _write(args.write or args.out_dirs[0] / "gpu-check.txt", text)
    print(text, end="")
    return 0 if text.rstrip().endswith("PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
