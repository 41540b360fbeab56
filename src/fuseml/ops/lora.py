"""``fuseml.ops.lora_linear``: a LoRA-adapted linear layer, unmerged, in one GEMM.

    out = act(x @ W^T + bias + scaling * (x @ A^T) @ B^T)        peft layouts: A (r, in),
                                                                  B (out, r)
Unmerged eager (peft) runs three GEMMs and an add: x @ W^T, x @ A^T, (.) @ B^T, each
writing to memory. Merging W' = W + s B A costs nothing per call but fixes one adapter
per weight copy. The fused kernel keeps the adapter separate and adds the rank-r term to
the GEMM's accumulator tiles (see ``fuseml.ops._gemm`` for the LoRA modes).

Multi-adapter: ``lora_a`` (adapters, r, in), ``lora_b`` (adapters, out, r) and an
``adapter_ids`` tensor giving each row's adapter (-1: base weight only). One launch
serves a mixed batch; the adapters are stacked along r so each row keeps its own columns.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fuseml.ops import _elementwise as ew
from fuseml.ops._utils import (
    check_same,
    check_tensor,
    compiled,
    fused_op,
    kept_derived,
    needs_dispatch,
    next_pow2,
)
from fuseml.ops.bias_act import activation_ref
from fuseml.ops.gemm import launch as _gemm
from fuseml.ops.linear import check_linear_args, linear_rows
from fuseml.runtime import resolve_backend

# In-loop LoRA (one launch) up to this many rows; above, x @ A^T is precomputed by a first
# small launch so the main GEMM does not redo it for every column tile (see _gemm). A first
# guess, not a measured crossover: on an H100 (rank 16, 4096 x 4096) the fused layer
# costs ~1% over the plain GEMM on both sides of it (NOTES.md).
IN_LOOP_MAX_M = 1024
IN_LOOP_MAX_R = 64  # stacked LoRA columns that fit beside the accumulator in registers

TMA_MAX_R = 64  # stacked LoRA columns the TMA kernel's fp32 epilogue takes (see lora_rows)
# Stacked columns of the expand mode (extra K steps of 64 through descriptors). H100, M = K
# = N = 4096, 16 adapters x rank 16: 257 us vs 301 for the pointer kernel, 1.17x one
# adapter (NOTES.md).
EXPAND_MAX_R = 256


def _scale_list(scaling, n: int) -> list[float]:
    if isinstance(scaling, torch.Tensor):
        return [float(v) for v in scaling.reshape(-1).tolist()]
    if isinstance(scaling, numbers.Real):
        return [float(scaling)] * n
    return [float(v) for v in scaling]


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
) -> torch.Tensor:
    """The fused layer for validated inputs in stacked form.

    a_stacked (R, in) and b_stacked (out, R) or (adapters, out, rank), R = adapters x rank,
    contiguous (see ``stack_adapters``); scales
    (adapters,) float32 or None (then ``scaling`` for all); adapter_ids (M,) or None.
    """
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
    loop = _gemm.gemm_loop(x2, weight, traced) if r_pad <= EXPAND_MAX_R else _gemm.LOOP_PTR
    small = type(m) is not int or m <= IN_LOOP_MAX_M
    if loop == _gemm.LOOP_TUNED and m >= _gemm.TMA_MIN_M:
        loop = _gemm.LOOP_TMA  # narrow outputs (see TMA_TUNED_N): LoRA keeps the TMA modes
    pdl = small and r_pad <= EXPAND_MAX_R and _gemm.pdl_available(x2, traced)
    args = (out, x2, weight, b, a_stacked, b_stacked, rank, scaling, scales, ids, code, traced)
    if pdl and r_pad <= IN_LOOP_MAX_R:
        # Either one launch (in-loop: every column tile redoes x @ A^T) or the overlapped
        # shrink + expand launches: which has the shorter GPU time depends on the kernel
        # and tile the GEMM takes at this size (H100, 4096 x 4096, rank 16: expand 13.8 vs
        # 23.7 us at M = 1, in-loop 25.8 vs 36.1 us at M = 256 on the pointer kernel), so
        # it is measured once per shape bucket, as tiles are. That choice is for calls
        # captured into a CUDA graph, where only GPU time counts. An eager call at these
        # sizes is bound by host time, where one launch beats two (H100 host, M = 1: 87 vs
        # 320 us per call): it takes the in-loop mode. (The first, eager call of a bucket
        # measures both, so a later capture finds the choice made.)
        default = _gemm.LORA_IN_LOOP if loop == _gemm.LOOP_PTR else _gemm.LORA_EXPAND
        mode = _tuned_mode(args, loop, default)
        if not capturing(x2):
            mode = _gemm.LORA_IN_LOOP
    elif pdl:
        # Wide stacks (several adapters): the overlapped pair, or the spread launch (one
        # launch, each row tile's xs computed in slices by its own column tiles; H100,
        # 4096 x 4096, 16 adapters x rank 16 at 256 rows: 26.5 against 32.8 us, NOTES.md)
        mode = _tuned_mode(args, loop, _gemm.LORA_EXPAND, wide=True)
    elif small and r_pad <= IN_LOOP_MAX_R:
        mode = _gemm.LORA_IN_LOOP
    elif loop == _gemm.LOOP_TMA and _expand_tma(r, b_stacked):
        # Above IN_LOOP_MAX_M rows the expand mode's launches run in stream order: the
        # overlap measured slower there (H100, M = 4096, rank 16: 223.9 vs 209.0 us), its
        # main kernel's persistent programs taking SMs the shrink needs. The joint launch
        # gives the shrink SMs of its own (where the tiles' rounds leave some), and the
        # tiles wait only for their own rows of xs: timed against it per shape bucket.
        mode = _gemm.LORA_EXPAND
        if r_pad <= IN_LOOP_MAX_R and _joint_ok(loop, a_stacked):
            mode = _tuned_mode(args, loop, mode, overlap=False)
    else:
        mode = _gemm.LORA_PRECOMPUTED
    _run_mode(mode, loop, pdl, *args)
    return out.view(*x.shape[:-1], n)


def capturing(x: torch.Tensor) -> bool:
    """Is this call being captured into a CUDA graph (on x's current stream)?"""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _tuned_mode(
    args: tuple, loop: int, default: int, overlap: bool = True, wide: bool = False
) -> int:
    """The LoRA mode for this shape bucket, from the tuning cache, else each timed whole
    (with its own tuned tiles) and the fastest kept: LORA_IN_LOOP, LORA_EXPAND with its
    launches overlapped, or LORA_JOINT where it can run; without ``overlap`` (rows past
    IN_LOOP_MAX_M), LORA_EXPAND in stream order or LORA_JOINT. ``wide``: a stack past
    IN_LOOP_MAX_R columns (several adapters), where in-loop and joint cannot run: the
    overlapped LORA_EXPAND or LORA_SPREAD where it can run. (The spread launch is offered
    to wide stacks only: for one adapter it lost at every size measured, H100, 4096 x
    4096, ranks 8 to 64 at 64 to 512 rows, by 5-30%, and each mode timed adds to a first
    call.)"""
    from fuseml.ops import _tune

    _out, x2, weight, *_rest, ids, _code, _traced = args
    m, k = x2.shape
    n = weight.shape[0]
    bucket = _tune.m_bucket(m)
    multi = "m" if ids is not None else ""
    # Keyed on the stacked width itself, not r_pad: the launches each mode runs are tuned
    # per width (the shrink's N), and timing the modes is what tunes them eagerly. Under
    # r_pad, rank 8 and rank 16 shared the choice, so a rank-16 layer whose eager call
    # found it made was first tuned inside a graph capture (which failed there).
    r = args[4].shape[0]
    memo_key = ("loramode", x2.dtype, bucket, n, k, r, multi, loop, x2.device)

    def spread_ok() -> bool:  # (on a memo miss only: it lists candidates)
        return wide and overlap and _spread_ok(loop, x2, n, args[4])

    def text_key() -> str:
        # (a table entry from before the spread mode existed does not answer for it)
        return (
            f"loramode:{str(x2.dtype)[6:]}:m{bucket}:n{n}:k{k}:r{r}{multi}{_gemm.loop_key(loop)}"
            f"{':s' if spread_ok() else ''}"
        )

    def bench(cfg: dict) -> float:
        return _tune.gpu_time_ms(lambda: _run_mode(cfg["LORA"], loop, overlap, *args))

    def modes() -> list[dict]:
        found = [{"LORA": _gemm.LORA_EXPAND}]
        if overlap and not wide:
            found.insert(0, {"LORA": _gemm.LORA_IN_LOOP})
        if _joint_ok(loop, args[4]) and not wide:
            found.append({"LORA": _gemm.LORA_JOINT})
        if spread_ok():
            found.append({"LORA": _gemm.LORA_SPREAD})
        return found

    cfg = _tune.choose(
        memo_key, x2.device, text_key, modes, bench, {"LORA": default}, can_time=True,
    )  # fmt: skip
    return cfg["LORA"]


