"""CompiledLaunches: which launch path a call takes (the GPU tests of the MLP and linear
kernels check that both paths compute the same thing)."""

import types

import pytest
from triton.compiler import CompiledKernel

from fuseml.ops import _utils


class _Compiled(CompiledKernel):
    """A stand-in compiled kernel: records its direct launches."""

    def __init__(self, calls):  # (CompiledKernel's own __init__ loads a binary)
        self.calls = calls
        self.module = None  # (read by CompiledKernel.__del__ in newer Triton)
        self.function, self.packed_metadata = "fn", "meta"

    def __getitem__(self, grid):  # the launch that calls a profiler's hooks
        return lambda *args: self.calls.append(("hooked", grid, args))

    def run(self, gx, gy, gz, stream, function, metadata, launch_meta, enter, leave, *args):
        assert (stream, function, metadata) == ("stream0", "fn", "meta")
        assert launch_meta is enter is leave is None
        self.calls.append(("direct", (gx, gy, gz), args))


class _Kernel:
    """A stand-in JIT kernel: kernel[grid](*args, **options) records an ordinary launch and
    hands back its compiled kernel, as Triton's does."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(("ordinary", grid, args, options))
            return _Compiled(self.calls)

        return launch


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.setattr(_utils, "_current_device", lambda: 0)
    monkeypatch.setattr(_utils, "_raw_stream", lambda device: f"stream{device}")
    monkeypatch.setattr(_utils, "_launch_hooks", lambda: None)
    kernel = _Kernel()
    fast = _utils.CompiledLaunches(kernel)
    fast.enabled = True  # (off under the interpreter, which these tests may run in)
    return kernel, fast


def test_repeat_calls_take_the_compiled_kernel(launches):
    kernel, fast = launches
    fast((4,), "k1", True, (1, 2), {"num_warps": 4})
    fast((8,), "k1", True, (3, 4), {"num_warps": 4})
    assert kernel.calls == [
        ("ordinary", (4,), (1, 2), {"num_warps": 4}),
        ("direct", (8, 1, 1), (3, 4)),  # the grid padded to 3 dims
    ]


def test_new_keys_and_unaligned_calls_take_the_ordinary_launch(launches):
    kernel, fast = launches
    fast((4,), "k1", True, (1,), {})
    fast((4,), "k2", True, (1,), {})  # another specialization: compiled anew
    fast((4,), "k1", False, (1,), {})  # a misaligned pointer: never the cached kernel
    assert [c[0] for c in kernel.calls] == ["ordinary", "ordinary", "ordinary"]
    fast((4, 2), "k2", True, (1,), {})
    assert kernel.calls[-1] == ("direct", (4, 2, 1), (1,))


def test_off_switch_and_compile_only(launches, monkeypatch):
    kernel, fast = launches
    fast((4,), "k1", True, (1,), {})
    fast.enabled = False  # FUSEML_DIRECT_LAUNCH=0
    fast((4,), "k1", True, (1,), {})
    fast.enabled = True
    monkeypatch.setattr(_utils, "compiling_only", lambda: True)  # tuning compiles only
    monkeypatch.setattr(_utils, "grid_launch", lambda k, g: k[g])
    fast((4,), "k1", True, (1,), {})
    assert [c[0] for c in kernel.calls] == ["ordinary"] * 3


def test_launch_hooks_take_the_launch_that_calls_them(launches, monkeypatch):
    kernel, fast = launches
    fast((4,), "k1", True, (1,), {})
    monkeypatch.setattr(_utils, "_launch_hooks", lambda: print)  # e.g. proton profiling
    fast((4,), "k1", True, (2,), {})
    assert kernel.calls[-1] == ("hooked", (4, 1, 1), (2,))


class _Chain:  # Triton's HookChain: an object even when no hook is set
    def __init__(self, *calls):
        self.calls = list(calls)


@pytest.mark.parametrize(
    ("enter", "exit_", "hooked"),
    [
        (None, None, False),
        (_Chain(), _Chain(), False),  # empty chains: no hook set
        (_Chain(print), _Chain(), True),
        (_Chain(), _Chain(print), True),
        (print, None, True),  # an older Triton's plain function
    ],
)
def test_launch_hooks_seen_through_empty_chains(monkeypatch, enter, exit_, hooked):
    runtime = types.SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=exit_)
    monkeypatch.setattr(_utils, "_knobs_runtime", runtime)
    assert (_utils._launch_hooks() is not None) == hooked


def test_the_environment_switch(monkeypatch):
    monkeypatch.setenv("FUSEML_DIRECT_LAUNCH", "0")
    assert not _utils.CompiledLaunches(_Kernel()).enabled


def test_aligned16():
    import torch

    buf = torch.zeros(64)
    assert _utils.aligned16(buf, None, buf[4:])  # 16 bytes in: aligned
    assert not _utils.aligned16(buf, buf[1:])  # 4 bytes in: not
    assert _utils.aligned16()


def test_plain_linear_launch_key_holds_out_dtype(monkeypatch):
    # The same x, W and config writing bfloat16 or float32 (LoRA's x @ A^T) are two
    # compiled kernels: the repeat-launch key must tell them apart.
    import torch

    from fuseml.ops import gemm

    keys = []
    monkeypatch.setattr(
        gemm.launch, "_linear_launches", lambda grid, key, aligned, args, options: keys.append(key)
    )
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    cfg = gemm.default_config(4, 16, 32, torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(4, 16, dtype=dtype)
        gemm.launch_linear(out, x, w, None, None, 1.0, 0, cfg)
    assert len(keys) == 2 and keys[0] != keys[1]


@pytest.fixture
def every_argument(monkeypatch):
    """The compiled kernel's launcher takes every parameter positionally, constexprs and
    defaulted ones included (``CompiledLaunches``): a parameter left to its default, or
    passed only as a keyword, works on the first, ordinary launch and fails on every repeat
    (on a GPU: "function takes exactly N arguments"). Checks that each launch through a
    ``CompiledLaunches`` hands over exactly as many arguments as its kernel has; returns
    the kernels launched."""
    seen = []
    call = _utils.CompiledLaunches.__call__

    def checked(self, grid, key, aligned, args, options):
        assert len(args) == len(self.kernel.arg_names), (self.kernel.arg_names, len(args))
        seen.append(self.kernel)
        return call(self, grid, key, aligned, args, options)

    monkeypatch.setattr(_utils.CompiledLaunches, "__call__", checked)
    return seen


@pytest.mark.parametrize("mode", ["in_loop", "expand", "joint", "spread", "linear"])
def test_tma_launches_pass_every_kernel_argument(mode, monkeypatch, every_argument):
    """Each TMA launch form passes every kernel argument (see ``every_argument``)."""
    import importlib

    import torch

    import fuseml
    from fuseml.ops import gemm
    from fuseml.ops import lora as lora_mod

    linear_mod = importlib.import_module("fuseml.ops.linear")  # (the module, not the op)
    seen = every_argument
    want = {"in_loop": gemm.LORA_IN_LOOP, "expand": gemm.LORA_EXPAND}.get(mode)
    want = {"joint": gemm.LORA_JOINT, "spread": gemm.LORA_SPREAD}.get(mode, want)
    x = torch.randn(40, 64)
    w, b = torch.randn(48, 64), torch.randn(48)
    a, bb = torch.randn(8, 64), torch.randn(48, 8)
    if mode == "linear":
        linear_mod.linear_rows(x, w, b, None, 1.0, 1, loop="tma")  # 1: relu
        assert seen == [gemm.tma._linear_tma_kernel]
    else:
        # (in-loop on the TMA kernel: forced; the other modes as in a graph capture)
        overlap = mode != "in_loop"
        path = lora_mod.LoraPath(
            loop="tma", overlap=overlap, capture=True, mode=want if overlap else None
        )
        fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, backend="triton", path=path)
        assert gemm.tma._lora_tma_kernel in seen


@pytest.mark.parametrize(
    "op", ["softmax", "log_softmax", "add", "bias_act", "linear", "stream", "mlp", "interaction"]
)
def test_other_launches_pass_every_kernel_argument(op, every_argument):
    """The on-chip softmax, elementwise, plain linear (both kernels), MLP-chain and gather
    + interaction launches pass every kernel argument too (see ``every_argument``)."""
    import importlib

    import torch

    import fuseml
    from fuseml.ops import _elementwise, _mlp_kernels, gemm

    # (the modules, not the ops of the same names that fuseml.ops exports)
    softmax_mod = importlib.import_module("fuseml.ops._softmax.rows")
    x = torch.randn(8, 64)
    w, b = torch.randn(32, 64), torch.randn(32)
    if op in ("softmax", "log_softmax"):
        getattr(fuseml.ops, op)(x, backend="triton")
        kernel = softmax_mod._softmax_rows_kernel
    elif op == "add":
        fuseml.ops.add(x, torch.randn(8, 64), backend="triton")
        kernel = _elementwise._bias_act_kernel
    elif op == "bias_act":
        fuseml.ops.bias_act(x, torch.randn(64), activation="gelu", backend="triton")
        kernel = _elementwise._bias_act_kernel
    elif op == "linear":
        fuseml.ops.linear(x, w, b, "relu", backend="triton")
        kernel = gemm.pointer._linear_kernel
    elif op == "stream":
        xs = torch.randn(600, 64, dtype=torch.bfloat16)
        ws, bs = w.to(torch.bfloat16), b.to(torch.bfloat16)
        cfg = next(c for c in gemm.candidates(600, 32, 64, xs.dtype, plain=True) if "STREAM" in c)
        gemm.launch_linear(torch.empty(600, 32, dtype=xs.dtype), xs, ws, bs, None, 1.0, 1, cfg)
        kernel = gemm.stream._linear_stream_kernel
    elif op == "interaction":
        from fuseml.ops import _interaction_kernels

        offsets = torch.tensor([0, 5, 9])
        ids = torch.tensor([[1, 2], [4, 0]])
        fuseml.ops.embedding_interaction(
            torch.randn(2, 16), torch.randn(9, 16), offsets, ids, backend="triton"
        )
        kernel = _interaction_kernels._embedding_interaction_kernel
    else:  # a narrow 16-bit chain: the register-resident chain kernel
        bf = torch.bfloat16
        ws = [torch.randn(32, 16, dtype=bf), torch.randn(16, 32, dtype=bf)]
        bs = [torch.randn(32, dtype=bf), torch.randn(16, dtype=bf)]
        fuseml.ops.mlp(torch.randn(8, 16, dtype=bf), ws, bs, "relu", backend="triton")
        kernel = _mlp_kernels._chain_kernel
    assert kernel in every_argument
