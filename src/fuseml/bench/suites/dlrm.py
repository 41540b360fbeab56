"""Suite ``dlrm``: DLRM inference (forward + sigmoid) per batch, samples/s and latency.

Configs kaggle and mlperf over the full Kaggle tables (26 tables, 33.8M rows); batch sizes
1 to 65,536; fp32 without TF32, fp32 with TF32, bf16. Ids uniform over each table (nearly
every lookup misses the cache: the worst case), and for bf16 also Zipf-skewed as real click
logs are (cases named .../zipf/...; see ``fuseml.models.bench_cases.random_inputs``). Rows
carry samples/s, TFLOP/s, % of the precision's matmul ceiling (pct_of_matmul) and % of
the memory floor (pct_of_copy: the fewest bytes a forward moves, at the copy bandwidth),
both ceilings measured in the same run.

Arms
  eager            the plain PyTorch model
  compile          torch.compile(model) (default mode); compile time in compile_s
  compile-max      torch.compile(mode="max-autotune-no-cudagraphs"), full runs, bf16 at
                   B = 4096 and 65536 (its autotuning takes minutes per compilation)
  fuseml           fuseml.optimize(model): the embedding gather and the dot interaction in
                   one kernel writing the top MLP's input, the MLPs as fused chains
                   (fuseml.nn.FusedDLRM), in every precision; its first call per layer
                   shape and batch bucket tunes the kernels (seconds each)
  fuseml-compile   torch.compile(fuseml.optimize(model)) (default mode): fuseml's ops
                   inside Inductor's graph, bf16
Every case is also timed as CUDA-graph replays (rows with mode "graph": eager + CUDA graph).
Per-stage breakdown (bf16, uniform ids, B = 4096 and 65536; cases .../stages, rows with
mode "stage", arms "fuseml:<stage>" and "compile:<stage>"): GPU time per call of the bottom
MLP, the gather + interaction and the top MLP, from the profiler; fuseml as the optimized
model runs them, torch.compile with each stage compiled apart.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

import torch

import fuseml
from fuseml.bench.harness import Case
from fuseml.models.bench_cases import dlrm_inference_cases, dlrm_work
from fuseml.models.dlrm import DLRMConfig
from fuseml.nn.dlrm import stage_ranges
from fuseml.runtime import tf32_matmuls

MAX_CARDINALITY = None  # the full Kaggle tables
BATCHES_FULL = [1, 64, 256, 4096, 32768, 65536]
BATCHES_QUICK = [1, 256, 4096, 65536]
MAX_AUTOTUNE_AT = (("bf16", 4096), ("bf16", 65536))  # (precision, batch): compile-max
CEILINGS = {  # the matmul ceiling of a precision (rows' pct_of_matmul)
    "fp32": "matmul_fp32_tflops",
    "tf32": "matmul_tf32_tflops",
    "bf16": "matmul_bf16_tflops",
}
PRECISIONS = {  # name -> (dtype, allow_tf32)
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
}


def _with_tf32(fn, allow: bool):
    def call():
        with tf32_matmuls(allow):
            return fn()

    return call


def _model_arm(model, inputs):
    def call():
        with torch.no_grad():
            return model(*inputs)

    return call


def _compiled_arm(model, inputs, mode: str, tf32: bool):
    compiled = torch.compile(model, dynamic=False, mode=mode)
    return _with_tf32(_model_arm(compiled, inputs), tf32)


STAGE_BATCHES = (4096, 65536)  # bf16, uniform ids: the per-stage breakdown
STAGE_CALLS = 10


def _stage_times(calls) -> dict[str, float]:
    """GPU microseconds per call of each stage, from the profiler: ``calls()`` runs one
    forward whose stages sit in ``record_function`` ranges named dlrm.<stage>. A stage's
    time is the sum of the kernels that ran inside its range on the GPU timeline (the
    range's own span would count the idle gaps of a host-bound eager call too)."""
    for _ in range(3):
        calls()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:  # (ranges are CPU events)
        for _ in range(STAGE_CALLS):
            calls()
        torch.cuda.synchronize()
    return stage_kernel_us(prof.events(), STAGE_CALLS)


def stage_kernel_us(events, calls: int) -> dict[str, float]:
    """{stage: kernel microseconds per call} from profiler events: the GPU-side spans of
    the dlrm.<stage> ranges and the kernels whose start lies in one."""
    cuda = torch.autograd.DeviceType.CUDA
    spans, kernels = [], []
    for e in events:
        if e.device_type != cuda:
            continue
        if e.name.startswith("dlrm."):
            spans.append((e.time_range.start, e.time_range.end, e.name.removeprefix("dlrm.")))
        else:
            kernels.append((e.time_range.start, e.time_range.end - e.time_range.start))
    spans.sort()
    totals: dict[str, float] = {}
    for start, dur in kernels:
        for lo, hi, stage in spans:
            if lo <= start < hi:
                totals[stage] = totals.get(stage, 0.0) + dur
                break
    return {stage: us / calls for stage, us in totals.items()}


def _stages_measure(model, fused_model, inputs):
    """measure(settings) of a per-stage breakdown: fuseml's stages as the optimized model
    runs them (its profile ranges), torch.compile's with each stage compiled apart (the
    bottom MLP, gather + interaction, the top MLP + sigmoid)."""

    def measure(settings) -> dict[str, dict]:
        dense, sparse = inputs
        rows = {}
        with torch.no_grad():
            with stage_ranges(fused_model, nvtx=False):
                fuseml_us = _stage_times(lambda: fused_model(dense, sparse))
            bottom = torch.compile(model.bottom_mlp, dynamic=False)
            middle = torch.compile(
                lambda x, s: model.interaction(x, model.embeddings(s)), dynamic=False
            )
            top = torch.compile(lambda z: torch.sigmoid(model.top_mlp(z).squeeze(1)), dynamic=False)

            def compiled_forward():
                rf = torch.profiler.record_function
                with rf("dlrm.bottom_mlp"):
                    x = bottom(dense)
                with rf("dlrm.embedding_interaction"):
                    z = middle(x, sparse)
                with rf("dlrm.top_mlp"):
                    return top(z)

            compile_us = _stage_times(compiled_forward)
        for arm, times in (("fuseml", fuseml_us), ("compile", compile_us)):
            for stage, us in times.items():
                rows[f"{arm}:{stage}"] = {"mode": "stage", "stage": stage, "p50_ms": us / 1e3}
        return rows

    return measure


class _Groups:
    """The models of one (config, precision, ids) group at a time: built on the first read
    of one of its cases' arms, freed before another group is built. Listing the suite builds
    nothing (``--cases`` builds only the groups it runs); all groups at once, each with an
    optimized copy, would hold ~120 GB at the full Kaggle tables."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.built: dict | None = None

    def get(self, key: tuple, build) -> dict:
        if self.key != key:
            self.key = self.built = None
            gc.collect()  # (the previous group's models, before the next one's)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.built = build()
            self.key = key
        return self.built


_groups = _Groups()


class _LazyArms(Mapping):
    """A case's arms, by name from the start, their callables from its group once read."""

    def __init__(self, names: tuple[str, ...], resolve) -> None:
        self._names, self._resolve = names, resolve

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        return self._resolve()[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _build_group(config, precision, ids, batches, quick, device, max_cardinality) -> dict:
    """{"arms": {batch: {arm: fn}}, "stages": {batch: measure}, "model"} of one group: one
    model (the cases share it) and one optimized copy of it."""
    dtype, tf32 = PRECISIONS[precision]
    dl_cases = dlrm_inference_cases(
        config, batches, dtype, device, max_cardinality=max_cardinality, ids=ids
    )
    fused_model = fuseml.optimize(dl_cases[0].model)[0]
    arms, stages = {}, {}
    for dc in dl_cases:
        make = {
            "eager": lambda dc=dc: _with_tf32(dc.arms["eager"], tf32),
            "compile": lambda dc=dc: _with_tf32(dc.arms["compile"], tf32),
            "fuseml": lambda dc=dc: _with_tf32(_model_arm(fused_model, dc.inputs), tf32),
            "fuseml-compile": lambda dc=dc: _compiled_arm(fused_model, dc.inputs, None, tf32),
            "compile-max": lambda dc=dc: _compiled_arm(
                dc.model, dc.inputs, "max-autotune-no-cudagraphs", tf32
            ),
        }
        names = _arm_names(quick, precision, ids, dc.batch_size)
        arms[dc.batch_size] = {name: make[name]() for name in names}
        stages[dc.batch_size] = _stages_measure(dc.model, fused_model, dc.inputs)
    return {"arms": arms, "stages": stages, "model": dl_cases[0].model}


def _arm_names(quick: bool, precision: str, ids: str, batch: int) -> tuple[str, ...]:
    """The arms of one case, named before its group's models are built."""
    names = ("eager", "compile", "fuseml")
    if precision == "bf16":  # (minutes of compilation per case)
        names += ("fuseml-compile",)
    if not quick and ids == "uniform" and (precision, batch) in MAX_AUTOTUNE_AT:
        names += ("compile-max",)  # (minutes of autotuning per compilation: two per config)
    return names


def cases(
    quick: bool = False,
    cuda: bool = True,
    *,
    device: str = "cuda",
    max_cardinality: int | None = MAX_CARDINALITY,
):
    """The suite's cases; each group's models are built when a case of it first runs.
    device, max_cardinality: for tests (the suite runs on CUDA over the full tables)."""
    configs = ["kaggle"] if quick else ["kaggle", "mlperf"]
    precisions = ["fp32", "bf16"] if quick else list(PRECISIONS)
    batches = BATCHES_QUICK if quick else BATCHES_FULL
    for config in configs:
        cfg = DLRMConfig.from_name(config, max_cardinality=max_cardinality)
        for precision, ids in [(p, "uniform") for p in precisions] + [("bf16", "zipf")]:
            dtype, tf32 = PRECISIONS[precision]
            key = (config, precision, ids, tuple(batches), quick, device, max_cardinality)

            def group(key=key) -> dict:
                return _groups.get(key, lambda: _build_group(*key))

            for batch in batches:
                names = _arm_names(quick, precision, ids, batch)
                law = "" if ids == "uniform" else f"/{ids}"
                params = {
                    "config": config,
                    "precision": precision,
                    "ids": ids,
                    "batch": batch,
                    "numel": batch,
                }
                flops, traffic = dlrm_work(cfg, batch, dtype)
                yield Case(
                    suite="dlrm",
                    name=f"{config}/{precision}{law}/bs{batch}",
                    params=params,
                    make_inputs=tuple,  # the arms close over their own inputs
                    arms=_LazyArms(names, lambda g=group, b=batch: g()["arms"][b]),
                    samples=batch,
                    flops=flops,
                    bytes=traffic,
                    ceiling=CEILINGS[precision],
                    graph=True,
                    # (fuseml: its first call tunes)
                    compile_arms=("compile", "compile-max", "fuseml", "fuseml-compile"),
                    dtype=dtype,
                    tf32=tf32,
                )
                if precision == "bf16" and ids == "uniform" and batch in STAGE_BATCHES:
                    yield Case(
                        suite="dlrm",
                        name=f"{config}/{precision}/bs{batch}/stages",
                        params=params,
                        make_inputs=tuple,
                        arms={},
                        check=False,
                        dtype=dtype,
                        measure=lambda settings, g=group, b=batch: g()["stages"][b](settings),
                    )


PLOT = {
    "x": "batch",
    "panels": ("config", "precision", "ids"),
    "xlabel": "batch size",
    "logx": True,
}
README = {
    "rows": ("config", "precision", "ids", "batch"),
    "arms": (
        "eager",
        "eager+graph",
        "compile",
        "compile+graph",
        "compile-max",
        "fuseml",
        "fuseml+graph",
        "fuseml-compile",
        "fuseml-compile+graph",
    ),
    "graph_arms": ("eager", "compile", "fuseml", "fuseml-compile"),
    "min_numel": 0,
    "cell": "samples",
    "sort": "numeric",
    "compare": False,
    "ceilings": False,
    "note": (
        "Cells: samples/s (p50 / p99 latency per batch). +graph: the same forward captured "
        "once in a CUDA graph and replayed (no host launch cost), as a server would run it. "
        "fuseml: fuseml.optimize(model) as of the row's commit (its first call per batch "
        "size tunes the kernels); fuseml-compile: torch.compile of it (bf16)."
    ),
    "first_call_arms": ("compile", "compile-max", "fuseml", "fuseml-compile"),
}
