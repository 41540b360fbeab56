"""``pad_k``: zero-pad the K columns of one or two tensors in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseml.ops._utils import (
    CompiledLaunches,
    aligned16,
    cdiv,
    int_spec,
    launches_skipped,
    next_pow2,
)


@triton.jit
def _pad_tile(src, dst, n_rows, sm, sk, tile, K, KP, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    ok = (rows < n_rows)[:, None]
    v = tl.load(src + rows[:, None] * sm + cols[None, :] * sk, mask=ok & (cols < K)[None, :])
    tl.store(dst + rows[:, None] * KP + cols[None, :], v, mask=ok & (cols < KP)[None, :])


@triton.jit
def _pad_k_kernel(
    a_ptr, a_out, rows_a, stride_am, stride_ak, b_ptr, b_out, rows_b, stride_bm, stride_bk,
    K, KP, tiles_a, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[:, :K] = src, out[:, K:KP] = 0 for one or two (rows, K) tensors, each out
    contiguous (rows, KP): programs below tiles_a take a's row tiles, the rest b's."""
    pid = tl.program_id(0)
    if pid < tiles_a:
        _pad_tile(a_ptr, a_out, rows_a, stride_am, stride_ak, pid, K, KP, BLOCK_R, BLOCK_C)
    else:
        _pad_tile(
            b_ptr, b_out, rows_b, stride_bm, stride_bk, pid - tiles_a, K, KP, BLOCK_R, BLOCK_C
        )  # fmt: skip


_pad_launches = CompiledLaunches(_pad_k_kernel)
PAD_BLOCK_ELEMS = 8192  # elements a program of _pad_k_kernel copies (rows x padded K)


def pad_k(kp: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (rows, K) tensor (one or two, one dtype and device, any strides) copied into a
    new contiguous (rows, kp) one whose last kp - K columns are zeros, in one launch
    (inside a CUDA graph, where the padded weight cannot be kept, x's and W's copies are
    one node, not the four of two F.pad calls)."""
    if not 1 <= len(tensors) <= 2:
        raise ValueError(f"pad_k: takes one or two tensors, got {len(tensors)}")
    a = tensors[0]
    b = tensors[-1]
    k = a.shape[1]
    if b.shape[1] != k or b.dtype != a.dtype or b.device != a.device or kp < k:
        raise ValueError(
            f"pad_k: tensors of one K, dtype and device, padded to kp >= K; got shapes "
            f"{[tuple(t.shape) for t in tensors]}, dtypes {[t.dtype for t in tensors]}, kp {kp}"
        )
    outs = tuple(torch.empty((t.shape[0], kp), dtype=t.dtype, device=t.device) for t in tensors)
    if launches_skipped():
        return outs
    block_c = next_pow2(kp)
    block_r = max(1, PAD_BLOCK_ELEMS // block_c)
    rows_b = b.shape[0] if len(tensors) == 2 else 0
    tiles_a = cdiv(a.shape[0], block_r)
    grid = (tiles_a + cdiv(rows_b, block_r),)
    if grid[0] == 0:
        return outs
    ints = (
        a.shape[0], a.stride(0), a.stride(1), rows_b, b.stride(0), b.stride(1), k, kp, tiles_a
    )  # fmt: skip
    args = (a, outs[0], *ints[:3], b, outs[-1], *ints[3:], block_r, block_c)
    key = (a.dtype, block_r, block_c, *map(int_spec, ints))
    _pad_launches(grid, key, aligned16(a, b, *outs), args, {"num_warps": 4})
    return outs
