import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fuseml.nn._common
from fuseml.nn import LoRALinear
from fuseml.ops import _fastcall
from fuseml.ops.bias_act import activation_ref
from fuseml.testing import (
    DTYPES,
    assert_close_verbose,
    capture_graph,
    fused_targets,
    replay_poisoned,
)

TARGETS = fused_targets(cuda_twin=False)


def _up(t):
    return None if t is None else t.detach().double()


def _make(device, dtype=torch.float32, backend="auto", ranks=(4,), activation=None):
    """LoRALinear 32 -> 24 with adapters 'a0', 'a1', ... of the given ranks, non-zero B."""
    m = LoRALinear((32, 24), activation=activation, backend=backend, device=device, dtype=dtype)
    for i, r in enumerate(ranks):
        m.add_adapter(f"a{i}", r, lora_alpha=2 * r + i)  # distinct scalings
        with torch.no_grad():
            m.lora_B[f"a{i}"].weight.normal_()
    m.set_adapter("a0")
    return m


def _ref64(m: LoRALinear, x, adapter_ids=None):
    """Unmerged peft chain in float64; adapter_ids selects per row (-1: base only)."""
    x64 = _up(x)
    h = F.linear(x64, _up(m.weight), _up(m.bias))
    for i, name in enumerate(m.adapters):
        if adapter_ids is None and name != m.active_adapter:
            continue
        sel = (
            torch.ones(x.shape[:-1], dtype=torch.bool) if adapter_ids is None else adapter_ids == i
        )
        sel = sel.cpu()
        a, b = _up(m.lora_A[name].weight).cpu(), _up(m.lora_B[name].weight).cpu()
        lora = F.linear(F.linear(x64.cpu()[sel], a), b) * m.scaling[name]
        h = h.cpu()
        h[sel] = h[sel] + lora
    return activation_ref(h, m.activation or "none")


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_lora_linear_single_adapter(device, backend, dtype, activation):
    m = _make(device, dtype, backend, ranks=(8,), activation=activation)
    x = torch.randn(2, 3, 32, device=device, dtype=dtype)
    with torch.no_grad():
        out = m(x)
    assert out.dtype == dtype and out.shape == (2, 3, 24)
    assert_close_verbose(out, _ref64(m, x), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_lora_linear_multi_adapter_mixed_ranks(device, backend, dtype, ids_dtype):
    m = _make(device, dtype, backend, ranks=(4, 2, 8), activation="relu")
    x = torch.randn(7, 32, device=device, dtype=dtype)
    ids = torch.tensor([0, -1, 2, 1, 1, -1, 0], device=device, dtype=ids_dtype)
    with torch.no_grad():
        out = m(x, ids)
    assert_close_verbose(out, _ref64(m, x, ids), dtype)
    x3 = torch.randn(2, 3, 32, device=device, dtype=dtype)  # batched: ids (2, 3)
    ids3 = torch.tensor([[2, 2, -1], [0, 1, -1]], device=device, dtype=ids_dtype)
    with torch.no_grad():
        out3 = m(x3, ids3)
    assert_close_verbose(out3, _ref64(m, x3, ids3), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_linear_stacked_cache_follows_changes(device, backend):
    m = _make(device, backend=backend, ranks=(4, 2))
    x = torch.randn(5, 32, device=device)
    ids = torch.tensor([0, 1, -1, 1, 0], device=device)
    with torch.inference_mode():
        m(x, ids)
    with torch.no_grad():
        first = m._stacked(m.adapters)
        assert m._stacked(m.adapters) is first  # built once, reused while nothing changes
        assert_close_verbose(m(x, ids), _ref64(m, x, ids))
        m.lora_B["a1"].weight.mul_(3.0)  # in place: same storage, new version
        assert_close_verbose(m(x, ids), _ref64(m, x, ids))
        m.scaling["a0"] = -0.5
        assert_close_verbose(m(x, ids), _ref64(m, x, ids))
        m.add_adapter("extra", 3, init=(torch.randn(3, 32), torch.randn(24, 3)))
        ids2 = torch.tensor([2, 1, -1, 2, 0], device=device)
        assert_close_verbose(m(x, ids2), _ref64(m, x, ids2))
        m.delete_adapter("a0")  # ids shift: 'a1' is 0 now, 'extra' 1
        assert m.adapters == ["a1", "extra"] and m.active_adapter is None
        ids3 = torch.tensor([1, 0, -1, 0, 1], device=device)
        assert_close_verbose(m(x, ids3), _ref64(m, x, ids3))
        m.lora_A["a1"].weight = nn.Parameter(torch.randn(2, 32, device=device))  # replaced
        assert_close_verbose(m(x, ids3), _ref64(m, x, ids3))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_linear_peft_init_and_no_adapter(device, backend):
    base = nn.Linear(32, 24, device=device)
    m = LoRALinear(base, r=4, lora_alpha=16, backend=backend)
    assert m.base_layer is base and m.active_adapter == "default" and m.scaling["default"] == 4.0
    assert not m.lora_B["default"].weight.any() and m.lora_A["default"].weight.abs().sum() > 0
    x = torch.randn(5, 32, device=device)
    ref = F.linear(x.double(), _up(base.weight), _up(base.bias))
    with torch.no_grad():
        assert_close_verbose(m(x), ref)  # B = 0: the layer starts as the base layer
        m.lora_B["default"].weight.normal_()
        m.set_adapter(None)
        assert_close_verbose(m(x), ref)  # no active adapter: the base layer alone
        empty = LoRALinear(base, backend=backend)
        assert_close_verbose(empty(x, torch.full((5,), -1, device=device)), ref)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_merge_unmerge(device, backend, dtype):
    m = _make(device, dtype, backend, ranks=(4, 2), activation="silu")
    m.set_adapter("a1")
    x = torch.randn(5, 32, device=device, dtype=dtype)
    before = m.weight.detach().clone()
    ref = _ref64(m, x)
    m.merge()
    assert m.merged and m.merged_adapter == "a1" and not torch.equal(m.weight, before)
    with torch.no_grad():
        assert_close_verbose(m(x), ref, dtype)
    m.merge()  # no-op
    with pytest.raises(RuntimeError, match="adapter_ids needs unmerged adapters"):
        m(x, torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match="'a1' is merged; unmerge\\(\\) first"):
        m.set_adapter("a0")
    with pytest.raises(RuntimeError, match="'a1' is merged"):
        m.delete_adapter("a1")
    m.unmerge()
    assert not m.merged and torch.equal(m.weight, before)  # bit for bit
    with torch.no_grad():
        assert_close_verbose(m(x), ref, dtype)
    m.unmerge()  # no-op
    m.set_adapter(None)
    with pytest.raises(RuntimeError, match="no active adapter to merge"):
        m.merge()


def test_lora_linear_unmerge_after_weight_changed(caplog):
    m = _make("cpu", ranks=(4,))
    before = m.weight.detach().clone()
    m.merge()
    with torch.no_grad():
        m.weight.add_(1.0)  # e.g. a training step while merged
    with caplog.at_level(logging.WARNING, logger="fuseml"):
        m.unmerge()
    assert "the weight changed while merged" in caplog.text
    assert_close_verbose(m.weight, before + 1.0)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_linear_training_uses_the_reference(device, backend, caplog, monkeypatch):
    monkeypatch.setattr(fuseml.nn._common, "_told_training", set())
    m = _make(device, backend=backend, ranks=(4, 2))
    x = torch.randn(5, 32, device=device)
    ids = torch.tensor([0, 1, -1, 1, 0], device=device)
    g = torch.randn(5, 24, device=device)
    with caplog.at_level(logging.INFO, logger="fuseml"):
        (m(x) + m(x, ids)).backward(g)  # the fused op would refuse autograd
    assert sum("LoRALinear: autograd is recording" in r.message for r in caplog.records) == 1
    # float64 twin: the same math on float64 leaves
    params = dict(m.named_parameters())
    p64 = {k: p.detach().double().requires_grad_() for k, p in params.items()}
    x64, ids64 = x.double(), ids.cpu()
    base = F.linear(x64, p64["base_layer.weight"], p64["base_layer.bias"])

    def lora(name, rows):
        a, b = p64[f"lora_A.{name}.weight"], p64[f"lora_B.{name}.weight"]
        return F.linear(F.linear(rows, a), b) * m.scaling[name]

    single = base + lora("a0", x64)
    multi = base.clone()
    for i, name in enumerate(m.adapters):
        sel = ids64 == i
        multi[sel] = multi[sel] + lora(name, x64[sel])
    (single + multi).backward(g.double())
    for k, p in params.items():
        assert_close_verbose(p.grad, p64[k].grad)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_linear_compile_fullgraph(device, backend):
    m = _make(device, backend=backend, ranks=(4, 2), activation="tanh")
    x = torch.randn(5, 32, device=device)
    ids = torch.tensor([1, -1, 0, 1, 0], device=device)
    with torch.no_grad():
        out = torch.compile(m, fullgraph=True)(x, ids)
    assert_close_verbose(out, _ref64(m, x, ids))


def test_lora_linear_state_dict_is_peft_layout():
    m = _make("cpu", ranks=(4, 2))
    assert list(m.state_dict()) == [
        "base_layer.weight", "base_layer.bias", "lora_A.a0.weight", "lora_A.a1.weight",
        "lora_B.a0.weight", "lora_B.a1.weight",
    ]  # fmt: skip
    twin = LoRALinear((32, 24))
    twin.add_adapter("a0", 4)
    twin.add_adapter("a1", 2)
    twin.load_state_dict(m.state_dict())
    for k, v in m.state_dict().items():
        assert torch.equal(twin.state_dict()[k], v)


def test_lora_linear_loads_float32_peft_adapters_into_a_16bit_layer():
    # peft saves adapters in float32 over a bfloat16 base by default: they load, cast
    m = LoRALinear((32, 24), 4, dtype=torch.bfloat16)
    state = {k: v.float() for k, v in m.state_dict().items()}
    state["lora_A.default.weight"] = torch.randn(4, 32)
    state["lora_B.default.weight"] = torch.randn(24, 4)
    m.load_state_dict(state)
    assert list(m.state_dict()) == list(state)
    for k, v in m.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, state[k].bfloat16())
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert_close_verbose(m(x), _ref64(m, x), torch.bfloat16)


def test_lora_linear_adapters_from_tensors_and_modules():
    m = LoRALinear((32, 24))
    a, b = torch.randn(3, 32), torch.randn(24, 3)
    m.add_adapter("copied", init=(a, b), lora_alpha=6)
    a.zero_()
    assert m.r["copied"] == 3 and m.scaling["copied"] == 2.0 and m.lora_A["copied"].weight.any()
    la, lb = nn.Linear(32, 5, bias=False), nn.Linear(5, 24, bias=False)
    m.add_adapter("shared", init=(la, lb), scaling=0.25)
    assert m.lora_A["shared"] is la and m.lora_B["shared"] is lb and m.scaling["shared"] == 0.25
    assert "copied: r=3 scaling=2" in repr(m)


def test_lora_linear_bad_input():
    with pytest.raises(TypeError, match="base must be an nn.Linear or \\(in_features, out"):
        LoRALinear(nn.Conv1d(4, 4, 1))
    m = _make("cpu", ranks=(4, 2))
    x = torch.randn(5, 32)
    with pytest.raises(ValueError, match=r"adapter_ids must be in \[-1, 2\)"):
        m(x, torch.tensor([0, 1, 2, 0, 0]))
    with pytest.raises(ValueError, match=r"adapter_ids must be in \[-1, 2\)"):
        m(x, torch.tensor([0, 1, -2, 0, 0]))
    with pytest.raises(TypeError, match="adapter_ids must be an int32 or int64 tensor"):
        m(x, torch.zeros(5))
    with pytest.raises(ValueError, match=r"adapter_ids must have shape \(5,\)"):
        m(x, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="x's last dim"):
        m(torch.randn(5, 31), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="an adapter named 'a0' exists"):
        m.add_adapter("a0", 4)
    with pytest.raises(ValueError, match="name must be a non-empty string without '.'"):
        m.add_adapter("a.b", 4)
    with pytest.raises(ValueError, match="r must be a positive int, got 0"):
        m.add_adapter("z", 0)
    with pytest.raises(ValueError, match="init must be 'peft' or a pair"):
        m.add_adapter("z", 4, init="gaussian")
    with pytest.raises(ValueError, match=r"lora_A must be \(r, 32\)"):
        m.add_adapter("z", init=(torch.randn(4, 31), torch.randn(24, 4)))
    with pytest.raises(ValueError, match=r"lora_B must be \(24, 4\)"):
        m.add_adapter("z", init=(torch.randn(4, 32), torch.randn(24, 3)))
    with pytest.raises(ValueError, match="r=2 but lora_A has shape"):
        m.add_adapter("z", 2, init=(torch.randn(4, 32), torch.randn(24, 4)))
    with pytest.raises(TypeError, match="lora_A has dtype torch.float16"):
        m.add_adapter("z", init=(nn.Linear(32, 4, bias=False).half(), nn.Linear(4, 24, bias=False)))
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        m.set_adapter("nope")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        LoRALinear((4, 4), activation="swish")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("multi", [False, True])
def test_lora_linear_cuda_graph_sees_adapter_writes_gpu(multi, fresh_tuning):
    """Tuning on; a CUDA graph captured after an eager call: its replays must follow
    adapter weights loaded in place after the capture (the stacked multi-adapter copy the
    module keeps for eager calls is not what the graph reads), and a replay writes every
    element of its output."""
    m = LoRALinear((512, 384), activation="gelu", device="cuda", dtype=torch.bfloat16)
    for i, r in enumerate((16, 8, 16) if multi else (16,)):
        m.add_adapter(f"a{i}", r, lora_alpha=2 * r)
        with torch.no_grad():
            m.lora_B[f"a{i}"].weight.normal_(std=0.1)
    m.set_adapter("a0")
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-1, 3, (1024,), device="cuda") if multi else None
    with torch.no_grad():
        assert_close_verbose(m(x, ids), _ref64(m, x, ids), torch.bfloat16)  # tunes
        graph, static = capture_graph(lambda: m(x, ids))
        for name in m.adapters:  # new adapter weights, loaded into the same tensors
            m.lora_A[name].weight.copy_(torch.randn_like(m.lora_A[name].weight) * 0.05)
            m.lora_B[name].weight.copy_(torch.randn_like(m.lora_B[name].weight) * 0.1)
        assert_close_verbose(replay_poisoned(graph, static), _ref64(m, x, ids), torch.bfloat16)
        assert_close_verbose(m(x, ids), _ref64(m, x, ids), torch.bfloat16)  # eager, after


