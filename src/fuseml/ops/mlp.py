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
each layer's epilogue is), and on the H100 that was the fastest for the DLRM top MLPs.

Up to ``MAX_FUSED_LAYERS`` layers per launch (longer chains: several launches) and widths
up to ``MAX_WIDTH``; wider layers run one by one through ``fuseml.ops.linear``, said once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from fuseml.ops import _elementwise as ew
from fuseml.ops import _tune
from fuseml.ops._elementwise import _activation
from fuseml.ops._math import _pdl_begin
from fuseml.ops._utils import (
    PLAIN_TENSORS,
    CompiledLaunches,
    aligned16,
    cdiv,
    check_choice,
    check_same,
    check_tensor,
    compiled,
    fused_op,
    grid_launch,
    int_spec,
    launches_skipped,
    needs_dispatch,
    pdl_launch,
    sm_count,
)
from fuseml.ops.bias_act import activation_ref
from fuseml.ops.gemm import dot_precision, mma
from fuseml.ops.linear import linear_rows
from fuseml.runtime import FLOAT_DTYPES, triton_interpreting

log = logging.getLogger("fuseml")

MAX_WIDTH = 1024
MAX_FUSED_LAYERS = 8
CHAIN_MAX_WIDTH = 256  # widths after layer 1 that the chain kernel holds in registers
# Inputs up to this wide: layer 0 is cheap inside the chain kernel, which then beats the
# unfused chain 2-4x (DLRM bottom MLPs, 13 wide). Wider inputs make layer 0 a real GEMM
# that every row block redoes over all of W0: there the chain kernel lost to running
# the layers one by one (kaggle top, 367 wide, B = 4096: 42.8 vs 27.2 us, H100), so
# tuning also times the layers one by one through fuseml.ops.linear.
CHAIN_SMALL_INPUT = 64


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


