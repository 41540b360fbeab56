"""The eager fast path (fuseml.ops._fastcall, csrc/fastcall.cpp): a repeat call of an
elementwise op, the on-chip softmax, a linear layer or a one-adapter LoRA layer launched
from C++, and a CUDA-backend call of an elementwise op or the softmax sent from C++ to its
CUDA C++ twin, gives what the Python path gives, and every call the C++ side cannot vouch
for takes the Python path."""

import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fuseml
from fuseml.ops import _fastcall
from fuseml.ops.linear import linear_choice
from fuseml.testing import (
    DTYPES,
    assert_close_verbose,
    fused_targets,
    poison_allocator,
    replay_poisoned,
)


def gpu(test):
    """A GPU test: the gpu marker, skipped without a GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


# ------------------------------------------------------------------------------ CPU
def _kernel(signature: dict, **meta):
    defaults = {"global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1}
    return SimpleNamespace(
        src=SimpleNamespace(signature=signature),
        metadata=SimpleNamespace(**{**defaults, **meta}),
    )


def test_layout_keeps_the_non_constexpr_parameters_in_order():
    ck = _kernel({"x": "*bf16", "n": "i32", "one": "constexpr", "a": "fp32", "BLOCK": "constexpr",
                  "big": "i64"})  # fmt: skip
    assert _fastcall._layout(ck, 6) == ([0, 1, 3, 5], [0, 1, 3, 2])


@pytest.mark.parametrize(
    ("signature", "meta", "n_args"),
    [
        ({"x": "*fp32", "n": "i32"}, {}, 3),  # not the launch's argument count
        ({"x": "*fp32", "h": "fp16"}, {}, 2),  # a parameter kind the C++ side does not pass
        ({"x": "*fp32", "t": ("i32", "i32")}, {}, 2),  # a tuple
        ({"x": "*fp32"}, {"global_scratch_size": 64}, 1),  # scratch memory
        ({"x": "*fp32"}, {"num_ctas": 2}, 1),  # a cluster launch
    ],
)
def test_layout_refuses_what_the_cpp_side_cannot_launch(signature, meta, n_args):
    assert _fastcall._layout(_kernel(signature, **meta), n_args) == ()


def test_layout_expands_host_descriptors_as_the_launcher_passes_them():
    """A 2-D host descriptor is 5 parameters (the CUtensorMap, its shape as int32, its
    strides as int64); the positions count the expanded arguments (_expanded)."""
    ck = _kernel({"x_desc": "tensordesc<bf16[128, 64]>", "out": "*bf16", "one": "constexpr",
                  "m": "i32"})  # fmt: skip
    assert _fastcall._layout(ck, 4, expand_descriptors=True) == (
        [0, 1, 2, 3, 4, 5, 7],
        [_fastcall.DESCRIPTOR, 1, 1, 2, 2, 0, 1],
    )
    assert _fastcall._layout(ck, 4) == ()  # (plain launches pass no descriptors)
    three_d = _kernel({"d": "tensordesc<bf16[2, 128, 64]>"})
    assert _fastcall._layout(three_d, 1, expand_descriptors=True) == ()


def _descriptor(shape, block, **attrs):
    desc = type("TensorDescriptor", (), {})()
    desc.base, desc.shape, desc.block_shape = object(), list(shape), list(block)
    desc.strides = [shape[1], 1]
    for name, value in attrs.items():
        setattr(desc, name, value)
    return desc


def test_expanded_arguments_and_descriptor_specs():
    pytest.importorskip("triton.backends.nvidia.driver")
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    d = _descriptor((300, 512), (128, 64), padding="zero", round_f32_to_tf32=False)
    flat = _fastcall._expanded((d, 7, 1.5))
    assert flat == [d, 300, 512, 512, 1, 7, 1.5]
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [128, 64]}
    ck = _kernel({}, tensordesc_meta=[meta])
    spec = _fastcall._descriptor_specs(ck, (d, 7))
    assert spec == [[TMA_DTYPE_DEVICE_TO_HOST[10], 3, 0, 128, 64]]
    nan = _descriptor((300, 512), (128, 64), padding="nan")
    assert _fastcall._descriptor_specs(ck, (nan,))[0][2] == 1
    # the box the compiler chose (the swizzle's width), not the descriptor's block
    wide = _descriptor((300, 512), (128, 128))
    assert _fastcall._descriptor_specs(ck, (wide,))[0][3:] == [128, 64]
    # forms the C++ side does not encode
    for bad in ({"fp4_padded": True}, {"is_im2col": True}, {"block_size": [2, 64, 64]}):
        assert (
            _fastcall._descriptor_specs(_kernel({}, tensordesc_meta=[{**meta, **bad}]), (d,))
            is None
        )
    assert _fastcall._descriptor_specs(_kernel({}, tensordesc_meta=[]), (d,)) is None
    tf32 = _descriptor((300, 512), (128, 64), round_f32_to_tf32=True)
    assert _fastcall._descriptor_specs(ck, (tf32,)) is None


def test_tma_kernel_parameters_are_where_the_cpp_side_writes_them():
    """fastcall_plan.h's fill_tma: x, W, three pointers, five ints, alpha, then
    kTmaConstexprs (12) constexprs, then the output descriptor and one constexpr."""
    import inspect

    from fuseml.ops.gemm.tma import _linear_tma_kernel

    params = list(
        inspect.signature(getattr(_linear_tma_kernel, "fn", _linear_tma_kernel)).parameters.values()
    )
    names = [p.name for p in params]
    const = [str(p.annotation).endswith("constexpr") for p in params]
    alpha, o_desc = names.index("alpha"), names.index("o_desc")
    assert names[: alpha + 1] == [
        "x_desc", "w_desc", "bias_ptr", "res_ptr", "out_ptr", "M", "N", "K", "stride_rm",
        "stride_om", "alpha",
    ]  # fmt: skip
    assert not any(const[: alpha + 1]) and all(const[alpha + 1 : o_desc])
    assert o_desc - alpha - 1 == 12
    assert not const[o_desc] and names[o_desc + 1 :] == ["OUT_SUB"] and const[-1]


def test_gemm_plans_offer_descriptors_and_padded_copies(monkeypatch):
    """register_gemm hands the C++ side the expanded TMA launch: each descriptor's spec,
    whether the last one is out's, and the padded copies the launch read."""
    pytest.importorskip("triton.backends.nvidia.driver")
    seen = {}
    monkeypatch.setattr(
        _fastcall, "fast", SimpleNamespace(register_gemm_plan=lambda *a: seen.update(a=a) or "")
    )
    monkeypatch.setattr(_fastcall, "_LAYOUTS", {})
    signature = {
        "x_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[128, 64]>",
        "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
        "K": "i32", "stride_rm": "constexpr", "stride_om": "i32", "alpha": "fp32",
        **{f"C{i}": "constexpr" for i in range(12)},
        "o_desc": "tensordesc<bf16[128, 64]>", "OUT_SUB": "constexpr",
    }  # fmt: skip
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [128, 64]}
    fake = _kernel(signature, tensordesc_meta=[meta] * 3, shared=1024)
    ck = type("CompiledKernel", (), {})()  # (hashable: layouts are kept per kernel)
    ck.src, ck.metadata, ck.function = fake.src, fake.metadata, 1234
    x, w, out = object(), object(), object()
    xd, wd, od = (_descriptor((300, 512), (128, 64)) for _ in range(3))
    od.base = out
    args = (xd, wd, out, out, out, 300, 256, 512, 0, 256, 1.0, *range(12), od, 2)
    options = {"num_warps": 8, "launch_pdl": True}
    padded = (object(), object())
    _fastcall.register_gemm(1, x, w, None, out, 1.0, ck, (132,), options, args, used=padded)
    a = seen["a"]
    assert a[:6] == (1, x, w, None, out, 1.0) and a[6:11] == (1234, [132, 1, 1], 8, 1024, True)
    positions, kinds, passed, specs, out_desc = a[11:16]
    assert positions == [*range(0, 10), 10, 11, 12, 13, 14, 15, 17, 18, *range(31, 36)]
    assert kinds[:5] == [_fastcall.DESCRIPTOR, 1, 1, 2, 2] == kinds[-5:]
    assert kinds[10:19] == [0, 0, 0, 1, 1, 1, 1, 3, _fastcall.DESCRIPTOR]
    assert passed[0] is xd and passed[5] is wd and passed[-5] is od
    assert len(specs) == 3 and out_desc and a[16:] == padded
    od.base = x  # the kernel stores through pointers: o_desc is x's
    _fastcall.register_gemm(1, x, w, None, out, 1.0, ck, (132,), options, (*args[:-2], od, 0))
    assert seen["a"][15] is False and seen["a"][16:] == (None, None)


