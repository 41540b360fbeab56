# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""GPU sweep of softmax kernel variants (tuning work, not the benchmark).

    PYTHONPATH=src python scripts/probe_softmax.py [short|long]

Candidate kernels live here until a measurement earns them a place in fuseml.ops.softmax:

  rowblock   short rows: a persistent program takes ROWS rows at a time as one
             (ROWS, BLOCK_N) tile, so each step has ROWS times the bytes in flight of the
             one-row-per-step kernel (43% of copy bandwidth at N = 4096 on an H200).
  online_l2  long rows: the online kernel with a persistent grid capped at PROGRAMS rows
             in flight (1-4 per SM) and the second pass walking the row backwards, so that it starts
             on the chunks the first pass loaded last (most likely still in L2). Today
             each of 132+ rows in flight streams 128 KiB-1 MiB twice and the second read
             misses L2 (62% of copy).

Each variant is checked against torch.softmax and timed with triton.testing.do_bench (L2
flushed before each call): median us and GB/s (one read + one write), next to
torch.softmax and fuseml.ops.softmax in the same run.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
import triton.testing

import fuseml
from fuseml.testing import rel_err

DT = torch.bfloat16


@triton.jit
def _rowblock_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_xm, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    local = tl.arange(0, ROWS)
    n_blocks = tl.cdiv(n_rows, ROWS)
    for blk in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = (blk * ROWS + local).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=-float("inf")
        ).to(tl.float32)
        z = x - tl.max(x, axis=1)[:, None]
        e = tl.exp(z)
        y = e / tl.sum(e, axis=1)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _online_l2_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_xm, stride_om,
    BLOCK_N: tl.constexpr, REVERSE: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    n_steps = tl.cdiv(n_cols, BLOCK_N)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x_row = x_ptr + tl.cast(row, tl.int64) * stride_xm
        m = tl.full([BLOCK_N], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK_N], tl.float32)
        for step in range(0, n_steps):
            offs = step * BLOCK_N + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        row_max = tl.max(m, axis=0)
        shift = tl.where(row_max == -float("inf"), 0.0, row_max)
        total = tl.sum(s * tl.exp(m - shift), axis=0)
        out_row = out_ptr + tl.cast(row, tl.int64) * stride_om
        for i in range(0, n_steps):
            if REVERSE:
                step = n_steps - 1 - i
            else:
                step = i
            offs = step * BLOCK_N + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (tl.exp(x - row_max) / total).to(out_ptr.dtype.element_ty),
                     mask=mask)  # fmt: skip


def _us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def _row(name: str, us: float, nbytes: int, base: float | None, err: float | None) -> None:
    gbps = nbytes / (us * 1e-6) / 1e9
    vs = f"{base / us:5.2f}x torch" if base else ""
    e = "" if err is None else f"err={err:.1e}"
    print(f"  {name:46s} {us:9.1f} us {gbps:7.0f} GB/s {vs} {e}", flush=True)


def short(m: int = 4096) -> None:
    for n in (128, 512, 1000, 1024, 2048, 4096):
        x = 3 * torch.randn(m, n, device="cuda", dtype=DT)
        out = torch.empty_like(x)
        ref = torch.softmax(x, -1)
        nbytes = 2 * x.numel() * x.element_size()
        print(f"== softmax {m} x {n} bf16")
        base = _us(lambda: torch.softmax(x, -1))
        _row("torch.softmax", base, nbytes, None, None)
        _row("fuseml (one row per step)", _us(lambda: fuseml.ops.softmax(x)), nbytes, base,
             rel_err(fuseml.ops.softmax(x), ref))  # fmt: skip
        block = triton.next_power_of_2(n)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for rows in (2, 4, 8, 16):
            if rows * block > 32768:
                continue
            for warps in (4, 8):
                for per_sm in (4,):
                    grid = (min(triton.cdiv(m, rows), per_sm * sms),)

                    def run(rows=rows, warps=warps, grid=grid):
                        _rowblock_kernel[grid](
                            x, out, m, n, x.stride(0), out.stride(0),
                            ROWS=rows, BLOCK_N=block, NUM_STAGES=2, num_warps=warps,
                        )  # fmt: skip

                    try:
                        out.fill_(float("nan"))
                        run()
                        err = rel_err(out, ref)
                        _row(f"rowblock rows={rows} warps={warps} per_sm={per_sm}", _us(run),
                             nbytes, base, err)  # fmt: skip
                    except Exception as e:  # a variant this GPU cannot build
                        print(f"  rowblock rows={rows} warps={warps}: {type(e).__name__}")


def long(m: int = 4096) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in (65536, 262144):
        x = 3 * torch.randn(m, n, device="cuda", dtype=DT)
        out = torch.empty_like(x)
        ref = torch.softmax(x, -1)
        nbytes = 2 * x.numel() * x.element_size()
        print(f"== softmax {m} x {n} bf16")
        base = _us(lambda: torch.softmax(x, -1))
        _row("torch.softmax", base, nbytes, None, None)
        _row("fuseml (online, one program per row)", _us(lambda: fuseml.ops.softmax(x)),
             nbytes, base, rel_err(fuseml.ops.softmax(x), ref))  # fmt: skip
        for programs in (sms, 2 * sms, 4 * sms):
            for reverse in (False, True):
                for block, warps in ((4096, 8), (8192, 16)):

                    def run(programs=programs, reverse=reverse, block=block, warps=warps):
                        _online_l2_kernel[(programs,)](
                            x, out, m, n, x.stride(0), out.stride(0),
                            BLOCK_N=block, REVERSE=reverse, num_warps=warps,
                        )  # fmt: skip

                    out.fill_(float("nan"))
                    run()
                    name = f"online_l2 programs={programs} rev={reverse} block={block} w={warps}"
                    _row(name, _us(run), nbytes, base, rel_err(out, ref))


def main() -> None:
    which = sys.argv[1:] or ["short", "long"]
    if "short" in which:
        short()
    if "long" in which:
        long()


if __name__ == "__main__":
    main()
