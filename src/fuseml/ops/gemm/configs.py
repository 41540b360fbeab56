"""Candidate launch configs of the GEMM kernels, as data, and the shape pruning that
picks from them."""

from __future__ import annotations

import torch

from fuseml.ops import _tune
from fuseml.ops._utils import cdiv, next_pow2

TMA_MIN_M = 512  # rows from which plain linear layers default to the TMA kernel (below:
# few tiles per SM, and the measured win is on the compute-bound shapes; see NOTES.md)
TMA_TUNED_MAX_M = 256  # up to this many rows the tuner chooses TMA or pointer loads: with
# narrow tiles the TMA kernel read W at up to 1.16x cuBLAS (H100, M = 16, NOTES.md); at
# M = 256 the pointer kernel's best tile took 23.4 us against cuBLAS's 20.4 (4096 x 4096)
TMA_TUNED_N = 64  # from TMA_MIN_M rows, outputs this narrow are tuned over both kernels:
# the pointer kernel's smaller tiles won at 64 -> 16 (H100 suite, 512 / 4096 / 65536 rows:
# 2.6 / 2.9 / 6.3 us against the TMA kernel's 2.9 / 3.2 / 6.5), the TMA kernel at 256 -> 64
LOOP_PTR, LOOP_TMA, LOOP_TUNED = 0, 1, 2  # gemm_loop's answers


def _cfg(bm, bn, bk, warps, stages, group=8) -> dict:
    return {
        "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip


# Candidates for 16-bit inputs (fp32 halves BLOCK_K). Large M: the tiles of the Triton
# matmul tutorial's Hopper list plus two narrower ones; small M (decode-like, the weight
# read dominates): narrow N tiles so that N / BLOCK_N programs cover the SMs, long K steps.
_LARGE = [
    _cfg(128, 256, 64, 8, 3), _cfg(128, 256, 64, 8, 4), _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 4, 4), _cfg(64, 256, 64, 8, 4),
    _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4),
    # 6 stages: 512 rows of 4096 x 4096 bf16 (TMA kernel, W rotating past the L2, H100)
    # 29.8 us against 31.0 for 4 stages and cuBLAS's 30.3 (with a separate GELU)
    _cfg(128, 128, 64, 4, 6),
]  # fmt: skip
_SMALL = [  # (BLOCK_N, BLOCK_K, warps, stages); BLOCK_M from M. Narrow N tiles and long K
    # steps keep more of W in flight per SM when a few rows leave the tensor cores idle.
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 5),
    (128, 64, 4, 4), (128, 128, 8, 3),
]  # fmt: skip
_SMALL_TMA = [  # the same for the TMA kernel (LOOP_TUNED): the best of a wider sweep,
    # H100, 4096 -> 4096 bf16 at M = 1, 16, 64 (scripts/probe_gemm.py small, NOTES.md).
    # The last two keep 192 KiB in flight at 64 rows, where the 5-stage tiles above do not
    # fit: 15.4 / 15.8 us against 16.4 for 32 x 256 / 3 stages (W rotating; cuBLAS 17.4)
    (64, 256, 4, 5), (64, 256, 4, 3), (32, 512, 4, 5), (32, 256, 4, 5), (32, 256, 4, 3),
    (32, 256, 4, 4), (32, 128, 4, 8),
]  # fmt: skip


_MID_TMA = [  # TMA-kernel candidates for 65 to TMA_TUNED_MAX_M rows (LOOP_TUNED): tiles
    # that give 128-256 programs at M = 256, N = 4096, beside the pointer kernel's _LARGE.
    # The deep ones keep 128-192 KiB of x and W in flight per SM: at 256 rows the loop
    # waits on W streaming from HBM, not on the tensor cores (H100, 4096 x 4096 bf16, W
    # rotating past the L2: 64 x 128 x 128 with 4 stages 19.6 us, 64 x 128 x 64 with 8
    # stages 20.5, against 25.2 for 4 stages of 64 and cuBLAS's 21.9; NOTES.md)
    _cfg(64, 128, 64, 4, 4), _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 128, 4, 4),
    _cfg(64, 128, 128, 4, 4), _cfg(64, 128, 64, 4, 8), _cfg(128, 64, 128, 4, 4),
]  # fmt: skip


