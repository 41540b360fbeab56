"""The summary of one ``scripts/gpu-check.sh`` run, machine-written:

    python -m fuseml.bench.gpu_check OUTDIR [--commit SHA]

Reads what the script left in OUTDIR (``tests.xml``: pytest's JUnit report of the GPU
tests; ``demo.rc``: ``fuseml demo``'s exit code; ``results/``: the quick suites' files),
writes ``OUTDIR/gpu-check.txt`` (atomically) and prints it. Committed per GPU as
``benchmarks/gpu-checks/<gpu>.txt``: a record of which commit passed where.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path


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
    if given:
        return given
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "tests"],
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        return sha + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: pass --commit)"


def _device() -> tuple[str, str, str]:
    import torch
    import triton

    name = "no CUDA device"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        name = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
    return name, torch.__version__, triton.__version__


def report(out_dir: Path, commit: str | None = None, device: tuple | None = None) -> str:
    """The summary text of the run in ``out_dir`` (its last line: PASS or FAIL)."""
    name, torch_v, triton_v = device or _device()
    lines = [
        "fuseml gpu-check",
        f"device:  {name}",
        f"torch:   {torch_v}",
        f"triton:  {triton_v}",
        f"commit:  {_commit(commit)}",
        f"date:    {datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
    ]
    ok = True
    counts = test_counts(out_dir / "tests.xml")
    paths = (
        (out_dir / "tests.paths").read_text().strip() if (out_dir / "tests.paths").is_file() else ""
    )
    if counts is None:
        lines.append("tests:   not run")
    else:
        lines.append(
            f"tests:   {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} "
            f"errors, {counts['skipped']} skipped of {counts['tests']} (pytest -m gpu "
            f"{paths or 'tests'}; {counts['time']:.0f} s of test time)"
        )
        ok = ok and counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
        lines += [f"  failed: {t}" for t in failed_tests(out_dir / "tests.xml")]
    rc_file = out_dir / "demo.rc"
    if rc_file.is_file():
        rc = int(rc_file.read_text().strip() or 1)
        lines.append(f"demo:    {'passed' if rc == 0 else 'FAILED'} (fuseml demo, exit {rc})")
        ok = ok and rc == 0
    else:
        lines.append("demo:    not run")
    suites = sorted(p.stem for p in (out_dir / "results").glob("*/*.json"))
    lines.append(f"suites:  {', '.join(suites) + ' (quick)' if suites else 'none run'}")
    ok = ok and (counts is not None or rc_file.is_file() or bool(suites))  # nothing ran: FAIL
    lines.append(f"result:  {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuseml.bench.gpu_check")
    parser.add_argument("out_dir", type=Path, help="the folder scripts/gpu-check.sh wrote")
    parser.add_argument("--commit", help="the commit tested (default: git rev-parse HEAD)")
    args = parser.parse_args(argv)
    if not args.out_dir.is_dir():
        parser.error(f"out_dir: {args.out_dir} is not a folder")
    text = report(args.out_dir, args.commit or os.environ.get("FUSEML_COMMIT"))
    target = args.out_dir / "gpu-check.txt"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    print(text, end="")
    return 0 if text.rstrip().endswith("PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
