"""``fuseml.ops.gelu(x, approximate)``: GELU in one pass, erf or tanh form, with backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuseml.ops import _elementwise as ew
from fuseml.ops import _fastcall
from fuseml.ops._utils import check_choice, check_tensor, compiled, fused_op, needs_dispatch
from fuseml.runtime import resolve_backend

APPROXIMATIONS = ("none", "tanh")


def gelu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Reference: torch's GELU."""
    return F.gelu(x, approximate=approximate)


def _code(approximate: str) -> int:
    return ew.ACT_CODE["gelu" if approximate == "none" else "gelu_tanh"]


_CODES = {a: _code(a) for a in APPROXIMATIONS}


def _forward(x: torch.Tensor, approximate: str, impl: str, traced: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    return ew.bias_act_into(out, x, None, None, 1.0, _code(approximate), impl=impl, traced=traced)


@fused_op("fuseml::gelu", mutates_args=())
def _gelu_op(x: torch.Tensor, approximate: str, impl: str) -> torch.Tensor:
    return _forward(x, approximate, impl, traced=True)


def _gelu_setup(ctx, inputs, output):
    x, approximate, _ = inputs
    ctx.save_for_backward(x)
    ctx.approximate = approximate


def _gelu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    dx = torch.ops.fuseml.bias_act_backward(grad, x, None, None, 1.0, _code(ctx.approximate))
    return dx, None, None


torch.library.register_autograd("fuseml::gelu", _gelu_backward, setup_context=_gelu_setup)


def gelu(x: torch.Tensor, approximate: str = "none", *, backend: str = "auto") -> torch.Tensor:
    """GELU of a float32/float16/bfloat16 tensor of any shape, computed in float32.

    approximate: "none" (exact, erf) or "tanh", as in torch.nn.functional.gelu.
    backend: auto (triton on CUDA tensors, eager otherwise) | eager | compile | triton | cuda.
    """
    fast = _fastcall.loaded()  # a repeat call launched from C++ (see fuseml.ops._fastcall)
    plain = fast is not None and type(x) is torch.Tensor and type(approximate) is str
    call = _fastcall.entry(fast, backend) if plain else None
    if call is not None:
        out = call(_fastcall.ELEMENTWISE, _CODES.get(approximate, -1), x, None, None, 1.0, -1)
        if out is not None:
            return out
    check_tensor("gelu", "x", x)
    check_choice("gelu", "approximate", approximate, APPROXIMATIONS)
    backend = resolve_backend(backend, x.device, "gelu")
    if backend == "eager":
        return gelu_ref(x, approximate)
    if backend == "compile":
        return compiled(gelu_ref)(x, approximate)
    if needs_dispatch(x):
        return torch.ops.fuseml.gelu(x, approximate, backend)
    return _forward(x, approximate, backend, traced=False)
