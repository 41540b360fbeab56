"""GPU checks over several GPUs: each xdist worker takes one, round robin."""

import pytest

from gpu_workers import worker_gpu


def test_workers_take_the_gpus_round_robin():
    assert [worker_gpu("0,1,2,3", f"gw{i}") for i in range(6)] == ["0", "1", "2", "3", "0", "1"]
    assert worker_gpu(" 2, 5 ", "gw1") == "5"


def test_no_list_or_no_worker_leaves_the_devices_alone():
    assert worker_gpu("", "gw3") is None
    assert worker_gpu("0,1", "") is None  # the controller, or a run without xdist
    assert worker_gpu("0,1", "master") is None


def test_a_bad_list_is_named():
    with pytest.raises(ValueError, match="CHECK_GPUS"):
        worker_gpu("0,x", "gw0")