def _joint_ok(loop: int, a_stacked: torch.Tensor) -> bool:
    """Can the one-launch joint mode run (the TMA kernel, A read through a descriptor)?"""
    return loop != _gemm.LOOP_PTR and _gemm.tma_eligible(a_stacked)


def _spread_fits(x2: torch.Tensor, n: int, a_stacked: torch.Tensor):
    """Which configs the spread mode can launch (``_gemm.spread_fits``: one wave, and
    shared memory for A's slice beside the main loop's buffers)."""
    m = x2.shape[0]
    r_pad = max(16, next_pow2(a_stacked.shape[0]))  # as launch_linear pads it
    sms = _gemm.persistent_programs(x2)
    es = x2.element_size()
    return lambda c: _gemm.spread_fits(c, m, n, r_pad, es, sms)


def _spread_configs(loop: int, x2: torch.Tensor, n: int, a_stacked: torch.Tensor) -> list:
    """The TMA-kernel candidates of this shape the spread mode can launch (_spread_fits)."""
    fits = _spread_fits(x2, n, a_stacked)
    cands = _gemm.candidates(x2.shape[0], n, x2.shape[1], x2.dtype, loop)
    return [c for c in cands if _gemm.takes_tma(loop, c) and fits(c)]


def _spread_ok(loop: int, x2: torch.Tensor, n: int, a_stacked: torch.Tensor) -> bool:
    """Can the spread mode run: the TMA kernel, A through a descriptor, and some TMA tile
    of this shape that fits one wave (few rows; see _spread_fits)?"""
    if not _joint_ok(loop, a_stacked) or type(x2.shape[0]) is not int:
        return False
    return bool(_spread_configs(loop, x2, n, a_stacked))


