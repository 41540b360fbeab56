"""Why a LoRA layer's CUDA-graph capture fails (GPU probe, not a test).

    PYTHONPATH=src python scripts/probe_capture.py M,adapters,rank ...

For each shape: fuseml's log at DEBUG (every tuning candidate that failed, and why), one
eager call (tunes), the tuned mode, then a capture of one call with the full traceback
of the first error.
"""

from __future__ import annotations

import logging
import sys
import traceback

import torch

import fuseml
from fuseml.ops import _tune


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("fuseml").setLevel(logging.DEBUG)
    for arg in sys.argv[1:]:
        m, adapters, r = (int(v) for v in arg.split(","))
        k = n = 4096
        dt = torch.bfloat16
        lead = (adapters,) if adapters else ()
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
        b = torch.randn(n, device="cuda", dtype=dt)
        a = torch.randn(*lead, r, k, device="cuda", dtype=dt) / k**0.5
        bb = torch.randn(*lead, n, r, device="cuda", dtype=dt) / r**0.5
        ids = torch.randint(0, adapters, (m,), device="cuda") if adapters else None

        def call(x=x, w=w, b=b, a=a, bb=bb, ids=ids):
            return fuseml.ops.lora_linear(x, w, b, a, bb, 2.0, "relu", adapter_ids=ids)

        print(f"== M={m} adapters {adapters or 1} rank {r}", flush=True)
        call()
        torch.cuda.synchronize()
        for key, cfg in _tune._memo.items():
            if key[0] == "loramode":
                print(f"  mode {key[2:6]}: {cfg}", flush=True)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                call()
            graph.replay()
            torch.cuda.synchronize()
            print("  capture and replay: ok", flush=True)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
