"""``fuseml.cuda_graphs``: how calls are planned into buckets (CPU), argument checks (CPU),
and on a GPU the served model against the eager one at batches below, on and above the
buckets, with repeat calls, mismatched inputs and NaN-poisoned static outputs."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from torch import nn

import fuseml
from fuseml.models.dlrm import DLRM, DLRMConfig
from fuseml.serving import (
    DEFAULT_BATCH_SIZES,
    CudaGraphs,
    _fill,
    _flatten,
    _Leaf,
    _outputs,
    _unflatten,
    bucket_for,
    cuda_graphs,
    plan_batches,
)
from fuseml.testing import assert_close_verbose, capture_graph, poison_, requires_cuda

# --- planning (pure) ------------------------------------------------------------------


def test_default_buckets_are_powers_of_two_to_65536():
    assert DEFAULT_BATCH_SIZES[0] == 1 and DEFAULT_BATCH_SIZES[-1] == 65536
    assert all(b == 1 << i for i, b in enumerate(DEFAULT_BATCH_SIZES))


@pytest.mark.parametrize(
    "rows, expected",
    [(1, 1), (2, 4), (4, 4), (5, 16), (16, 16)],
)
def test_bucket_for_is_the_smallest_that_holds(rows, expected):
    assert bucket_for(rows, (1, 4, 16)) == expected


def test_bucket_for_above_the_largest():
    with pytest.raises(ValueError, match="exceed the largest bucket 16"):
        bucket_for(17, (1, 4, 16))


@pytest.mark.parametrize(
    "rows, expected",
    [
        (0, []),
        (1, [(0, 1, 1)]),
        (3, [(0, 3, 4)]),
        (16, [(0, 16, 16)]),
        (17, [(0, 16, 16), (16, 17, 1)]),
        (35, [(0, 16, 16), (16, 32, 16), (32, 35, 4)]),
        (48, [(0, 16, 16), (16, 32, 16), (32, 48, 16)]),
    ],
)
def test_plan_batches(rows, expected):
    assert plan_batches(rows, (16, 4, 1, 4)) == expected  # unsorted, repeated: the same


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 65, 1000, 70_000, 200_001])
def test_plan_batches_covers_every_row_once(rows):
    plan = plan_batches(rows, DEFAULT_BATCH_SIZES)
    assert plan[0][0] == 0 and plan[-1][1] == rows
    for (_, stop, _), (start, _, _) in itertools.pairwise(plan):
        assert stop == start
    for start, stop, bucket in plan:
        assert bucket in DEFAULT_BATCH_SIZES and stop - start <= bucket
        assert bucket == bucket_for(stop - start, DEFAULT_BATCH_SIZES)


@pytest.mark.parametrize("buckets", [(), (0, 4), (-1,), (2.0,), (True,)])
def test_plan_batches_bad_buckets(buckets):
    with pytest.raises(ValueError, match="batch_sizes"):
        plan_batches(3, buckets)


@pytest.mark.parametrize("rows", [-1, 2.5, None])
def test_plan_batches_bad_rows(rows):
    with pytest.raises(ValueError, match="rows must be a non-negative int"):
        plan_batches(rows, (1, 4))


@pytest.mark.parametrize("pad", ["first", "zeros"])
def test_fill_copies_rows_then_pads(pad):
    x = torch.arange(1, 13, dtype=torch.float32).view(6, 2)
    ids = torch.arange(6).view(6, 1) + 5
    static = [torch.full((4, 2), float("nan")), torch.full((4, 1), -1, dtype=torch.int64)]
    _fill(static, [x, ids], 3, 5, pad)  # 2 rows into a bucket of 4
    assert torch.equal(static[0][:2], x[3:5]) and torch.equal(static[1][:2], ids[3:5])
    if pad == "first":
        assert torch.equal(static[0][2:], x[3:4].expand(2, 2))
        assert torch.equal(static[1][2:], ids[3:4].expand(2, 1))
    else:
        assert not static[0][2:].any() and not static[1][2:].any()


# --- inputs and outputs (pure) --------------------------------------------------------


def test_flatten_and_unflatten_round_trip():
    dense, ids, extra = torch.zeros(3, 2), torch.zeros(3, 4, dtype=torch.int64), torch.ones(3)
    leaves, spec = _flatten(["dense", "sparse"], (dense, [ids, extra]), {"return_logits": True})
    assert [n for n, _ in leaves] == ["dense", "sparse[0]", "sparse[1]"]
    hash(spec)
    args, kwargs = _unflatten(spec, [t for _, t in leaves])
    assert args[0] is dense and isinstance(args[1], list) and args[1][1] is extra
    assert kwargs == {"return_logits": True}
    # a different static setting is a different spec (its own graphs)
    assert _flatten(["dense", "sparse"], (dense, ids), {"return_logits": False})[1] != spec
    # keyword order does not matter
    a, b = _flatten(["x"], (dense,), {"p": 1, "q": 2}), _flatten(["x"], (dense,), {"q": 2, "p": 1})
    assert a[1] == b[1]


def test_flatten_refuses_bags():
    bags = [(torch.zeros(5, dtype=torch.int64), torch.tensor([0, 2, 3]))] * 2
    with pytest.raises(ValueError, match=r"sparse\[0\] is a sequence.*bags.*eagerly"):
        _flatten(["dense", "sparse"], (torch.zeros(3, 2), bags), {})


def test_flatten_refuses_non_tensors_in_a_sequence_and_unhashable_settings():
    with pytest.raises(TypeError, match=r"x\[1\]: expected a tensor, got int"):
        _flatten(["x"], ([torch.zeros(2), 3],), {})
    with pytest.raises(TypeError, match="opts: .*hashable, got dict"):
        _flatten(["x"], (torch.zeros(2),), {"opts": {"a": 1}})


def test_leaf_check_names_the_argument_and_what_was_expected():
    leaf = _Leaf("sparse", torch.int64, torch.device("cpu"), (26,))
    leaf.check(torch.zeros(7, 26, dtype=torch.int64))  # any batch
    with pytest.raises(ValueError, match=r"sparse: expected a torch.int64 .*\(B, 26\).*int32"):
        leaf.check(torch.zeros(7, 26, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sparse: .*shape \(7, 25\)"):
        leaf.check(torch.zeros(7, 25, dtype=torch.int64))


def test_outputs_need_the_batch_in_dim_0():
    assert _outputs(torch.zeros(4), 4)[1] == "tensor"
    assert _outputs((torch.zeros(4), torch.zeros(4, 2)), 4)[1] == "tuple"
    with pytest.raises(ValueError, match="batch \\(4 rows\\) in dim 0"):
        _outputs(torch.zeros(()), 4)
    with pytest.raises(TypeError, match="tensor or a tuple/list of tensors, got dict"):
        _outputs({"p": torch.zeros(4)}, 4)


# --- construction ---------------------------------------------------------------------


def test_public_name():
    assert fuseml.cuda_graphs is cuda_graphs


def test_cpu_model_is_refused():
    with pytest.raises(ValueError, match="needs a model on a CUDA device.*fallback='eager'"):
        cuda_graphs(nn.Linear(3, 2))


def test_cpu_model_with_eager_fallback_runs_eagerly_logged_once(caplog):
    model = nn.Linear(3, 2).eval()
    x = torch.randn(5, 3)
    with caplog.at_level(logging.WARNING, logger="fuseml.serving"):
        served = cuda_graphs(model, fallback="eager")
        out1, out2 = served(x), served(x[:2])
    assert served.eager and served.num_graphs == 0
    with torch.no_grad():
        assert torch.equal(out1, model(x)) and torch.equal(out2, model(x[:2]))
    assert not out1.requires_grad
    assert len([r for r in caplog.records if "eagerly" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pad": "mean"}, "pad must be one of"),
        ({"fallback": "cpu"}, "fallback must be one of"),
        ({"warmup": 0}, "warmup must be an int >= 1"),
        ({"batch_sizes": ()}, "batch_sizes must hold"),
        ({"batch_sizes": (4, 0)}, "batch_sizes must be positive ints"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CudaGraphs(nn.Linear(3, 2), **{"fallback": "eager", **kwargs})


def test_not_a_module():
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        cuda_graphs(lambda x: x)


# --- on the GPU -----------------------------------------------------------------------

BUCKETS = (1, 4, 16)
# below, on and between the buckets, and above the largest (chunks + a tail bucket)
ROWS = (1, 3, 4, 5, 16, 17, 35, 48)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 8)).cuda().eval()


def _dlrm(**overrides) -> DLRM:
    torch.manual_seed(0)
    config = DLRMConfig.from_name("tiny", max_cardinality=50, **overrides)
    return DLRM(config).cuda().eval()


def _dlrm_inputs(model: DLRM, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    cards = torch.tensor(model.config.cardinalities, device="cuda")
    dense = torch.randn(rows, model.config.num_dense, device="cuda")
    sparse = (torch.rand(rows, len(cards), device="cuda") * cards).long()
    return dense, sparse


@pytest.mark.parametrize("pad", ["first", "zeros"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
@pytest.mark.gpu
@requires_cuda
def test_mlp_matches_eager(pad, mode):
    model = _mlp()
    served = cuda_graphs(model, BUCKETS, pad=pad)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad
    )
    for rows in (*ROWS, *ROWS):  # first calls capture, repeat calls replay
        x = torch.randn(rows, 13, device="cuda")
        with ctx():
            out = served(x)
        with torch.no_grad():
            ref = model(x)
        assert out.shape == ref.shape and not out.requires_grad
        assert_close_verbose(out, ref, torch.float32)
    assert served.num_graphs == len(BUCKETS)


class _GradModeProbe(nn.Module):
    """A linear layer that records whether grad mode was on in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(13, 8)
        self.grad_modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.grad_modes.append(torch.is_grad_enabled())
        return self.lin(x)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