_SKINNY_N = [  # (BLOCK_M, BLOCK_K, warps, stages) for many rows and N <= 256 (LoRA's
    # x @ A^T; BLOCK_N at most 64): short row tiles, so that the programs cover the SMs
    # (H100, M = 4096, N = 16: 64 x 16 tiles left half the SMs idle, 23 us for a 32 MiB
    # read; M = 1024, 16 adapters x rank 16 = 256 columns: 64 x 128 tiles made 32 programs)
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3),
    # Few, tall tiles: LoRA's shrink overlapped with the main launch (see
    # fuseml.ops.lora._overlapped_expand) must leave the SMs to it (1024 rows: 4 programs)
    (256, 64, 8, 4), (256, 128, 8, 3),
]  # fmt: skip
_NARROW_N = [  # (BLOCK_M, BLOCK_K, warps, stages) with 32-column tiles, for many rows and
    # 33-64 output columns (the DLRM's 256 -> 64): 64-row tiles of all 64 columns make
    # one program per 64 rows, 64 of them at 4096 rows on 132 SMs. H100, 256 -> 64 at 4096
    # rows, bias + GELU-tanh, 45 weight sets rotating past the L2 (scripts/probe_gemm.py
    # cands, NOTES.md): TMA 64 x 32 x 128 / 3 stages 3.8 us, 64 x 32 x 256 / 2 stages 3.9,
    # against 4.1 for the best 64-column tile (cuBLAS F.linear + GELU 5.9)
    (64, 128, 4, 3), (64, 256, 4, 2),
]  # fmt: skip
_SHORT_K = [  # (BLOCK_M, BLOCK_N, warps, stages) for many rows and a K of one step (the
    # DLRM's 13 -> 512, 64 -> 16): the kernel is about one round trip to memory long, so
    # more, smaller tiles (H100, 13 -> 512 at 512 rows: 64 x 128 tiles, 32 programs, took
    # 5.4 us against cuBLASLt's 4.3)
    (64, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2), (128, 32, 4, 2),
]  # fmt: skip
_REG_PIPE = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps) of the pointer loop with its loads a
    # step early (REG_PIPE), for rows that are not 16-byte aligned (no asynchronous copies,
    # so Triton does not pipeline the loop). H100, 367 -> 512 bf16 + bias + ReLU at 4096
    # rows, graph replay (scripts/probe_unaligned.py): 128 x 128 x 32 / 8 warps 11.3 us
    # against 13.2 without; 128 x 64 x 64 16.9 against 61.6; cuBLASLt 27.7. Some tiles
    # lose with it (128 x 128 x 64: 20.0 against 13.6), so both are timed
    (128, 128, 32, 8), (128, 64, 64, 4), (128, 64, 32, 4), (64, 128, 32, 4), (64, 64, 64, 4),
]  # fmt: skip
_FEW_TILES = [  # 65+ rows where 128 x 128 tiles would not fill one wave (FEW_TILES_WAVE
    # programs): 64 x 64 tiles, 4x the programs. H100, 1024 -> 1024 at 512 rows, bias +
    # GELU-tanh, weights rotating over 8 sets (scripts/probe_gemm.py cands): TMA 64 x 64 x
    # 128 / 4 stages 5.4 us, 64 x 64 x 64 / 6 stages 6.3, against 7.6 for the best tile
    # before (128 x 64) and cuBLAS's 7.3 (F.linear + GELU); 32 programs of 128 x 128: 9.4
    _cfg(64, 64, 128, 4, 4), _cfg(64, 64, 64, 4, 6), _cfg(64, 64, 64, 4, 4),
]  # fmt: skip
_TMA_STORE = [  # TMA-kernel tiles whose epilogue stores through a descriptor in OUT_SUB
    # column slices (see _tma_store), the tile loop flattened (FLATTEN) even where a
    # program has one tile: plain layers from TMA_MIN_M rows (LOOP_TMA). H100, 1024 ->
    # 1024 at 4096 rows, bf16 + bias + ReLU, inputs rotating past the L2, graph replay
    # (scripts/probe_tma_store.py): 128 x 256 x 64 / 4 stages / 4 slices 15.4 us, 2 slices
    # 15.6, 3 stages 15.9; 256 x 128 17.0; 128 x 128 17.7; against 16.9 for the tuned
    # pointer-store tile (64 x 256 x 64 / 4 stages) and cuBLASLt's 15.4. The 4-stage 128 x
    # 256 tile does not fit beside a residual's tile (245,792 bytes, H100): the candidate
    # filter leaves it out of layers with one (see candidates)
    dict(_cfg(128, 256, 64, 8, 4), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(128, 256, 64, 8, 3), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(256, 128, 64, 8, 3), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(128, 128, 64, 8, 4), OUT_SUB=4, FLATTEN=True),
]  # fmt: skip
_STREAM = [  # (BLOCK_M, warps, stages, programs an SM) of _linear_stream_kernel, for many
    # rows, a K of one step up to STREAM_MAX_K and outputs up to STREAM_MAX_N wide, 16-bit:
    # the weight tile stays on chip and row tiles stream through it; BLOCK_N is min(N, 64).
    # The two of a sweep of eight that were fastest somewhere (H100, bias + GELU-tanh,
    # inputs rotating past the L2, graph replay; scripts/probe_gemm.py cands): 65536 x
    # 256 -> 64 17.5 us (64 rows, 1 an SM) against 17.7 for the best pointer tile; 4096 x
    # 13 -> 512 4.3 (32 rows, 4 an SM) against 4.6. Behind at 4096 x 256 -> 64 (4.7-5.8
    # against 3.8) and 65536 x 64 -> 16 (5.8-8.5 against 5.2), so the tuner decides.
    (64, 4, 3, 1), (32, 4, 3, 4),
]  # fmt: skip
STREAM_MIN_M = 512
STREAM_MAX_K = 256
STREAM_MAX_N = 512
SHORT_ROWS_MAX_N = 512  # outputs up to this wide also get 16-row tiles at 17-64 rows
FEW_TILES_WAVE = 132  # an H100 SXM's SM count: the candidate list is device-independent
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on Hopper (the largest)


