import importlib
import json
import re

import pytest
import torch

import fuseml
from fuseml.ops import ACTIVATIONS, _tune, _utils, gemm, linear_ref
from fuseml.ops._elementwise import ACT_CODE
from fuseml.runtime import tf32_matmuls
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets, rel_err, tolerance

TARGETS = fused_targets(cuda_twin=False)
linear_mod = importlib.import_module("fuseml.ops.linear")  # (fuseml.ops.linear: the function)
# (M, K, N): DLRM-like (K=13), odd sizes, K and N not multiples of 16, one row, tiny.
SHAPES = [(1, 13, 40), (3, 33, 17), (37, 45, 70), (64, 16, 16), (130, 24, 9)]


def _up(t):
    return None if t is None else t.double()


def _inputs(m, k, n, dtype, device, residual=True, lead=()):
    x = torch.randn(*lead, m, k, dtype=dtype, device=device)
    w = (torch.randn(n, k, dtype=dtype, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device=device)
    r = torch.randn(*lead, m, n, dtype=dtype, device=device) if residual else None
    return x, w, b, r


def _ref64(x, w, b, act, r=None, alpha=1.0):
    return linear_ref(_up(x), _up(w), _up(b), act, _up(r), alpha)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_shapes(device, backend, shape, dtype):
    x, w, b, r = _inputs(*shape, dtype, device)
    out = fuseml.ops.linear(x, w, b, "relu", r, 0.5, backend=backend)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2])
    assert_close_verbose(out, _ref64(x, w, b, "relu", r, 0.5), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("activation", [*ACTIVATIONS, None])
def test_linear_every_activation(device, backend, activation):
    x, w, b, _ = _inputs(9, 20, 24, torch.float32, device, residual=False)
    out = fuseml.ops.linear(x, w, b, activation, backend=backend)
    assert_close_verbose(out, _ref64(x, w, b, activation))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_linear_layouts(device, backend):
    # batched x, transposed (non-contiguous) weight, x with a row stride, no bias
    x, _, b, r = _inputs(5, 20, 12, torch.float32, device, lead=(2, 3))
    w_t = torch.randn(20, 12, device=device).t()  # (12, 20) with strides (1, 12)
    out = fuseml.ops.linear(x, w_t, b, "gelu", r, -1.0, backend=backend)
    assert out.shape == (2, 3, 5, 12)
    assert_close_verbose(out, _ref64(x, w_t, b, "gelu", r, -1.0))
    big = torch.randn(30, 50, device=device)
    xs = big[3:20, 7:27]  # row stride 50
    xt = big[:20, :9].t()  # (9, 20): column stride 50
    for xv in (xs, xt):
        out = fuseml.ops.linear(xv, w_t, None, None, backend=backend)
        assert_close_verbose(out, _ref64(xv, w_t, None, None))
    x1 = torch.randn(20, device=device)  # 1-D input: (in,) -> (out,)
    assert_close_verbose(fuseml.ops.linear(x1, w_t, b, backend=backend), _ref64(x1, w_t, b, None))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_linear_empty(device, backend):
    x, w, b, _ = _inputs(0, 8, 6, torch.float32, device, residual=False)
    assert fuseml.ops.linear(x, w, b, backend=backend).shape == (0, 6)
    w0 = torch.randn(0, 8, device=device)
    assert fuseml.ops.linear(x[:0], w0, backend=backend).shape == (0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("fp32_dot", gemm.common.FP32_DOTS)
@pytest.mark.parametrize(("m", "k", "n"), [(300, 512, 256), (4096, 1024, 1024), (64, 13, 512)])
def test_linear_fp32_follows_torch_tf32_flag(tf32, fp32_dot, m, k, n, monkeypatch):
    """TF32 only where torch allows it; otherwise fp32 accuracy through either dot
    (FUSEML_FP32_DOT): within twice cuBLAS's own fp32 error against float64. 4096 rows
    take the TMA kernel with tf32x3, the pointer kernel with ieee."""
    monkeypatch.setenv("FUSEML_FP32_DOT", fp32_dot)
    x, w, b, _ = _inputs(m, k, n, torch.float32, "cuda", residual=False)
    ref = _ref64(x, w, b, "relu")
    with tf32_matmuls(tf32):
        out = fuseml.ops.linear(x, w, b, "relu", backend="triton")
        cublas = rel_err(linear_ref(x, w, b, "relu"), ref)
    err = rel_err(out, ref)
    assert err <= tolerance(torch.float32, tf32=tf32)
    if not tf32:  # an fp32-accurate dot, not tf32 (whose error here is about 2e-4)
        assert err <= max(2 * cublas, 1e-7), (err, cublas)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp32_dot", gemm.common.FP32_DOTS)
@pytest.mark.parametrize("m", [64, 4096])
def test_linear_fp32_dot_keeps_inf_and_nan(fp32_dot, m, monkeypatch):
    """tf32x3 splits each value into a TF32 part and a remainder (inf - inf is NaN): an
    inf or NaN input must still give what cuBLAS gives, and nowhere else."""
    monkeypatch.setenv("FUSEML_FP32_DOT", fp32_dot)
    x, w, _, _ = _inputs(m, 256, 128, torch.float32, "cuda", residual=False)
    w = w.abs()  # one inf in a row gives +-inf in every column, not inf - inf
    x[1, 3] = float("inf")
    x[2, 5] = float("-inf")
    x[3, 7] = float("nan")
    w[9, 11] = float("inf")
    with tf32_matmuls(False):
        out = fuseml.ops.linear(x, w, backend="triton")
        ref = torch.nn.functional.linear(x, w)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isinf(), ref.isinf())
    both = ref.isinf()
    assert torch.equal(out[both], ref[both])
    assert_close_verbose(out[ref.isfinite()], ref[ref.isfinite()].double(), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 4096), (4096, 367, 512), (5000, 1024, 1000)])
def test_linear_large(dtype, m, k, n):
    x, w, b, r = _inputs(m, k, n, dtype, "cuda")
    out = fuseml.ops.linear(x, w, b, "gelu", r, 0.25, backend="triton")
    assert_close_verbose(out, _ref64(x, w, b, "gelu", r, 0.25), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", None])
def test_linear_backward(device, backend, activation):
    x, w, b, r = _inputs(6, 10, 7, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, r)]
    out = fuseml.ops.linear(*leaves[:3], activation, leaves[3], 0.5, backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    refs = [t.double().requires_grad_() for t in (x, w, b, r)]
    linear_ref(*refs[:3], activation, refs[3], 0.5).backward(g.double())
    for name, got, ref in zip(["x", "w", "b", "r"], leaves, refs):
        assert got.grad is not None, name
        assert_close_verbose(got.grad, ref.grad)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_linear_opcheck(device, backend):
    x, w, b, r = _inputs(5, 9, 11, torch.float32, device)
    torch.library.opcheck(torch.ops.fuseml.linear, (x, w, b, r, 0.5, "gelu"))
    torch.library.opcheck(torch.ops.fuseml.linear, (x, w, None, None, 1.0, "none"))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_linear_compile_fullgraph(device, backend):
    x, w, b, r = _inputs(8, 24, 16, torch.float32, device)

    def fn(x, w, b, r):
        return fuseml.ops.linear(x, w, b, "silu", r, 2.0, backend=backend).sum(-1)

    out = torch.compile(fn, fullgraph=True)(x, w, b, r)
    assert_close_verbose(out, _ref64(x, w, b, "silu", r, 2.0).sum(-1))


def test_linear_eager_and_compile_backends():
    x, w, b, r = _inputs(8, 24, 16, torch.float32, "cpu")
    ref = _ref64(x, w, b, "tanh", r, 0.5)
    for backend in ("auto", "eager", "compile"):
        assert_close_verbose(fuseml.ops.linear(x, w, b, "tanh", r, 0.5, backend=backend), ref)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"w": torch.randn(6, 9)}, ValueError, "in_features"),
        ({"w": torch.randn(6)}, ValueError, "weight must be 2-D"),
        ({"b": torch.randn(5)}, ValueError, "bias must have shape (6,)"),
        ({"r": torch.randn(4, 5)}, ValueError, "residual must have"),
        ({"x": torch.randn(4, 8, dtype=torch.float64)}, TypeError, "x must have dtype"),
        ({"w": torch.randn(6, 8, dtype=torch.bfloat16)}, TypeError, "mixed dtypes"),
        ({"x": torch.ones(4, 8, dtype=torch.int32)}, TypeError, "x must have dtype"),
        ({"act": "swish"}, ValueError, "activation must be one of"),
        ({"alpha": "2"}, TypeError, "alpha must be a real number"),
        ({"backend": "cuda"}, ValueError, "no CUDA C++ twin"),
        ({"backend": "fast"}, ValueError, "backend must be one of"),
    ],
)
def test_linear_bad_input(kwargs, exc, words):
    args = {
        "x": torch.randn(4, 8),
        "w": torch.randn(6, 8),
        "b": torch.randn(6),
        "r": None,
        "act": "relu",
        "alpha": 1.0,
        "backend": "auto",
    }
    args.update(kwargs)
    with pytest.raises(exc, match=re.escape(words)):
        fuseml.ops.linear(
            args["x"], args["w"], args["b"], args["act"], args["r"], args["alpha"],
            backend=args["backend"],
        )  # fmt: skip


