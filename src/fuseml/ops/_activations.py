"""Activation functions in float32 for Triton kernels, shared by the elementwise epilogue
(ops/_elementwise.py), the GEMM epilogues and the MLP chain: one formula per activation,
with its derivative for the backward.

Callers import ``_activation`` by bare name: torch.compile re-parses user Triton kernels
and resolves helpers through the kernel module's globals.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuseml.ops._math import LOG2E, _exp2, _rcp

# Activation names and their codes; the CUDA twin (csrc/elementwise.cu) uses the same codes.
ACTIVATIONS = ("none", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")
ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
LEAKY_SLOPE = 0.01


# ------------------------------------------------------------------- activation math
# Each formula is written once; FAST (a constexpr, fast_math() of the input: True for
# compiled CUDA launches) picks the instructions of its two primitives (ops/_math.py).
# In 16-bit dtypes erf-GELU moves 4 bytes an element and is compute-bound without FAST
# (35 SASS instructions an element, 76% of copy bandwidth on an H200); with FAST it is
# 23. docs/performance/elementwise.md.


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    # 1 / (1 + e^-x); e^-x = inf for x < -88 gives 0, as it should.
    return _rcp(1.0 + _exp2(x * (-LOG2E), FAST), FAST)


@triton.jit
def _gelu_tanh_gate(h, FAST: tl.constexpr):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u) exactly, u = c (h + k h^3); -2 c log2(e) and
    # -2 c k log2(e) are folded into the two constants.
    v = h * (-2.302208198144325 - 0.1029432395800235 * (h * h))
    return _rcp(1.0 + _exp2(v, FAST), FAST)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    # Triton has no portable tanh (libdevice's is not available under the interpreter).
    # Small |x|: odd minimax polynomial (Cephes tanhf coefficients, ~1 ulp), which avoids the
    # cancellation of 1 - 2/(e^2x + 1) near 0; large |x|: that formula, exact to rounding.
    ax = tl.abs(x)
    z = x * x
    p = (
        (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1)
        * z
        - 3.33332819422e-1
    ) * z * x + x
    big = 1.0 - 2.0 * _rcp(_exp2(ax * (2.0 * LOG2E), FAST) + 1.0, FAST)
    big = tl.where(x < 0.0, -big, big)
    return tl.where(ax < 0.625, p, big)


@triton.jit
def _normal_cdf(h, FAST: tl.constexpr):
    # Phi(h) = 0.5 * erfc(-h / sqrt(2)), with erfc(z) = t * exp(P(t) - z^2), t = 1 / (1 +
    # z / 2), from a Chebyshev fit whose *fractional* error is < 1.2e-7 everywhere
    # (Numerical Recipes' erfcc): one reciprocal, one exp2 and 9 FMAs, where libdevice's
    # erff costs ~25 instructions; and no cancellation in the negative tail, as 1 + erf(x)
    # has. Folded for exp2: w = z * sqrt(log2 e), so 0.5 * erfc(z) = t * 2^(P2(t) - w^2)
    # with P2 = log2(e) * P - 1 (the coefficients below).
    w = tl.abs(h) * 0.8493218002880191
    t = _rcp(1.0 + 0.41627730557884884 * w, FAST)
    p = 0.246517298 * t - 1.18611495
    p = p * t + 2.14747446
    p = p * t - 1.63775315
    p = p * t + 0.402321582
    p = p * t - 0.26875686
    p = p * t + 0.139630057
    p = p * t + 0.539700616
    p = p * t + 1.4427292
    p = p * t - 2.82574822
    half_erfc = t * _exp2(p - w * w, FAST)
    return tl.where(h < 0.0, half_erfc, 1.0 - half_erfc)


@triton.jit
def _activation(h, ACTIVATION: tl.constexpr, FAST: tl.constexpr = False):
    """act(h) for float32 h; ACTIVATION is a code from ACTIVATIONS (branch-free per launch)."""
    if ACTIVATION == 1:  # relu; NaN stays NaN as in torch.relu
        h = tl.where(h < 0.0, 0.0, h)
    elif ACTIVATION == 2:  # leaky_relu, slope 0.01
        h = tl.where(h < 0.0, 0.01 * h, h)
    elif ACTIVATION == 3:  # gelu, erf form: h * Phi(h)
        h = h * _normal_cdf(h, FAST)
    elif ACTIVATION == 4:  # gelu, tanh form
        h = h * _gelu_tanh_gate(h, FAST)
    elif ACTIVATION == 5:  # silu
        h = h * _sigmoid(h, FAST)
    elif ACTIVATION == 6:
        h = _sigmoid(h, FAST)
    elif ACTIVATION == 7:
        h = _tanh(h, FAST)
    return h


@triton.jit
def _activation_grad(h, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """d act / d h at float32 h."""
    if ACTIVATION == 0:
        d = tl.full(h.shape, 1.0, tl.float32)
    elif ACTIVATION == 1:
        d = tl.where(h > 0.0, 1.0, 0.0)
    elif ACTIVATION == 2:
        d = tl.where(h > 0.0, 1.0, 0.01)
    elif ACTIVATION == 3:
        pdf = _exp2(-0.7213475204444817 * h * h, FAST) * 0.3989422804014327
        d = _normal_cdf(h, FAST) + h * pdf
    elif ACTIVATION == 4:
        s = _gelu_tanh_gate(h, FAST)
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
        d = s + 2.0 * h * s * (1.0 - s) * du
    elif ACTIVATION == 5:
        s = _sigmoid(h, FAST)
        d = s * (1.0 + h * (1.0 - s))
    elif ACTIVATION == 6:
        s = _sigmoid(h, FAST)
        d = s * (1.0 - s)
    else:
        t = _tanh(h, FAST)
        d = 1.0 - t * t
    return d