def test_lora_linear_replay_key():
    """No key off CUDA; an adapter written in place, a changed scaling or another active
    adapter changes what a replayed graph is keyed on."""
    m = _make("cpu", ranks=(4, 8))
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert m._replay_key(x, "a0", m.scaling["a0"], "triton") is None  # a CPU tensor
    state = fuseml.serving.state_key(m)
    with torch.no_grad():
        m.lora_B["a0"].weight.add_(1)
    assert fuseml.serving.state_key(m) != state


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_eager_calls_replay_graphs_gpu(dtype, monkeypatch):
    """Repeated eager inference calls with one active adapter replay a CUDA graph of the
    layer: fresh outputs, new inputs seen, adapter weights written in place, another
    scaling or another active adapter seen; replay_graphs = 0 launches every call."""
    from replays import counted, fresh_calls

    m = _make("cuda", dtype, ranks=(4, 8), activation="gelu").eval()  # (training: no replays)
    calls = counted(monkeypatch, fuseml.nn.lora, "lora_linear")
    # (the C++ fast path off: it serves 16-bit repeat calls before any replay, below)
    with torch.no_grad(), _fastcall.suspended():
        x = fresh_calls(m, (40, 32), dtype, _ref64)  # (each output its own tensor)
        assert len(calls) == 4  # two eager calls, the warm-up and the capture, then replays
        m.lora_B["a0"].weight.mul_(-1.0)  # in place: a new version, a new graph
        assert_close_verbose(m(x), _ref64(m, x), dtype)
        m.scaling["a0"] *= 3  # another scaling
        assert_close_verbose(m(x), _ref64(m, x), dtype)
        m.set_adapter("a1")
        for _ in range(4):
            assert_close_verbose(m(x), _ref64(m, x), dtype)
        m.replay_graphs = 0
        n = len(calls)
        for _ in range(3):
            m(x)
        assert len(calls) == n + 3


