"""Compile a fuseml Triton kernel for sm_90 on a machine without a GPU: the part the
offline_* scripts share (no timing; imported by them, not run)."""

from __future__ import annotations

import os
from collections.abc import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def compile_sm90(
    kernel,
    consts: dict,
    arg_type: Callable[[str], str],
    divisible: Callable[[str], bool] = lambda name: False,
    **options,
):
    """``kernel`` compiled for sm_90 with ``options`` (num_warps, ...): the arguments named
    in ``consts`` as those constexprs, every other one typed ``arg_type(name)`` (a Triton
    signature type: "*bf16", "i32", "fp32", "tensordesc<bf16[64, 64]>") and marked
    16-divisible where ``divisible(name)``, as the launchers' real arguments are (without
    it pointer accesses compile to scalar loads and stores, which is not what runs)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
            continue
        signature[name] = arg_type(name)
        if divisible(name):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
