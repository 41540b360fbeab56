"""``fuseml.ops.lora_linear``: a LoRA-adapted linear layer, unmerged, in one GEMM.

    out = act(x @ W^T + bias + scaling * (x @ A^T) @ B^T)        peft layouts: A (r, in),
                                                                  B (out, r)
Unmerged eager (peft) runs three GEMMs and an add: x @ W^T, x @ A^T, (.) @ B^T, each
writing to memory. Merging W' = W + s B A costs nothing per call but fixes one adapter
per weight copy. The fused kernel keeps the adapter separate and adds the rank-r term to
the GEMM's accumulator tiles (see ``fuseml.ops.gemm`` for the LoRA modes).

Multi-adapter: ``lora_a`` (adapters, r, in), ``lora_b`` (adapters, out, r) and an
``adapter_ids`` tensor giving each row's adapter (-1: base weight only). One launch
serves a mixed batch; the adapters are stacked along r so each row keeps its own columns.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fuseml.ops import _elementwise as ew
from fuseml.ops import _fastcall
from fuseml.ops._lora_adapters import (
    _scale_list,
    check_adapter_ids,
    check_adapter_ids_tensor,
    device_scales,
    stack_adapters,
)
from fuseml.ops._lora_modes import (
    Force,
    _expand_tma,
    _joint_ok,
    _run_mode,
    _spread_ok,
    _tuned_mode,
    main_loop,
)
from fuseml.ops._utils import (
    PLAIN_TENSORS,
    REAL_NUMBERS,
    check_same,
    check_tensor,
    compiled,
    fused_op,
    needs_dispatch,
    next_pow2,
)
from fuseml.ops.bias_act import activation_ref
from fuseml.ops.gemm import launch as _gemm
from fuseml.ops.gemm.lora_modes import reserve_joint_flags
from fuseml.ops.linear import _CODES, check_linear_args
from fuseml.runtime import resolve_backend

# In-loop LoRA (one launch) up to this many rows; above, x @ A^T is precomputed by a first
# small launch so the main GEMM does not redo it for every column tile (see _gemm). A first
# guess, not a measured crossover: the fused layer costs ~1% over the plain GEMM on both
# sides of it (docs/performance/lora.md).
IN_LOOP_MAX_M = 1024
IN_LOOP_MAX_R = 64  # stacked LoRA columns that fit beside the accumulator in registers

# Stacked columns of the expand mode (extra K steps of 64 through descriptors): 16 adapters
# of rank 16 cost 1.17x one adapter's layer (docs/performance/lora.md).
EXPAND_MAX_R = 256
# Rows up to which the functional op reads a multi-adapter B in place; above, the stacked
# copy (~4 us) costs less than the slower kernels that reading B in place takes
# (docs/performance/lora.md).
B3D_MAX_M = 1024
# Eager (uncaptured) one-adapter calls up to this many rows repeat from C++
# (fuseml.ops._fastcall): ~10 us of host time against ~90-130 through Python. They run
# in-loop on the pointer kernel where that is the tuned mode, else the joint launch; from
# 1024 rows the pointer kernel falls behind. Captured calls keep the tuned mode
# (docs/performance/host.md).
FAST_MAX_M = 512


@dataclass(frozen=True)
class LoraPath:
    """Forces parts of the fused layer's launch choice (tests, benchmarks of one path);
    each field left at its default takes the normal choice.

    loop: "tma" or "ptr" forces the GEMM's main loop ("tma" where the layout allows it).
    overlap: whether the shrink and expand launches may overlap (programmatic dependent
    launch); None: where the device and settings allow it. capture: whether the call
    counts as captured into a CUDA graph; None: asks torch. mode: the LoRA mode
    (fuseml.ops.gemm.LORA_*) taken wherever the mode is tuned, instead of timing them;
    LORA_JOINT and LORA_SPREAD fall back to LORA_EXPAND where they cannot run.
    in_loop_max_m: rows up to which the one-launch small-batch modes apply. b3d_max_m:
    rows up to which ``lora_linear`` reads a multi-adapter B in place (``stack_adapters``).
    config: a GEMM launch config (a candidate of ``fuseml.ops.gemm.candidates``) taken by
    every launch of the layer instead of the tuned ones.
    """

    loop: str = "auto"
    overlap: bool | None = None
    capture: bool | None = None
    mode: int | None = None
    in_loop_max_m: int = IN_LOOP_MAX_M
    b3d_max_m: int = B3D_MAX_M
    config: dict | None = None


_AUTO = LoraPath()


def lora_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling,
    activation: str | None = None,
    adapter_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the unmerged peft chain (multi-adapter: one masked pass per adapter)."""
    h = F.linear(x, weight, bias)
    if adapter_ids is None:
        h = h + F.linear(F.linear(x, lora_a), lora_b) * scaling
    else:
        scales = _scale_list(scaling, lora_a.shape[0])
        for a in range(lora_a.shape[0]):
            sel = adapter_ids == a
            if bool(sel.any()):
                h[sel] = h[sel] + F.linear(F.linear(x[sel], lora_a[a]), lora_b[a]) * scales[a]
    return activation_ref(h, activation or "none")


