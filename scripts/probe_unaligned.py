"""GPU sweep of the pointer GEMM loop on rows that are not 16-byte aligned (tuning work,
not the benchmark).

    PYTHONPATH=src:scripts python scripts/probe_unaligned.py [M,...]   (default 512,4096,65536)
    PROBE_TILES=0 ...: the library arms only (no fixed tiles)

The DLRM's 367 -> 512 layer (bf16 + bias + ReLU): 367-element rows are 734 bytes, so
neither TMA nor Triton's asynchronous copies can load them, and Triton's pipeliner leaves
the K loop as it is (each step waits for its own loads). Arms, each at several tiles:

- ``ptr``: the library's pointer loop on the raw rows, as is;
- ``ptr reg``: the same loop with each step's loads issued a step early into registers
  (``REG_PIPE``), so they arrive while the step before is multiplied;

next to fuseml's layer four ways: as the library runs it; on the raw rows, tuned
(``REG_PIPE`` tiles among its candidates); padded whatever the rows (what the library does
from PAD_K_MIN_M rows, see fuseml.ops.linear: x, and inside a graph capture W too, padded
in one launch); and on rows zero-padded to 368 by F.pad per call with W padded before;
and cuBLASLt's fused epilogue. CUDA graphs of
calls over 3 input sets in turn (past the L2 at 4096 rows and more), interleaved over
PROBE_ROUNDS rounds.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from graph_arms import relu_layer_sets, report, time_arms

import fuseml.ops
from fuseml.ops import _elementwise as ew
from fuseml.ops import _gemm

linear_mod = sys.modules["fuseml.ops.linear"]

DT = torch.bfloat16
K, N = 367, 512
CALLS = 24
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps)
    (128, 128, 64, 8), (128, 128, 32, 8), (64, 128, 64, 4), (128, 64, 64, 4),
    (64, 64, 64, 4), (128, 256, 64, 8), (64, 256, 64, 8), (256, 128, 64, 8),
]  # fmt: skip


def probe(m: int, rounds: int) -> None:
    """Every arm at m rows, timed and reported."""
    dev = torch.device("cuda")
    relu = ew.ACT_CODE["relu"]
    xs, w, b, outs, ref = relu_layer_sets(m, K, N, DT)
    w_pad = F.pad(w, (0, 1))

    def pad_from(rows):  # the library with padding from this many rows
        def run(i):
            kept = linear_mod.PAD_K_MIN_M
            linear_mod.PAD_K_MIN_M = rows
            try:
                fuseml.ops.linear(xs[i % 3], w, b, activation="relu")
            finally:
                linear_mod.PAD_K_MIN_M = kept

        return run

    arms = {
        "fuseml.ops.linear (as is)": lambda i: fuseml.ops.linear(
            xs[i % 3], w, b, activation="relu"),
        "fuseml raw rows (tuned)": pad_from(1 << 62),
        "fuseml padded (one launch)": pad_from(1),
        "fuseml x padded, W before": lambda i: fuseml.ops.linear(
            F.pad(xs[i % 3], (0, 1)), w_pad, b, activation="relu"),
        "cuBLASLt fused epilogue": lambda i: torch._addmm_activation(b, xs[i % 3], w.t()),
    }  # fmt: skip
    checked = set()

    def ptr_arm(bm, bn, bk, warps, reg):
        cfg = dict(_gemm._cfg(bm, bn, bk, warps, 1 if reg else 3), REG_PIPE=reg)
        tag = f"ptr{' reg' if reg else ''} {bm}x{bn}x{bk} w{warps}"

        def run(i):
            _gemm.launch_linear(outs[i % 3], xs[i % 3], w, b, None, 1.0, relu, cfg)

        arms[tag] = run
        checked.add(tag)

    for tile in TILES if os.environ.get("PROBE_TILES", "1") == "1" else ():
        ptr_arm(*tile, False)
        ptr_arm(*tile, True)
    flops = 2 * m * K * N
    print(f"{torch.cuda.get_device_name(dev)}: {m} x {K} -> {N} bf16 + bias + ReLU; "
          f"{len(arms)} arms x {rounds} rounds", flush=True)  # fmt: skip
    times, failed = time_arms(arms, checked, outs[0], ref, rounds, CALLS)
    report(times, failed, "cuBLASLt fused epilogue",
           lambda us: f"{flops / us / 1e6:6.1f} TFLOP/s", 30)  # fmt: skip


def main() -> None:
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "512,4096,65536").split(",")]
    rounds = int(os.environ.get("PROBE_ROUNDS", "3"))
    for m in ms:
        probe(m, rounds)


if __name__ == "__main__":
    main()