@pytest.mark.gpu
@requires_cuda
def test_warm_up_and_capture_run_without_grad(mode):
    """The warm-up and the capture run the forward with grad mode off, whatever the
    caller's mode: a fused module asks grad mode whether autograd records the call, and
    under it would capture its eager reference instead of its kernels."""
    model = _GradModeProbe().cuda().eval()
    served = cuda_graphs(model, BUCKETS)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad
    )
    with ctx():
        for rows in ROWS:
            served(torch.randn(rows, 13, device="cuda"))
    assert served.num_graphs == len(BUCKETS)
    # warm-ups and captures only: replays do not run the forward
    assert len(model.grad_modes) == len(BUCKETS) * (served.warmup + 1)
    assert not any(model.grad_modes)


@pytest.mark.parametrize("variant", ["hash_ids", "no_id_check"])
@pytest.mark.gpu
@requires_cuda
def test_dlrm_matches_eager(variant):
    model = _dlrm(hash_ids=variant == "hash_ids")
    model.embeddings.check_ids = False  # the range check syncs with the host
    served = cuda_graphs(model, BUCKETS, pad="zeros")
    for rows in (*ROWS, *ROWS):
        dense, sparse = _dlrm_inputs(model, rows)
        for logits in (False, True):
            out = served(dense, sparse, return_logits=logits)
            with torch.no_grad():
                ref = model(dense, sparse, return_logits=logits)
            assert_close_verbose(out, ref, torch.float32)
    assert served.num_graphs == 2 * len(BUCKETS)  # per bucket, per return_logits