# ------------------------------------------------------------------------------ tuning
def test_candidates_are_pruned_to_the_problem():
    for m, n, k in [(1, 16, 13), (3, 4096, 4096), (65536, 64, 16), (4096, 11008, 4096)]:
        cands = gemm.candidates(m, n, k, torch.bfloat16)
        bound = (
            len(gemm.configs._LARGE) + len(gemm.configs._FEW_TILES) + len(gemm.configs._SKINNY_N)
            + len(gemm.configs._NARROW_N) + len(gemm.configs._SHORT_K)
        )  # fmt: skip
        assert cands and len(cands) <= bound
        for c in cands:
            smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2
            assert smem <= gemm.SMEM_LIMIT, c
            assert 16 <= c["BLOCK_M"] <= max(16, _tune.m_bucket(m))
            assert 16 <= c["BLOCK_N"] <= max(16, 1 << (n - 1).bit_length())
            assert 16 <= c["BLOCK_K"] <= max(16, 1 << (k - 1).bit_length())
    fp32 = gemm.candidates(4096, 4096, 4096, torch.float32)
    assert max(c["BLOCK_K"] for c in fp32) == 32  # half the 16-bit K step
    # a narrow output at 17-64 rows also gets 16-row tiles (more programs); a wide one not
    assert {c["BLOCK_M"] for c in gemm.candidates(64, 64, 256, torch.bfloat16)} == {16, 64}
    assert {c["BLOCK_M"] for c in gemm.candidates(64, 4096, 4096, torch.bfloat16)} == {64}
    assert {c["BLOCK_M"] for c in gemm.candidates(16, 64, 256, torch.bfloat16)} == {16}


def test_m_bucket():
    assert [_tune.m_bucket(m) for m in (0, 1, 2, 3, 300, 512, 513)] == [1, 1, 2, 4, 512, 512, 1024]