def _run_mode(
    mode, loop, pdl, out, x2, weight, b, a_stacked, b_stacked, rank, scaling, scales, ids, code,
    traced,
) -> None:  # fmt: skip
    """Writes the fused layer to ``out`` in LoRA mode ``mode`` (see fuseml.ops._gemm); pdl:
    the expand mode's two launches overlap."""
    k = x2.shape[1]
    n = weight.shape[0]
    r = a_stacked.shape[0]
    r_pad = max(16, next_pow2(r))
    xa = None
    if mode == _gemm.LORA_IN_LOOP:
        if loop != _gemm.LOOP_PTR:
            # In-loop inside the TMA kernel (A through a descriptor): a tuning candidate for
            # decode-like rows (LOOP_TUNED), or forced (FUSEML_GEMM=tma); otherwise in-loop
            # takes the pointer kernel.
            forced = loop == _gemm.LOOP_TMA and _gemm.gemm_mode() == "tma"
            if not (_gemm.tma_eligible(a_stacked) and (loop == _gemm.LOOP_TUNED or forced)):
                loop = _gemm.LOOP_PTR
    elif mode in (_gemm.LORA_JOINT, _gemm.LORA_SPREAD):
        # One launch (the TMA kernel only): joint, its first programs write xs (into a
        # buffer the launcher makes) on the SMs the GEMM's tiles leave free; spread, each
        # row tile's first column tiles write a slice of it from their K loop. The tiles
        # wait for their rows of xs after their K loop.
        pass
    elif mode == _gemm.LORA_EXPAND:
        # xs = scaled, masked x @ A^T in x's dtype from a first launch, then more K steps of
        # the main kernel (on the TMA kernel B and xs through descriptors). With pdl the
        # main kernel streams W while the shrink computes xs, and waits for xs only before
        # its last K steps (no column tile redoes x @ A^T, the in-loop mode's cost).
        if loop != _gemm.LOOP_PTR and not _expand_tma(r, b_stacked):
            loop = _gemm.LOOP_PTR
        if pdl:
            _overlapped_expand(
                out, x2, weight, b, a_stacked, b_stacked, rank, scaling, scales, ids, code,
                traced, loop,
            )  # fmt: skip
            return
        xa = _shrink(x2, a_stacked, rank, scaling, scales, ids, traced)
    else:  # precomputed: x @ A^T in float32, by the same kernel; the epilogue scales, masks
        xa = linear_rows(x2, a_stacked, None, None, 1.0, 0, traced=traced, out_dtype=torch.float32)
        if r_pad > TMA_MAX_R:
            # More than one epilogue step of the fp32 mode overflows the TMA kernel's
            # shared memory (H100: 466 KiB asked for 16 adapters x rank 16).
            loop = _gemm.LOOP_PTR

    # (one launch, or the expand mode's in stream order: nothing overlaps from here on)
    run, extra = _main_launch(
        mode, loop, False, out, x2, weight, b, a_stacked, b_stacked, xa, ids, scales, scaling,
        rank, code, traced,
    )  # fmt: skip
    joint = mode == _gemm.LORA_JOINT
    if joint and x2.shape[0] > IN_LOOP_MAX_M:
        # Many rows: the tile the expand mode's main launch tuned (the same GEMM, timed
        # first by _tuned_mode). Tuning the joint launch's own added 4.6 s to a first
        # call at 4096 rows, rank 64 (H100), for a tile that lost to the expand mode.
        expand, expand_extra = _main_launch(
            _gemm.LORA_EXPAND, loop, False, out, x2, weight, b, a_stacked, b_stacked, xa,
            ids, scales, scaling, rank, code, traced,
        )  # fmt: skip
        run(_gemm.choose_config("linear", x2, n, k, expand, expand_extra, loop))
        return
    if mode == _gemm.LORA_SPREAD:
        fits = _spread_fits(x2, n, a_stacked)
        cfg = _gemm.choose_config("linear", x2, n, k, run, extra, loop, tma_only=True, fits=fits)
        if not fits(cfg):  # the untuned default (inside a capture, say): the first that fits
            cfg = _spread_configs(loop, x2, n, a_stacked)[0]
        run(cfg)
        return
    run(_gemm.choose_config("linear", x2, n, k, run, extra, loop, tma_only=joint))