def _served_matches_the_model(served, model: DLRM) -> None:
    """The served (optimized) model against the plain one, at every ROWS count."""
    for rows in ROWS:
        dense, sparse = _dlrm_inputs(model, rows)
        with torch.no_grad():
            ref = model(dense, sparse)
        assert_close_verbose(served(dense, sparse), ref, torch.float32, tf32=True)


@pytest.mark.gpu
@requires_cuda
def test_dlrm_optimized_matches_eager():
    model = _dlrm()
    model.embeddings.check_ids = False
    fused, _ = fuseml.optimize(model)
    _served_matches_the_model(cuda_graphs(fused, BUCKETS), model)


@pytest.mark.parametrize("optimized", [False, True])
@pytest.mark.gpu
@requires_cuda
def test_dlrm_default_id_check_is_captured(optimized):
    """check_ids as built (the default): captured without a host sync, ids checked on the
    device, a bad id raising after the call that saw it, naming its table."""
    model = _dlrm()
    assert model.embeddings.check_ids
    served_model = fuseml.optimize(model)[0] if optimized else model
    served = cuda_graphs(served_model, BUCKETS)
    _served_matches_the_model(served, model)
    dense, sparse = _dlrm_inputs(model, 5)
    bad = sparse.clone()
    bad[3, 7] = model.config.cardinalities[7]  # one past table 7's last row
    with pytest.raises(ValueError, match=r"sparse ids of table 7 \(C8\) must be in \[0, "):
        served(dense, bad)
    with torch.no_grad():  # the flags were cleared: good ids run again
        assert_close_verbose(served(dense, sparse), model(dense, sparse), torch.float32, tf32=True)
    if optimized:  # the eager fused forward checks in its kernel, one sync at the end
        with pytest.raises(ValueError, match=r"sparse ids of table 7 \(C8\)"):
            served_model(dense, bad)


