"""GPU probe: what programmatic dependent launch (PDL, Hopper+) buys launch-bound kernels.

A kernel launched with PDL may start while the kernel before it on the stream finishes;
its programs wait (``griddepcontrol.wait``) before touching memory, so results cannot
change. What can move is the gap between two kernels: the launch, the programs' start
and their index arithmetic overlap the previous kernel's tail. Lean kernels with and
without it, timed as the suites time them (CUDA-graph replay, inputs rotating past twice
the L2, arms interleaved over rounds):

    PYTHONPATH=src python scripts/probe_pdl.py [add] [softmax] [neighbours] [fuseml]

  add         x + y at 1M elements (fp32, bf16) and 16M fp32: torch.compile, the lean
              kernel, the same launched with PDL (trigger right after the wait, or after
              the loads are issued), fuseml's op
  softmax     4096 x 1024 bf16 rows, one row a program: torch, torch.compile, fuseml,
              a lean row kernel with and without PDL
  neighbours  each call after (or before) a torch kernel (torch.neg): what is left of
              the gain when the kernel next to it does not take part
  fuseml      fuseml's launch-bound suite cases with FUSEML_PDL=0 / 1, alone and each
              call after a torch kernel, beside torch's fastest arm
  rows        fuseml's on-chip softmax kernel at 4096 x 1024 bf16 in several launch
              shapes (rows a program, warps, a persistent grid), PDL off / on, alone and
              after torch.neg: which shapes lose with PDL after a kernel that does not
              take part
  lora        lora_linear 4096 -> 4096 bf16 at rank 64, 64 / 256 / 512 rows, PDL off / on
              (each tunes its own LoRA mode), against the merged weight's F.linear
  shapes      fuseml.ops.softmax / log_softmax itself (the suite's path) at 4096 x
              PROBE_WIDTHS (default 512) float32, PROBE_SHAPES launch shapes forced on
              the on-chip kernel (rows/warps/stages[/pdl], default: the one-warp rows and
              the two-row programs, PDL off / on), torch, torch.compile and the CUDA twin
              beside them, alone and after torch.neg; PROBE_FULL=1 times with the full
              suite's settings
  widths      the same kernel at the widths that take one program a row (PROBE_WIDTHS,
              bf16 and fp32): the library's shape PDL off / on against two-row programs
              (twice the warps, or the same) with PDL, alone and after torch.neg
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from probe_launch_bound import rotated, table

import fuseml

NUMEL = int(os.environ.get("PROBE_NUMEL", "1000000"))


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        if not LATE:
            tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask).to(tl.float32)
    if PDL and LATE:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask)


@triton.jit
def _row_softmax(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    tl.store(out_ptr + row * n_cols + cols, (e / tl.sum(e, 0)).to(out_ptr.dtype.element_ty), mask)


def add_arms(dtype: torch.dtype, numel: int) -> tuple[dict, list]:
    es = torch.empty((), dtype=dtype).element_size()
    block = 2048 // es
    grid = (triton.cdiv(numel, block),)
    sets = rotated(
        lambda: tuple(torch.randn(numel, device="cuda", dtype=dtype) for _ in range(2)),
        3 * numel * es,
    )

    def lean(pdl: bool, late: bool = False):
        opts = {"launch_pdl": True} if pdl else {}

        def run(a, b):
            out = torch.empty_like(a)
            _add[grid](a, b, out, numel, BLOCK=block, PDL=pdl, LATE=late, num_warps=4, **opts)
            return out

        return run

    arms = {
        "compile": torch.compile(lambda a, b: a + b, dynamic=False),
        "fuseml triton": lambda a, b: fuseml.ops.add(a, b, backend="triton"),
        "lean": lean(False),
        "lean, PDL": lean(True),
        "lean, PDL, trigger after loads": lean(True, True),
    }
    return arms, sets


def add() -> None:
    for dtype, numel in ((torch.float32, NUMEL), (torch.bfloat16, NUMEL), (torch.float32, 1 << 24)):
        arms, sets = add_arms(dtype, numel)
        table(f"add {str(dtype)[6:]} {numel}", arms, sets)


def softmax() -> None:
    m, n = 4096, 1024
    sets = rotated(
        lambda: (3 * torch.randn(m, n, device="cuda", dtype=torch.bfloat16),), 2 * m * n * 2
    )

    def lean(pdl: bool):
        opts = {"launch_pdl": True} if pdl else {}

        def run(x):
            out = torch.empty_like(x)
            _row_softmax[(m,)](x, out, n, BLOCK=n, PDL=pdl, num_warps=4, **opts)
            return out

        return run

    arms = {
        "torch": lambda x: torch.softmax(x, -1),
        "compile": torch.compile(lambda x: torch.softmax(x, -1), dynamic=False),
        "fuseml triton": lambda x: fuseml.ops.softmax(x, -1, backend="triton"),
        "lean row a program": lean(False),
        "lean row a program, PDL": lean(True),
    }
    table(f"softmax bf16 {m} x {n}", arms, sets)


def neighbours() -> None:
    arms, sets = add_arms(torch.float32, NUMEL)
    paired = {}
    for name in ("compile", "lean", "lean, PDL"):
        fn = arms[name]
        paired[f"neg, then {name}"] = lambda a, b, fn=fn: (torch.neg(a), fn(a, b))[1]
        paired[f"{name}, then neg"] = lambda a, b, fn=fn: (fn(a, b), torch.neg(b))[0]
    table(f"add fp32 {NUMEL} beside torch.neg (us a pair)", paired, sets)


def _with_pdl(flag: str, fn):
    """fn with FUSEML_PDL=flag while it runs (a graph captures the launches it makes)."""

    def run(*args):
        saved = os.environ.get("FUSEML_PDL")
        os.environ["FUSEML_PDL"] = flag
        try:
            return fn(*args)
        finally:
            if saved is None:
                os.environ.pop("FUSEML_PDL", None)
            else:
                os.environ["FUSEML_PDL"] = saved

    return run


def fuseml_cases() -> None:
    ops = fuseml.ops
    f32, bf16 = torch.float32, torch.bfloat16

    def tensors(*shapes, dtype):
        return lambda: tuple(torch.randn(*s, device="cuda", dtype=dtype) for s in shapes)

    cases = [  # title, inputs, bytes a call, {arm: fn}
        (
            "add fp32 1M",
            tensors((NUMEL,), (NUMEL,), dtype=f32),
            12 * NUMEL,
            {
                "compile": torch.compile(lambda a, b: a + b, dynamic=False),
                "triton": lambda a, b: ops.add(a, b, backend="triton"),
                "cuda": lambda a, b: ops.add(a, b, backend="cuda"),
            },
        ),
        (
            "bias + residual + relu fp32 2048 x 512",
            tensors((2048, 512), (2048, 512), (512,), dtype=f32),
            12 << 20,
            {
                "compile": torch.compile(lambda x, r, b: torch.relu(x + b + r), dynamic=False),
                "triton": lambda x, r, b: ops.bias_act(x, b, r, backend="triton"),
                "cuda": lambda x, r, b: ops.bias_act(x, b, r, backend="cuda"),
            },
        ),
        (
            "softmax bf16 4096 x 1024",
            tensors((4096, 1024), dtype=bf16),
            16 << 20,
            {
                "compile": torch.compile(lambda x: torch.softmax(x, -1), dynamic=False),
                "triton": lambda x: ops.softmax(x, -1, backend="triton"),
                "cuda": lambda x: ops.softmax(x, -1, backend="cuda"),
            },
        ),
        (
            "linear 256 -> 64 + relu bf16, 16 rows",
            tensors((16, 256), (64, 256), (64,), dtype=bf16),
            40 << 10,
            {
                "cuBLASLt": lambda x, w, b: torch._addmm_activation(b, x, w.t()),
                "triton": lambda x, w, b: ops.linear(x, w, b, "relu", backend="triton"),
            },
        ),
        (
            "linear 256 -> 64 + relu bf16, 512 rows",
            tensors((512, 256), (64, 256), (64,), dtype=bf16),
            360 << 10,
            {
                "cuBLASLt": lambda x, w, b: torch._addmm_activation(b, x, w.t()),
                "triton": lambda x, w, b: ops.linear(x, w, b, "relu", backend="triton"),
            },
        ),
    ]
    for title, make, nbytes, peers in cases:
        sets = rotated(make, nbytes)
        arms = {}
        for name, fn in peers.items():
            if name in ("triton", "cuda"):
                arms[f"{name}, PDL off"] = _with_pdl("0", fn)
                arms[f"{name}, PDL on"] = _with_pdl("1", fn)
            else:
                arms[name] = fn
        table(title, arms, sets)
        paired = {
            f"neg, then {name}": lambda *a, fn=fn: (torch.neg(a[0]), fn(*a))[1]
            for name, fn in arms.items()
        }
        table(f"{title}, each call after torch.neg (us a pair)", paired, sets)


def rows_shapes() -> None:
    import importlib

    from fuseml.ops._utils import fast_math

    sm = importlib.import_module("fuseml.ops.softmax")
    m, n = 4096, 1024
    sets = rotated(
        lambda: (3 * torch.randn(m, n, device="cuda", dtype=torch.bfloat16),), 2 * m * n * 2
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launch(rows, warps, programs, pdl):
        opts = {"launch_pdl": True} if pdl else {}

        def run(x):
            out = torch.empty_like(x)
            sm._softmax_rows_kernel[(programs,)](
                x, out, m, n, x.stride(0), out.stride(0),
                LOG=False, ROWS=rows, BLOCK_N=n, NUM_STAGES=2 if programs < m // rows else 1,
                FAST=fast_math(x), VEC=8, PDL=pdl, num_warps=warps, **opts,
            )  # fmt: skip
            return out

        return run

    shapes = [
        (1, 2, m),
        (1, 4, m),
        (2, 4, m // 2),
        (4, 4, m // 4),
        (1, 2, 8 * sms),
        (1, 4, 4 * sms),
    ]
    arms = {}
    for rows, warps, programs in shapes:
        for pdl in (False, True):
            name = f"{rows} row(s) / {warps} w / {programs} programs, PDL {'on' if pdl else 'off'}"
            arms[name] = launch(rows, warps, programs, pdl)
    table(f"softmax rows kernel bf16 {m} x {n}", arms, sets)
    paired = {
        f"neg, then {name}": lambda x, fn=fn: (torch.neg(x), fn(x))[1] for name, fn in arms.items()
    }
    table(f"softmax rows kernel bf16 {m} x {n}, after torch.neg (us a pair)", paired, sets)


def rows_widths() -> None:
    import importlib

    from fuseml.ops._utils import fast_math

    sm = importlib.import_module("fuseml.ops.softmax")
    m = 4096
    widths = [int(v) for v in os.environ.get("PROBE_WIDTHS", "1024,2048,4096,8192").split(",")]
    for dtype in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dtype).element_size()
        for n in widths:
            sets = rotated(lambda n=n, dtype=dtype: (3 * torch.randn(m, n, device="cuda", dtype=dtype),),
                           2 * m * n * es)  # fmt: skip
            cfg = sm._rows_config(n, es, 227 * 1024)
            if cfg["PERSISTENT"] or cfg["ROWS"] != 1:
                continue

            def launch(rows, warps, stages, pdl, n=n, es=es):
                opts = {"launch_pdl": True} if pdl else {}

                def run(x):
                    out = torch.empty_like(x)
                    sm._softmax_rows_kernel[(triton.cdiv(m, rows),)](
                        x, out, m, n, x.stride(0), out.stride(0),
                        LOG=False, ROWS=rows, BLOCK_N=n, NUM_STAGES=stages, FAST=fast_math(x),
                        VEC=16 // es, PDL=pdl, num_warps=warps, **opts,
                    )  # fmt: skip
                    return out

                return run

            w, st = cfg["num_warps"], cfg["NUM_STAGES"]
            arms = {
                f"library 1 row / {w} w, PDL off": launch(1, w, st, False),
                f"library 1 row / {w} w, PDL on": launch(1, w, st, True),
                f"2 rows / {min(16, 2 * w)} w, PDL on": launch(2, min(16, 2 * w), st, True),
                f"2 rows / {w} w, PDL on": launch(2, w, st, True),
            }
            if w < 4:  # the rule's shape under PDL (softmax.PDL_MIN_WARPS)
                arms[f"{4 // w} rows / 4 w, PDL on"] = launch(4 // w, 4, 1, True)
            table(f"softmax rows kernel {str(dtype)[6:]} {m} x {n}", arms, sets)
            paired = {
                f"neg, then {name}": lambda x, fn=fn: (torch.neg(x), fn(x))[1]
                for name, fn in arms.items()
            }
            table("the same after torch.neg (us a pair)", paired, sets)


def library_shapes() -> None:
    import importlib

    import probe_launch_bound as plb

    from fuseml.bench.harness import Settings

    sm = importlib.import_module("fuseml.ops.softmax")
    if os.environ.get("PROBE_FULL") == "1":
        plb.SETTINGS = Settings.for_mode(quick=False)
    library_config = sm._rows_config
    forced: dict = {}

    def rows_config(n_cols, elem_size, smem_bytes=None, pdl=False):
        cfg = library_config(n_cols, elem_size, smem_bytes, pdl)
        return {**cfg, **forced} if forced else cfg

    sm._rows_config = rows_config
    spec = os.environ.get("PROBE_SHAPES", "1/1/2/0,1/1/2/1,2/2/2/0,2/2/2/1,4/4/1/1")
    shapes = [tuple(int(v) for v in item.split("/")) for item in spec.split(",")]
    dtype = getattr(torch, os.environ.get("PROBE_DTYPE", "float32"))
    m = 4096
    for n in (int(v) for v in os.environ.get("PROBE_WIDTHS", "512").split(",")):
        for log in (False, True):
            ref, fused, compiled = plb.softmax_ops(log)
            sets = plb.row_sets(n, dtype, m)
            arms = {"torch": lambda x, ref=ref: ref(x, -1), "compile": compiled}
            for pdl in ("0", "1"):
                arms[f"cuda twin, PDL {pdl}"] = _with_pdl(
                    pdl, lambda x, fused=fused: fused(x, -1, backend="cuda")
                )
            for rows, warps, stages, *pdl in shapes:
                cfg = {"ROWS": rows, "num_warps": warps, "NUM_STAGES": stages}
                flag = str(pdl[0]) if pdl else "1"

                def run(x, cfg=cfg, fused=fused):
                    forced.update(cfg)
                    sm._ROWS_PLANS.clear()  # the launch plans are cached per shape
                    try:
                        return fused(x, -1, backend="triton")
                    finally:
                        forced.clear()
                        sm._ROWS_PLANS.clear()

                arms[f"{rows} row(s) / {warps} w / {stages} st, PDL {flag}"] = _with_pdl(flag, run)
            arms["library, PDL 1"] = _with_pdl("1", lambda x, fused=fused: fused(x, -1))
            title = f"{'log_' if log else ''}softmax {str(dtype)[6:]} {m} x {n}"
            table(title, arms, sets)
            paired = {
                f"neg, then {name}": lambda x, fn=fn: (torch.neg(x), fn(x))[1]
                for name, fn in arms.items()
            }
            table(f"{title}, after torch.neg (us a pair)", paired, sets)


def lora() -> None:
    import torch.nn.functional as F

    bf = torch.bfloat16
    for m in (64, 256, 512):

        def make(m=m):
            x = torch.randn(m, 4096, device="cuda", dtype=bf)
            w = (torch.randn(4096, 4096, device="cuda") / 64).to(bf)
            b = torch.randn(4096, device="cuda", dtype=bf)
            a = (torch.randn(64, 4096, device="cuda") / 64).to(bf)
            bb = (torch.randn(4096, 64, device="cuda") / 8).to(bf)
            merged = (w.float() + 0.5 * (bb.float() @ a.float())).to(bf)
            return x, w, b, a, bb, merged

        sets = rotated(make, 2 * 4096 * 4096 * 2)

        def fused(x, w, b, a, bb, merged):
            return fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, backend="triton")

        arms = {
            "merged F.linear": lambda x, w, b, a, bb, merged: F.linear(x, merged, b),
            "fused, PDL off": _with_pdl("0", fused),
            "fused, PDL on": _with_pdl("1", fused),
        }
        table(f"lora_linear bf16 4096 -> 4096, rank 64, {m} rows", arms, sets)


if __name__ == "__main__":
    what = sys.argv[1:] or ["add", "softmax", "neighbours", "fuseml"]
    for name in what:
        {
            "add": add, "softmax": softmax, "neighbours": neighbours, "fuseml": fuseml_cases,
            "rows": rows_shapes, "widths": rows_widths, "lora": lora,
            "shapes": library_shapes,
        }[name]()  # fmt: skip
