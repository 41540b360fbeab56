import importlib
import itertools
import logging
import re

import pytest
import torch
from triton.runtime.errors import OutOfResources

import fuseml
from fuseml.ops import _mlp_plan as plan
from fuseml.ops import mlp_ref
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets

mlp_mod = importlib.import_module("fuseml.ops.mlp")  # fuseml.ops.mlp is also the function

TARGETS = fused_targets(cuda_twin=False)


def _up(t):
    return None if t is None else t.double()


def _layers(widths, dtype, device, bias_every=1):
    ws = [
        torch.randn(o, i, dtype=dtype, device=device) / i**0.5
        for i, o in itertools.pairwise(widths)
    ]
    bs = [
        torch.randn(o, dtype=dtype, device=device) if j % bias_every == 0 else None
        for j, o in enumerate(widths[1:])
    ]
    return ws, bs


def _ref64(x, ws, bs, acts):
    acts = [acts] * len(ws) if isinstance(acts, str) or acts is None else acts
    acts = ["none" if a is None else a for a in acts]
    return mlp_ref(_up(x), [_up(w) for w in ws], [_up(b) for b in bs], acts)


CHAINS = [
    ([13, 64, 32, 16], "relu"),  # a DLRM bottom MLP, scaled down
    ([20, 33, 17], ["gelu", "sigmoid"]),  # odd widths
    ([8, 16], None),  # one layer, no activation
    ([37, 48, 40, 1], ["relu", "relu", "sigmoid"]),  # a top MLP ending in one logit
]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("widths", "acts"), CHAINS)
@pytest.mark.parametrize("m", [1, 70])
def test_mlp_chains(device, backend, dtype, widths, acts, m):
    ws, bs = _layers(widths, dtype, device, bias_every=2 if m == 1 else 1)
    x = torch.randn(m, widths[0], dtype=dtype, device=device)
    out = fuseml.ops.mlp(x, ws, bs, acts, backend=backend)
    assert out.shape == (m, widths[-1]) and out.dtype == dtype
    assert_close_verbose(out, _ref64(x, ws, bs, acts), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("widths", "acts"),
    [*CHAINS[:2], CHAINS[3], ([70, 300, 20, 5, 3], ["tanh", "silu", "relu", None])],
)
def test_mlp_both_kernels(device, backend, dtype, widths, acts):
    """The register-resident chain kernel (16-bit, widths after layer 1 up to 256) and
    the scratch kernel give the reference's result on the same chain: a 70-wide input
    takes several K steps in the chain kernel's first layer, 300 several chunks."""
    assert plan.chain_fits(widths, dtype)
    ws, bs = _layers(widths, dtype, device, bias_every=2)
    x = torch.randn(37, widths[0], dtype=dtype, device=device)
    acts = [acts] * len(ws) if isinstance(acts, str) else acts
    codes = [fuseml.ops.ACTIVATIONS.index(a or "none") for a in acts]
    ref = _ref64(x, ws, bs, acts)
    small = plan._chain_cfg(16, 32, 16, 4, 2)  # 3 row blocks, 16-column steps
    for cfg in (plan._CHAIN_DEFAULT, small, plan._DEFAULT, plan._LAYERS):
        out = torch.full((37, widths[-1]), float("nan"), dtype=dtype, device=device)
        plan._launch_group(x, out, ws, bs, codes, cfg, False)
        assert_close_verbose(out, ref, dtype)


def test_mlp_chain_kernel_takes_16_bit_chains_that_fit():
    fits = plan.chain_fits
    assert fits([13, 512, 256, 64, 16], torch.bfloat16)  # DLRM bottom MLPs
    assert fits([367, 512, 256, 1], torch.float16)  # kaggle top MLP
    assert not fits([13, 512, 256, 64, 16], torch.float32)  # fp32 operands: registers
    assert not fits([479, 1024, 1024, 512, 256, 1], torch.bfloat16)  # layer 1 too wide
    assert not fits([8, 16], torch.bfloat16)  # one layer