@pytest.mark.gpu
@requires_cuda
def test_outputs_are_fresh_and_static_outputs_are_overwritten():
    model = _mlp()
    served = cuda_graphs(model, BUCKETS)
    x, y = torch.randn(3, 13, device="cuda"), torch.randn(3, 13, device="cuda")
    first = served(x)
    kept = first.clone()
    for g in served._graphs.values():
        for o in g.outputs:
            poison_(o)
            assert o.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    second = served(y)
    assert torch.equal(first, kept)  # a later call leaves an earlier result alone
    assert not second.isnan().any()
    with torch.no_grad():
        assert_close_verbose(second, model(y), torch.float32)


@pytest.mark.gpu
@requires_cuda
def test_mismatched_inputs_raise():
    model = _dlrm(hash_ids=True)
    model.embeddings.check_ids = False
    served = cuda_graphs(model, BUCKETS)
    dense, sparse = _dlrm_inputs(model, 5)
    served(dense, sparse)
    with pytest.raises(ValueError, match="dense: expected a torch.float32 .*cuda.*torch.float16"):
        served(dense.half(), sparse)
    with pytest.raises(ValueError, match=r"sparse: expected a torch.int64 .*int32"):
        served(dense, sparse.int())
    with pytest.raises(ValueError, match=r"sparse: .*\(B, 26\).*\(5, 25\)"):
        served(dense, sparse[:, :25])
    with pytest.raises(ValueError, match=r"dense: .*cuda.*got .*cpu"):
        served(dense.cpu(), sparse)
    with pytest.raises(ValueError, match="sparse: expected 5 rows"):
        served(dense, sparse[:4])
    bags = [(sparse[:, t], torch.arange(5, device="cuda")) for t in range(26)]
    with pytest.raises(ValueError, match="bags.*eagerly"):
        served(dense, bags)
    served2 = cuda_graphs(model, BUCKETS)
    with pytest.raises(ValueError, match=r"dense: expected a tensor on cuda.*cpu"):
        served2(dense.cpu(), sparse.cpu())


@pytest.mark.gpu
@requires_cuda
def test_capture_failure_is_clear_or_falls_back():
    class Syncs(nn.Module):
        def forward(self, x):
            if bool((x > 1e9).any()):  # a host sync: not capturable
                raise AssertionError
            return x * 2

    x = torch.randn(3, 4, device="cuda")
    with pytest.raises(RuntimeError, match=r"(?s)capturing Syncs at batch 4 failed.*host"):
        cuda_graphs(Syncs().eval(), BUCKETS)(x)
    served = cuda_graphs(Syncs().eval(), BUCKETS, fallback="eager")
    assert torch.equal(served(x), x * 2) and served.eager
    # the process is left in order: random ops and new captures work
    torch.randn(4, device="cuda")
    g, out = capture_graph(lambda: torch.rand(3, device="cuda") + x[:1, :3], warmup=1)
    g.replay()
    torch.cuda.synchronize()
    assert out.shape == (1, 3)