def test_suspended_hides_the_loaded_extension_inside_the_block(monkeypatch):
    loaded = object()
    monkeypatch.setattr(_fastcall, "_loaded", loaded)
    monkeypatch.setattr(_fastcall, "fast", loaded)
    with _fastcall.suspended():
        assert _fastcall.fast is None
        with _fastcall.suspended():  # nested
            assert _fastcall.fast is None
        assert _fastcall.fast is None
    assert _fastcall.fast is loaded


class _Refusing:
    """A loaded extension that must not be called."""

    def call(self, *args):
        raise AssertionError("the fast call was reached")


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_compiled_callers_never_reach_the_fast_call(device, backend, monkeypatch):
    # torch.compile traces the public functions: with the extension loaded, the fast
    # branch folds away (no graph break under fullgraph) and the op's kernel is traced
    # (a module object, as the loaded extension is: Dynamo cannot guard on one)
    refusing = types.ModuleType("fuseml_fastcall")
    refusing.call = refusing.call_twin = _Refusing().call
    monkeypatch.setattr(_fastcall, "fast", refusing)
    x = torch.randn(6, 16, device=device)
    b = torch.randn(16, device=device)
    w = torch.randn(16, 16, device=device) / 4
    gemm = "triton" if backend == "cuda" else backend

    def chain(a, bias):
        h = fuseml.ops.bias_act(a, bias, None, 1.0, "relu", backend=backend)
        h = fuseml.ops.add(fuseml.ops.gelu(h, backend=backend), a, backend=backend)
        h = fuseml.ops.linear(h, w, bias, "relu", backend=gemm)  # (no CUDA C++ twin)
        return fuseml.ops.softmax(h, -1, backend=backend)

    out = torch.compile(chain, fullgraph=True)(x, b)
    x64, b64, w64 = x.double(), b.double(), w.double()
    h64 = F.relu(F.linear(F.gelu(F.relu(x64 + b64)) + x64, w64, b64))
    assert_close_verbose(out, torch.softmax(h64, -1), x.dtype)


