"""Programmatic dependent launch (``pdl_launch``): where it is on, and chains of fused ops
launched with it, each reading what the one before wrote (or writing what it read),
computing exactly what they compute without it: on a stream, in a CUDA graph, for every
kernel that takes it (elementwise flat and 2-D, softmax on-chip / split / online /
strided, linear pointer / TMA / streaming), both backends."""

import importlib

import pytest
import torch

import fuseml
from fuseml.ops import _elementwise, _fastcall, _utils, gemm
from fuseml.testing import rel_err, tolerance

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_off_on_the_cpu_and_when_traced(monkeypatch):
    monkeypatch.setenv("FUSEML_PDL", "1")
    assert not _utils.pdl_launch(torch.randn(4))
    if torch.cuda.is_available():
        assert not _utils.pdl_launch(torch.randn(4, device="cuda"), traced=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switch(monkeypatch):
    x = torch.randn(4, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.setenv("FUSEML_PDL", "1")
    assert _utils.pdl_launch(x) == hopper
    monkeypatch.setenv("FUSEML_PDL", "0")
    assert not _utils.pdl_launch(x)
    monkeypatch.setenv("FUSEML_PDL", "yes")
    with pytest.raises(ValueError, match="FUSEML_PDL must be 0 or 1"):
        _utils.pdl_launch(x)
    with pytest.raises(RuntimeError, match="FUSEML_PDL must be 0 or 1"):
        fuseml.ops.add(x, x, backend="cuda")


def _stream_linear(x, w):
    """x @ w^T + ReLU through the streaming kernel (a STREAM candidate, whatever the tuner
    would pick); 16-bit, K <= 256."""
    m, k = x.shape
    cfg = next(c for c in gemm.candidates(m, w.shape[0], k, x.dtype, plain=True) if "STREAM" in c)
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    gemm.launch_linear(out, x, w, None, None, 1.0, _elementwise.ACT_CODE["relu"], cfg)
    return out


def _chain(x, y, b, w, wb, w2, backend):
    """Each step reads what the step before wrote; one writes in place what the step
    before read. Every kernel that launches with PDL is in it."""
    ops = fuseml.ops
    h = ops.add(x, y, backend=backend)  # flat
    for _ in range(2):
        h = ops.bias_act(h, b, residual=y, alpha=0.5, activation="tanh", backend=backend)  # 2-D
        ops.bias_act(y, None, residual=h, alpha=0.25, activation="none", out=y, backend=backend)
        h = ops.softmax(h * 8.0, -1, backend=backend)  # on-chip rows (after a torch kernel)
        h = ops.gelu(h * 64.0, backend=backend)
        h = ops.linear(h, w, wb, "relu", backend="triton")  # (no CUDA twin) TMA on Hopper
        h = ops.linear(h[:64], w, wb, "gelu_tanh", backend="triton").repeat(x.shape[0] // 64, 1)
        if w2 is not None:  # the streaming kernel (16-bit only), K = 256 of a strided x
            h = _stream_linear(h[:, : w2.shape[1]], w2)
        h = ops.log_softmax(h, 0, backend=backend)  # a non-last dim
    flat = h.reshape(-1)
    split = ops.softmax(flat.view(-1, 1 << 16) * 8.0, -1, backend=backend)  # long rows
    online = ops.softmax(torch.cat([flat, flat]).view(1, -1), -1, backend=backend)  # longest
    return h, split, online, y


@pytest.mark.parametrize("backend", [pytest.param(b, marks=gpu) for b in ("triton", "cuda")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_dependent_chain_same_with_and_without_pdl(backend, dtype, graph, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    m, n = 2048, 512

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    w2 = rand(n, 256) / 16.0 if dtype != torch.float32 else None
    inputs = (rand(m, n), rand(m, n), rand(n), rand(n, n) / n**0.5, rand(n), w2)
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUSEML_PDL", flag)
        args = [None if t is None else t.clone() for t in inputs]
        if graph:
            _chain(*[None if t is None else t.clone() for t in inputs], backend)  # compiles
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                outs = _chain(*args, backend)
            args[1].copy_(inputs[1])  # (y is updated in place)
            cg.replay()
        else:
            outs = _chain(*args, backend)
        torch.cuda.synchronize()
        results[flag] = [o.clone() for o in outs]
    if torch.cuda.get_device_capability()[0] >= 9:
        assert _utils.pdl_launch(inputs[0])  # (FUSEML_PDL=1 here): the test tested it
    for off, on in zip(results["0"], results["1"], strict=True):
        assert torch.isfinite(on.float()).all()
        # bit for bit: no launch shape in the chain changes under PDL (float32 rows of 512
        # columns take the same two-row programs either way, launched without it; 16-bit
        # rows of a 1024-wide block, which do change, are not in it)
        assert torch.equal(off, on)


@pytest.mark.parametrize("backend", [pytest.param(b, marks=gpu) for b in ("triton", "cuda")])
@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_long_chain_of_launch_bound_steps(backend, graph, monkeypatch):
    """300 short dependent steps, each racing the one before if a program touched memory
    before its wait: x <- x + y in place (flat), z <- x + 1 (2-D, a bias), x <- z in place
    ... on exact small integers, so any stale read shows in the sums."""
    monkeypatch.setenv("FUSEML_PDL", "1")
    x = torch.zeros(1024, 1024, device="cuda")
    y = torch.ones(1024, 1024, device="cuda")
    one = torch.ones(1024, device="cuda")
    z = torch.empty_like(x)

    def steps():
        for _ in range(100):
            fuseml.ops.bias_act(x, None, residual=y, activation="none", out=x, backend=backend)
            fuseml.ops.bias_act(x, one, activation="none", out=z, backend=backend)
            fuseml.ops.bias_act(z, None, activation="relu", out=x, backend=backend)

    if graph:
        steps()  # compiles off capture
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            steps()
        x.zero_()
        cg.replay()
    else:
        steps()
    torch.cuda.synchronize()
    assert (x == 200.0).all() and (z == 200.0).all()


@pytest.mark.parametrize("graph", [pytest.param(g, marks=gpu) for g in (False, True)],
                         ids=["stream", "graph"])  # fmt: skip
@pytest.mark.parametrize("rows", [64, 640])
def test_lora_and_mlp_chain_under_pdl(graph, rows, monkeypatch):
    """LoRA layers (their TMA launches behind the kernel before, the overlapped shrink /
    expand pair) and the MLP chain kernel, each reading the one before's output, under
    PDL: the float64 reference's result (the LoRA mode, and so the rounding, may differ
    with FUSEML_PDL=0, so not compared bit for bit)."""

    monkeypatch.setenv("FUSEML_PDL", "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(bf)

    x = rand(rows, 512)
    w, b = rand(512, 512, scale=512**-0.5), rand(512)
    a, bb = rand(16, 512, scale=512**-0.5), rand(512, 16, scale=0.25)
    ws = [rand(32, 512, scale=512**-0.5), rand(16, 32, scale=32**-0.5)]
    bs = [rand(32), rand(16)]
    ops = fuseml.ops

    def chain(x):
        h = ops.lora_linear(x, w, b, a, bb, 0.5, activation="relu", backend="triton")
        h = ops.lora_linear(h, w, b, a, bb, 0.5, activation="gelu_tanh", backend="triton")
        return ops.mlp(h, ws, bs, "relu", backend="triton")

    def ref(x):
        d = torch.float64
        h = x.to(d)
        for act in ("relu", "gelu_tanh"):
            h = h @ w.to(d).T + b.to(d) + 0.5 * (h @ a.to(d).T) @ bb.to(d).T
            h = torch.relu(h) if act == "relu" else torch.nn.functional.gelu(h, approximate="tanh")
            h = h.to(bf).to(d)  # each layer's output rounds to bf16
        for wi, bi in zip(ws, bs, strict=True):
            h = torch.relu(h @ wi.to(d).T + bi.to(d)).to(bf).to(d)
        return h

    if graph:
        chain(x)  # compiles off capture
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            out = chain(x)
        cg.replay()
    else:
        out = chain(x)
    torch.cuda.synchronize()
    assert rel_err(out, ref(x)) < 2 * tolerance(bf)


def test_bench_rows_record_pdl(monkeypatch):
    """Every bench row says whether the run launched with PDL (run_metadata's "pdl")."""
    from fuseml.bench import harness

    monkeypatch.setenv("FUSEML_PDL", "0")
    assert harness.pdl_on() is False
    if torch.cuda.is_available():
        monkeypatch.setenv("FUSEML_PDL", "1")
        assert harness.pdl_on() == (torch.cuda.get_device_capability()[0] >= 9)
    else:
        assert harness.pdl_on() is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_softmax_rows_of_few_warps_launch_without_pdl(monkeypatch):
    """The on-chip softmax's launch plans: float32 rows of 512 columns (two-warp programs)
    launch without PDL while it is on, 16-bit rows of 1024 (four-warp programs under it)
    with it, where the device has it; and both give what they give with PDL off."""
    sm = importlib.import_module("fuseml.ops._softmax.rows")
    monkeypatch.setenv("FUSEML_PDL", "1")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for n_cols, dtype, takes in ((512, torch.float32, False), (1024, torch.bfloat16, True)):
        x = torch.randn(64, n_cols, device="cuda", dtype=dtype)
        sm._ROWS_PLANS.clear()
        with _fastcall.suspended():  # (the Python path plans the call)
            on = fuseml.ops.softmax(x, -1, backend="triton")
        (plan,) = sm._ROWS_PLANS.values()
        assert plan[1][-1] is (takes and hopper) and ("launch_pdl" in plan[2]) is (takes and hopper)
        monkeypatch.setenv("FUSEML_PDL", "0")
        off = fuseml.ops.softmax(x, -1, backend="triton")
        monkeypatch.setenv("FUSEML_PDL", "1")
        if dtype == torch.float32:
            assert torch.equal(on, off)  # the same launch shape either way
        else:
            assert rel_err(on, off) < tolerance(dtype)


@pytest.mark.parametrize("graph", [pytest.param(g, marks=gpu) for g in (False, True)],
                         ids=["stream", "graph"])  # fmt: skip
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_embedding_interaction_under_pdl(graph, backend, monkeypatch):
    """The gather + interaction right behind the kernel that writes its x and before one
    that reads its output: bit for bit the same with and without PDL, eager and in a
    graph (a program reading x before its wait would see the old x)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cards = torch.full((26,), 1000)
    offsets = torch.zeros(27, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.cumsum(cards, 0).cuda()
    weight = torch.randn(26_000, 16, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (4096, 26), device="cuda", generator=g, dtype=torch.int32)
    x0 = torch.randn(4096, 16, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(16, device="cuda", generator=g).to(torch.bfloat16)

    def chain(x):
        for _ in range(3):
            fuseml.ops.bias_act(x, bias, activation="tanh", out=x, backend="triton")  # in place
            z = fuseml.ops.embedding_interaction(x, weight, offsets, ids, out_width=368,
                                                 backend=backend)  # fmt: skip
            x = fuseml.ops.bias_act(z[:, :16], None, activation="gelu", backend="triton")
        return x, z

    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUSEML_PDL", flag)
        x = x0.clone()
        if graph:
            chain(x0.clone())  # compiles off capture
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                outs = chain(x)
            x.copy_(x0)
            cg.replay()
        else:
            outs = chain(x)
        torch.cuda.synchronize()
        results[flag] = [o.clone() for o in outs]
    for off, on in zip(results["0"], results["1"], strict=True):
        assert torch.isfinite(on.float()).all() and torch.equal(off, on)
