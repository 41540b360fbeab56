import logging

import pytest
import torch
from torch import nn

import fuseml.nn._common
from fuseml.nn import FusedMLP
from fuseml.ops import linear_ref
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets

TARGETS = fused_targets(cuda_twin=False)


def _up(t):
    return None if t is None else t.detach().double()


def _ref64(mlp: FusedMLP, x):
    h = _up(x)
    for lin, act in mlp.layers():
        h = linear_ref(h, _up(lin.weight), _up(lin.bias), act)
    return h


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_fused_mlp_matches_reference(device, backend, dtype, shape):
    acts = ["relu", "gelu_tanh", None]
    mlp = FusedMLP([32, 48, 16, 8], acts, device=device, dtype=dtype, backend=backend)
    assert [act for _, act in mlp.layers()] == acts
    x = torch.randn(shape, device=device, dtype=dtype)
    with torch.no_grad():
        out = mlp(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], 8)
    assert_close_verbose(out, _ref64(mlp, x), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_mlp_from_sequential_keeps_children_and_keys(device, backend):
    seq = nn.Sequential(
        nn.Linear(32, 24), nn.LeakyReLU(), nn.Linear(24, 16, bias=False), nn.Identity(),
        nn.Linear(16, 8), nn.Sigmoid(),
    ).to(device)  # fmt: skip
    mlp = FusedMLP.from_sequential(seq, backend=backend)
    assert isinstance(mlp, nn.Sequential) and all(a is b for a, b in zip(mlp, seq))
    assert list(mlp.state_dict()) == list(seq.state_dict())
    assert [act for _, act in mlp.layers()] == ["leaky_relu", None, "sigmoid"]
    x = torch.randn(7, 32, device=device)
    with torch.no_grad():
        out = mlp(x)
    assert_close_verbose(out, seq.double()(x.double()))
    assert type(mlp[0:2]) is nn.Sequential and type(mlp.to_sequential()) is nn.Sequential
    assert "backend=" in repr(mlp)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_mlp_sees_changed_children(device, backend):
    """The forward keeps its reading of the children between calls: a replaced child, a
    changed GELU approximation, or a replaced parameter must show in the next call."""
    mlp = FusedMLP([16, 24, 8], ["gelu", None], device=device, backend=backend)
    x = torch.randn(5, 16, device=device)
    with torch.no_grad():
        mlp(x)
        mlp[1].approximate = "tanh"
        assert_close_verbose(mlp(x), _ref64(mlp, x))
        assert [act for _, act in mlp.layers()] == ["gelu_tanh", None]
        mlp[1] = nn.Sigmoid()
        assert_close_verbose(mlp(x), _ref64(mlp, x))
        mlp[2].weight = nn.Parameter(torch.randn(8, 24, device=device))
        assert_close_verbose(mlp(x), _ref64(mlp, x))
        mlp[1].approximate = "sigmoid-ish"  # a plain attribute on Sigmoid: not read
        mlp[1] = nn.GELU(approximate="tanh")
        mlp[1].approximate = "nope"
        with pytest.raises(ValueError, match="no fused epilogue"):
            mlp(x)


def test_fused_mlp_state_dict_loads_both_ways():
    fused = FusedMLP([32, 48, 8], ["relu", None])
    plain = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    assert list(fused.state_dict()) == list(plain.state_dict()) == [
        "0.weight", "0.bias", "2.weight", "2.bias",
    ]  # fmt: skip
    plain.load_state_dict(fused.state_dict())
    other = FusedMLP([32, 48, 8], ["relu", None])
    other.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), fused.parameters()))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_mlp_training_runs_the_reference(device, backend, caplog, monkeypatch):
    monkeypatch.setattr(fuseml.nn._common, "_told_training", set())
    mlp = FusedMLP([16, 24, 8], ["silu", None], device=device, backend=backend)
    x = torch.randn(6, 16, device=device)
    with caplog.at_level(logging.INFO, logger="fuseml"):
        mlp(x).square().sum().backward()  # the fused op has no backward: eager it is
        mlp(x)
    assert sum("FusedMLP: autograd is recording" in r.message for r in caplog.records) == 1
    ref_params = [p.detach().double().requires_grad_() for p in mlp.parameters()]
    h = x.double()
    h = torch.nn.functional.silu(torch.nn.functional.linear(h, *ref_params[:2]))
    torch.nn.functional.linear(h, *ref_params[2:]).square().sum().backward()
    for p, p64 in zip(mlp.parameters(), ref_params):
        assert_close_verbose(p.grad, p64.grad)