def test_int_spec():
    from fuseml.ops._utils import int_spec

    assert int_spec(1) == (True, False, True)
    assert int_spec(32) == (False, True, True)
    assert int_spec(37) == (False, False, True)
    assert int_spec(2**31) == (False, True, False)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_mlp_layer_by_layer_choice_is_said_once(device, backend, caplog):
    """A 16-bit chain with a wide input runs layer by layer when untuned (the interpreter):
    same result as the reference, said once in the log."""
    plan._say_layers.cache_clear()
    ws, bs = _layers([80, 48, 16], torch.bfloat16, device)
    x = torch.randn(5, 80, dtype=torch.bfloat16, device=device)
    with caplog.at_level(logging.INFO, logger="fuseml"):
        out = fuseml.ops.mlp(x, ws, bs, "relu", backend=backend)
        fuseml.ops.mlp(x, ws, bs, "relu", backend=backend)
    assert_close_verbose(out, _ref64(x, ws, bs, "relu"), torch.bfloat16)
    said = [r for r in caplog.records if "layer by layer" in r.getMessage()]
    if device == "cpu":  # (on a GPU tuning may pick a fused kernel instead)
        assert len(said) == 1 and "80-48-16" in said[0].getMessage()
    assert len(said) <= 1


def test_mlp_untuned_choice():
    """Without tuning: the chain kernel for narrow-input chains it takes, the layers one
    by one for other 16-bit chains, the scratch kernel for float32; tuning also times
    the layers one by one wherever the chain kernel does not clearly win."""
    pick = plan.default_config
    assert pick([13, 512, 256, 64, 16], torch.bfloat16)["kind"] == "chain"
    assert pick([367, 512, 256, 1], torch.bfloat16)["kind"] == "layers"  # wide input
    assert pick([479, 1024, 1024, 512, 256, 1], torch.float16)["kind"] == "layers"
    assert pick([13, 512, 256, 64, 16], torch.float32) == plan._DEFAULT
    for widths, dtype, layers in [
        ([13, 512, 256, 64, 16], torch.bfloat16, False),
        ([367, 512, 256, 1], torch.bfloat16, True),
        ([13, 512, 256, 64, 16], torch.float32, True),
    ]:
        for m in (64, 65536):
            assert (plan._LAYERS in plan.candidates(m, widths, dtype)) == layers


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_mlp_layouts_and_long_chains(device, backend):
    ws, bs = _layers([12, 24, 16], torch.float32, device)
    x = torch.randn(2, 3, 12, device=device)  # batched
    assert_close_verbose(
        fuseml.ops.mlp(x, ws, bs, "tanh", backend=backend), _ref64(x, ws, bs, "tanh")
    )
    xt = torch.randn(12, 10, device=device).t()  # column-strided rows
    assert_close_verbose(
        fuseml.ops.mlp(xt, ws, bs, "relu", backend=backend), _ref64(xt, ws, bs, "relu")
    )
    ws, bs = _layers([16] * 12, torch.float32, device)  # 11 layers: two launches (8 + 3)
    x = torch.randn(5, 16, device=device)
    assert_close_verbose(
        fuseml.ops.mlp(x, ws, bs, "tanh", backend=backend), _ref64(x, ws, bs, "tanh")
    )
    assert fuseml.ops.mlp(x[:0], ws, bs, "tanh", backend=backend).shape == (0, 16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_mlp_wider_than_the_limit_runs_layer_by_layer(device, backend, caplog):
    """A layer wider than the fused kernels take (max_width: 32 here, MAX_WIDTH by default)
    runs the chain layer by layer, said once."""
    mlp_mod._warn_unfused.cache_clear()
    ws, bs = _layers([16, 40, 8], torch.float32, device)
    x = torch.randn(3, 16, device=device)
    codes = [fuseml.ops.ACTIVATIONS.index("relu")] * len(ws)
    with caplog.at_level(logging.WARNING, logger="fuseml"):
        out = mlp_mod.mlp_rows(x, ws, bs, codes, max_width=32)
        mlp_mod.mlp_rows(x, ws, bs, codes, max_width=32)
    assert_close_verbose(out, _ref64(x, ws, bs, "relu"))
    said = [r for r in caplog.records if "layer by layer" in r.getMessage()]
    assert len(said) == 1  # said once


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # scratch / chain kernel
def test_mlp_opcheck_and_compile(device, backend, dtype):
    ws, bs = _layers([10, 24, 8], dtype, device, bias_every=2)
    x = torch.randn(6, 10, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.fuseml.mlp, (x, ws, bs, [1, 0]))

    def fn(x):
        return fuseml.ops.mlp(x, ws, bs, ["relu", None], backend=backend).sum(-1)

    out = torch.compile(fn, fullgraph=True)(x)
    assert_close_verbose(out, _ref64(x, ws, bs, ["relu", None]).sum(-1), dtype)


def test_mlp_eager_and_compile_backends():
    ws, bs = _layers([10, 24, 8], torch.float32, "cpu")
    x = torch.randn(6, 10)
    for backend in ("auto", "eager", "compile"):
        assert_close_verbose(
            fuseml.ops.mlp(x, ws, bs, "relu", backend=backend), _ref64(x, ws, bs, "relu")
        )
    assert_close_verbose(fuseml.ops.mlp(x, ws, None, "relu"), _ref64(x, ws, [None, None], "relu"))


@pytest.mark.parametrize(
    ("args", "exc", "words"),
    [
        (lambda ws, bs: (torch.randn(3, 11), ws, bs, "relu"), ValueError, "weights[0] must be (out, 11) (its input is x of width 11)"),
        (lambda ws, bs: (torch.randn(3, 10), [ws[0], ws[0]], bs, "relu"), ValueError, "weights[1] must be (out, 24)"),
        (lambda ws, bs: (torch.randn(3, 10), ws, bs[:1], "relu"), ValueError, "one entry (tensor or None) per layer (2)"),
        (lambda ws, bs: (torch.randn(3, 10), ws, [bs[1], bs[0]], "relu"), ValueError, "biases[0] must have shape (24,)"),
        (lambda ws, bs: (torch.randn(3, 10), ws, bs, ["relu"]), ValueError, "one per layer (2)"),
        (lambda ws, bs: (torch.randn(3, 10), ws, bs, ["relu", "swish"]), ValueError, "activations[1] must be one of"),
        (lambda ws, bs: (torch.randn(3, 10), [], bs, "relu"), TypeError, "non-empty list"),
        (lambda ws, bs: (torch.randn(3, 10, dtype=torch.bfloat16), ws, bs, "relu"), TypeError, "mixed dtypes"),
    ],
)  # fmt: skip
def test_mlp_bad_input(args, exc, words):
    ws, bs = _layers([10, 24, 8], torch.float32, "cpu")
    with pytest.raises(exc, match=re.escape(words)):
        fuseml.ops.mlp(*args(ws, bs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "widths", [[13, 512, 256, 64, 16], [367, 512, 256, 1], [479, 1024, 1024, 512, 256, 1]]
)
@pytest.mark.parametrize("m", [1, 4096, 20000])
def test_mlp_dlrm_shapes_gpu(dtype, widths, m):
    ws, bs = _layers(widths, dtype, "cuda")
    x = torch.randn(m, widths[0], dtype=dtype, device="cuda")
    acts = ["relu"] * (len(ws) - 1) + ["sigmoid"]
    out = fuseml.ops.mlp(x, ws, bs, acts, backend="triton")
    assert_close_verbose(out, _ref64(x, ws, bs, acts), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [300, 65536 + 37])
def test_every_mlp_candidate_config_is_correct(dtype, m):
    """Tuning may pick any candidate: each one must compute the same thing, also with many
    row blocks per persistent program (m = 65573: 4-16 blocks per program)."""
    widths = [13, 512, 256, 64, 16]
    ws, bs = _layers(widths, dtype, "cuda", bias_every=2)
    x = torch.randn(m, widths[0], dtype=dtype, device="cuda")
    acts = ["relu", "gelu", "relu", "sigmoid"]
    codes = [fuseml.ops.ACTIVATIONS.index(a) for a in acts]
    ref = _ref64(x, ws, bs, acts)
    configs = [*plan._SMALL_B, *plan._LARGE_B, plan._LAYERS]
    if plan.chain_fits(widths, dtype):
        configs = plan._CHAIN_SMALL_B + plan._CHAIN_LARGE_B + configs
    unrunnable = []
    for cfg in configs:
        out = torch.full((m, widths[-1]), float("nan"), dtype=dtype, device="cuda")
        try:
            plan._launch_group(x, out, ws, bs, codes, cfg, False)
        except OutOfResources:
            # Tuning skips a config the device cannot run (fp32's tf32x3 dots hold each
            # operand twice in shared memory); the untuned default must run (below).
            unrunnable.append(cfg)
            continue
        try:
            assert_close_verbose(out, ref, dtype)
        except AssertionError as err:
            raise AssertionError(f"config {cfg}: {err}") from None
    default = plan._CHAIN_DEFAULT if plan.chain_fits(widths, dtype) else plan._DEFAULT
    assert default not in unrunnable
    assert len(unrunnable) < len(configs) // 2, unrunnable
    if dtype != torch.float32:
        assert not unrunnable


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("widths", "m"),
    [([13, 512, 256, 128], 32768), ([13, 512, 256, 128], 65536), ([367, 512, 256, 1], 4096)],
)
def test_mlp_tuned_large_batch_gpu(widths, m, fresh_tuning):
    """With tuning on (as users run it), the chosen config gives the reference's result
    (the 367-wide chain also times its layers one by one, each linear layer tuning on its
    first call inside the MLP's tuning)."""
    from fuseml.ops import _tune

    ws, bs = _layers(widths, torch.bfloat16, "cuda")
    x = torch.randn(m, widths[0], dtype=torch.bfloat16, device="cuda")
    out = fuseml.ops.mlp(x, ws, bs, "relu", backend="triton")
    assert _tune.entry_count()[0] >= 1  # it did tune
    acts = ["relu"] * (len(widths) - 1)
    assert_close_verbose(out, _ref64(x, ws, bs, acts), torch.bfloat16)
    again = fuseml.ops.mlp(x, ws, bs, "relu", backend="triton")
    assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mlp_direct_launch_matches_the_ordinary_launch_gpu(monkeypatch):
    """Repeat calls of the chain kernel go through the compiled kernel's own launcher
    (CompiledLaunches): same output as Triton's ordinary launch for every batch size
    (1, multiples of 16, odd), for a 16-byte-misaligned input (ordinary launch) and for
    a strided one."""
    widths = [13, 512, 256, 64, 16]
    ws, bs = _layers(widths, torch.bfloat16, "cuda", bias_every=2)
    acts = ["relu", "gelu", "relu", "sigmoid"]
    codes = [fuseml.ops.ACTIVATIONS.index(a) for a in acts]
    cfg = plan._CHAIN_DEFAULT
    buf = torch.randn(300 * 14 + 1, dtype=torch.bfloat16, device="cuda")
    inputs = [torch.randn(m, 13, dtype=torch.bfloat16, device="cuda") for m in (1, 16, 37, 64, 1)]
    inputs.append(buf[1 : 1 + 300 * 13].view(300, 13))  # data_ptr % 16 == 2
    inputs.append(buf[: 300 * 14].view(300, 14)[:, :13])  # row stride 14
    launches = plan._chain_launches
    for x in inputs:
        outs = []
        for direct in (False, True, True):  # ordinary, then the first and a repeat direct
            monkeypatch.setattr(launches, "enabled", direct)
            out = torch.full((x.shape[0], 16), float("nan"), dtype=x.dtype, device="cuda")
            plan._launch_group(x, out, ws, bs, codes, cfg, False)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        assert_close_verbose(outs[2], _ref64(x, ws, bs, acts), torch.bfloat16)
    assert len(launches.compiled) >= 3  # M = 1, a multiple of 16, neither


def test_split_plan_offered_where_the_input_is_too_wide_for_the_chain():
    """Tuning times the split plan (the first layer through fuseml.ops.linear, the rest in
    one chain-kernel launch) for the kaggle top MLP's shape, one candidate per chain tile,
    keyed apart from tables made before it; not for a narrow input, float32, or a chain
    whose later layers the chain kernel cannot hold."""
    top = (367, 512, 256, 1)
    for m in (64, 65536):
        cands = plan.candidates(m, top, torch.bfloat16)
        split = [c for c in cands if c.get("kind") == "split"]
        chain = plan._CHAIN_SMALL_B if m <= plan.SMALL_BATCH else plan._CHAIN_LARGE_B
        assert [{**c, "kind": "chain"} for c in split] == chain + plan._SPLIT_WHOLE
        assert plan._LAYERS in cands
    assert plan.split_fits(top, torch.bfloat16)
    assert not plan.split_fits(top, torch.float32)
    assert not plan.split_fits((13, 512, 256, 64, 16), torch.bfloat16)  # narrow input
    assert not plan.split_fits((479, 1024, 1024, 512, 256, 1), torch.bfloat16)
    assert not plan.split_fits((367, 512, 1), torch.bfloat16)  # one layer after the first


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 37, 130])
@pytest.mark.parametrize("widths", [[100, 64, 32, 1], [100, 64, 256, 1]])
def test_split_plan_matches_float64(device, backend, dtype, m, widths):
    """The split plan of a top-MLP-shaped chain (wide input, a 1-wide sigmoid head) under
    chain tiles (a 256-wide layer also in one chunk), into a NaN-filled output: the
    float64 reference."""
    ws, bs = _layers(widths, dtype, device)
    x = torch.randn(m, widths[0], dtype=dtype, device=device)
    acts = ["relu", "relu", "sigmoid"]
    codes = [fuseml.ops.ACTIVATIONS.index(a) for a in acts]
    ref = _ref64(x, ws, bs, acts)
    assert plan.split_fits(widths, dtype)
    chains = plan._CHAIN_SMALL_B[:2] + plan._CHAIN_LARGE_B[-1:]
    if widths[2] == 256:
        chains = plan._SPLIT_WHOLE
    for chain in chains:
        cfg = plan._split_cfg(chain)
        out = torch.full((m, 1), float("nan"), dtype=dtype, device=device)
        plan._launch_group(x, out, ws, bs, codes, cfg, False)
        assert_close_verbose(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [300, 65536 + 37])
def test_split_plan_kaggle_top_every_chain_tile_gpu(m):
    """The kaggle top MLP (367-512-256-1, bf16) under every split candidate, as tuning
    may pick it, into a NaN-filled output."""
    widths = [367, 512, 256, 1]
    ws, bs = _layers(widths, torch.bfloat16, "cuda")
    x = torch.randn(m, widths[0], dtype=torch.bfloat16, device="cuda")
    acts = ["relu", "relu", "sigmoid"]
    codes = [fuseml.ops.ACTIVATIONS.index(a) for a in acts]
    ref = _ref64(x, ws, bs, acts)
    for cfg in plan.candidates(m, widths, torch.bfloat16):
        if cfg.get("kind") != "split":
            continue
        out = torch.full((m, 1), float("nan"), dtype=torch.bfloat16, device="cuda")
        plan._launch_group(x, out, ws, bs, codes, cfg, False)
        try:
            assert_close_verbose(out, ref, torch.bfloat16)
        except AssertionError as err:
            raise AssertionError(f"config {cfg}: {err}") from None