class _Recording:
    """A loaded extension that records its calls and takes none of them."""

    def __init__(self):
        self.calls = []

    def call(self, *args):
        self.calls.append(args[:2] + args[6:])  # (op, code, dim)
        return None

    def call_twin(self, *args):
        self.calls.append(("twin", *args[:2], *args[6:]))
        return None


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
def test_public_calls_offer_the_fast_call_their_op_code_and_dim(device, backend, monkeypatch):
    rec = _Recording()
    monkeypatch.setattr(_fastcall, "fast", rec)
    x = torch.randn(4, 8, device=device)
    relu = fuseml.ops._elementwise.ACT_CODE["relu"]
    gelu_tanh = fuseml.ops._elementwise.ACT_CODE["gelu_tanh"]
    none = fuseml.ops._elementwise.ACT_CODE["none"]
    outs = [
        fuseml.ops.softmax(x, backend=backend),
        fuseml.ops.log_softmax(x, 1, backend=backend),
        fuseml.ops.gelu(x, "tanh", backend=backend),
        fuseml.ops.add(x, x, backend=backend),
        fuseml.ops.bias_act(x, x[0], None, 1.0, "relu", backend=backend),
    ]
    assert rec.calls == [
        (_fastcall.SOFTMAX_ROWS, 0, -1), (_fastcall.SOFTMAX_ROWS, 1, 1),
        (_fastcall.ELEMENTWISE, gelu_tanh, -1), (_fastcall.ELEMENTWISE, none, -1),
        (_fastcall.ELEMENTWISE, relu, -1),
    ]  # fmt: skip
    # each declined, so the Python path answered
    x64 = x.double()
    refs = [torch.softmax(x64, -1), torch.log_softmax(x64, 1), F.gelu(x64, approximate="tanh"),
            2 * x64, F.relu(x64 + x64[0])]  # fmt: skip
    for out, ref in zip(outs, refs, strict=True):
        assert_close_verbose(out, ref, torch.float32)
    fuseml.ops.softmax(x, backend="eager")  # other backends never offer it
    assert len(rec.calls) == 5


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch's answer")
def test_the_build_runs_in_a_child_process_and_reports_why_it_failed():
    # The child imports this fuseml (its folder put on PYTHONPATH) and builds nothing here
    why = _fastcall._build_apart()
    assert why is not None and "CPU-only build" in why


def test_usable_only_for_triton_backends():
    assert _fastcall.usable("auto") and _fastcall.usable("triton")
    assert not _fastcall.usable("cuda") and not _fastcall.usable("eager")


