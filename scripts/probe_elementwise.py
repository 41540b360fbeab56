"""Time the elementwise epilogue's CUDA twin next to the Triton kernel and a same-size copy
on the GPU, at the sizes where the suite's targets apply (16M elements and more) and the
DLRM / LoRA epilogue shapes (2-D, with a bias).

Medians of triton.testing.do_bench (L2 flushed), GB/s counted as one read of each input
and one write of the output.

Then, for the mid-size 2-D epilogues where the Triton kernel trailed torch.compile (up to
10% on an H200), the Triton kernel's tile (bytes per operand) and warps against
torch.compile of the reference chain.

With --small: flat ops (1M elements; PROBE_NUMEL / PROBE_OPS / PROBE_DTYPES for others)
under CUDA-graph replay (GPU time), the Triton kernel's tile / warps against torch's
built-in, a copy of x and the CUDA twin.

With --twin-rows: the 2-D epilogues with a bias (bias + GELU; bias + residual + ReLU), fp32
and bf16, 4096 / 65536 rows x 512 / 4096, in CUDA-graph replay with inputs rotating past
the L2 as in the suite: the CUDA twin at each rows-per-thread setting (a process each,
FUSEML_EW_CUDA_ROWS = 0 (the library's choice), 1, 2, 4), the Triton kernel beside it as
the run's reference (torch.compile too with PROBE_COMPILE=1).

Usage (GPU machine): PYTHONPATH=src [PROBE_GRAPH=1] python3 scripts/probe_elementwise.py
[--sweep-only | --small | --inductor]   (--sweep-only: PROBE_SWEEP / PROBE_REPEAT;
--inductor: fp32 bias + residual + ReLU at large shapes against lean copies of
torch.compile's kernel; see main)
"""

import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from fuseml.ops import _elementwise as ew
from fuseml.runtime import cuda_backend_status

CASES = (  # op, dtype, shape, bias, residual
    ("add", "float32", (1 << 28,), False, True),
    ("add", "bfloat16", (1 << 28,), False, True),
    ("gelu", "float32", (1 << 28,), False, False),
    ("gelu", "bfloat16", (1 << 28,), False, False),
    ("gelu", "bfloat16", (1 << 24,), False, False),
    ("gelu_tanh", "bfloat16", (1 << 28,), False, False),
    ("gelu", "bfloat16", (65536, 4096), True, False),
    ("relu", "bfloat16", (4096, 4096), True, True),
    ("relu", "bfloat16", (65536, 4096), True, True),
    ("gelu", "bfloat16", (4096, 4096), True, False),
    ("gelu", "float32", (65536, 4096), True, False),
    ("relu", "bfloat16", (65536, 512), True, True),
    ("gelu", "bfloat16", (65536, 512), True, False),
    ("gelu", "bfloat16", (4096, 1000), True, False),
)


SWEEP = (  # op, dtype, shape (bias always; residual for relu)
    ("relu", "bfloat16", (4096, 512)),
    ("relu", "bfloat16", (4096, 4096)),
    ("gelu", "bfloat16", (4096, 512)),
    ("gelu", "bfloat16", (4096, 4096)),
    ("relu", "float32", (4096, 512)),
    ("gelu", "float32", (4096, 4096)),
)


