"""``fuseml.ops.linear``: x @ W^T with the epilogue fused into the GEMM.

    out = act(x @ W^T + bias + alpha * residual)

Unfused, torch runs the GEMM (cuBLAS, bias possibly fused), then one elementwise kernel
per remaining step, each reading and writing the (M, N) output. Fused, the accumulator
tile gets bias, residual and activation in registers and is written once.
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
    as_rows,
    check_choice,
    check_same,
    check_tensor,
    compiled,
    fused_op,
    keeps_derived,
    kept_derived,
    needs_dispatch,
)
from fuseml.ops.bias_act import activation_ref
from fuseml.ops.gemm import launch as gemm_launch
from fuseml.ops.gemm import pad_k
from fuseml.runtime import FLOAT_DTYPES, resolve_backend

ACTIVATIONS = ew.ACTIVATIONS


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    alpha: float = 1.0,
) -> torch.Tensor:
    """Reference: F.linear (cuBLAS, bias fused), then one torch op per epilogue step."""
    h = F.linear(x, weight, bias)
    if residual is not None:
        h = h + alpha * residual
    return activation_ref(h, activation or "none")


# ------------------------------------------------------------------------ launcher
# A K whose rows are not 16-byte aligned leaves the GEMM unaligned, masked loads (and no
# TMA): for K between 64 (one step: see gemm's ONE_STEP) and PAD_K_MAX, from PAD_K_MIN_M
# rows, x is zero-padded per call to a multiple of 16 (one launch of gemm.pad_k), and W
# once per tensor and version (inside a CUDA graph capture the graph pads W too, in the
# same launch as x: a kept copy would not see in-place updates made after the capture).
# The DLRM's 367 -> 512 at 4096 rows: 11.7 -> 9.6 us. One threshold for eager and captured
# calls, so that a graph captured after an eager warm-up finds its K tuned. Wider K lost
# (see docs/performance/gemm.md).
PAD_K_MIN_M = 128
PAD_K_MAX = 512
PAD_K_TO = 16  # elements: row strides divisible by 16 (Triton's alignment specialization)


def padded_k(x2: torch.Tensor, k: int, traced: bool) -> int:
    """The K this call's GEMM runs at: ``pad_k_rule``, for direct launches on a GPU (not
    the op traced by torch.compile); else k."""
    if traced or not x2.is_cuda:
        return k
    return pad_k_rule(x2.shape[0], k)


def pad_k_rule(m, k: int) -> int:
    """k, or k padded up to a multiple of PAD_K_TO (see PAD_K_MAX), from PAD_K_MIN_M rows."""
    if type(m) is not int or m < PAD_K_MIN_M:
        return k
    return padded_width(k)


def padded_width(k: int) -> int:
    """The K a GEMM of this width runs at once padded: k rounded up to a multiple of
    PAD_K_TO between 64 and PAD_K_MAX (one K step below, a loss above), else k."""
    if k % PAD_K_TO == 0 or not 64 < k < PAD_K_MAX:
        return k
    return -(-k // PAD_K_TO) * PAD_K_TO


def padded_weight(weight: torch.Tensor, kp: int, keep: bool | None = None) -> torch.Tensor:
    """weight with zero columns up to kp, kept per tensor and version where that is safe
    (``kept_derived``; keep: ``keeps_derived(weight)`` where asked already)."""
    return kept_derived(weight, "padk", lambda w: pad_k(kp, w)[0], keep=keep)


def _prepare(x, weight, bias, residual, alpha, code, traced, out_dtype, loop, pad_to=None):
    """A linear call up to its launch, shared by ``linear_rows`` and ``linear_choice`` so
    that the query answers for the very launch the call makes: (out, loop, pick, run), with
    out the (M, N) output, loop gemm_loop's choice, pick(config) the config the launch takes
    (the given one, else the tuned one) and run(config) the launch; x and W padded to the K
    ``padded_k`` says first."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # any strides: the kernel takes both
    out = torch.empty((x2.shape[0], n), dtype=out_dtype or x.dtype, device=x.device)
    res2 = None if residual is None else as_rows(residual.reshape(-1, n))
    b = None if bias is None else bias.contiguous()
    kp = padded_k(x2, k, traced) if pad_to is None else pad_to
    # cuBLASLt's kernel, one more candidate of a plain layer it computes alike (gemm.VENDOR)
    vendor = loop == "auto" and kp == k and gemm_launch.vendor_fits(x2, b, res2, code, out)
    unpadded = None  # the call's (x, W) where the launch reads padded copies, W's kept
    offers = True  # may the launch's plan go to the eager fast path (fast: see run)
    if kp != k:  # zero columns: the same sums, from aligned rows
        if keeps_derived(weight):  # W padded once (per version), x per call
            unpadded = (x2, weight)
            weight = padded_weight(weight, kp, keep=True)
            (x2,) = pad_k(kp, x2)
        else:  # (e.g. inside a graph capture) both, in one launch: no plan to keep
            x2, weight = pad_k(kp, x2, weight)
            offers = False
        k = kp

    loop = gemm_launch.gemm_loop(x2, weight, traced, loop)

    def run(cfg: dict, fast: bool = False) -> None:  # (fast: see launch_linear)
        if cfg.get("VENDOR"):
            gemm_launch.launch_vendor(out, x2, weight, b, code)
            return
        tma = gemm_launch.takes_tma(loop, cfg)
        gemm_launch.launch_linear(
            out, x2, weight, b, res2, alpha, code, cfg, traced=traced, tma=tma,
            fast=fast and offers, unpadded=unpadded,
        )  # fmt: skip

    def pick(config: dict | None) -> dict:
        if config:
            return config
        # Layers with a residual are tuned apart: some tiles that fit without one do not fit
        # with it (see gemm.candidates), so one table entry cannot serve both; likewise rows
        # that are not 16-byte aligned (their own candidates, see gemm.configs._REG_PIPE),
        # and the layers cuBLASLt's kernel may run (an entry naming it serves only those)
        unaligned = (
            loop == gemm_launch.LOOP_PTR and not traced and not gemm_launch.tma_eligible(x2, weight)
        )
        tags = (
            gemm_launch.loop_key(loop),
            "res" if res2 is not None else "",
            "u" if unaligned else "",
            "v" if vendor else "",
        )
        return gemm_launch.choose_config(
            "linear", x2, n, k, run, ":".join(filter(None, tags)), loop, plain=True,
            residual=res2 is not None, unaligned=unaligned,
            more=[gemm_launch.VENDOR] if vendor else (),
        )  # fmt: skip

    return out, loop, pick, run


