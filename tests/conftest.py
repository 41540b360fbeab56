"""Test setup: on a machine without CUDA, Triton kernels run under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any
fuseml import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
