"""Where the first call of a fresh process goes once the caches are warm (diagnosis).

    PYTHONPATH=src python scripts/probe_first_call.py [PROBLEM]

Runs the tuning suite's child process twice on fresh temporary caches: cold (fills the
fuseml tuning cache and Triton's kernel cache), then warm under cProfile, whose top
entries by cumulative time are printed with the warm first-call time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fuseml.bench.suites.tuning import PROBLEMS


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "linear 512->256, M 64, relu"
    spec = PROBLEMS[name]
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = "import sys; from fuseml.bench.suites.tuning import child; child(sys.argv[1])"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, FUSEML_CACHE=f"{tmp}/f", TRITON_CACHE_DIR=f"{tmp}/t",
                   FUSEML_AUTOTUNE="1", PYTHONPATH=src)  # fmt: skip
        for label, extra in (("cold", {}), ("warm", {"FUSEML_TUNING_PROFILE": "35"})):
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(spec)],
                env={**env, **extra}, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            print(f"== {label}: {name}")
            print(proc.stdout.strip())
            if label == "warm" or proc.returncode:
                print(proc.stderr[-12000:])


if __name__ == "__main__":
    main()
