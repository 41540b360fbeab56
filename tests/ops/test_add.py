import pytest
import torch

import fuseml
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets

SHAPES = [(1,), (7,), (1, 1), (3, 33), (1, 4096), (129, 257), (2, 3, 17), (4100,)]


def _make(shape, dtype, device, layout="contiguous"):
    if layout == "transposed":  # dense, permuted strides
        return torch.randn(shape[::-1], dtype=dtype, device=device).t()
    if layout == "sliced":  # row stride != number of columns
        full = torch.randn(shape[0], shape[1] + 5, dtype=dtype, device=device)
        return full[:, 2 : 2 + shape[1]]
    if layout == "strided_cols":  # last dim not unit-stride
        return torch.randn(shape[0], 2 * shape[1], dtype=dtype, device=device)[:, ::2]
    return torch.randn(shape, dtype=dtype, device=device)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_matches_float64(device, backend, dtype, shape):
    x = _make(shape, dtype, device)
    y = _make(shape, dtype, device)
    out = fuseml.ops.add(x, y, backend=backend)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_verbose(out, x.double() + y.double(), dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("layout_x", ["transposed", "sliced", "strided_cols"])
@pytest.mark.parametrize("layout_y", ["contiguous", "transposed", "sliced"])
def test_add_non_contiguous(device, backend, layout_x, layout_y):
    x = _make((37, 19), torch.float32, device, layout_x)
    y = _make((37, 19), torch.float32, device, layout_y)
    assert not x.is_contiguous()
    out = fuseml.ops.add(x, y, backend=backend)
    assert_close_verbose(out, x.double() + y.double())


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_add_empty(device, backend):
    x = torch.randn(0, 5, device=device)
    assert fuseml.ops.add(x, x, backend=backend).shape == (0, 5)


def test_add_backends_agree():
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    expected = x + y
    for backend in ("auto", "eager", "compile"):
        torch.testing.assert_close(fuseml.ops.add(x, y, backend=backend), expected)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_add_autograd(device, backend):
    x = torch.randn(4, 5, device=device, requires_grad=True)
    y = torch.randn(4, 5, device=device, requires_grad=True)
    g = torch.randn(4, 5, device=device)
    fuseml.ops.add(x, y, backend=backend).backward(g)
    torch.testing.assert_close(x.grad, g)
    torch.testing.assert_close(y.grad, g)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_add_opcheck(device, backend):
    x = torch.randn(5, 9, device=device)
    torch.library.opcheck(torch.ops.fuseml.add, (x, torch.randn_like(x), backend))


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_add_compile_fullgraph(device, backend):
    x, y = torch.randn(6, 10, device=device), torch.randn(6, 10, device=device)
    fn = torch.compile(lambda a, b: fuseml.ops.add(a, b, backend=backend) * 2, fullgraph=True)
    assert_close_verbose(fn(x, y), (x.double() + y.double()) * 2)


def test_add_bad_input():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="y must have shape"):
        fuseml.ops.add(x, torch.randn(4, 3))
    with pytest.raises(TypeError, match="x must have dtype"):
        fuseml.ops.add(torch.ones(3, 4, dtype=torch.int32), x)
    with pytest.raises(TypeError, match="mixed dtypes"):
        fuseml.ops.add(x, x.half())
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        fuseml.ops.add(x, 1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        fuseml.ops.add(x, x, backend="fast")
    with pytest.raises(ValueError, match="backend='cuda' is unavailable"):
        fuseml.ops.add(x, x, backend="cuda")
    other = torch.randn(3, 4, device="cuda" if torch.cuda.is_available() else "meta")
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        fuseml.ops.add(x, other)


def test_add_triton_unavailable(monkeypatch):
    from fuseml import runtime

    monkeypatch.setattr(runtime, "triton_interpreting", lambda: False)
    monkeypatch.setattr(runtime, "_RESOLVED", {})  # availability is memoised per process
    with pytest.raises(ValueError, match="backend='triton' is unavailable"):
        fuseml.ops.add(torch.randn(3), torch.randn(3), backend="triton")


def test_flat_launch_half_packs_rule():
    """The flat path takes twice the warps for the same tile (8 bytes a thread) from
    HALF_PACK_MIN_NUMEL elements without an activation, and stays at one 16-byte vector a
    thread below that and with an activation (erf-GELU lost 4-6% on 8-byte packs)."""
    from fuseml.ops import _elementwise as ew

    big = ew.HALF_PACK_MIN_NUMEL
    for es, block in ((4, 512), (2, 1024)):
        cfg = ew.launch_config(1, big, es, 0)
        assert (cfg["BLOCK_N"], cfg["num_warps"]) == (block, 2 * ew.NUM_WARPS)
        assert ew.launch_config(1, big - 1, es, 0)["num_warps"] == ew.NUM_WARPS
        for act in (ew.ACT_CODE["relu"], None):  # None: activation unknown
            cfg = ew.launch_config(1, big, es, act)
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == (block, ew.NUM_WARPS)
        cfg = ew.launch_config(1, big, es, ew.ACT_CODE["gelu"])  # 16 bytes a thread
        assert cfg["BLOCK_N"] * es == 32 * cfg["num_warps"] * 16


def test_flat_launch_wide_rule():
    """Transcendental activations take 4 KiB tiles on 8 warps (one 16-byte vector a thread)
    from WIDE_FLAT_MIN_NUMEL elements; below it, and for add / ReLU, the 2 KiB tile on 4."""
    from fuseml.ops import _elementwise as ew

    n = ew.WIDE_FLAT_MIN_NUMEL
    for es in (4, 2):
        narrow = (ew.TILE_BYTES // es, ew.NUM_WARPS)
        for name in ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
            act = ew.ACT_CODE[name]
            cfg = ew.launch_config(1, n, es, act)
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == (ew.WIDE_TILE_BYTES // es, 8), name
            assert cfg["grid"] == (n * es // ew.WIDE_TILE_BYTES,)
            cfg = ew.launch_config(1, n - 1, es, act)
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == narrow, name
        for act in (0, ew.ACT_CODE["relu"], ew.ACT_CODE["leaky_relu"], None):
            cfg = ew.launch_config(1, n, es, act)
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == narrow, act
        # 2-D launches (rows > 1) keep their own rule
        assert ew.launch_config(n // 512, 512, es, ew.ACT_CODE["gelu"])["BLOCK_N"] == 512


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_from_half_pack_size_on_gpu(backend, dtype):
    """Sizes where the flat path takes 8-byte packs (HALF_PACK_MIN_NUMEL and up): the sum
    equals torch's (both round the float32 sum once), with a tail of fewer elements than
    a pack, an in-place output, and a second operand scaled by alpha."""
    from fuseml.ops import _elementwise as ew

    n = ew.HALF_PACK_MIN_NUMEL + 3
    x = torch.randn(n, device="cuda", dtype=dtype)
    y = torch.randn(n, device="cuda", dtype=dtype)
    assert torch.equal(fuseml.ops.add(x, y, backend=backend), x + y)
    expected = (x.float() + 0.5 * y.float()).to(dtype)
    out = fuseml.ops.bias_act(x, None, residual=y, alpha=0.5, activation="none",
                              out=x, backend=backend)  # fmt: skip
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, expected)
