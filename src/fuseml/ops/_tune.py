"""Measured launch configurations, kept on disk per device and shape bucket.

A GEMM's best tile depends on the device and on M, N, K. The first call of a new shape
bucket times a short, shape-pruned list of candidate configs (compile + a few
milliseconds each) and stores the winner in a JSON file, so a new process finds it
instead of re-tuning:

    $FUSEML_CACHE/tune/<gpu>-triton<version>-t<TABLE_VERSION>-l2cold.json
        (default ~/.cache/fuseml, the folder of fuseml's other caches)

M is bucketed by powers of two (the best tile changes slowly with M; N and K are model
constants and stay exact). ``FUSEML_AUTOTUNE=0`` turns tuning off: the heuristic config
is used and nothing is written. Under the Triton interpreter, or while torch.compile
traces (inputs are fake there), the cached entry is used if present, else the heuristic.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fuseml import settings
from fuseml._files import write_text_atomic
from fuseml.ops._utils import compile_only, compiling_only
from fuseml.runtime import gc_paused, gpu_slug, triton_interpreting, triton_version

log = logging.getLogger("fuseml")

TABLE_VERSION = 4  # raised when the candidate lists or how they are timed change, so that
# a table tuned before is not taken as the answer now (2: the TMA-store tiles; 3: TMA tiles
# of host-bound plain layers timed with a penalty; 4: cuBLASLt's kernel, see gemm.configs)
_lock = threading.Lock()
_tables: dict[str, dict] = {}  # file path -> {key: config}


def cache_dir() -> Path:
    return settings.cache_dir() / "tune"


def autotune_enabled() -> bool:
    return settings.autotune() and not triton_interpreting()


def m_bucket(m: int) -> int:
    """Powers of two: 1, 2, 4, ..., so 300 and 500 share the entry of 512."""
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def l2_mode() -> str:
    """FUSEML_TUNE_L2: "cold" (default: each timed call finds the L2 flushed, as a served
    model's layer finds its weights evicted by the layers before it, and as the bench
    suites time with inputs rotating past the L2) or "warm" (the same inputs replayed)."""
    return settings.tune_l2()


def _table_path(device: torch.device) -> Path:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # Each way of timing keeps its own table: warm and cold timings rank tiles differently
    cold = "-l2cold" if l2_mode() == "cold" else ""
    return cache_dir() / f"{gpu_slug(name)}-triton{triton_version()}-t{TABLE_VERSION}{cold}.json"


def _table(path: Path) -> dict:
    table = _tables.get(str(path))
    if table is None:
        table = {}
        if path.exists():
            try:
                table = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                log.warning("fuseml: ignoring unreadable tuning cache %s (%s)", path, err)
        _tables[str(path)] = table
    return table


def _save(path: Path, table: dict) -> None:
    try:
        write_text_atomic(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError as err:
        log.warning("fuseml: could not write tuning cache %s (%s)", path, err)


_flush: dict[int, tuple[torch.Tensor, float]] = {}  # device index -> (buffer, its read in ms)


def _l2_flush(index: int) -> tuple[torch.Tensor, float]:
    """A buffer twice the size of the device's L2 (read-only: reading it leaves clean
    lines, so no write-back lands in the timed call) and the GPU time of one read of it,
    measured once per process (inside ``gpu_time_ms``'s collector pause)."""
    import triton.testing

    entry = _flush.get(index)
    if entry is None:
        l2 = torch.cuda.get_device_properties(index).L2_cache_size or 64 << 20
        buf = torch.ones(2 * l2 // 4, dtype=torch.float32, device=f"cuda:{index}")
        entry = (buf, triton.testing.do_bench_cudagraph(buf.sum, rep=10))  # (gc_paused)
        _flush[index] = entry
    return entry


def gpu_time_ms(fn: Callable[[], object]) -> float:
    """GPU time of one call of ``fn`` in ms, from CUDA-graph replays.

    Host launch time is excluded: for small problems it exceeds the kernel's GPU time, and
    timing with it would rank every config the same. The first call (compilation, and
    a resource error for a config that does not fit) happens outside the capture.
    L2-cold by default (see ``l2_mode``): each call follows a read of twice the L2's size,
    whose own time is subtracted. Warm, tiles that wait on a weight streaming from HBM
    rank as if it came from the L2 (a 4096 x 4096 bf16 weight fits an H100's).
    """
    # do_bench_cudagraph runs on a stream of its own. The caller's stream may still have
    # queued kernels reading memory that the timed calls write (the output of a layer is
    # often a block the allocator just took back from a tensor those kernels still read):
    # let that stream drain first. (Without this, a DLRM's first, tuning call got a few
    # wrong rows.)
    torch.cuda.synchronize()
    # do_bench_cudagraph captures: the collector is paused as in every capture (gc_paused).
    with gc_paused():
        return _replayed_ms(fn)


def _replayed_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    if l2_mode() == "warm":
        ms = triton.testing.do_bench_cudagraph(fn, rep=10)
    else:
        buf, flush_ms = _l2_flush(torch.cuda.current_device())

        def cold() -> None:
            buf.sum()
            fn()

        # rep sizes the replayed graph by the calls' host time: 3 ms keeps ~60 calls of
        # flush + kernel a replay; 10 ms tripled each candidate's tuning time, most of it
        # the flush (docs/performance/tuning.md)
        ms = triton.testing.do_bench_cudagraph(cold, rep=3) - flush_ms
    torch.cuda.synchronize()
    return ms


def _async_compile_module():
    """Triton's async-compile module where it has ``AsyncCompileMode``, else None."""
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return None
    return _async_compile if hasattr(_async_compile, "AsyncCompileMode") else None


def parallel_compile() -> str:
    """How a cold first call compiles its candidates here, in words (``fuseml env``)."""
    threads = settings.compile_threads()
    if threads <= 1:
        return "one at a time as they are timed (FUSEML_COMPILE_THREADS)"
    if _async_compile_module() is None:
        return "one at a time as they are timed (this Triton has no async compile mode)"
    return f"in parallel on up to {threads} threads, then timed one by one"


def compile_candidates(candidates: list[dict], run: Callable[[dict], object]) -> int:
    """Compile every candidate's kernels at once, on a thread pool, before they are timed
    one by one: Triton's compiler releases the GIL, so a cold first call (nothing in
    Triton's on-disk cache) compiles its candidates in parallel instead of one after
    another. ``run(config)`` is the timed launch; inside ``compile_only()`` its kernels
    are compiled (Triton's ``AsyncCompileMode`` with warmup launches), not run. Returns the
    number of candidates submitted (0 where this Triton has no async compile mode or
    threads are off). Errors are left to the timing pass, which skips a failing config.
    """
    threads = min(settings.compile_threads(), len(candidates))
    if threads <= 1 or triton_interpreting():
        return 0
    ac = _async_compile_module()
    if ac is None:  # an older Triton: candidates compile as they are timed
        return 0
    active = getattr(ac, "active_mode", None)
    if active is not None and active.get() is not None:  # the caller's own: leave it be
        return 0
    from concurrent.futures import ThreadPoolExecutor

    # (leaving AsyncCompileMode waits for every compile, before the pool shuts down)
    with (
        ThreadPoolExecutor(threads) as pool,
        ac.AsyncCompileMode(pool, ignore_errors=True),
        compile_only(),
    ):
        for cfg in candidates:
            try:
                run(cfg)
            except Exception as err:  # reported again (or not) when timed
                log.debug("fuseml: compiling config %s failed: %s", cfg, err)
    return len(candidates)


def entry_count(folder: Path | None = None) -> tuple[int, int]:
    """(tuned entries, table files) in the tuning cache folder; a half-written file counts 0."""
    folder = cache_dir() if folder is None else Path(folder)
    tables = sorted(folder.glob("*.json")) if folder.is_dir() else []
    entries = 0
    for path in tables:
        try:
            entries += len(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return entries, len(tables)


def lookup(device: torch.device, key: str) -> dict | None:
    with _lock:
        return _table(_table_path(device)).get(key)


_memo: dict[tuple, dict] = {}  # the configs this process chose, by the caller's memo key
_capture_misses: set[str] = set()  # keys first met inside a graph capture (warned once)


def memoized(memo_key: tuple) -> dict | None:
    """The config this process already chose for ``memo_key`` (see ``choose``), or None."""
    return _memo.get(memo_key)


def choose(
    memo_key: tuple,
    device: torch.device,
    key: Callable[[], str],
    candidates: Callable[[], list[dict]],
    bench: Callable[[dict], float],
    default: dict,
    *,
    can_time: bool,
    run: Callable[[dict], object] | None = None,
) -> dict:
    """The config for one problem: in-process memo (this runs on every call), then the
    on-disk table, then tuning (only where ``can_time``: real CUDA tensors, not the fake
    ones torch.compile traces with). ``key`` and ``candidates`` are built on a miss only.
    ``run(config)``, where given, is the launch ``bench`` times: the candidates are then
    compiled in parallel first (``compile_candidates``).
    """
    cfg = _memo.get(memo_key)
    if cfg is not None:
        return cfg
    if compiling_only():  # a candidate of an enclosing tuning being compiled: no timing
        return lookup(device, key()) or default
    if not can_time and device.type != "cuda":  # no table to read: the default, every time
        _memo[memo_key] = default
        return default
    text_key = key()
    if not can_time:  # fake CUDA tensors (torch.compile tracing): the table, not memoised
        return lookup(device, text_key) or default
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Timing launches inside a CUDA-graph capture would invalidate it: the table or
        # the default (same results, maybe slower), not memoised, so an eager call later
        # still tunes. Graph users run one eager call first (as torch.compile's
        # cudagraphs do): a call met here only in a capture is a miss worth reporting.
        found = lookup(device, text_key)
        if found is None and len(candidates()) <= 1:  # nothing to choose (as ``tuned``)
            return default
        if found is None and text_key not in _capture_misses:
            _capture_misses.add(text_key)
            log.warning(
                "fuseml: %s: first met inside a CUDA-graph capture, where nothing can be "
                "timed: using the default config (run one eager call before capturing to "
                "tune it)", text_key,
            )  # fmt: skip
        return found or default
    cfg = tuned(device, text_key, candidates(), bench, default, run=run)
    if not torch.compiler.is_compiling():
        _memo[memo_key] = cfg
    return cfg


def tuned(
    device: torch.device,
    key: str,
    candidates: list[dict],
    bench: Callable[[dict], float],
    default: dict,
    run: Callable[[dict], object] | None = None,
) -> dict:
    """The config for ``key``: from the cache, else measured now, else ``default``.

    ``bench(config)`` returns a time in ms (it may raise for a config that does not fit,
    e.g. out of shared memory; that config is skipped). ``run``: see ``choose``.
    """
    found = lookup(device, key)
    if found is not None:
        return found
    if not autotune_enabled() or torch.compiler.is_compiling() or len(candidates) <= 1:
        return default
    start = time.perf_counter()
    compiled = 0
    if run is not None and device.type == "cuda":
        compiled = compile_candidates(candidates, run)
    compile_s = time.perf_counter() - start
    best, best_ms = default, float("inf")
    last_err = None
    for cfg in candidates:
        try:
            ms = bench(cfg)
        except Exception as err:  # a config the device cannot run (shared memory, ...)
            log.debug("fuseml: tuning %s: config %s failed: %s", key, cfg, err)
            last_err = err
            continue
        log.debug("fuseml: tuning %s: config %s: %.4f ms", key, cfg, ms)
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best_ms == float("inf"):  # nothing ran: keep nothing, the launch reports the error
        log.warning(
            "fuseml: tuning %s: none of %d configs ran (last error: %s); using the default",
            key, len(candidates), str(last_err).splitlines()[0] if last_err else "none",
        )  # fmt: skip
        return default
    log.info(
        "fuseml: tuned %s in %.1f s over %d configs (%s): %s (%.4f ms)",
        key, time.perf_counter() - start, len(candidates),
        f"compiled in parallel in {compile_s:.1f} s" if compiled else "compiled as timed",
        best, best_ms,
    )  # fmt: skip
    path = _table_path(device)
    with _lock:
        table = _table(path)
        table[key] = best
        _save(path, table)
    return best
