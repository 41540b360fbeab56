"""``fuseml bench SUITE --sweep``: every candidate launch config of fuseml's kernel as an
arm, each computing the reference's function (small shapes, Triton interpreter on CPU)."""

import pytest
import torch

from fuseml import bench, runtime
from fuseml.bench.harness import Case
from fuseml.bench.suites import elementwise, linear
from fuseml.ops import bias_act_ref
from fuseml.testing import rel_err, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not runtime.triton_available(DEVICE), reason="Triton (or its interpreter) unavailable"
)


@needs_triton
@pytest.mark.parametrize(
    "op,kind,shape",
    [("bias_residual_relu", "xbr", (33, 40)), ("gelu_tanh", "x", (1000,)), ("add", "xy", (77,))],
)
def test_elementwise_sweep_arms_compute_the_op(op, kind, shape):
    dtype = torch.float32
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    other = torch.randn(shape, device=DEVICE, dtype=dtype)
    bias = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    inputs = {"xbr": (x, bias, other), "x": (x,), "xy": (x, other)}[kind]
    act, alpha = elementwise._KERNEL_ARGS[op]
    b = bias if "b" in kind else None
    y = other if kind in ("xbr", "xy") else None
    ref = bias_act_ref(x.double(), b, y, alpha, act)
    arms = elementwise._sweep(op, kind, shape, dtype)()
    assert len(arms) == len(elementwise.SWEEP_TILE_BYTES) * len(elementwise.SWEEP_WARPS)
    for name, fn in arms.items():
        assert name.startswith("triton@") and name.endswith(("/w4", "/w8"))
        out = fn(*inputs)
        assert rel_err(out, ref) <= tolerance(dtype), name


def test_elementwise_sweep_configs_cover_the_tile():
    assert elementwise.sweep_config((1 << 20,), 4, 8192, 4) == {
        "BLOCK_M": 1, "BLOCK_N": 2048, "num_warps": 4,
    }  # fmt: skip
    # 2-D rows: a 16 KiB tile of 512-wide bf16 rows is 16 rows
    assert elementwise.sweep_config((4096, 512), 2, 16384, 8) == {
        "BLOCK_M": 16, "BLOCK_N": 512, "num_warps": 8,
    }  # fmt: skip
    assert elementwise.sweep_config((3, 512), 2, 16384, 8)["BLOCK_M"] == 4  # rows capped


def test_every_elementwise_case_has_a_sweep():
    assert all(c.sweep is not None for c in elementwise.cases(quick=True, cuda=False))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_sweep_arms_are_the_candidates_and_compute_the_layer(dtype, monkeypatch):
    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    case = linear.linear_case(32, 48, 7, dtype, device=DEVICE)
    arms = case.sweep()
    assert arms and all(name.startswith("triton@") for name in arms)
    x, w, b = case.make_inputs()
    ref = case.arms["eager"](x, w, b)
    for name, fn in arms.items():
        assert rel_err(fn(x, w, b), ref) <= tolerance(dtype), name


def test_config_label():
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    assert linear.config_label(cfg) == "64x128x64/w4/s3"
    assert linear.config_label({**cfg, "TMA": True, "OUT_SUB": 2}) == "64x128x64/w4/s3/tma/out_sub2"


def _case(name, sweep):
    return Case(suite="s", name=name, params={}, make_inputs=lambda: (),
                arms={"eager": abs, "triton": abs}, sweep=sweep)  # fmt: skip


def test_with_sweeps_keeps_the_cases_that_have_one_and_adds_their_arms():
    swept = _case("a", lambda: {"triton@1": abs, "triton@2": abs})
    cases = bench.with_sweeps([swept, _case("b", None)], "s")
    assert cases == [swept]
    assert list(swept.arms) == ["eager", "triton", "triton@1", "triton@2"]
    assert bench.sweep_arms(["triton"], cases) == ["triton", "triton@1", "triton@2"]
    assert bench.sweep_arms(["eager"], cases) == ["eager"]
    with pytest.raises(ValueError, match="no selected case of suite s has a sweep"):
        bench.with_sweeps([_case("b", None)], "s")


def test_bench_command_takes_cases_and_sweep(monkeypatch):
    from typer.testing import CliRunner

    from fuseml.apps import cli

    seen = {}
    monkeypatch.setattr(bench, "run_suite", lambda name, **kw: seen.update(kw, name=name))
    result = CliRunner().invoke(cli.app, ["bench", "linear", "--cases", "m4096$", "--sweep"])
    assert result.exit_code == 0, result.output
    assert seen["name"] == "linear" and seen["cases"] == "m4096$" and seen["sweep"] is True


@needs_triton
def test_softmax_sweep_splits_long_rows_at_each_width(monkeypatch):
    from fuseml.bench.suites import softmax

    monkeypatch.setattr(softmax, "MAX_ONCHIP_COLS", 1024)  # small rows past the on-chip width
    x = 3 * torch.randn(3, 5000, device=DEVICE)
    for log in (False, True):
        arms = softmax._sweep(5000, log)()
        assert list(arms) == ["triton@split2048", "triton@split4096"]  # 3 and 2 pieces a row
        ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
        for name, fn in arms.items():
            out = fn(x)
            assert rel_err(out, ref) <= tolerance(x.dtype), name
            assert (out.double() - ref).abs().max() <= 1e-5, name
    assert softmax._sweep(1000, False)() == {}  # on-chip rows: nothing to split


@needs_triton
def test_mlp_sweep_arms_are_the_candidates_and_compute_the_chain(monkeypatch):
    from fuseml.bench.suites import mlp

    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    case = mlp.mlp_case("kaggle-bottom", 6, torch.bfloat16, device=DEVICE)
    arms = case.sweep()
    assert arms and all(name.startswith("triton@") for name in arms)
    x, ws, bs = case.make_inputs()
    ref = case.arms["eager"](x, ws, bs)
    for name, fn in arms.items():
        assert rel_err(fn(x, ws, bs), ref) <= tolerance(torch.bfloat16), name


def test_config_label_names_kinds_and_programs_an_sm():
    from fuseml.bench.suites._common import config_label, unique_name

    chain = {"kind": "chain", "BLOCK_M": 64, "CHUNK": 64, "BLOCK_K": 32, "num_warps": 4,
             "num_stages": 3}  # fmt: skip
    assert config_label(chain) == "chain/64x64x32/w4/s3"
    scratch = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "per_sm": 2}
    assert config_label(scratch) == "32x128x64/w4/p2"
    assert config_label({"kind": "layers"}) == "layers"
    assert unique_name("a", {"a": 1, "a'": 2}) == "a''"


def test_arms_that_no_selected_case_has_are_refused():
    cases = [_case("a", None), Case(suite="s", name="b", params={}, make_inputs=lambda: (),
             arms={"eager": abs}, overhead_arms={"triton-op": abs})]  # fmt: skip
    bench.check_arms(["eager", "triton", "triton-op"], cases, "s")  # each known: no error
    with pytest.raises(ValueError, match=r"arms 'tvm', 'xla' are not an arm of the selected "
                       r"cases of suite s; they have \['eager', 'triton', 'triton-op'\]"):  # fmt: skip
        bench.check_arms(["eager", "tvm", "xla"], cases, "s")
    with pytest.raises(ValueError, match=r"arms 'tvm' is not an arm"):
        bench.check_arms(["tvm"], cases, "s")
    measured = Case(suite="s", name="m", params={}, make_inputs=lambda: (), arms={},
                    measure=lambda settings: {})  # fmt: skip
    bench.check_arms(["tvm"], [measured], "s")  # arms named as the suite measures: unchecked
