"""GPU probe: short softmax rows with a warp a row in Triton, against the library's tiles.

The on-chip kernel loads a (ROWS, BLOCK_N) tile. Triton's default layout puts a tile's
warps along its columns wherever a row is wider than one warp's 16-byte vectors (float32
from 256 columns, 16-bit from 512): a 4 x 512 float32 tile on 4 warps gives each warp 128
columns of all four rows, so every row's max and sum cross warps through shared memory
(3 barriers). The CUDA twin gives each warp its own row (shuffles only) and was faster at
4096 x 512 float32 (5.84 against 6.36 us with PDL, NOTES.md, sixteenth round).

A (C, ROWS, W) tile, W = 32 16-byte vectors and C = BLOCK_N / W column chunks outermost,
gets a warp a row from Triton's own layout rules: offline (triton 3.9, sm_90) its blocked
layout is warpsPerCTA = [1, 4, 1] at 4 rows on 4 warps, no barrier, no shared memory,
where the (ROWS, BLOCK_N) tile has warpsPerCTA = [1, 4] and 3 barriers. This probe times
that lean kernel (the library kernel's math: exp2 of (x - max) * log2(e), a reciprocal,
masks for widths such as 1000) at several rows a program, PDL off / on, beside the
library's softmax, its CUDA twin, torch and torch.compile, alone and each call after a
torch kernel, as the suites time them (CUDA-graph replay at the full suite's settings,
inputs rotating past twice the L2, arms interleaved over rounds):

    PYTHONPATH=src:scripts python scripts/probe_warp_rows.py
        PROBE_WIDTHS="float32:512,bfloat16:1024,..."  PROBE_ROWS="2,4,8"  PROBE_LOG=0|1

--check runs the lean kernel against torch.softmax on the CPU (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from fuseml.ops._math import LOG2E, _exp2, _pdl_begin, _rcp
from fuseml.ops._utils import fast_math


@triton.jit
def _warp_rows_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_xm, stride_om,
    LOG: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        _pdl_begin()
    rows = tl.cast(tl.program_id(0), tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, C)[:, None, None] * W + tl.arange(0, W)[None, None, :]  # (C, 1, W)
    mask = (rows < n_rows)[None, :, None] & (cols < n_cols)
    x = tl.load(x_ptr + rows[None, :, None] * stride_xm + cols, mask=mask, other=-float("inf")).to(
        tl.float32
    )
    z = x - tl.max(tl.max(x, axis=2), axis=0)[None, :, None]
    e = _exp2(z * LOG2E, FAST)
    s = tl.sum(tl.sum(e, axis=2), axis=0)[None, :, None]
    y = z - tl.log(s) if LOG else e * _rcp(s, FAST)
    tl.store(
        out_ptr + rows[None, :, None] * stride_om + cols, y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )  # fmt: skip


def warp_rows(x: torch.Tensor, rows: int, log: bool, pdl: bool) -> torch.Tensor:
    """softmax (log_softmax) of a contiguous 2-D x over its last dim, a warp a row."""
    n_rows, n_cols = x.shape
    vec = 16 // x.element_size()
    w = 32 * vec
    block = max(w, triton.next_power_of_2(n_cols))
    out = torch.empty_like(x)
    opts = {"launch_pdl": True} if pdl else {}
    _warp_rows_kernel[(triton.cdiv(n_rows, rows),)](
        x, out, n_rows, n_cols, x.stride(0), out.stride(0), LOG=log, ROWS=rows, C=block // w,
        W=w, FAST=fast_math(x), PDL=pdl, num_warps=rows, **opts,
    )  # fmt: skip
    return out


def check() -> None:
    """The lean kernel against torch (CPU, interpreter)."""
    for dtype in (torch.float32, torch.bfloat16):
        for n_cols in (512, 1000, 1024):
            x = 4 * torch.randn(37, n_cols, dtype=dtype)
            for log in (False, True):
                want = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
                got = warp_rows(x, 4, log, False).double()
                err = ((got - want).abs().max() / want.abs().max()).item()
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                assert err < tol, (dtype, n_cols, log, err)
                print(f"{str(dtype)[6:]:9} {n_cols:5d} log={log}: max rel err {err:.1e}")


def main() -> None:
    import probe_launch_bound as plb
    from probe_pdl import _with_pdl

    from fuseml.bench.harness import Settings

    plb.SETTINGS = Settings.for_mode(quick=False)
    log = os.environ.get("PROBE_LOG", "0") == "1"
    rows_list = [int(v) for v in os.environ.get("PROBE_ROWS", "2,4,8").split(",")]
    widths = os.environ.get("PROBE_WIDTHS", "float32:512,bfloat16:1024,bfloat16:512,float32:1024")
    ref, fused, compiled = plb.softmax_ops(log)

    for item in widths.split(","):
        dtype_name, n = item.split(":")
        sets = plb.row_sets(int(n), getattr(torch, dtype_name))
        arms = {
            "torch": lambda x: ref(x, -1),
            "compile": compiled,
            "library": lambda x: fused(x, -1, backend="triton"),
            "cuda twin": lambda x: fused(x, -1, backend="cuda"),
        }
        for rows in rows_list:
            for pdl in (False, True):
                arms[f"warp a row, {rows} rows, PDL {int(pdl)}"] = lambda x, rows=rows, pdl=pdl: (
                    warp_rows(x, rows, log, pdl)
                )
        arms = {name: _with_pdl("1", fn) for name, fn in arms.items()}  # (the library's)
        title = f"{'log_' if log else ''}softmax {dtype_name} 4096 x {n}"
        plb.table(title, arms, sets)
        paired = {
            f"neg, then {name}": lambda x, fn=fn: (torch.neg(x), fn(x))[1]
            for name, fn in arms.items()
        }
        plb.table(f"{title}, after torch.neg (us a pair)", paired, sets)


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