@pytest.mark.gpu
@requires_cuda
def test_sequence_inputs_and_tuple_outputs():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, pair, scale=1.0):
            a, b = pair
            return self.lin(x) * scale, a + b.float()

    model = Two().cuda().eval()
    served = cuda_graphs(model, BUCKETS)
    for rows in ROWS:
        x = torch.randn(rows, 4, device="cuda")
        pair = [torch.randn(rows, 2, device="cuda"), torch.randint(0, 9, (rows, 2), device="cuda")]
        out = served(x, pair, scale=2.0)
        with torch.no_grad():
            ref = model(x, pair, scale=2.0)
        assert isinstance(out, tuple) and len(out) == 2
        for o, r in zip(out, ref, strict=True):
            assert_close_verbose(o, r, torch.float32)


class _Rerun:
    """Stands in for a CUDA graph on CPU: replay re-runs the model on the static inputs
    and writes the static outputs in place, as a replay does."""

    def __init__(self, served: CudaGraphs, g, spec) -> None:
        self.served, self.g, self.spec = served, g, spec

    def replay(self) -> None:
        args, kwargs = _unflatten(self.spec, self.g.inputs)
        outs, _ = _outputs(self.served.module(*args, **kwargs), self.g.inputs[0].shape[0])
        for o, new in zip(self.g.outputs, outs, strict=True):
            o.copy_(new)


@pytest.fixture
def cpu_served(monkeypatch):
    """A CudaGraphs on CPU whose graphs re-run the model: the call path (plan, fill,
    copy out, checks) without CUDA."""
    import contextlib

    def fake_capture(self, g, spec, bucket):
        args, kwargs = _unflatten(spec, g.inputs)
        g.outputs, g.kind = _outputs(self.module(*args, **kwargs), bucket)
        for o in g.outputs:
            poison_(o)  # a replay must write every row
        g.graph = _Rerun(self, g, spec)

    monkeypatch.setattr(CudaGraphs, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())

    def make(model, **kwargs):
        served = CudaGraphs(model, fallback="eager", **kwargs)
        served.eager, served.device = False, torch.device("cpu")
        return served

    return make


@pytest.mark.parametrize("pad", ["first", "zeros"])
def test_call_path_matches_eager_on_cpu(cpu_served, pad):
    torch.manual_seed(0)
    model = DLRM(DLRMConfig.from_name("tiny", max_cardinality=50)).eval()
    served = cpu_served(model, batch_sizes=BUCKETS, pad=pad)
    cards = torch.tensor(model.config.cardinalities)
    for rows in (*ROWS, *ROWS):
        dense = torch.randn(rows, model.config.num_dense)
        sparse = (torch.rand(rows, len(cards)) * cards).long()
        out = served(dense, sparse, return_logits=True)
        with torch.no_grad():
            ref = model(dense, sparse, return_logits=True)
        assert out.shape == (rows,)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert served.num_graphs == len(BUCKETS)
    with pytest.raises(ValueError, match="sparse: expected a torch.int64"):
        served(dense, sparse.int())
    assert served(dense[:0], sparse[:0]).shape == (0,)  # no rows: the model's own result