def ms(fn):
    """Median ms: L2-flushed events, or CUDA-graph replay (GPU time only, the host's launch
    cost left out) with PROBE_GRAPH=1, for kernels of a few microseconds."""
    if os.environ.get("PROBE_GRAPH") == "1":
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def sweep_case(op, dtype_name, shape) -> str:
    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype)
    # relu / leaky_relu / none: bias + residual + activation; gelu: bias + GELU
    y = torch.randn_like(x) if op != "gelu" else None
    out = torch.empty_like(x)
    act = ew.ACT_CODE[op]
    if op != "gelu":
        fn = {"relu": torch.relu, "leaky_relu": F.leaky_relu, "none": lambda v: v}[op]
        ref = torch.compile(lambda x, b, y: fn(x + b + y), dynamic=False)
        args = (x, b, y)
    else:
        ref = torch.compile(lambda x, b: F.gelu(x + b), dynamic=False)
        args = (x, b)
    ref(*args)
    cells = [f"compile {ms(lambda: ref(*args)) * 1e3:.1f}"]
    t = ms(lambda: ew.bias_act_into(out, x, y, b, 1.0, act, impl="cuda"))
    cells.append(f"cuda {t * 1e3:.1f}")
    heur = ew.launch_config(*shape, x.element_size())
    t = ms(lambda: ew.bias_act_into(out, x, y, b, 1.0, act))
    cells.append(
        f"heuristic {heur['BLOCK_M']}x{heur['BLOCK_N']}/{heur['num_warps']}w {t * 1e3:.1f}"
    )
    es = x.element_size()
    for tile_bytes in (1024, 2048, 4096, 8192, 16384):
        for warps in (2, 4, 8):
            tile = tile_bytes // es
            bn = min(tile, triton.next_power_of_2(shape[1]))
            cfg = {"BLOCK_M": max(1, tile // bn), "BLOCK_N": bn, "num_warps": warps}
            if tile // (32 * warps) < 8 // es:  # under 8 bytes a thread
                continue
            t = ms(lambda cfg=cfg: ew.bias_act_into(out, x, y, b, 1.0, act, config=cfg))
            cells.append(f"{tile_bytes // 1024}K/{warps}w {t * 1e3:.1f}")
    return f"{op:5} {dtype_name:8} {shape!s:12} us: " + " | ".join(cells)


def small_case(op, dtype_name, numel) -> str:
    dtype = getattr(torch, dtype_name)
    x = torch.randn(numel, device="cuda", dtype=dtype)
    y = torch.randn_like(x) if op == "add" else None
    out = torch.empty_like(x)
    act = ew.ACT_CODE["none" if op == "add" else op]

    def graph_us(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3

    if op == "add":
        builtin = lambda: torch.add(x, y)
    else:
        builtin = lambda: F.gelu(x, approximate="tanh" if op == "gelu_tanh" else "none")
    cells = [f"torch {graph_us(builtin):.2f}", f"copy(x) {graph_us(lambda: out.copy_(x)):.2f}"]
    cells.append(
        f"cuda {graph_us(lambda: ew.bias_act_into(out, x, y, None, 1.0, act, impl='cuda')):.2f}"
    )
    heur = ew.launch_config(1, numel, x.element_size())
    t = graph_us(lambda: ew.bias_act_into(out, x, y, None, 1.0, act))
    cells.append(f"heuristic {heur['BLOCK_N']}/{heur['num_warps']}w {t:.2f}")
    for tile in (512, 1024, 2048, 4096, 8192):
        for warps in (1, 2, 4, 8):
            if tile // (32 * warps) > 64:  # over 64 elements a thread: spills
                continue
            if tile // (32 * warps) < 8 // x.element_size():  # under 8 bytes a thread
                continue
            cfg = {"BLOCK_M": 1, "BLOCK_N": tile, "num_warps": warps}
            t = graph_us(lambda cfg=cfg: ew.bias_act_into(out, x, y, None, 1.0, act, config=cfg))
            cells.append(f"{tile}/{warps}w {t:.2f}")
    return f"{op:4} {dtype_name:8} {numel} us (graph): " + " | ".join(cells)


def time_case(op, dtype_name, shape, has_bias, has_y) -> str:
    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    y = torch.randn_like(x) if has_y else None
    b = torch.randn(shape[-1], device="cuda", dtype=dtype) if has_bias else None
    out = torch.empty_like(x)
    act = ew.ACT_CODE["none" if op == "add" else op]
    nbytes = (2 + has_y) * x.numel() * x.element_size()
    cells = []
    for impl in ("cuda", "triton"):
        t = ms(lambda impl=impl: ew.bias_act_into(out, x, y, b, 1.0, act, impl=impl))
        cells.append(f"{impl} {t * 1e3:8.1f} us {nbytes / t / 1e6:7.0f} GB/s")
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    cells.append(f"copy {t * 1e3:8.1f} us")
    return f"{op:9} {dtype_name:8} {shape!s:14} " + " | ".join(cells)


@triton.jit
def _lean_bias_residual_relu(
    x_ptr, b_ptr, y_ptr, out_ptr, numel, N: tl.constexpr, BLOCK: tl.constexpr,
    MASKED: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """relu(x + b + y) over a contiguous (M, N) tensor as one flat run, the bias by
    offs % N (N a constant), as torch.compile writes it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel if MASKED else None
    x = tl.load(x_ptr + offs, mask=mask)
    if EVICT:
        b = tl.load(b_ptr + offs % N, mask=mask, eviction_policy="evict_last")
    else:
        b = tl.load(b_ptr + offs % N, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.maximum(x + b + y, 0.0), mask=mask)


def inductor_case(dtype_name, shape) -> str:
    """fp32 bias + residual + ReLU at a large shape: torch.compile, the library's kernel,
    and a lean copy of torch.compile's kernel with / without masks and the bias's
    evict_last, at several blocks and warps (L2-flushed events)."""
    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype)
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    ref = torch.compile(lambda x, b, y: torch.relu(x + b + y), dynamic=False)
    expect = ref(x, b, y)
    cells = [f"compile {ms(lambda: ref(x, b, y)) * 1e3:.1f}"]
    act = ew.ACT_CODE["relu"]
    cells.append(f"library {ms(lambda: ew.bias_act_into(out, x, y, b, 1.0, act)) * 1e3:.1f}")
    numel = x.numel()
    for block, warps in ((1024, 4), (512, 4), (512, 2), (256, 2), (256, 1), (1024, 8)):
        for masked in (False, True):
            for evict in (True, False):
                if evict and masked:
                    continue

                def run(block=block, warps=warps, masked=masked, evict=evict):
                    _lean_bias_residual_relu[(numel // block,)](
                        x, b, y, out, numel, N=shape[-1], BLOCK=block, MASKED=masked,
                        EVICT=evict, num_warps=warps,
                    )  # fmt: skip

                run()
                name = f"{block}/{warps}w{' mask' if masked else ''}{' evl' if evict else ''}"
                name += "" if torch.equal(out, expect) else " (DIFFERS)"
                cells.append(f"{name} {ms(run) * 1e3:.1f}")
    return f"{dtype_name:8} {shape!s:14} us: " + " | ".join(cells)


TWIN_ROWS = tuple(
    (op, dtype_name, shape)
    for dtype_name in ("float32", "bfloat16")
    for shape in ((4096, 512), (4096, 4096), (65536, 512), (65536, 4096))
    for op in ("gelu", "relu")
)


def rotated_graph_us(fn, make) -> float:
    """GPU us per call of ``fn(*inputs)`` in CUDA-graph replays (the suite's
    ``bench_graph_ms``) cycling over input sets from ``make()``, enough of them to pass
    twice the L2 (as the suite does)."""
    from fuseml.bench.harness import Settings, bench_graph_ms

    first = make()
    per_set = sum(t.numel() * t.element_size() for t in first if t is not None)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = [first] + [make() for _ in range(min(16, -(-2 * l2 // per_set)))]
    p50, _p20, _p80 = bench_graph_ms(fn, sets, Settings())
    return p50 * 1e3


def twin_rows_case(op, dtype_name, shape, with_compile: bool) -> str:
    dtype = getattr(torch, dtype_name)
    act = ew.ACT_CODE[op]
    has_y = op == "relu"

    def make():
        x = torch.randn(shape, device="cuda", dtype=dtype)
        y = torch.randn_like(x) if has_y else None
        return x, y, torch.randn(shape[-1], device="cuda", dtype=dtype), torch.empty_like(x)

    cells = []
    for impl in ("cuda", "triton"):
        t = rotated_graph_us(
            lambda x, y, b, out, impl=impl: ew.bias_act_into(out, x, y, b, 1.0, act, impl=impl),
            make,
        )
        cells.append(f"{impl} {t:7.2f}")
    if with_compile:
        if has_y:
            ref = torch.compile(lambda x, y, b, out: torch.relu(x + b + y), dynamic=False)
        else:
            ref = torch.compile(lambda x, y, b, out: F.gelu(x + b), dynamic=False)
        cells.append(f"compile {rotated_graph_us(ref, make):7.2f}")
    rows = os.environ.get("FUSEML_EW_CUDA_ROWS", "0")
    return f"rows={rows} {op:4} {dtype_name:8} {shape!s:13} us (graph): " + " | ".join(cells)


def main() -> None:
    if "--twin-rows" in sys.argv and "FUSEML_EW_CUDA_ROWS" not in os.environ:
        import subprocess

        for rows in ("0", "1", "2", "4"):  # one process each: the knob is read once
            env = dict(os.environ, FUSEML_EW_CUDA_ROWS=rows)
            subprocess.run([sys.executable, *sys.argv], env=env, check=True)
        return
    ok, why = cuda_backend_status("cuda")  # builds / loads the CUDA twin
    if not ok:
        raise SystemExit(f"CUDA twin unavailable: {why}")
    if "--twin-rows" in sys.argv:
        rows = os.environ["FUSEML_EW_CUDA_ROWS"]
        for op, dtype_name, shape in TWIN_ROWS:
            if rows == "4" and dtype_name != "float32":
                continue  # 16-bit kernels take at most 2 rows a thread
            with_compile = rows == "0" and os.environ.get("PROBE_COMPILE") == "1"
            print(twin_rows_case(op, dtype_name, shape, with_compile), flush=True)
        return
    if "--inductor" in sys.argv:  # PROBE_SHAPES="524288x512,65536x4096", PROBE_REPEAT
        shapes = os.environ.get("PROBE_SHAPES", "524288x512,65536x4096,65536x512").split(",")
        for _ in range(int(os.environ.get("PROBE_REPEAT", "2"))):
            for item in shapes:
                shape = tuple(int(v) for v in item.split("x"))
                print(inductor_case(os.environ.get("PROBE_DTYPE", "float32"), shape), flush=True)
        return
    if "--small" in sys.argv:
        # PROBE_NUMEL / PROBE_OPS / PROBE_DTYPES (comma lists) widen the flat sweep, e.g.
        # PROBE_NUMEL=16777216 PROBE_OPS=gelu,gelu_tanh PROBE_DTYPES=bfloat16
        sizes = [int(v) for v in os.environ.get("PROBE_NUMEL", "1000000").split(",")]
        ops = os.environ.get("PROBE_OPS", "add,gelu").split(",")
        dtypes = os.environ.get("PROBE_DTYPES", "float32,bfloat16").split(",")
        for numel in sizes:
            for op in ops:
                for dtype_name in dtypes:
                    print(small_case(op, dtype_name, numel), flush=True)
        return
    if "--sweep-only" not in sys.argv:
        for case in CASES:
            print(time_case(*case), flush=True)
    # PROBE_SWEEP="relu:float32:524288x512,..." replaces the sweep's cases; PROBE_REPEAT
    # runs each that many times (the spread between passes is the run's noise).
    cases = SWEEP
    if os.environ.get("PROBE_SWEEP"):
        cases = []
        for item in os.environ["PROBE_SWEEP"].split(","):
            op, dtype_name, shape = item.split(":")
            cases.append((op, dtype_name, tuple(int(v) for v in shape.split("x"))))
    for _ in range(int(os.environ.get("PROBE_REPEAT", "1"))):
        for case in cases:
            print(sweep_case(*case), flush=True)


if __name__ == "__main__":
    main()