# ------------------------------------------------------------------------ launcher
def lora_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    rank: int,
    scaling: float,
    scales: torch.Tensor | None,
    adapter_ids: torch.Tensor | None,
    code: int,
    *,
    traced: bool = False,
    path: LoraPath | None = None,
) -> torch.Tensor:
    """The fused layer for validated inputs in stacked form.

    a_stacked (R, in) and b_stacked (out, R) or (adapters, out, rank), R = adapters x rank,
    contiguous (see ``stack_adapters``); scales (adapters,) float32 or None (then
    ``scaling`` for all); adapter_ids (M,) or None; path: see ``LoraPath``.
    """
    path = path or _AUTO
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not (m and n):
        return out.view(*x.shape[:-1], n)
    ids = None if adapter_ids is None else adapter_ids.reshape(-1)
    b = None if bias is None else bias.contiguous()
    r = a_stacked.shape[0]
    r_pad = max(16, next_pow2(r))  # as launch_linear pads it
    loop = main_loop(x2, weight, traced, path.loop) if r_pad <= EXPAND_MAX_R else _gemm.LOOP_PTR
    small = type(m) is not int or m <= path.in_loop_max_m
    if loop == _gemm.LOOP_TUNED and m >= _gemm.TMA_MIN_M:
        loop = _gemm.LOOP_TMA  # narrow outputs (see TMA_TUNED_N): LoRA keeps the TMA modes
    pdl = (
        small
        and r_pad <= EXPAND_MAX_R
        and not traced
        and (_gemm.pdl_available(x2, traced) if path.overlap is None else path.overlap)
    )
    args = (out, x2, weight, b, a_stacked, b_stacked, rank, scaling, scales, ids, code, traced)
    eager = not traced and not (capturing(x2) if path.capture is None else path.capture)
    can_fast = (  # an eager call whose launch the C++ fast path may repeat (FAST_MAX_M)
        eager
        and type(m) is int
        and m <= FAST_MAX_M
        and ids is None
        and scales is None
        and b_stacked.dim() == 2
        and path.loop == "auto"
        and path.config is None
    )
    if eager and x2.is_cuda:
        reserve_joint_flags(x2)  # (for the joint / spread launches of later captures)
    if pdl and r_pad <= IN_LOOP_MAX_R:
        # Either one launch (in-loop: every column tile redoes x @ A^T) or the overlapped
        # shrink + expand launches: which has the shorter GPU time depends on the kernel
        # and tile the GEMM takes at this size (either wins somewhere), so it is measured
        # once per shape bucket, as tiles are. That choice is for calls captured into a
        # CUDA graph, where only GPU time counts. An eager call at these sizes is bound by
        # host time, where one launch beats two (87 against 320 us per call at M = 1): it
        # takes the in-loop mode where that is the tuned one, else the joint launch (the
        # expand mode's two launches as one) where it can run and its repeats launch from
        # C++: expand and joint time within a few percent of each other, and the tuned
        # pick between them flips from run to run (512 x 4096 -> 4096, r 16, H200: 43.6
        # us a call in-loop on the pointer kernel against 28.9 joint). (The first, eager
        # call of a bucket measures them all, so a later capture finds the choice made.)
        # See docs/performance/lora.md.
        default = _gemm.LORA_IN_LOOP if loop == _gemm.LOOP_PTR else _gemm.LORA_EXPAND
        mode = _chosen_mode(path, args, loop, default)
        if eager:
            joint = (
                mode != _gemm.LORA_IN_LOOP
                and can_fast
                and _joint_ok(loop, a_stacked)
                and _fastcall.loaded() is not None
            )
            mode = _gemm.LORA_JOINT if joint else _gemm.LORA_IN_LOOP
    elif pdl:
        # Wide stacks (several adapters): the overlapped pair, or the spread launch (one
        # launch, each row tile's xs computed in slices by its own column tiles), timed
        # per shape bucket.
        mode = _chosen_mode(path, args, loop, _gemm.LORA_EXPAND, wide=True)
    elif small and r_pad <= IN_LOOP_MAX_R:
        mode = _gemm.LORA_IN_LOOP
    elif loop == _gemm.LOOP_TMA and _expand_tma(r, b_stacked):
        # Above IN_LOOP_MAX_M rows the expand mode's launches run in stream order: the
        # overlap measured ~7% slower there, its main kernel's persistent programs taking
        # SMs the shrink needs. The joint launch gives the shrink SMs of its own (where
        # the tiles' waves leave some), and the tiles wait only for their own rows of xs:
        # timed against it per shape bucket.
        mode = _gemm.LORA_EXPAND
        if r_pad <= IN_LOOP_MAX_R and _joint_ok(loop, a_stacked):
            mode = _chosen_mode(path, args, loop, mode, overlap=False)
    else:
        mode = _gemm.LORA_PRECOMPUTED
    fast = can_fast and mode in (_gemm.LORA_IN_LOOP, _gemm.LORA_JOINT)
    if fast and mode == _gemm.LORA_IN_LOOP:
        loop = _gemm.LOOP_PTR  # (see FAST_MAX_M)
    _run_mode(mode, loop, pdl, *args, force=Force(path.loop, path.config), fast=fast)
    return out.view(*x.shape[:-1], n)


