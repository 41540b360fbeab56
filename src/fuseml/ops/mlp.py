"""``fuseml.ops.mlp``: a chain of linear layers (+ bias, activation) in one launch.

    h_0 = x;  h_{i+1} = act_i(h_i @ W_i^T + b_i);  out = h_L

Unfused, each layer is a GEMM plus an epilogue kernel and writes its (M, width)
activation to memory, which the next layer reads back. For the DLRM MLPs (widths up to
1024, batch up to 65536) that traffic and the launch count dominate. Two fused kernels:

- the chain kernel (16-bit inputs; every width after layer 1 at most 256): a program owns
  BLOCK_M rows and keeps every intermediate in registers. Layer 0's output is computed
  CHUNK columns at a time and each chunk is at once multiplied into layer 1's
  accumulator as its next K step, so layer 0 may be up to 1024 wide; later layers take
  their whole input from registers. The DLRM bottom MLPs (13-512-256-64-16) run this way.
- the scratch kernel (any chain up to 1024 wide): a persistent program runs every layer
  on BLOCK_M rows at a time, a layer's output going to a per-program scratch block of
  BLOCK_M x max-width (2 buffers) that stays in L2 and is reused for the next rows.

Each layer is rounded to the input dtype, exactly as the unfused chain rounds it. Which
kernel and tile runs is measured per shape bucket (``fuseml.ops._tune``); where the input
is wide enough that layer 0 is a real GEMM (which every row block would redo over all of
W0), tuning also times the layers one by one through ``fuseml.ops.linear`` (not fused:
each layer's epilogue is), which can win for the DLRM top MLPs (docs/performance/mlp.md).

Up to ``MAX_FUSED_LAYERS`` layers per launch (longer chains: several launches) and widths
up to ``MAX_WIDTH``; wider layers run one by one through ``fuseml.ops.linear``, said once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fuseml.ops import _elementwise as ew
from fuseml.ops._mlp_plan import _group_config, _run_group, _run_layers, _say_layers
from fuseml.ops._utils import (
    PLAIN_TENSORS,
    check_choice,
    check_same,
    check_tensor,
    compiled,
    fused_op,
    needs_dispatch,
)
from fuseml.ops.bias_act import activation_ref
from fuseml.runtime import FLOAT_DTYPES

log = logging.getLogger("fuseml")

MAX_WIDTH = 1024
MAX_FUSED_LAYERS = 8


def mlp_ref(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    activations: Sequence[str],
) -> torch.Tensor:
    """Reference: one F.linear and one activation per layer."""
    h = x
    for w, b, act in zip(weights, biases, activations):
        h = activation_ref(F.linear(h, w, b), act)
    return h


@functools.cache
def _warn_unfused(widths: tuple, max_width: int) -> None:
    log.warning(
        "fuseml.ops.mlp: a layer wider than %d (widths %s) runs layer by layer through "
        "fuseml.ops.linear (same result, not fused)",
        max_width,
        widths,
    )


def mlp_rows(
    x, weights, biases, codes, *, traced: bool = False, max_width: int = MAX_WIDTH
) -> torch.Tensor:
    """The chain for validated inputs; x (..., D0) -> (..., D_L). Chains with a layer
    wider than ``max_width`` (at most MAX_WIDTH) run layer by layer."""
    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    h = x.reshape(-1, x.shape[-1])
    if h.shape[1] > 1 and h.stride(1) != 1:
        h = h.contiguous()
    if max(widths) > max_width:
        _warn_unfused(widths, max_width)
        h = _run_layers(h, weights, biases, codes, traced)
        return h.view(*x.shape[:-1], widths[-1])
    for g in range(0, len(weights), MAX_FUSED_LAYERS):
        ws = weights[g : g + MAX_FUSED_LAYERS]
        bs = biases[g : g + MAX_FUSED_LAYERS]
        cs = codes[g : g + MAX_FUSED_LAYERS]
        cfg = _group_config(h, ws, bs, cs, traced)
        if cfg.get("kind") == "layers":
            _say_layers(tuple(int(d) for d in widths[g : g + len(ws) + 1]), h.dtype)
        h = _run_group(h, ws, bs, cs, cfg, traced)
    return h.view(*x.shape[:-1], widths[-1])


# ------------------------------------------------------------------------ registration
@fused_op("fuseml::mlp", mutates_args=())
def _mlp_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    codes: list[int],
) -> torch.Tensor:
    """codes: activation codes (fuseml.ops._elementwise.ACT_CODE), one per layer."""
    return mlp_rows(x, weights, biases, codes, traced=True)


# ---------------------------------------------------------------------------- public
def _valid_mlp_args(x, weights, biases, activations):
    """normalize_mlp_args's result when every argument is plainly valid (one pass, no
    messages: the per-call fast path), else None (the full check then names the error)."""
    if type(x) not in PLAIN_TENSORS or not isinstance(weights, (list, tuple)) or not weights:
        return None
    n = len(weights)
    if biases is None:
        biases = [None] * n
    elif not isinstance(biases, (list, tuple)) or len(biases) != n:
        return None
    if activations is None or type(activations) is str:
        acts = ["none" if activations is None else activations] * n
    elif isinstance(activations, (list, tuple)) and len(activations) == n:
        acts = ["none" if a is None else a for a in activations]
    else:
        return None
    if not all(type(a) is str and a in ew.ACT_CODE for a in acts):
        return None
    dt, dev = x.dtype, x.device
    if dt not in FLOAT_DTYPES or x.dim() < 1:
        return None
    width = x.shape[-1]
    for w, b in zip(weights, biases):
        if type(w) not in PLAIN_TENSORS or w.dtype != dt or w.device != dev or w.dim() != 2:
            return None
        out_w, in_w = w.shape
        if in_w != width:
            return None
        width = out_w
        if b is not None and (
            type(b) not in PLAIN_TENSORS or b.dtype != dt or b.device != dev or b.shape != (width,)
        ):
            return None
    return list(weights), list(biases), acts


def normalize_mlp_args(op, x, weights, biases, activations):
    """Validate; return (weights list, biases list, activation names list)."""
    valid = _valid_mlp_args(x, weights, biases, activations)
    if valid is not None:
        return valid
    check_tensor(op, "x", x)
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence) or not weights:
        raise TypeError(f"{op}: weights must be a non-empty list of (out, in) tensors")
    weights = list(weights)
    n = len(weights)
    biases = [None] * n if biases is None else list(biases)
    if len(biases) != n:
        raise ValueError(
            f"{op}: biases must have one entry (tensor or None) per layer ({n}), got {len(biases)}"
        )
    if activations is None or isinstance(activations, str):
        activations = [activations] * n
    activations = ["none" if a is None else a for a in activations]
    if len(activations) != n:
        raise ValueError(
            f"{op}: activations must be one name or one per layer ({n}), got {len(activations)}"
        )
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim (..., in_features), got 0-d")
    width = x.shape[-1]
    for i, (w, b, a) in enumerate(zip(weights, biases, activations)):
        check_tensor(op, f"weights[{i}]", w)
        check_same(op, "x", x, f"weights[{i}]", w)
        if w.dim() != 2 or w.shape[1] != width:
            raise ValueError(
                f"{op}: weights[{i}] must be (out, {width}) (its input is "
                f"{'x' if i == 0 else f'layer {i - 1}'} of width {width}), got {tuple(w.shape)}"
            )
        if b is not None:
            check_tensor(op, f"biases[{i}]", b)
            check_same(op, "x", x, f"biases[{i}]", b)
            if tuple(b.shape) != (w.shape[0],):
                raise ValueError(
                    f"{op}: biases[{i}] must have shape ({w.shape[0]},), got {tuple(b.shape)}"
                )
        check_choice(op, f"activations[{i}]", a, ew.ACTIVATIONS)
        width = w.shape[0]
    return weights, biases, activations


def mlp(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    activations: str | Sequence[str | None] | None = "relu",
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """act_L(... act_1(x @ W_1^T + b_1) ...) in one launch (per 8 layers).

    weights: [(D1, D0), (D2, D1), ...] in nn.Linear layout; biases: one tensor or None per
    layer (None: no biases); activations: one name for every layer, or one per layer
    (None meaning 'none'). Widths above 1024 run layer by layer through fuseml.ops.linear.
    """
    from fuseml.runtime import resolve_backend

    op = "mlp"
    weights, biases, activations = normalize_mlp_args(op, x, weights, biases, activations)
    backend = resolve_backend(backend, x.device, op, cuda_twin=False)
    if backend in ("eager", "compile"):
        fn = mlp_ref if backend == "eager" else compiled(mlp_ref)
        return fn(x, weights, biases, activations)
    codes = [ew.ACT_CODE[a] for a in activations]
    if needs_dispatch(x, *weights, *biases):
        return torch.ops.fuseml.mlp(x, weights, biases, codes)
    return mlp_rows(x, weights, biases, codes)