def _main_launch(
    mode, loop, pdl, out, x2, weight, b, a_stacked, b_stacked, xa, ids, scales, scaling, rank,
    code, traced,
):  # fmt: skip
    """(launch(config), tuning-key suffix) of the fused layer's main launch in LoRA mode
    ``mode`` (xa: xs for the expand mode, x @ A^T for the precomputed one, else None)."""
    r_pad = max(16, next_pow2(a_stacked.shape[0]))

    def run(cfg: dict) -> None:
        _gemm.launch_linear(
            out, x2, weight, b, None, 1.0, code, cfg,
            lora=mode, lora_a=a_stacked, lora_b=b_stacked, xa=xa, ids=ids, scales=scales,
            lora_scale=scaling, rank=rank, traced=traced,
            tma=mode in (_gemm.LORA_JOINT, _gemm.LORA_SPREAD) or _gemm.takes_tma(loop, cfg),
            pdl=pdl,
        )  # fmt: skip

    return run, f"lora{mode}r{r_pad}{'m' if ids is not None else ''}{_gemm.loop_key(loop)}"


def _overlapped_expand(
    out, x2, weight, b, a_stacked, b_stacked, rank, scaling, scales, ids, code, traced, loop
) -> None:  # fmt: skip
    """The expand mode's two launches overlapped (programmatic dependent launch): the
    shrink writes xs while the main launch streams W, which waits for xs only before its
    last K steps. Both tiles are tuned as the pair runs: the shrink's programs hold SMs
    that the main launch's programs then wait for, so neither the fastest shrink alone
    nor the fastest main launch alone makes the fastest pair. Shrink tiles (H100, 4096 x
    4096, 1024 rows, rank 16): 16 programs of 64 rows 8.8 us alone, 61.4 us with the main
    launch; 4 programs of 256 rows 22.0 us alone, 52.0 with it. Main tiles (256 rows, 16
    adapters): the one tuned alone (64 x 128 x 128, 4 stages: 192 KiB of shared memory)
    leaves no room for a shrink program beside it on an SM (NOTES.md). So the tiles are
    chosen in three rounds: the main tile alone, the shrink's tile behind it, and, for
    mixed batches of several adapters (whose shrink is as wide as all their ranks
    together), the main tile again behind that shrink. The pair of the first two rounds
    is among the third's candidates, so it can only keep or better it; timing the main
    tile behind the shrink's untuned default instead chose a tile that made 16 adapters
    at 1024 rows 14% slower. A single adapter's shrink (one rank wide) skips the third
    round (0.2-0.3 s of timing on a first call: its candidates are compiled already)."""
    m, k = x2.shape
    n = weight.shape[0]
    r = a_stacked.shape[0]
    xs = torch.empty((m, r), dtype=x2.dtype, device=x2.device)
    main, extra = _main_launch(
        _gemm.LORA_EXPAND, loop, True, out, x2, weight, b, a_stacked, b_stacked, xs, ids,
        scales, scaling, rank, code, traced,
    )  # fmt: skip
    main_alone = _gemm.choose_config("linear", x2, n, k, main, extra, loop)
    shrink, shrink_loop = _shrink_launch(
        xs, x2, a_stacked, rank, scaling, scales, ids, traced, True
    )

    def pair(cfg: dict) -> None:
        shrink(cfg)
        main(main_alone)

    shrink_extra = (
        f"shrinkpdl{'m' if ids is not None else ''}{_gemm.loop_key(shrink_loop)}"
        f":n{n}{_gemm.loop_key(loop)}"
    )
    shrink_cfg = _shrink_config(x2, a_stacked, ids, rank, pair, shrink_extra, shrink_loop)

    def main_pair(cfg: dict) -> None:
        shrink(shrink_cfg)
        main(cfg)

    main_cfg = main_alone
    if ids is not None and r > rank:
        main_cfg = _gemm.choose_config("linear", x2, n, k, main_pair, extra + "pair", loop)
    shrink(shrink_cfg)
    main(main_cfg)


