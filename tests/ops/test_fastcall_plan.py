"""csrc/fastcall_plan.h on the CPU: the checks in tests/ops/csrc/fastcall_plan_checks.cpp,
built with torch's C++ extension loader (skipped where no C++ compiler, ninja or CUDA
headers are installed: the header names the driver's types)."""

import os
import shutil
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "src" / "fuseml" / "csrc"
CHECKS = Path(__file__).resolve().parent / "csrc" / "fastcall_plan_checks.cpp"


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