def candidates(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    loop: int = LOOP_PTR,
    *,
    plain: bool = False,
    residual: bool = False,
    unaligned: bool = False,
) -> list[dict]:
    """Shape-pruned candidate configs (tile dims never far above the problem's, pipeline
    buffers within SMEM_LIMIT); with LOOP_TUNED also TMA-kernel configs (flagged "TMA")
    up to TMA_TUNED_MAX_M rows. plain (plain layers, not LoRA's launches): also
    ``_linear_stream_kernel``'s configs (flagged "STREAM", programs an SM) where the shape
    is one it serves, and with LOOP_TMA the tiles that store through a descriptor
    (``_TMA_STORE``); residual: the layer adds one (its tile's layout change takes shared
    memory beside a TMA-store tile's); unaligned: x's or W's rows are not 16-byte aligned
    (then the pointer loop also times the ``_REG_PIPE`` tiles)."""
    mb = max(16, _tune.m_bucket(m))
    cap_n = max(16, next_pow2(n))
    cap_k = max(16, next_pow2(k))
    if mb <= 64:
        # A narrow output at 17-64 rows: tiles of all the rows make N / BLOCK_N programs
        # (256 -> 64 at 64 rows: 1-4), so also 16-row tiles (4x more)
        rows = (mb, 16) if mb > 16 and n <= SHORT_ROWS_MAX_N else (mb,)
        base = [_cfg(bm, bn, bk, w, s) for bm in rows for bn, bk, w, s in _SMALL]
        if loop == LOOP_TUNED:
            base += [dict(_cfg(mb, bn, bk, w, s), TMA=True) for bn, bk, w, s in _SMALL_TMA]
    else:
        base = list(_LARGE)
        if cdiv(mb, 128) * cdiv(n, 128) < FEW_TILES_WAVE:
            base += _FEW_TILES
        if cap_n <= 256:
            base += [_cfg(bm, min(cap_n, 64), bk, w, s) for bm, bk, w, s in _SKINNY_N]
        if cap_n == 64:
            base += [_cfg(bm, 32, bk, w, s) for bm, bk, w, s in _NARROW_N]
        if cap_k <= 64:
            base += [_cfg(bm, bn, cap_k, w, s) for bm, bn, w, s in _SHORT_K]
        if unaligned and loop == LOOP_PTR and cap_k > 64:
            base += [dict(_cfg(bm, bn, bk, w, 1), REG_PIPE=True) for bm, bn, bk, w in _REG_PIPE]
        if loop == LOOP_TUNED and mb <= TMA_TUNED_MAX_M:
            base += [dict(c, TMA=True) for c in _MID_TMA]
        elif loop == LOOP_TUNED and n <= TMA_TUNED_N:  # from TMA_MIN_M rows: both kernels
            base += [dict(c, TMA=True) for c in base]
        if loop == LOOP_TMA and plain and dtype != torch.float32:
            # (16-bit only: measured there; a float32 layer with a residual asked for 311,352
            # bytes of shared memory on an H100, with one of these tiles or the same tile's
            # pointer stores: the failing test did not tell which)
            base += _TMA_STORE
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for c in base:
        c = dict(c)
        if dtype == torch.float32:
            c["BLOCK_K"] = max(16, c["BLOCK_K"] // 2)
        c["BLOCK_M"] = min(c["BLOCK_M"], mb)
        c["BLOCK_N"] = min(c["BLOCK_N"], cap_n)
        c["BLOCK_K"] = min(c["BLOCK_K"], cap_k)
        smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * es
        if c.get("OUT_SUB"):
            # slices of at least 16 columns; one slice's buffer (the output is x's dtype)
            # and the barriers beside the main loop's (offline, sm_90: 213,536 bytes for
            # 128 x 256 x 64 / 4 stages / 4 slices in bf16)
            c["OUT_SUB"] = max(1, min(c["OUT_SUB"], c["BLOCK_N"] // 16))
            smem += c["BLOCK_M"] * c["BLOCK_N"] // c["OUT_SUB"] * es + 1024
            if residual:  # 245,792 bytes with one for 128 x 256 x 64 / 4 stages (H100)
                smem += c["BLOCK_M"] * c["BLOCK_N"] * es // 2
        if c not in out and smem <= SMEM_LIMIT:
            out.append(c)
    if plain and es == 2 and m >= STREAM_MIN_M and cap_k <= STREAM_MAX_K and n <= STREAM_MAX_N:
        bn, bk = min(cap_n, 64), cap_k
        for bm, warps, stages, per_sm in _STREAM:
            # x's buffers, W's tile and the epilogue's layout change (a float32 tile, the
            # measured allocations: 245,760 bytes for 128 x 64 x 256 / 3 stages in bf16),
            # for every program an SM
            bm = min(bm, mb)
            if per_sm * ((stages * bm + bn) * bk * es + bm * bn * 4) <= SMEM_LIMIT:
                out.append(dict(_cfg(bm, bn, bk, warps, stages), STREAM=per_sm))
    return out


SEGMENT_CONFIGS = [  # launch_shrink_segments: short row blocks (each adapter's rows are
    # a fraction of the batch) and long, deep K steps: few programs each stream a long
    # run of x (16 rows x 4096 bf16: 128 KiB) and their adapter's A
    {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "SEGMENTS": True}
    for bm, bk, w, st in ((16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4))
]


def default_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """The untuned config: tuning off, interpreter, or torch.compile tracing."""
    bk = 32 if dtype == torch.float32 else 64
    return _cfg(
        min(128, max(16, _tune.m_bucket(m))),
        min(128, max(16, next_pow2(n))),
        min(bk, max(16, next_pow2(k))),
        4,
        3,
    )
