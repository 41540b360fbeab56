"""Suite ``softmax``: M = 4096 rows, N from 128 to 262,144 columns (powers of two and odd
widths), softmax and log-softmax.

Arms
  manual   the naive chain: max, subtract, exp, sum, divide (5 reads, 3 writes)
  torch    torch.softmax / torch.log_softmax
  compile  torch.compile of the reference
  triton   fuseml.ops.softmax / log_softmax (on-chip persistent kernel up to 32,768
           columns, online two-pass kernel above)
  cuda     the CUDA C++ twin (warp per row for short rows, block per row for long ones)
  copy     a device-to-device copy of the input (softmax only): what moving the same
           bytes once costs at this size, the practical ceiling of a one-read, one-write
           op (the copy_gbps ceiling is measured at 1 GiB). A reference, not a peer.

Sweep (``--sweep``): rows past the on-chip kernel's width, through the split-row kernel at
every width of a row's piece (columns a program: SWEEP_SPLIT_BLOCKS, the warps following
it), arms ``triton@split<columns>``.
"""

from __future__ import annotations

import importlib

import torch

import fuseml
from fuseml.bench.harness import Case
from fuseml.bench.suites._common import launch_bound

sm = importlib.import_module("fuseml.ops.softmax")  # (fuseml.ops.softmax: the function)
from fuseml.ops._softmax.long_rows import SPLIT_MAX_CHUNKS  # noqa: E402
from fuseml.ops._softmax.rows import MAX_ONCHIP_COLS  # noqa: E402

SWEEP_SPLIT_BLOCKS = (2048, 4096, 8192, 16384, 32768)


def _sweep(n: int, log: bool):
    """sweep() of one case: one arm per width of the split kernel's pieces that splits a
    row of ``n`` columns into 2 or more pieces within the kernel's limit of pieces a row
    (at most half the SMs: a row's programs wait on each other, so all must be resident)."""

    def sweep() -> dict:
        if n <= MAX_ONCHIP_COLS:
            return {}
        sms = (
            torch.cuda.get_device_properties(0).multi_processor_count
            if torch.cuda.is_available()
            else 2 * SPLIT_MAX_CHUNKS  # (the interpreter runs one program at a time)
        )
        limit = min(SPLIT_MAX_CHUNKS, sms // 2)
        arms = {}
        for block in SWEEP_SPLIT_BLOCKS:
            chunks = -(-n // block)
            if not 1 < chunks <= limit:
                continue

            def call(x, block=block, chunks=chunks):
                return sm._forward(x, -1, log, "triton", False, path="split", split=(block, chunks))

            arms[f"triton@split{block}"] = call
        return arms

    return sweep


ROWS = 4096
N_FULL = [128, 256, 512, 1000, 1024, 2048, 3000, 4096, 8192, 16384, 32768, 50257, 65536,
          131072, 262144]  # fmt: skip
N_QUICK = [128, 1000, 4096, 16384, 50257, 65536, 262144]
LOG_N_QUICK = [1024, 32768, 262144]


def _manual_softmax(x):
    m = x.max(dim=-1, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def _manual_log_softmax(x):
    z = x - x.max(dim=-1, keepdim=True).values
    return z - torch.log(torch.exp(z).sum(dim=-1, keepdim=True))


def _case(op: str, n: int, dtype: torch.dtype, cuda: bool) -> Case:
    log = op == "log_softmax"
    ref = torch.log_softmax if log else torch.softmax
    fused = fuseml.ops.log_softmax if log else fuseml.ops.softmax
    dname = str(dtype).replace("torch.", "")
    es = torch.empty((), dtype=dtype).element_size()
    return Case(
        suite="softmax",
        name=f"{op}/{dname}/{ROWS}x{n}",
        params={"op": op, "dtype": dname, "n_cols": n, "numel": ROWS * n, "shape": [ROWS, n]},
        make_inputs=lambda: (3 * torch.randn(ROWS, n, device="cuda", dtype=dtype),),
        arms={
            "torch": lambda x: ref(x, -1),
            "manual": _manual_log_softmax if log else _manual_softmax,
            "compile": torch.compile(lambda x: ref(x, -1), dynamic=False),
            "triton": lambda x: fused(x, -1, backend="triton"),
            **({"cuda": lambda x: fused(x, -1, backend="cuda")} if cuda else {}),
            **({} if log else {"copy": lambda x: torch.empty_like(x).copy_(x)}),
        },
        bytes=2 * ROWS * n * es,
        dtype=dtype,
        # Small N: a few microseconds of GPU work, so host launch time would dominate the
        # events timing; CUDA-graph replays show the kernels' own time as well.
        graph=launch_bound(0, 2 * ROWS * n * es),
        sweep=_sweep(n, log),
    )


def cases(quick: bool = False, cuda: bool = True):
    if quick:
        for n in N_QUICK:
            yield _case("softmax", n, torch.bfloat16, cuda)
        for n in LOG_N_QUICK:
            yield _case("log_softmax", n, torch.bfloat16, cuda)
        return
    for op in ("softmax", "log_softmax"):
        for dtype in (torch.float32, torch.bfloat16):
            for n in N_FULL:
                yield _case(op, n, dtype, cuda)


PLOT = {"x": "n_cols", "panels": ("op", "dtype"), "xlabel": "columns (N)", "logx": True}
README = {
    "rows": ("op", "dtype", "shape"),
    "arms": ("manual", "torch", "compile", "triton", "cuda", "copy"),
    "min_numel": 0,
    "reference_arms": ("copy",),
}
