"""One timing harness for every suite.

A suite yields :class:`Case` objects: a way to make one input set, the arms to compare
(eager, built-in, compile, triton, cuda, ...) and how many bytes / FLOPs one call must move.
:func:`run_cases` times every arm of every case the same way and returns result rows:

* ``triton.testing.do_bench`` median with p20/p80, after warm-up (which also triggers
  Triton / torch.compile compilation and CUDA extension builds, so those stay out of the
  numbers). do_bench clears L2 before every timed call (a write of a 256 MB buffer; the
  turns timer below writes the same buffer, so both time equally cold calls); on top of
  that, inputs that fit in L2 are rotated over several sets (past twice the L2) so that no
  arm is timed on cache-resident data.
* For launch-bound cases a CUDA-graph arm: N calls captured in one graph and replayed, so
  the per-call time is GPU time without launch gaps. At such sizes the event timing
  includes whatever host time per call the flush does not hide, so comparisons of kernels
  there use the graph rows (report.py, summary.py).
* Every arm's first call (compilation) happens before any arm is timed, and each arm is
  timed after a 50 ms spin-up so that GPU clocks are not still low from an idle compile.
* Heavy cases (a call of TURNS_MIN_MS or more) time their arms in turns: TURNS_ROUNDS
  rounds, each giving every arm an equal slice of the timing, the order rotating, so that
  a board that slows under sustained load (an H100 at its power cap runs its clocks from
  1980 down to ~1100 MHz under a large GEMM) weighs on every arm alike instead of on the
  arms timed last. Such rows carry ``turns`` (the rounds). ``fuseml bench --turns``
  (Settings.turns) times every case so, its graph rows too: for arms within 1% of each
  other, where the order of timing can decide which reads faster.
* For the smallest cases, host overhead per call (dispatch + launch, no GPU wait).
* Each arm's output is compared with the first arm's (the reference) with the project's
  tolerance table; a mismatch is recorded in the row and reported, never hidden.
* Rates: GB/s against the copy ceiling, or TFLOP/s where the case names a matmul ceiling
  (GEMM suites); a GEMM case that also gives its bytes gets GB/s and % of the roofline
  (the larger of % of the matmul and % of the copy ceiling) as extra fields, since at
  small M it is bound by reading the weights, not by the tensor cores.
* A timing whose p20-p80 spread is over 10% of its median, or whose median is far from
  the same arm's committed run on this GPU, is timed again before its row is written; the
  row records ``reruns``, and ``noisy`` (why) if it stays so (noise.py).
* Every row is stamped with the commit it ran from, asked of git (commit.py): marked
  ``+dirty`` where the tree differs from it, with the git tree id of src/ as on disk
  (``src_tree``; tables name the local commit with that src/), ``unknown (no git)`` in a
  copied tree.
* A case with ``measure`` is not a kernel timing (e.g. the first call of a fresh process,
  timed in a subprocess): it returns its rows' fields itself and skips all of the above.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from fuseml import runtime
from fuseml.bench.commit import DIRTY, git_commit, source_tree
from fuseml.bench.noise import History, settle
from fuseml.testing import rel_err, tolerance

log = logging.getLogger("fuseml")


@dataclass
class Case:
    suite: str
    name: str  # unique within the suite, e.g. "gelu/bfloat16/16777216"
    params: dict  # table columns: op, dtype, numel, shape, ...
    make_inputs: Callable[[], tuple]  # one fresh input set on the device
    arms: dict[str, Callable]  # arm name -> fn(*inputs); the first arm is the reference
    bytes: int = 0  # fewest bytes one call must move (each input read, output written once)
    flops: int = 0
    samples: int = 0  # rows per call: when set, the rate is samples/s (model suites)
    ceiling: str = "copy_gbps"  # key of the ceiling the rate is compared with
    graph: bool | tuple[str, ...] = False  # also time under a CUDA graph (launch-bound
    # sizes): every arm, or only the arms named (ones that sync with the host cannot be)
    overhead: bool = False  # also measure host time per call
    overhead_arms: dict[str, Callable] = field(default_factory=dict)  # host-overhead-only arms
    check: bool = True  # compare every arm's output with the reference arm's
    dtype: torch.dtype | None = None  # for the tolerance of the check
    tf32: bool = False  # float32 matmuls through tf32: the looser tolerance applies
    compile_arms: tuple[str, ...] = ("compile",)  # arms whose first call is a compilation
    unchecked_arms: tuple[str, ...] = ("copy",)  # baselines that compute something else
    # Not a kernel timing: measure(settings) -> {arm: row fields (mode, p50_ms, ...), or a
    # list of them, one per mode}.
    measure: Callable[[Settings], dict[str, dict]] | None = None
    # describe(arm) -> more row fields, asked right after the arm's first call (e.g. the
    # launch config the tuner chose for it)
    describe: Callable[[str], dict] | None = None
    # sweep() -> {arm: fn}: one more arm per candidate launch config of fuseml's kernel,
    # named "<arm>@<config>" (``fuseml bench SUITE --sweep``); None: the case has no sweep
    sweep: Callable[[], dict[str, Callable]] | None = None


@dataclass
class Settings:
    quick: bool = False
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    graph_calls: int = 20
    overhead_iters: int = 2000
    # Every case's arms timed in turns, graph rows included (``fuseml bench --turns``);
    # else only heavy cases' events rows (see TURNS_MIN_MS)
    turns: bool = False
    # For a case's own ``measure``: (arm, mode) -> that case's committed median in ms, so
    # that it can time an arm again where it lands far from it (noise.py)
    history: dict[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def for_mode(cls, quick: bool, *, turns: bool = False) -> Settings:
        if quick:
            return cls(
                quick=True, warmup_ms=25.0, rep_ms=50.0, graph_calls=10, overhead_iters=500,
                turns=turns,
            )  # fmt: skip
        return cls(turns=turns)


def pdl_on() -> bool:
    """Whether fuseml's kernels launch with programmatic dependent launch in this run
    (``fuseml.ops._utils.pdl_launch``: Hopper and later unless FUSEML_PDL=0); recorded in
    every row, since it moves launch-bound rows by ~0.5 us."""
    if not torch.cuda.is_available():
        return False
    from fuseml.ops._utils import pdl_launch

    return pdl_launch(torch.empty(0, device="cuda"))


def run_metadata() -> dict:
    info = runtime.device_info()
    commit = git_commit()
    return {
        "gpu": info["name"],
        "gpu_slug": info["slug"],
        "sm_count": info["sm_count"],
        "torch": torch.__version__,
        "triton": runtime.triton_version(),
        "cuda": torch.version.cuda,
        "commit": commit,
        # the code measured, where the commit alone does not say it (see commit.py)
        **({"src_tree": source_tree()} if commit.endswith(DIRTY) else {}),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "pdl": pdl_on(),
    }


# ------------------------------------------------------------------------------ timers
def bench_ms(fn: Callable[[], object], settings: Settings) -> tuple[float, float, float]:
    """(p50, p20, p80) in ms of one call of ``fn``, GPU time between CUDA events."""
    p50, p20, p80, _ = bench_ms_p99(fn, settings)
    return p50, p20, p80


def bench_ms_p99(fn: Callable[[], object], settings: Settings) -> tuple[float, ...]:
    """(p50, p20, p80, p99) in ms of one call of ``fn``."""
    import triton.testing

    return tuple(
        triton.testing.do_bench(
            fn, warmup=settings.warmup_ms, rep=settings.rep_ms, quantiles=[0.5, 0.2, 0.8, 0.99]
        )
    )


def bench_graph_ms(
    fn: Callable, input_sets: list[tuple], settings: Settings
) -> tuple[float, float, float]:
    """Per-call (p50, p20, p80) in ms of ``graph_calls`` calls captured in one CUDA graph."""
    n = settings.graph_calls
    graph = capture_graph(fn, input_sets, n)
    p50, p20, p80 = bench_ms(graph.replay, settings)
    del graph
    return p50 / n, p20 / n, p80 / n


def capture_graph(fn: Callable, input_sets: list[tuple], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` (over the input sets in turn) captured in one CUDA graph,
    after a warm-up off the capture stream, as torch requires."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in input_sets[:3]:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with runtime.graph_capture(graph, collect=True):
        for k in range(calls):
            fn(*input_sets[k % len(input_sets)])
    return graph


# Heavy cases: arms timed in turns (see the module docstring), so that the clocks' drop
# under the power cap weighs on every arm alike: the large GEMMs (4096 -> 11008 at 4096
# rows read 0.948x cuBLASLt timed after four other arms, 0.984x in turns, on an H100),
# large model batches, the largest elementwise and softmax cases.
TURNS_MIN_MS = 0.5
TURNS_ROUNDS = 5


def l2_flush_buffer() -> torch.Tensor:
    """The buffer do_bench writes before each timed call to clear the L2 (256 MB on CUDA):
    the turns timer writes the same one, so both timers start each call equally cold."""
    from triton import runtime as triton_runtime

    return triton_runtime.driver.active.get_empty_cache_for_benchmark()


def event_times_ms(fn: Callable[[], object], calls: int, flush: torch.Tensor) -> list[float]:
    """GPU ms of each of ``calls`` calls of ``fn`` (CUDA events), the L2 flushed (a write
    of ``flush``, see l2_flush_buffer) before each, as do_bench times; one untimed call
    first."""
    fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def quantiles_ms(samples: list[float]) -> tuple[float, float, float, float]:
    """(p50, p20, p80, p99) of ``samples``, interpolated as do_bench's quantiles are."""
    t = torch.tensor(samples, dtype=torch.float64)
    q = torch.tensor([0.5, 0.2, 0.8, 0.99], dtype=torch.float64)
    return tuple(float(v) for v in torch.quantile(t, q))


