# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""GPU sweep of the GEMM main loop on large shapes (tuning work, not the benchmark).

    PYTHONPATH=src python scripts/probe_gemm.py [M,K,N ...]
    PYTHONPATH=src python scripts/probe_gemm.py lora [M:adapters:rank ...]   (PROBE_CAPS=124,..;
        PROBE_TRACE=1: tracebacks of failed arms)
    PYTHONPATH=src python scripts/probe_gemm.py small
    PYTHONPATH=src python scripts/probe_gemm.py cands M,K,N ...   (PROBE_EXTRA=bm-bn-bk-w-s[-t],..;
        PROBE_COLD=1: L2 flushed before each call, as the tuner times)
    PYTHONPATH=src python scripts/probe_gemm.py kernels M,K,N ...
    PYTHONPATH=src python scripts/probe_gemm.py overlap M,K,rank ...   (PROBE_MAIN, PROBE_SHRINK[_ONLY])
    PYTHONPATH=src python scripts/probe_gemm.py shrink M,K,rank[,adapters] ...
    PYTHONPATH=src python scripts/probe_gemm.py profile M,K,rank ...   (PROBE_MAIN; for ncu)
    PYTHONPATH=src python scripts/probe_gemm.py eager M,rank ...
    PYTHONPATH=src python scripts/probe_gemm.py timeline M,adapters,rank ...
    PYTHONPATH=src python scripts/probe_gemm.py expand M,adapters,rank ...   (PROBE_MAINS)

