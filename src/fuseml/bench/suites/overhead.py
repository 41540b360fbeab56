"""Suite ``overhead``: host time per eager call of every public op and of
``fuseml.optimize``d models at host-bound sizes, against the torch equivalent, in one run.

At these sizes the GPU work of a call takes a few microseconds, so a loop of eager calls
runs at the speed of the host: what validation, dispatch, allocation and the launches cost
the CPU. Each case times the wall time of a loop of calls per arm (the GPU synchronized
before and after each loop, so a call whose GPU work outlasts its host time counts the
GPU's), REPEATS loops, the arms' loops in turns (an arm whose spread stays wide is timed
again: suites._common.walls_in_turns), after a warm-up that also tunes and compiles.

Arms
  torch     the nearest torch equivalent: one op where torch has one (F.gelu,
            torch.softmax, torch.add, F.linear), the unfused chain otherwise (bias + act,
            F.linear + act, the MLP's layers, the unmerged LoRA layer, the DLRM model's
            embedding + interaction, the plain model, the peft model as peft runs it)
  cublaslt  linear + activation in cuBLASLt's epilogue (torch._addmm_activation)
  merged    the LoRA layer with its adapter merged into the weight (one GEMM); for the
            peft model, peft's merge_and_unload()
  fuseml    the fuseml op (backend auto), or the fuseml.optimize'd model
Cells: microseconds of wall time per call (median over the loops, p20-p80 beside it).
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import time

import torch
import torch.nn.functional as F

import fuseml
from fuseml.bench.harness import Case, Settings
from fuseml.bench.suites._common import (
    mlp_top_model,
    peft_mlp_model,
    timing_fields,
    walls_in_turns,
)
from fuseml.ops.embedding_interaction import embedding_interaction_ref

ITERS_FULL, ITERS_QUICK = 2000, 500
REPEATS_FULL, REPEATS_QUICK = 7, 3
DTYPE = torch.bfloat16


def _measure(build):
    """measure(settings) of a case whose ``build()`` returns {arm: fn()} on the GPU."""

    def measure(settings: Settings) -> dict[str, dict]:
        arms = build()
        iters = ITERS_QUICK if settings.quick else ITERS_FULL
        repeats = REPEATS_QUICK if settings.quick else REPEATS_FULL
        warmup = {}
        with torch.no_grad():
            for arm, fn in arms.items():
                t0 = time.perf_counter()
                for _ in range(3):  # first calls: tuning, compilation, caches
                    fn()
                torch.cuda.synchronize()
                warmup[arm] = round(time.perf_counter() - t0, 3)
            walls = walls_in_turns(arms, dict.fromkeys(arms, iters), repeats)
        return {
            arm: {
                "mode": "host",
                **timing_fields(t, host_us=round(t.quantiles[0] * 1e3, 2), iters=iters),
                "warmup_s": warmup[arm],
            }
            for arm, t in walls.items()
        }

    return measure


def _t(*shape, scale: float = 1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(DTYPE)


def _ops() -> list[tuple[str, str, object]]:
    """(name, shape label, build) of the op cases."""

    def gelu():
        x = _t(64, 512)
        return {"torch": lambda: F.gelu(x), "fuseml": lambda: fuseml.ops.gelu(x)}

    def softmax():
        x = _t(64, 512)
        return {
            "torch": lambda: torch.softmax(x, -1),
            "fuseml": lambda: fuseml.ops.softmax(x, -1),
        }

    def add():
        x, y = _t(64, 512), _t(64, 512)
        return {"torch": lambda: torch.add(x, y), "fuseml": lambda: fuseml.ops.add(x, y)}

    def bias_relu():
        x, b = _t(64, 512), _t(512)
        return {
            "torch": lambda: torch.relu(x + b),
            "fuseml": lambda: fuseml.ops.bias_act(x, b, activation="relu"),
        }

    def linear_relu(m: int, k: int, n: int):  # F.linear + ReLU; cuBLASLt's fused epilogue
        def build():
            x, w, b = _t(m, k), _t(n, k, scale=k**-0.5), _t(n)
            return {
                "torch": lambda: torch.relu(F.linear(x, w, b)),
                "cublaslt": lambda: torch._addmm_activation(b, x, w.t()),
                "fuseml": lambda: fuseml.ops.linear(x, w, b, "relu"),
            }

        return build

    def linear_small():
        x, w, b = _t(64, 64), _t(16, 64, scale=0.1), _t(16)
        return {"torch": lambda: F.linear(x, w, b), "fuseml": lambda: fuseml.ops.linear(x, w, b)}

    def mlp(rows: int, widths: tuple, acts: tuple):
        def build():
            x = _t(rows, widths[0])
            ws = [_t(o, i, scale=i**-0.5) for i, o in itertools.pairwise(widths)]
            bs = [_t(o) for o in widths[1:]]
            fns = [torch.relu if a == "relu" else torch.sigmoid for a in acts]

            def chain():
                h = x
                for w, b, fn in zip(ws, bs, fns):
                    h = fn(F.linear(h, w, b))
                return h

            return {"torch": chain, "fuseml": lambda: fuseml.ops.mlp(x, ws, bs, list(acts))}

        return build

    def lora(rows: int):  # one adapter of rank 16 on a 4096-wide layer
        def build():
            k = n = 4096
            x, w, b = _t(rows, k), _t(n, k, scale=k**-0.5), _t(n)
            a, bb = _t(16, k, scale=k**-0.5), _t(n, 16, scale=0.25)
            merged = w + 0.5 * (bb @ a)
            return {
                "torch": lambda: F.linear(x, w, b) + 0.5 * F.linear(F.linear(x, a), bb),
                "merged": lambda: F.linear(x, merged, b),
                "fuseml": lambda: fuseml.ops.lora_linear(x, w, b, a, bb, 0.5),
            }

        return build

    def interaction():  # kaggle: 26 tables, d = 16
        cards = torch.full((26,), 10_000)
        offsets = torch.zeros(27, dtype=torch.int64, device="cuda")
        offsets[1:] = torch.cumsum(cards, 0).cuda()
        weight = _t(int(cards.sum()), 16, scale=0.05)
        x = _t(64, 16)
        ids = torch.randint(0, 10_000, (64, 26), device="cuda", dtype=torch.int32)
        return {
            "torch": lambda: embedding_interaction_ref(x, weight, offsets, ids, out_width=368),
            "fuseml": lambda: fuseml.ops.embedding_interaction(
                x, weight, offsets, ids, out_width=368
            ),
        }

    return [
        ("gelu", "64x512", gelu),
        ("softmax", "64x512", softmax),
        ("add", "64x512", add),
        ("bias_act relu", "64x512", bias_relu),
        ("linear relu", "64x512->256", linear_relu(64, 512, 256)),
        ("linear", "64x64->16", linear_small),
        ("linear relu", "512x1024->1024", linear_relu(512, 1024, 1024)),
        # the DLRM top MLP's first layer: rows of 734 bytes, K padded to 368
        ("linear relu", "4096x367->512", linear_relu(4096, 367, 512)),
        ("mlp", "64x13-512-256-64-16", mlp(64, (13, 512, 256, 64, 16), ("relu",) * 4)),
        # the kaggle top MLP at a serving batch: its first layer's K (367) is padded and
        # tuning splits the chain (a GEMM, then the chain kernel)
        ("mlp", "4096x367-512-256-1", mlp(4096, (367, 512, 256, 1), ("relu", "relu", "sigmoid"))),
        ("lora_linear", "16x4096->4096 r16", lora(16)),
        ("lora_linear", "512x4096->4096 r16", lora(512)),
        ("embedding_interaction", "64x26x16", interaction),
    ]


def _models() -> list[tuple[str, str, object]]:
    """(name, shape label, build) of the whole-model cases (fuseml.optimize)."""

    def dlrm(config: str):
        def build():
            from fuseml.models.bench_cases import random_inputs
            from fuseml.models.dlrm import DLRM, DLRMConfig

            cfg = DLRMConfig.from_name(config, max_cardinality=100_000)
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = DLRM(cfg)
            model = model.to(DTYPE).eval()
            model.embeddings.check_ids = False  # a host sync each call: not dispatch cost
            fused, _ = fuseml.optimize(model)
            dense, sparse = random_inputs(cfg, 64, "cuda", DTYPE)
            return {"torch": lambda: model(dense, sparse), "fuseml": lambda: fused(dense, sparse)}

        return build

    def mlp_model():  # the kaggle top MLP as users write it
        model = mlp_top_model(DTYPE)
        fused, _ = fuseml.optimize(copy.deepcopy(model))
        x = _t(64, 367)
        return {"torch": lambda: model(x), "fuseml": lambda: fused(x)}

    def peft_model():  # peft's default LoRA on a 4096-wide MLP; merged: merge_and_unload
        pm, merged = peft_mlp_model(DTYPE)
        fused, _ = fuseml.optimize(copy.deepcopy(pm))
        x = _t(16, 4096)
        return {"torch": lambda: pm(x), "merged": lambda: merged(x), "fuseml": lambda: fused(x)}

    models = [
        ("DLRM kaggle", "B=64", dlrm("kaggle")),
        ("DLRM mlperf", "B=64", dlrm("mlperf")),
        ("MLP kaggle top", "B=64", mlp_model),
    ]
    if importlib.util.find_spec("peft") is not None:
        models.append(("peft LoRA MLP", "B=16 4096x3 r16", peft_model))
    return models


def cases(quick: bool = False, cuda: bool = True):
    for kind, table in (("op", _ops()), ("model", _models())):
        for name, shape, build in table:
            yield Case(
                suite="overhead",
                name=f"{kind}/{name}/{shape}",
                params={"kind": kind, "name": name, "shape": shape, "numel": 0},
                make_inputs=tuple,
                arms={},
                check=False,
                dtype=DTYPE,
                measure=_measure(build),
            )


PLOT = None  # a table says it all
README = {
    "mode": "host",
    "rows": ("kind", "name", "shape"),
    "arms": ("torch", "cublaslt", "merged", "fuseml"),
    "fused": "fuseml",
    "ceilings": False,
    "note": (
        "Cells: wall time per eager call (the GPU synchronized after each loop of calls; at "
        "these sizes the host sets the pace), median over loops of calls after a warm-up "
        "that tunes and compiles. torch: the nearest torch equivalent (one op where torch "
        "has one, the unfused chain otherwise); cublaslt: torch._addmm_activation; merged: the LoRA adapter merged into the weight. "
        "fuseml vs best peer above 1.00x: fuseml's call is cheaper."
    ),
}
