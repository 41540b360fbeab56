import pytest
import torch
import torch.nn.functional as F

import fuseml
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets, tolerance

SHAPES = [(1,), (7,), (1, 1), (3, 33), (1, 4096), (129, 257), (2, 3, 17)]


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_matches_float64(device, backend, approximate, dtype, shape):
    x = 3 * torch.randn(shape, dtype=dtype, device=device)
    out = fuseml.ops.gelu(x, approximate, backend=backend)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_verbose(out, F.gelu(x.double(), approximate=approximate), dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_wide_range_and_specials(device, backend, approximate):
    # Covers both branches of the tanh helper (|u| < 0.625 and beyond), saturation and
    # +-inf / NaN propagation like torch.
    x = torch.cat(
        [
            torch.linspace(-12, 12, 2001),
            torch.tensor([1e-6, -1e-6, 0.0, 30.0, -30.0, float("inf"), float("-inf")]),
        ]
    ).to(device)
    out = fuseml.ops.gelu(x, approximate, backend=backend)
    assert_close_verbose(out, F.gelu(x.double(), approximate=approximate))
    nan = fuseml.ops.gelu(torch.tensor([float("nan")], device=device), approximate, backend=backend)
    assert torch.isnan(nan).all()


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_gelu_layouts(device, backend):
    base = torch.randn(33, 40, device=device)
    for x in (base.t(), base[:, 3:20], base[:, ::3], base.view(3, 11, 40).permute(2, 0, 1)):
        out = fuseml.ops.gelu(x, backend=backend)
        assert_close_verbose(out, F.gelu(x.double()))
    # A dense permuted input keeps its layout, like torch.empty_like.
    assert fuseml.ops.gelu(base.t(), backend=backend).stride() == base.t().stride()


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_backward(device, backend, approximate, dtype):
    x = (2 * torch.randn(5, 37, device=device)).to(dtype).requires_grad_()
    g = torch.randn(5, 37, device=device, dtype=dtype)
    fuseml.ops.gelu(x, approximate, backend=backend).backward(g)
    x64 = x.detach().double().requires_grad_()
    F.gelu(x64, approximate=approximate).backward(g.double())
    assert_close_verbose(x.grad, x64.grad, dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_gelu_opcheck(device, backend):
    x = torch.randn(4, 9, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.fuseml.gelu, (x, "none", backend))
    torch.library.opcheck(torch.ops.fuseml.gelu, (x.detach(), "tanh", backend))


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_gelu_compile_fullgraph(device, backend):
    x = torch.randn(6, 10, device=device)
    fn = torch.compile(lambda a: fuseml.ops.gelu(a, "tanh", backend=backend) + 1, fullgraph=True)
    assert_close_verbose(fn(x), F.gelu(x.double(), approximate="tanh") + 1)


def test_gelu_backends_agree_on_cpu():
    x = torch.randn(8, 8)
    for backend in ("auto", "eager", "compile"):
        err = (fuseml.ops.gelu(x, backend=backend) - F.gelu(x)).abs().max()
        assert err <= tolerance(torch.float32)


def test_gelu_bad_input():
    with pytest.raises(ValueError, match="approximate must be one of"):
        fuseml.ops.gelu(torch.randn(3), approximate="fast")
    with pytest.raises(TypeError, match="x must have dtype"):
        fuseml.ops.gelu(torch.arange(3))
    with pytest.raises(TypeError, match="x must have dtype"):
        fuseml.ops.gelu(torch.randn(3, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_wide_flat_launch_on_gpu(backend, approximate, dtype):
    """From WIDE_FLAT_MIN_NUMEL elements the flat path runs in wider programs / blocks (4
    KiB tiles on 8 warps, 256-thread blocks in the twin): each element is computed as by
    the narrow launch below that size (bit for bit on the shared prefix), with a tail
    shorter than a vector, and within tolerance of float64."""
    from fuseml.ops import _elementwise as ew

    n = ew.WIDE_FLAT_MIN_NUMEL + 3
    x = 3 * torch.randn(n, device="cuda", dtype=dtype)
    wide = fuseml.ops.gelu(x, approximate, backend=backend)
    narrow = fuseml.ops.gelu(x[: n // 2].clone(), approximate, backend=backend)
    assert torch.equal(wide[: n // 2], narrow)
    assert_close_verbose(wide, F.gelu(x.double(), approximate=approximate), dtype)
