"""The LoRA modes of ``fuseml.ops.lora_linear`` and their launches: the tuned choice
between modes, and how each mode runs the shrink (x @ A^T) and the main GEMM launch (see
``fuseml.ops.gemm`` for the modes themselves)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fuseml.ops import gemm
from fuseml.ops._utils import next_pow2
from fuseml.ops.gemm import launch as _gemm
from fuseml.ops.linear import linear_rows

TMA_MAX_R = 64  # stacked LoRA columns the TMA kernel's fp32 epilogue takes (see lora_rows)


class Force(NamedTuple):
    """What a caller forces on every GEMM launch of one fused layer (``LoraPath``'s loop
    and config): loop "auto" | "tma" | "ptr" (as ``main_loop``'s force); config a launch
    config taken instead of the tuned one (None: tuned)."""

    loop: str = "auto"
    config: dict | None = None

    def choose(self, *args, **kwargs) -> dict:
        """``config``, else ``_gemm.choose_config(*args, **kwargs)``."""
        return self.config or _gemm.choose_config(*args, **kwargs)


AUTO = Force()


def main_loop(x2: torch.Tensor, weight: torch.Tensor, traced: bool, force: str = "auto") -> int:
    """The main loop of a GEMM of x2 by weight: ``_gemm.gemm_loop``'s choice, or the one
    ``force`` names ("tma": the TMA kernel where the layout allows it and the call is not
    traced; "ptr": the pointer kernel)."""
    return _gemm.gemm_loop(x2, weight, traced, force)


def _tuned_mode(
    args: tuple,
    loop: int,
    default: int,
    overlap: bool = True,
    wide: bool = False,
    force: Force = AUTO,
) -> int:
    """The LoRA mode for this shape bucket, from the tuning cache, else each timed whole
    (with its own tuned tiles) and the fastest kept: LORA_IN_LOOP, LORA_EXPAND with its
    launches overlapped, or LORA_JOINT where it can run; without ``overlap`` (rows past
    IN_LOOP_MAX_M), LORA_EXPAND in stream order or LORA_JOINT. ``wide``: a stack past
    IN_LOOP_MAX_R columns (several adapters), where in-loop and joint cannot run: the
    overlapped LORA_EXPAND or LORA_SPREAD where it can run. (The spread launch is offered
    to wide stacks only: for one adapter it lost at every size measured, and each mode
    timed adds to a first call.) force: for the launches timed."""
    from fuseml.ops import _tune

    _out, x2, weight, *_rest, ids, _code, _traced = args
    m, k = x2.shape
    n = weight.shape[0]
    bucket = _tune.m_bucket(m)
    multi = "m" if ids is not None else ""
    # Keyed on the stacked width itself, not r_pad: the launches each mode runs are tuned
    # per width (the shrink's N), and timing the modes is what tunes them eagerly. Keyed on
    # r_pad, rank 8 and rank 16 would share the choice, and a rank-16 layer whose eager
    # call found it made would be tuned first inside a graph capture, which fails there.
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
        return _tune.gpu_time_ms(lambda: _run_mode(cfg["LORA"], loop, overlap, *args, force=force))

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
    """Which configs the spread mode can launch (``gemm.spread_fits``: one wave, and
    shared memory for A's slice beside the main loop's buffers)."""
    m = x2.shape[0]
    r_pad = max(16, next_pow2(a_stacked.shape[0]))  # as launch_linear pads it
    sms = _gemm.persistent_programs(x2)
    es = x2.element_size()
    return lambda c: gemm.spread_fits(c, m, n, r_pad, es, sms)


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
    traced, *, force: Force = AUTO, fast: bool = False,
) -> None:  # fmt: skip
    """Writes the fused layer to ``out`` in LoRA mode ``mode`` (see fuseml.ops.gemm); pdl:
    the expand mode's two launches overlap; force: the loop (the shrink's and the
    precomputed x @ A^T's, and in-loop on the TMA kernel where it names "tma") and the
    config of every launch; fast: the main launch is offered to the eager fast path."""
    k = x2.shape[1]
    n = weight.shape[0]
    r = a_stacked.shape[0]
    r_pad = max(16, next_pow2(r))
    xa = None
    if mode == _gemm.LORA_IN_LOOP:
        if loop != _gemm.LOOP_PTR:
            # In-loop inside the TMA kernel (A through a descriptor): a tuning candidate for
            # decode-like rows (LOOP_TUNED), or forced (force.loop "tma"); otherwise in-loop
            # takes the pointer kernel.
            forced = loop == _gemm.LOOP_TMA and force.loop == "tma"
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
                traced, loop, force,
            )  # fmt: skip
            return
        xa = _shrink(x2, a_stacked, rank, scaling, scales, ids, traced, force)
    else:  # precomputed: x @ A^T in float32, by the same kernel; the epilogue scales, masks
        xa = linear_rows(
            x2, a_stacked, None, None, 1.0, 0, traced=traced, out_dtype=torch.float32,
            loop=force.loop, config=force.config,
        )  # fmt: skip
        if r_pad > TMA_MAX_R:
            # More than one epilogue step of the fp32 mode overflows the TMA kernel's
            # shared memory (466 KiB asked for 16 adapters x rank 16).
            loop = _gemm.LOOP_PTR

    # (one launch, or the expand mode's in stream order: nothing overlaps from here on)
    run, extra = _main_launch(
        mode, loop, False, out, x2, weight, b, a_stacked, b_stacked, xa, ids, scales, scaling,
        rank, code, traced,
    )  # fmt: skip
    joint = mode == _gemm.LORA_JOINT
    if joint and not pdl:
        # Past IN_LOOP_MAX_M rows (the joint mode runs without overlap only there): the
        # tile the expand mode's main launch tuned (the same GEMM, timed first by
        # _tuned_mode). Tuning the joint launch's own added seconds to a first call (4.6 s
        # at 4096 rows, rank 64) for a tile that lost to the expand mode.
        expand, expand_extra = _main_launch(
            _gemm.LORA_EXPAND, loop, False, out, x2, weight, b, a_stacked, b_stacked, xa,
            ids, scales, scaling, rank, code, traced,
        )  # fmt: skip
        run(force.choose("linear", x2, n, k, expand, expand_extra, loop))
        return
    if mode == _gemm.LORA_SPREAD:
        fits = _spread_fits(x2, n, a_stacked)
        cfg = force.choose("linear", x2, n, k, run, extra, loop, tma_only=True, fits=fits)
        if not fits(cfg):  # the untuned default (inside a capture, say): the first that fits
            cfg = _spread_configs(loop, x2, n, a_stacked)[0]
        run(cfg)
        return
    run(force.choose("linear", x2, n, k, run, extra, loop, tma_only=joint), fast=fast)


def _main_launch(
    mode, loop, pdl, out, x2, weight, b, a_stacked, b_stacked, xa, ids, scales, scaling, rank,
    code, traced,
):  # fmt: skip
    """(launch(config, fast=False), tuning-key suffix) of the fused layer's main launch in
    LoRA mode ``mode`` (xa: xs for the expand mode, x @ A^T for the precomputed one, else
    None); fast: see ``_gemm.launch_linear``."""
    r_pad = max(16, next_pow2(a_stacked.shape[0]))

    def run(cfg: dict, fast: bool = False) -> None:
        _gemm.launch_linear(
            out, x2, weight, b, None, 1.0, code, cfg,
            lora=mode, lora_a=a_stacked, lora_b=b_stacked, xa=xa, ids=ids, scales=scales,
            lora_scale=scaling, rank=rank, traced=traced,
            tma=mode in (_gemm.LORA_JOINT, _gemm.LORA_SPREAD) or _gemm.takes_tma(loop, cfg),
            pdl=pdl, fast=fast,
        )  # fmt: skip

    return run, f"lora{mode}r{r_pad}{'m' if ids is not None else ''}{_gemm.loop_key(loop)}"


def _overlapped_expand(
    out, x2, weight, b, a_stacked, b_stacked, rank, scaling, scales, ids, code, traced, loop,
    force=AUTO,
) -> None:  # fmt: skip
    """The expand mode's two launches overlapped (programmatic dependent launch): the
    shrink writes xs while the main launch streams W, which waits for xs only before its
    last K steps. Both tiles are tuned as the pair runs: the shrink's programs hold SMs
    that the main launch's programs then wait for, so neither the fastest shrink alone
    nor the fastest main launch alone makes the fastest pair: a shrink tile fast alone
    can be slow beside the main launch (8.8 against 61.4 us, H100), and a main tile tuned
    alone can fill an SM's shared memory, leaving no room for a shrink program. So the
    tiles are chosen in three steps: the main tile alone, the shrink's tile behind it,
    and, for mixed batches of several adapters (whose shrink is as wide as all their
    ranks together), the main tile again behind that shrink. The pair of the first two
    steps is among the third's candidates, so it can only keep or better it (timing the
    main tile behind the shrink's untuned default instead chose slower tiles). A single
    adapter's shrink (one rank wide) skips the third step, which would only add timing
    to a first call. See docs/performance/lora.md."""
    m, k = x2.shape
    n = weight.shape[0]
    r = a_stacked.shape[0]
    xs = torch.empty((m, r), dtype=x2.dtype, device=x2.device)
    main, extra = _main_launch(
        _gemm.LORA_EXPAND, loop, True, out, x2, weight, b, a_stacked, b_stacked, xs, ids,
        scales, scaling, rank, code, traced,
    )  # fmt: skip
    main_alone = force.choose("linear", x2, n, k, main, extra, loop)
    shrink, shrink_loop = _shrink_launch(
        xs, x2, a_stacked, rank, scaling, scales, ids, traced, True, force.loop
    )

    def pair(cfg: dict) -> None:
        shrink(cfg)
        main(main_alone)

    shrink_extra = (
        f"shrinkpdl{'m' if ids is not None else ''}{_gemm.loop_key(shrink_loop)}"
        f":n{n}{_gemm.loop_key(loop)}"
    )
    shrink_cfg = force.config or _shrink_config(
        x2, a_stacked, ids, rank, pair, shrink_extra, shrink_loop
    )

    def main_pair(cfg: dict) -> None:
        shrink(shrink_cfg)
        main(cfg)

    main_cfg = main_alone
    if ids is not None and r > rank:
        main_cfg = force.choose("linear", x2, n, k, main_pair, extra + "pair", loop)
    shrink(shrink_cfg)
    main(main_cfg)


def _expand_tma(r: int, b_stacked: torch.Tensor) -> bool:
    """Can the TMA kernel's expand mode read B and xs (R columns) through descriptors?
    (A 3-D B is read through its (adapters * out, rank) view.)"""
    if b_stacked.dim() == 3:
        b_stacked = b_stacked.reshape(-1, b_stacked.shape[-1])
    return r % 8 == 0 and _gemm.tma_eligible(b_stacked)


def _shrink(x2, a_stacked, rank, scaling, scales, ids, traced, force=AUTO) -> torch.Tensor:
    """xs = (x @ A^T) * scaling, each row keeping only its adapter's columns (MULTI), in
    x's dtype: the first launch of the expand mode in stream order (the rounding the
    unmerged chain does; ``_overlapped_expand`` runs its overlapped form)."""
    m = x2.shape[0]
    r = a_stacked.shape[0]
    xs = torch.empty((m, r), dtype=x2.dtype, device=x2.device)
    run, loop = _shrink_launch(
        xs, x2, a_stacked, rank, scaling, scales, ids, traced, False, force.loop
    )
    if m:
        extra = f"shrink{'m' if ids is not None else ''}{_gemm.loop_key(loop)}"
        run(force.config or _shrink_config(x2, a_stacked, ids, rank, run, extra, loop))
    return xs


def _shrink_launch(xs, x2, a_stacked, rank, scaling, scales, ids, traced, pdl, force_loop="auto"):
    """(launch(config) of the shrink into xs, its main loop choice)."""
    loop = main_loop(x2, a_stacked, traced, force_loop)

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
    more = gemm.SEGMENT_CONFIGS if ids is not None and r > rank else []
    return _gemm.choose_config("linear", x2, r, k, run, extra, loop, more=more)
