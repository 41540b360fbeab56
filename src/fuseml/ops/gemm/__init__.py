"""The Triton GEMM behind ``linear`` and ``lora_linear``: out = epilogue(x @ W^T [+ LoRA]).

    h   = x @ W^T                                   (M, K) x (N, K)^T, fp32 accumulator
    h  += (s * (x @ A^T)) @ B^T                     LoRA, optional (see LORA modes)
    out = act(h + bias + alpha * residual)          rounded once to the output dtype

Two main loops share one epilogue (``_epilogue``), so plain and LoRA layers, and both
loops, compute the same thing: ``_gemm_body`` (pointer loads, any layout and GPU) and
``_tma_body`` (Hopper+: a persistent grid whose tiles the tensor-memory accelerator loads;
taken from ``TMA_MIN_M`` rows where rows are 16-byte aligned, tuned against the pointer
loop below that and for narrow outputs, see ``gemm_loop``). Where K fits one BLOCK_K step
the pointer loop is a single step (``ONE_STEP``, plain layers); for such skinny plain
layers at many rows the tuner also times ``_linear_stream_kernel`` (one column tile of W
kept on chip, row tiles streamed through it; same epilogue). Tiles are
visited in grouped order (GROUP_M row-tiles share each column strip of W while it is in
L2). Tile sizes come from ``fuseml.ops._tune``: measured once per device and shape bucket
and kept on disk.

LoRA modes (constexpr LORA):
  1  in-loop: the (BLOCK_M, R) product x @ A^T is accumulated inside the main K loop from
     the x tiles already loaded, then one (BLOCK_M, R) x (R, BLOCK_N) dot adds it to the
     tile. One launch; each column tile redoes the small product (R / BLOCK_N extra
     FLOPs), which is free while the GEMM waits on memory (small M).
  2  precomputed: xa = x @ A^T (fp32, M x R) comes from a first, small launch of this same
     kernel and the epilogue adds (s * xa) @ B^T. Two launches, R / N extra FLOPs in all:
     the better trade once the GEMM is compute-bound (large M). Pointer kernel, or TMA
     where the rank is not a multiple of 8.
  3  shrink: this launch *is* the first one of mode 4: x @ A^T with each row's scaling
     and adapter mask applied in the epilogue, stored in the input dtype (xs).
  4  expand (TMA kernel): xs and B tiles arrive through their own descriptors after the
     K loop and one more dot adds xs @ B^T to the accumulator: an extra K step over the
     stacked columns, no register-to-shared copies and no masking in the epilogue.
  5  joint (TMA kernel, one launch): the grid's first programs compute xs (as mode 3)
     on SMs the GEMM's tiles leave free, setting a flag per row tile of xs stored; the
     others run the GEMM tiles and, after the K loop, wait for their row tile's flag
     before adding xs @ B^T (as mode 4); the last tile to read a row tile's flag puts it
     back to zero, so no memset precedes the launch (``joint_flags``: 1.1-1.3 us a call
     in a CUDA graph at 64-512 rows, H100). The shrink's programs are the grid's lowest,
     which start first and wait on nothing, and the grid is no larger than the SM count,
     so the GEMM's wait always ends. Where every SM has tiles, the GEMM
     keeps as few programs as finish its tiles in the same rounds and the shrink takes
     the SMs left; where free SMs outnumber row tiles, K is split over them (float32
     parts the tiles sum in order). (H100, NOTES.md: against the overlapped pair,
     0.3-0.5 us less at 1 row, within noise at 64-1024 rows; at 4096 and 8192 rows,
     ranks 16 and 64, within 1-5% of fuseml's plain GEMM where expand in stream order
     took 8-12% more. The tuner picks per shape.)
  6  spread (TMA kernel, one launch, one tile a program: the tiles must fit one wave):
     each row tile's first R_PAD / SLICE column tiles also accumulate a SLICE-column
     slice of x @ A^T in their K loop, from the x tiles already loaded, and store it as
     xs (as mode 3), posting on the row tile's counter; every tile then waits for its
     row tile's slices and adds xs @ B^T (``_spread_expand``). No program streams all
     of K for the shrink, as the joint and overlapped modes' shrink programs do. For
     mixed batches of many adapters (16 x rank 16 at 256 rows, H100: 26.5 against 32.8
     us for the overlapped pair, NOTES.md).
Multi-adapter: A and B of every adapter are stacked along R (R = adapters x rank), and
each row keeps only the columns of its own adapter (id -1: none), scaled per adapter.
Exact, since the other columns are multiplied by zero. A mixed batch's shrink may
instead run per adapter segment (``launch_shrink_segments``: each row's own columns
only), timed by the tuner beside the stacked product.
"""

from fuseml.ops.gemm.common import dot_precision, fp32_dot, lora_cols, mma, round_tf32
from fuseml.ops.gemm.configs import (
    LOOP_PTR,
    LOOP_TMA,
    LOOP_TUNED,
    SEGMENT_CONFIGS,
    SMEM_LIMIT,
    TMA_MIN_M,
    TMA_TUNED_MAX_M,
    TMA_TUNED_N,
    candidates,
    default_config,
)
from fuseml.ops.gemm.launch import (
    choose_config,
    gemm_loop,
    gemm_mode,
    launch_linear,
    launch_shrink_segments,
    loop_key,
    pdl_available,
    persistent_programs,
    takes_tma,
    tma_eligible,
)
from fuseml.ops.gemm.lora_modes import (
    LORA_EXPAND,
    LORA_IN_LOOP,
    LORA_JOINT,
    LORA_NONE,
    LORA_PRECOMPUTED,
    LORA_SHRINK,
    LORA_SPREAD,
    LoraLaunch,
    joint_flags,
    spread_fits,
)
from fuseml.ops.gemm.pad import pad_k

__all__ = [
    "LOOP_PTR",
    "LOOP_TMA",
    "LOOP_TUNED",
    "LORA_EXPAND",
    "LORA_IN_LOOP",
    "LORA_JOINT",
    "LORA_NONE",
    "LORA_PRECOMPUTED",
    "LORA_SHRINK",
    "LORA_SPREAD",
    "SEGMENT_CONFIGS",
    "SMEM_LIMIT",
    "TMA_MIN_M",
    "TMA_TUNED_MAX_M",
    "TMA_TUNED_N",
    "LoraLaunch",
    "candidates",
    "choose_config",
    "default_config",
    "dot_precision",
    "fp32_dot",
    "gemm_loop",
    "gemm_mode",
    "joint_flags",
    "launch_linear",
    "launch_shrink_segments",
    "loop_key",
    "lora_cols",
    "mma",
    "pad_k",
    "pdl_available",
    "persistent_programs",
    "round_tf32",
    "spread_fits",
    "takes_tma",
    "tma_eligible",
]