def test_tuning_cache_is_measured_once_and_persisted(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setattr(_tune, "autotune_enabled", lambda: True)
    monkeypatch.setattr(_tune, "_tables", {})
    dev = torch.device("cpu")
    cands = [{"BLOCK_M": 16}, {"BLOCK_M": 32}, {"BLOCK_M": 64}]
    timed = []

    def bench(cfg):
        timed.append(cfg["BLOCK_M"])
        if cfg["BLOCK_M"] == 64:
            raise RuntimeError("out of shared memory")  # skipped, not fatal
        return {16: 2.0, 32: 1.0}[cfg["BLOCK_M"]]

    best = _tune.tuned(dev, "k1", cands, bench, {"BLOCK_M": 16})
    assert best == {"BLOCK_M": 32} and timed == [16, 32, 64]
    files = list((tmp_path / "tune").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == {"k1": {"BLOCK_M": 32}}
    # same process: no second measurement; a new process (fresh memo) reads the file
    assert _tune.tuned(dev, "k1", cands, bench, {"BLOCK_M": 16}) == {"BLOCK_M": 32}
    monkeypatch.setattr(_tune, "_tables", {})
    assert _tune.lookup(dev, "k1") == {"BLOCK_M": 32}
    assert timed == [16, 32, 64]


def test_choose_memoises_and_only_times_where_it_can(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setattr(_tune, "autotune_enabled", lambda: True)
    monkeypatch.setattr(_tune, "_tables", {})
    monkeypatch.setattr(_tune, "_memo", {})
    dev = torch.device("cpu")
    built = []

    def key():
        built.append("key")
        return "k2"

    cands = [{"B": 1}, {"B": 2}]
    bench = {1: 2.0, 2: 1.0}.__getitem__
    # cannot time on the CPU (interpreter): the default, memoised, no key built, no file
    assert _tune.choose(("c",), dev, key, lambda: cands, lambda c: bench(c["B"]), {"B": 0},
                        can_time=False) == {"B": 0}  # fmt: skip
    assert _tune._memo == {("c",): {"B": 0}} and built == []
    assert not list(tmp_path.glob("tune/*.json"))
    # can time: tuned, memoised; the next call neither builds the key nor times again
    got = _tune.choose(("p",), dev, key, lambda: cands, lambda c: bench(c["B"]), {"B": 0},
                       can_time=True)  # fmt: skip
    assert got == {"B": 2} and built == ["key"]
    assert _tune.choose(("p",), dev, key, None, None, {"B": 0}, can_time=True) == {"B": 2}
    assert _tune.memoized(("p",)) == {"B": 2} and built == ["key"]


def test_compile_candidates_runs_each_config_compile_only(tmp_path, monkeypatch):
    pytest.importorskip("triton.runtime._async_compile")
    from fuseml.ops._utils import compiling_only, grid_launch

    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setattr(_tune, "triton_interpreting", lambda: False)
    monkeypatch.setattr(_tune, "_tables", {})
    monkeypatch.setattr(_tune, "_memo", {})
    seen = []

    class Kernel:  # what a launch site does with a @triton.jit kernel
        def __getitem__(self, grid):
            raise AssertionError("launched while compiling only")

        def warmup(self, *args, grid, **kwargs):
            seen.append((args, grid, kwargs))

    def run(cfg):
        assert compiling_only()
        # a nested tuning problem inside the launch is not timed while compiling
        nested = _tune.choose(("n",), torch.device("cpu"), lambda: "n", lambda: [{"B": 1}],
                              None, {"B": 0}, can_time=True)  # fmt: skip
        assert nested == {"B": 0}
        grid_launch(Kernel(), (cfg["B"],))(1, 2, BLOCK=cfg["B"])

    monkeypatch.setenv("FUSEML_COMPILE_THREADS", "4")
    assert _tune.compile_candidates([{"B": 1}, {"B": 2}], run) == 2
    assert seen == [((1, 2), (1,), {"BLOCK": 1}), ((1, 2), (2,), {"BLOCK": 2})]
    assert not compiling_only() and _tune._memo == {}
    monkeypatch.setenv("FUSEML_COMPILE_THREADS", "0")
    assert _tune.compile_candidates([{"B": 1}, {"B": 2}], run) == 0
    assert "one at a time" in _tune.parallel_compile()
    # inside an async compile mode of the caller's own: left alone, nothing submitted
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    monkeypatch.setenv("FUSEML_COMPILE_THREADS", "4")
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool):
        assert _tune.compile_candidates([{"B": 1}, {"B": 2}], run) == 0
    monkeypatch.setenv("FUSEML_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="FUSEML_COMPILE_THREADS"):
        _tune.compile_candidates([{"B": 1}, {"B": 2}], run)
    monkeypatch.setenv("FUSEML_COMPILE_THREADS", "3")
    assert _tune.parallel_compile() == "in parallel on up to 3 threads, then timed one by one"


def test_tuned_compiles_candidates_before_timing_them(tmp_path, monkeypatch):
    # On a CUDA device with a launch given, every candidate is compiled first, then timed
    monkeypatch.setattr(_tune, "autotune_enabled", lambda: True)
    monkeypatch.setattr(_tune, "_tables", {})
    monkeypatch.setattr(_tune, "_table_path", lambda device: tmp_path / "table.json")
    events = []
    monkeypatch.setattr(
        _tune, "compile_candidates", lambda cands, run: events.append(("compile", len(cands)))
    )

    def bench(cfg):
        events.append(("time", cfg["B"]))
        return float(cfg["B"])

    cands = [{"B": 2}, {"B": 1}]
    got = _tune.tuned(torch.device("cuda"), "k", cands, bench, {"B": 0}, run=lambda c: None)
    assert got == {"B": 1} and events == [("compile", 2), ("time", 2), ("time", 1)]
    # without a launch to compile through: timed only
    events.clear()
    monkeypatch.setattr(_tune, "_tables", {})
    (tmp_path / "table.json").unlink()
    assert _tune.tuned(torch.device("cuda"), "k", cands, bench, {"B": 0}) == {"B": 1}
    assert events == [("time", 2), ("time", 1)]


def test_tuning_disabled_uses_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    monkeypatch.setattr(_tune, "_tables", {})

    def bench(cfg):
        raise AssertionError("must not time anything")

    got = _tune.tuned(torch.device("cpu"), "k", [{"a": 1}, {"a": 2}], bench, {"a": 0})
    assert got == {"a": 0}
    assert not (tmp_path / "tune").exists()


def test_no_tuning_inside_a_graph_capture(tmp_path, monkeypatch, caplog):
    """A tuning miss met inside a CUDA-graph capture times nothing (timing there would
    invalidate the capture): the table's entry or the default, not remembered (a later
    eager call tunes), and one warning per key that names it."""
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setenv("FUSEML_AUTOTUNE", "1")
    monkeypatch.setattr(_tune, "_memo", {})
    monkeypatch.setattr(_tune, "_capture_misses", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(_tune, "lookup", lambda device, key: None)  # (no GPU to name here)

    def bench(cfg):
        raise AssertionError("timed inside a capture")

    dev = torch.device("cuda")
    args = (dev, lambda: "k:capture", lambda: [{"a": 1}, {"a": 2}], bench, {"a": 0})
    with caplog.at_level("WARNING", logger="fuseml"):
        for _ in range(2):
            assert _tune.choose(("k",), *args, can_time=True) == {"a": 0}
    assert ("k",) not in _tune._memo
    assert sum("k:capture" in r.getMessage() for r in caplog.records) == 1
    # one candidate (a tile another launch chose): nothing to tune, nothing to report
    one = (dev, lambda: "k:one", lambda: [{"a": 3}], bench, {"a": 3})
    with caplog.at_level("WARNING", logger="fuseml"):
        assert _tune.choose(("k1",), *one, can_time=True) == {"a": 3}
    assert not any("k:one" in r.getMessage() for r in caplog.records)


def test_tuning_l2_mode_switch_and_its_own_table(tmp_path, monkeypatch):
    """FUSEML_TUNE_L2: cold (default) or warm, each with its own table (the two timings
    rank tiles differently); anything else is an error naming the variable."""
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.delenv("FUSEML_TUNE_L2", raising=False)
    dev = torch.device("cpu")
    assert _tune.l2_mode() == "cold"
    cold = _tune._table_path(dev)
    monkeypatch.setenv("FUSEML_TUNE_L2", "warm")
    assert _tune.l2_mode() == "warm"
    warm = _tune._table_path(dev)
    assert cold != warm and cold.name.endswith("-l2cold.json") and cold.parent == warm.parent
    monkeypatch.setenv("FUSEML_TUNE_L2", "lukewarm")
    with pytest.raises(ValueError, match="FUSEML_TUNE_L2"):
        _tune.l2_mode()


def test_cold_tuning_flushes_the_l2_before_each_timed_call(monkeypatch):
    """Cold timing: every timed call follows a read of the flush buffer (twice the L2), and
    the flush's own time is subtracted; warm timing replays the call alone. (The effect on
    tile choice is measured, not tested: a timed test under parallel GPU test workers
    compared noise; docs/performance/tuning.md has the measurements.) The captures run with
    Python's collector paused, as every capture."""
    import gc

    import triton.testing

    events, collector_on = [], []

    class Flush:
        def sum(self):
            events.append("flush")

    def bench(fn, rep):
        collector_on.append(gc.isenabled())
        for _ in range(3):
            fn()
        return 1.0

    monkeypatch.setattr(_tune, "_l2_flush", lambda index: (Flush(), 0.25))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", bench)
    monkeypatch.setenv("FUSEML_TUNE_L2", "cold")
    assert _tune.gpu_time_ms(lambda: events.append("call")) == 0.75
    assert events == ["flush", "call"] * 3
    events.clear()
    monkeypatch.setenv("FUSEML_TUNE_L2", "warm")
    assert _tune.gpu_time_ms(lambda: events.append("call")) == 1.0
    assert events == ["call"] * 3
    assert collector_on == [False, False] and gc.isenabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_gpu_call_tunes_and_writes_the_cache(fresh_tuning):
    x, w, b, _ = _inputs(77, 96, 80, torch.bfloat16, "cuda", residual=False)
    out = fuseml.ops.linear(x, w, b, "relu", backend="triton")
    assert_close_verbose(out, _ref64(x, w, b, "relu"), torch.bfloat16)
    (table,) = (fresh_tuning / "tune").glob("*.json")
    entries = json.loads(table.read_text())
    assert any(key.startswith("linear:bfloat16") and ":m128:n80:k96" in key for key in entries)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(3, 200, 300), (1000, 367, 520), (1000, 256, 60), (50, 256, 64)]
)
@pytest.mark.parametrize("lora", ["none", "in_loop", "precomputed"])
def test_every_candidate_config_is_correct(dtype, m, k, n, lora):
    """Tuning may pick any candidate: each one must compute the same thing."""
    x, w, b, r = _inputs(m, k, n, dtype, "cuda")
    rank = 16
    a = torch.randn(rank, k, dtype=dtype, device="cuda") / k**0.5
    bb = torch.randn(n, rank, dtype=dtype, device="cuda") / rank**0.5
    ref = _ref64(x, w, b, "gelu", r, 0.5)
    kw = {}
    if lora != "none":
        ref = _ref64(x, w, b, None, r, 0.5) + (x.double() @ a.double().t() @ bb.double().t()) * 0.25
        ref = torch.nn.functional.gelu(ref)
        mode = gemm.LORA_IN_LOOP if lora == "in_loop" else gemm.LORA_PRECOMPUTED
        xa = (x.float() @ a.float().t()) if lora == "precomputed" else None
        kw = dict(lora=mode, lora_a=a, lora_b=bb, xa=xa, lora_scale=0.25, rank=rank)
    code = fuseml.ops.ACTIVATIONS.index("gelu")
    for cfg in gemm.candidates(m, n, k, dtype, plain=lora == "none"):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        gemm.launch_linear(out, x, w, b, r, 0.5, code, cfg, **kw)
        try:
            assert_close_verbose(out, ref, dtype)
        except AssertionError as err:
            raise AssertionError(f"config {cfg}: {err}") from None


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("k", [13, 64])
def test_linear_one_step(device, backend, k):
    """K within one BLOCK_K step: the pointer kernel's one-step variant, its bias loaded
    with x and W, and its residual too for tiles up to 64 x 64 (else in the epilogue)."""
    x, w, b, r = _inputs(37, k, 70, torch.bfloat16, device)
    for cfg in (gemm.configs._cfg(16, 32, 64, 4, 2), gemm.configs._cfg(64, 128, 64, 4, 2)):
        for bias, res in ((b, r), (None, r), (b, None)):
            out = torch.full((37, 70), float("nan"), dtype=torch.bfloat16, device=device)
            gemm.launch_linear(out, x, w, bias, res, 0.5, 3, cfg)  # 3: gelu
            ref = _ref64(x, w, bias, "gelu", res, 0.5)
            assert_close_verbose(out, ref, torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [(530, 13, 500), (1000, 64, 16), (600, 200, 70)])
def test_linear_stream_kernel(device, backend, dtype, m, k, n):
    """The streaming kernel (W's column tile on chip, row tiles streamed through it; several
    row tiles a program, a ragged last one): every one of its candidates, with and without
    bias and residual, x strided, direct and traced launches, the same results as the
    reference."""
    x, w, b, r = _inputs(m, k, n, dtype, device)
    x = torch.cat([x, x], dim=1)[:, ::2]  # a row stride of 2k, a column stride of 2
    cands = [c for c in gemm.candidates(m, n, k, dtype, plain=True) if c.get("STREAM")]
    assert cands
    for cfg in cands:
        grid = gemm.launch.stream_grid(m, n, cfg, gemm.persistent_programs(x))
        assert grid[0] % -(-n // cfg["BLOCK_N"]) == 0
        # traced: the launch torch.compile's trace makes (wrap_triton), run eagerly here
        for bias, res, traced in ((b, r, False), (None, None, False), (b, r, True)):
            out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
            gemm.launch_linear(out, x, w, bias, res, 0.5, 3, cfg, traced=traced)  # 3: gelu
            try:
                assert_close_verbose(out, _ref64(x, w, bias, "gelu", res, 0.5), dtype)
            except AssertionError as err:
                raise AssertionError(f"config {cfg}: {err}") from None


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_linear_choice_names_the_config_and_kernel(device, backend, monkeypatch):
    """linear_mod.linear_choice(): the launch config and kernel a call with these tensors
    takes (bench rows record it); the streaming kernel's configs say so."""
    x, w, b, _ = _inputs(600, 64, 16, torch.bfloat16, device, residual=False)
    launched = []  # (config, tma) of every launch the call makes
    launch = gemm.launch.launch_linear

    def recording(*args, tma=False, **kw):
        launched.append((args[7], tma))
        return launch(*args, tma=tma, **kw)

    monkeypatch.setattr(gemm.launch, "launch_linear", recording)
    fuseml.ops.linear(x, w, b, "relu", backend=backend)
    choice = linear_mod.linear_choice(x, w, b, "relu")
    assert choice["kernel"] in ("ptr", "tma", "stream") and choice["BLOCK_M"] >= 16
    cfg, tma = launched[-1]  # the query names the call's own launch
    assert {k: v for k, v in choice.items() if k != "kernel"} == cfg
    assert (choice["kernel"] == "tma") == tma and (choice["kernel"] == "stream") == bool(
        cfg.get("STREAM")
    )
    cfg = next(c for c in gemm.candidates(600, 16, 64, torch.bfloat16, plain=True) if "STREAM" in c)
    out = linear_mod.linear_rows(x, w, b, None, 1.0, ACT_CODE["relu"], config=cfg)
    assert linear_mod.linear_choice(x, w, b, "relu", config=cfg) == {**cfg, "kernel": "stream"}
    assert_close_verbose(out, _ref64(x, w, b, "relu"), torch.bfloat16)


def test_stream_candidates_only_where_they_serve():
    def streams(m, n, k, **kw):
        return [c for c in gemm.candidates(m, n, k, torch.bfloat16, **kw) if c.get("STREAM")]

    assert streams(4096, 64, 256, plain=True) and streams(65536, 512, 13, plain=True)
    assert not streams(4096, 64, 256)  # LoRA and the others do not ask for them
    assert not streams(256, 64, 256, plain=True)  # too few rows to stream
    assert not streams(4096, 64, 512, plain=True)  # K past one step of STREAM_MAX_K
    assert not streams(4096, 1024, 64, plain=True)  # too wide
    assert not any(
        c.get("STREAM") for c in gemm.candidates(4096, 64, 64, torch.float32, plain=True)
    )  # 16-bit only
    for c in streams(4096, 64, 256, plain=True):
        assert c["BLOCK_K"] == 256 and c["BLOCK_N"] == 64
        assert not gemm.takes_tma(gemm.LOOP_TMA, c)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_tma_kernel(device, backend, dtype):
    """loop="tma": the persistent TMA kernel where the layout allows it (16-byte aligned
    rows), the pointer kernel elsewhere; the same results either way."""
    used = []
    for m, k, n in [(37, 48, 70), (130, 64, 9), (5, 13, 8)]:
        x, w, b, r = _inputs(m, k, n, dtype, device)
        out = linear_mod.linear_rows(x, w, b, r, 0.5, ACT_CODE["gelu"], loop="tma")
        assert_close_verbose(out, _ref64(x, w, b, "gelu", r, 0.5), dtype)
        used.append(linear_mod.linear_choice(x, w, b, "gelu", r, 0.5, loop="tma")["kernel"])
    assert used == ["tma", "tma", "ptr"]  # K = 13 rows are not 16-byte aligned: pointers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (4096, 4096, 4096),
        (300, 512, 1000),
        (200, 1024, 1000),
        (1, 1024, 64),
        (4096, 256, 64),  # many rows, 64 columns: the 32-column tiles (_NARROW_N) too
        (16, 4096, 4096),
        (64, 4096, 4096),
    ],
)
def test_linear_tma_kernel_gpu(m, k, n):
    x, w, b, r = _inputs(m, k, n, torch.bfloat16, "cuda")
    for cfg in gemm.candidates(m, n, k, torch.bfloat16, gemm.LOOP_TUNED):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm.launch_linear(out, x, w, b, r, 0.5, 4, cfg, tma=True)  # 4: gelu_tanh
        assert_close_verbose(out, _ref64(x, w, b, "gelu_tanh", r, 0.5), torch.bfloat16)


def _store_pair(m, k, n, dtype, device, cfg, out_view=None, residual=True, programs=None):
    """(output of the TMA kernel with cfg's descriptor stores, with the same tile's pointer
    stores, the float64 reference): bias + GELU-tanh [+ 0.5 x residual]. The pointer-store
    twin takes 2 stages and no flattened loop (the same K order; cfg's own stages may not
    fit beside the pointer stores' layout change). out_view(m, n): an output tensor other
    than a fresh contiguous one (a strided view); programs: the TMA kernel's grid size."""
    x, w, b, r = _inputs(m, k, n, dtype, device, residual=residual)
    twin = {key: v for key, v in cfg.items() if key not in ("OUT_SUB", "FLATTEN")}
    outs = []
    for c in (cfg, dict(twin, num_stages=2)):
        out = out_view(m, n) if out_view else torch.empty(m, n, dtype=dtype, device=device)
        out.fill_(float("nan"))
        gemm.launch_linear(out, x, w, b, r, 0.5, 4, c, tma=True, programs=programs)  # gelu_tanh
        outs.append(out)
    return (*outs, _ref64(x, w, b, "gelu_tanh", r, 0.5))


@pytest.mark.parametrize("sub", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_tma_store(sub, dtype, monkeypatch):
    """The TMA kernel's descriptor stores (OUT_SUB column slices, _tma_store): the pointer
    stores' values bit for bit, ragged last row and column tiles (the TMA drops what lies
    past M and N), two tiles a program (the flattened tile loop); an output whose rows are
    not 16-byte aligned takes the pointer stores."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    described = []  # (shape, strides, block) of every descriptor made
    make = TensorDescriptor.from_tensor

    def from_tensor(t, block):
        described.append((tuple(t.shape), t.stride(), tuple(block)))
        return make(t, block)

    monkeypatch.setattr(TensorDescriptor, "from_tensor", from_tensor)
    cfg = dict(gemm.configs._cfg(32, 64, 16, 4, 2), OUT_SUB=sub, FLATTEN=True)
    tma_out, ptr_out, ref = _store_pair(70, 48, 72, dtype, "cpu", cfg, programs=2)
    assert torch.equal(tma_out, ptr_out)
    assert_close_verbose(tma_out, ref, dtype)
    assert ((70, 72), (72, 1), (32, 64 // sub)) in described  # out's, in slices
    described.clear()
    wide = torch.empty(70, 77, dtype=dtype)  # 77-element rows: no descriptor over them
    tma_out, ptr_out, ref = _store_pair(
        70, 48, 72, dtype, "cpu", cfg, lambda m, n: wide[:, :n], programs=2
    )
    assert torch.equal(tma_out, ptr_out)
    assert_close_verbose(tma_out, ref, dtype)
    assert described and not any(shape == (70, 72) for shape, _, _ in described)


def test_tma_store_candidates(monkeypatch):
    """Plain 16-bit layers on the TMA loop also time the descriptor-store tiles, with slices
    of at least 16 columns; LoRA's launches (not plain) and the pointer loop do not."""
    plain = gemm.candidates(4096, 1024, 1024, torch.bfloat16, gemm.LOOP_TMA, plain=True)
    stores = [c for c in plain if c.get("OUT_SUB")]
    assert len(stores) == len(gemm.configs._TMA_STORE) and all(c["FLATTEN"] for c in stores)
    assert not any(
        c.get("OUT_SUB")
        for c in gemm.candidates(4096, 1024, 1024, torch.bfloat16, gemm.LOOP_TMA)
        + gemm.candidates(4096, 1024, 1024, torch.bfloat16, gemm.LOOP_PTR, plain=True)
    )

    def with_res(residual):
        return [
            c for c in gemm.candidates(
                4096, 1024, 1024, torch.bfloat16, gemm.LOOP_TMA, plain=True, residual=residual
            ) if c.get("OUT_SUB")
        ]  # fmt: skip

    # 128 x 256 x 64 / 4 stages does not fit beside a residual's tile: left out
    big = dict(gemm.configs._cfg(128, 256, 64, 8, 4), OUT_SUB=4, FLATTEN=True)
    assert big in stores
    assert with_res(True) == [c for c in stores if c != big]
    monkeypatch.setattr(gemm.configs, "_TMA_STORE", [big])
    assert with_res(False) == [big] and with_res(True) == []
    for c in gemm.candidates(512, 16, 1024, torch.bfloat16, gemm.LOOP_TMA, plain=True):
        if c.get("OUT_SUB"):
            assert c["BLOCK_N"] == 16 and c["OUT_SUB"] == 1
    assert not any(  # 16-bit only
        c.get("OUT_SUB")
        for c in gemm.candidates(4096, 1024, 1024, torch.float32, gemm.LOOP_TMA, plain=True)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("m", "k", "n", "dtype"),
    [
        (4096, 1024, 1024, torch.bfloat16),
        (300, 512, 1000, torch.bfloat16),
        (1000, 256, 200, torch.float16),
        (777, 384, 264, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("residual", [True, False])
def test_linear_tma_store_gpu(m, k, n, dtype, residual):
    """Every descriptor-store candidate on the GPU, with and without a residual (each has
    its own candidates): the pointer stores' values bit for bit (the same tile and loop),
    and close to the float64 reference."""
    cands = gemm.candidates(m, n, k, dtype, gemm.LOOP_TMA, plain=True, residual=residual)
    for cfg in cands:
        if not cfg.get("OUT_SUB"):
            continue
        tma_out, ptr_out, ref = _store_pair(m, k, n, dtype, "cuda", cfg, residual=residual)
        assert torch.equal(tma_out, ptr_out), cfg
        assert_close_verbose(tma_out, ref, dtype)


def _reg_pipe_pair(m, k, n, dtype, device, tile):
    """(the pointer loop's output with REG_PIPE, without, the float64 reference) for one
    (BLOCK_M, BLOCK_N, BLOCK_K, warps) tile: bias + ReLU + 0.5 x residual."""
    x, w, b, r = _inputs(m, k, n, dtype, device)
    outs = []
    for reg in (True, False):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        cfg = dict(gemm.configs._cfg(*tile, 1 if reg else 2), REG_PIPE=reg)
        gemm.launch_linear(out, x, w, b, r, 0.5, 1, cfg)  # 1: relu
        outs.append(out)
    return (*outs, _ref64(x, w, b, "relu", r, 0.5))


@pytest.mark.parametrize(("m", "k", "n"), [(37, 45, 70), (70, 131, 33), (16, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reg_pipe(m, k, n, dtype):
    """The pointer loop with its loads a step early (REG_PIPE, for rows that are not
    16-byte aligned): the same K steps in the same order as the plain loop, so the same
    values bit for bit, ragged last step included."""
    reg, plain, ref = _reg_pipe_pair(m, k, n, dtype, "cpu", (32, 32, 16, 4))
    assert torch.equal(reg, plain)
    assert_close_verbose(reg, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("m", "k", "n"), [(4096, 367, 512), (1000, 479, 1024), (300, 100, 70)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tile", [(128, 128, 64, 8), (64, 64, 32, 4), (128, 256, 64, 8)])
def test_linear_reg_pipe_gpu(m, k, n, dtype, tile):
    """REG_PIPE on the GPU over unaligned rows (K = 367, the DLRM's): bit for bit the
    plain loop's values (the same dots in the same order), close to the reference."""
    if dtype == torch.float32:
        tile = (*tile[:2], tile[2] // 2, tile[3])
    reg, plain, ref = _reg_pipe_pair(m, k, n, dtype, "cuda", tile)
    assert torch.equal(reg, plain)
    assert_close_verbose(reg, ref, dtype)


def test_gemm_path_choice(monkeypatch):
    """gemm_loop's loop: auto takes TMA only on Hopper+ CUDA tensors with aligned rows,
    from TMA_MIN_M rows, tuned up to TMA_TUNED_MAX_M rows and for outputs up to
    TMA_TUNED_N wide; tma / ptr force it (where the layout allows); anything else is an
    error."""
    x = torch.randn(gemm.TMA_MIN_M, 64)
    w = torch.randn(gemm.TMA_TUNED_N + 8, 64)
    assert gemm.gemm_loop(x, w, False) == gemm.LOOP_PTR  # CPU tensors: pointer kernel
    monkeypatch.setattr(gemm.launch, "_tma_device", lambda t: True)  # as on a Hopper GPU
    assert gemm.gemm_loop(x, w, False) == gemm.LOOP_TMA
    assert gemm.gemm_loop(x, w[: gemm.TMA_TUNED_N], False) == gemm.LOOP_TUNED
    assert gemm.gemm_loop(x[: gemm.TMA_TUNED_MAX_M], w, False) == gemm.LOOP_TUNED
    assert gemm.gemm_loop(x[:1], w, False) == gemm.LOOP_TUNED
    assert gemm.gemm_loop(x[: gemm.TMA_TUNED_MAX_M + 1], w, False) == gemm.LOOP_PTR
    assert gemm.gemm_loop(x, w, True) == gemm.LOOP_PTR  # traced by torch.compile
    x13, w13 = torch.randn(gemm.TMA_MIN_M, 13), torch.randn(4, 13)
    assert gemm.gemm_loop(x13, w13, False) == gemm.LOOP_PTR  # 52-byte rows: no TMA
    assert gemm.gemm_loop(x[:1], w, False, "tma") == gemm.LOOP_TMA
    assert gemm.gemm_loop(torch.randn(8, 13), torch.randn(4, 13), False, "tma") == gemm.LOOP_PTR
    assert gemm.gemm_loop(x, w, False, "ptr") == gemm.LOOP_PTR
    assert gemm.gemm_loop(x, w, False, "tuned") == gemm.LOOP_TUNED
    assert gemm.gemm_loop(x13, w13, False, "tuned") == gemm.LOOP_PTR
    with pytest.raises(ValueError, match="loop must be one of"):
        gemm.gemm_loop(x, w, False, "wgmma")
    monkeypatch.setenv("FUSEML_FP32_DOT", "ieee")  # FMA dots: never the TMA kernel
    with tf32_matmuls(False):
        assert gemm.gemm_loop(x, w, False) == gemm.LOOP_PTR
        assert gemm.gemm_loop(x[:1], w, False) == gemm.LOOP_PTR
        assert gemm.gemm_loop(x.bfloat16(), w.bfloat16(), False) == gemm.LOOP_TMA
    with tf32_matmuls(True):  # TF32 allowed: no FMA dot
        assert gemm.gemm_loop(x, w, False) == gemm.LOOP_TMA


def test_fp32_dot_choice(monkeypatch):
    """float32 without TF32 takes FUSEML_FP32_DOT (tf32x3 unless set); with TF32 allowed,
    or 16-bit inputs, the dot is tf32 (ignored for 16-bit); other values are an error."""
    monkeypatch.delenv("FUSEML_FP32_DOT", raising=False)
    with tf32_matmuls(False):
        assert gemm.dot_precision(torch.float32) == "tf32x3"
        assert gemm.dot_precision(torch.bfloat16) == "tf32"
        monkeypatch.setenv("FUSEML_FP32_DOT", "ieee")
        assert gemm.dot_precision(torch.float32) == "ieee"
        monkeypatch.setenv("FUSEML_FP32_DOT", "fp64")
        with pytest.raises(ValueError, match="FUSEML_FP32_DOT"):
            gemm.dot_precision(torch.float32)
    with tf32_matmuls(True):
        assert gemm.dot_precision(torch.float32) == "tf32"


@pytest.mark.parametrize("fp32_dot", gemm.common.FP32_DOTS)
def test_linear_fp32_dots_interpreted(fp32_dot, monkeypatch):
    """Both fp32 dots build and run (the interpreter computes fp32 either way)."""
    monkeypatch.setenv("FUSEML_FP32_DOT", fp32_dot)
    x, w, b, r = _inputs(37, 45, 70, torch.float32, "cpu")
    with tf32_matmuls(False):
        out = fuseml.ops.linear(x, w, b, "gelu", r, 0.5, backend="triton")
    assert_close_verbose(out, _ref64(x, w, b, "gelu", r, 0.5), torch.float32)


def test_tuned_loop_adds_tma_candidates_up_to_tma_tuned_max_m():
    for m in (1, 16, 64):
        plain = gemm.candidates(m, 4096, 4096, torch.bfloat16)
        tuned = gemm.candidates(m, 4096, 4096, torch.bfloat16, gemm.LOOP_TUNED)
        assert not any(c.get("TMA") for c in plain)
        assert [c for c in tuned if not c.get("TMA")] == plain
        assert 1 <= len([c for c in tuned if c.get("TMA")]) <= len(gemm.configs._SMALL_TMA)
    mid = gemm.candidates(256, 4096, 4096, torch.bfloat16, gemm.LOOP_TUNED)
    assert [c for c in mid if not c.get("TMA")] == gemm.candidates(256, 4096, 4096, torch.bfloat16)
    assert len([c for c in mid if c.get("TMA")]) == len(gemm.configs._MID_TMA)
    big = gemm.candidates(4096, 4096, 4096, torch.bfloat16, gemm.LOOP_TUNED)
    assert not any(c.get("TMA") for c in big)
    narrow = gemm.candidates(4096, 16, 64, torch.bfloat16, gemm.LOOP_TUNED)
    plain = gemm.candidates(4096, 16, 64, torch.bfloat16)
    assert narrow == plain + [dict(c, TMA=True) for c in plain]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_tuned_loop_runs_the_chosen_kernel(device, backend):
    """LOOP_TUNED: a config flagged TMA launches the TMA kernel, any other the pointer
    kernel; both give the same result (small M, as on a Hopper GPU)."""
    x, w, b, r = _inputs(16, 64, 40, torch.bfloat16, device)
    ref = _ref64(x, w, b, "gelu", r, 0.5)
    cands = gemm.candidates(16, 40, 64, torch.bfloat16, gemm.LOOP_TUNED)
    gelu = ACT_CODE["gelu"]
    for want_tma in (True, False):
        cfg = next(c for c in cands if bool(c.get("TMA")) == want_tma)
        out = linear_mod.linear_rows(x, w, b, r, 0.5, gelu, loop="tuned", config=cfg)
        assert_close_verbose(out, ref, torch.bfloat16)
        choice = linear_mod.linear_choice(x, w, b, "gelu", r, 0.5, loop="tuned", config=cfg)
        assert (choice["kernel"] == "tma") == want_tma, cfg


def test_module_parameters_launch_directly_outside_autograd():
    """nn.Parameter weights must not send a no-grad call through the op dispatcher (tens of
    microseconds per call); a call autograd records, or a tensor subclass, must."""
    from fuseml.ops._utils import needs_dispatch

    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(3, 8))
    with torch.no_grad():
        assert not needs_dispatch(x, w, None)
    assert needs_dispatch(x, w)  # grad mode on and w requires grad

    class Sub(torch.Tensor):
        pass

    with torch.no_grad():
        assert needs_dispatch(x.as_subclass(Sub), w)


def test_tuning_where_no_config_runs_keeps_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    monkeypatch.setattr(_tune, "autotune_enabled", lambda: True)
    monkeypatch.setattr(_tune, "_tables", {})

    def bench(cfg):
        raise RuntimeError("out of resource: shared memory")

    with caplog.at_level("WARNING", logger="fuseml"):
        got = _tune.tuned(torch.device("cpu"), "k", [{"a": 1}, {"a": 2}], bench, {"a": 0})
    assert got == {"a": 0}
    assert "none of 2 configs ran" in caplog.text and "shared memory" in caplog.text
    assert not list(tmp_path.glob("tune/*.json"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_direct_launch_matches_the_ordinary_launch_gpu(monkeypatch):
    """Repeat launches of the pointer kernel go through the compiled kernel's own launcher
    (CompiledLaunches): same output as Triton's ordinary launch for batch sizes 1, a
    multiple of 16 and neither, with and without bias / residual, for a 16-byte-misaligned
    x (ordinary launch) and a column-strided one."""
    k, n = 40, 24
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    buf = torch.randn(100 * k + 1, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 32, 37)]
    xs += [buf[1 : 1 + 100 * k].view(100, k), buf[: 50 * k].view(k, 50).t()]
    cfg = gemm.default_config(64, n, k, torch.bfloat16)
    launches = gemm.launch._linear_launches
    for x in xs:
        for bias, res in ((b, None), (None, torch.randn(x.shape[0], n, device="cuda").bfloat16())):
            outs = []
            for direct in (False, True, True):  # ordinary, then the first and a repeat
                monkeypatch.setattr(launches, "enabled", direct)
                out = torch.full((x.shape[0], n), float("nan"), device="cuda").bfloat16()
                gemm.launch_linear(out, x, w, bias, res, 0.5, 1, cfg)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
            assert_close_verbose(outs[2], _ref64(x, w, bias, "relu", res, 0.5), torch.bfloat16)
    assert len(launches.compiled) >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_tma_direct_launch_matches_the_ordinary_launch_gpu(monkeypatch):
    """The TMA kernel's repeat launches (host descriptors through the compiled kernel's
    launcher) give the ordinary launch's output: rows 1, 37 and 512, bias or residual, a
    bf16 and a float32 output (LoRA's precomputed x @ A^T is written in float32)."""
    if not gemm.launch._has_tma(torch.cuda.current_device()):
        pytest.skip("needs TMA (Hopper or later)")
    k, n = 64, 72
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    launches = gemm.launch._linear_tma_launches
    for m in (1, 37, 512):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = gemm.default_config(m, n, k, torch.bfloat16)
        res = torch.randn(m, n, device="cuda").bfloat16()
        for bias, r, out_dtype in ((b, None, torch.bfloat16), (None, res, torch.float32)):
            outs = []
            for direct in (False, True, True):  # ordinary, then the first and a repeat
                monkeypatch.setattr(launches, "enabled", direct)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
                gemm.launch_linear(out, x, w, bias, r, 0.5, 1, cfg, tma=True)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
            assert_close_verbose(outs[2], _ref64(x, w, bias, "relu", r, 0.5), out_dtype)
    assert len(launches.compiled) >= 4


def test_pad_k_rule():
    """K padded to a multiple of 16 between 64 and PAD_K_MAX, from PAD_K_MIN_M rows."""
    m = linear_mod.PAD_K_MIN_M
    assert linear_mod.pad_k_rule(m, 367) == 368
    assert linear_mod.pad_k_rule(m, 65) == 80
    assert linear_mod.pad_k_rule(m - 1, 367) == 367  # few rows: the pad costs more
    assert linear_mod.pad_k_rule(m, 368) == 368
    assert linear_mod.pad_k_rule(m, 13) == 13  # one K step (the DLRM's 13 -> 512)
    assert linear_mod.pad_k_rule(m, linear_mod.PAD_K_MAX + 1) == linear_mod.PAD_K_MAX + 1
    assert linear_mod.pad_k_rule("s0", 367) == 367  # a symbolic M (torch.compile)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_linear_padded_k(device, backend):
    """The padded-K path (asked for here on any device): x and W zero-padded, the same
    result; W's padded copy is made once per weight and version."""
    x, w, b, r = _inputs(40, 100, 24, torch.float32, device, lead=(2,))
    x = x[..., :99]  # strided rows, K = 99 -> 112
    w = w[:, :99].contiguous()
    code = ACT_CODE["gelu"]

    def call():
        return linear_mod.linear_rows(x, w, b, r, 0.5, code, pad_to=112)

    kept = dict(_utils._KEPT)
    out = call()
    assert_close_verbose(out, _ref64(x, w, b, "gelu", r, 0.5), torch.float32)
    assert len(_utils._KEPT) == len(kept) + 1  # W's padded copy, kept
    held = dict(_utils._KEPT)
    call()
    assert dict(_utils._KEPT) == held  # the padded W was reused
    w.mul_(2.0)  # a new version: padded again
    out = call()
    assert_close_verbose(out, _ref64(x, w, b, "gelu", r, 0.5), torch.float32)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_padded_launch_offers_the_fast_path_the_calls_own_tensors(device, backend, monkeypatch):
    """A padded call whose W copy is kept offers the eager fast path its launch with the
    call's own x and W beside the padded copies it read; one that pads both in the launch
    (W not kept: an inference tensor has no version) offers nothing."""
    from fuseml.ops.gemm import launch as gemm_launch

    x, w, b, _ = _inputs(40, 100, 24, torch.float32, device)
    seen = []
    real = gemm_launch.launch_linear

    def spy(out, x2, weight, *args, **kwargs):  # (observes the launch; changes nothing)
        seen.append((x2, weight, kwargs.get("fast"), kwargs.get("unpadded")))
        return real(out, x2, weight, *args, **kwargs)

    monkeypatch.setattr(gemm_launch, "launch_linear", spy)

    def call(x, w):  # linear_rows's own steps, at K padded to 112, as the call it offers
        out, _, pick, run = linear_mod._prepare(
            x, w, b, None, 1.0, ACT_CODE["relu"], False, None, "auto", pad_to=112
        )
        run(pick(None), fast=True)
        return out

    out = call(x, w)
    x2, w2, fast, unpadded = seen[-1]  # (the call's own launch, after any tuning)
    assert fast and unpadded[0] is x and unpadded[1] is w
    assert x2.shape == (40, 112) and w2.shape == (24, 112)
    assert_close_verbose(out, _ref64(x, w, b, "relu"), torch.float32)
    with torch.inference_mode():
        out = call(x.clone(), w.clone())
    assert seen[-1][2] is False and seen[-1][3] is None
    assert_close_verbose(out, _ref64(x, w, b, "relu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [64, 200, 600, 4096])
def test_linear_padded_k_gpu(dtype, m):
    """The DLRM's 367 -> 512 layer (padded from PAD_K_MIN_M rows) matches the reference,
    also replayed from a CUDA graph after an in-place update of W (padded inside the graph,
    in x's launch)."""
    assert linear_mod.pad_k_rule(m, 367) == (368 if m >= linear_mod.PAD_K_MIN_M else 367)
    x, w, b, r = _inputs(m, 367, 512, dtype, "cuda")
    out = fuseml.ops.linear(x, w, b, "relu", r, 0.5, backend="triton")
    assert_close_verbose(out, _ref64(x, w, b, "relu", r, 0.5), dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fuseml.ops.linear(x, w, b, "relu", r, 0.5, backend="triton")  # tunes the graph's path
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fuseml.ops.linear(x, w, b, "relu", r, 0.5, backend="triton")
    w.mul_(-1.0)
    graph.replay()
    assert_close_verbose(out, _ref64(x, w, b, "relu", r, 0.5), dtype)


def _spy_tuning_keys(monkeypatch, flag: str) -> list:
    """Record (extra key, the ``flag`` keyword) of every choose_config call from now on."""
    seen = []
    choose = gemm.choose_config

    def spy(op, x, n, k, launch, extra="", loop=gemm.LOOP_PTR, **kw):
        seen.append((extra, kw.get(flag)))
        return choose(op, x, n, k, launch, extra, loop, **kw)

    monkeypatch.setattr(gemm.launch, "choose_config", spy)
    return seen


def test_residual_layers_are_tuned_apart(monkeypatch):
    """A layer with a residual has its own tuning entry and candidates (some TMA-store tiles
    do not fit beside the residual's tile): an entry tuned without one never serves it."""
    seen = _spy_tuning_keys(monkeypatch, "residual")
    x, w, b, r = _inputs(20, 16, 24, torch.float32, "cpu")
    fuseml.ops.linear(x, w, b, "relu", backend="triton")
    fuseml.ops.linear(x, w, b, "relu", r, 0.5, backend="triton")
    assert seen == [("", False), ("res", True)]


def test_unaligned_rows_are_tuned_apart(monkeypatch):
    """Rows that are not 16-byte aligned have their own tuning entry, whose pointer-loop
    candidates include the REG_PIPE tiles (one stage: the loop's loads are not async)."""
    seen = _spy_tuning_keys(monkeypatch, "unaligned")
    for k in (45, 64):  # 180-byte rows, 256-byte rows (float32)
        x, w, b, _ = _inputs(20, k, 24, torch.float32, "cpu")
        fuseml.ops.linear(x, w, b, "relu", backend="triton")
    assert seen == [("u", True), ("", False)]
    reg = [
        c for c in gemm.candidates(4096, 512, 367, torch.bfloat16, unaligned=True)
        if c.get("REG_PIPE")
    ]  # fmt: skip
    assert len(reg) == len(gemm.configs._REG_PIPE) and all(c["num_stages"] == 1 for c in reg)
    assert not any(
        c.get("REG_PIPE")
        for c in gemm.candidates(4096, 512, 367, torch.bfloat16)
        + gemm.candidates(4096, 512, 367, torch.bfloat16, gemm.LOOP_TMA, unaligned=True)
        + gemm.candidates(4096, 512, 48, torch.bfloat16, unaligned=True)  # one K step
        + gemm.candidates(32, 512, 367, torch.bfloat16, unaligned=True)  # few rows
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pad_k_copies_in_one_launch(dtype, monkeypatch):
    """pad_k: each tensor (any strides) copied into contiguous rows of kp columns, the new
    columns zero; two tensors in one launch (x and W inside a graph capture)."""
    calls = []
    launches = gemm.pad._pad_launches
    monkeypatch.setattr(gemm.pad, "_pad_launches", lambda *a: calls.append(1) or launches(*a))
    x = torch.randn(45, 37, dtype=dtype).t()  # (37, 45), column-major
    w = torch.randn(70, 45, dtype=dtype)
    xp, wp = gemm.pad_k(64, x, w)
    assert calls == [1]
    for src, padded in ((x, xp), (w, wp)):
        assert padded.shape == (src.shape[0], 64) and padded.is_contiguous()
        assert torch.equal(padded[:, :45], src) and not padded[:, 45:].any()
    (one,) = gemm.pad_k(48, w[:3])
    assert torch.equal(one[:, :45], w[:3]) and not one[:, 45:].any()
    with pytest.raises(ValueError, match="one or two tensors"):
        gemm.pad_k(48, x, w, w)
    with pytest.raises(ValueError, match="one K, dtype and device"):
        gemm.pad_k(64, x, w[:, :40])
    with pytest.raises(ValueError, match="kp >= K"):
        gemm.pad_k(32, x)


@pytest.mark.parametrize(("rows", "ms", "loop", "plain", "penalized"), [
    (64, 0.004, gemm.LOOP_TUNED, True, True),  # host-bound plain layer: TMA must win by more
    (64, 0.2, gemm.LOOP_TUNED, True, True),  # (few rows: host-bound at any tile time)
    (65536, 0.004, gemm.LOOP_TUNED, True, True),  # narrow output, a fast tile: host-bound
    (65536, 0.2, gemm.LOOP_TUNED, True, False),  # a slow tile: GPU time decides
    (64, 0.004, gemm.LOOP_TUNED, False, False),  # LoRA's modes: no C++ fast path either way
    (64, 0.004, gemm.LOOP_PTR, True, False),  # (no TMA tile on the pointer loop)
])  # fmt: skip
def test_host_bound_plain_layers_time_tma_tiles_with_a_penalty(rows, ms, loop, plain, penalized):
    """A host-bound plain layer's eager call (up to TMA_TUNED_MAX_M rows, or a tile faster
    than TMA_HOST_BOUND_MS) repeats from C++ only on a pointer tile, so tuning times a TMA
    tile TMA_HOST_BOUND_PENALTY slower than it ran."""
    ptr, tma = {"BLOCK_M": 16}, {"BLOCK_M": 16, "TMA": True}
    assert gemm.launch.tuning_ms(ms, ptr, loop, rows, plain) == ms
    expected = ms * gemm.configs.TMA_HOST_BOUND_PENALTY if penalized else ms
    assert gemm.launch.tuning_ms(ms, tma, loop, rows, plain) == pytest.approx(expected)


def test_offered_gemm_names_the_calls_own_tensors(monkeypatch):
    """A launch offered to the eager fast path carries the call's x and W, and where the
    launch read zero-padded copies, those beside them (``used``)."""
    offered = []
    monkeypatch.setattr(gemm.launch._fastcall, "register_gemm", lambda *args: offered.append(args))
    x, w, b, _ = _inputs(4, 8, 6, torch.float32, "cpu")
    xp, wp, out = torch.zeros(4, 16), torch.zeros(6, 16), torch.empty(4, 6)
    gemm.launch._offer_gemm((1, b, None), x, w, out, 1.0, "ck", (1,), {}, ())
    gemm.launch._offer_gemm((1, b, (x, w)), xp, wp, out, 1.0, "ck", (1,), {}, ())
    (c0, x0, w0, b0, *_, used0), (_, x1, w1, _, *_, used1) = offered
    assert c0 == 1 and x0 is x and w0 is w and b0 is b and used0 is None
    assert x1 is x and w1 is w and used1[0] is xp and used1[1] is wp


def test_cublaslt_candidate_only_for_layers_it_computes_alike():
    """gemm.VENDOR (cuBLASLt's kernel) is offered to a layer with a bias and a ReLU or no
    activation, its output in x's dtype, 16-bit inputs or float32 where TF32 is allowed."""
    relu, none = ACT_CODE["relu"], ACT_CODE["none"]
    x, _, b, r = _inputs(8, 16, 24, torch.bfloat16, "cpu")
    out = torch.empty(8, 24, dtype=torch.bfloat16)
    assert gemm.vendor_fits(x, b, None, relu, out) and gemm.vendor_fits(x, b, None, none, out)
    assert not gemm.vendor_fits(x, None, None, relu, out)  # no bias
    assert not gemm.vendor_fits(x, b, r, relu, out)  # a residual
    assert not gemm.vendor_fits(x, b, None, ACT_CODE["gelu_tanh"], out)
    assert not gemm.vendor_fits(x, b, None, relu, out.float())  # another output dtype
    x32, b32, out32 = x.float(), b.float(), out.float()
    with tf32_matmuls(True):
        assert gemm.vendor_fits(x32, b32, None, relu, out32)
    with tf32_matmuls(False):  # fp32 accuracy: fuseml's tf32x3, not cuBLAS's SGEMM
        assert not gemm.vendor_fits(x32, b32, None, relu, out32)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "none"])
def test_cublaslt_config_matches_float64(device, backend, dtype, activation):
    x, w, b, _ = _inputs(37, 48, 70, dtype, device, residual=False)
    tf32 = dtype == torch.float32
    with tf32_matmuls(tf32):
        out = linear_mod.linear_rows(x, w, b, None, 1.0, ACT_CODE[activation], config=gemm.VENDOR)
        choice = linear_mod.linear_choice(x, w, b, activation, config=gemm.VENDOR)
    assert choice == {**gemm.VENDOR, "kernel": "cublaslt"}
    assert_close_verbose(out, _ref64(x, w, b, activation), dtype, tf32=tf32)
    with pytest.raises(ValueError, match="ReLU or no activation, not 'gelu'"):
        linear_mod.linear_rows(x, w, b, None, 1.0, ACT_CODE["gelu"], config=gemm.VENDOR)


def test_cublaslt_layers_are_tuned_apart(monkeypatch):
    """A layer cuBLASLt's kernel may run is tuned with it as one more candidate, under its
    own key: an entry naming that kernel never serves a layer it would compute otherwise."""
    seen = _spy_tuning_keys(monkeypatch, "more")
    x, w, b, _ = _inputs(20, 16, 24, torch.bfloat16, "cpu", residual=False)
    fuseml.ops.linear(x, w, b, "relu", backend="triton")
    fuseml.ops.linear(x, w, b, "gelu", backend="triton")
    fuseml.ops.linear(x, w, None, "relu", backend="triton")
    assert seen == [("v", [gemm.VENDOR]), ("", ()), ("", ())]


def test_cublaslt_timed_with_the_host_bound_penalty():
    """cuBLASLt's kernel launches from Python on every call: where a call is host-bound the
    tuner counts it TMA_HOST_BOUND_PENALTY slower, as it does the TMA tiles."""
    tuning_ms, penalty = gemm.launch.tuning_ms, gemm.configs.TMA_HOST_BOUND_PENALTY
    assert tuning_ms(0.01, gemm.VENDOR, gemm.LOOP_TMA, 4096, True) == 0.01 * penalty
    assert tuning_ms(0.2, gemm.VENDOR, gemm.LOOP_PTR, 64, True) == 0.2 * penalty
    assert tuning_ms(0.2, gemm.VENDOR, gemm.LOOP_TMA, 65536, True) == 0.2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cublaslt_candidate_is_timed_and_served_gpu(fresh_tuning, monkeypatch, dtype):
    """A first call tunes cuBLASLt's kernel beside the tiles; the call and its repeats
    (from C++ where a tile won) give the same output, the float64 reference's."""
    timed = []
    launch = gemm.launch.launch_vendor

    def counting(*args):
        timed.append(args[0].shape)
        return launch(*args)

    monkeypatch.setattr(gemm.launch, "launch_vendor", counting)
    x, w, b, _ = _inputs(4096, 1024, 1024, dtype, "cuda", residual=False)
    with tf32_matmuls(True):
        out = fuseml.ops.linear(x, w, b, "relu")
        repeats = [fuseml.ops.linear(x, w, b, "relu") for _ in range(3)]
        choice = linear_mod.linear_choice(x, w, b, "relu")
    assert timed and choice["kernel"] in ("cublaslt", "tma", "ptr", "stream")
    assert_close_verbose(out, _ref64(x, w, b, "relu"), dtype, tf32=True)
    assert all(torch.equal(r, out) for r in repeats)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_cublaslt_config_under_torch_compile(device, backend, monkeypatch):
    """A layer whose tuned entry names cuBLASLt's kernel traces into torch.compile's graph
    (fullgraph) as that kernel and gives the reference's output."""
    choose = gemm.choose_config

    def prefer_vendor(op, x, n, k, launch, extra="", loop=gemm.LOOP_PTR, **kw):
        if gemm.VENDOR in kw.get("more", ()):
            return gemm.VENDOR
        return choose(op, x, n, k, launch, extra, loop, **kw)

    monkeypatch.setattr(gemm.launch, "choose_config", prefer_vendor)
    launched = []
    launch = gemm.launch.launch_vendor
    monkeypatch.setattr(gemm.launch, "launch_vendor", lambda *a: (launched.append(1), launch(*a)))
    x, w, b, _ = _inputs(40, 64, 48, torch.bfloat16, device, residual=False)
    torch._dynamo.reset()
    fn = torch.compile(
        lambda x: fuseml.ops.linear(x, w, b, "relu", backend=backend), fullgraph=True
    )
    assert_close_verbose(fn(x), _ref64(x, w, b, "relu"), torch.bfloat16)
    assert launched  # (traced: the graph holds cuBLASLt's kernel)
    assert linear_mod.linear_choice(x, w, b, "relu")["kernel"] == "cublaslt"