def test_entry_sends_the_cuda_backend_to_the_twins_call():
    rec = _Recording()
    assert _fastcall.entry(rec, "auto") == rec.call and _fastcall.entry(rec, "triton") == rec.call
    assert _fastcall.entry(rec, "cuda") == rec.call_twin
    assert _fastcall.entry(rec, "eager") is None and _fastcall.entry(rec, "compile") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_a_declined_twin_call_reaches_the_python_paths_error(monkeypatch):
    rec = _Recording()
    monkeypatch.setattr(_fastcall, "fast", rec)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="backend='cuda'"):
        fuseml.ops.gelu(x, backend="cuda")
    with pytest.raises(ValueError, match="backend='cuda'"):
        fuseml.ops.softmax(x, backend="cuda")
    gelu = fuseml.ops._elementwise.ACT_CODE["gelu"]
    assert rec.calls == [("twin", _fastcall.ELEMENTWISE, gelu, -1),
                         ("twin", _fastcall.SOFTMAX_ROWS, 0, -1)]  # fmt: skip


# ------------------------------------------------------------------------------ GPU
@pytest.fixture
def fast():
    """The loaded extension, its plans forgotten: each test's calls register their own."""
    if not _fastcall.wait(timeout=900):
        pytest.fail(f"the fast path did not load: {_fastcall.status()}")
    _fastcall.fast.clear()
    return _fastcall.fast


def _hits(fast) -> int:
    return fast.stats()[0]