def test_lora_linear_repeat_calls_served_by_the_fast_path_skip_replays(monkeypatch):
    """A call the C++ fast path serves returns its output as it is (the active adapter's
    tensors and scaling passed, no replay key made); a call it does not serve takes the
    module's own path (the reference's result); a backend it does not serve is not asked."""
    m = _make("cpu", ranks=(4, 8), activation="relu").eval()
    x = torch.randn(6, 32)
    served, seen = torch.full((6, 24), 7.0), []

    class Fast:
        serve = True

        def call_lora(self, code, *args):
            seen.append(args)
            return served if self.serve else None

    fast = Fast()
    monkeypatch.setattr(_fastcall, "loaded", lambda: fast)
    m.set_adapter("a1")
    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(m, "_replay_key", lambda *a: pytest.fail("replay key made"))
        assert m(x) is served
    xs, w, b, a, bb, scaling = seen[0]
    assert xs is x and w is m.weight and b is m.bias and scaling == m.scaling["a1"]
    assert a is m.lora_A["a1"].weight and bb is m.lora_B["a1"].weight
    fast.serve = False
    with torch.no_grad():
        assert_close_verbose(m(x), _ref64(m, x), torch.float32)
    m.backend = "eager"
    n = len(seen)
    with torch.no_grad():
        assert_close_verbose(m(x), _ref64(m, x), torch.float32)
    assert len(seen) == n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_linear_16bit_repeat_calls_launch_from_cpp_gpu():
    """16-bit eager inference calls with one active adapter: the first call keeps the
    launch's plan, later calls launch from C++ (no graph captured), each against the
    reference over NaN-poisoned free memory; another active adapter is seen."""
    from replays import fresh_calls

    if not _fastcall.wait(timeout=900):
        pytest.fail(f"the fast path did not load: {_fastcall.status()}")
    m = _make("cuda", torch.bfloat16, ranks=(4, 8), activation="gelu").eval()
    fast = _fastcall.fast
    with torch.no_grad():
        hits = fast.stats()[0]
        fresh_calls(m, (40, 32), torch.bfloat16, _ref64)
        assert fast.stats()[0] >= hits + 4, _fastcall.refusals
        m.set_adapter("a1")
        fresh_calls(m, (40, 32), torch.bfloat16, _ref64, n=3)
    cache = m.__dict__.get("_replay_cache")
    assert cache is None or cache.num_graphs == 0