For each shape (default 4096,4096,4096 and 4096,4096,11008; bf16, bias + GELU-tanh):
cuBLAS (F.linear + gelu, and cuBLASLt's fused epilogue), then every large-tile candidate
of the pointer kernel and the first four of the persistent TMA kernel, with and without
`flatten` and warp specialisation of its tile loop. GPU time per call from CUDA-graph
replays; TFLOP/s; ratio to the best cuBLAS arm. Variants that fail to compile are listed
with their error and skipped. `lora`: the fused LoRA layer per mode (see lora_sweep) next to
the merged weight and fuseml's plain linear, with the tuned configs.
`small`: M = 1 / 16 / 64 (weight-read bound), a wider tile sweep than the tuner's
candidates, to choose the small-M candidate list. `cands`: every tuning candidate of a
shape. `shrink`: LoRA's shrink launch alone per candidate, and the expand mode's main
launch alone (xs given). `kernels`: the names of the kernels cuBLAS runs (torch.profiler). `overlap`: LoRA's
expand mode in parts (plain GEMM, main launch alone, shrink alone, the overlapped pair).
`profile`: a few plain / joint / overlapped launches under NVTX ranges, for a profiler.
`eager`: LoRA per eager call (host time included) in each mode an eager call could take.
`timeline`: kernel start / end times of the tuned layer in a CUDA-graph replay.
"""

from __future__ import annotations

import itertools
import os
import re
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from fuseml.ops import _elementwise as ew
from fuseml.ops import _gemm, _tune
from fuseml.testing import rel_err

DT = torch.bfloat16
GELU = ew.ACT_CODE["gelu_tanh"]


def bench_us(fn) -> float:
    """GPU us of one call of ``fn`` in CUDA-graph replays; with PROBE_COLD=1 each call
    follows an L2 flush, as the tuner times candidates (fuseml.ops._tune.gpu_time_ms): the
    conditions of the suite's rows, which a few weight sets in turn do not give where they
    fit in the L2."""
    if os.environ.get("PROBE_COLD") == "1":
        return _tune.gpu_time_ms(fn) * 1e3
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def measure(run, out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(GPU us per call, relative error) of a variant writing ``out``; raises where the
    variant cannot be built or run here."""
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    return bench_us(run), rel_err(out, ref)


def cfg_tag(cfg: dict) -> str:
    """A launch config as "bm.. bn.. bk.. w.. s.." (tile sizes, warps, stages)."""
    names = (("bm", "BLOCK_M"), ("bn", "BLOCK_N"), ("bk", "BLOCK_K"), ("w", "num_warps"))
    return " ".join(
        f"{short}{cfg[key]}" for short, key in (*names, ("s", "num_stages")) if key in cfg
    )


def time_all(results, out, ref, show) -> list[tuple[float, str]]:
    """Times each (tag, run) variant (``show(tag, us, err)`` as it goes); variants that
    cannot be built or run here are listed with their error. Sorted (us, tag) pairs."""
    timed = []
    for tag, run in results:
        try:
            us, err = measure(run, out, ref)
        except Exception as e:  # a variant this Triton / GPU cannot build or run
            print(f"  {tag:58s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        timed.append((us, tag))
        show(tag, us, err)
    return sorted(timed)


def sweep(m: int, k: int, n: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=DT)
    w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
    b = torch.randn(n, device="cuda", dtype=DT)
    out = torch.empty(m, n, device="cuda", dtype=DT)
    ref = F.gelu(F.linear(x, w, b), approximate="tanh")
    flop = 2.0 * m * n * k

    def show(name: str, us: float, best: float | None, err: str = "") -> None:
        ratio = f"{best / us:5.2f}x of best cuBLAS" if best else ""
        print(f"  {name:58s} {us:9.1f} us {flop / us / 1e6:7.1f} TFLOP/s {ratio} {err}", flush=True)

    print(f"== M={m} K={k} N={n} bf16, bias + gelu_tanh", flush=True)
    peers = {
        "cublas F.linear + gelu": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "cublasLt addmm_activation(gelu)": lambda: torch._addmm_activation(
            b, x, w.t(), use_gelu=True
        ),
    }
    times = {name: bench_us(fn) for name, fn in peers.items()}
    best = min(times.values())
    for name, us in times.items():
        show(name, us, best)
    results = []
    for cfg in _gemm._LARGE:
        tag = f"ptr {cfg_tag(cfg)}"

        def run(cfg=cfg):
            _gemm.launch_linear(out, x, w, b, None, 1.0, GELU, cfg)

        results.append((tag, run))
    for cfg, flatten, ws in itertools.product(_gemm._LARGE[:4], (False, True), (False, True)):
        tag = f"tma {cfg_tag(cfg)}"
        tag += (" flatten" if flatten else "") + (" ws" if ws else "")

        def run(cfg=cfg, flatten=flatten, ws=ws):
            _gemm._launch_tma(out, x, w, b, None, 1.0, GELU, cfg, flatten=flatten, warp_spec=ws)

        results.append((tag, run))
    timed = time_all(results, out, ref, lambda tag, us, err: show(tag, us, best, f"err={err:.1e}"))
    for us, tag in timed[:3]:
        print(f"  best: {tag} {us:.1f} us ({best / us:.2f}x of best cuBLAS)")


def lora_inputs(m: int, k: int, n: int, r: int, adapters: int = 0) -> tuple:
    """(x, W, bias, A, B) of a bf16 LoRA layer; ``adapters`` > 0: A and B stacked over that
    many adapters of rank r (peft layouts, a leading adapter dim)."""
    x = torch.randn(m, k, device="cuda", dtype=DT)
    w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
    b = torch.randn(n, device="cuda", dtype=DT)
    lead = (adapters,) if adapters else ()
    a = torch.randn(*lead, r, k, device="cuda", dtype=DT) / k**0.5
    bb = torch.randn(*lead, n, r, device="cuda", dtype=DT) / r**0.5
    return x, w, b, a, bb


def lora_sweep(k: int = 4096, n: int = 4096, shapes: str = "") -> None:
    """LoRA against the merged weight and fuseml's own plain linear of the same shape, per
    mode: the default (with PDL on Hopper: the expand mode, its main launch overlapping the
    shrink), the expand mode with the overlap switched off (launches in stream order), and
    FUSEML_PDL=0 (in-loop up to IN_LOOP_MAX_M rows). First call of each arm tunes; the
    configs it chose are listed. ``shapes``: "M:adapters:rank,..." (adapters 0: single);
    PROBE_ARMS: a regex of the arms to run beside the merged weight's; PROBE_CAPS: the
    overlapped pair again with every persistent grid capped at each of these (does the
    main launch wait for SMs its shrink holds?)."""
    import fuseml
    from fuseml.ops import _tune
    from fuseml.ops import lora as lora_mod

    todo = [tuple(int(v) for v in t.split(":")) for t in shapes.split(",") if t] or [
        (1, 0, 16), (16, 0, 16), (64, 0, 16), (256, 0, 16), (1024, 0, 16), (1, 0, 64),
        (256, 0, 64), (4096, 0, 16), (4096, 0, 64), (1024, 16, 16),
    ]  # fmt: skip
    launch = _gemm.launch_linear

    def no_overlap(*a, **kw):  # the expand mode's two launches, in plain stream order
        kw["pdl"] = False
        return launch(*a, **kw)

    nsets = int(os.environ.get("PROBE_SETS", "1"))  # > 1: weights rotate (L2-cold, as
    # the suite's graph rows); the time shown is per call
    for m, adapters, r in todo:
        sets = []
        for _ in range(nsets):
            x, w, b, a, bb = lora_inputs(m, k, n, r, adapters)
            merged_w = w + 2.0 * (bb @ a) if not adapters else w
            sets.append((x, w, b, a, bb, merged_w))
        ids = torch.randint(0, adapters, (m,), device="cuda") if adapters else None
        x, w, b, a, bb, _ = sets[-1]
        ref = lora_mod.lora_linear_ref(x, w, b, a, bb, 2.0, "relu", ids)
        print(f"== LoRA M={m} K={k} N={n} rank {r} adapters {adapters or 1}, bf16, relu, "
              f"{nsets} weight set(s)")  # fmt: skip

        def each(call):
            def run():
                for s in sets:
                    out = call(*s)
                return out

            return run

        fused = each(
            lambda x, w, b, a, bb, _m: fuseml.ops.lora_linear(
                x, w, b, a, bb, 2.0, "relu", adapter_ids=ids, check_ids=False
            )
        )

        def variant(env=None, patch=None, mode=None):
            def run():
                saved = os.environ.get("FUSEML_PDL")
                tuned_mode = lora_mod._tuned_mode
                if env is not None:
                    os.environ["FUSEML_PDL"] = env
                if patch is not None:
                    _gemm.launch_linear = patch
                if mode is not None:
                    lora_mod._tuned_mode = lambda *a, **kw: mode
                try:
                    return fused()
                finally:
                    _gemm.launch_linear = launch
                    lora_mod._tuned_mode = tuned_mode
                    if saved is None:
                        os.environ.pop("FUSEML_PDL", None)
                    else:
                        os.environ["FUSEML_PDL"] = saved

            return run

        def zeroed(run):  # the joint launch's counters zeroed by a memset per call
            def zeroed_run():
                os.environ["FUSEML_JOINT_FLAGS"] = "zeros"
                try:
                    return run()
                finally:
                    os.environ.pop("FUSEML_JOINT_FLAGS")

            return zeroed_run

        def capped(cap):  # the overlapped pair with every persistent grid at most `cap`
            def run():
                saved = _gemm.persistent_programs
                _gemm.persistent_programs = lambda t: cap
                try:
                    return variant(mode=_gemm.LORA_EXPAND)()
                finally:
                    _gemm.persistent_programs = saved

            return run

        caps = [int(v) for v in os.environ.get("PROBE_CAPS", "").split(",") if v]
        arms = {
            "merged weight, cuBLAS (+ relu)": each(
                lambda x, w, b, a, bb, mw: torch.relu(F.linear(x, mw, b))
            ),
            "fuseml.ops.linear, no adapter": each(
                lambda x, w, b, a, bb, mw: fuseml.ops.linear(x, mw, b, "relu")
            ),
            "fused (default: tuned mode)": fused,
            "fused, expand + PDL": variant(mode=_gemm.LORA_EXPAND),
            **{f"fused, expand + PDL, grids <= {c}": capped(c) for c in caps},
            "fused, joint (one launch)": variant(mode=_gemm.LORA_JOINT),
            "fused, spread (one launch, one wave)": variant(mode=_gemm.LORA_SPREAD),
            "fused, joint, flags zeroed per call": zeroed(variant(mode=_gemm.LORA_JOINT)),
            "fused, expand in stream order": variant(patch=no_overlap, mode=_gemm.LORA_EXPAND),
            "fused, FUSEML_PDL=0 (in-loop)": variant(env="0"),
        }
        only = os.environ.get("PROBE_ARMS")  # a regex of arm names (merged always runs)
        base = None
        for name, fn in arms.items():
            if only and base is not None and not re.search(only, name):
                continue
            try:
                before = set(_tune._memo)
                got = fn()
                torch.cuda.synchronize()
                err = f" err={rel_err(got, ref):.1e}" if name.startswith("fused") else ""
                us = bench_us(fn) / nsets
                base = base or us
                print(f"  {name:40s} {us:8.1f} us {us / base:5.2f}x merged{err}", flush=True)
                for key in set(_tune._memo) - before:
                    print(f"      config {key}: {_tune._memo[key]}")
            except Exception as e:
                print(f"  {name:40s} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
                if os.environ.get("PROBE_TRACE") == "1":
                    import traceback

                    traceback.print_exc()


def small_sweep(k: int = 4096, n: int = 4096) -> None:
    """Decode-like rows (M = 1, 16, 64): a config sweep wider than the tuner's candidates,
    pointer and TMA kernels, against cuBLAS. These shapes are bound by the weight read
    (k x n x 2 bytes), so GB/s of W is the number that matters."""
    import itertools

    for m in (1, 16, 64):
        x = torch.randn(m, k, device="cuda", dtype=DT)
        w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
        b = torch.randn(n, device="cuda", dtype=DT)
        out = torch.empty(m, n, device="cuda", dtype=DT)
        ref = torch.relu(F.linear(x, w, b))
        w_bytes = w.numel() * w.element_size()
        print(f"== M={m} K={k} N={n} bf16 + bias + relu (weights {w_bytes / 2**20:.0f} MiB)")
        timed = []
        for name, fn in (
            ("cublas F.linear + relu", lambda: torch.relu(F.linear(x, w, b))),
            ("cublasLt addmm_activation", lambda: torch._addmm_activation(b, x, w.t())),
        ):
            us = bench_us(fn)
            timed.append((us, name))
            print(f"  {name:50s} {us:8.1f} us {w_bytes / us / 1e3:7.0f} GB/s of W")
        best_peer = min(timed)[0]
        bm = max(16, triton.next_power_of_2(m))
        for bn, bk, warps, stages, tma in itertools.product(
            (16, 32, 64), (256, 512), (4,), (3, 5), (False, True)
        ):
            cfg = _gemm._cfg(bm, bn, bk, warps, stages)
            tag = f"{'tma' if tma else 'ptr'} bn{bn} bk{bk} w{warps} s{stages}"

            def run(cfg=cfg, tma=tma):
                _gemm.launch_linear(out, x, w, b, None, 1.0, 1, cfg, tma=tma)

            try:
                us, err = measure(run, out, ref)
            except Exception as e:  # shared memory, box sizes: not buildable here
                print(f"  {tag:50s} failed: {type(e).__name__}")
                continue
            timed.append((us, tag))
            print(f"  {tag:50s} {us:8.1f} us {w_bytes / us / 1e3:7.0f} GB/s of W "
                  f"{best_peer / us:5.2f}x best cuBLAS err={err:.1e}", flush=True)  # fmt: skip
        for us, tag in sorted(timed)[:4]:
            print(f"  best: {tag} {us:.1f} us ({best_peer / us:.2f}x of best cuBLAS)")


def candidate_sweep(m: int, k: int, n: int) -> None:
    """Every tuning candidate of (M, K, N) (LOOP_TUNED: pointer and TMA kernels) against
    cuBLAS. One weight set (L2-warm where W fits, an optimistic figure for both), or
    PROBE_SETS of them in turn (L2-cold, as the suite's graph rows; the time is per call).
    PROBE_EXTRA="bm-bn-bk-warps-stages[-t],...": more configs (-t: the TMA kernel)."""
    nsets = int(os.environ.get("PROBE_SETS", "1"))
    sets = []
    for _ in range(nsets):
        x = torch.randn(m, k, device="cuda", dtype=DT)
        w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
        b = torch.randn(n, device="cuda", dtype=DT)
        sets.append((x, w, b))
    out = torch.empty(m, n, device="cuda", dtype=DT)
    ref = F.gelu(F.linear(*sets[-1]), approximate="tanh")
    print(f"== candidates M={m} K={k} N={n} bf16, bias + gelu_tanh, {nsets} set(s)", flush=True)

    def cublas_run():
        for xs, ws, bs in sets:
            F.gelu(F.linear(xs, ws, bs), approximate="tanh")

    cublas = bench_us(cublas_run) / nsets
    print(f"  {'cublas F.linear + gelu':58s} {cublas:9.1f} us", flush=True)
    results = []
    cfgs = _gemm.candidates(m, n, k, DT, _gemm.LOOP_TUNED, plain=True)
    for spec in filter(None, os.environ.get("PROBE_EXTRA", "").split(",")):
        fields = spec.split("-")
        cfg = _gemm._cfg(*(int(v) for v in fields[:5]))  # bm-bn-bk-warps-stages
        if fields[5:] == ["t"]:
            cfg["TMA"] = True
        cfgs.append(cfg)
    for cfg in cfgs:
        tma = cfg.get("TMA", False)

        def run(cfg=cfg, tma=tma):
            for xs, ws, bs in sets:
                _gemm.launch_linear(out, xs, ws, bs, None, 1.0, GELU, cfg, tma=tma)

        tag = "tma" if tma else f"stream x{cfg['STREAM']}" if cfg.get("STREAM") else "ptr"
        tag += f" {cfg_tag(cfg)}"
        results.append((tag, run))

    def show(tag, us, err):
        us /= nsets
        print(f"  {tag:58s} {us:9.1f} us {us / cublas:5.2f}x cuBLAS err={err:.1e}", flush=True)

    for us, tag in time_all(results, out, ref, show)[:3]:
        us /= nsets
        print(f"  best: {tag} {us:.1f} us ({us / cublas:.2f}x cuBLAS)")


def tma_tile(spec: str) -> dict:
    """A TMA-kernel config from "bm-bn-bk-warps-stages"."""
    return dict(_gemm._cfg(*(int(v) for v in spec.split("-"))), TMA=True)


def lora_parts(m: int, k: int, r: int, small_tile: str):
    """(n, 3 rotating input sets, xs and out buffers, the main tile PROBE_MAIN names, else
    ``small_tile`` up to 256 rows and 128 x 256 x 64 above) for the probes that run LoRA's
    launches in parts."""
    n = 4096
    xs = torch.empty(m, r, device="cuda", dtype=DT)
    out = torch.empty(m, n, device="cuda", dtype=DT)
    spec = os.environ.get("PROBE_MAIN", small_tile if m <= 256 else "128-256-64-8-3")
    return n, lora_sets(m, k, n, r), xs, out, tma_tile(spec)


def overlap_sweep(m: int, k: int, r: int) -> None:
    """LoRA's expand mode in parts, x and weights rotating over 3 sets: the plain GEMM and
    the expand main launch alone (xs given) on the tile PROBE_MAIN names (bm-bn-bk-w-s,
    TMA kernel), then for each shrink tile (the tuner's candidates and PROBE_SHRINK extras)
    the shrink alone and the shrink + main pair as the fused layer runs them in a graph
    (programmatic dependent launch): where the adapter's cost goes."""
    n, sets, xs, out, main_cfg = lora_parts(m, k, r, "64-128-128-4-4")
    x, _a, w, bb, b, xs_ref = sets[-1]
    ref = torch.relu(F.linear(x, w, b) + xs_ref @ bb.t())
    print(f"== overlap M={m} K={k} N={n} rank {r}, main tile {cfg_tag(main_cfg)}", flush=True)

    def show(tag, us, err):
        print(f"  {tag:64s} {us / 3:9.1f} us/call err={err:.1e}", flush=True)

    def merged():
        for x, _a, w, _bb, b, _xs in sets:
            F.linear(x, w, b)

    print(f"  {'cuBLAS F.linear (the merged arm, no activation)':64s} "
          f"{bench_us(merged) / 3:9.1f} us/call", flush=True)  # fmt: skip

    def plain():
        for x, _a, w, _bb, b, _xs in sets:
            _gemm.launch_linear(out, x, w, b, None, 1.0, 1, main_cfg, tma=True)

    def main_alone():
        for x, _a, w, bb, b, xs_ref in sets:
            _gemm.launch_linear(
                out, x, w, b, None, 1.0, 1, main_cfg, lora=_gemm.LORA_EXPAND, lora_b=bb,
                xa=xs_ref, lora_scale=2.0, rank=r, tma=True,
            )  # fmt: skip

    time_all([("plain GEMM + bias + ReLU", plain)], out, F.relu(F.linear(x, w, b)), show)
    time_all([("expand main alone (xs given)", main_alone)], out, ref, show)
    shrink_cfgs = [c for c in _gemm.candidates(m, r, k, DT, _gemm.LOOP_TUNED) if c.get("TMA")]
    if os.environ.get("PROBE_SHRINK_ONLY") == "1":  # only the PROBE_SHRINK tiles
        shrink_cfgs = []
    for spec in filter(None, os.environ.get("PROBE_SHRINK", "").split(",")):
        shrink_cfgs.append(tma_tile(spec))
    for cfg in shrink_cfgs:
        tag = f"{cfg_tag(cfg)} ({_gemm.cdiv(m, cfg['BLOCK_M'])} programs)"

        def shrink(cfg=cfg):
            for x, a, _w, _bb, _b, _xs in sets:
                _gemm.launch_linear(
                    xs, x, a, None, None, 1.0, 0, cfg, lora=_gemm.LORA_SHRINK, lora_scale=2.0,
                    rank=r, tma=True,
                )  # fmt: skip

        def pair(cfg=cfg):
            for x, a, w, bb, b, _xs in sets:
                _gemm.launch_linear(
                    xs, x, a, None, None, 1.0, 0, cfg, lora=_gemm.LORA_SHRINK, lora_scale=2.0,
                    rank=r, tma=True, pdl=True,
                )  # fmt: skip
                _gemm.launch_linear(
                    out, x, w, b, None, 1.0, 1, main_cfg, lora=_gemm.LORA_EXPAND, lora_b=bb,
                    xa=xs, lora_scale=2.0, rank=r, tma=True, pdl=True,
                )  # fmt: skip

        time_all([(f"shrink alone {tag}", shrink)], xs, xs_ref, show)
        time_all([(f"shrink + main, PDL: {tag}", pair)], out, ref, show)


def cublas_kernels(shapes: list[tuple[int, int, int]]) -> None:
    """The kernels cuBLAS runs for F.linear at each (M, K, N), bf16 (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=DT)
        w = torch.randn(n, k, device="cuda", dtype=DT)
        b = torch.randn(n, device="cuda", dtype=DT)
        F.linear(x, w, b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.linear(x, w, b)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"== cuBLAS kernels, F.linear M={m} K={k} N={n} bf16: {names}", flush=True)


def lora_sets(m: int, k: int, n: int, r: int, count: int = 3) -> list[tuple]:
    """``count`` input sets (x, A, W, B, bias, xs = 2 x A^T in bf16) of a rank-r layer."""
    sets = []
    for _ in range(count):
        x = torch.randn(m, k, device="cuda", dtype=DT)
        a = torch.randn(r, k, device="cuda", dtype=DT) / k**0.5
        w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
        bb = torch.randn(n, r, device="cuda", dtype=DT) / r**0.5
        b = torch.randn(n, device="cuda", dtype=DT)
        sets.append((x, a, w, bb, b, (2.0 * (x @ a.t())).to(DT)))
    return sets


def profile_target(m: int, k: int, r: int) -> None:
    """A few launches for a profiler (``ncu --nvtx --nvtx-include 'joint/'``, say): the
    plain GEMM, the joint LoRA launch and the overlapped pair, each under its own NVTX
    range, on the tile PROBE_MAIN names (TMA kernel; no tuning), weights rotating over 3
    sets; each variant runs 3 rounds (the first compiles) and is checked once."""
    n, sets, xs, out, cfg = lora_parts(m, k, r, "64-128-64-4-8")
    shrink_cfg = dict(
        _gemm._cfg(min(64, 1 << (max(16, m) - 1).bit_length()), 16, 256, 4, 4), TMA=True
    )

    def plain(x, a, w, bb, b):
        _gemm.launch_linear(out, x, w, b, None, 1.0, 1, cfg, tma=True)

    def joint(x, a, w, bb, b):
        _gemm.launch_linear(
            out, x, w, b, None, 1.0, 1, cfg, lora=_gemm.LORA_JOINT, lora_a=a, lora_b=bb,
            lora_scale=2.0, rank=r, tma=True,
        )  # fmt: skip

    def pair(x, a, w, bb, b):
        _gemm.launch_linear(
            xs, x, a, None, None, 1.0, 0, shrink_cfg, lora=_gemm.LORA_SHRINK, lora_scale=2.0,
            rank=r, tma=True, pdl=True,
        )  # fmt: skip
        _gemm.launch_linear(
            out, x, w, b, None, 1.0, 1, cfg, lora=_gemm.LORA_EXPAND, lora_b=bb, xa=xs,
            lora_scale=2.0, rank=r, tma=True, pdl=True,
        )  # fmt: skip

    print(f"== profile target M={m} K={k} N={n} rank {r}, tile {cfg_tag(cfg)}", flush=True)
    for name, fn in (("plain", plain), ("joint", joint), ("pair", pair)):
        for i in range(3):
            with torch.cuda.nvtx.range(f"{name}/{i}"):
                for x, a, w, bb, b, _xs in sets:
                    fn(x, a, w, bb, b)
            torch.cuda.synchronize()
        x, a, w, bb, b, xs_ref = sets[-1]
        ref = F.linear(x, w, b) if name == "plain" else F.linear(x, w, b) + xs_ref @ bb.t()
        print(f"  {name:6s} err={rel_err(out, torch.relu(ref)):.1e}", flush=True)


def shrink_sweep(m: int, k: int, r: int, adapters: int = 0) -> None:
    """LoRA's shrink launch alone (xs = 2 * x @ A^T in x's dtype, the first launch of the
    expand mode) for every tuning candidate, and the expand mode's main launch alone (xs
    given, no overlap) for the TMA candidates, with x and the weights rotating over 3 sets.
    ``adapters`` > 0: r is the stacked width of that many adapters in a mixed batch (random
    ids), and the segmented shrink's configs are timed too."""
    n = 4096
    sets = lora_sets(m, k, n, r)
    xs = torch.empty(m, r, device="cuda", dtype=DT)
    out = torch.empty(m, n, device="cuda", dtype=DT)
    rank = r // adapters if adapters else r
    ids = torch.randint(0, adapters, (m,), device="cuda") if adapters else None
    print(f"== shrink M={m} K={k} stacked columns {r}, adapters {adapters or 1} (3 sets)")
    results = []
    segments = _gemm.SEGMENT_CONFIGS if adapters > 1 else []
    for cfg in _gemm.candidates(m, r, k, DT, _gemm.LOOP_TUNED) + segments:
        tma = cfg.get("TMA", False)

        def run(cfg=cfg, tma=tma):
            for x, a, _w, _bb, _b, _xs in sets:
                if cfg.get("SEGMENTS"):
                    _gemm.launch_shrink_segments(xs, x, a, ids, None, 2.0, rank, cfg)
                    continue
                _gemm.launch_linear(
                    xs, x, a, None, None, 1.0, 0, cfg, lora=_gemm.LORA_SHRINK, ids=ids,
                    lora_scale=2.0, rank=rank, tma=tma,
                )  # fmt: skip

        kind = "segments" if cfg.get("SEGMENTS") else "tma" if tma else "ptr"
        results.append((f"shrink {kind} {cfg_tag(cfg)}", run))

    def show(tag, us, err):
        print(f"  {tag:58s} {us / 3:9.1f} us/call err={err:.1e}", flush=True)

    want = sets[-1][5]
    if adapters:
        owner = torch.arange(r, device="cuda") // rank
        want = torch.where(ids[:, None] == owner[None, :], want, 0)
    time_all(results, xs, want, show)
    if adapters:
        return
    ref = torch.relu(
        F.linear(sets[-1][0], sets[-1][2], sets[-1][4]) + sets[-1][5] @ sets[-1][3].t()
    )
    results = []
    # (from TMA_MIN_M rows every candidate takes the TMA kernel: LOOP_TMA, no flag)
    tuned = [c for c in _gemm.candidates(m, n, k, DT, _gemm.LOOP_TUNED) if c.get("TMA")]
    for cfg in tuned or _gemm.candidates(m, n, k, DT, _gemm.LOOP_TMA):

        def run(cfg=cfg):
            for x, _a, w, bb, b, xs_ref in sets:
                _gemm.launch_linear(
                    out, x, w, b, None, 1.0, 1, cfg, lora=_gemm.LORA_EXPAND, lora_b=bb,
                    xa=xs_ref, lora_scale=2.0, rank=r, tma=True,
                )  # fmt: skip

        results.append((f"expand main tma {cfg_tag(cfg)}", run))
    time_all(results, out, ref, show)


def eager_sweep(m: int, r: int, k: int = 4096, n: int = 4096, calls: int = 200) -> None:
    """Per eager call (host time included): ``calls`` back-to-back calls of the fused LoRA
    layer (bias, relu; weights fixed) timed by events around them, per LoRA mode the
    eager path could take (in-loop and the joint launch: one launch each; the overlapped
    pair: two), against the merged weight's F.linear + relu and fuseml's plain linear.
    Each mode is tuned by a first call (not timed)."""
    import fuseml
    from fuseml.ops import lora as lora_mod

    x, w, b, a, bb = lora_inputs(m, k, n, r)
    mw = w + 2.0 * (bb @ a)
    ref = lora_mod.lora_linear_ref(x, w, b, a, bb, 2.0, "relu")

    def fused():
        return fuseml.ops.lora_linear(x, w, b, a, bb, 2.0, "relu")

    def forced(mode):  # the eager call takes `mode` (capturing() is what keeps it in-loop)
        def run():
            saved = lora_mod.capturing, lora_mod._tuned_mode
            lora_mod.capturing = lambda t: True
            lora_mod._tuned_mode = lambda *a_, **k_: mode
            try:
                return fused()
            finally:
                lora_mod.capturing, lora_mod._tuned_mode = saved

        return run

    arms = {
        "merged weight, F.linear + relu": lambda: torch.relu(F.linear(x, mw, b)),
        "fuseml.ops.linear, no adapter": lambda: fuseml.ops.linear(x, mw, b, "relu"),
        "fused, as eager calls run now": fused,
        "fused, in-loop (forced)": forced(_gemm.LORA_IN_LOOP),
        "fused, joint (forced)": forced(_gemm.LORA_JOINT),
        "fused, expand + PDL (forced)": forced(_gemm.LORA_EXPAND),
    }
    print(f"== eager calls, LoRA M={m} K={k} N={n} rank {r}, bf16, relu, {calls} calls")
    for name, fn in arms.items():
        try:
            got = fn()
            torch.cuda.synchronize()
            err = f" err={rel_err(got, ref):.1e}" if name.startswith("fused") else ""
            for _ in range(10):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            print(f"  {name:36s} {start.elapsed_time(end) * 1e3 / calls:8.1f} us/call{err}")
        except Exception as e:
            print(f"  {name:36s} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}")


def timeline(m: int, adapters: int, r: int, k: int = 4096, n: int = 4096) -> None:
    """Kernel start / end times of the tuned fused LoRA layer inside a CUDA-graph replay
    (torch.profiler's CUDA activity, which CUPTI records per graph node), 3 replays, us from
    each replay's first kernel: does the overlapped pair's main launch start while the
    shrink runs, and when does the shrink end? ``adapters`` 0: a single adapter of rank r;
    else a mixed batch of that many adapters of rank r (random ids). Eager first call tunes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import fuseml

    x, w, b, a, bb = lora_inputs(m, k, n, r, adapters)
    ids = torch.randint(0, adapters, (m,), device="cuda") if adapters else None

    def call():
        return fuseml.ops.lora_linear(x, w, b, a, bb, 2.0, "relu", adapter_ids=ids, check_ids=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # tunes
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    print(f"== timeline M={m} adapters {adapters or 1} rank {r} K={k} N={n} (graph replay)")
    t0 = last_end = None
    for start, end, name in kernels:
        if last_end is None or start - last_end > 20:  # a new replay
            t0 = start
            print("  --")
        print(f"  {start - t0:7.1f} .. {end - t0:7.1f} us  ({end - start:6.1f})  {name[:70]}")
        last_end = end if last_end is None else max(last_end, end)


def sustained(m: int, k: int, n: int, calls: int = 60) -> None:
    """Short against sustained timing of one large layer (bias + GELU-tanh, bf16): cuBLASLt's
    fused epilogue and fuseml's tuned linear, each timed as the tuner times (a 3 ms graph
    replay), then over ``calls`` back-to-back calls with events around each (as the suite's
    events rows), first five against the last half. Run with nvidia-smi sampling clocks and
    power beside it to see whether a long kernel runs at lower clocks than a short timing
    finds."""
    import fuseml

    x = torch.randn(m, k, device="cuda", dtype=DT)
    w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
    b = torch.randn(n, device="cuda", dtype=DT)
    arms = {
        "cublaslt": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
        "fuseml": lambda: fuseml.ops.linear(x, w, b, "gelu_tanh", backend="triton"),
    }
    flop = 2.0 * m * n * k
    print(f"== sustained M={m} K={k} N={n} bf16, bias + gelu_tanh", flush=True)
    for name, fn in (*arms.items(), *arms.items()):
        fn()
        torch.cuda.synchronize()
        short = triton.testing.do_bench_cudagraph(fn, rep=3) * 1e3
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(calls)
        ]
        for start, end in ev:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        us = [s.elapsed_time(e) * 1e3 for s, e in ev]
        first = sorted(us[:5])[2]
        last = sorted(us[calls // 2 :])[len(us[calls // 2 :]) // 2]
        print(
            f"  {name:10s} short {short:9.1f} us ({flop / short / 1e6:5.0f} TFLOP/s)  "
            f"sustained first5 {first:9.1f}  last half {last:9.1f} us "
            f"({flop / last / 1e6:5.0f} TFLOP/s)",
            flush=True,
        )
    for key, cfg in _tune._memo.items():
        print(f"  tuned: {key[0]} {key[3:6]} -> {cfg}")


def expand_sweep(m: int, adapters: int, r: int, k: int = 4096, n: int = 4096) -> None:
    """The expand mode's main launch alone (xs given, no shrink, no PDL), weights rotating
    over 3 sets, on each tile of PROBE_MAINS (bm-bn-bk-w-s,..): the plain GEMM, one
    adapter of rank r (one xs @ B^T step), ``adapters`` adapters with B stacked (N,
    adapters * r) (steps of 64 columns) and with B read in place as (adapters, N, r)
    (steps of r columns), each with FUSEML_EXPAND_STAGES_MAX at 2 and 8: what the stacked
    columns cost the main launch, and whether it is their step count."""
    specs = os.environ.get("PROBE_MAINS", "64-128-128-4-4,64-128-64-4-8,128-128-64-4-4")
    big = adapters * r
    sets = []
    for _ in range(3):
        x = torch.randn(m, k, device="cuda", dtype=DT)
        w = torch.randn(n, k, device="cuda", dtype=DT) / k**0.5
        b = torch.randn(n, device="cuda", dtype=DT)
        b3 = torch.randn(adapters, n, r, device="cuda", dtype=DT) / r**0.5
        ids = torch.randint(0, adapters, (m,), device="cuda")
        xs = torch.randn(m, big, device="cuda", dtype=DT)
        owner = torch.arange(big, device="cuda") // r
        xs = torch.where(ids[:, None] == owner[None, :], xs, 0).contiguous()
        stacked = b3.permute(1, 0, 2).reshape(n, big).contiguous()
        one = (xs[:, :r].contiguous(), stacked[:, :r].contiguous())
        sets.append((x, w, b, b3, stacked, xs, *one))
    out = torch.empty(m, n, device="cuda", dtype=DT)
    x, w, b, b3, stacked, xs, xs1, b1 = sets[-1]
    base = F.linear(x, w, b)
    refs = {
        "plain": torch.relu(base),
        "one": torch.relu(base + xs1 @ b1.t()),
        "many": torch.relu(base + xs @ stacked.t()),
    }
    print(f"== expand main alone M={m} K={k} N={n} {adapters} adapters x rank {r} (3 sets)")

    def show(tag, us, err):
        print(f"  {tag:64s} {us / 3:9.1f} us/call err={err:.1e}", flush=True)

    for spec in specs.split(","):
        cfg = tma_tile(spec)

        def run(kind, cfg=cfg):
            def go():
                for x, w, b, b3, stacked, xs, xs1, b1 in sets:
                    if kind == "plain":
                        _gemm.launch_linear(out, x, w, b, None, 1.0, 1, cfg, tma=True)
                        continue
                    bb, xa, rank = {
                        "one": (b1, xs1, r), "stacked": (stacked, xs, big), "b3d": (b3, xs, r),
                    }[kind]  # fmt: skip
                    _gemm.launch_linear(
                        out, x, w, b, None, 1.0, 1, cfg, lora=_gemm.LORA_EXPAND, lora_b=bb,
                        xa=xa, lora_scale=1.0, rank=rank, tma=True,
                    )  # fmt: skip

            return go

        time_all([(f"{spec} plain GEMM", run("plain"))], out, refs["plain"], show)
        time_all([(f"{spec} one adapter", run("one"))], out, refs["one"], show)
        for stages in ("2", "8"):
            os.environ["FUSEML_EXPAND_STAGES_MAX"] = stages
            for kind in ("stacked", "b3d"):
                tag = f"{spec} {adapters} adapters, B {kind}, expand buffers <= {stages}"
                time_all([(tag, run(kind))], out, refs["many"], show)
        os.environ.pop("FUSEML_EXPAND_STAGES_MAX", None)


# Subcommands run once per "a,b,..." argument, with those integers as arguments
PER_SHAPE = {
    "timeline": timeline,
    "eager": eager_sweep,
    "shrink": shrink_sweep,
    "profile": profile_target,
    "overlap": overlap_sweep,
    "cands": candidate_sweep,
    "sustained": sustained,
    "expand": expand_sweep,
}


def main() -> None:
    run = PER_SHAPE.get(sys.argv[1]) if sys.argv[1:] else None
    if run is not None:
        for a in sys.argv[2:]:
            run(*(int(v) for v in a.split(",")))
        return
    if sys.argv[1:2] == ["kernels"]:
        cublas_kernels([tuple(int(v) for v in a.split(",")) for a in sys.argv[2:]])
        return
    if sys.argv[1:2] == ["lora"]:
        lora_sweep(shapes=",".join(sys.argv[2:]))
        return
    if sys.argv[1:] == ["small"]:
        small_sweep()
        return
    shapes = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or [
        (4096, 4096, 4096),
        (4096, 4096, 11008),
    ]
    for m, k, n in shapes:
        sweep(m, k, n)


if __name__ == "__main__":
    main()