def _chosen_mode(path: LoraPath, args: tuple, loop: int, default: int, **kw) -> int:
    """The tuned LoRA mode (``_tuned_mode``), or the one ``path`` forces."""
    forced = path.mode
    if forced is None:
        return _tuned_mode(args, loop, default, force=Force(path.loop, path.config), **kw)
    x2, weight, a_stacked = args[1], args[2], args[4]
    if forced == _gemm.LORA_SPREAD and not _spread_ok(loop, x2, weight.shape[0], a_stacked):
        return _gemm.LORA_EXPAND
    if forced == _gemm.LORA_JOINT and not _joint_ok(loop, a_stacked):
        return _gemm.LORA_EXPAND
    return forced


def capturing(x: torch.Tensor) -> bool:
    """Is this call being captured into a CUDA graph (on x's current stream)?"""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------ registration
@fused_op("fuseml::lora_linear", mutates_args=())
def _lora_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    rank: int,
    scaling: float,
    scales: torch.Tensor | None,
    adapter_ids: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    code = ew.ACT_CODE[activation]
    return lora_rows(
        x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, code,
        traced=True,
    )  # fmt: skip


# ---------------------------------------------------------------------------- public


def _validate(x, weight, bias, lora_a, lora_b, scaling, activation, adapter_ids) -> str:
    op = "lora_linear"
    activation = check_linear_args(op, x, weight, bias, None, 1.0, activation)
    n, k = weight.shape
    for name, t in (("lora_a", lora_a), ("lora_b", lora_b)):
        check_tensor(op, name, t)
        check_same(op, "x", x, name, t)
    if adapter_ids is None:
        if lora_a.dim() != 2 or lora_b.dim() != 2:
            raise ValueError(
                f"{op}: without adapter_ids, lora_a must be (r, {k}) and lora_b ({n}, r); got "
                f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)} (stacked adapters need "
                "adapter_ids)"
            )
        r = lora_a.shape[0]
        expect_a, expect_b = (r, k), (n, r)
    else:
        if lora_a.dim() != 3 or lora_b.dim() != 3:
            raise ValueError(
                f"{op}: with adapter_ids, lora_a must be (adapters, r, {k}) and lora_b "
                f"(adapters, {n}, r); got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
            )
        na, r = lora_a.shape[:2]
        expect_a, expect_b = (na, r, k), (na, n, r)
    if r < 1:
        raise ValueError(f"{op}: the LoRA rank must be >= 1, got lora_a {tuple(lora_a.shape)}")
    if tuple(lora_a.shape) != expect_a:
        raise ValueError(f"{op}: lora_a must have shape {expect_a}, got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != expect_b:
        raise ValueError(f"{op}: lora_b must have shape {expect_b}, got {tuple(lora_b.shape)}")
    if adapter_ids is None:
        if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
            raise TypeError(f"{op}: scaling must be a real number, got {type(scaling).__name__}")
        return activation
    check_adapter_ids_tensor(op, x, adapter_ids)
    if not (isinstance(scaling, numbers.Real) and not isinstance(scaling, bool)):
        n_scales = (
            scaling.numel()
            if isinstance(scaling, torch.Tensor)  # no host sync for a tensor on the GPU
            else len(_scale_list(scaling, lora_a.shape[0]))
        )
        if n_scales != lora_a.shape[0]:
            raise ValueError(
                f"{op}: scaling must be one number or one per adapter ({lora_a.shape[0]}), got "
                f"{n_scales} values"
            )
    return activation


def fast_call(x, weight, bias, lora_a, lora_b, scaling, activation, backend: str = "auto"):
    """The one-adapter call launched from C++ where a plan the Python path kept serves it
    (a repeat eager call: ``fuseml.ops._fastcall``), else None (the caller takes the
    Python path). Nothing is validated here: a plan is kept only for a validated call,
    and serves only calls of its signature."""
    fast = _fastcall.loaded()
    if (
        fast is None
        or type(x) is not torch.Tensor
        or type(weight) not in PLAIN_TENSORS
        or type(lora_a) not in PLAIN_TENSORS
        or type(lora_b) not in PLAIN_TENSORS
        or (bias is not None and type(bias) not in PLAIN_TENSORS)
        or type(scaling) not in REAL_NUMBERS
        or not (activation is None or type(activation) is str)
        or not _fastcall.usable(backend)
    ):
        return None
    return fast.call_lora(_CODES.get(activation, -1), x, weight, bias, lora_a, lora_b, scaling)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float | Sequence[float] | torch.Tensor,
    activation: str | None = None,
    *,
    adapter_ids: torch.Tensor | None = None,
    check_ids: bool = True,
    backend: str = "auto",
    path: LoraPath | None = None,
) -> torch.Tensor:
    """act(x @ W^T + bias + scaling * (x @ A^T) @ B^T) in one fused GEMM, adapter unmerged.

    Single adapter: lora_a (r, in), lora_b (out, r), scaling a number (peft's
    lora_alpha / r). Multi-adapter: lora_a (adapters, r, in), lora_b (adapters, out, r),
    scaling one number or one per adapter, adapter_ids (...,) int tensor with x's leading
    shape, -1 meaning no adapter for that row. check_ids validates the ids (one host sync).
    Forward only on the fused backends (inference); backend='eager' for training. path:
    a ``LoraPath`` forcing parts of the launch choice (direct calls; a call traced by
    torch.compile takes the normal choice).
    """
    if adapter_ids is None and path is None:
        out = fast_call(x, weight, bias, lora_a, lora_b, scaling, activation, backend)
        if out is not None:
            return out
    op = "lora_linear"
    activation = _validate(x, weight, bias, lora_a, lora_b, scaling, activation, adapter_ids)
    backend = resolve_backend(backend, x.device, op, cuda_twin=False)
    if adapter_ids is not None and check_ids and not torch.compiler.is_compiling():
        check_adapter_ids(op, adapter_ids, lora_a.shape[0])
    if backend in ("eager", "compile"):
        fn = lora_linear_ref if backend == "eager" else compiled(lora_linear_ref)
        return fn(x, weight, bias, lora_a, lora_b, scaling, activation, adapter_ids)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias, lora_a, lora_b)
    ):
        raise RuntimeError(
            f"{op}: the fused kernel is forward-only; use backend='eager' to train, or call "
            "under torch.no_grad() / inference_mode()"
        )
    rows = x.numel() // max(x.shape[-1], 1)
    a_s, b_s, rank = stack_adapters(
        lora_a, lora_b, in_place=type(rows) is not int or rows <= (path or _AUTO).b3d_max_m
    )
    scales = None
    scale = 1.0
    if adapter_ids is not None and not isinstance(scaling, numbers.Real):
        scales = device_scales(scaling, lora_a.shape[0], x.device)
    else:
        scale = float(scaling)
    return lora_stacked(
        x, weight, bias, a_s, b_s, rank, scale, scales, adapter_ids, activation, path
    )


def lora_stacked(
    x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, activation,
    path: LoraPath | None = None,
) -> torch.Tensor:  # fmt: skip
    """The fused call on pre-stacked adapters (modules keep the stacked form); path: see
    ``LoraPath`` (direct calls only)."""
    if needs_dispatch(x, weight, bias, a_stacked, b_stacked, scales, adapter_ids):
        return torch.ops.fuseml.lora_linear(
            x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, activation
        )
    code = ew.ACT_CODE[activation]
    return lora_rows(
        x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, code,
        path=path,
    )  # fmt: skip
