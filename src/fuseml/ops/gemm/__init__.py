"""The Triton GEMM family behind ``linear``, ``lora_linear`` and the MLP chain.

    h   = x @ W^T                                   (M, K) x (N, K)^T, fp32 accumulator
    h  += (s * (x @ A^T)) @ B^T                     LoRA, optional (see lora_modes)
    out = act(h + bias + alpha * residual)          rounded once to the output dtype

Every kernel ends in one epilogue (``common._epilogue``), so plain and LoRA layers and
all main loops compute the same thing:

    pointer     ``_gemm_body``: pointer loads, any layout and GPU; one step where K fits
    tma         ``_tma_body``: Hopper+, a persistent grid whose tiles the TMA loads
    stream      skinny plain layers at many rows: W's column tile kept on chip
    lora_modes  LoRA's six modes (in-loop, precomputed, shrink, expand, joint, spread)
    pad         ``pad_k``: K padded to 16-byte aligned rows
    configs     candidate configs as data, and the shape pruning that picks from them
    launch      which loop a call takes (``gemm_loop``), the launchers, the tuned config

Tiles are visited in grouped order (GROUP_M row tiles share a column strip of W while it
is in L2). Why each loop, mode and table: docs/performance/gemm.md and lora.md.
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
    VENDOR,
    candidates,
    default_config,
)
from fuseml.ops.gemm.launch import (
    LOOPS,
    choose_config,
    gemm_loop,
    launch_linear,
    launch_shrink_segments,
    launch_vendor,
    loop_key,
    pdl_available,
    persistent_programs,
    takes_tma,
    tma_eligible,
    vendor_fits,
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
    reserve_joint_flags,
    spread_fits,
)
from fuseml.ops.gemm.pad import pad_k

__all__ = [
    "LOOPS",
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
    "VENDOR",
    "LoraLaunch",
    "candidates",
    "choose_config",
    "default_config",
    "dot_precision",
    "fp32_dot",
    "gemm_loop",
    "joint_flags",
    "launch_linear",
    "launch_shrink_segments",
    "launch_vendor",
    "loop_key",
    "lora_cols",
    "mma",
    "pad_k",
    "pdl_available",
    "persistent_programs",
    "reserve_joint_flags",
    "round_tf32",
    "spread_fits",
    "takes_tma",
    "tma_eligible",
    "vendor_fits",
]
