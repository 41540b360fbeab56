"""csrc/fastcall_plan.h and fastcall_state.h on the CPU: the checks in tests/ops/csrc/,
built with torch's C++ extension loader (skipped where no C++ compiler, ninja or CUDA
headers are installed: the plan header names the driver's types)."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from fuseml import serving

CSRC = Path(__file__).resolve().parents[2] / "src" / "fuseml" / "csrc"
CHECKS = Path(__file__).resolve().parent / "csrc" / "fastcall_plan_checks.cpp"
STATE_CHECKS = Path(__file__).resolve().parent / "csrc" / "fastcall_state_checks.cpp"


def _cuda_include() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda.h").is_file():
            return str(Path(home) / "include")
    return None


def test_padded_copies_and_tma_arguments(tmp_path):
    from torch.utils import cpp_extension

    include = _cuda_include()
    if shutil.which("c++") is None or include is None or not cpp_extension.is_ninja_available():
        pytest.skip("needs a C++ compiler, ninja and the CUDA headers")

    module = cpp_extension.load(
        name="fuseml_fastcall_plan_checks",
        sources=[str(CHECKS)],
        extra_include_paths=[str(CSRC), include],
        extra_cflags=["-O0"],
        build_directory=str(tmp_path),
        with_cuda=False,
        verbose=False,
    )
    assert module.run() == []


@pytest.fixture(scope="module")
def state_module(tmp_path_factory):
    from torch.utils import cpp_extension

    if shutil.which("c++") is None or not cpp_extension.is_ninja_available():
        pytest.skip("needs a C++ compiler and ninja")
    return cpp_extension.load(
        name="fuseml_fastcall_state_checks",
        sources=[str(STATE_CHECKS)],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O0"],
        build_directory=str(tmp_path_factory.mktemp("state")),
        with_cuda=False,
        verbose=False,
    )


def _python_key(module):
    return serving.state_key(module)  # (no fast path on the CPU: the Python key)


@pytest.mark.parametrize("reader", ["cpp", "python"])
def test_state_key_sees_every_change_of_a_modules_state(state_module, reader):
    """The replay key read in C++ (csrc/fastcall_state.h) and in Python change exactly when
    a replayed graph would go stale: a weight written in place, replaced by a tensor of
    another shape (even at a freed one's address), a buffer set, a module replaced; and
    there is none where a slot holds an inference tensor."""

    def key(module):
        if reader == "python":
            return _python_key(module)
        plan = serving._state_plan(module)
        got = state_module.state_key(*plan)
        if got is False:
            got = state_module.state_key(*serving._state_plan(module, listed=True))
        return got

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.BatchNorm1d(3))
    first = key(model)
    assert first is not None and key(model) == first
    with torch.no_grad():
        model[0].weight.add_(1)  # in place: a new version
    second = key(model)
    assert second != first and key(model) == second
    model[0].weight = nn.Parameter(torch.zeros(2, 4))  # another shape
    third = key(model)
    assert third not in (first, second)
    model[0].bias = None  # a slot that holds nothing
    fourth = key(model)
    assert fourth != third and key(model) == fourth
    model[2] = nn.BatchNorm1d(3)  # a module replaced: listed again
    fifth = key(model)
    assert fifth != fourth and key(model) == fifth
    with torch.inference_mode():
        frozen = torch.ones(3)
    model[2].register_buffer("frozen", frozen)
    serving._state_plan(model, listed=True)
    assert key(model) is None


def test_state_key_in_cpp_finds_a_replaced_module(state_module):
    """The C++ key answers False, building nothing, where a module below was replaced since
    the tree was listed; listed again, it keys the new module's tensors."""
    model = nn.Sequential(nn.Linear(4, 3))
    plan = serving._state_plan(model)
    before = state_module.state_key(*plan)
    model[0] = nn.Linear(4, 3)
    assert state_module.state_key(*plan) is False
    after = state_module.state_key(*serving._state_plan(model, listed=True))
    assert isinstance(after, bytes) and after != before
