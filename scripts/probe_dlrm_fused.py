"""Diagnosis: the fuseml arm of the dlrm suite, call by call, as the harness makes it.

    PYTHONPATH=src python scripts/probe_dlrm_fused.py [REGEX]

For each matching case (default: kaggle and mlperf bf16 at B = 32768 and 65536): the
eager output is kept (and a copy of it), the fuseml arm's first call tunes; then whether
the kept eager output changed (memory written by someone else), whether the fuseml output
matches a fresh eager output, and the same for a second fuseml call.
"""

from __future__ import annotations

import re
import sys

import torch

from fuseml.bench.suites import dlrm
from fuseml.testing import rel_err


def main() -> None:
    pattern = re.compile(sys.argv[1] if len(sys.argv) > 1 else r"bf16/bs(32768|65536)$")
    for case in dlrm.cases(quick=False):
        if not pattern.search(case.name) or "fuseml" not in case.arms:
            continue
        eager, fused = case.arms["eager"], case.arms["fuseml"]
        ref = eager()
        kept = ref.clone()
        out1 = fused()
        torch.cuda.synchronize()
        changed = rel_err(ref, kept)
        fresh = eager()
        out2 = fused()
        print(
            f"{case.name}: kept eager output changed by {changed:.2e}; fused first call vs "
            f"fresh eager {rel_err(out1, fresh):.2e}, second call {rel_err(out2, fresh):.2e}, "
            f"eager vs eager {rel_err(fresh, kept):.2e}; NaN in fused: "
            f"{bool(out1.isnan().any())}",
            flush=True,
        )
        bad = (out1.float() - fresh.float()).abs() > 0.05
        if bad.any():
            idx = bad.nonzero().flatten()
            print(f"  {idx.numel()} rows off; first {idx[:8].tolist()} last {idx[-4:].tolist()}")


if __name__ == "__main__":
    main()
