"""``fuseml.optimize`` on a GPU with tuning on, as users run it: whole models against the
eager model and its float64 twin, at batches that reach the distinct tuned paths.

Models: every DLRM named config (bf16, float32 with TF32 off; small tables), the DLRM MLPs
of the ``mlp`` bench suite, a peft LoRA MLP (4096 wide) and a multi-adapter LoRA layer.
Each goes through the stages a user's calls do, in one process with an empty tuning cache
(``fresh_tuning``):

  first   the first call, which tunes every layer (a padded weight derived during the
          tuner's compile-only pass was once kept here and gave wrong predictions)
  repeat  the second call: bit-identical to the first
  warm    the tuning memo dropped, the on-disk table kept (a new process): within the
          tolerance, no new tuning, and bit-identical to the first (same configs)
  graph   the forward captured in a CUDA graph after an eager warm-up on a side stream
          (nothing may be first met inside the capture), its output poisoned with NaN
          before each replay; replayed on the captured inputs, then on new ones copied in

Every output is compared with the float64 reference and with the eager model's output
(the table's tolerance on the relative error norm), and no row may be far off where the
norm over the batch would hide it (see ``_check``).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import fuseml
from fuseml.bench.suites.mlp import MLPS
from fuseml.models.dlrm import CONFIG_NAMES
from fuseml.nn import FusedDLRM, FusedMLP, LoRALinear
from fuseml.ops import _tune
from fuseml.runtime import tf32_matmuls
from fuseml.testing import (
    assert_close_verbose,
    capture_graph,
    replay_poisoned,
    requires_cuda,
    tolerance,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

# A row's error against the reference, over the rows' rms norm, may be at most this many
# times the table's tolerance: correct rows stay within a few times the whole batch's
# relative error, a wrong or unwritten row is off by about its own norm (~1).
ROW_FACTOR = 10

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_slow = pytest.mark.slow


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 through fp32-accurate dots, in the fused kernels and in torch's matmuls."""
    with tf32_matmuls(False):
        yield


# ------------------------------------------------------------------------------ checks
def _double(inputs: tuple) -> tuple:
    """The floating inputs in float64 (ids stay integers)."""
    return tuple(t.double() if t.is_floating_point() else t for t in inputs)


def _worst_row(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows of ||out_r - ref_r||, over the rms of the rows' norms ||ref_r||."""
    out64 = out.detach().double().reshape(out.shape[0], -1)
    ref64 = ref.detach().double().reshape(ref.shape[0], -1)
    diff = torch.linalg.vector_norm(out64 - ref64, dim=1).nan_to_num(nan=float("inf"))
    scale = torch.linalg.vector_norm(ref64) / out64.shape[0] ** 0.5
    return float(diff.max() / scale) if scale > 0 else float(diff.max())


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``out`` within the tolerance table's bound of ``ref`` (relative error norm; NaN never
    passes), and its worst row within ROW_FACTOR times that of the rows' scale."""
    try:
        assert_close_verbose(out, ref, dtype)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None
    worst, bound = _worst_row(out, ref), ROW_FACTOR * tolerance(dtype)
    assert worst <= bound, (
        f"{what}: worst row off by {worst:.3e} of the rows' rms norm (> {bound:.1e}): a few "
        "wrong rows that the batch's error norm hides"
    )


def _check_both(out, expected: tuple, dtype: torch.dtype, what: str) -> None:
    ref64, eager = expected
    _check(out, ref64, dtype, f"{what}, against the float64 reference")
    _check(out, eager, dtype, f"{what}, against the eager model")


def _check_equal(out: torch.Tensor, first: torch.Tensor, what: str) -> None:
    if torch.equal(out, first):
        return
    differ = out != first
    worst = (out.double() - first.double()).abs().nan_to_num(nan=float("inf")).max()
    raise AssertionError(
        f"{what}: not bit-identical to the first call: {int(differ.sum())} of {out.numel()} "
        f"elements differ, by up to {float(worst):.3e}"
    )


