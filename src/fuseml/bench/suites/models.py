"""Suite ``models``: whole models as users run them, per batch: called eagerly (wall time
per call) and replayed from a CUDA graph (GPU time per call), next to torch.compile of
the model and of the ``fuseml.optimize``d model, bf16.

Models
  MLP kaggle top   nn.Sequential 367-512-256-1 (Linear, ReLU, Linear, ReLU, Linear), as
                   users write DLRM's top MLP; 64, 4096 and 65536 rows
  peft LoRA MLP    a 4096-wide 3-layer GELU MLP with peft's default LoRA on every Linear
                   (r = 16, adapters in float32 over the bf16 base, as get_peft_model makes
                   them; lora_B drawn at random, as after training); 16, 512 and 4096 rows
(DLRM is the ``dlrm`` suite's.)

Arms
  torch           the model (for peft: peft's own forward)
  merged          peft's merge_and_unload(): one GEMM per layer (peft model only)
  compile         torch.compile(model) (default mode)
  fuseml          fuseml.optimize(model)
  fuseml-compile  torch.compile(fuseml.optimize(model)) (default mode)
Rows of mode "wall": a loop of eager calls, the GPU synchronized before and after it (what
a caller waits for: the host's time per call or the GPU's, whichever is longer), median
over loops, the arms' loops in turns (suites._common.walls_in_turns; an arm whose spread
stays wide is timed again, noise.py); rows of mode "graph": GRAPH_CALLS calls captured in
one CUDA graph, replayed (do_bench), per call, timed again where far from the committed
median. Every arm's output is checked against the torch arm's (tolerance of bf16; the
merged arm differs from the unmerged model by rounding W + s B A to bf16).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import time

import torch

import fuseml
from fuseml.bench.harness import Case, Settings, bench_graph_ms
from fuseml.bench.noise import settle
from fuseml.bench.suites._common import (
    mlp_top_model,
    peft_mlp_model,
    timing_fields,
    walls_in_turns,
)
from fuseml.testing import rel_err, tolerance

DTYPE = torch.bfloat16
ITERS_FULL, ITERS_QUICK = 400, 100
REPEATS_FULL, REPEATS_QUICK = 7, 3
MIN_LOOP_S = 0.05  # a loop of eager calls lasts at least this long


def _mlp_top():
    return mlp_top_model(DTYPE), 367, None


def _peft_mlp():
    pm, merged = peft_mlp_model(DTYPE)
    return pm, 4096, merged


# name -> (build() -> (model, in_features, merged model or None), rows, rows in quick mode)
MODELS = {
    "MLP kaggle top": (_mlp_top, (64, 4096, 65536), (64, 65536)),
    "peft LoRA MLP": (_peft_mlp, (16, 512, 4096), (16, 512, 4096)),
}


def _arms(name: str) -> tuple[dict[str, object], int]:
    """({arm: module}, in_features) of one model (built once, shared by its row counts)."""
    model, in_features, merged = MODELS[name][0]()
    fused, _ = fuseml.optimize(copy.deepcopy(model))
    arms = {"torch": model}
    if merged is not None:
        arms["merged"] = merged
    arms["compile"] = torch.compile(model, dynamic=False)
    arms["fuseml"] = fused
    arms["fuseml-compile"] = torch.compile(fused, dynamic=False)
    return arms, in_features


def _measure(rows: int, arms_of):
    def measure(settings: Settings) -> dict[str, list[dict]]:
        arms, in_features = arms_of()
        x = torch.randn(rows, in_features, device="cuda").to(DTYPE)
        iters = ITERS_QUICK if settings.quick else ITERS_FULL
        repeats = REPEATS_QUICK if settings.quick else REPEATS_FULL
        fns = {arm: (lambda m=module: m(x)) for arm, module in arms.items()}
        fields: dict[str, dict] = {}
        loops: dict[str, int] = {}
        with torch.no_grad():
            ref = arms["torch"](x)
            for arm, fn in fns.items():
                t0 = time.perf_counter()
                first = fn()
                torch.cuda.synchronize()
                fields[arm] = {"compile_s": round(time.perf_counter() - t0, 3)}
                if arm != "torch":
                    err = rel_err(first, ref)
                    fields[arm].update(
                        rel_err_vs_ref=err, matches_ref=bool(err <= tolerance(DTYPE))
                    )
                for _ in range(2):  # the first calls: tuning, compilation, graph capture
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                one = time.perf_counter() - t0
                n = max(iters, min(20 * iters, int(MIN_LOOP_S / max(one, 1e-6))))
                loops[arm] = min(n, max(10, int(2.0 / max(one, 1e-6))))  # at most ~2 s a loop
            walls = walls_in_turns(fns, loops, repeats)
            graph_past = {arm: settings.history.get((arm, "graph")) for arm in fns}
            graphs = {}
            for arm, fn in fns.items():
                try:
                    graphs[arm] = settle(
                        lambda names, fn=fn: {names[0]: bench_graph_ms(fn, [()], settings)},
                        [arm], {arm: graph_past[arm]},
                    )[arm]  # fmt: skip
                except Exception as e:  # a row of its own says why
                    graphs[arm] = f"{type(e).__name__}: {e}"
        out: dict[str, list[dict]] = {}
        for arm in fns:
            out[arm] = [
                {"mode": "wall", **timing_fields(walls[arm], iters=loops[arm]), **fields[arm]}
            ]
            g = graphs[arm]
            if isinstance(g, str):
                out[arm].append({"mode": "graph", "error": g})
            else:
                out[arm].append({"mode": "graph", **timing_fields(g), **fields[arm]})
        return out

    return measure


def cases(quick: bool = False, cuda: bool = True):
    for name, (_, rows_full, rows_quick) in MODELS.items():
        if name.startswith("peft") and importlib.util.find_spec("peft") is None:
            continue
        arms_of = functools.cache(functools.partial(_arms, name))  # built once, lazily

        for rows in rows_quick if quick else rows_full:
            yield Case(
                suite="models",
                name=f"{name}/B={rows}",
                params={"model": name, "batch": rows, "numel": rows},
                make_inputs=tuple,
                arms={},
                samples=rows,
                check=False,
                dtype=DTYPE,
                measure=_measure(rows, arms_of),
            )


PLOT = None


def _table(mode: str, note: str) -> dict:
    """A README table of one mode's rows: every arm, fuseml against the peers
    (fuseml-compile shown beside compile, not a peer)."""
    return {
        "mode": mode,
        "graph_arms": (),
        "rows": ("model", "batch"),
        "arms": ("torch", "merged", "compile", "fuseml", "fuseml-compile"),
        "fused": "fuseml",
        "reference_arms": ("fuseml-compile",),
        "sort": "numeric",
        "ceilings": False,
        "note": note,
    }


README = [
    _table(
        "wall",
        "Eager calls. Cells: wall time per call (a loop of calls, the GPU synchronized after "
        "it), median over loops. merged: peft's merge_and_unload(); fuseml-compile: "
        "torch.compile(fuseml.optimize(model)), compared with compile.",
    ),
    _table(
        "graph",
        "CUDA-graph replays. Cells: GPU time per call of calls captured in one graph.",
    ),
]
