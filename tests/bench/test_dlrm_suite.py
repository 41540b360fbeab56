from types import SimpleNamespace as NS

import torch

from fuseml.bench.suites.dlrm import stage_kernel_us
from fuseml.models.bench_cases import random_inputs
from fuseml.models.dlrm import DLRMConfig

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
