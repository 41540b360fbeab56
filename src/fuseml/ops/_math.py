"""Float32 primitives for Triton kernels, in two instruction choices picked by FAST (and
the first statement of a programmatic dependent launch, _pdl_begin).

FAST (a constexpr; ``fast_math(tensor)`` in ops/_utils.py: compiled launches on NVIDIA
GPUs) makes 2^x and 1/x one MUFU instruction each: ``ex2.approx.ftz.f32`` (~2 ulp) and
``rcp.approx.ftz.f32`` (1 ulp), both flushing subnormal results to 0. Without it they are
``tl.exp2`` (the same approximation plus a range fix-up for subnormal results: 4 more
instructions) and a 2-ulp division (7 more). The interpreter has no inline assembly and
runs the FAST=False form of the same formulas.

Callers import these by bare name: torch.compile re-parses user Triton kernels and
resolves helpers through the kernel module's globals.
"""

import torch
import triton
import triton.language as tl

from fuseml.runtime import triton_interpreting

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)

# FAST for the GEMM and MLP epilogues' activations, fixed per process: their launches run on
# NVIDIA GPUs unless Triton's interpreter is on (as fast_math says per tensor). An erf-GELU
# epilogue of a 512 x 4096 -> 4096 layer cost 7 us on an H200 without it.
EPILOGUE_FAST = tl.constexpr(not triton_interpreting() and torch.version.hip is None)


@triton.jit
def _ptx_f32(x, INSTR: tl.constexpr):
    """One PTX instruction of one float32 operand: INSTR as "ex2.approx.ftz.f32"."""
    return tl.inline_asm_elementwise(
        INSTR + " $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """2 ** x for float32 x."""
    if FAST:
        y = _ptx_f32(x, "ex2.approx.ftz.f32")
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _rcp(x, FAST: tl.constexpr):
    """1 / x for float32 x."""
    if FAST:
        y = _ptx_f32(x, "rcp.approx.ftz.f32")
    else:
        y = 1.0 / x
    return y


@triton.jit
def _pdl_begin():
    """First statement of a kernel launched with programmatic dependent launch (see
    ``pdl_launch`` in ops/_utils.py): wait until every grid before it on the stream has
    completed and its writes are visible, then let the next PDL launch begin. Nothing may
    touch global memory before it."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
