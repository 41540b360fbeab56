import subprocess
import sys

import pytest
import torch

from fuseml import runtime


def test_import_initialises_no_cuda():
    code = (
        "import torch, fuseml, fuseml.ops\n"
        "assert not torch.cuda.is_initialized(), 'import fuseml initialised CUDA'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert runtime.resolve_backend("auto", cpu, "op") == "eager"
    assert runtime.resolve_backend("eager", cpu, "op") == "eager"
    assert runtime.resolve_backend("compile", cpu, "op") == "compile"
    with pytest.raises(ValueError, match="op: backend must be one of"):
        runtime.resolve_backend("tvm", cpu, "op")
    with pytest.raises(ValueError, match="backend='cuda' is unavailable here"):
        runtime.resolve_backend("cuda", cpu, "op")


def test_gpu_slug():
    assert runtime.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
