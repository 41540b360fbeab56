import pytest
import torch
from torch import nn

from fuseml.nn import FusedLinear
from fuseml.ops import ACTIVATIONS, linear_ref
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets

TARGETS = fused_targets(cuda_twin=False)


def _up(t):
    return None if t is None else t.detach().double()


def _ref64(m, x):
    return linear_ref(_up(x), _up(m.weight), _up(m.bias), m.activation)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_linear_every_activation(device, backend, activation):
    m = FusedLinear(32, 24, activation=activation, device=device, backend=backend)
    x = torch.randn(5, 32, device=device)
    with torch.no_grad():
        out = m(x)
    assert out.shape == (5, 24)
    assert_close_verbose(out, _ref64(m, x))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 32), (1, 32), (2, 3, 32), "transposed"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_shapes(device, backend, dtype, shape, bias):
    m = FusedLinear(32, 24, bias, "silu", device=device, dtype=dtype, backend=backend)
    if shape == "transposed":
        x = torch.randn(32, 7, device=device, dtype=dtype).t()  # non-contiguous rows
    else:
        x = torch.randn(shape, device=device, dtype=dtype)
    with torch.no_grad():
        out = m(x)
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], 24)
    assert_close_verbose(out, _ref64(m, x), dtype)


def test_fused_linear_initialises_like_nn_linear():
    torch.manual_seed(3)
    plain = nn.Linear(32, 24)
    torch.manual_seed(3)
    fused = FusedLinear(32, 24)
    assert torch.equal(plain.weight, fused.weight) and torch.equal(plain.bias, fused.bias)
    assert fused.activation is None and FusedLinear(4, 4, activation="none").activation is None


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_linear_from_linear_shares_parameters(device, backend):
    lin = nn.Linear(32, 24, device=device).eval()
    fused = FusedLinear.from_linear(lin, "gelu_tanh", backend=backend)
    assert fused.weight is lin.weight and fused.bias is lin.bias and not fused.training
    x = torch.randn(2, 3, 32, device=device)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # an update of one is an update of the other
        out = fused(x)
    ref = torch.nn.functional.gelu(lin.double()(x.double()), approximate="tanh")
    assert_close_verbose(out, ref)
    no_bias = FusedLinear.from_linear(nn.Linear(8, 4, bias=False, device=device))
    assert no_bias.bias is None and no_bias(torch.randn(3, 8, device=device)).shape == (3, 4)


def test_fused_linear_state_dict_round_trip():
    lin = nn.Linear(32, 24)
    fused = FusedLinear(32, 24, activation="relu")
    assert list(fused.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    fused.load_state_dict(lin.state_dict())
    assert torch.equal(fused.weight, lin.weight) and torch.equal(fused.bias, lin.bias)
    other = nn.Linear(32, 24)
    other.load_state_dict(FusedLinear(32, 24).state_dict())
    assert list(FusedLinear(8, 4, bias=False).state_dict()) == ["weight"]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_linear_backward(device, backend):
    m = FusedLinear(32, 24, activation="tanh", device=device, backend=backend)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    g = torch.randn(2, 5, 24, device=device)
    m(x).backward(g)
    leaves = [t.detach().double().requires_grad_() for t in (x, m.weight, m.bias)]
    linear_ref(*leaves, "tanh").backward(g.double())
    for got, want in zip((x.grad, m.weight.grad, m.bias.grad), (t.grad for t in leaves)):
        assert_close_verbose(got, want)


def test_fused_linear_repr():
    text = repr(FusedLinear(32, 24, activation="relu", backend="eager"))
    assert "in_features=32, out_features=24, bias=True" in text
    assert "activation='relu'" in text and "backend='eager'" in text


def test_fused_linear_bad_input():
    with pytest.raises(ValueError, match="FusedLinear: activation must be None or one of"):
        FusedLinear(4, 4, activation="swish")
    with pytest.raises(ValueError, match="FusedLinear: backend must be one of"):
        FusedLinear(4, 4, backend="cuda")
    with pytest.raises(TypeError, match="linear must be an nn.Linear, got Conv1d"):
        FusedLinear.from_linear(nn.Conv1d(4, 4, 1))
    m = FusedLinear(32, 24)
    with pytest.raises(ValueError, match=r"x's last dim \(31\) must equal weight's in_features"):
        m(torch.randn(5, 31))
    with pytest.raises(TypeError, match="weight has dtype torch.float32 but x has torch.float16"):
        m(torch.randn(5, 32).half())
