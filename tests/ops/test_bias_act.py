import pytest
import torch

import fuseml
from fuseml.ops import ACTIVATIONS, bias_act_ref
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets, poison_

SHAPES = [(1, 1), (3, 33), (1, 4096), (129, 257), (2, 3, 17), (64, 16), (5, 512)]


def _inputs(shape, dtype, device, residual=True):
    x = 2 * torch.randn(shape, dtype=dtype, device=device)
    b = torch.randn(shape[-1], dtype=dtype, device=device)
    r = torch.randn(shape, dtype=dtype, device=device) if residual else None
    return x, b, r


def _ref64(x, b, r, alpha, act):
    up = lambda t: None if t is None else t.double()
    return bias_act_ref(up(x), up(b), up(r), alpha, act)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_every_activation(device, backend, activation, dtype):
    x, b, r = _inputs((37, 45), dtype, device)
    out = fuseml.ops.bias_act(x, b, r, 0.7, activation, backend=backend)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_verbose(out, _ref64(x, b, r, 0.7, activation), dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_act_shapes(device, backend, shape, dtype, residual, with_bias):
    x, b, r = _inputs(shape, dtype, device, residual)
    b = b if with_bias else None
    out = fuseml.ops.bias_act(x, b, r, 0.5, "gelu", backend=backend)
    assert_close_verbose(out, _ref64(x, b, r, 0.5, "gelu"), dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_act_widths_of_whole_vectors(device, backend, dtype):
    # Widths and row strides that are multiples of a 16-byte vector but not of 16 elements
    # (1000, 24, 40): the Triton kernel is told so (VEC) and moves 16-byte vectors. Row
    # views at a 16-byte offset and at a 2-element one (no vector alignment) as well.
    for n in (1000, 24, 40):
        x, b, r = _inputs((33, n), dtype, device)
        out = fuseml.ops.bias_act(x, b, r, 0.5, "gelu", backend=backend)
        assert_close_verbose(out, _ref64(x, b, r, 0.5, "gelu"), dtype)
        wide = torch.randn(33, n + 24, dtype=dtype, device=device)
        for start in (8, 2):
            xv = wide[:, start : start + n]
            out = fuseml.ops.bias_act(xv, b, r, 1.0, "relu", backend=backend)
            assert_close_verbose(out, _ref64(xv, b, r, 1.0, "relu"), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_act_launch_geometry_on_gpu(backend, dtype):
    # Sizes that take each launch shape of the kernels: flat at 1M elements and more (a
    # ragged tail at 1M + 3; GELU from 4M in the wide tiles), 2-D with a bias over 4 blocks
    # an SM or fewer (rows a thread reduced: the twin's 1-row kernel in bf16, its 2-row one
    # in fp32 with ReLU) and over many (ragged rows, a ragged last column tile of 1 vector;
    # the twin's 2-row kernel in bf16, its 4-row one in fp32 with ReLU; fp32 GELU takes one
    # row a thread), and 2-D with a single row.
    torch.manual_seed(0)
    for numel in (1_000_003, 4 << 20):
        x = torch.randn(numel, device="cuda", dtype=dtype)
        y = torch.randn_like(x)
        out = fuseml.ops.bias_act(x, None, y, 0.5, "gelu", backend=backend)
        assert_close_verbose(out, _ref64(x, None, y, 0.5, "gelu"), dtype)
    for shape in ((4096, 512), (3001, 4104), (37, 8200), (1, 4104)):
        x, b, r = _inputs(shape, dtype, "cuda")
        for act in ("gelu", "relu"):
            out = fuseml.ops.bias_act(x, b, r, 0.5, act, backend=backend)
            assert_close_verbose(out, _ref64(x, b, r, 0.5, act), dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_bias_act_non_contiguous(device, backend):
    big = torch.randn(40, 70, device=device)
    b = torch.randn(30, device=device)
    x = big[:30, 5:35].t()  # transposed slice: no unit-stride rows
    r = big[5:35, 30:60]  # row-strided view
    out = fuseml.ops.bias_act(x, b, r, -1.5, "silu", backend=backend)
    assert_close_verbose(out, _ref64(x, b, r, -1.5, "silu"))
    x3 = torch.randn(4, 30, 6, device=device).transpose(1, 2)  # batched, permuted
    out3 = fuseml.ops.bias_act(x3, b, None, 1.0, "tanh", backend=backend)
    assert_close_verbose(out3, _ref64(x3, b, None, 1.0, "tanh"))


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_in_place(device, backend, dtype):
    x, b, r = _inputs((33, 20), dtype, device)
    expected = _ref64(x, b, r, 0.25, "relu")
    ptr = x.data_ptr()
    out = fuseml.ops.bias_act(x, b, r, 0.25, "relu", out=x, backend=backend)
    assert out is x and x.data_ptr() == ptr
    assert_close_verbose(x, expected, dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_bias_act_out_buffer(device, backend, layout):
    x, b, r = _inputs((17, 24), torch.float32, device)
    if layout == "contiguous":
        out = torch.empty(17, 24, device=device)
    elif layout == "transposed":
        out = torch.empty(24, 17, device=device).t()
    else:
        out = torch.empty(17, 40, device=device)[:, 8:32]
    poison_(out)
    res = fuseml.ops.bias_act(x, b, r, 2.0, "leaky_relu", out=out, backend=backend)
    assert res is out
    assert_close_verbose(out, _ref64(x, b, r, 2.0, "leaky_relu"))


@pytest.mark.parametrize(("device", "backend"), fused_targets())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_act_backward(device, backend, activation, dtype):
    x, b, r = _inputs((2, 7, 19), dtype, device)
    for t in (x, b, r):
        t.requires_grad_()
    g = torch.randn(2, 7, 19, dtype=dtype, device=device)
    fuseml.ops.bias_act(x, b, r, 0.3, activation, backend=backend).backward(g)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, b, r)]
    bias_act_ref(*leaves64, 0.3, activation).backward(g.double())
    for got, want in zip((x.grad, b.grad, r.grad), (t.grad for t in leaves64), strict=True):
        assert_close_verbose(got, want, dtype)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_bias_act_backward_partial_requires_grad(device, backend):
    x, b, r = _inputs((6, 8), torch.float32, device)
    b.requires_grad_()
    fuseml.ops.bias_act(x, b, r, 1.0, "sigmoid", backend=backend).sum().backward()
    b64 = b.detach().double().requires_grad_()
    bias_act_ref(x.double(), b64, r.double(), 1.0, "sigmoid").sum().backward()
    assert x.grad is None and r.grad is None
    assert_close_verbose(b.grad, b64.grad)


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_bias_act_opcheck(device, backend):
    x, b, r = _inputs((5, 9), torch.float32, device)
    torch.library.opcheck(torch.ops.fuseml.bias_act, (x, b, r, 0.5, "gelu_tanh", backend))
    xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
    torch.library.opcheck(torch.ops.fuseml.bias_act, (xg, bg, None, 1.0, "silu", backend))
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.fuseml.bias_act_out, (x, b, r, 0.5, "relu", backend, out))
    torch.library.opcheck(
        torch.ops.fuseml.bias_act_backward, (torch.randn_like(x), x, b, r, 0.5, 3)
    )


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_bias_act_compile_fullgraph(device, backend):
    x, b, r = _inputs((8, 24), torch.float32, device)

    def fn(x, b, r):
        return fuseml.ops.bias_act(x, b, r, 0.5, "gelu", backend=backend).sum(-1)

    out = torch.compile(fn, fullgraph=True)(x, b, r)
    assert_close_verbose(out, _ref64(x, b, r, 0.5, "gelu").sum(-1))


def test_bias_act_eager_and_compile_backends():
    x, b, r = _inputs((8, 24), torch.float32, "cpu")
    ref = _ref64(x, b, r, 0.5, "relu")
    for backend in ("auto", "eager", "compile"):
        assert_close_verbose(fuseml.ops.bias_act(x, b, r, 0.5, "relu", backend=backend), ref)
    out = torch.empty_like(x)
    fuseml.ops.bias_act(x, b, r, 0.5, "relu", out=out, backend="eager")
    assert_close_verbose(out, ref)


def test_bias_act_bad_input():
    x, b, r = _inputs((4, 6), torch.float32, "cpu")
    with pytest.raises(ValueError, match="bias must have shape \\(6,\\)"):
        fuseml.ops.bias_act(x, torch.randn(5), r)
    with pytest.raises(ValueError, match="residual must have shape \\(4, 6\\)"):
        fuseml.ops.bias_act(x, b, torch.randn(4, 5))
    with pytest.raises(ValueError, match="activation must be one of"):
        fuseml.ops.bias_act(x, b, r, activation="swish")
    with pytest.raises(TypeError, match="bias has dtype torch.float16"):
        fuseml.ops.bias_act(x, b.half(), r)
    with pytest.raises(TypeError, match="residual must have dtype"):
        fuseml.ops.bias_act(x, b, r.long())
    with pytest.raises(TypeError, match="alpha must be a real number"):
        fuseml.ops.bias_act(x, b, r, alpha=torch.tensor(1.0))
    with pytest.raises(ValueError, match="out must have shape"):
        fuseml.ops.bias_act(x, b, r, out=torch.empty(6, 4))
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        fuseml.ops.bias_act(x.requires_grad_(), b, r, out=torch.empty(4, 6))
    with pytest.raises(ValueError, match="backend='cuda' is unavailable"):
        fuseml.ops.bias_act(x.detach(), b, r, backend="cuda")
    other = torch.randn(6, device="cuda" if torch.cuda.is_available() else "meta")
    with pytest.raises(ValueError, match="bias is on"):
        fuseml.ops.bias_act(x.detach(), other, r)


def test_flat_launch_index_width(monkeypatch):
    # Launches index in int32 unless the last program's offsets could pass it: the launch
    # flags (FLAT, WIDE) recorded from a stand-in kernel for packed fp32 tensors of a small
    # and of (pretended) near-2^31-element sizes; a 2-D launch (a bias) is never FLAT.
    from fuseml.ops import _elementwise as ew

    launches = []

    def record(grid, key, aligned, args, options):  # FLAT, WIDE: before GRID2D and PDL
        launches.append(args[-4:-2])

    monkeypatch.setattr(ew, "_bias_act_launches", record)
    x = torch.randn(4, 8)
    block = ew.TILE_BYTES // 4  # fp32 elements a program
    last = 2**31 - 1 - block  # the largest size whose offsets all fit in int32
    for n_cols in (32, last, last + 1):
        ew._launch(x, x, x, None, 1.0, 0, "triton", False, None, 1, n_cols, 0, 0, 0)
    ew._launch(x, x, None, x[0], 1.0, 0, "triton", False, None, 4, 8, 8, 0, 8)
    # 2-D: int32 while the last row block's offsets fit (pretended 2^19 x 4096: they do
    # not; 2^19 x 4095 rows of stride 4096 with a residual of stride 4095 neither)
    ew._launch(x, x, None, x[0], 1.0, 0, "triton", False, None, 2**19, 4096, 4096, 0, 4096)
    ew._launch(x, x, x, x[0], 1.0, 0, "triton", False, None, 2**19, 4095, 4095, 4096, 4095)
    ew._launch(x, x, None, x[0], 1.0, 0, "triton", False, None, 2**18, 4096, 4096, 0, 4096)
    assert launches == [
        (True, False), (True, False), (True, True), (False, False),
        (False, True), (False, True), (False, False),
    ]  # fmt: skip


def test_two_axis_grid_and_its_one_axis_fallback():
    # 2-D launches put (column blocks, row blocks) on two grid axes; row blocks past the
    # second axis's limit go on one axis (the tile found by division). Both give the
    # reference: the one-axis launch is forced here (launch_config's one_axis, passed to
    # the launcher as its config) so that a small tensor takes the fallback.
    from fuseml.ops import _elementwise as ew

    assert ew._config(4096, 4096, 2)["grid"] == (2, 4096)
    assert ew._config(200_000, 4096, 4)["grid"] == (200_000 * 4,)  # 200,000 row blocks
    assert ew._config(1, 4096, 2)["grid"] == (4,)  # flat
    x = torch.randn(37, 300)
    b = torch.randn(300)
    r = torch.randn(37, 300)
    want = bias_act_ref(x.double(), b.double(), r.double(), 0.5, "gelu")
    code = ew.ACT_CODE["gelu"]
    for one_axis in (False, True):
        cfg = ew.launch_config(37, 300, 4, code, one_axis=one_axis)
        assert len(cfg["grid"]) == (1 if one_axis else 2)
        got = poison_(torch.empty_like(x))
        ew.bias_act_into(got, x, r, b, 0.5, code, impl="triton", config=cfg)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_direct_launch_matches_the_ordinary_launch_gpu(monkeypatch):
    """Repeat launches go through the compiled kernel's own launcher (CompiledLaunches):
    the same output as Triton's ordinary launch, on the flat path and the 2-D path (with
    and without bias / residual), for one row, widths that are multiples of 16 and not
    (1000: VEC without the 16-divisibility), a row-strided view, and a 16-byte-misaligned
    input (which always takes the ordinary launch). Specializations must not mix: every
    case compiles its own entry."""
    from fuseml.ops import _elementwise as ew

    launches = ew._bias_act_launches
    monkeypatch.setattr(launches, "compiled", {})
    buf = torch.randn(64 * 1000 + 1, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(33, 2048, device="cuda", dtype=torch.bfloat16)
    cases = [
        (torch.randn(1 << 20, device="cuda"), False, False),  # flat fp32
        (torch.randn(4097, device="cuda", dtype=torch.bfloat16), False, True),  # flat, ragged
        (torch.randn(1, 512, device="cuda"), True, True),  # one row
        (torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16), True, False),
        (torch.randn(64, 1008, device="cuda", dtype=torch.float16), True, True),
        (wide[:, :1024], True, True),  # row stride 2048
        (buf[1:].view(64, 1000), True, False),  # misaligned: the ordinary launch
    ]
    for x, with_bias, residual in cases:
        b = torch.randn(x.shape[-1], device="cuda", dtype=x.dtype) if with_bias else None
        r = torch.randn(x.shape, device="cuda", dtype=x.dtype) if residual else None
        outs = []
        for direct in (False, True, True):  # ordinary, then the first and a repeat
            monkeypatch.setattr(launches, "enabled", direct)
            out = poison_(torch.empty_like(x))
            fuseml.ops.bias_act(x, b, r, 0.5, "gelu", out=out, backend="triton")
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        assert_close_verbose(outs[2], _ref64(x, b, r, 0.5, "gelu"), x.dtype)
    assert len(launches.compiled) == len(cases) - 1


def test_2d_launch_half_packs_rule():
    """The 2-D path takes 2 KiB tiles on 8 warps (8 bytes a thread) from
    HALF_PACK_2D_MIN_BYTES an operand for none / ReLU / leaky ReLU, and keeps its 4 KiB
    tiles below that, for every other activation and where the activation is unknown."""
    from fuseml.ops import _elementwise as ew

    code = ew.ACT_CODE
    for es, (rows, cols) in ((4, (65536, 512)), (4, (65536, 4096)), (2, (65536, 4096))):
        big = rows * cols * es >= ew.HALF_PACK_2D_MIN_BYTES
        for act in ("none", "relu", "leaky_relu"):
            cfg = ew.launch_config(rows, cols, es, code[act])
            assert cfg["BLOCK_M"] * cfg["BLOCK_N"] * es == ew.HALF_TILE_BYTES_2D
            assert cfg["num_warps"] == ew.HALF_PACK_2D_WARPS and big
        for act in ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh", None):
            cfg = ew.launch_config(rows, cols, es, None if act is None else code[act])
            assert cfg["BLOCK_M"] * cfg["BLOCK_N"] * es == ew.TILE_BYTES_2D
            assert cfg["num_warps"] == ew.NUM_WARPS_2D[es]
    small = ew.launch_config(65536, 512, 2, code["relu"])  # 64 MiB an operand
    assert (small["BLOCK_M"] * small["BLOCK_N"] * 2, small["num_warps"]) == (ew.TILE_BYTES_2D, 8)


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
@pytest.mark.parametrize("dtype", DTYPES)
def test_2d_half_pack_tiles_compute_the_same(device, backend, dtype):
    """The 8-bytes-a-thread tiles, forced here at any size (launch_config's half_pack,
    passed to the launcher as its config), on odd and aligned widths, with and without a
    residual, in place too."""
    from fuseml.ops import _elementwise as ew

    for shape in ((37, 300), (64, 512), (3, 1000), (2, 4096)):
        for act in ("none", "relu", "leaky_relu"):
            x, b, r = _inputs(shape, dtype, device)
            code = ew.ACT_CODE[act]
            cfg = ew.launch_config(*shape, x.element_size(), code, half_pack=True)
            assert cfg["num_warps"] == ew.HALF_PACK_2D_WARPS
            want = _ref64(x, b, r, 0.5, act)
            out = poison_(torch.empty_like(x))
            ew.bias_act_into(out, x, r, b, 0.5, code, impl=backend, config=cfg)
            assert_close_verbose(out, want, dtype)
            want = _ref64(x, b, None, 1.0, act)
            got = ew.bias_act_into(x, x, None, b, 1.0, code, impl=backend, config=cfg)
            assert got.data_ptr() == x.data_ptr()
            assert_close_verbose(x, want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_half_packs_at_full_size(backend, dtype):
    """Operands of HALF_PACK_2D_MIN_BYTES (the 8-byte packs of both backends), a bias,
    a residual at alpha 1 and ReLU: bit-identical to relu((x + b) + r) in float32, then
    in place over x."""
    from fuseml.ops import _elementwise as ew

    cols = 1000 if dtype == torch.float32 else 1024  # (1000: the 16-byte-vector widths)
    rows = -(-ew.HALF_PACK_2D_MIN_BYTES // (cols * dtype.itemsize))
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    b = torch.randn(cols, device="cuda", dtype=dtype)
    want = torch.relu(x.float() + b.float() + r.float()).to(dtype)
    assert torch.equal(fuseml.ops.bias_act(x, b, r, 1.0, "relu", backend=backend), want)
    fuseml.ops.bias_act(x, b, r, 1.0, "relu", out=x, backend=backend)
    assert torch.equal(x, want)
