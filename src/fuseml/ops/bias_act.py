"""``fuseml.ops.bias_act``: activation(x + bias + alpha * residual) in one pass.

The epilogue that follows a matmul (bias), a LoRA branch (scaled residual) and an
activation. Unfused, torch reads and writes the tensor once per step (3-4 kernels); fused,
each input is read once and the output written once.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from fuseml.ops import _elementwise as ew
from fuseml.ops import _fastcall
from fuseml.ops._utils import (
    PLAIN_TENSORS,
    REAL_NUMBERS,
    check_choice,
    check_same,
    check_shape,
    check_tensor,
    compiled,
    fused_op,
    needs_dispatch,
)
from fuseml.runtime import resolve_backend

ACTIVATIONS = ew.ACTIVATIONS

_ACT_REF = {
    "none": lambda h: h,
    "relu": torch.relu,
    "leaky_relu": lambda h: F.leaky_relu(h, ew.LEAKY_SLOPE),
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def activation_ref(h: torch.Tensor, activation: str) -> torch.Tensor:
    return _ACT_REF[activation](h)


def bias_act_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    alpha: float = 1.0,
    activation: str = "relu",
) -> torch.Tensor:
    """Reference: the unfused torch chain, one kernel per step."""
    h = x if bias is None else x + bias
    if residual is not None:
        h = h + alpha * residual
    return _ACT_REF[activation](h)


# ------------------------------------------------------------------------ registration
@fused_op("fuseml::bias_act", mutates_args=())
def _bias_act_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    activation: str,
    impl: str,
) -> torch.Tensor:
    out = torch.empty_like(x)
    code = ew.ACT_CODE[activation]
    return ew.bias_act_into(out, x, residual, bias, alpha, code, impl=impl, traced=True)


@fused_op("fuseml::bias_act_out", mutates_args=("out",))
def _bias_act_out_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    activation: str,
    impl: str,
    out: torch.Tensor,
) -> None:
    code = ew.ACT_CODE[activation]
    ew.bias_act_into(out, x, residual, bias, alpha, code, impl=impl, traced=True)


@fused_op("fuseml::bias_act_backward", mutates_args=())
def _bias_act_backward_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    activation: int,
) -> torch.Tensor:
    """grad * act'(x + bias + alpha * residual): the gradient w.r.t. the pre-activation."""
    return ew.bias_act_backward_rows(grad, x, residual, bias, alpha, activation, traced=True)


def _setup(ctx, inputs, output):
    x, bias, residual, alpha, activation, _ = inputs
    ctx.save_for_backward(x, bias, residual)
    ctx.alpha = alpha
    ctx.code = ew.ACT_CODE[activation]


def _backward(ctx, grad):
    x, bias, residual = ctx.saved_tensors
    dh = torch.ops.fuseml.bias_act_backward(grad, x, bias, residual, ctx.alpha, ctx.code)
    dx = dh if ctx.needs_input_grad[0] else None
    dbias = None
    if bias is not None and ctx.needs_input_grad[1]:
        # Sum over all leading dims in float32, then round once.
        dbias = dh.reshape(-1, dh.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
    dres = dh * ctx.alpha if residual is not None and ctx.needs_input_grad[2] else None
    return dx, dbias, dres, None, None, None


torch.library.register_autograd("fuseml::bias_act", _backward, setup_context=_setup)


# ---------------------------------------------------------------------------- public
def _validate(x, bias, residual, alpha, activation, out) -> float:
    op = "bias_act"
    check_tensor(op, "x", x)
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_same(op, "x", x, "bias", bias)
        if x.dim() == 0:
            raise ValueError(f"{op}: x must have at least 1 dim when a bias is given, got 0-d")
        check_shape(op, "bias", bias, (x.shape[-1],), "the last dim of x")
    if residual is not None:
        check_tensor(op, "residual", residual)
        check_same(op, "x", x, "residual", residual)
        check_shape(op, "residual", residual, x.shape, "the shape of x")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{op}: alpha must be a real number, got {type(alpha).__name__}")
    check_choice(op, "activation", activation, ACTIVATIONS)
    if out is not None:
        check_tensor(op, "out", out)
        check_same(op, "x", x, "out", out)
        check_shape(op, "out", out, x.shape, "the shape of x")
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, bias, residual, out)
        ):
            raise RuntimeError(
                f"{op}: out= does not support autograd; call without out= to get gradients"
            )
    return float(alpha)


_CODES = {a: ew.ACT_CODE[a] for a in ACTIVATIONS}


def bias_act(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    alpha: float = 1.0,
    activation: str = "relu",
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """activation(x + bias + alpha * residual), computed in float32 and rounded once.

    x: (..., N) float32/float16/bfloat16; bias: (N,) or None, broadcast over leading dims;
    residual: like x, or None; activation: one of ACTIVATIONS (leaky_relu slope 0.01).
    out: write the result there (``out=x`` works in place); returned.
    backend: auto (triton on CUDA tensors, eager otherwise) | eager | compile | triton | cuda.
    """
    fast = _fastcall.loaded()  # a repeat call launched from C++ (see fuseml.ops._fastcall)
    plain = (
        fast is not None
        and out is None
        and type(x) is torch.Tensor
        and (bias is None or type(bias) in PLAIN_TENSORS)
        and (residual is None or type(residual) in PLAIN_TENSORS)
        and type(alpha) in REAL_NUMBERS
        and type(activation) is str
    )
    call = _fastcall.entry(fast, backend) if plain else None
    if call is not None:
        code = _CODES.get(activation, -1)
        result = call(_fastcall.ELEMENTWISE, code, x, residual, bias, alpha, -1)
        if result is not None:
            return result
    alpha = _validate(x, bias, residual, alpha, activation, out)
    backend = resolve_backend(backend, x.device, "bias_act")
    if backend in ("eager", "compile"):
        fn = bias_act_ref if backend == "eager" else compiled(bias_act_ref)
        result = fn(x, bias, residual, alpha, activation)
        return result if out is None else out.copy_(result)
    if out is not None:
        if needs_dispatch(x, bias, residual, out):
            torch.ops.fuseml.bias_act_out(x, bias, residual, alpha, activation, backend, out)
            return out
        code = ew.ACT_CODE[activation]
        return ew.bias_act_into(out, x, residual, bias, alpha, code, impl=backend)
    if needs_dispatch(x, bias, residual):
        return torch.ops.fuseml.bias_act(x, bias, residual, alpha, activation, backend)
    out = torch.empty_like(x)
    code = ew.ACT_CODE[activation]
    return ew.bias_act_into(out, x, residual, bias, alpha, code, impl=backend)