def test_fused_mlp_bad_input():
    with pytest.raises(ValueError, match="widths must be at least two positive ints"):
        FusedMLP([32])
    with pytest.raises(TypeError, match="widths must be a sequence of ints"):
        FusedMLP(32)
    with pytest.raises(ValueError, match=r"activations must be one name or one per layer \(2\)"):
        FusedMLP([8, 8, 8], ["relu"])
    with pytest.raises(ValueError, match="activation must be None or one of"):
        FusedMLP([8, 8], "swish")
    with pytest.raises(ValueError, match="backend must be one of"):
        FusedMLP([8, 8], backend="cuda")
    with pytest.raises(TypeError, match="seq must be an nn.Sequential"):
        FusedMLP.from_sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"child '1' \(Dropout\) must be nn.Linear"):
        FusedMLP.from_sequential(nn.Sequential(nn.Linear(8, 8), nn.Dropout(), nn.Linear(8, 8)))
    with pytest.raises(ValueError, match="slope 0.01 only"):
        FusedMLP.from_sequential(nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2)))
    with pytest.raises(ValueError, match=r"child '0' \(ReLU\) must follow an nn.Linear"):
        FusedMLP.from_sequential(nn.Sequential(nn.ReLU(), nn.Linear(8, 8)))
    with pytest.raises(ValueError, match=r"child '2' \(Tanh\) must follow an nn.Linear"):
        FusedMLP.from_sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Tanh()))
    with pytest.raises(ValueError, match=r"weights\[1\] must be"):
        FusedMLP.from_sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(6, 4)))(torch.randn(2, 8))


def test_fused_mlp_replay_key():
    """What a replayed graph is keyed on: no key off CUDA or while autograd records; the
    activations, an in-place weight update and a replaced parameter all change it."""
    mlp = FusedMLP([8, 16, 4], ["relu", None])
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert mlp._replay_key(x, ["relu", None], "triton") is None  # a CPU tensor
    state = fuseml.serving.state_key(mlp)
    assert len(state) == 4
    with torch.no_grad():
        mlp[0].weight.mul_(2)  # in place: a new version
    assert fuseml.serving.state_key(mlp) != state
    state = fuseml.serving.state_key(mlp)
    mlp[2].bias = nn.Parameter(mlp[2].bias.detach() + 1)  # replaced
    assert fuseml.serving.state_key(mlp) != state
    assert not fuseml.serving.replayable(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_eager_calls_replay_graphs(dtype, monkeypatch):
    """Repeated eager inference calls replay a CUDA graph: fresh outputs, new inputs seen,
    a weight updated in place or replaced and a changed activation child seen; calls
    under autograd and replay_graphs = 0 launch every time."""
    from replays import counted, fresh_calls

    mlp = FusedMLP([367, 512, 256, 1], ["relu", "relu", None], device="cuda", dtype=dtype)
    mlp.eval()  # (a module in training mode never replays)
    calls = counted(monkeypatch, fuseml.nn.mlp, "fused_mlp")
    with torch.no_grad():
        x = fresh_calls(mlp, (64, 367), dtype, _ref64)  # (each output its own tensor)
        assert len(calls) == 4  # two eager calls, the warm-up and the capture, then replays
        assert mlp.__dict__["_replay_cache"].num_graphs == 1
        mlp[0].weight.mul_(-1.0)  # in place: a new version, a new graph
        assert_close_verbose(mlp(x), _ref64(mlp, x), dtype)
        mlp[2].bias = nn.Parameter(mlp[2].bias + 1)  # replaced
        assert_close_verbose(mlp(x), _ref64(mlp, x), dtype)
        mlp[1] = nn.GELU()  # another activation
        assert_close_verbose(mlp(x), _ref64(mlp, x), dtype)
        mlp.replay_graphs = 0
        n = len(calls)
        for _ in range(3):
            mlp(x)
        assert len(calls) == n + 3
    mlp.replay_graphs = 4
    cache = fuseml.serving.replay_cache(mlp, "FusedMLP")
    graphs = cache.num_graphs
    for _ in range(4):  # autograd records: never captured nor replayed
        out = mlp(x)
        assert out.grad_fn is not None
        assert_close_verbose(out, _ref64(mlp, x), dtype)
    assert cache.num_graphs == graphs
    mlp.train()  # training mode: never captured nor replayed
    with torch.no_grad():
        n = len(calls)
        for _ in range(4):
            assert_close_verbose(mlp(x), _ref64(mlp, x), dtype)
    assert len(calls) == n + 4 and cache.num_graphs == graphs
