"""Launchers of the GEMM kernels: which main loop a call takes, one launch of each
kernel, and the tuned choice of config."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from fuseml.ops import _fastcall, _tune
from fuseml.ops._activations import ACT_CODE, ACTIVATIONS
from fuseml.ops._utils import (
    CompiledLaunches,
    aligned16,
    cdiv,
    compiling_only,
    grid_launch,
    int_spec,
    launches_skipped,
    next_pow2,
    pdl_launch,
    sm_count,
)
from fuseml.ops.gemm.common import dot_precision, lora_cols
from fuseml.ops.gemm.configs import (
    LOOP_PTR,
    LOOP_TMA,
    LOOP_TUNED,
    TMA_HOST_BOUND_MS,
    TMA_HOST_BOUND_PENALTY,
    TMA_MIN_M,
    TMA_TUNED_MAX_M,
    TMA_TUNED_N,
    VENDOR,
    candidates,
    default_config,
)
from fuseml.ops.gemm.lora_modes import (
    JOINT_SHRINK_STAGES,
    JOINT_SPLIT,
    LORA_EXPAND,
    LORA_IN_LOOP,
    LORA_JOINT,
    LORA_NONE,
    LORA_PRECOMPUTED,
    LORA_SHRINK,
    LORA_SPREAD,
    SPREAD_EXPAND_STAGES,
    LoraLaunch,
    _segment_rows_kernel,
    _shrink_segment_kernel,
    expand_stages,
    joint_flags,
    joint_flags_kept,
    spread_slice,
)
from fuseml.ops.gemm.pointer import _linear_kernel, _lora_kernel
from fuseml.ops.gemm.stream import _linear_stream_kernel
from fuseml.ops.gemm.tma import _linear_tma_kernel, _lora_tma_kernel
from fuseml.runtime import triton_interpreting

LOOPS = ("auto", "tma", "ptr", "tuned")  # gemm_loop's choices: the default rule, or one forced


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # Hopper and later


def _tma_device(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_tma(x.get_device())


def gemm_loop(x: torch.Tensor, weight: torch.Tensor, traced: bool, loop: str = "auto") -> int:
    """Which main loop a linear call takes: LOOP_TMA (``_tma_body``), LOOP_PTR
    (``_gemm_body``) or LOOP_TUNED (the tuned config's "TMA" flag decides, see
    ``takes_tma``). Only direct launches take TMA (the op traced by torch.compile keeps
    the pointer kernel), only for TMA-compatible layouts. loop "auto": on Hopper+ GPUs
    from TMA_MIN_M rows, tuned up to TMA_TUNED_MAX_M rows and for outputs at most
    TMA_TUNED_N wide; "tma" / "ptr" / "tuned" force one (tests, the bench's pointer-loop
    arm; "tuned" as "tma" where the layout allows)."""
    if traced:
        return LOOP_PTR
    if loop == "auto":  # cheapest checks first: this runs on every call
        m = x.shape[0]
        if TMA_TUNED_MAX_M < m < TMA_MIN_M or not (_tma_device(x) and tma_eligible(x, weight)):
            return LOOP_PTR
        if x.dtype == torch.float32 and dot_precision(x.dtype) == "ieee":
            return LOOP_PTR  # FMA dots: the TMA kernel's large tiles spill registers
        return LOOP_TMA if m >= TMA_MIN_M and weight.shape[0] > TMA_TUNED_N else LOOP_TUNED
    if loop not in LOOPS:
        raise ValueError(f"gemm_loop: loop must be one of {LOOPS}, got {loop!r}")
    if loop == "ptr" or not tma_eligible(x, weight):
        return LOOP_PTR
    return LOOP_TMA if loop == "tma" else LOOP_TUNED


def pdl_available(x: torch.Tensor, traced: bool) -> bool:
    """Can LoRA's expand launch overlap its shrink launch (programmatic dependent launch,
    see ``pdl_launch``)? FUSEML_PDL=0 turns it off (then small batches take the one-launch
    in-loop mode, see fuseml.ops.lora)."""
    return pdl_launch(x, traced)


def takes_tma(loop: int, config: dict) -> bool:
    """Does a launch with this loop choice and config take the TMA kernel?"""
    if config.get("STREAM"):  # the streaming kernel has pointer loads of its own
        return False
    return loop == LOOP_TMA or (loop == LOOP_TUNED and config.get("TMA", False))


def loop_key(loop: int) -> str:
    """The tuning-key suffix of a loop choice: each has its own entries (best tiles differ)."""
    return ("", "tma", "tmatuned")[loop]


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """TMA needs unit inner strides, 16-byte aligned row strides and base pointers."""
    for t in tensors:  # (a plain loop: this runs on every call)
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _launch_tma(
    out, x, weight, bias, residual, alpha, activation, config, lora=None, *, pdl=None,
    programs=None, fast=False, offer=None,
) -> None:  # fmt: skip
    """One launch of the TMA kernel. lora: None, or a LoraLaunch whose mode is
    LORA_IN_LOOP (A read through its own descriptor), LORA_PRECOMPUTED (xa = x @ A^T
    given), LORA_SHRINK (weight is A), LORA_EXPAND (xa is xs, read with B through
    descriptors), LORA_JOINT (xa unused: its first programs fill an xs buffer made here,
    whose shape depends on the K split; A through a descriptor) or LORA_SPREAD (xa unused:
    an xs buffer made here; A through a descriptor of SLICE rows; one tile a program, which
    needs the tiles to fit one wave). pdl (LoRA only): the kernel's PDL flag, and for
    LORA_EXPAND with pdl the launch may start early. programs: the persistent grid's size
    instead of ``persistent_programs`` (tests: several tiles a program on the CPU). fast:
    a one-adapter joint launch is offered to the eager fast path (``fuseml.ops._fastcall``);
    offer: as ``_launch_plain``'s, for a plain layer's launch.

    Repeat launches go through the compiled kernel's launcher (``CompiledLaunches``): a
    host descriptor specializes on its dtype and block shape only, both fixed by the
    constexprs below, so the key holds no descriptor. Triton's launcher still encodes
    each descriptor (cuTensorMapEncodeTiled) on every launch.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    sms = persistent_programs(x) if programs is None else programs
    programs = tiles if sms is None else min(tiles, sms)
    joint = lora is not None and lora.mode == LORA_JOINT
    spread = lora is not None and lora.mode == LORA_SPREAD
    n_shrink = 0
    if spread:
        # Every tile may wait for others of its row tile: all must be resident at once
        if sms is not None and tiles > sms:
            raise ValueError(
                f"launch_linear: the spread LoRA mode needs one tile a program, got {tiles} "
                f"tiles of {bm} x {bn} for {sms} SMs"
            )
        programs = tiles
    if joint:
        # xs's programs first: one per SM the tiles leave free, at most one per row tile.
        # Where every SM has tiles, the GEMM takes as few programs as finish its tiles in
        # the same number of rounds (512 tiles on 132 SMs: 128 programs of 4), and at most
        # all SMs but one (CPU: two programs more than the tiles)
        free_sms = programs + 2 if sms is None else sms
        if tiles >= free_sms:
            programs = min(cdiv(tiles, cdiv(tiles, free_sms)), free_sms - 1)
        row_tiles = cdiv(m, bm)
    # One tile a program: nothing to flatten, and the epilogue's loads go before the main
    # loop (see _tma_body); unless the config says (the TMA-store tiles, measured flattened)
    flatten = config.get("FLATTEN", tiles > programs)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    bias_arg = out if bias is None else bias
    res_arg = out if residual is None else residual
    ints = (m, n, k, 0 if residual is None else residual.stride(0), out.stride(0))
    common = (
        bias is not None, residual is not None, activation, dot_precision(x.dtype),
        triton_interpreting(), bm, bn, bk, config["GROUP_M"], programs, flatten,
    )  # fmt: skip
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    ptrs = (bias_arg, res_arg, out)
    if lora is None:  # (only direct launches take TMA, see gemm_loop)
        dep = pdl_launch(x)
        if dep:
            options["launch_pdl"] = True
        # TMA stores where the config asks and out's layout allows (else pointer stores of
        # the same values); x_desc stands in for an unused o_desc
        sub = config.get("OUT_SUB", 0)
        if sub and not tma_eligible(out):
            sub = 0
        o_desc = TensorDescriptor.from_tensor(out, [bm, bn // sub]) if sub else x_desc
        args = (x_desc, w_desc, *ptrs, *ints, float(alpha), *common, dep, o_desc, sub)
        key = (x.dtype, out.dtype, common, dep, sub, *options.values(), *map(int_spec, ints))
        ck = _linear_tma_launches((programs,), key, aligned16(*ptrs), args, options)
        if ck is not None and offer is not None:
            _offer_gemm(offer, x, weight, out, alpha, ck, (programs,), options, args)
        return
    mode, xa, lora_a, lora_b = lora.mode, lora.xa, lora.a, lora.b
    ids, scales, lora_scale, rank = lora.ids, lora.scales, lora.scale, lora.rank
    r = 1 if lora_b is None else lora_cols(lora_b)
    b3d = lora_b is not None and lora_b.dim() == 3
    r_pad = max(16, next_pow2(r))
    a_desc = b_desc = x_desc
    sync, shrink_k, shrink_stages, split = out, 16, 1, 1
    # (SLICE is a constexpr: the other modes keep one value, so no N compiles them again)
    slice_w = spread_slice(r_pad, n, bn) if spread else 16
    if mode == LORA_IN_LOOP:
        a_desc = TensorDescriptor.from_tensor(lora_a, [r_pad, bk])
    if joint:
        # Two counters per row tile, zero (see joint_flags). The shrink's loop reads x
        # and A in K steps of up to 512 bytes, in the GEMM's buffers: shorter steps where
        # fewer than JOINT_SHRINK_STAGES of them fit (with one, each step waits for its load)
        sync = joint_flags(x, 2 * row_tiles)
        es = x.element_size()
        budget = config["num_stages"] * (bm + bn) * bk * es
        shrink_k = max(16, min(512 // es, next_pow2(k)))
        while shrink_k > 32 and budget // ((bm + r_pad) * shrink_k * es) < JOINT_SHRINK_STAGES:
            shrink_k //= 2
        shrink_stages = max(1, min(8, budget // ((bm + r_pad) * shrink_k * es)))
        # More free SMs than row tiles (decode-like rows): K split over them, so that no
        # one SM streams a whole row tile of x and A
        split = max(1, min(JOINT_SPLIT, (free_sms - programs) // row_tiles, cdiv(k, shrink_k)))
        n_shrink = min(row_tiles, free_sms - programs) * split
        a_desc = TensorDescriptor.from_tensor(lora_a, [r_pad, shrink_k])
        b_desc = TensorDescriptor.from_tensor(x, [bm, shrink_k])
        # xs, or its float32 parts where K is split (see _joint_shrink)
        shape, dtype = ((split, m, r), torch.float32) if split > 1 else ((m, r), x.dtype)
        xa = torch.empty(shape, dtype=dtype, device=x.device)
    elif spread:  # A's slice for the K loop; xs (written by the tiles) and its counters;
        # B through pointers (see _spread_expand)
        a_desc = TensorDescriptor.from_tensor(lora_a, [slice_w, bk])
        xa = torch.empty((m, r), dtype=x.dtype, device=x.device)
        sync = joint_flags(x, 2 * cdiv(m, bm))
    elif mode == LORA_EXPAND:
        a_desc = TensorDescriptor.from_tensor(xa, [bm, lora.r_block])
        b2 = lora_b.reshape(-1, lora_b.shape[-1]) if b3d else lora_b  # (adapters * N, rank)
        b_desc = TensorDescriptor.from_tensor(b2, [bn, lora.r_block])
    expand = 3
    if spread:
        expand = SPREAD_EXPAND_STAGES
    elif mode == LORA_EXPAND:
        expand = expand_stages(config, r_pad, lora.r_block, x.element_size())
    if pdl and mode == LORA_EXPAND:
        options["launch_pdl"] = True
    # PDL behind the kernel before (see _lora_tma_kernel's DEP): not for the expand launch
    # (above), the spread mode's cooperative one, nor the joint mode, whose programs wait
    # for each other: with PDL the joint launch measured about 2 us slower
    dep = mode in (LORA_IN_LOOP, LORA_PRECOMPUTED, LORA_SHRINK) and pdl_launch(x)
    if dep:
        options["launch_pdl"] = True
    if spread and not triton_interpreting():
        # A cooperative launch: the driver starts it only with every program resident at
        # once. Its tiles wait for each other, so two such launches on two streams that
        # each got part of the SMs could otherwise wait on each other for ever.
        options["launch_cooperative_grid"] = True
    more = (
        out if lora_b is None else lora_b, out if xa is None else xa,
        out if ids is None else ids, out if scales is None else scales, sync,
    )  # fmt: skip
    ints += (0 if lora_b is None else lora_b.stride(-2),)
    consts = (
        mode, ids is not None, r, max(rank, 1), r_pad, lora.r_block, scales is not None,
    )  # fmt: skip
    args = (
        x_desc, w_desc, a_desc, b_desc, *ptrs, *more, *ints, float(alpha), float(lora_scale),
        n_shrink, *common[:3], *consts, *common[3:], bool(pdl), shrink_k, shrink_stages, split,
        b3d, expand, slice_w, dep,
    )  # fmt: skip
    key = (
        x.dtype, out.dtype, common, consts, bool(pdl), shrink_k, shrink_stages, split, b3d, expand,
        slice_w, dep, tuple(options.items()),
        tuple(t.dtype for t in more), *map(int_spec, ints), int_spec(n_shrink),
    )  # fmt: skip
    aligned = aligned16(*ptrs, *more)
    if spread and triton_interpreting():
        # Programs run one after the other here: the K loops and xs slices first, then
        # the rest (waits already met) in a second launch; one launch on a GPU
        for phase in (1, 2):
            _lora_tma_launches((programs,), (*key, phase), aligned, (*args, phase), options)
        return
    ck = _lora_tma_launches((programs + n_shrink,), (*key, 0), aligned, (*args, 0), options)
    one_adapter = ids is None and scales is None and not b3d
    kept = joint and joint_flags_kept(sync)  # (a fresh buffer lives for this launch only)
    if ck is not None and fast and kept and residual is None and one_adapter:
        _fastcall.register_joint(
            activation, x, weight, bias, out, lora_scale, lora_a, lora_b, xa, sync, split,
            n_shrink, ck, (programs + n_shrink,), options, (*args, 0),
        )  # fmt: skip


def persistent_programs(x: torch.Tensor) -> int | None:
    """Programs of the TMA kernel's persistent grid: x's SM count (None on the CPU, where
    the interpreter runs one program per tile)."""
    return sm_count(x.get_device()) if x.is_cuda else None


_linear_tma_launches = CompiledLaunches(_linear_tma_kernel)
_lora_tma_launches = CompiledLaunches(_lora_tma_kernel)
_linear_launches = CompiledLaunches(_linear_kernel)  # plain linear layers' repeat launches
_stream_launches = CompiledLaunches(_linear_stream_kernel)
_lora_launches = CompiledLaunches(_lora_kernel)  # LoRA launches on the pointer kernel


def launch_linear(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    alpha: float,
    activation: int,
    config: dict,
    *,
    lora: int = LORA_NONE,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    xa: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    rank: int = 1,
    traced: bool = False,
    tma: bool = False,
    pdl: bool = False,
    programs: int | None = None,
    fast: bool = False,
    unpadded: tuple | None = None,
) -> None:
    """One launch of ``_linear_kernel``; x (M, K), weight (N, K), out (M, N), all validated.

    lora_a (R, K) and lora_b (N, R) are the stacked adapters; ``rank`` the per-adapter rank.
    tma: through the TMA kernel (the caller checked ``gemm_loop``; for LORA_IN_LOOP also that
    lora_a can be read through a descriptor: see ``fuseml.ops.lora``). pdl (LORA_SHRINK and
    the LORA_EXPAND launch right after it; see ``pdl_available``): the expand launch starts while
    the shrink runs and waits for xs only before its last K steps. programs: the TMA
    kernel's persistent grid size (see ``_launch_tma``). fast: the launch a call takes (not
    a tuning candidate), offered to the eager fast path (``fuseml.ops._fastcall``) where
    it is a plain layer's, a one-adapter in-loop LoRA layer's on the pointer loop, or a
    one-adapter joint LoRA launch. unpadded: the call's (x, weight) where x and weight here
    are their copies zero-padded in K (weight's kept per tensor and version), for that offer.
    """
    if launches_skipped():
        return
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return
    r = 0 if lora == LORA_NONE else 1 if lora_b is None else lora_cols(lora_b)
    r_pad = max(16, next_pow2(max(r, 1)))
    r_block = r_pad if lora == LORA_IN_LOOP else min(r_pad, 64)
    b3d = lora_b is not None and lora_b.dim() == 3
    if b3d and lora not in (LORA_IN_LOOP, LORA_SPREAD):  # the expand mode's descriptor
        r_block = min(r_block, rank)  # steps through a 3-D B one adapter (or part) at a time
    grid = (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)
    even_k = k % config["BLOCK_K"] == 0
    precision = dot_precision(x.dtype)
    upcast = triton_interpreting()
    pdl = pdl and not upcast  # a launch-order hint: the interpreter runs launches in order
    if lora in (LORA_JOINT, LORA_SPREAD) and not tma:
        raise ValueError(
            "launch_linear: the joint and spread LoRA modes run on the TMA kernel only"
        )
    # (activation, bias, unpadded) of a plain layer's launch the fast path may keep
    offer = None
    if fast and lora == LORA_NONE and residual is None:
        offer = (activation, bias, unpadded)
    if tma:
        extra = None
        if lora != LORA_NONE:
            extra = LoraLaunch(lora, lora_a, lora_b, xa, ids, scales, lora_scale, rank, r_block)
        _launch_tma(
            out, x, weight, bias, residual, alpha, activation, config, extra, pdl=pdl,
            programs=programs, fast=fast, offer=offer,
        )  # fmt: skip
        return
    if lora == LORA_NONE:
        b_arg = x if bias is None else bias
        r_arg = x if residual is None else residual
        ints = (
            m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            0 if residual is None else residual.stride(0), out.stride(0),
        )  # fmt: skip
        dep = pdl_launch(x, traced)  # programmatic dependent launch (not LoRA's pdl)
        if config.get("STREAM"):
            flags = (bias is not None, residual is not None, activation, precision, upcast)
            _launch_stream(
                out, x, weight, b_arg, r_arg, ints, alpha, flags, config, traced, dep, offer
            )
            return
        consts = (
            bias is not None, residual is not None, activation, precision, upcast,
            config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["GROUP_M"], even_k,
            k <= config["BLOCK_K"], dep, bool(config.get("REG_PIPE")),
        )  # fmt: skip
        tensors = (x, weight, b_arg, r_arg, out)
        _launch_plain(
            _linear_kernel, _linear_launches, grid, tensors, ints, alpha, consts, config, dep,
            traced, offer,
        )  # fmt: skip
        return
    dummy = x
    tensors = (
        x, weight,
        dummy if bias is None else bias,
        dummy if residual is None else residual,
        out,
        dummy if lora_a is None else lora_a,
        dummy if lora_b is None else lora_b,
        dummy if xa is None else xa,
        dummy if ids is None else ids,
        dummy if scales is None else scales,
    )  # fmt: skip
    ints = (
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        0 if residual is None else residual.stride(0), out.stride(0),
        0 if lora_a is None else lora_a.stride(0), 0 if lora_b is None else lora_b.stride(-2),
    )  # fmt: skip
    consts = (
        bias is not None, residual is not None, activation,
        lora, ids is not None, r, max(rank, 1), r_pad, r_block,
        scales is not None, precision, upcast,
        config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
        config["GROUP_M"], even_k, pdl, b3d,
    )  # fmt: skip
    # (every argument in _lora_kernel's order; launch_pdl is a launch option, not an
    # argument: the expand launch may start while the shrink runs)
    args = (*tensors, *ints, float(alpha), float(lora_scale), *consts)
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    if pdl and lora == LORA_EXPAND:
        options["launch_pdl"] = True
    if traced:
        grid_launch(torch.library.wrap_triton(_lora_kernel), grid)(*args, **options)
        return
    key = (
        tuple(t.dtype for t in tensors), consts, tuple(sorted(options.items())),
        *map(int_spec, ints),
    )  # fmt: skip
    ck = _lora_launches(grid, key, aligned16(*tensors), args, options)
    one_adapter = ids is None and scales is None and not b3d
    if ck is not None and fast and lora == LORA_IN_LOOP and residual is None and one_adapter:
        _fastcall.register(
            _fastcall.LORA, activation, x, weight, bias, out, lora_scale, ck, grid, options,
            args, (lora_a, lora_b),
        )  # fmt: skip


def stream_grid(m: int, n: int, config: dict, sms: int | None) -> tuple[int]:
    """``_linear_stream_kernel``'s grid: every column tile times as many row programs as
    ``config["STREAM"]`` programs an SM allow (at most one a row tile). Without an SM
    count (the interpreter) two row programs, so that tests see several tiles a program."""
    tiles_n = cdiv(n, config["BLOCK_N"])
    tiles_m = cdiv(m, config["BLOCK_M"])
    rows = 2 if sms is None else max(1, sms * config["STREAM"] // tiles_n)
    return (tiles_n * min(tiles_m, rows),)


def _launch_stream(
    out, x, weight, b_arg, r_arg, ints, alpha, flags, config, traced, dep=False, offer=None
) -> None:  # fmt: skip
    """One launch of ``_linear_stream_kernel`` (a "STREAM" config; plain layers only); dep:
    with programmatic dependent launch (``pdl_launch``); offer: see ``_launch_plain``."""
    m, n, k = ints[:3]
    grid = stream_grid(m, n, config, persistent_programs(x))
    consts = (
        *flags, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
        k == config["BLOCK_K"], config["num_stages"], dep,
    )  # fmt: skip
    tensors = (x, weight, b_arg, r_arg, out)
    _launch_plain(
        _linear_stream_kernel, _stream_launches, grid, tensors, ints, alpha, consts, config, dep,
        traced, offer,
    )  # fmt: skip


def _launch_plain(
    kernel, launches, grid, tensors, ints, alpha, consts, config, dep, traced, offer=None
):  # fmt: skip
    """One launch of a plain-layer kernel (``_linear_kernel`` or ``_linear_stream_kernel``):
    tensors (x, weight, bias, residual, out), the ints, alpha and the constexprs in the
    kernel's order; dep: with programmatic dependent launch. Traced launches go through
    wrap_triton, the others repeat through ``launches`` (CompiledLaunches). offer: None, or
    (activation code, bias, unpadded: see ``launch_linear``) of a launch whose plan the
    eager fast path may keep."""
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    if dep:
        options["launch_pdl"] = True
    args = (*tensors, *ints, float(alpha), *consts)
    if traced:
        grid_launch(torch.library.wrap_triton(kernel), grid)(*args, **options)
        return
    # out's dtype too: LoRA's x @ A^T launch writes float32 from 16-bit x and W
    key = (
        tensors[0].dtype, tensors[-1].dtype, consts, options["num_warps"],
        options["num_stages"], *map(int_spec, ints),
    )  # fmt: skip
    ck = launches(grid, key, aligned16(*tensors), args, options)
    if ck is not None and offer is not None:
        _offer_gemm(offer, tensors[0], tensors[1], tensors[-1], alpha, ck, grid, options, args)


def _offer_gemm(offer, x, weight, out, alpha, ck, grid, options, args) -> None:
    """Hand the eager fast path a plain layer's launch (``_fastcall.register_gemm``): x and
    weight those the launch read, the call's own where offer says they were padded."""
    code, bias, unpadded = offer
    used = None if unpadded is None else (x, weight)
    x_call, w_call = unpadded or (x, weight)
    _fastcall.register_gemm(code, x_call, w_call, bias, out, alpha, ck, grid, options, args, used)


def launch_shrink_segments(
    xs: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, ids: torch.Tensor,
    scales: torch.Tensor | None, lora_scale: float, rank: int, config: dict, *,
    traced: bool = False, pdl: bool = False,
) -> None:  # fmt: skip
    """Multi-adapter LoRA's shrink into xs (M, R), zeroed here: each adapter's rows listed
    (``_segment_rows_kernel``), then ``_shrink_segment_kernel``. x (M, K), a_stacked (R,
    K) with R = adapters x rank, ids (M,) per row (-1, or any id past the adapters: no
    adapter, as the stacked product masks them). config from ``SEGMENT_CONFIGS``."""
    if launches_skipped():
        return
    m, k = x.shape
    r = a_stacked.shape[0]
    xs.zero_()
    if m == 0:
        return
    adapters = r // rank
    rows = torch.empty((adapters, m), dtype=torch.int32, device=x.device)
    counts = torch.empty(adapters, dtype=torch.int32, device=x.device)
    wrap = torch.library.wrap_triton if traced else (lambda kernel: kernel)
    grid_launch(wrap(_segment_rows_kernel), (adapters,))(
        ids, rows, counts, m, CHUNK=max(16, min(next_pow2(m), 2048)), num_warps=4
    )  # fmt: skip
    upcast = triton_interpreting()
    grid_launch(wrap(_shrink_segment_kernel), (adapters, cdiv(m, config["BLOCK_M"])))(
        x, a_stacked, xs, rows, counts, xs if scales is None else scales,
        m, k, x.stride(0), x.stride(1), a_stacked.stride(0), float(lora_scale),
        R=r, RANK=rank, RANK_PAD=max(16, next_pow2(rank)), PER_ADAPTER_SCALE=scales is not None,
        PRECISION=dot_precision(x.dtype), UPCAST=upcast, BLOCK_M=config["BLOCK_M"],
        BLOCK_K=config["BLOCK_K"], PDL=pdl and not upcast,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip


def tuning_ms(ms: float, config: dict, loop: int, m: int, plain: bool) -> float:
    """The time tuning compares for a candidate that ran ``ms``: where the call is
    host-bound (up to TMA_TUNED_MAX_M rows, or a tile under TMA_HOST_BOUND_MS), a plain
    layer's TMA tile where the tuner weighs both kernels, and cuBLASLt's kernel (VENDOR),
    count TMA_HOST_BOUND_PENALTY slower, as only pointer tiles repeat from C++ (see the
    constants)."""
    host_bound = m <= TMA_TUNED_MAX_M or ms < TMA_HOST_BOUND_MS
    python_launch = config.get("VENDOR") or (loop == LOOP_TUNED and takes_tma(loop, config))
    if plain and python_launch and host_bound:
        return ms * TMA_HOST_BOUND_PENALTY
    return ms


VENDOR_CODES = (ACT_CODE["none"], ACT_CODE["relu"])


def vendor_fits(x, bias, residual, code: int, out: torch.Tensor) -> bool:
    """Whether cuBLASLt's kernel computes this plain layer as fuseml's would (see VENDOR):
    a bias, no residual, ReLU or no activation, the output in x's dtype, 16-bit inputs or
    float32 where TF32 is allowed."""
    if bias is None or residual is not None or code not in VENDOR_CODES or out.dtype != x.dtype:
        return False
    if x.dtype == torch.float32:
        return dot_precision(x.dtype) == "tf32"
    return x.dtype in (torch.float16, torch.bfloat16)


def launch_vendor(out, x, weight, bias, code: int) -> None:
    """out = act(x @ weight^T + bias) by cuBLASLt (torch._addmm_activation: ReLU in its
    epilogue; torch.addmm without one), for a layer ``vendor_fits`` accepts."""
    if code not in VENDOR_CODES:
        raise ValueError(
            f"config {VENDOR}: cuBLASLt's kernel runs a ReLU or no activation, not "
            f"{ACTIVATIONS[code]!r}"
        )
    if launches_skipped() or compiling_only() or out.numel() == 0:
        return
    if code == ACT_CODE["relu"]:
        torch._addmm_activation(bias, x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def choose_config(
    op: str,
    x: torch.Tensor,
    n: int,
    k: int,
    launch: Callable[[dict], None],
    extra: str = "",
    loop: int = LOOP_PTR,
    *,
    tma_only: bool = False,
    more: list[dict] = (),
    fits: Callable[[dict], bool] | None = None,
    plain: bool = False,
    residual: bool = False,
    unaligned: bool = False,
) -> dict:
    """The launch config of an (M, N, K) problem; ``launch(cfg)`` runs it (for tuning).
    tma_only: only the candidates that take the TMA kernel (LoRA's joint mode). more:
    candidates beside the GEMM's own (LoRA's segmented shrink). fits: only the candidates
    it accepts (LoRA's spread mode: one wave); the untuned default may not be one.
    plain: plain layers, which also time the streaming kernel's and the TMA-store tiles
    (see candidates); residual: the layer adds one, unaligned: its rows are not 16-byte
    aligned (see candidates; the caller keys its tuning on both through ``extra``).

    See ``fuseml.ops._tune.choose``: memo, then the on-disk table, then tuning.
    """
    m = x.shape[0]
    if type(m) is not int or type(n) is not int or type(k) is not int:
        # Symbolic sizes (torch.compile with dynamic shapes): no bucket to look up.
        hint = m if type(m) is int else 64
        return default_config(
            hint, int(n) if type(n) is int else 128, int(k) if type(k) is int else 128, x.dtype
        )
    precision = dot_precision(x.dtype)
    bucket = _tune.m_bucket(m)
    memo_key = (op, x.dtype, precision, bucket, n, k, extra, x.device)
    cfg = _tune.memoized(memo_key)  # every call: keep this path short
    if cfg is not None:
        return cfg

    def text_key() -> str:
        return (
            f"{op}:{str(x.dtype)[6:]}:{precision}:m{bucket}:n{n}:k{k}{':' + extra if extra else ''}"
        )

    def bench(c: dict) -> float:
        return tuning_ms(_tune.gpu_time_ms(lambda: launch(c)), c, loop, m, plain)

    def listed() -> list[dict]:
        own = [
            c for c in candidates(
                m, n, k, x.dtype, loop, plain=plain, residual=residual, unaligned=unaligned
            )
            if not tma_only or takes_tma(loop, c)
        ]  # fmt: skip
        return [c for c in own if fits is None or fits(c)] + list(more)

    return _tune.choose(
        memo_key,
        x.device,
        text_key,
        listed,
        bench,
        default_config(m, n, k, x.dtype),
        can_time=x.is_cuda and not is_fake(x),
        run=launch,
    )