def _expand_tma(r: int, b_stacked: torch.Tensor) -> bool:
    """Can the TMA kernel's expand mode read B and xs (R columns) through descriptors?
    (A 3-D B is read through its (adapters * out, rank) view.)"""
    if b_stacked.dim() == 3:
        b_stacked = b_stacked.reshape(-1, b_stacked.shape[-1])
    return r % 8 == 0 and _gemm.tma_eligible(b_stacked)


def _shrink(x2, a_stacked, rank, scaling, scales, ids, traced) -> torch.Tensor:
    """xs = (x @ A^T) * scaling, each row keeping only its adapter's columns (MULTI), in
    x's dtype: the first launch of the expand mode in stream order (the rounding the
    unmerged chain does; ``_overlapped_expand`` runs its overlapped form)."""
    m = x2.shape[0]
    r = a_stacked.shape[0]
    xs = torch.empty((m, r), dtype=x2.dtype, device=x2.device)
    run, loop = _shrink_launch(xs, x2, a_stacked, rank, scaling, scales, ids, traced, False)
    if m:
        extra = f"shrink{'m' if ids is not None else ''}{_gemm.loop_key(loop)}"
        run(_shrink_config(x2, a_stacked, ids, rank, run, extra, loop))
    return xs


def _shrink_launch(xs, x2, a_stacked, rank, scaling, scales, ids, traced, pdl):
    """(launch(config) of the shrink into xs, its main loop choice)."""
    loop = _gemm.gemm_loop(x2, a_stacked, traced)

    def run(cfg: dict) -> None:
        if cfg.get("SEGMENTS"):
            _gemm.launch_shrink_segments(
                xs, x2, a_stacked, ids, scales, scaling, rank, cfg, traced=traced, pdl=pdl
            )
            return
        _gemm.launch_linear(
            xs, x2, a_stacked, None, None, 1.0, 0, cfg,
            lora=_gemm.LORA_SHRINK, ids=ids, scales=scales, lora_scale=scaling, rank=rank,
            traced=traced, tma=_gemm.takes_tma(loop, cfg), pdl=pdl,
        )  # fmt: skip

    return run, loop