def bench_turns_ms(
    fns: dict[str, Callable[[], object]],
    per_call_ms: dict[str, float],
    settings: Settings,
    timer: Callable[[Callable[[], object], int], list[float]],
    rounds: int = TURNS_ROUNDS,
) -> dict[str, tuple[float, float, float, float]]:
    """(p50, p20, p80, p99) ms per call of each arm, timed in turns: ``rounds`` rounds,
    each timing every arm for rep_ms / rounds (at least 2 calls, from ``per_call_ms``),
    round r starting at arm r (mod arms). ``timer(fn, calls)``: the calls' times in ms."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            calls = max(2, int(settings.rep_ms / rounds / max(per_call_ms[name], 1e-3)))
            samples[name].extend(timer(fns[name], calls))
    return {name: quantiles_ms(v) for name, v in samples.items()}


def host_overhead_us(fn: Callable, inputs: tuple, iters: int) -> float:
    """Host time per call in microseconds: what dispatch and launch cost the CPU.

    Inputs are tiny, so the GPU keeps up and the loop measures only the CPU side.
    """
    for _ in range(10):
        fn(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*inputs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def rotation_sets(case: Case, l2_bytes: int) -> list[tuple]:
    """Enough input sets that cycling through them touches more than twice the L2."""
    per_set = max(case.bytes, 1)
    n = 1 if per_set >= 2 * l2_bytes else min(64, math.ceil(2 * l2_bytes / per_set) + 1)
    return [case.make_inputs() for _ in range(n)]


# ------------------------------------------------------------------------------ runner
def run_cases(
    cases: Iterable[Case],
    *,
    ceilings: dict,
    settings: Settings,
    arms: Iterable[str] | None = None,
    progress=None,
    history: History | None = None,
) -> list[dict]:
    """Time every (case, arm) and return one row per measurement.

    history: (case, arm, mode) -> the committed median in ms (noise.committed_history):
    a timing far from it is timed again (noise.py)."""
    meta = run_metadata()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    wanted = set(arms) if arms else None
    rows: list[dict] = []
    for case in cases:
        if progress is not None:
            progress(case)
        rows.extend(_run_case(case, ceilings, settings, wanted, meta, l2, history))
    return rows


def _first_line(exc: BaseException) -> str:
    """The exception's type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _row(case: Case, arm: str, meta: dict, ceilings: dict, **fields) -> dict:
    row = {"suite": case.suite, "case": case.name, "arm": arm, **case.params}
    p50 = fields.get("p50_ms")
    if p50 and case.samples:  # model suites: samples/s, and how near both hardware limits
        fields.update(rate=round(case.samples / (p50 * 1e-3), 1), rate_unit="samples/s")
        if case.flops:
            fields["tflops"] = round(case.flops / (p50 * 1e-3) / 1e12, 2)
            matmul = ceilings.get(case.ceiling) if case.ceiling.startswith("matmul") else None
            if matmul:  # % of the matmul ceiling (its dtype's) measured in the run
                fields["pct_of_matmul"] = round(100 * fields["tflops"] / matmul, 2)
        copy = ceilings.get("copy_gbps")
        if case.bytes and copy:  # % of the memory floor: the fewest bytes at copy speed
            fields["pct_of_copy"] = round(100 * case.bytes / (p50 * 1e-3) / 1e9 / copy, 2)
    elif p50 and (case.bytes or case.flops):
        by_flops = bool(case.flops) and (not case.bytes or case.ceiling.startswith("matmul"))
        if by_flops:
            rate, unit = case.flops / (p50 * 1e-3) / 1e12, "TFLOP/s"
        else:
            rate, unit = case.bytes / (p50 * 1e-3) / 1e9, "GB/s"
        ceiling = ceilings.get(case.ceiling)
        pct = round(100 * rate / ceiling, 1) if ceiling else None
        fields.update(
            rate=round(rate, 2),
            rate_unit=unit,
            ceiling=case.ceiling,
            ceiling_value=ceiling,
            pct_of_ceiling=pct,
        )
        if by_flops and case.bytes:  # GEMMs: small M is bound by the weight read
            gbps = case.bytes / (p50 * 1e-3) / 1e9
            copy = ceilings.get("copy_gbps")
            fields["gbps"] = round(gbps, 1)
            if copy:
                fields["pct_of_copy"] = round(100 * gbps / copy, 1)
                if pct is not None:
                    fields["pct_of_roofline"] = max(pct, fields["pct_of_copy"])
    row.update(fields)
    row.update(meta)
    return row