# ------------------------------------------------------------------------------ kernel
@triton.jit
def _pick(i: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """The i-th argument, chosen at compile time."""
    if i == 0:
        r = v0
    elif i == 1:
        r = v1
    elif i == 2:
        r = v2
    elif i == 3:
        r = v3
    elif i == 4:
        r = v4
    elif i == 5:
        r = v5
    elif i == 6:
        r = v6
    else:
        r = v7
    return r


@triton.jit
def _mlp_layer(
    src_ptr, src_rows, src_ok,  # input block: base, (BLOCK_M,) row offsets, row mask
    w_ptr, b_ptr,  # (N, K) contiguous weight, (N,) bias
    dst_ptr, dst_rows, dst_ok,  # output block, as for the input
    K, N,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dst = act(src @ W^T + b) for one block of BLOCK_M rows, BLOCK_N columns at a time."""
    ks = tl.arange(0, BLOCK_K)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(
                src_ptr + src_rows[:, None] + kk[None, :],
                mask=src_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * K + kk[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc = mma(a, w, acc, PRECISION, UPCAST)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # A bare name, not ew._activation: torch.compile re-parses user Triton kernels and
        # resolves only plain global names (the attribute form failed under inductor).
        acc = _activation(acc, ACT)
        tl.store(
            dst_ptr + dst_rows[:, None] + cols[None, :],
            acc.to(dst_ptr.dtype.element_ty),
            mask=dst_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _mlp_kernel(
    x_ptr,  # (M, D0) input, unit column stride
    out_ptr,  # (M, D_L) output, contiguous
    scratch_ptr,  # (programs, 2, BLOCK_M, MAX_W) per-program ping-pong buffers
    w0, w1, w2, w3, w4, w5, w6, w7,  # (D_{i+1}, D_i) contiguous weights (unused: any)
    b0, b1, b2, b3, b4, b5, b6, b7,  # (D_{i+1},) biases
    d0, d1, d2, d3, d4, d5, d6, d7, d8,  # widths: D0 in, D_{i+1} out of layer i
    M,
    stride_xm,
    stride_om,
    NUM_LAYERS: tl.constexpr,
    ACTS: tl.constexpr,  # activation code of layer i in bits [4i, 4i + 4)
    BIASES: tl.constexpr,  # bit i: layer i has a bias
    MAX_W: tl.constexpr,  # widest intermediate (scratch row length)
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    s0 = scratch_ptr + pid.to(tl.int64) * (2 * BLOCK_M * MAX_W)
    s1 = s0 + BLOCK_M * MAX_W
    local = tl.arange(0, BLOCK_M)
    s_rows = local.to(tl.int64) * MAX_W
    s_ok = local < BLOCK_M
    for rb in range(pid, tl.cdiv(M, BLOCK_M), n_prog):
        rows = (rb * BLOCK_M + local).to(tl.int64)
        row_ok = rows < M
        for i in tl.static_range(NUM_LAYERS):
            w = _pick(i, w0, w1, w2, w3, w4, w5, w6, w7)
            b = _pick(i, b0, b1, b2, b3, b4, b5, b6, b7)
            k = _pick(i, d0, d1, d2, d3, d4, d5, d6, d7)
            n = _pick(i, d1, d2, d3, d4, d5, d6, d7, d8)
            if i == 0:
                src, src_rows, src_ok = x_ptr, rows * stride_xm, row_ok
            elif i % 2 == 1:
                src, src_rows, src_ok = s0, s_rows, s_ok
            else:
                src, src_rows, src_ok = s1, s_rows, s_ok
            if i == NUM_LAYERS - 1:
                dst, dst_rows, dst_ok = out_ptr, rows * stride_om, row_ok
            elif i % 2 == 0:
                dst, dst_rows, dst_ok = s0, s_rows, s_ok
            else:
                dst, dst_rows, dst_ok = s1, s_rows, s_ok
            _mlp_layer(
                src, src_rows, src_ok, w, b, dst, dst_rows, dst_ok, k, n,
                (BIASES >> i) & 1, (ACTS >> (4 * i)) & 15, PRECISION, UPCAST,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            # The block's threads wrote what all of them read next (and the next row block
            # overwrites the buffers): one CTA barrier per layer.
            tl.debug_barrier()


@triton.jit
def _chain_layer(
    h, w_ptr, b_ptr,
    K: tl.constexpr, N: tl.constexpr, PK: tl.constexpr, PN: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """act(h @ W^T + b) for a (BLOCK_M, PK) register tile h: the whole (K, N) weight in one
    dot (PK, PN <= 256), padded rows and columns zero."""
    ks = tl.arange(0, PK)
    ns = tl.arange(0, PN)
    w = tl.load(
        w_ptr + ns[None, :] * K + ks[:, None],
        mask=(ks[:, None] < K) & (ns[None, :] < N),
        other=0.0,
    )
    acc = mma(h, w, tl.zeros((BLOCK_M, PN), dtype=tl.float32), PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
    return _activation(acc, ACT)


@triton.jit
def _chain_kernel(
    x_ptr,  # (M, D0) input, unit column stride
    out_ptr,  # (M, D_L) output
    w0, w1, w2, w3, w4, w5, w6, w7,  # (D_{i+1}, D_i) contiguous weights (unused: None)
    b0, b1, b2, b3, b4, b5, b6, b7,  # (D_{i+1},) biases (absent: None)
    M,
    stride_xm,
    stride_om,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    D4: tl.constexpr, D5: tl.constexpr, D6: tl.constexpr, D7: tl.constexpr, D8: tl.constexpr,
    P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr,
    P6: tl.constexpr, P7: tl.constexpr, P8: tl.constexpr,  # padded widths (powers of 2, >= 16)
    D_OUT: tl.constexpr, P_OUT: tl.constexpr,  # the last layer's width, padded
    NUM_LAYERS: tl.constexpr,
    ACTS: tl.constexpr,  # activation code of layer i in bits [4i, 4i + 4)
    BIASES: tl.constexpr,  # bit i: layer i has a bias
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # layer 0's output columns per step (= layer 1's K step)
    BLOCK_K: tl.constexpr,  # layer 0's K step
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl_launch)
):  # fmt: skip
    """Every layer of the chain for BLOCK_M rows, all intermediates in registers.

    Layers 0 and 1 run as one stream: CHUNK columns of layer 0's output at a time, each
    activated, rounded to the input dtype and at once multiplied into layer 1's (BLOCK_M,
    P2) accumulator as its next K step, so layer 0's output (up to 1024 wide) is never
    held whole. Layers 2 on take their input whole from registers (widths <= 256).
    """
    if PDL:
        _pdl_begin()
    dt = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    n2 = tl.arange(0, P2)
    n2_ok = n2 < D2
    if D0 <= BLOCK_K:  # the input row block fits one K step: load it once
        k0 = tl.arange(0, BLOCK_K)
        xa = tl.load(x_rows + k0[None, :], mask=row_ok[:, None] & (k0[None, :] < D0), other=0.0)
    acc = tl.zeros((BLOCK_M, P2), dtype=tl.float32)
    for j in range(0, D1, CHUNK):
        n1 = j + tl.arange(0, CHUNK)
        n1_ok = n1 < D1
        c = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)
        if D0 <= BLOCK_K:
            w = tl.load(
                w0 + n1[None, :] * D0 + k0[:, None],
                mask=(k0[:, None] < D0) & n1_ok[None, :],
                other=0.0,
            )
            c = mma(xa, w, c, PRECISION, UPCAST)
        else:
            for k in range(0, D0, BLOCK_K):
                kk = k + tl.arange(0, BLOCK_K)
                k_ok = kk < D0
                a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(
                    w0 + n1[None, :] * D0 + kk[:, None],
                    mask=k_ok[:, None] & n1_ok[None, :],
                    other=0.0,
                )
                c = mma(a, w, c, PRECISION, UPCAST)
        if BIASES & 1:
            c += tl.load(b0 + n1, mask=n1_ok, other=0.0).to(tl.float32)[None, :]
        c = _activation(c, ACTS & 15)
        w = tl.load(
            w1 + n2[None, :] * D1 + n1[:, None],
            mask=n1_ok[:, None] & n2_ok[None, :],
            other=0.0,
        )
        acc = mma(c.to(dt), w, acc, PRECISION, UPCAST)
    if (BIASES >> 1) & 1:
        acc += tl.load(b1 + n2, mask=n2_ok, other=0.0).to(tl.float32)[None, :]
    h = _activation(acc, (ACTS >> 4) & 15)
    # Layers 2 to 7 written out: each has its own constexpr widths, and a jit helper picking
    # the i-th of them (as _pick does for pointers) returns a runtime value, which tl.arange
    # refuses (triton 3.9, offline).
    if NUM_LAYERS > 2:
        h = _chain_layer(
            h.to(dt), w2, b2, D2, D3, P2, P3, (BIASES >> 2) & 1, (ACTS >> 8) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 3:
        h = _chain_layer(
            h.to(dt), w3, b3, D3, D4, P3, P4, (BIASES >> 3) & 1, (ACTS >> 12) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 4:
        h = _chain_layer(
            h.to(dt), w4, b4, D4, D5, P4, P5, (BIASES >> 4) & 1, (ACTS >> 16) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 5:
        h = _chain_layer(
            h.to(dt), w5, b5, D5, D6, P5, P6, (BIASES >> 5) & 1, (ACTS >> 20) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 6:
        h = _chain_layer(
            h.to(dt), w6, b6, D6, D7, P6, P7, (BIASES >> 6) & 1, (ACTS >> 24) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    if NUM_LAYERS > 7:
        h = _chain_layer(
            h.to(dt), w7, b7, D7, D8, P7, P8, (BIASES >> 7) & 1, (ACTS >> 28) & 15,
            PRECISION, UPCAST, BLOCK_M,
        )  # fmt: skip
    cols = tl.arange(0, P_OUT)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        h.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols[None, :] < D_OUT),
    )


# ------------------------------------------------------------------------------ launcher
def _cfg(bm, bn, bk, warps, per_sm) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "per_sm": per_sm}


# Candidates: rows per program and the column / K steps, 1 to 4 programs per SM. Every
# row block re-reads all the weights (from L2), so large batches want many rows per
# program (the kaggle bottom MLP's 310 KiB of bf16 weights per 64 rows are 317 MB of L2
# reads at B = 65536); small batches want small blocks, to give every SM a program.
_LARGE_B = [
    _cfg(64, 64, 64, 4, 2), _cfg(64, 128, 64, 4, 2), _cfg(128, 64, 64, 4, 1),
    _cfg(128, 128, 64, 8, 1), _cfg(128, 256, 64, 8, 1), _cfg(256, 64, 64, 8, 1),
    _cfg(256, 128, 64, 8, 1),
]  # fmt: skip
_SMALL_B = [
    _cfg(16, 64, 64, 4, 4), _cfg(32, 64, 64, 4, 4), _cfg(32, 128, 64, 4, 2),
    _cfg(64, 64, 64, 4, 2), _cfg(64, 128, 64, 4, 2), _cfg(128, 64, 64, 4, 1),
]  # fmt: skip
SMALL_BATCH = 8192  # up to this many rows the small-block candidates (a first guess: 4096
# rows make 64 blocks of 64 rows, half an H100's SMs; 16384 rows fill them with 128-row blocks)
_DEFAULT = _cfg(64, 64, 64, 4, 2)


def _chain_cfg(bm, chunk, bk, warps, stages) -> dict:
    return {
        "kind": "chain", "BLOCK_M": bm, "CHUNK": chunk, "BLOCK_K": bk,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip


# The chain kernel: one program per BLOCK_M rows (not persistent: a program holds layer 1's
# accumulator in registers, one or two fit an SM). 64 rows and more per program use
# Hopper's warp-group MMA (64 rows per 4 warps); fewer, the older MMA. Kept from an H100
# sweep (scripts/probe_mlp.py, NOTES.md): at B = 65536 the 128 / 64-row configs below
# were within 3% of each other (44.6-45.8 us, kaggle bottom) and 32-column chunks or
# 64 rows with 128-column chunks 16-38% slower; at B = 256 / 4096, 64 rows with 4 warps
# was best (9.3 us), 16 and 32 rows best for the 367-wide kaggle top MLP.
_CHAIN_LARGE_B = [
    _chain_cfg(128, 64, 64, 8, 3), _chain_cfg(128, 64, 64, 8, 2),
    _chain_cfg(128, 128, 64, 8, 2), _chain_cfg(64, 64, 64, 4, 3),
]  # fmt: skip
_CHAIN_SMALL_B = [
    _chain_cfg(16, 64, 64, 4, 3), _chain_cfg(32, 64, 64, 4, 3), _chain_cfg(64, 64, 64, 4, 3),
    _chain_cfg(64, 64, 64, 8, 3),
]  # fmt: skip
# The scratch kernel's configs that came closest where the chain kernel also runs (it
# lost by 1.1-2.6x at every batch of the sweep): kept as candidates there.
_SCRATCH_NEXT_TO_CHAIN = [_cfg(32, 128, 64, 4, 2), _cfg(128, 128, 64, 8, 1)]
_LAYERS = {"kind": "layers"}  # not fused: fuseml.ops.linear per layer
_CHAIN_DEFAULT = _chain_cfg(64, 64, 64, 4, 3)


@functools.cache
def _warn_unfused(widths: tuple) -> None:
    log.warning(
        "fuseml.ops.mlp: a layer wider than %d (widths %s) runs layer by layer through "
        "fuseml.ops.linear (same result, not fused)",
        MAX_WIDTH,
        widths,
    )


def _padded(d: int) -> int:
    """A width as a tile dimension: a power of two, at least 16 (tl.dot's minimum).
    (Plain Python: triton.next_power_of_2 is a constexpr function, ~3 us a call.)"""
    return 16 if d <= 16 else 1 << (d - 1).bit_length()


def chain_fits(widths: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether the register-resident chain kernel takes this chain: 16-bit inputs, two
    layers or more, layer 1's output and every later width at most CHAIN_MAX_WIDTH (held
    whole in registers); D0 and D1 any (streamed). float32 stays on the scratch kernel:
    its (BLOCK_M, 256) float32 operands do not fit the registers (sm_90, offline: 16 KB of
    spills a thread with exact fp32 dots, 160 B to 1.4 KB with TF32)."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and len(widths) >= 3
        and all(_padded(d) <= CHAIN_MAX_WIDTH for d in widths[2:])
    )


def _run_layers(x2, weights, biases, codes, traced) -> torch.Tensor:
    """The group layer by layer through fuseml.ops.linear (each epilogue fused; the
    activations between layers go through memory)."""
    h = x2
    for w, b, c in zip(weights, biases, codes):
        h = linear_rows(h, w, b, None, 1.0, c, traced=traced)
    return h


@functools.cache
def _say_layers(widths: tuple, dtype: torch.dtype) -> None:
    log.info(
        "fuseml.ops.mlp: widths %s (%s) run layer by layer through fuseml.ops.linear, "
        "measured (or, untuned, known) faster here than the fused kernels; same rounding",
        "-".join(map(str, widths)), str(dtype)[6:],
    )  # fmt: skip


def _launch_group(x2, out, weights, biases, codes, cfg, traced) -> None:
    kind = cfg.get("kind")
    if kind == "chain":
        _launch_chain(x2, out, weights, biases, codes, cfg, traced)
    elif kind == "layers":
        if not launches_skipped() and x2.shape[0]:
            out.copy_(_run_layers(x2, weights, biases, codes, traced))
    else:
        _launch_scratch(x2, out, weights, biases, codes, cfg, traced)


def _run_group(x2, weights, biases, codes, cfg, traced) -> torch.Tensor:
    """The group's output under ``cfg``: one fused launch, or the layers one by one."""
    if cfg.get("kind") == "layers":
        return _run_layers(x2, weights, biases, codes, traced)
    out = torch.empty((x2.shape[0], weights[-1].shape[0]), dtype=x2.dtype, device=x2.device)
    _launch_group(x2, out, weights, biases, codes, cfg, traced)
    return out


def _packed(codes, biases) -> tuple[int, int]:
    """(ACTS, BIASES) of both kernels: layer i's activation code in bits [4i, 4i + 4),
    bit i set where layer i has a bias."""
    acts = sum(c << (4 * i) for i, c in enumerate(codes))
    return acts, sum(1 << i for i, b in enumerate(biases) if b is not None)


_chain_launches = CompiledLaunches(_chain_kernel)
_chain_consts: dict = {}  # static key -> the chain kernel's constexpr arguments and options


def _chain_static(x2, weights, biases, codes, cfg) -> tuple:
    """(constexpr arguments in the kernel's order, launch options) of one group (widths
    made concrete: see ``_group_config``)."""
    widths = [int(d) for d in (x2.shape[1], *(w.shape[0] for w in weights))]
    n_layers = len(weights)
    ds = widths + [1] * (9 - len(widths))
    ps = [_padded(d) for d in ds[2:]]
    consts = (
        *ds, *ps, widths[-1], _padded(widths[-1]), n_layers,
        *_packed(codes, biases),
        dot_precision(x2.dtype), triton_interpreting(),
        cfg["BLOCK_M"], cfg["CHUNK"], min(cfg["BLOCK_K"], _padded(widths[0])),
    )  # fmt: skip
    return consts, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def _launch_chain(x2, out, weights, biases, codes, cfg, traced) -> None:
    m = x2.shape[0]
    if launches_skipped() or m == 0:
        return
    if traced:  # (widths may be symbolic there, and unhashable: nothing kept)
        skey = None
        consts, options = _chain_static(x2, weights, biases, codes, cfg)
    else:
        skey = (
            x2.dtype, x2.shape[1], *(w.shape[0] for w in weights), *codes,
            *(b is None for b in biases), *cfg.values(),
        )  # fmt: skip
        static = _chain_consts.get(skey)
        if static is None:
            static = _chain_consts[skey] = _chain_static(x2, weights, biases, codes, cfg)
        consts, options = static
    pad = (None,) * (8 - len(weights))
    ws = (*(w.contiguous() for w in weights), *pad)
    bs = (*(None if b is None else b.contiguous() for b in biases), *pad)
    sx, so = x2.stride(0), out.stride(0)
    dep = pdl_launch(x2, traced)
    if dep:
        options = {**options, "launch_pdl": True}
    args = (x2, out, *ws, *bs, m, sx, so, *consts, dep)
    grid = (cdiv(m, cfg["BLOCK_M"]),)
    if traced:
        grid_launch(torch.library.wrap_triton(_chain_kernel), grid)(*args, **options)
        return
    key = (skey, dep, int_spec(m), int_spec(sx), int_spec(so))
    _chain_launches(grid, key, aligned16(x2, out, *ws, *bs), args, options)


def _launch_scratch(x2, out, weights, biases, codes, cfg, traced) -> None:
    m = x2.shape[0]
    n_layers = len(weights)
    widths = [x2.shape[1], *(w.shape[0] for w in weights)]
    max_w = max(widths[1:-1], default=16)
    bm = cfg["BLOCK_M"]
    n_blocks = cdiv(m, bm)
    n_prog = n_blocks
    if x2.is_cuda:
        n_prog = min(n_blocks, cfg["per_sm"] * sm_count(x2.get_device()))
    scratch = torch.empty((max(n_prog, 1), 2, bm, max_w), dtype=x2.dtype, device=x2.device)
    if launches_skipped() or m == 0:
        return
    pad = 8 - n_layers
    ws = [w.contiguous() for w in weights] + [x2] * pad
    bs = [x2 if b is None else b.contiguous() for b in biases] + [x2] * pad
    ds = widths + [1] * (9 - len(widths))
    acts, has_b = _packed(codes, biases)
    kernel = torch.library.wrap_triton(_mlp_kernel) if traced else _mlp_kernel
    grid_launch(kernel, (n_prog,))(
        x2, out, scratch, *ws, *bs, *ds, m, x2.stride(0), out.stride(0),
        NUM_LAYERS=n_layers, ACTS=acts, BIASES=has_b, MAX_W=max_w,
        PRECISION=dot_precision(x2.dtype), UPCAST=triton_interpreting(),
        BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip


def candidates(m: int, widths: Sequence[int], dtype: torch.dtype) -> list[dict]:
    """The configs tuning times for a batch of m rows through these widths."""
    small = m <= SMALL_BATCH
    if chain_fits(widths, dtype):
        chain = _CHAIN_SMALL_B if small else _CHAIN_LARGE_B
        if widths[0] <= CHAIN_SMALL_INPUT:
            return chain + _SCRATCH_NEXT_TO_CHAIN
        return [*chain, _LAYERS]
    return [*(_SMALL_B if small else _LARGE_B), _LAYERS]


def default_config(widths: Sequence[int], dtype: torch.dtype) -> dict:
    """The config without tuning (interpreter, FUSEML_AUTOTUNE=0, a symbolic batch): the
    chain kernel where it takes the chain with a narrow input, else for 16-bit inputs the
    layers one by one (faster on the H100 for every such DLRM MLP measured), else the
    scratch kernel."""
    if chain_fits(widths, dtype) and widths[0] <= CHAIN_SMALL_INPUT:
        return _CHAIN_DEFAULT
    return _LAYERS if dtype in (torch.float16, torch.bfloat16) else _DEFAULT


def _group_config(x2, weights, biases, codes, traced) -> dict:
    """The launch config of one fused group (see ``fuseml.ops._tune.choose``)."""
    m = x2.shape[0]
    # (int(): under torch.compile with dynamic shapes the widths may be symbolic; they are
    # the weights' shapes, model constants, so specializing on them is right)
    widths = tuple(int(d) for d in (x2.shape[1], *(w.shape[0] for w in weights)))
    if type(m) is not int:  # symbolic batch under torch.compile: no bucket to look up
        return default_config(widths, x2.dtype)
    precision = dot_precision(x2.dtype)
    bucket = _tune.m_bucket(m)
    memo_key = ("mlp", x2.dtype, precision, bucket, widths, x2.device)
    cfg = _tune.memoized(memo_key)  # every call: keep this path short
    if cfg is not None:
        return cfg

    def text_key() -> str:  # (mlp2: the chain kernel joined the candidates)
        return f"mlp2:{str(x2.dtype)[6:]}:{precision}:m{bucket}:{'-'.join(map(str, widths))}"

    def run(c: dict) -> None:
        # (timed as CUDA-graph replays: the allocation is the capture's, not a replay's;
        # "layers" tunes each linear layer on its first, untimed call)
        _run_group(x2, weights, biases, codes, c, False)

    def bench(c: dict) -> float:
        return _tune.gpu_time_ms(lambda: run(c))

    return _tune.choose(
        memo_key,
        x2.device,
        text_key,
        lambda: candidates(m, widths, x2.dtype),
        bench,
        default_config(widths, x2.dtype),
        can_time=x2.is_cuda and not traced and not is_fake(x2),
        run=run,
    )


def mlp_rows(x, weights, biases, codes, *, traced: bool = False) -> torch.Tensor:
    """The chain for validated inputs; x (..., D0) -> (..., D_L)."""
    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    h = x.reshape(-1, x.shape[-1])
    if h.shape[1] > 1 and h.stride(1) != 1:
        h = h.contiguous()
    if max(widths) > MAX_WIDTH:
        _warn_unfused(widths)
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