def linear_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    code: int,
    *,
    traced: bool = False,
    out_dtype: torch.dtype | None = None,
    loop: str = "auto",
    config: dict | None = None,
    pad_to: int | None = None,
    fast_tried: bool = False,
) -> torch.Tensor:
    """act(x @ W^T + bias + alpha * residual) for validated inputs, shaped (..., N).

    loop: the main loop, "auto" or forced ("tma", "ptr", "tuned"; see ``gemm_loop``). config: this
    launch config instead of the tuned one (tests). pad_to: the K the GEMM runs at (x and W
    zero-padded to it) instead of ``padded_k``'s. ``linear_choice`` names the config and
    kernel a call takes. fast_tried: the caller offered the call to the fast path already.
    """
    fast = _fastcall.loaded()  # a repeat call launched from C++ (see fuseml.ops._fastcall)
    usual = not traced and residual is None and out_dtype is None and loop == "auto"
    usual = usual and config is None and pad_to is None
    tries = fast is not None and usual and not fast_tried and type(x) is torch.Tensor
    if tries:
        result = fast.call(_fastcall.GEMM, code, x, weight, bias, alpha, -1)
        if result is not None:
            return result
    out, _, pick, run = _prepare(
        x, weight, bias, residual, alpha, code, traced, out_dtype, loop, pad_to
    )
    if out.numel():
        run(pick(config), fast=usual)
    flat = x.dim() == 2  # (the common case: no view of the output)
    return out if flat else out.view(*x.shape[:-1], out.shape[1])


def linear_choice(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    alpha: float = 1.0,
    *,
    loop: str = "auto",
    config: dict | None = None,
) -> dict | None:
    """The launch config a direct ``linear`` call with these arguments takes (``linear_rows``
    with ``loop`` and ``config``), with the kernel it runs ("stream", "tma", "ptr" or "cublaslt"); None
    where the call launches nothing (no rows or no columns). The bench records it beside
    the fused arm's times, so that a row says which tile the tuner chose.

    Once such a call has run this is a lookup of the tuning memo; asked before any, it
    chooses as the call would (tuning, on a GPU, where the tuning table has no entry).
    """
    activation = check_linear_args("linear_choice", x, weight, bias, residual, alpha, activation)
    code = ew.ACT_CODE[activation]
    out, loop_id, pick, _ = _prepare(
        x, weight, bias, residual, float(alpha), code, False, None, loop
    )
    if not out.numel():
        return None
    cfg = pick(config)
    if cfg.get("VENDOR"):
        kernel = "cublaslt"
    elif cfg.get("STREAM"):
        kernel = "stream"
    else:
        kernel = "tma" if gemm_launch.takes_tma(loop_id, cfg) else "ptr"
    return {**cfg, "kernel": kernel}


# ------------------------------------------------------------------------ registration
@fused_op("fuseml::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    activation: str,
) -> torch.Tensor:
    return linear_rows(x, weight, bias, residual, alpha, ew.ACT_CODE[activation], traced=True)


def _setup(ctx, inputs, output):
    x, weight, bias, residual, alpha, activation = inputs
    ctx.save_for_backward(x, weight, bias, residual)
    ctx.alpha = alpha
    ctx.code = ew.ACT_CODE[activation]