def spin_up(fn: Callable, inputs: tuple, ms: float = 50.0) -> float:
    """Keep the GPU busy for ``ms`` so its clocks are up before timing; returns the GPU ms
    of one call (timed first).

    A compilation (seconds of an idle GPU) lets the clocks drop; do_bench's short warm-up
    does not always bring them back, which once made the arm timed right after a compile
    look up to 2x slower at mid sizes.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end), 1e-3)
    for _ in range(min(10_000, int(ms / per_call) + 1)):
        fn(*inputs)
    torch.cuda.synchronize()
    return per_call


def _run_case(case, ceilings, settings, wanted, meta, l2, history=None) -> list[dict]:
    if case.measure is not None:
        past = {(a, m): ms for (c, a, m), ms in (history or {}).items() if c == case.name}
        # {arm: fields, or a list of them (modes)}
        measured = case.measure(dataclasses.replace(settings, history=past))
        return [
            _row(case, arm, meta, ceilings, **fields)
            for arm, per_arm in measured.items()
            if wanted is None or arm in wanted
            for fields in (per_arm if isinstance(per_arm, list) else [per_arm])
        ]
    arms = {k: v for k, v in case.arms.items() if wanted is None or k in wanted}
    ref_name = next(iter(case.arms))
    sets = rotation_sets(case, l2)
    reference = None
    if case.check and ref_name in case.arms:
        reference = case.arms[ref_name](*sets[0])
    # First calls of every arm before any timing: compilations, extension builds and
    # autotuning happen here, and the output is checked against the reference arm.
    fields_by_arm: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for arm, fn in arms.items():
        t0 = time.perf_counter()
        try:
            out = fn(*sets[0])
            torch.cuda.synchronize()
        except Exception as exc:  # recorded as a failed row; the other arms still run
            failed[arm] = _first_line(exc)
            log.warning("%s: arm %s failed: %s", case.name, arm, failed[arm])
            continue
        first_call_s = time.perf_counter() - t0
        fields: dict = {} if case.describe is None else dict(case.describe(arm))
        if arm in case.compile_arms:
            fields["compile_s"] = round(first_call_s, 3)
        if reference is not None and arm != ref_name and arm not in case.unchecked_arms:
            err = rel_err(out, reference)
            fields["rel_err_vs_ref"] = err
            tol = tolerance(case.dtype or out.dtype, tf32=case.tf32)
            fields["matches_ref"] = bool(err <= tol)
        fields_by_arm[arm] = fields
        del out
    del reference
    rows = [
        _row(case, arm, meta, ceilings, mode="events", error=why) for arm, why in failed.items()
    ]
    arms = {arm: fn for arm, fn in arms.items() if arm not in failed}
    if not arms:
        return rows
    # One call of each arm after its first; heavy cases (or every case, settings.turns)
    # are timed in turns (see TURNS_MIN_MS), the rest one arm after the other. Unsettled
    # timings (noise.py) are timed again before the rows are written.
    history = history or {}

    def past(mode: str) -> dict[str, float | None]:
        return {arm: history.get((case.name, arm, mode)) for arm in arms}

    per_call = {arm: spin_up(fn, sets[0], ms=0.0) for arm, fn in arms.items()}
    heavy = len(arms) > 1 and (settings.turns or max(per_call.values()) >= TURNS_MIN_MS)
    graphed = [arm for arm in arms if case.graph is True or (case.graph and arm in case.graph)]
    graph_in_turns = settings.turns and len(graphed) > 1
    flush = None
    if heavy or graph_in_turns:
        flush = l2_flush_buffer()  # do_bench's own: the same flush in both timers

    def timer(fn, calls):
        return event_times_ms(fn, calls, flush)

    if heavy:
        for fn in arms.values():
            spin_up(fn, sets[0])
        cycles = {arm: itertools.cycle(sets) for arm in arms}
        calls = {
            arm: (lambda fn=fn, cycle=cycles[arm]: fn(*next(cycle))) for arm, fn in arms.items()
        }
        # a re-run times every arm in turns again, so a drift still weighs on all alike
        events = settle(
            lambda names: bench_turns_ms(calls, per_call, settings, timer), arms, past("events")
        )
    else:

        def time_each(names):
            out = {}
            for arm in names:
                fn = arms[arm]
                spin_up(fn, sets[0])
                cycle = itertools.cycle(sets)
                out[arm] = bench_ms_p99(lambda fn=fn, cycle=cycle: fn(*next(cycle)), settings)
            return out

        events = settle(time_each, arms, past("events"))
    graph_times = {}
    if graph_in_turns:
        n = settings.graph_calls
        graphs = {arm: capture_graph(arms[arm], sets, n) for arm in graphed}
        replays = {arm: graph.replay for arm, graph in graphs.items()}
        per_replay = {arm: spin_up(replay, (), ms=0.0) for arm, replay in replays.items()}
        for replay in replays.values():
            spin_up(replay, ())

        def graph_turns(names):
            timed = bench_turns_ms(replays, per_replay, settings, timer)
            return {arm: tuple(t / n for t in q[:3]) for arm, q in timed.items()}

        graph_times = settle(graph_turns, graphed, past("graph"))
        del graphs, replays
    elif graphed:
        graph_times = settle(
            lambda names: {arm: bench_graph_ms(arms[arm], sets, settings) for arm in names},
            graphed,
            past("graph"),
        )
    flush = None  # (freed before the host-overhead loops)
    for arm, fn in arms.items():
        fields = fields_by_arm[arm]
        timing = events[arm]
        p50, p20, p80, p99 = timing.quantiles
        if heavy:
            fields["turns"] = TURNS_ROUNDS
        fields.update(mode="events", p50_ms=p50, p20_ms=p20, p80_ms=p80, p99_ms=p99)
        fields.update(timing.fields())
        if case.overhead:
            fields["host_us"] = round(host_overhead_us(fn, sets[0], settings.overhead_iters), 2)
        rows.append(_row(case, arm, meta, ceilings, **fields))
        if arm in graphed:
            g = graph_times[arm]
            g50, g20, g80 = g.quantiles[:3]
            graph = {"turns": TURNS_ROUNDS} if graph_in_turns else {}
            rows.append(
                _row(
                    case, arm, meta, ceilings, mode="graph", p50_ms=g50, p20_ms=g20, p80_ms=g80,
                    **graph, **g.fields(),
                )
            )  # fmt: skip
    if case.overhead:
        for arm, fn in case.overhead_arms.items():
            if wanted is not None and arm not in wanted:
                continue
            us = host_overhead_us(fn, sets[0], settings.overhead_iters)
            rows.append(_row(case, arm, meta, ceilings, mode="host", host_us=round(us, 2)))
    return rows