def _shrink_config(x2, a_stacked, ids, rank, run, extra: str, loop: int) -> dict:
    """The shrink's tuned config: the GEMM's candidates, and for a mixed batch of several
    adapters the segmented shrink's (``_gemm.launch_shrink_segments``)."""
    k = x2.shape[1]
    r = a_stacked.shape[0]
    more = _gemm.SEGMENT_CONFIGS if ids is not None and r > rank else []
    return _gemm.choose_config("linear", x2, r, k, run, extra, loop, more=more)


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
def stack_adapters(
    lora_a: torch.Tensor, lora_b: torch.Tensor, *, in_place: bool = True
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """peft layouts -> the kernel's stacked form: A (R, in), B (out, R) or (n, out, r), and
    the rank.

    Single: A (r, in), B (out, r). Multi: A (n, r, in), B (n, out, r) -> R = n * r, adapter
    a owning columns [a*r, (a+1)*r). With ``in_place`` a multi-adapter B is read as given
    (no copy) where it is contiguous and r is a power of two >= 16; else it is stacked
    into (out, R) by a copy, kept between eager calls (``kept_derived``). The stacked copy makes
    the faster kernels (H100, 16 adapters x rank 16, 4096 x 4096: the main launch 13.6 vs
    15.5 us at 16 rows, 29.9 vs 33.3 at 256: its B steps go 64 columns at a time instead
    of one adapter's 16), the copy itself 4 us a call: modules, which keep their stacked
    form, pass ``in_place=False``; the functional op reads B in place up to B3D_MAX_M rows
    (a CUDA graph of it then holds no copy).
    """
    if lora_a.dim() == 2:
        return lora_a.contiguous(), lora_b.contiguous(), lora_a.shape[0]
    n, r, k = lora_a.shape
    a = lora_a.reshape(n * r, k).contiguous()  # a view when lora_a is contiguous
    if in_place and B3D_MIN_RANK <= r == next_pow2(r) and lora_b.is_contiguous():
        return a, lora_b, r
    # 4 us of a 19 us layer at 16 rows with 16 adapters of rank 16 (H100, CUDA graph)
    b = kept_derived(
        lora_b, "stacked", lambda t: t.permute(1, 0, 2).reshape(t.shape[1], n * r).contiguous()
    )
    return a, b, r


B3D_MIN_RANK = 16  # tl.dot's shortest K: the TMA kernel steps through a 3-D B by adapter
# Rows up to which the functional op reads a multi-adapter B in place; above, the stacked
# copy (4 us) costs less than the slower kernels (H100, 16 adapters x rank 16, CUDA graph:
# 21.6 vs 23.8 us at 16 rows, 66.5 vs 67.5 at 1024, 255.4 vs 244.2 at 4096; 4 adapters
# 237.4 vs 219.9 at 4096)
B3D_MAX_M = 1024


def check_adapter_ids_tensor(op: str, x: torch.Tensor, adapter_ids) -> None:
    """An int32/int64 tensor on x's device with x's leading shape (no host sync)."""
    if not isinstance(adapter_ids, torch.Tensor) or adapter_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(
            f"{op}: adapter_ids must be an int32 or int64 tensor, got {adapter_ids!r:.60}"
        )
    if adapter_ids.device != x.device:
        raise ValueError(f"{op}: adapter_ids is on {adapter_ids.device} but x is on {x.device}")
    if tuple(adapter_ids.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{op}: adapter_ids must have shape {tuple(x.shape[:-1])} (one id per row of x), "
            f"got {tuple(adapter_ids.shape)}"
        )


def check_adapter_ids(op: str, adapter_ids: torch.Tensor, n_adapters: int) -> None:
    """Every id in [-1, n_adapters): a host sync (skip with check_ids=False)."""
    if adapter_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(adapter_ids))
    if lo < -1 or hi >= n_adapters:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"{op}: adapter_ids must be in [-1, {n_adapters}) (-1: no adapter; there are "
            f"{n_adapters} adapters), found {bad}"
        )


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
) -> torch.Tensor:
    """act(x @ W^T + bias + scaling * (x @ A^T) @ B^T) in one fused GEMM, adapter unmerged.

    Single adapter: lora_a (r, in), lora_b (out, r), scaling a number (peft's
    lora_alpha / r). Multi-adapter: lora_a (adapters, r, in), lora_b (adapters, out, r),
    scaling one number or one per adapter, adapter_ids (...,) int tensor with x's leading
    shape, -1 meaning no adapter for that row. check_ids validates the ids (one host sync).
    Forward only on the fused backends (inference); backend='eager' for training.
    """
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
        lora_a, lora_b, in_place=type(rows) is not int or rows <= B3D_MAX_M
    )
    scales = None
    scale = 1.0
    if adapter_ids is not None and not isinstance(scaling, numbers.Real):
        scales = device_scales(scaling, lora_a.shape[0], x.device)
    else:
        scale = float(scaling)
    return lora_stacked(x, weight, bias, a_s, b_s, rank, scale, scales, adapter_ids, activation)


_SCALES: dict[tuple, torch.Tensor] = {}  # (values, device) -> float32 tensor, reused


def device_scales(scaling, n: int, device: torch.device) -> torch.Tensor:
    """Per-adapter scalings as a float32 tensor on ``device``, without a copy per call:
    a tensor already there is used as is; a list is uploaded once and kept (a host-to-
    device copy per call would also keep the call out of CUDA graphs)."""
    if isinstance(scaling, torch.Tensor) and scaling.device == device:
        return scaling.reshape(-1).to(torch.float32)
    values = tuple(_scale_list(scaling, n))
    key = (values, device)
    found = _SCALES.get(key)
    if found is None:  # (never evicted: a CUDA graph may read it; a few bytes each)
        found = _SCALES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return found


def lora_stacked(
    x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, activation
) -> torch.Tensor:
    """The fused call on pre-stacked adapters (modules keep the stacked form)."""
    if needs_dispatch(x, weight, bias, a_stacked, b_stacked, scales, adapter_ids):
        return torch.ops.fuseml.lora_linear(
            x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, activation
        )
    code = ew.ACT_CODE[activation]
    return lora_rows(
        x, weight, bias, a_stacked, b_stacked, rank, scaling, scales, adapter_ids, code
    )
