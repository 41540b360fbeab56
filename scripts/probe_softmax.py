"""GPU sweep of the softmax launch configs (tuning work, not the benchmark).

    PYTHONPATH=src python scripts/probe_softmax.py [N ...]

M = 4096 bf16 rows (PROBE_M sets them) of N = 16384, 32768 (where the on-chip kernel
ends), 50257, 65536 and 262144 columns (or the N given), softmax (log_softmax with
PROBE_LOG=1). Timed: torch's op and a same-size copy; the on-chip kernel where it
applies, by warps, pipelining stages and grid (PROBE_ROWS="warps:stages:per_sm,...",
default 8 / 16 / 32 warps); the CUDA twin; the split-row kernel's columns per program and
columns per warp (PROBE_SPLIT="block:cols_per_warp,..."), each with a row's columns shared
evenly over its programs or not; then the online kernel's columns per step, warps and
programs per SM (0: one program per row; PROBE_ONLINE). "none" skips the split or online
sweep. Median us (triton.testing.do_bench, L2 flushed) and GB/s (one read + one write).
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys

import torch
import triton.testing

import fuseml
from fuseml.testing import rel_err

sm = importlib.import_module("fuseml.ops.softmax")  # the module (fuseml.ops.softmax: the op)
LOG = os.environ.get("PROBE_LOG") == "1"  # log_softmax instead of softmax


def env_sweep(name: str) -> list[tuple[int, ...]]:
    """The configs an environment variable names ("a:b:c,d:e:f"), [] if it is unset."""
    value = os.environ.get(name, "")
    return [tuple(int(v) for v in t.split(":")) for t in value.split(",") if t]


def us_of(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def inputs(n: int, m: int):
    """(x, torch.softmax(x), show): m x n bf16 rows, and a printer of one timing line
    (us, GB/s of one read and one write, error against the reference)."""
    x = 3 * torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = (torch.log_softmax if LOG else torch.softmax)(x, -1)
    nbytes = 2 * x.numel() * x.element_size()

    def show(name: str, us: float, err: float | None = None) -> None:
        e = "" if err is None else f" err={err:.1e}"
        print(f"  {name:40s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s{e}", flush=True)

    return x, ref, show


def show_registers() -> None:
    """Registers a thread of each split kernel compiled so far (the kernel cache's
    layout differs between triton versions: best effort)."""
    kernel = sm._softmax_split_kernel
    caches = getattr(kernel, "device_caches", None) or {}
    for cache in caches.values():
        entries = cache[0] if isinstance(cache, tuple) else cache
        for compiled in entries.values():
            consts = getattr(compiled, "constants", None) or getattr(compiled.src, "constants", {})
            keys = ("BLOCK_N", "CHUNK", "PAIRS", "LOG")
            named = {k: v for k, v in consts.items() if isinstance(k, str) and k in keys}
            print(f"  split kernel {named or ''}: {compiled.n_regs} registers, "
                  f"{compiled.n_spills} spills", flush=True)  # fmt: skip


def _width(n: int, m: int) -> None:
    x, ref, show = inputs(n, m)

    op = fuseml.ops.log_softmax if LOG else fuseml.ops.softmax

    def fused():
        return op(x)

    print(f"== {'log_softmax' if LOG else 'softmax'} {m} x {n} bf16")
    show("copy", us_of(lambda: torch.empty_like(x).copy_(x)))
    show("torch", us_of(lambda: (torch.log_softmax if LOG else torch.softmax)(x, -1)))
    if n <= sm.MAX_ONCHIP_COLS:
        show("fuseml on-chip kernel", us_of(fused))
        base, programs = sm._rows_config, sm._persistent_programs
        # PROBE_ROWS="warps:stages:per_sm,...": the on-chip kernel's warps, software
        # pipelining stages (1: plain loads, 2+: cp.async through shared memory; 0: the
        # library's) and grid (per_sm 0: the occupancy-sized persistent grid; -1: one
        # program per row; k > 0: k programs per SM; -2: the library's choice). Default:
        # warps 8 / 16 / 32 with the library's stages and grid (at 32768 columns 16 warps
        # spill 72 B a thread offline, sm_90a; 32 do not).
        sweep = env_sweep("PROBE_ROWS") or [(8, 0, -2), (16, 0, -2), (32, 0, -2)]
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        try:
            for warps, stages, per_sm in sweep:

                def config(cols, es, smem=None, warps=warps, stages=stages, per_sm=per_sm):
                    cfg = dict(base(cols, es, smem), num_warps=warps)
                    if stages:
                        cfg["NUM_STAGES"] = stages
                    if per_sm != -2:
                        cfg["PERSISTENT"] = per_sm >= 0
                    return cfg

                def grid(x2, out2, cfg, log, per_sm=per_sm):
                    return per_sm * n_sm if per_sm > 0 else programs(x2, out2, cfg, log)

                sm._rows_config, sm._persistent_programs = config, grid
                sm._ROWS_PLANS.clear()  # plans are cached per shape: drop the last variant's
                kind = {0: "occupancy", -1: "a row each", -2: "lib"}.get(per_sm, per_sm)
                name = f"on-chip kernel, {warps} warps, stages {stages or 'lib'}, grid {kind}"
                show(name, us_of(fused), rel_err(fused(), ref))
        finally:
            sm._rows_config, sm._persistent_programs = base, programs
            sm._ROWS_PLANS.clear()
    show("fuseml CUDA twin", us_of(lambda: op(x, backend="cuda")))
    if sm._split_config(x):
        # The split kernel's row counters from the slab (left at zero by each launch) or
        # zeroed per call (a memset launch before each), interleaved over 3 rounds
        try:
            for r, knob in itertools.product(range(3), ("slab", "zeros")):
                os.environ["FUSEML_SOFTMAX_COUNTERS"] = knob
                show(f"library split, counters {knob} (round {r})", us_of(fused))
        finally:
            os.environ.pop("FUSEML_SOFTMAX_COUNTERS", None)
    if sm._split_config(x):
        # 16-bit x held as int32 pairs through the wait (SPLIT_PAIRS) or as float32,
        # interleaved over 3 rounds, each checked against torch
        pairs = sm.SPLIT_PAIRS
        try:
            for r, on in itertools.product(range(3), (False, True)):
                sm.SPLIT_PAIRS = on
                show(
                    f"library split, pairs {int(on)} (round {r})",
                    us_of(fused),
                    rel_err(fused(), ref),
                )
        finally:
            sm.SPLIT_PAIRS = pairs
        show_registers()
    if os.environ.get("PROBE_SPLIT") == "none":
        return
    names = ("MAX_ONCHIP_COLS", "SPLIT_BLOCK", "SPLIT_MAX_BLOCK", "SPLIT_COLS_PER_WARP")
    saved = {name: getattr(sm, name) for name in (*names, "SPLIT_BALANCED", "SPLIT_HALF_GAIN")}
    try:
        # The split-row kernel: PROBE_SPLIT="block:cols_per_warp,..." (columns a program)
        sm.MAX_ONCHIP_COLS = 1024
        sm.SPLIT_HALF_GAIN = 2.0  # the block swept, never halved
        sweep = env_sweep("PROBE_SPLIT") or [
            (2048, 512), (2048, 1024), (4096, 512), (4096, 1024), (8192, 1024), (16384, 1024)
        ]  # fmt: skip
        # balanced: equal chunks per row
        for (block, per_warp), balanced in itertools.product(sweep, (False, True)):
            sm.SPLIT_BLOCK, sm.SPLIT_COLS_PER_WARP = block, per_warp
            sm.SPLIT_MAX_BLOCK = max(block, saved["SPLIT_MAX_BLOCK"])
            sm.SPLIT_BALANCED = balanced
            if not sm._split_config(x):
                continue
            err = rel_err(fused(), ref)
            name = f"split block={block} warps={block // per_warp} balanced={int(balanced)}"
            show(f"{name} ({sm._split_config(x)})", us_of(fused), err)
        show_registers()
    finally:
        for name, value in saved.items():
            setattr(sm, name, value)
    if os.environ.get("PROBE_ONLINE") == "none":
        return
    saved = (sm.MAX_ONCHIP_COLS, sm.ONLINE_BLOCK, sm.ONLINE_WARPS, sm.ONLINE_PER_SM)
    split_max = sm.SPLIT_MAX_CHUNKS
    try:
        sm.MAX_ONCHIP_COLS = 1024  # the online kernel at every width here
        sm.SPLIT_MAX_CHUNKS = 0
        # (per_sm 1 and 4 never beat 0 or 2 at 16384 / 32768, H100: NOTES.md).
        # PROBE_ONLINE="block:warps:per_sm,...": only those.
        sweep = env_sweep("PROBE_ONLINE") or list(
            itertools.product((4096, 8192, 16384), (8, 16, 32), (0, 2))
        )
        for block, warps, per_sm in sweep:
            sm.ONLINE_BLOCK, sm.ONLINE_WARPS, sm.ONLINE_PER_SM = block, warps, per_sm
            err = rel_err(fused(), ref)
            show(f"online block={block} warps={warps} per_sm={per_sm}", us_of(fused), err)
    finally:
        sm.MAX_ONCHIP_COLS, sm.ONLINE_BLOCK, sm.ONLINE_WARPS, sm.ONLINE_PER_SM = saved
        sm.SPLIT_MAX_CHUNKS = split_max


def main() -> None:
    m = int(os.environ.get("PROBE_M", "4096"))  # rows
    widths = [int(a) for a in sys.argv[1:]] or [16384, 32768, 50257, 65536, 262144]
    for n in widths:
        _width(n, m)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
