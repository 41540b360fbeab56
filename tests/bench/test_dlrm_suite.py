import gc
import weakref
from types import SimpleNamespace as NS

import pytest
import torch

from fuseml.bench.suites import dlrm
from fuseml.bench.suites.dlrm import stage_kernel_us
from fuseml.models.bench_cases import random_inputs
from fuseml.models.dlrm import DLRMConfig
from fuseml.testing import rel_err, tolerance

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, start, end, device=CUDA):
    return NS(name=name, device_type=device, time_range=NS(start=start, end=end))


def test_stage_times_sum_the_kernels_inside_each_gpu_span():
    events = [
        _event("dlrm.bottom_mlp", 0, 10), _event("k1", 1, 3), _event("k2", 4, 9),
        _event("dlrm.top_mlp", 20, 40), _event("k3", 25, 35),
        _event("dlrm.top_mlp", 0, 100, CPU),  # the CPU-side range: not a span
        _event("k4", 50, 51),  # outside every span: no stage's
    ]  # fmt: skip
    assert stage_kernel_us(events, 2) == {"bottom_mlp": 3.5, "top_mlp": 5.0}


def test_zipf_ids_are_skewed_and_inside_their_tables():
    config = DLRMConfig.from_name("kaggle")
    cards = torch.tensor(config.cardinalities)
    _, uniform = random_inputs(config, 20000, ids="uniform")
    _, zipf = random_inputs(config, 20000, ids="zipf")
    assert (zipf >= 0).all() and (zipf < cards).all()
    big = int(cards.argmax())  # 10M rows: uniform ids nearly all distinct, Zipf's not
    assert len(zipf[:, big].unique()) < 0.6 * len(uniform[:, big].unique())


def test_cases_build_one_group_of_models_at_a_time_when_their_arms_are_read():
    """Listing the suite builds no model (``--cases`` builds only the groups it runs); a
    case's arms build its (config, precision, ids) group, and the next group frees it."""
    before = dlrm._groups.key
    listed = list(dlrm.cases(quick=True, device="cpu", max_cardinality=50))
    assert dlrm._groups.key == before
    by_name = {c.name: c for c in listed}
    assert {"kaggle/fp32/bs1", "kaggle/bf16/zipf/bs256", "kaggle/bf16/bs4096/stages"} <= set(
        by_name
    )
    fp32, bf16 = by_name["kaggle/fp32/bs1"], by_name["kaggle/bf16/bs256"]
    assert list(fp32.arms) == ["eager", "compile", "fuseml"]  # (no compiled copy in fp32)
    assert list(bf16.arms) == ["eager", "compile", "fuseml", "fuseml-compile"]
    assert dlrm._groups.key == before and "tf32" not in fp32.arms

    eager, fused = fp32.arms["eager"](), fp32.arms["fuseml"]()
    assert dlrm._groups.key[:3] == ("kaggle", "fp32", "uniform")
    assert eager.shape == fused.shape == (1,)
    assert rel_err(fused, eager) <= tolerance(torch.float32)
    first = weakref.ref(dlrm._groups.built["model"])

    out = bf16.arms["fuseml"]()
    assert dlrm._groups.key[:3] == ("kaggle", "bf16", "uniform") and out.shape == (256,)
    gc.collect()
    assert first() is None  # the fp32 group's model is gone
    with pytest.raises(KeyError):
        fp32.arms["compile-max"]
