"""Candidate launch configs of the GEMM kernels as data, one table per kernel and row
range, and the shape pruning that picks from them (``candidates``). The tuner times the
candidates once per device and shape bucket (see ``fuseml.ops._tune``); why each table
holds what it holds: docs/performance/gemm.md."""

from __future__ import annotations

import torch

from fuseml.ops import _tune
from fuseml.ops._utils import cdiv, next_pow2

# Plain layers take the TMA kernel from this many rows: below, few tiles per SM
TMA_MIN_M = 512
# Up to this many rows the tuner times TMA and pointer loads: narrow TMA tiles read W fastest
TMA_TUNED_MAX_M = 256
# From TMA_MIN_M rows, outputs this narrow are tuned over both kernels (smaller pointer tiles)
TMA_TUNED_N = 64
# A plain layer whose eager call is bound by host time (up to TMA_TUNED_MAX_M rows, or a
# tile faster than TMA_HOST_BOUND_MS) repeats from C++ only on a pointer tile
# (fuseml.ops._fastcall); a TMA tile launches from Python (64 x 512 -> 256: 113 against 9
# us a call, H200). There a TMA tile is timed this much slower than it runs, and wins only
# by more (in a CUDA graph the cost is that margin at most). docs/performance/gemm.md.
TMA_HOST_BOUND_PENALTY = 1.25
TMA_HOST_BOUND_MS = 0.04
LOOP_PTR, LOOP_TMA, LOOP_TUNED = 0, 1, 2  # gemm_loop's answers
# cuBLASLt's own kernel (torch._addmm_activation: its GEMM with the bias + ReLU epilogue) is
# one more candidate of a plain layer with a bias and a ReLU or no activation, where cuBLAS
# computes as fuseml would (16-bit inputs, or float32 where TF32 is allowed), taken where it
# times faster (TF32 layers: 413 us against Triton's 698, 1024 -> 1024 at 65536 rows, H200).
# Its launch is Python's (no C++ repeat): at host-bound sizes it is timed
# TMA_HOST_BOUND_PENALTY slower, as TMA tiles are.
VENDOR = {"VENDOR": "cublaslt"}


def _cfg(bm, bn, bk, warps, stages, group=8) -> dict:
    return {
        "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip


# Tiles are for 16-bit inputs; float32 halves BLOCK_K (see candidates).

# 65+ rows: the Triton matmul tutorial's Hopper tiles, two narrower ones, and a 6-stage one
# that keeps W streaming at 512 rows of 4096 x 4096
_LARGE = [
    _cfg(128, 256, 64, 8, 3), _cfg(128, 256, 64, 8, 4), _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 4, 4), _cfg(64, 256, 64, 8, 4),
    _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4), _cfg(128, 128, 64, 4, 6),
]  # fmt: skip
# Up to 64 rows, (BLOCK_N, BLOCK_K, warps, stages): narrow N, long K keep W in flight per SM
_SMALL = [
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 5),
    (128, 64, 4, 4), (128, 128, 8, 3),
]  # fmt: skip
# Up to 64 rows on the TMA kernel (LOOP_TUNED), as _SMALL; the deepest keep 192 KiB in flight
_SMALL_TMA = [
    (64, 256, 4, 5), (64, 256, 4, 3), (32, 512, 4, 5), (32, 256, 4, 5), (32, 256, 4, 3),
    (32, 256, 4, 4), (32, 128, 4, 8),
]  # fmt: skip
# 65 to TMA_TUNED_MAX_M rows on the TMA kernel: 128-256 programs, deep buffers for W from HBM
_MID_TMA = [
    _cfg(64, 128, 64, 4, 4), _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 128, 4, 4),
    _cfg(64, 128, 128, 4, 4), _cfg(64, 128, 64, 4, 8), _cfg(128, 64, 128, 4, 4),
]  # fmt: skip
# Many rows, N <= 256 (LoRA's x @ A^T), (BLOCK_M, BLOCK_K, warps, stages): short row tiles to
# cover the SMs, and few tall ones that leave the SMs to an overlapped main launch
_SKINNY_N = [
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3),
    (256, 64, 8, 4), (256, 128, 8, 3),
]  # fmt: skip
# Many rows, 33-64 outputs (the DLRM's 256 -> 64), (BLOCK_M, BLOCK_K, warps, stages), 32 columns
_NARROW_N = [(64, 128, 4, 3), (64, 256, 4, 2)]
# Many rows, K of one step (the DLRM's 13 -> 512), (BLOCK_M, BLOCK_N, warps, stages): more tiles
_SHORT_K = [(64, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2), (128, 32, 4, 2)]
# Rows not 16-byte aligned (REG_PIPE: loads a step early), (BLOCK_M, BLOCK_N, BLOCK_K, warps);
# some tiles lose with it, so both forms are timed
_REG_PIPE = [
    (128, 128, 32, 8), (128, 64, 64, 4), (128, 64, 32, 4), (64, 128, 32, 4), (64, 64, 64, 4),
]  # fmt: skip
# 65+ rows where 128 x 128 tiles would not fill one wave (FEW_TILES_WAVE): 4x the programs
_FEW_TILES = [_cfg(64, 64, 128, 4, 4), _cfg(64, 64, 64, 4, 6), _cfg(64, 64, 64, 4, 4)]
# Plain layers on the TMA kernel (LOOP_TMA), 16-bit: stores through a descriptor in OUT_SUB
# column slices (see _tma_store), tile loop flattened
_TMA_STORE = [
    dict(_cfg(128, 256, 64, 8, 4), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(128, 256, 64, 8, 3), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(256, 128, 64, 8, 3), OUT_SUB=4, FLATTEN=True),
    dict(_cfg(128, 128, 64, 8, 4), OUT_SUB=4, FLATTEN=True),
]  # fmt: skip
# _linear_stream_kernel, (BLOCK_M, warps, stages, programs an SM); BLOCK_N is min(N, 64)
_STREAM = [(64, 4, 3, 1), (32, 4, 3, 4)]
STREAM_MIN_M = 512  # the streaming kernel's shapes: many rows,
STREAM_MAX_K = 256  # K of one step,
STREAM_MAX_N = 512  # a few column tiles
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
            # (16-bit only: a float32 layer with a residual overflowed shared memory)
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
            # and the barriers beside the main loop's, as the compiler allocates them
            c["OUT_SUB"] = max(1, min(c["OUT_SUB"], c["BLOCK_N"] // 16))
            smem += c["BLOCK_M"] * c["BLOCK_N"] // c["OUT_SUB"] * es + 1024
            if residual:  # the residual tile's layout change takes half a tile more
                smem += c["BLOCK_M"] * c["BLOCK_N"] * es // 2
        if c not in out and smem <= SMEM_LIMIT:
            out.append(c)
    if plain and es == 2 and m >= STREAM_MIN_M and cap_k <= STREAM_MAX_K and n <= STREAM_MAX_N:
        bn, bk = min(cap_n, 64), cap_k
        for bm, warps, stages, per_sm in _STREAM:
            # x's buffers, W's tile and the epilogue's layout change (a float32 tile), for
            # every program an SM
            bm = min(bm, mb)
            if per_sm * ((stages * bm + bn) * bk * es + bm * bn * 4) <= SMEM_LIMIT:
                out.append(dict(_cfg(bm, bn, bk, warps, stages), STREAM=per_sm))
    return out


# launch_shrink_segments: short row blocks (an adapter's rows are a fraction of the batch)
# and long, deep K steps
SEGMENT_CONFIGS = [
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