def _inputs(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = 3 * torch.randn(shape, dtype=dtype, device="cuda", generator=g)
    y = torch.randn(shape, dtype=dtype, device="cuda", generator=g)
    b = torch.randn(shape[-1], dtype=dtype, device="cuda", generator=g)
    return x, y, b


# name -> (fuseml call on (x, y, bias, backend), float64 reference on (x, y, bias))
CASES = {
    "gelu": (lambda x, y, b, be: fuseml.ops.gelu(x, backend=be), lambda x, y, b: F.gelu(x)),
    "gelu_tanh": (
        lambda x, y, b, be: fuseml.ops.gelu(x, "tanh", backend=be),
        lambda x, y, b: F.gelu(x, approximate="tanh"),
    ),
    "add": (lambda x, y, b, be: fuseml.ops.add(x, y, backend=be), lambda x, y, b: x + y),
    "bias_relu": (
        lambda x, y, b, be: fuseml.ops.bias_act(x, b, backend=be),
        lambda x, y, b: F.relu(x + b),
    ),
    "bias_residual_silu": (
        lambda x, y, b, be: fuseml.ops.bias_act(x, b, y, 0.5, "silu", backend=be),
        lambda x, y, b: F.silu(x + b + 0.5 * y),
    ),
    "residual_gelu": (
        lambda x, y, b, be: fuseml.ops.bias_act(x, None, y, 2, "gelu", backend=be),
        lambda x, y, b: F.gelu(x + 2 * y),
    ),
    "softmax": (
        lambda x, y, b, be: fuseml.ops.softmax(x, backend=be),
        lambda x, y, b: torch.softmax(x, -1),
    ),
    "log_softmax": (
        lambda x, y, b, be: fuseml.ops.log_softmax(x, dim=x.dim() - 1, backend=be),
        lambda x, y, b: torch.log_softmax(x, -1),
    ),
}


@pytest.mark.parametrize("shape", [(64, 512), (3, 33), (2, 3, 17), (1, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["auto", "cuda"])  # a Triton plan / the twin's op
@gpu
def test_repeat_calls_launch_from_cpp_with_the_python_paths_result(
    fast, backend, case, dtype, shape
):
    fn, ref = CASES[case]
    x, y, b = _inputs(shape, dtype)
    with torch.no_grad():
        if backend == "auto":
            fn(x, y, b, backend)  # compiles (a specialization's first launch registers nothing)
            fast.clear()
            python = fn(x, y, b, backend)  # the Python path's launch, which registers its plan
        else:
            with _fastcall.suspended():
                python = fn(x, y, b, backend)  # the Python path (it builds the twin's extension)
        poison_allocator()  # an element the fast launch leaves unwritten shows as NaN
        before = _hits(fast)
        out = fn(x, y, b, backend)
        torch.cuda.synchronize()
    assert _hits(fast) == before + 1, "the repeat call did not take the fast path"
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, python)
    assert_close_verbose(out, ref(x.double(), y.double(), b.double()), dtype)


@gpu
def test_cuda_backend_calls_the_twin_path_does_not_take(fast):
    x, y, _ = _inputs((64, 512), torch.float32)
    fuseml.ops.gelu(x, backend="cuda")  # (builds the twin's extension where needed)
    before = _hits(fast)
    xg = x.clone().requires_grad_()
    out = fuseml.ops.gelu(xg, backend="cuda")  # autograd: the Python path records it
    assert out.grad_fn is not None and _hits(fast) == before
    t = x.t()  # not contiguous
    assert_close_verbose(fuseml.ops.gelu(t, backend="cuda"), F.gelu(t.double()), torch.float32)
    assert_close_verbose(
        fuseml.ops.softmax(x, 0, backend="cuda"), torch.softmax(x.double(), 0), torch.float32
    )
    assert _hits(fast) == before
    with pytest.raises(ValueError, match="approximate"):
        fuseml.ops.gelu(x, "sigmoid", backend="cuda")
    with pytest.raises(ValueError, match="y"):
        fuseml.ops.add(x, y[:32], backend="cuda")
    assert _hits(fast) == before


def _warm(fn, *args):
    with torch.no_grad():
        for _ in range(3):
            fn(*args)


@gpu
def test_autograd_calls_take_the_python_path(fast):
    x, _, b = _inputs((64, 512), torch.float32)
    _warm(fuseml.ops.gelu, x)
    before = _hits(fast)
    xg = x.clone().requires_grad_()
    out = fuseml.ops.gelu(xg)
    assert out.grad_fn is not None and _hits(fast) == before
    out.sum().backward()
    assert xg.grad is not None
    bg = b.clone().requires_grad_()  # a bias that needs a gradient
    assert fuseml.ops.bias_act(x, bg).grad_fn is not None and _hits(fast) == before
    with torch.no_grad():  # no gradient recorded: plain calls, the plan kept by the second
        fuseml.ops.bias_act(x, bg)  # (the first may compile, or find the kernel compiled
        fuseml.ops.bias_act(x, bg)  # by an earlier test in this process and register)
        kept = _hits(fast)
        assert fuseml.ops.bias_act(x, bg).grad_fn is None and _hits(fast) == kept + 1


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@gpu
def test_layouts_and_modes_the_cpp_side_does_not_vouch_for(fast):
    x, y, _ = _inputs((64, 512), torch.bfloat16)
    for fn in (fuseml.ops.gelu, fuseml.ops.softmax):
        _warm(fn, x)
    before = _hits(fast)
    t = x.t()  # not contiguous
    assert_close_verbose(fuseml.ops.gelu(t), F.gelu(t.double()), torch.bfloat16)
    assert_close_verbose(fuseml.ops.softmax(x, 0), torch.softmax(x.double(), 0), torch.bfloat16)
    mode = _Counting()
    with mode:
        fuseml.ops.gelu(x)
    assert mode.ops > 0  # the dispatch mode saw the call
    assert _hits(fast) == before
    with pytest.raises(ValueError, match="y"):  # bad input: the Python path's error
        fuseml.ops.add(x, y[:32])
    with pytest.raises(ValueError, match="activation"):
        fuseml.ops.bias_act(x, None, None, 1.0, "swish")
    with pytest.raises(TypeError, match="x must have dtype"):
        fuseml.ops.gelu(x.to(torch.int32))


@gpu
def test_a_change_of_fuseml_pdl_is_a_new_signature(fast, monkeypatch):
    x, _, _ = _inputs((64, 512), torch.float16)
    _warm(fuseml.ops.gelu, x)
    ref = fuseml.ops.gelu(x)
    monkeypatch.setenv("FUSEML_PDL", "0")
    before = _hits(fast)
    first = fuseml.ops.gelu(x)
    assert _hits(fast) == before  # no plan for this setting yet
    _warm(fuseml.ops.gelu, x)
    assert _hits(fast) > before
    assert torch.equal(first, ref) and torch.equal(fuseml.ops.gelu(x), ref)


@gpu
def test_fast_calls_inside_a_cuda_graph(fast):
    x, y, b = _inputs((64, 512), torch.bfloat16)

    def step():
        h = fuseml.ops.bias_act(x, b, y, 1.0, "relu")
        return fuseml.ops.softmax(fuseml.ops.gelu(h))

    _warm(step)
    before = _hits(fast)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step()
    assert _hits(fast) == before + 6  # three on the side stream, three captured
    x.copy_(torch.randn_like(x))  # a replay reads the inputs as they are then
    got = replay_poisoned(graph, out)
    torch.cuda.synchronize()
    want = torch.softmax(F.gelu(F.relu(x.double() + b.double() + y.double())), -1)
    assert_close_verbose(got, want, torch.bfloat16)


# ------------------------------------------------------------------- linear (GEMM)
LINEAR_SHAPES = [  # (x's shape, out_features)
    ((64, 512), 256),
    ((64, 64), 16),
    ((2, 3, 64), 48),
    ((1, 128), 1),
    ((300, 256), 96),
    ((512, 256), 128),  # the TMA loop (host descriptors) from 512 rows
    ((256, 367), 512),  # K padded to 368 (the DLRM top MLP's first layer)
    ((1024, 367), 64),  # padded, on the TMA loop
]


@gpu
@pytest.mark.parametrize(("shape", "n"), LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("activation", "with_bias"), [(None, False), ("relu", True), ("gelu", True)]
)
def test_linear_repeat_calls_launch_from_cpp(fast, shape, n, dtype, activation, with_bias):
    g = torch.Generator(device="cuda").manual_seed(1)
    k = shape[-1]
    x = torch.randn(shape, dtype=dtype, device="cuda", generator=g)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, dtype=dtype, device="cuda", generator=g) if with_bias else None
    with torch.no_grad():
        fuseml.ops.linear(x, w, b, activation)  # compiles (and tunes where tuning is on)
        fast.clear()
        python = fuseml.ops.linear(x, w, b, activation)  # offers its plan
        poison_allocator()
        before = _hits(fast)
        out = fuseml.ops.linear(x, w, b, activation)
        torch.cuda.synchronize()
    kernel = linear_choice(x, w, b, activation)["kernel"]
    assert _hits(fast) == before + 1, kernel  # (the TMA loop's descriptors included)
    assert out.shape == (*shape[:-1], n) and out.dtype == dtype
    assert torch.equal(out, python)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    ref = ref if activation is None else getattr(F, activation)(ref)
    assert_close_verbose(out, ref, dtype)


@gpu
def test_linear_calls_the_cpp_side_does_not_take(fast):
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(200, 100, dtype=torch.bfloat16, device="cuda", generator=g)
    w = torch.randn(96, 100, dtype=torch.bfloat16, device="cuda", generator=g) / 10
    r = torch.randn(200, 96, dtype=torch.bfloat16, device="cuda", generator=g)
    x32, w32 = x.float(), w.float()
    with torch.no_grad():
        for _ in range(3):
            fp32 = fuseml.ops.linear(x32, w32)  # float32: TF32 flags decide its dots
            residual = fuseml.ops.linear(x, w, None, "relu", r, 0.5)
            transposed = fuseml.ops.linear(x.t().contiguous().t(), w)
    with torch.inference_mode():  # W padded per call: no version to key a kept copy on
        xi, wi = x.clone(), w.clone()  # (inference tensors)
        for _ in range(3):
            inference = fuseml.ops.linear(xi, wi)  # K = 100 from 128 rows: padded to 112
    assert _hits(fast) == 0
    ref = F.linear(x.double(), w.double())
    for out in (inference, transposed):
        assert_close_verbose(out, ref, torch.bfloat16)
    assert_close_verbose(residual, F.relu(ref + 0.5 * r.double()), torch.bfloat16)
    assert_close_verbose(fp32, ref, torch.float32, tf32=torch.backends.cuda.matmul.allow_tf32)


@gpu
def test_linear_tuned_and_heuristic_plans_are_apart(fast, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(48, 256, dtype=torch.bfloat16, device="cuda", generator=g)
    w = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda", generator=g) / 16
    ref = F.linear(x.double(), w.double())
    for tune in ("0", "1"):  # heuristic, then tuned tiles: a new signature each
        monkeypatch.setenv("FUSEML_AUTOTUNE", tune)
        before = _hits(fast)
        with torch.no_grad():
            first = fuseml.ops.linear(x, w)
            assert _hits(fast) == before  # no plan under this setting yet
            for _ in range(3):
                out = fuseml.ops.linear(x, w)
        # the later calls launch from C++ (the first of them too, where the first call's
        # kernel was compiled already)
        hits = _hits(fast) - before
        assert hits >= 2, (tune, hits, linear_choice(x, w)["kernel"])
        assert torch.equal(out, first)
        assert_close_verbose(out, ref, torch.bfloat16)


@gpu
@pytest.mark.parametrize("rows", [256, 1024])  # the pointer and the TMA loop
def test_padded_plans_keep_a_copy_per_weight_and_see_its_writes(fast, rows):
    """K = 367 runs padded to 368: the plan keeps each weight's padded copy (two layers of
    one shape alternating both launch from C++); an in-place write of W, or another W in
    its place, is seen; inside a capture the Python path pads W in the graph, so a replay
    after a write of W sees it too."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(rows, 367, dtype=torch.bfloat16, device="cuda", generator=g)
    w1, w2 = (
        torch.randn(512, 367, dtype=torch.bfloat16, device="cuda", generator=g) / 20
        for _ in range(2)
    )
    b = torch.randn(512, dtype=torch.bfloat16, device="cuda", generator=g)

    def call(w):
        poison_allocator()  # an element left unwritten shows as NaN
        return fuseml.ops.linear(x, w, b, "relu")

    def check(out, w):
        ref = F.relu(F.linear(x.double(), w.double(), b.double()))
        assert_close_verbose(out, ref, torch.bfloat16)

    with torch.no_grad():
        for w in (w1, w2, w1, w2):
            call(w)  # compiles, then registers each weight's copy
        before = _hits(fast)
        outs = [(w, call(w)) for w in (w1, w2, w1, w2)]
        torch.cuda.synchronize()
        assert _hits(fast) == before + 4
        for w, out in outs:
            check(out, w)
        w1.mul_(-1)  # a new version: the kept copy is stale
        check(call(w1), w1)
        w1 = w1.clone()  # another tensor (its storage may be the freed one's)
        check(call(w1), w1)
        torch.cuda.synchronize()
        hits = _hits(fast)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(w2)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fuseml.ops.linear(x, w2, b, "relu")
        assert _hits(fast) == hits + 1  # the side stream's call; the captured one padded W
        w2.add_(0.25)
        got = replay_poisoned(graph, captured)
        torch.cuda.synchronize()
        check(got, w2)


# ------------------------------------------------------------------- LoRA (one adapter)
LORA_SHAPES = [  # (x's shape, out_features, rank)
    ((16, 256), 128, 16),
    ((300, 512), 256, 8),
    ((2, 3, 64), 48, 4),
    ((512, 1024), 512, 32),
]


def _lora_inputs(shape, n, r, dtype, with_bias, seed=4):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = shape[-1]
    x = torch.randn(shape, dtype=dtype, device="cuda", generator=g)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, dtype=dtype, device="cuda", generator=g) if with_bias else None
    a = torch.randn(r, k, dtype=dtype, device="cuda", generator=g) / k**0.5
    bb = torch.randn(n, r, dtype=dtype, device="cuda", generator=g) / r**0.5
    return x, w, b, a, bb


def _lora_ref(x, w, b, a, bb, scaling, activation=None):
    from fuseml.ops.lora import lora_linear_ref

    d = [None if t is None else t.double() for t in (x, w, b, a, bb)]
    return lora_linear_ref(*d, scaling, activation)


@gpu
@pytest.mark.parametrize(("shape", "n", "r"), LORA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("activation", "with_bias"), [(None, False), ("relu", True), ("gelu", True)]
)
def test_lora_repeat_calls_launch_from_cpp(fast, shape, n, r, dtype, activation, with_bias):
    x, w, b, a, bb = _lora_inputs(shape, n, r, dtype, with_bias)
    with torch.no_grad():
        fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation)  # compiles, tunes
        fast.clear()
        python = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation)  # offers its plan
        poison_allocator()
        before = _hits(fast)
        out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation)
        torch.cuda.synchronize()
        assert _hits(fast) == before + 1, _fastcall.refusals
        rescaled = fuseml.ops.lora_linear(x, w, b, a, bb, 2, activation)  # the same plan
        assert _hits(fast) == before + 2
    assert out.shape == (*shape[:-1], n) and out.dtype == dtype
    assert torch.equal(out, python)
    assert_close_verbose(out, _lora_ref(x, w, b, a, bb, 0.5, activation), dtype)
    assert_close_verbose(rescaled, _lora_ref(x, w, b, a, bb, 2.0, activation), dtype)


@gpu
def test_lora_calls_the_cpp_side_does_not_take(fast):
    from fuseml.ops.lora import FAST_MAX_M, LoraPath

    x, w, b, a, bb = _lora_inputs((64, 256), 128, 16, torch.bfloat16, True)
    big = torch.randn(FAST_MAX_M + 88, 256, dtype=x.dtype, device="cuda")
    a3, b3 = a[None].repeat(2, 1, 1), bb[None].repeat(2, 1, 1)
    ids = torch.tensor([0, 1, -1, 1] * 16, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            rows = fuseml.ops.lora_linear(big, w, b, a, bb, 0.5)  # past FAST_MAX_M: TMA
            multi = fuseml.ops.lora_linear(x, w, b, a3, b3, 0.5, adapter_ids=ids)
            forced = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, path=LoraPath(loop="ptr"))
            fp32 = fuseml.ops.lora_linear(x.float(), w.float(), None, a.float(), bb.float(), 0.5)
    assert _hits(fast) == 0, _fastcall.refusals
    assert_close_verbose(rows, _lora_ref(big, w, b, a, bb, 0.5), torch.bfloat16)
    assert_close_verbose(forced, _lora_ref(x, w, b, a, bb, 0.5), torch.bfloat16)
    ref = _lora_ref(x, w, b, a, bb, 0.5)
    ref[ids == -1] = F.linear(x.double(), w.double(), b.double())[ids == -1]
    assert_close_verbose(multi, ref, torch.bfloat16)
    assert_close_verbose(
        fp32, _lora_ref(x, w, None, a, bb, 0.5), torch.float32,
        tf32=torch.backends.cuda.matmul.allow_tf32,
    )  # fmt: skip
    # under autograd the fused layer refuses (forward only) from either side
    wg = w.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="forward-only"):
        fuseml.ops.lora_linear(x, wg, b, a, bb, 0.5)


@gpu
@pytest.mark.parametrize(("activation", "with_bias"), [(None, False), ("gelu", True)])
def test_lora_joint_launch_repeats_from_cpp(fast, activation, with_bias):
    """An eager call that takes the joint launch (forced here; the tuned mode where it wins)
    keeps that launch's plan, four host descriptors encoded per call, and the calls of the
    same signature repeat it from C++: the same output as the Python launch, every call. A
    call on another stream takes the Python path (the flags are the registering stream's)."""
    from fuseml.ops import gemm
    from fuseml.ops.lora import LoraPath

    joint = LoraPath(mode=gemm.LORA_JOINT)
    x, w, b, a, bb = _lora_inputs((512, 1024), 1024, 16, torch.bfloat16, with_bias)
    ref = _lora_ref(x, w, b, a, bb, 0.5, activation)
    with torch.no_grad():
        fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation, path=joint)  # compiles
        fast.clear()
        python = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation, path=joint)
        before = _hits(fast)
        outs = []
        for _ in range(3):
            poison_allocator()
            outs.append(fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation))
        torch.cuda.synchronize()
        assert _hits(fast) == before + 3, _fastcall.refusals
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            hits = _hits(fast)
            other = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, activation)
            assert _hits(fast) == hits
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    assert_close_verbose(python, ref, torch.bfloat16)
    for out in outs:
        assert torch.equal(out, python)
    assert_close_verbose(other, ref, torch.bfloat16)


