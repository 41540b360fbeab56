"""The TMA main loop (``_tma_body``, Hopper+: a persistent grid whose tiles the
tensor-memory accelerator loads) and its kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from fuseml.ops._math import _pdl_begin
from fuseml.ops.gemm.common import _bt_chunk, _epilogue, _tile_coords, _xs_tile, mma
from fuseml.ops.gemm.lora_modes import _joint_shrink, _joint_wait, _joint_xs, _spread_expand


@triton.jit
def _tma_store(
    o_desc, y, off_m, off_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """The output tile y (BLOCK_M, BLOCK_N, float32) stored through o_desc (block (BLOCK_M,
    BLOCK_N // SUB)) in SUB column slices, 1, 2 or 4: each slice goes from registers to
    shared memory and out by the TMA (which drops what lies past M and N) while the next
    is converted. Faster than pointer stores from registers on large plain layers (1024 ->
    1024 at 4096 rows: 17.1 -> 15.4 us, level with cuBLASLt)."""
    if SUB == 1:
        o_desc.store([off_m, off_n], y.to(o_desc.dtype))
    elif SUB == 2:
        # (BLOCK_M, BLOCK_N) -> (BLOCK_M, BLOCK_N / 2, 2): the last axis picks the half
        halves = tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        h0, h1 = tl.split(halves)
        o_desc.store([off_m, off_n], h0.to(o_desc.dtype))
        o_desc.store([off_m, off_n + BLOCK_N // 2], h1.to(o_desc.dtype))
    else:
        # (BLOCK_M, 2, 2, BLOCK_N / 4) [m, a, b, j] = y[m, a * BLOCK_N / 2 + b * BLOCK_N / 4
        # + j] -> [m, j, b, a]: split a (the half), then b (the quarter within it)
        q = tl.permute(tl.reshape(y, (BLOCK_M, 2, 2, BLOCK_N // 4)), (0, 3, 2, 1))
        first, second = tl.split(q)
        q0, q1 = tl.split(first)
        q2, q3 = tl.split(second)
        o_desc.store([off_m, off_n], q0.to(o_desc.dtype))
        o_desc.store([off_m, off_n + BLOCK_N // 4], q1.to(o_desc.dtype))
        o_desc.store([off_m, off_n + BLOCK_N // 2], q2.to(o_desc.dtype))
        o_desc.store([off_m, off_n + 3 * BLOCK_N // 4], q3.to(o_desc.dtype))


@triton.jit
def _tma_body(
    x_desc,  # TensorDescriptor over x (M, K), block (BLOCK_M, BLOCK_K)
    w_desc,  # TensorDescriptor over W (N, K), block (BLOCK_N, BLOCK_K)
    a_desc,  # LORA 1: over stacked A (R, K), block (R_PAD, BLOCK_K) (LORA 5: (R_PAD,
    # SHRINK_K)); LORA 4: over xs (M, R)
    b_desc,  # LORA 4: over stacked B (N, R), block (BLOCK_N, R_BLOCK); LORA 5: x, block
    # (BLOCK_M, SHRINK_K)
    bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,  # as in _gemm_body
    sync_ptr,  # LORA 5: 2 int32 counters per row tile, zero at launch and again at exit
    # (xs stored; tiles that have read it: see _joint_wait)
    M, N, K, stride_rm, stride_om, stride_bn, alpha, lora_scale,
    n_shrink,  # LORA 5: the grid's first n_shrink programs compute xs
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    LORA: tl.constexpr, MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr,
    R_PAD: tl.constexpr, R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, PDL: tl.constexpr,
    SHRINK_K: tl.constexpr = 16, SHRINK_STAGES: tl.constexpr = 1,  # LORA 5, see _joint_shrink
    SHRINK_SPLIT: tl.constexpr = 1,
    B3D: tl.constexpr = False,  # B as (adapters, N, RANK): see _bt_chunk; LORA 4's b_desc
    # is then over its (adapters * N, RANK) view, with R_BLOCK <= RANK
    EXPAND_STAGES: tl.constexpr = 3,  # LORA 4 with R_PAD > R_BLOCK: buffers of its xs @ B^T
    # loop (see expand_stages)
    SLICE: tl.constexpr = 16,  # LORA 6: stacked columns of xs each producing tile computes
    PHASE: tl.constexpr = 0,  # LORA 6 under the interpreter (programs run one after the
    # other, so no tile can wait for a later one): 1 = K loops and xs slices only, 2 = the
    # rest, in a second launch; 0 = both (one launch)
    o_desc=None,  # OUT_SUB > 0: a TensorDescriptor over out (M, N), block (BLOCK_M,
    # BLOCK_N // OUT_SUB)
    OUT_SUB: tl.constexpr = 0,  # 0: pointer stores; else TMA stores in OUT_SUB slices
):  # fmt: skip
    """Hopper+ (see gemm_loop): a persistent grid (one program per SM, tiles in grouped
    order) whose tiles are loaded by the tensor-memory accelerator (TMA), which zero-fills
    past K, M and N: no masks or index math in the main loop. FLATTEN lets Triton
    pipeline the tile and K loops as one (faster where a program has several tiles).
    LORA 1: x @ A^T accumulated from the x tiles already in shared memory (A's rows past
    R arrive as zeros); LORA 2: precomputed xa read by the epilogue; LORA 4: xs @ B^T as
    one more K step; LORA 5: the first n_shrink programs compute xs, the rest the tiles;
    LORA 6: each row tile's first R_PAD / SLICE column tiles compute a slice of its xs in
    the K loop (see lora_modes). PDL: as in _gemm_body."""
    if LORA == 3 and PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The epilogue's loads go before the K loop (as in _gemm_body) only where the tile loop
    # is not flattened into it: flattened, the pipeliner keeps a copy of each per stage in
    # registers (140 -> 229 registers for a 64 x 128 x 64 tile with 8 stages)
    EARLY: tl.constexpr = not FLATTEN
    B_EARLY: tl.constexpr = (EARLY and (LORA == 1 or LORA >= 4)) and (R_PAD == R_BLOCK)
    XA_W: tl.constexpr = SLICE if LORA == 6 else R_PAD  # columns of the in-loop product
    SLICES: tl.constexpr = R_PAD // SLICE  # LORA 6: producing column tiles per row tile
    # The tile's coordinates without the grouped order's divisions where the output is one
    # tile wide or tall (see _tile_coords); not where the tile loop is flattened into the K
    # loop, whose pipelining was measured without a branch
    SHORTCUT: tl.constexpr = not FLATTEN
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    xa = tl.zeros((BLOCK_M, XA_W), dtype=tl.float32)
    first = tl.program_id(0)
    if LORA == 5:
        if first < n_shrink:
            _joint_shrink(
                b_desc, a_desc, xa_ptr, ids_ptr, scale_ptr, sync_ptr, M, K, lora_scale,
                n_tiles_m, n_shrink, MULTI, R, RANK, R_PAD, PER_ADAPTER_SCALE, PRECISION,
                UPCAST, BLOCK_M, SHRINK_K, SHRINK_STAGES, SHRINK_SPLIT,
            )  # fmt: skip
            first = n_tiles_m * n_tiles_n  # no GEMM tiles for this program
        else:
            first -= n_shrink
    for tile in tl.range(first, n_tiles_m * n_tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M, SHORTCUT)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA == 1 or LORA == 6:
            xa = tl.zeros((BLOCK_M, XA_W), dtype=tl.float32)
        # LORA 6: this tile's slice of xs (column tiles past SLICES compute one again, so
        # the K loop has no branch; only the first SLICES store theirs)
        a_row = (pid_n % SLICES) * SLICE
        # Loads of the epilogue that do not wait on the main loop go before it (EARLY):
        # pointer loads, which block nothing until their use (a descriptor load waits for
        # its data where it is issued); int32 indices and the input dtype, since they are
        # held in registers across the loop
        bias_v = 0.0
        b_v = 0.0
        s_v = 0.0
        if HAS_BIAS and EARLY:
            cn = off_n + tl.arange(0, BLOCK_N)
            bias_v = tl.load(bias_ptr + cn, mask=cn < N, other=0.0)
        if B_EARLY:  # the B^T chunk (R_PAD, BLOCK_N); LORA 4 without PDL: xs too
            cn = off_n + tl.arange(0, BLOCK_N)
            rs = tl.arange(0, R_PAD)
            b_v = _bt_chunk(b_ptr, cn, N, stride_bn, rs, R, RANK, B3D)
            if LORA == 4 and not PDL:  # (LORA 5: xs only after the wait)
                s_v = _xs_tile(xa_ptr, off_m + tl.arange(0, BLOCK_M), M, rs, R)
        for k0 in range(0, K, BLOCK_K):
            xt = x_desc.load([off_m, k0])
            wt = w_desc.load([off_n, k0])
            acc = mma(xt, wt.T, acc, PRECISION, UPCAST)
            if LORA == 1:
                at = a_desc.load([0, k0])
                xa = mma(xt, at.T, xa, PRECISION, UPCAST)
            if LORA == 6:
                at = a_desc.load([a_row, k0])
                xa = mma(xt, at.T, xa, PRECISION, UPCAST)
        if LORA == 6:
            acc = _spread_expand(
                acc, xa, a_row, pid_m, pid_n, off_m, off_n, b_ptr, xa_ptr, ids_ptr, scale_ptr,
                sync_ptr, M, N, stride_bn, lora_scale, n_tiles_m, n_tiles_n, b_v,
                MULTI, R, RANK, R_PAD, R_BLOCK, PER_ADAPTER_SCALE, PRECISION, UPCAST,
                BLOCK_M, BLOCK_N, SLICE, SLICES, B3D, B_EARLY, EXPAND_STAGES, PHASE,
            )  # fmt: skip
        if LORA == 5:  # wait until the shrink programs have stored this row tile of xs
            _joint_wait(sync_ptr, pid_m, n_tiles_m, n_tiles_n, SHRINK_SPLIT)
            st = _joint_xs(
                xa_ptr, off_m, M, R, R_PAD, BLOCK_M, SHRINK_SPLIT, b_ptr.dtype.element_ty
            )  # fmt: skip
            if B_EARLY:
                bt_t = b_v
            else:
                cn = off_n + tl.arange(0, BLOCK_N)
                bt_t = _bt_chunk(b_ptr, cn, N, stride_bn, tl.arange(0, R_PAD), R, RANK, B3D)
            acc = mma(st, bt_t, acc, PRECISION, UPCAST)
        if LORA == 4:
            if PDL:
                tl.extra.cuda.gdc_wait()
            if R_PAD > R_BLOCK:  # several steps: one set of buffers, not one per step
                for r0 in tl.range(0, R_PAD, R_BLOCK, num_stages=EXPAND_STAGES):
                    st = a_desc.load([off_m, r0])
                    if B3D:  # adapter r0 // RANK's rows of the (adapters * N, RANK) view
                        bt = b_desc.load([(r0 // RANK) * N + off_n, r0 % RANK])
                    else:
                        bt = b_desc.load([off_n, r0])
                    acc = mma(st, bt.T, acc, PRECISION, UPCAST)
            else:
                if B_EARLY:
                    bt_t = b_v
                else:
                    bt_t = b_desc.load([off_n, 0]).T
                if B_EARLY and not PDL:
                    st = s_v
                else:
                    st = a_desc.load([off_m, 0])
                acc = mma(st, bt_t, acc, PRECISION, UPCAST)
        rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        cols = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        if PHASE != 1:
            y = _epilogue(
                acc, rows, cols, M, N, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr,
                scale_ptr, stride_rm, stride_om, stride_bn, alpha, lora_scale, xa,
                HAS_BIAS, HAS_RES, ACTIVATION, LORA, MULTI, R, RANK, R_PAD, R_BLOCK,
                PER_ADAPTER_SCALE, PRECISION, UPCAST, bias_v, 0.0, EARLY, False,
                b_v, B_EARLY and LORA == 1, B3D, OUT_SUB == 0,
            )  # fmt: skip
            if OUT_SUB > 0:
                _tma_store(o_desc, y, off_m, off_n, BLOCK_M, BLOCK_N, OUT_SUB)


@triton.jit
def _linear_tma_kernel(
    x_desc, w_desc, bias_ptr, res_ptr, out_ptr,  # as in _tma_body
    M, N, K, stride_rm, stride_om, alpha,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr = True, PDL: tl.constexpr = False,
    o_desc=None, OUT_SUB: tl.constexpr = 0,  # as in _tma_body (o_desc: x_desc where unused)
):  # fmt: skip
    """Plain linear layers through _tma_body (the fewest launch arguments). PDL: as in
    _linear_kernel."""
    if PDL:
        _pdl_begin()
    _tma_body(
        x_desc, w_desc, x_desc, x_desc, bias_ptr, res_ptr, out_ptr, out_ptr, out_ptr, out_ptr,
        out_ptr, out_ptr,
        M, N, K, stride_rm, stride_om, 0, alpha, 1.0, 0,
        HAS_BIAS, HAS_RES, ACTIVATION, 0, False, 1, 1, 16, 16, False, PRECISION, UPCAST,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, FLATTEN, False,
        o_desc=o_desc, OUT_SUB=OUT_SUB,
    )  # fmt: skip


@triton.jit
def _lora_tma_kernel(
    x_desc, w_desc, a_desc, b_desc, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
    sync_ptr, M, N, K, stride_rm, stride_om, stride_bn, alpha, lora_scale, n_shrink,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
    LORA: tl.constexpr, MULTI: tl.constexpr, R: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr,
    R_BLOCK: tl.constexpr, PER_ADAPTER_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr = True, PDL: tl.constexpr = False,
    SHRINK_K: tl.constexpr = 16, SHRINK_STAGES: tl.constexpr = 1,
    SHRINK_SPLIT: tl.constexpr = 1, B3D: tl.constexpr = False, EXPAND_STAGES: tl.constexpr = 3,
    SLICE: tl.constexpr = 16, DEP: tl.constexpr = False, PHASE: tl.constexpr = 0,
):  # fmt: skip
    """LoRA layers (LORA 1 in-loop, 2 precomputed, 3 shrink, 4 expand, 5 joint, 6 spread)
    through _tma_body. DEP: launched with programmatic dependent launch behind whatever
    kernel came before (``pdl_launch``; not the expand launch's PDL, whose programs read x
    and W before they wait, only for xs: the shrink before it waits at its top)."""
    if DEP:
        _pdl_begin()
    _tma_body(
        x_desc, w_desc, a_desc, b_desc, bias_ptr, res_ptr, out_ptr, b_ptr, xa_ptr, ids_ptr, scale_ptr,
        sync_ptr, M, N, K, stride_rm, stride_om, stride_bn, alpha, lora_scale, n_shrink,
        HAS_BIAS, HAS_RES, ACTIVATION, LORA, MULTI, R, RANK, R_PAD, R_BLOCK, PER_ADAPTER_SCALE,
        PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, FLATTEN,
        PDL, SHRINK_K, SHRINK_STAGES, SHRINK_SPLIT, B3D, EXPAND_STAGES, SLICE, PHASE,
    )  # fmt: skip