def _backward(ctx, grad):
    x, weight, bias, residual = ctx.saved_tensors
    if ctx.code == ew.ACT_CODE["none"]:
        dh = grad
    else:  # recompute the pre-activation (one GEMM) rather than keep it from the forward
        h = torch.ops.fuseml.linear(x, weight, bias, residual, ctx.alpha, "none")
        dh = torch.ops.fuseml.bias_act_backward(grad, h, None, None, 1.0, ctx.code)
    dh2 = dh.reshape(-1, dh.shape[-1])
    dx = (dh2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
    dw = dh2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    db = None
    if bias is not None and ctx.needs_input_grad[2]:
        db = dh2.sum(0, dtype=torch.float32).to(bias.dtype)
    dres = dh * ctx.alpha if residual is not None and ctx.needs_input_grad[3] else None
    return dx, dw, db, dres, None, None


torch.library.register_autograd("fuseml::linear", _backward, setup_context=_setup)


# ---------------------------------------------------------------------------- public
def _valid_linear_args(x, weight, bias, residual, alpha, activation) -> str | None:
    """check_linear_args's result when every argument is plainly valid (one pass, no
    messages: the per-call fast path), else None (the full check then names the error)."""
    if type(x) not in PLAIN_TENSORS or type(weight) not in PLAIN_TENSORS or residual is not None:
        return None
    dt, dev = x.dtype, x.device
    if (
        dt not in FLOAT_DTYPES or weight.dtype != dt or weight.device != dev
        or weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]
        or type(alpha) not in (float, int)
    ):  # fmt: skip
        return None
    if bias is not None and (
        type(bias) not in PLAIN_TENSORS or bias.dtype != dt or bias.device != dev
        or bias.shape != (weight.shape[0],)
    ):  # fmt: skip
        return None
    activation = "none" if activation is None else activation
    return activation if type(activation) is str and activation in ew.ACT_CODE else None


def check_linear_args(op, x, weight, bias, residual, alpha, activation) -> str:
    """Validate linear-style arguments; return the activation name ('none' for None)."""
    valid = _valid_linear_args(x, weight, bias, residual, alpha, activation)
    if valid is not None:
        return valid
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight)
    check_same(op, "x", x, "weight", weight)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim (..., in_features), got 0-d")
    if weight.dim() != 2:
        raise ValueError(
            f"{op}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"{op}: x's last dim ({x.shape[-1]}) must equal weight's in_features "
            f"(weight shape {tuple(weight.shape)})"
        )
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_same(op, "x", x, "bias", bias)
        if tuple(bias.shape) != (n,):
            raise ValueError(
                f"{op}: bias must have shape ({n},) (weight's out_features), got "
                f"{tuple(bias.shape)}"
            )
    if residual is not None:
        check_tensor(op, "residual", residual)
        check_same(op, "x", x, "residual", residual)
        expected = (*x.shape[:-1], n)
        if tuple(residual.shape) != expected:
            raise ValueError(
                f"{op}: residual must have the output's shape {expected}, got "
                f"{tuple(residual.shape)}"
            )
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{op}: alpha must be a real number, got {type(alpha).__name__}")
    activation = "none" if activation is None else activation
    check_choice(op, "activation", activation, ACTIVATIONS)
    return activation


_CODES = {None: ew.ACT_CODE["none"], **{a: ew.ACT_CODE[a] for a in ACTIVATIONS}}


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    alpha: float = 1.0,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """act(x @ weight^T + bias + alpha * residual), one kernel.

    x: (..., in) float32/float16/bfloat16; weight: (out, in) as in nn.Linear; bias: (out,)
    or None; residual: (..., out) or None; activation: None or one of ACTIVATIONS.
    float32 uses TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` allows it, else
    fp32-accurate dots (see ``fuseml.ops.gemm.fp32_dot``).
    backend: auto (triton on CUDA tensors, eager otherwise) | eager | compile | triton.
    The first call of a new (M bucket, N, K) on a GPU tunes the tile (a few seconds) and
    stores the result on disk (see ``fuseml.ops._tune``).
    """
    fast = _fastcall.loaded()  # a repeat call launched from C++ (see fuseml.ops._fastcall)
    plain = (
        fast is not None
        and residual is None
        and type(x) is torch.Tensor
        and type(weight) in PLAIN_TENSORS
        and (bias is None or type(bias) in PLAIN_TENSORS)
        and type(alpha) in REAL_NUMBERS
        and (activation is None or type(activation) is str)
    )
    tried = plain and _fastcall.usable(backend)
    if tried:
        out = fast.call(_fastcall.GEMM, _CODES.get(activation, -1), x, weight, bias, alpha, -1)
        if out is not None:
            return out
    op = "linear"
    activation = check_linear_args(op, x, weight, bias, residual, alpha, activation)
    alpha = float(alpha)
    backend = resolve_backend(backend, x.device, op, cuda_twin=False)
    if backend in ("eager", "compile"):
        fn = linear_ref if backend == "eager" else compiled(linear_ref)
        return fn(x, weight, bias, activation, residual, alpha)
    if needs_dispatch(x, weight, bias, residual):
        return torch.ops.fuseml.linear(x, weight, bias, residual, alpha, activation)
    return linear_rows(x, weight, bias, residual, alpha, ew.ACT_CODE[activation], fast_tried=tried)
