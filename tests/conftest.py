"""Test setup: on a machine without CUDA, Triton kernels run under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any
fuseml import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GEMM configs are not tuned per test shape (minutes of compiling on a GPU): tests run the
# default config, every candidate config has its own correctness test, and the tuning
# path is tested where it is switched back on.
os.environ.setdefault("FUSEML_AUTOTUNE", "0")

import pytest


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