def _tuned_entries() -> int:
    """Entries in the tuning table(s) of this test's cache folder (``fresh_tuning``)."""
    return _tune.entry_count()[0]


# ------------------------------------------------------------------------------ stages
def _check_stages(
    label: str,
    fused,
    eager,
    ref64,
    inputs: tuple,
    new_inputs: tuple,
    dtype: torch.dtype,
    monkeypatch,
    *,
    graph: bool = True,
) -> None:
    """First / repeat / warm-cache calls of ``fused(*inputs)`` and, with ``graph``, its CUDA
    graph (see the module docstring). ``eager`` and ``ref64`` are the model and its
    float64 copy (``ref64`` is given the floating inputs in float64)."""
    with torch.no_grad():
        expected = (ref64(*_double(inputs)), eager(*inputs))

        first = fused(*inputs)
        _check_both(first, expected, dtype, f"{label}, first (tuning) call")
        entries = _tuned_entries()
        assert entries > 0, (
            f"{label}, first (tuning) call: nothing was tuned (is tuning on? FUSEML_AUTOTUNE)"
        )

        _check_equal(fused(*inputs), first, f"{label}, repeat call")

        # A new process: nothing remembered, the table read back from disk.
        monkeypatch.setattr(_tune, "_memo", {})
        monkeypatch.setattr(_tune, "_tables", {})
        warm = fused(*inputs)
        _check_both(warm, expected, dtype, f"{label}, warm-cache call")
        assert _tuned_entries() == entries, (
            f"{label}, warm-cache call: tuned again ({entries} -> {_tuned_entries()} entries): "
            "the first call's choices were not all found in the table"
        )
        _check_equal(warm, first, f"{label}, warm-cache call")

        if graph:
            new_expected = (ref64(*_double(new_inputs)), eager(*new_inputs))
            _check_graph(
                label, fused, inputs, new_inputs, expected, new_expected, dtype, monkeypatch
            )


def _check_graph(
    label, fused, inputs, new_inputs, expected, new_expected, dtype, monkeypatch
) -> None:
    """Capture ``fused`` on static copies of the inputs as the PyTorch docs do (warm-up on
    a side stream first), then replay with the output poisoned: on the same inputs, then
    on ``new_inputs`` copied into the static ones."""
    static = tuple(t.clone() for t in inputs)
    monkeypatch.setattr(_tune, "_capture_misses", set())
    g, out = capture_graph(lambda: fused(*static), warmup=3)
    assert not _tune._capture_misses, (
        f"{label}, graph capture: first met inside the capture, so run untuned: "
        f"{sorted(_tune._capture_misses)}"
    )
    try:
        _check_both(replay_poisoned(g, out), expected, dtype, f"{label}, graph replay")
        for t, new in zip(static, new_inputs, strict=True):
            t.copy_(new)
        _check_both(
            replay_poisoned(g, out), new_expected, dtype, f"{label}, graph replay on new inputs"
        )
    finally:
        del g


# -------------------------------------------------------------------------------- DLRM
DLRM_BATCHES = [
    pytest.param(64, id="b64"),  # below linear.PAD_K_MIN_M: the top MLP's K as is
    pytest.param(4096, id="b4096"),  # padded K; the MLPs' small-batch candidates
    pytest.param(16384, id="b16384", marks=_slow),  # above mlp.SMALL_BATCH: large-batch ones
]


def _dlrm(config: str, dtype: torch.dtype):
    from fuseml.models.dlrm import DLRM, DLRMConfig

    cfg = DLRMConfig.from_name(config, max_cardinality=10_000)
    with torch.device("cuda"):
        model = DLRM(cfg)
    model = model.to(dtype).eval()
    # The id check syncs with the host (no capture); the random ids are valid.
    model.embeddings.check_ids = False
    return cfg, model