@gpu
def test_eager_lora_call_takes_the_joint_launch_where_expand_is_tuned(fast, monkeypatch):
    """Where the mode tuned for graphs is the expand pair (two launches; forced here, as
    tuning picks it where it times a little faster), an eager call at up to FAST_MAX_M
    rows takes the joint launch (one, its repeats from C++), not the in-loop pointer
    kernel; a captured call keeps the pair. Each matches the reference."""
    from fuseml.ops import gemm
    from fuseml.ops.gemm import launch as _gemm
    from fuseml.ops.lora import LoraPath

    used = []
    launch = _gemm._launch_tma  # (a spy: the LoRA mode of each TMA-kernel launch)
    monkeypatch.setattr(
        _gemm, "_launch_tma", lambda *a, **k: used.append(a[8] and a[8][0]) or launch(*a, **k)
    )
    expand = LoraPath(mode=gemm.LORA_EXPAND)
    x, w, b, a, bb = _lora_inputs((512, 1024), 1024, 16, torch.bfloat16, True)
    ref = _lora_ref(x, w, b, a, bb, 0.5, "gelu")
    with torch.no_grad():
        fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "gelu", path=expand)  # compiles, tunes
        used.clear()
        poison_allocator()
        first = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "gelu", path=expand)
        assert used == [gemm.LORA_JOINT]
        before = _hits(fast)
        again = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "gelu")
        assert _hits(fast) == before + 1, _fastcall.refusals
        used.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "gelu", path=expand)
        assert used[-1] == gemm.LORA_EXPAND and gemm.LORA_JOINT not in used, used
        replay_poisoned(graph, captured)
    for out in (first, again, captured):
        assert_close_verbose(out, ref, torch.bfloat16)


@gpu
def test_captured_lora_calls_take_the_python_path(fast):
    x, w, b, a, bb = _lora_inputs((64, 256), 128, 16, torch.bfloat16, True)
    with torch.no_grad():
        for _ in range(3):  # eager: the plan kept
            eager = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5)
        before = _hits(fast)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5)
        assert _hits(fast) == before  # (a capture takes the mode tuned for graphs)
        replay_poisoned(graph, captured)
    assert_close_verbose(captured, _lora_ref(x, w, b, a, bb, 0.5), torch.bfloat16)
    assert_close_verbose(eager, _lora_ref(x, w, b, a, bb, 0.5), torch.bfloat16)
