"""GPU probe of a candidate long-row softmax: the split-row scheme with a persistent grid
that loads its next chunk before it waits for the current row's other chunks. (The same
scheme inside fuseml's split kernel, with its head and tail piece for unaligned rows, was
tried and taken out: 1-4% on aligned rows, nothing on unaligned ones, a loss for
log_softmax; numbers in ops/softmax.py and NOTES.md.)

    PYTHONPATH=src timeout 300 python scripts/probe_softmax_pipelined.py [N ...]

fuseml's split-row kernel (fuseml.ops.softmax) gives each (row, chunk) its own program,
which sits idle, holding its registers, while it waits for the row's other chunks. Here
a grid of exactly the programs that fit on the GPU at once walks the (row, chunk) items
in order (item i on program i % grid), and issues the loads of its next item before the
wait, so the wait overlaps memory traffic. The wait is safe when every program is
resident (the grid comes from the compiled kernel's registers and the device's limits)
and the grid is at least twice the chunks of a row. Softmax only, bf16 rows whose width
is a multiple of 8 (no unaligned head or tail: 50256 stands in for 50257), with fixed or
evenly shared chunks; compared with torch.softmax, a same-size copy and fuseml's split-row
kernel; PROBE_PIPE="block:warps,..." picks the configs. Median us (triton.testing.do_bench,
L2 flushed).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from probe_softmax import env_sweep, inputs, us_of  # scripts/ (this script's folder)

import fuseml
from fuseml.ops._math import LOG2E, _exp2, _rcp
from fuseml.ops._utils import cdiv, next_pow2, sm_count
from fuseml.ops.softmax import row_stats
from fuseml.testing import rel_err


@triton.jit
def _load_item(
    x_ptr, item, n_items, chunks, n_cols, stride_xm, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr
):
    row = tl.cast(item // chunks, tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rel = (item % chunks) * CHUNK + cols
    mask = (rel < n_cols) & (item < n_items)
    if CHUNK < BLOCK_N:
        mask &= cols < CHUNK
    return tl.load(x_ptr + row * stride_xm + rel, mask=mask, other=-float("inf"))


@triton.jit
def _pipelined_kernel(
    x_ptr, out_ptr, stats_ptr, count_ptr, n_rows, n_cols, stride_xm, stride_om, chunks,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    n_items = n_rows * chunks
    step = tl.num_programs(0)
    item = tl.program_id(0)
    x = _load_item(x_ptr, item, n_items, chunks, n_cols, stride_xm, BLOCK_N, CHUNK)
    while item < n_items:
        nxt = item + step
        x_next = _load_item(x_ptr, nxt, n_items, chunks, n_cols, stride_xm, BLOCK_N, CHUNK)
        row = tl.cast(item // chunks, tl.int64)
        chunk = item % chunks
        xf = x.to(tl.float32)
        m = tl.max(xf, axis=0)
        shift = tl.where(m == -float("inf"), 0.0, m)
        stats_row = stats_ptr + row * (2 * chunks)
        tl.store(stats_row + 2 * chunk, m)
        tl.store(stats_row + 2 * chunk + 1, tl.sum(_exp2((xf - shift) * LOG2E, True), axis=0))
        posted = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") + 1
        while posted < chunks:
            posted = tl.atomic_add(count_ptr + row, 0, sem="acquire")
        m_row, total = row_stats(stats_row, chunks, BLOCK_G, True)
        y = _exp2((xf - m_row) * LOG2E, True) * _rcp(total, True)
        cols = tl.arange(0, BLOCK_N)
        rel = chunk * CHUNK + cols
        mask = rel < n_cols
        if CHUNK < BLOCK_N:
            mask &= cols < CHUNK
        tl.store(out_ptr + row * stride_om + rel, y.to(out_ptr.dtype.element_ty), mask=mask)
        x = x_next
        item = nxt


_GRIDS: dict[tuple, int] = {}


def _grid(x, out, stats, count, chunks, block, warps, chunk) -> int:
    """Programs that fit on the GPU at once, from the compiled kernel."""
    key = (block, warps, chunks, chunk)
    if key not in _GRIDS:
        k = _pipelined_kernel.warmup(
            x, out, stats, count, x.shape[0], x.shape[1], x.stride(0), out.stride(0), chunks,
            BLOCK_N=block, BLOCK_G=next_pow2(chunks), CHUNK=chunk, num_warps=warps, grid=(1,),
        )  # fmt: skip
        k._init_handles()
        props = torch.cuda.get_device_properties(x.device)
        threads = warps * 32
        per_sm = min(
            props.max_threads_per_multi_processor // threads,
            props.regs_per_multiprocessor // max(1, k.n_regs * threads),
            props.shared_memory_per_multiprocessor // k.metadata.shared
            if k.metadata.shared
            else 64,
        )
        _GRIDS[key] = max(1, per_sm) * sm_count(x.get_device())
        print(f"    (block {block}, {warps} warps: {k.n_regs} registers, {per_sm} per SM)")
    return _GRIDS[key]


def pipelined_softmax(x: torch.Tensor, block: int, warps: int, balanced: bool) -> torch.Tensor:
    n_rows, n_cols = x.shape
    assert n_cols % 8 == 0 and x.is_contiguous(), "aligned rows only"
    chunks = cdiv(n_cols, block)
    # balanced: a row's columns shared evenly (rounded up to 16), as the library does
    chunk = min(block, cdiv(cdiv(n_cols, chunks), 16) * 16) if balanced else block
    out = torch.empty_like(x)
    stats = torch.empty((n_rows, chunks, 2), dtype=torch.float32, device=x.device)
    count = torch.zeros((n_rows,), dtype=torch.int32, device=x.device)
    grid = _grid(x, out, stats, count, chunks, block, warps, chunk)
    if grid < 2 * chunks:
        raise ValueError(f"grid {grid} < 2 x {chunks} chunks: the wait could hang")
    _pipelined_kernel[(grid,)](
        x, out, stats, count, n_rows, n_cols, x.stride(0), out.stride(0), chunks,
        BLOCK_N=block, BLOCK_G=next_pow2(chunks), CHUNK=chunk, num_warps=warps,
    )  # fmt: skip
    return out


def _width(n: int, m: int) -> None:
    x, ref, show = inputs(n, m)
    print(f"== softmax {m} x {n} bf16")
    show("copy", us_of(lambda: torch.empty_like(x).copy_(x)))
    show("torch.softmax", us_of(lambda: torch.softmax(x, -1)))
    show("fuseml (split-row kernel)", us_of(lambda: fuseml.ops.softmax(x)))
    configs = env_sweep("PROBE_PIPE") or [(4096, 4), (8192, 8), (8192, 4), (16384, 16)]
    for block, warps in configs:  # columns an item, warps
        for balanced in (False, True):
            if balanced and n % block == 0:
                continue  # the same chunks
            err = rel_err(pipelined_softmax(x, block, warps, balanced), ref)
            us = us_of(lambda b=block, w=warps, e=balanced: pipelined_softmax(x, b, w, e))
            show(f"pipelined block={block} warps={warps} balanced={int(balanced)}", us, err)


def main(m: int = 4096) -> None:
    for n in [int(a) for a in sys.argv[1:]] or [50256, 65536, 262144]:
        _width(n, m)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