@pytest.mark.parametrize("batch", DLRM_BATCHES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_optimized_dlrm_tuned_gpu(config, dtype, batch, fresh_tuning, monkeypatch):
    """Every named DLRM: click probabilities of the optimized model, stage by stage."""
    from fuseml.models.bench_cases import random_inputs

    cfg, model = _dlrm(config, dtype)
    fused, report = fuseml.optimize(model)
    label = f"DLRM {config} {DTYPE_NAMES[dtype]} B={batch}"
    assert type(fused) is FusedDLRM, f"{label}: the DLRM itself was not swapped:\n{report}"
    for part in ("bottom_mlp", "top_mlp"):  # one FusedMLP, or every Linear a FusedLinear
        mlp = getattr(fused, part)
        assert isinstance(mlp, FusedMLP) or not any(type(m) is nn.Linear for m in mlp), (
            f"{label}: {part} was not swapped:\n{report}"
        )
    inputs = random_inputs(cfg, batch, "cuda", dtype, seed=1)
    new_inputs = random_inputs(cfg, batch, "cuda", dtype, seed=2)
    model64 = copy.deepcopy(model).double()
    _check_stages(label, fused, model, model64, inputs, new_inputs, dtype, monkeypatch)


# --------------------------------------------------------------------------------- MLP
_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def _sequential(widths, activations) -> nn.Sequential:
    layers: list[nn.Module] = []
    for (n_in, n_out), act in zip(itertools.pairwise(widths), activations, strict=True):
        layers += [nn.Linear(n_in, n_out), _ACTIVATIONS[act]()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(256, id="b256"),
        pytest.param(4096, id="b4096"),
        pytest.param(16384, id="b16384", marks=_slow),
    ],
)
@pytest.mark.parametrize("name", list(MLPS))
def test_optimized_bench_mlp_tuned_gpu(name, batch, fresh_tuning, monkeypatch):
    """The mlp suite's DLRM MLPs as nn.Sequential(Linear, activation, ...), bf16."""
    widths, activations = MLPS[name]
    dtype = torch.bfloat16
    model = _sequential(widths, activations).to("cuda", dtype).eval()
    fused, report = fuseml.optimize(model)
    label = f"MLP {name} bf16 B={batch}"
    assert isinstance(fused, FusedMLP) or not any(type(m) is nn.Linear for m in fused), (
        f"{label}: not swapped:\n{report}"
    )
    inputs = (torch.randn(batch, widths[0], device="cuda", dtype=dtype),)
    new_inputs = (torch.randn(batch, widths[0], device="cuda", dtype=dtype),)
    model64 = copy.deepcopy(model).double()
    _check_stages(label, fused, model, model64, inputs, new_inputs, dtype, monkeypatch)


# -------------------------------------------------------------------------------- LoRA
LORA_HIDDEN = 4096
LORA_RANK = 16
LORA_B_STD = 0.05  # peft starts B at 0; drawn so, the adapters move the output by ~60%


def _randomize_lora_b(pm) -> None:
    """peft starts lora_B at zero: draw it so that the adapters change the output."""
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, LORA_B_STD)


def _lora_mlp(peft):
    """A 4096-wide MLP (3 Linear layers, GELU between) with a LoRA adapter on every Linear,
    built as users do: peft on the float32 model, then the whole model cast to bf16 (peft
    keeps adapters of a bf16 base in float32, autocast_adapter_dtype, and fuseml.optimize
    leaves layers whose adapter and base dtypes differ)."""
    h = LORA_HIDDEN
    with torch.device("cuda"):
        model = nn.Sequential(
            nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h)
        )
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=["0", "2", "4"])
    pm = peft.get_peft_model(model, config)
    _randomize_lora_b(pm)
    return pm.to(torch.bfloat16).eval()


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(16, id="b16"),  # decode-like rows: in-loop LoRA, the modes tuned
        pytest.param(512, id="b512"),
        pytest.param(4096, id="b4096", marks=_slow),  # above IN_LOOP_MAX_M: shrink + expand
    ],
)
def test_optimized_peft_lora_mlp_tuned_gpu(batch, fresh_tuning, monkeypatch):
    """The LoRA bench model through peft: every Linear a LoRALinear, stage by stage."""
    peft = pytest.importorskip("peft")
    pm = _lora_mlp(peft)
    fused, report = fuseml.optimize(pm)
    label = f"peft LoRA MLP {LORA_HIDDEN} r={LORA_RANK} bf16 B={batch}"
    assert report.swapped, f"{label}: nothing swapped:\n{report}"
    swapped = [m for m in fused.modules() if type(m) is LoRALinear]
    assert len(swapped) == 3 and [m.activation for m in swapped] == ["gelu", "gelu", None], (
        f"{label}: expected 3 LoRALinear layers (GELU folded into the first two):\n{report}"
    )
    dtype = torch.bfloat16
    inputs = (torch.randn(batch, LORA_HIDDEN, device="cuda", dtype=dtype),)
    new_inputs = (torch.randn(batch, LORA_HIDDEN, device="cuda", dtype=dtype),)
    pm64 = copy.deepcopy(pm).double()
    _check_stages(label, fused, pm, pm64, inputs, new_inputs, dtype, monkeypatch)


