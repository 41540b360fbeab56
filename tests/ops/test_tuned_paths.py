"""Every path that tunes, pads, keeps a derived copy or keeps a launch plan, run as users
run it: tuning on (the suite's default is off), an empty tuning cache, then a warm one;
first and repeat calls; another row count of the same tuning bucket; inside a CUDA graph;
after an in-place write to a weight. Outputs are poisoned with NaN before each call: the
allocator's free blocks (``poison_allocator``) for eager calls, the graph's own output
before a replay. Each stage is checked against a float64 reference."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import fuseml
from fuseml.ops import _tune, _utils
from fuseml.testing import (
    assert_close_verbose,
    capture_graph,
    poison_allocator,
    replay_poisoned,
    requires_cuda,
)

pytestmark = [pytest.mark.gpu, requires_cuda]
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Path:
    """One tuned path: ``params(dtype)`` makes the weights (kept across calls: what a
    derived copy is made from), ``rows(m, params)`` the per-call inputs; ``call`` the
    fused op, ``ref`` the reference (called on float64 copies)."""

    params: Callable[[torch.dtype], dict]
    rows: Callable[[int, dict], dict]
    call: Callable[[dict, dict], torch.Tensor]
    ref: Callable[[dict, dict], torch.Tensor]
    m: int  # rows of the tuning call
    other_m: int  # rows of a later call in the same tuning bucket
    dtype: torch.dtype = BF16
    tunes: bool = True  # writes a tuning-table entry


def _w(n, k, dtype):
    bound = 1 / math.sqrt(k)
    return torch.empty(n, k, device="cuda").uniform_(-bound, bound).to(dtype)


def _linear(k, n, *, residual=False, act="relu", m=4096, other_m=3001, dtype=BF16):
    def params(dt):
        return {"w": _w(n, k, dt), "b": torch.randn(n, device="cuda").to(dt) * 0.1}

    def rows(m, p):
        r = {"x": torch.randn(m, k, device="cuda").to(p["w"].dtype)}
        if residual:
            r["res"] = torch.randn(m, n, device="cuda").to(p["w"].dtype)
        return r

    def call(r, p, op=fuseml.ops.linear):
        return op(r["x"], p["w"], p["b"], act, r.get("res"))

    return Path(
        params, rows, call, lambda r, p: call(r, p, fuseml.ops.linear_ref), m, other_m, dtype
    )


def _mlp(widths, acts, *, m, other_m, dtype=BF16):
    def params(dt):
        ws = [_w(n, k, dt) for k, n in itertools.pairwise(widths)]
        return {f"w{i}": w for i, w in enumerate(ws)} | {
            f"b{i}": torch.randn(w.shape[0], device="cuda").to(dt) * 0.1 for i, w in enumerate(ws)
        }

    def rows(m, p):
        return {"x": torch.randn(m, widths[0], device="cuda").to(p["w0"].dtype)}

    n = len(widths) - 1
    acts = [acts] * n if isinstance(acts, str) else acts

    def call(r, p, op=fuseml.ops.mlp):
        return op(r["x"], [p[f"w{i}"] for i in range(n)], [p[f"b{i}"] for i in range(n)], acts)

    return Path(params, rows, call, lambda r, p: call(r, p, fuseml.ops.mlp_ref), m, other_m, dtype)


def _lora(adapters, rank, *, m, other_m, hidden=4096):
    def params(dt):
        lead = () if adapters is None else (adapters,)
        return {
            "w": _w(hidden, hidden, dt),
            "b": torch.randn(hidden, device="cuda").to(dt) * 0.1,
            "a": (torch.rand(*lead, rank, hidden, device="cuda") * 2 - 1).to(dt) / hidden**0.5,
            "bb": (torch.randn(*lead, hidden, rank, device="cuda") / rank**0.5).to(dt),
        }

    def rows(m, p):
        r = {"x": torch.randn(m, hidden, device="cuda").to(p["w"].dtype)}
        if adapters is not None:  # every row an adapter, one in 8 none (-1)
            r["ids"] = torch.randint(-1, adapters, (m,), device="cuda")
        return r

    def call(r, p):
        ids = r.get("ids")
        kw = {} if ids is None else {"adapter_ids": ids, "check_ids": False}  # (no host sync)
        return fuseml.ops.lora_linear(r["x"], p["w"], p["b"], p["a"], p["bb"], 2.0, **kw)

    def ref(r, p):
        ids = r.get("ids")
        if ids is not None:
            ids = ids.long()
        return fuseml.ops.lora_linear_ref(
            r["x"], p["w"], p["b"], p["a"], p["bb"], 2.0, adapter_ids=ids
        )

    return Path(params, rows, call, ref, m, other_m)


def _softmax(n, *, m, other_m):
    def rows(m, p):
        return {"x": torch.randn(m, n, device="cuda").to(BF16) * 4}

    return Path(
        lambda dt: {},
        rows,
        lambda r, p: fuseml.ops.softmax(r["x"]),
        lambda r, p: torch.softmax(r["x"], -1),
        m,
        other_m,
        tunes=False,
    )


def _bias_act(n, *, m, other_m):
    def rows(m, p):
        return {
            "x": torch.randn(m, n, device="cuda").to(BF16),
            "res": torch.randn(m, n, device="cuda").to(BF16),
        }

    def call(r, p, op=fuseml.ops.bias_act):
        return op(r["x"], p["b"], r["res"], 0.5, "gelu")

    return Path(
        lambda dt: {"b": torch.randn(n, device="cuda").to(dt)},
        rows,
        call,
        lambda r, p: call(r, p, fuseml.ops.bias_act_ref),
        m,
        other_m,
        tunes=False,
    )


KAGGLE_TOP = (367, 512, 256, 1)
ACTS_TOP = ["relu", "relu", "sigmoid"]
KAGGLE_BOTTOM = (13, 512, 256, 64, 16)
MLPERF_TOP = (479, 1024, 1024, 512, 256, 1)
PATHS = {
    # K = 367: x padded per call, W padded once and kept (from 128 rows)
    "linear-padded-k": _linear(367, 512),
    "linear-padded-k-128": _linear(367, 512, m=128, other_m=100),  # 100 rows: not padded
    "linear-unaligned": _linear(367, 512, m=64, other_m=40),  # raw rows, REG_PIPE tiles
    "linear-residual": _linear(512, 256, residual=True, act="gelu"),
    "linear-narrow": _linear(64, 16, m=4096, other_m=2500),  # tuned over both kernels
    "linear-decode": _linear(4096, 4096, act="none", m=16, other_m=9),
    "linear-fp32": _linear(256, 128, m=1024, other_m=700, dtype=torch.float32),
    "mlp-chain": _mlp(KAGGLE_BOTTOM, "relu", m=4096, other_m=3000),
    "mlp-chain-large": _mlp(KAGGLE_BOTTOM, "relu", m=16384, other_m=10000),
    "mlp-top": _mlp(KAGGLE_TOP, ACTS_TOP, m=4096, other_m=3001),  # the reported failure
    "mlp-top-large": _mlp(KAGGLE_TOP, ACTS_TOP, m=16384, other_m=9000),
    "mlp-mlperf-top": _mlp(MLPERF_TOP, ["relu"] * 4 + ["sigmoid"], m=4096, other_m=2100),
    "mlp-fp32": _mlp(KAGGLE_BOTTOM, "relu", m=4096, other_m=3000, dtype=torch.float32),
    "lora-decode": _lora(None, 16, m=16, other_m=11),
    "lora": _lora(None, 16, m=4096, other_m=3000),
    "lora-multi": _lora(4, 16, m=1024, other_m=600),  # a stacked B kept (above B3D_MAX_M)
    "lora-multi-large": _lora(4, 16, m=4096, other_m=2500),
    "lora-multi-wide": _lora(16, 16, m=64, other_m=40),  # the spread mode's shapes
    "softmax": _softmax(1000, m=4096, other_m=3001),
    "softmax-split": _softmax(65536, m=64, other_m=33),  # split rows: counter slabs
    "bias-act": _bias_act(1000, m=4096, other_m=3001),
}


def _ref64(path: Path, rows: dict, params: dict) -> torch.Tensor:
    def up(d):
        return {k: v.double() if v.is_floating_point() else v for k, v in d.items()}

    return path.ref(up(rows), up(params))


def _check(path: Path, out, rows, params, stage: str) -> None:
    try:
        assert_close_verbose(out, _ref64(path, rows, params), path.dtype)
    except AssertionError as err:
        raise AssertionError(f"{stage}: {err}") from None


def _eager(path: Path, rows, params) -> torch.Tensor:
    poison_allocator()
    with torch.no_grad():
        return path.call(rows, params)


@pytest.mark.parametrize("name", list(PATHS))
def test_tuned_path_gpu(name, fresh_tuning, monkeypatch):
    path = PATHS[name]
    params = path.params(path.dtype)
    rows = path.rows(path.m, params)

    first = _eager(path, rows, params)  # tunes
    _check(path, first, rows, params, "first call (tuning)")
    if path.tunes:
        assert _tune.entry_count()[0] >= 1, "the first call did not tune"
    assert torch.equal(_eager(path, rows, params), first), "repeat call differs from the first"

    other = path.rows(path.other_m, params)  # the bucket's config at another row count
    _check(path, _eager(path, other, params), other, params, f"{path.other_m} rows")

    # A new process: the on-disk table, nothing remembered, no kept copies
    monkeypatch.setattr(_tune, "_memo", {})
    monkeypatch.setattr(_tune, "_tables", {})
    monkeypatch.setattr(_utils, "_KEPT", {})
    entries = _tune.entry_count()[0]
    warm = _eager(path, rows, params)
    _check(path, warm, rows, params, "warm cache")
    assert _tune.entry_count()[0] == entries, "the warm call tuned again"

    # In a CUDA graph, after the eager calls above
    graph, static = capture_graph(lambda: path.call(rows, params))
    _check(path, replay_poisoned(graph, static), rows, params, "graph replay")
    fresh = path.rows(path.m, params)
    for key, t in rows.items():
        t.copy_(fresh[key])
    _check(path, replay_poisoned(graph, static), rows, params, "graph replay, new inputs")

    # An in-place write to the weights: kept copies must follow it, and so must the graph
    if params:
        with torch.no_grad():
            for t in params.values():
                t.mul_(0.5)
        _check(path, _eager(path, rows, params), rows, params, "after an in-place weight update")
        _check(
            path, replay_poisoned(graph, static), rows, params,
            "graph replay after an in-place weight update",
        )  # fmt: skip


SIDE_STREAM = ["linear-padded-k", "mlp-top", "mlp-chain", "lora-multi", "softmax-split"]


@pytest.mark.parametrize("name", SIDE_STREAM)
def test_tuned_path_first_call_on_a_side_stream_gpu(name, fresh_tuning):
    """The first (tuning) call made on a stream of the caller's, inputs written on the
    default stream just before: tuning's own timing streams must not race with either."""
    path = PATHS[name]
    params = path.params(path.dtype)
    rows = path.rows(path.m, params)
    poison_allocator()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        first = path.call(rows, params)
        again = path.call(rows, params)
    torch.cuda.current_stream().wait_stream(stream)
    _check(path, first, rows, params, "first call on a side stream")
    assert torch.equal(again, first), "repeat call on the side stream differs"