# --- ReplayCache, on the CPU with stand-ins for CUDA graphs and streams -----------------


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: the function called inside the capture says
    what a replay recomputes (``body``)."""

    capturing: _FakeGraph | None = None

    def __init__(self) -> None:
        self.body = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def graph(g, stream=None, pool=None, capture_error_mode="global"):
        _FakeGraph.capturing = g
        _FakeGraph.modes.append(capture_error_mode)
        try:
            yield
        finally:
            _FakeGraph.capturing = None

    monkeypatch.setattr(_FakeGraph, "modes", [], raising=False)  # each capture's error mode
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def _counting_fn(calls: list):
    def fn(a, b):
        calls.append("call")
        out = a * 2 + b
        g = _FakeGraph.capturing
        if g is not None:  # what the captured kernels would redo on replay
            g.body = lambda: out.copy_(a * 2 + b)
        return out

    return fn


def test_replay_cache_runs_eagerly_then_captures_then_replays(fake_cuda):
    from fuseml.serving import ReplayCache

    cache, calls = ReplayCache("T", capture_after=2, max_graphs=2), []
    fn = _counting_fn(calls)
    outs = []
    for i in range(6):
        a, b = torch.full((3,), float(i)), torch.ones(3)
        out = cache.run(("k",), fn, [a, b])
        assert torch.equal(out, a * 2 + b)
        outs.append(out)
    # two eager calls, then the warm-up and the capture, then replays only
    assert len(calls) == 4 and cache.num_graphs == 1
    # thread-local: other threads' CUDA calls (the fast path's build) cannot invalidate it
    assert _FakeGraph.modes == ["thread_local"]
    graph, _, static_out, raw = cache._graphs[("k",)]
    assert graph.replays == 4  # the capturing call replays too
    assert raw is None and cache.cpp_replays == 0  # (no executable handle to launch)
    assert all(o is not static_out for o in outs)  # each call's own output
    assert [float(o[0]) for o in outs] == [1, 3, 5, 7, 9, 11]  # none overwritten later
    # a third signature evicts the least recently used graph
    for key in (("k2",), ("k3",)):
        for _ in range(3):
            cache.run(key, fn, [torch.ones(3), torch.ones(3)])
    assert cache.num_graphs == 2 and ("k",) not in cache._graphs
    assert copy.deepcopy(cache).num_graphs == 0  # a copied owner starts without graphs


def test_replay_cache_captures_with_the_garbage_collector_paused(fake_cuda):
    """A collection inside a capture could free a CUDA graph, which fails the capture: the
    forward is captured with Python's cyclic collector paused, and it runs again after."""
    import gc

    from fuseml.serving import ReplayCache

    cache, states = ReplayCache("T", capture_after=1), []

    def fn(a):
        out, g = a + 1, _FakeGraph.capturing
        if g is not None:
            states.append(gc.isenabled())
            g.body = lambda: out.copy_(a + 1)
        return out

    for _ in range(3):
        cache.run(("k",), fn, [torch.ones(2)])
    assert states == [False] and gc.isenabled()


def test_replay_cache_capture_failure_turns_replays_off(fake_cuda, caplog):
    from fuseml.serving import ReplayCache

    cache, calls = ReplayCache("Owner", capture_after=1), []
    fn = _counting_fn(calls)

    def fails_inside_capture(a, b):
        if _FakeGraph.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return fn(a, b)

    a, b = torch.ones(2), torch.ones(2)
    with caplog.at_level(logging.WARNING, logger="fuseml.serving"):
        for _ in range(4):
            assert torch.equal(cache.run(("k",), fails_inside_capture, [a, b]), a * 2 + b)
    assert not cache.enabled and cache.num_graphs == 0
    assert sum("Owner: replaying eager calls from CUDA graphs is off" in r.message
               for r in caplog.records) == 1  # fmt: skip


@pytest.mark.gpu
@requires_cuda
def test_replay_cache_launches_from_cpp_unless_the_graph_draws_random_numbers():
    """With the fast path loaded, a captured forward's replays (copies in, launch, copy out)
    are one C++ call and give the forward's outputs, each a fresh tensor; a forward that
    draws random numbers keeps torch's replay, which advances the generator."""
    from fuseml.ops import _fastcall
    from fuseml.serving import ReplayCache

    if not _fastcall.wait(timeout=900):
        pytest.fail(f"the fast path did not load: {_fastcall.status()}")
    cache = ReplayCache("T", capture_after=1)
    b = torch.randn(5, 3, device="cuda")
    outs, expected = [], []
    for i in range(5):
        a = torch.full((5, 3), float(i), device="cuda")
        outs.append(cache.run(("k",), lambda a, b: a * 2 + b, [a, b.t().contiguous().t()]))
        expected.append(a * 2 + b)
    assert cache.cpp_replays == 3  # (call 1 eager, call 2 captures and replays through torch)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected, strict=True))
    assert len({o.data_ptr() for o in outs}) == len(outs)

    noisy = ReplayCache("R", capture_after=1)
    draws = [noisy.run(("r",), lambda a: a + torch.rand_like(a), [b]) for _ in range(4)]
    assert noisy.cpp_replays == 0 and noisy.num_graphs == 1
    assert not torch.equal(draws[-1], draws[-2])  # torch's replay: new random numbers
