"""GPU sweep of launch configs at the launch-bound sizes where a suite row trails a peer:
flat add at 1M elements (elementwise suite) and short softmax rows at 4096 x 128 / 1000 /
1024 (softmax suite), timed as the suites time them: CUDA-graph replay (the suite's
graph_calls per graph), inputs rotating past twice the L2, median of do_bench.

    PYTHONPATH=src python scripts/probe_launch_bound.py [add] [add-asm] [softmax] [fp32] [wide] [rules] [inductor] [sweep]

Each line: the arm or config, us per call, and the output's relative error against the
first arm's. Several rounds interleave the arms (PROBE_ROUNDS, default 3), so a drift of
the board weighs on all alike; the table shows each arm's median over the rounds.
PROBE_ADD="elements:warps,..." (or PROBE_ADD_BYTES="tile bytes:warps,...") and
PROBE_ROWS="rows:warps,..." pick the Triton configs;
PROBE_CUDA=0 leaves out the softmax sweeps' CUDA-twin arm (no extension build).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

import fuseml
from fuseml.bench.harness import Settings, bench_graph_ms
from fuseml.ops import _elementwise as ew
from fuseml.ops._utils import cdiv, fast_math
from fuseml.testing import rel_err

sm = importlib.import_module("fuseml.ops.softmax")  # the module, not the op
SETTINGS = Settings.for_mode(quick=True)
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "3"))
CUDA_ARMS = os.environ.get("PROBE_CUDA", "1") == "1"  # 0: no CUDA-twin arms (no ext build)


def env_pairs(name: str, default: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in t.split(":")) for t in os.environ.get(name, default).split(",")]


def rotated(make, nbytes: int) -> list[tuple]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = min(64, math.ceil(2 * l2 / nbytes) + 1)
    return [make() for _ in range(n)]


def row_sets(n: int, dtype: torch.dtype = torch.bfloat16, m: int = 4096) -> list[tuple]:
    """Softmax inputs of (m, n) rows, enough sets to rotate past twice the L2 (x read and
    an output written each call)."""
    es = torch.empty((), dtype=dtype).element_size()
    return rotated(lambda: (3 * torch.randn(m, n, device="cuda", dtype=dtype),), 2 * m * n * es)


def softmax_ops(log: bool) -> tuple:
    """(torch's op, fuseml's op, torch.compile of torch's op along the last dim)."""
    ref = torch.log_softmax if log else torch.softmax
    fused = fuseml.ops.log_softmax if log else fuseml.ops.softmax
    return ref, fused, torch.compile(lambda x: ref(x, -1), dynamic=False)


def table(title: str, arms: dict, sets: list[tuple]) -> None:
    ref = None
    errs = {}
    for name, fn in arms.items():
        out = fn(*sets[0]).to(torch.float32, copy=True)  # arms may write one buffer
        ref = out if ref is None else ref
        errs[name] = rel_err(out, ref)
    times = {name: [] for name in arms}
    for _ in range(ROUNDS):
        for name, fn in arms.items():
            times[name].append(bench_graph_ms(fn, sets, SETTINGS)[0] * 1e3)
    print(f"== {title}")
    best = min(statistics.median(v) for v in times.values())
    for name, v in times.items():
        med = statistics.median(v)
        spread = f"{min(v):.2f}-{max(v):.2f}"
        print(f"  {name:28s} {med:7.2f} us ({spread}) {best / med:5.2f}x  err={errs[name]:.1e}")


def add_sweep(dtype: torch.dtype, numel: int = 1_000_000, op: str = "add") -> None:
    """The flat path's launch configs for ``op`` (add: x + y; gelu: erf-GELU of x) at
    ``numel`` elements, against torch and torch.compile."""
    es = torch.empty((), dtype=dtype).element_size()
    n_in = 2 if op == "add" else 1
    sets = rotated(
        lambda: tuple(torch.randn(numel, device="cuda", dtype=dtype) for _ in range(n_in)),
        (n_in + 1) * numel * es,
    )
    approx = "tanh" if op == "gelu_tanh" else "none"
    if op == "add":
        ref, fused = (lambda a, b: a + b), fuseml.ops.add
    else:
        ref = functools.partial(torch.nn.functional.gelu, approximate=approx)
        fused = functools.partial(fuseml.ops.gelu, approximate=approx)
    compiled = torch.compile(ref, dynamic=False)

    # The twin's flat pack is the library's rule unless FUSEML_EW_CUDA_FLAT_BYTES=8|16 is
    # set for the process (read once): run the probe once per value to compare them.
    pack = os.environ.get("FUSEML_EW_CUDA_FLAT_BYTES")
    arms = {
        "torch": ref,
        "compile": compiled,
        "fuseml triton (library)": lambda *t: fused(*t, backend="triton"),
        f"fuseml cuda ({f'{pack}-byte packs' if pack else 'library'})": (
            lambda *t: fused(*t, backend="cuda")
        ),
    }
    act = 0 if op == "add" else ew.ACT_CODE[op]
    pairs = env_pairs("PROBE_ADD", "512:4,1024:4,2048:4,1024:8,2048:8,4096:8,256:2")
    if os.environ.get("PROBE_ADD_BYTES"):  # "bytes:warps,...": tiles in bytes, either dtype
        pairs = [(nbytes // es, warps) for nbytes, warps in env_pairs("PROBE_ADD_BYTES", "")]
    for elems, warps in pairs:
        cfg = {"BLOCK_M": 1, "BLOCK_N": elems, "num_warps": warps, "grid": (cdiv(numel, elems),)}

        def run(a, b=None, cfg=cfg):
            out = torch.empty_like(a)
            return ew.bias_act_into(out, a, b, None, 1.0, act, config=cfg)

        arms[f"triton {elems} el / {warps} w"] = run
    table(f"{op} {str(dtype)[6:]} {numel}", arms, sets)


def rows_kernel(log: bool, rows: int, warps: int, stages: int, programs):
    """A call of the on-chip softmax kernel on (M, N) x with a given config, bypassing the
    library's choice; programs(M) gives the grid (a program each ROWS rows, or fewer: the
    kernel's programs then loop over the row blocks)."""

    def run(x):
        m, n = x.shape
        out = torch.empty_like(x)
        sm._softmax_rows_kernel[(programs(m),)](
            x, out, m, n, x.stride(0), out.stride(0),
            LOG=log, ROWS=rows, BLOCK_N=1 << (n - 1).bit_length(), NUM_STAGES=stages,
            FAST=fast_math(x), VEC=sm._rows_vec(x, out), num_warps=warps,
        )  # fmt: skip
        return out

    return run


def softmax_sweep(n: int, log: bool, rows_default: str, dtype=torch.bfloat16) -> None:
    m = 4096
    sets = row_sets(n, dtype, m)
    ref, fused, compiled = softmax_ops(log)
    arms = {
        "torch": lambda x: ref(x, -1),
        "compile": compiled,
        "fuseml triton (library)": lambda x: fused(x, -1, backend="triton"),
        "fuseml cuda": lambda x: fused(x, -1, backend="cuda"),
        "copy": lambda x: torch.empty_like(x).copy_(x),
    }
    if not CUDA_ARMS:
        del arms["fuseml cuda"]
    for rows, warps in env_pairs("PROBE_ROWS", rows_default):
        for stages in map(int, os.environ.get("PROBE_STAGES", "1,2").split(",")):
            arms[f"triton {rows} rows / {warps} w / {stages} st"] = rows_kernel(
                log, rows, warps, stages, lambda m_, rows=rows: cdiv(m_, rows)
            )
    table(f"{'log_' if log else ''}softmax {str(dtype)[6:]} {m} x {n}", arms, sets)


def rows_rule(n: int, dtype: torch.dtype, log: bool = False) -> None:
    """The library's on-chip config against candidate rules at one width: short rows as
    one 16-byte vector a thread (2 KiB of the row tile a program, 4 warps), two vectors
    (4 KiB), and one pipelining stage where each program takes one row block."""
    m = 4096
    sets = row_sets(n, dtype, m)
    fused = fuseml.ops.log_softmax if log else fuseml.ops.softmax
    base = sm._rows_config

    def with_config(rule):
        def run(x):
            sm._rows_config = rule
            sm._ROWS_PLANS.clear()
            try:
                return fused(x, -1, backend="triton")
            finally:
                sm._rows_config = base
                sm._ROWS_PLANS.clear()

        return run

    def short(tile_bytes: int, stages: int | None):
        def rule(cols, es, smem=None):
            cfg = dict(base(cols, es, smem))
            if cfg["BLOCK_N"] < 1024:
                cfg["ROWS"] = max(1, tile_bytes // (cfg["BLOCK_N"] * es))
                cfg["num_warps"] = 4
            if stages and not cfg["PERSISTENT"]:
                cfg["NUM_STAGES"] = stages
            return cfg

        return rule

    arms = {
        "torch": lambda x: (torch.log_softmax if log else torch.softmax)(x, -1),
        "fuseml cuda": lambda x: fused(x, -1, backend="cuda"),
        "library": lambda x: fused(x, -1, backend="triton"),
        "stages 1": with_config(short(0, 1)),
        "2 KiB short tiles": with_config(short(2048, None)),
        "2 KiB short tiles, stages 1": with_config(short(2048, 1)),
        "4 KiB short tiles, stages 1": with_config(short(4096, 1)),
        "copy": lambda x: torch.empty_like(x).copy_(x),
    }
    table(f"{'log_' if log else ''}softmax {str(dtype)[6:]} {m} x {n} (rules)", arms, sets)


def persistent_sweep(n: int, per_sm: list[int], warps: int, stages: list[int]) -> None:
    """The on-chip kernel on a persistent grid of per_sm programs an SM, each looping over
    rows with the next row's load pipelined (NUM_STAGES) behind the current row's math."""
    m = 4096
    sets = row_sets(n, torch.bfloat16, m)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    arms = {
        "fuseml triton (library)": lambda x: fuseml.ops.softmax(x, -1, backend="triton"),
        "copy": lambda x: torch.empty_like(x).copy_(x),
    }
    for k, st in itertools.product(per_sm, stages):
        arms[f"persistent {k}/SM, {warps} w, {st} st"] = rows_kernel(
            False, 1, warps, st, lambda m_, k=k: min(m_, k * n_sm)
        )
    table(f"softmax bf16 {m} x {n} (persistent grids)", arms, sets)


def online_arm(log: bool, block: int, warps: int, stages: int = 1, per_sm: int = 0):
    """A call of the library's online (two-read) kernel with a given config."""
    names = ("ONLINE_BLOCK", "ONLINE_WARPS", "ONLINE_STAGES", "ONLINE_PER_SM")

    def run(x):
        saved = [getattr(sm, k) for k in names]
        for k, v in zip(names, (block, warps, stages, per_sm)):
            setattr(sm, k, v)
        try:
            out = torch.empty_like(x)
            sm._launch_online(x, out, log, False)
            return out
        finally:
            for k, v in zip(names, saved):
                setattr(sm, k, v)

    return run


@triton.jit
def lane_online_kernel(x_ptr, out_ptr, n_cols, stride_xm, stride_om, LOG: tl.constexpr,
                       BLOCK: tl.constexpr, EVICT1: tl.constexpr, EVICT2: tl.constexpr):  # fmt: skip
    """A program a row, two reads: a running max and sum per lane over the row (no
    reduction across the program until the end, so no barrier a step; torch.compile's
    looped-reduction form), then the output from a second read, optionally with eviction
    hints (EVICT1 / EVICT2: "" or "evict_last" / "evict_first")."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    m = tl.full([BLOCK], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < n_cols, other=-float("inf"), eviction_policy=EVICT1)
        x = x.to(tl.float32)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    m_row = tl.max(m, axis=0)
    shift = tl.where(m_row == -float("inf"), 0.0, m_row)
    total = tl.sum(s * tl.exp(m - shift), axis=0)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        ok = offs < n_cols
        x = tl.load(x_row + offs, mask=ok, other=0.0, eviction_policy=EVICT2).to(tl.float32)
        if LOG:
            y = x - m_row - tl.log(total)
        else:
            y = tl.exp(x - m_row) / total
        tl.store(out_ptr + row * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def lane_online_arm(log: bool, block: int, warps: int, hints: bool):
    def run(x):
        out = torch.empty_like(x)
        ev1, ev2 = ("evict_last", "evict_first") if hints else ("", "")
        lane_online_kernel[(x.shape[0],)](
            x, out, x.shape[1], x.stride(0), out.stride(0),
            LOG=log, BLOCK=block, EVICT1=ev1, EVICT2=ev2, num_warps=warps,
        )  # fmt: skip
        return out

    return run


def wide_rows(n: int, log: bool, dtype=torch.float32, m: int = 4096) -> None:
    """The on-chip kernel (the library's path up to MAX_ONCHIP_COLS) against the online
    two-pass kernel (statistics in one read, the output from a second, L2-warm read) at
    one width: PROBE_ONLINE="columns:warps[:stages[:programs an SM]],..." (programs an SM
    0: one program a row), and the on-chip kernel (PROBE_ONCHIP="warps:stages[:rows a
    program[:programs an SM]],...": by default one row a program, a program per row),
    and lane_online_kernel (PROBE_LANES="columns:warps:hints,...")."""
    sets = row_sets(n, dtype, m)
    _, fused, compiled = softmax_ops(log)
    arms = {
        "fuseml triton (library)": lambda x: fused(x, -1, backend="triton"),
        "compile": compiled,
        "copy": lambda x: torch.empty_like(x).copy_(x),
    }
    for cfg in os.environ.get("PROBE_ONLINE", "2048:4,4096:8,8192:8,8192:16,16384:16").split(","):
        if cfg:
            v = [int(t) for t in cfg.split(":")]
            arms[f"online {':'.join(map(str, v))}"] = online_arm(log, *v)
    for cfg in os.environ.get("PROBE_LANES", "").split(","):
        if cfg:
            block, warps, hints = (int(t) for t in cfg.split(":"))
            name = f"lane online {block} / {warps} w{', hints' if hints else ''}"
            arms[name] = lane_online_arm(log, block, warps, bool(hints))
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in os.environ.get("PROBE_ONCHIP", "").split(","):
        if cfg:
            given = [int(t) for t in cfg.split(":")]
            warps, stages, rows, per_sm = given + [2, 3, 1, 0][len(given) :]

            def programs(m_, rows=rows, per_sm=per_sm):
                return min(cdiv(m_, rows), per_sm * n_sm) if per_sm else cdiv(m_, rows)

            grid = f"{per_sm}/SM" if per_sm else "a program"
            arms[f"on-chip {rows} rows, {grid}, {warps} w / {stages} st"] = rows_kernel(
                log, rows, warps, stages, programs
            )
    table(f"{'log_' if log else ''}softmax {str(dtype)[6:]} {m} x {n}", arms, sets)


def inductor_code(n: int, log: bool, dtype=torch.float32) -> None:
    """torch.compile's generated code for (log_)softmax over (4096, n): written to
    $PROBE_OUT (if set), its kernels' configuration lines printed."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4096, n, device="cuda", dtype=dtype)
    _, _, compiled = softmax_ops(log)
    _, codes = run_and_get_code(compiled, x)
    name = f"inductor_{'log_' if log else ''}softmax_{str(dtype)[6:]}_{n}.py"
    out = os.environ.get("PROBE_OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            f.write("\n\n".join(codes))
    print(f"== {name}")
    keys = (
        "@triton_heuristics",
        "def triton_",
        "num_warps",
        "R0_BLOCK",
        "RBLOCK",
        "XBLOCK",
        "triton_meta",
        ".run(",
        "for r0_offset",
        "for roffset",
    )
    for line in "\n".join(codes).splitlines():
        if any(k in line for k in keys):
            print("  " + line.strip()[:200])


def add_asm(dtype: torch.dtype, numel: int = 1_000_000) -> None:
    """torch.compile's kernel for a + b against fuseml's flat kernel, as built: each one's
    PTX, cubin and launch config written to $PROBE_OUT (compare offline), the config and
    register count printed; and the output addresses each arm's calls get inside a CUDA
    graph capture over rotating inputs (a reused output stays in L2 between calls)."""
    import glob

    from torch._inductor.utils import run_and_get_code

    tag = str(dtype)[6:]
    out_dir = os.environ.get("PROBE_OUT", "")
    a = torch.randn(numel, device="cuda", dtype=dtype)
    b = torch.randn(numel, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda p, q: p + q, dynamic=False)
    _, codes = run_and_get_code(compiled, a, b)
    if out_dir:
        with open(os.path.join(out_dir, f"inductor_add_{tag}.py"), "w") as f:
            f.write("\n\n".join(codes))
    print(f"== add {tag} {numel}: torch.compile's code")
    for line in "\n".join(codes).splitlines():
        if any(
            k in line
            for k in (
                "@triton_heuristics",
                "def triton_",
                "XBLOCK",
                "num_warps",
                "tl.load",
                "tl.store",
                "xmask =",
                "triton_meta",
            )
        ):
            print("  " + line.strip()[:220])
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    for path in glob.glob(os.path.join(cache, "*", "triton_poi_fused_add*")):
        if out_dir and path.endswith((".ptx", ".cubin", ".json", ".ttgir")):
            # (every dtype's kernel has the same name: the cache entry's folder tells them
            # apart, and both of the autotuner's configs are there)
            entry = os.path.basename(os.path.dirname(path))[:8]
            dst = os.path.join(out_dir, f"inductor_{tag}_{entry}_{os.path.basename(path)}")
            with open(path, "rb") as src, open(dst, "wb") as f:
                f.write(src.read())
            print(f"  wrote {dst}")
    fuseml.ops.add(a, b, backend="triton")
    for key, ck in ew._bias_act_launches.compiled.items():
        if key[0][0] != dtype:
            continue
        print(f"  fuseml kernel {key[0][1]}: regs {ck.n_regs}, warps {ck.metadata.num_warps}")
        if out_dir:
            for ext in ("ptx", "cubin", "ttgir"):
                mode = "wb" if ext == "cubin" else "w"
                with open(os.path.join(out_dir, f"fuseml_add_{tag}.{ext}"), mode) as f:
                    f.write(ck.asm[ext])
    sets = rotated(
        lambda: (torch.randn_like(a), torch.randn_like(b)), 3 * a.numel() * a.element_size()
    )
    arms = {
        "torch.add": lambda p, q: p + q,
        "compile": compiled,
        "fuseml triton": lambda p, q: fuseml.ops.add(p, q, backend="triton"),
        "fuseml cuda": lambda p, q: fuseml.ops.add(p, q, backend="cuda"),
    }
    for name, fn in arms.items():
        for s in sets[:3]:
            fn(*s)
        torch.cuda.synchronize()
        ptrs = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k in range(8):
                ptrs.append(fn(*sets[k % len(sets)]).data_ptr())
        base = min(ptrs)
        print(
            f"  {name:14s} output offsets in a capture (MiB): {[round((p - base) / 2**20, 2) for p in ptrs]}"
        )
        del graph


def best_configs() -> None:
    """The launch configs torch.compile's pointwise autotuning chose in this process (its
    `.best_config` files in the inductor cache)."""
    import glob

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for path in sorted(glob.glob(os.path.join(cache_dir(), "**", "*.best_config"), recursive=True)):
        with open(path) as f:
            print(f"  torch.compile's choice {os.path.basename(path)}: {f.read().strip()[:200]}")


def main() -> None:
    what = sys.argv[1:] or ["add", "softmax"]
    if "rules" in what:
        widths = [
            int(v) for v in os.environ.get("PROBE_N", "128,256,512,1000,2048,4096").split(",")
        ]
        for dtype in (torch.bfloat16, torch.float32):
            for n in widths:
                rows_rule(n, dtype)
        rows_rule(1024, torch.bfloat16, log=True)
    if "add-asm" in what:
        for dtype in (torch.float32, torch.bfloat16):
            add_asm(dtype)
    if "add" in what:  # PROBE_ADD_NUMEL="1000000,4000000": the sizes; PROBE_OP=add,gelu,gelu_tanh
        for op in os.environ.get("PROBE_OP", "add").split(","):
            for numel in map(int, os.environ.get("PROBE_ADD_NUMEL", "1000000").split(",")):
                add_sweep(torch.float32, numel, op)
                add_sweep(torch.bfloat16, numel, op)
        best_configs()
    if "wide" in what:  # float32 rows where torch.compile's looped reduction is close
        logs = [bool(int(v)) for v in os.environ.get("PROBE_LOG", "0,1").split(",")]
        for n in map(int, os.environ.get("PROBE_N", "8192,16384,32768").split(",")):
            for m in map(int, os.environ.get("PROBE_M", "4096").split(",")):
                for log in logs:
                    wide_rows(n, log, m=m)
    if "inductor" in what:
        for n in map(int, os.environ.get("PROBE_N", "8192,32768").split(",")):
            for log in (False, True):
                inductor_code(n, log)
    if "fp32" in what:  # the on-chip kernel's warps / rows a program for float32 rows
        for n in map(int, os.environ.get("PROBE_N", "512,1000,1024,2048").split(",")):
            log = os.environ.get("PROBE_LOG", "0") == "1"
            softmax_sweep(n, log, "1:1,1:2,1:4,1:8,2:4,2:8", torch.float32)
    if "sweep" in what:  # any widths / dtype: PROBE_N, PROBE_DTYPE, PROBE_LOG, PROBE_ROWS
        dtype = getattr(torch, os.environ.get("PROBE_DTYPE", "bfloat16"))
        for n in map(int, os.environ.get("PROBE_N", "3000").split(",")):
            for log in (bool(int(v)) for v in os.environ.get("PROBE_LOG", "0").split(",")):
                softmax_sweep(n, log, os.environ.get("PROBE_ROWS", "1:4,1:8,2:8"), dtype)
    if "softmax" in what:
        softmax_sweep(
            128, False, os.environ.get("PROBE_ROWS", "16:4,8:4,8:2,4:1,4:2,32:4,32:8,16:2")
        )
        softmax_sweep(1000, False, "1:4,1:2,1:8,2:4,2:8")
        softmax_sweep(1024, True, "1:4,1:2,1:8,2:4,2:8")


if __name__ == "__main__":
    main()
