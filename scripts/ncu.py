"""Usage: ncu [NCU OPTIONS] python scripts/ncu.py op OP SHAPE [SHAPE ...] [--dtype bf16]
           [--kw NAME=VALUE ...] [--backends triton,cuda] [--calls 3]
       ncu [NCU OPTIONS] python scripts/ncu.py case SUITE REGEX [--arms triton,cuda]
           [--calls 3] [--quick]

A driver for Nsight Compute: a few calls of one public op (``fuseml.ops.OP`` on random
tensors of the given shapes, e.g. 4096x65536, with each backend in turn) or of the arms of
the bench cases whose names match REGEX (as ``fuseml bench SUITE --cases REGEX``), nothing
else on the GPU. Each op-and-backend or case-and-arm first runs once outside any range
(compilation, tuning and extension builds launch kernels of their own), then ``--calls``
times inside an NVTX range named ``<op or case>/<backend or arm>``, so that

    ncu --nvtx --nvtx-include "softmax/cuda/" --section SpeedOfLight \\
        python scripts/ncu.py op softmax 4096x65536 --backends triton,cuda

profiles the CUDA twin's calls only, and ``--nvtx-include "regex:.*/triton/"`` every
Triton arm. Without ncu it runs as it is (a smoke test of the arguments).
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

import fuseml

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # fmt: skip


def value(text: str):
    """A keyword argument's value from the command line: bool, None, int, float, string."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def profiled(label: str, fn, calls: int) -> None:
    """One call of ``fn`` outside any range, then ``calls`` inside the NVTX range ``label``."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(label)
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"{label} done ({calls} calls)", flush=True)


def run_op(a) -> None:
    op = getattr(fuseml.ops, a.name, None)
    if not callable(op):
        raise SystemExit(f"fuseml.ops has no op {a.name!r}")
    dtype = DTYPES[a.dtype]
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.args]
    tensors = [torch.randn(shape, device="cuda", dtype=dtype) for shape in shapes]
    kw = {k: value(v) for k, v in (item.split("=", 1) for item in a.kw)}
    for backend in a.backends.split(","):
        profiled(f"{a.name}/{backend}/", lambda be=backend: op(*tensors, backend=be, **kw), a.calls)


def run_case(a) -> None:
    from fuseml import runtime
    from fuseml.bench.suites import SUITES

    if a.name not in SUITES or len(a.args) != 1:
        raise SystemExit(f"case SUITE REGEX: SUITE one of {sorted(SUITES)}, one REGEX")
    pattern = re.compile(a.args[0])
    cuda_ok = runtime.cuda_backend_status("cuda")[0]
    matched = [c for c in SUITES[a.name].cases(quick=a.quick, cuda=cuda_ok)
               if pattern.search(c.name)]  # fmt: skip
    if not matched:
        raise SystemExit(f"no case of suite {a.name} matches {a.args[0]!r}")
    wanted = a.arms.split(",") if a.arms else None
    for case in matched:
        torch._dynamo.reset()  # one static compilation per case, as the bench runs them
        inputs = case.make_inputs()
        for arm, fn in case.arms.items():
            if wanted is None or arm in wanted:
                profiled(f"{case.name}/{arm}/", lambda fn=fn, i=inputs: fn(*i), a.calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("op", "case"))
    ap.add_argument("name", help="op: a fuseml.ops name; case: a bench suite")
    ap.add_argument("args", nargs="+", help="op: input shapes (AxB); case: a case regex")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--kw", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--backends", default="triton", help="op: backends, comma-separated")
    ap.add_argument("--arms", help="case: arms, comma-separated (default: all)")
    ap.add_argument("--quick", action="store_true", help="case: the quick suite's cases")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu.py profiles GPU kernels: no CUDA device is visible here")
    (run_op if a.what == "op" else run_case)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