# Adapter names and lora_alpha (rank 16 each: scalings 2, 1, 4, 0.5).
MULTI_ADAPTERS = {"default": 32, "second": 16, "third": 64, "fourth": 8}


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(256, id="b256"),  # in-loop LoRA (4 x rank 16 = 64 stacked columns)
        pytest.param(4096, id="b4096", marks=_slow),  # shrink + expand / joint, tuned
    ],
)
def test_optimized_peft_multi_adapter_tuned_gpu(batch, fresh_tuning, monkeypatch):
    """A 4096 x 4096 peft layer with 4 adapters, one mixed batch (adapter per row, -1 for
    the base layer alone) against peft's mixed-batch forward (``adapter_names``).

    No CUDA-graph stage: ``LoRALinear(x, adapter_ids)`` checks the ids' range with a host
    sync on every call (no way to skip it), which a capture refuses."""
    peft = pytest.importorskip("peft")
    h = LORA_HIDDEN
    with torch.device("cuda"):
        model = nn.Sequential(nn.Linear(h, h))
    names = list(MULTI_ADAPTERS)
    pm = peft.get_peft_model(
        model,
        peft.LoraConfig(r=LORA_RANK, lora_alpha=MULTI_ADAPTERS[names[0]], target_modules=["0"]),
    )
    for name in names[1:]:
        pm.add_adapter(
            name,
            peft.LoraConfig(r=LORA_RANK, lora_alpha=MULTI_ADAPTERS[name], target_modules=["0"]),
        )
    _randomize_lora_b(pm)
    pm = pm.to(torch.bfloat16).eval()
    fused, report = fuseml.optimize(pm)
    label = f"peft LoRA layer {h} x {h}, {len(names)} adapters r={LORA_RANK} bf16 B={batch}"
    layer = fused.base_model.model[0]
    assert type(layer) is LoRALinear and layer.adapters == names, (
        f"{label}: not swapped with its adapters:\n{report}"
    )
    peft_layer = pm.base_model.model[0]
    peft_layer64 = copy.deepcopy(peft_layer).double()

    def by_name(ids: torch.Tensor) -> list[str]:
        return [names[i] if i >= 0 else "__base__" for i in ids.tolist()]

    def ids_for(n: int) -> torch.Tensor:
        ids = torch.randint(-1, len(names), (n,), device="cuda")
        ids[: len(names) + 1] = torch.arange(-1, len(names), device="cuda")  # each one once
        return ids

    dtype = torch.bfloat16
    inputs = (torch.randn(batch, h, device="cuda", dtype=dtype), ids_for(batch))
    new_inputs = (torch.randn(batch, h, device="cuda", dtype=dtype), ids_for(batch))
    _check_stages(
        label,
        layer,
        lambda x, ids: peft_layer(x, adapter_names=by_name(ids)),
        lambda x, ids: peft_layer64(x, adapter_names=by_name(ids)),
        inputs,
        new_inputs,
        dtype,
        monkeypatch,
        graph=False,
    )
