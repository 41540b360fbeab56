"""Which kernel and tile run an MLP chain of ``fuseml.ops.mlp``, and their launches: the
candidate configs, the untuned default, the tuned choice per shape bucket and the launch
of one fused group (the chain kernel, the scratch kernel or the layers one by one)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from fuseml.ops import _tune
from fuseml.ops._mlp_kernels import _chain_kernel, _mlp_kernel
from fuseml.ops._utils import (
    CompiledLaunches,
    aligned16,
    cdiv,
    grid_launch,
    int_spec,
    launches_skipped,
    pdl_launch,
    sm_count,
)
from fuseml.ops.gemm import dot_precision
from fuseml.ops.linear import linear_rows
from fuseml.runtime import triton_interpreting

log = logging.getLogger("fuseml")

CHAIN_MAX_WIDTH = 256  # widths after layer 1 that the chain kernel holds in registers
# Inputs up to this wide: layer 0 is cheap inside the chain kernel (the DLRM bottom MLPs,
# 13 wide). A wider input makes layer 0 a real GEMM that every row block redoes over all
# of W0, where the layers one by one through fuseml.ops.linear can win (the 367-wide
# kaggle top MLP: 27.2 against 42.8 us on an H100), so tuning also times those
# (docs/performance/mlp.md).
CHAIN_SMALL_INPUT = 64


def _cfg(bm, bn, bk, warps, per_sm) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "per_sm": per_sm}


# Candidates: rows per program and the column / K steps, 1 to 4 programs per SM. Every
# row block re-reads all the weights (from L2), so large batches want many rows per
# program (64-row blocks read the kaggle bottom MLP's weights from L2 as 317 MB at
# B = 65536); small batches want small blocks, to give every SM a program.
_LARGE_B = [
    _cfg(64, 64, 64, 4, 2), _cfg(64, 128, 64, 4, 2), _cfg(128, 64, 64, 4, 1),
    _cfg(128, 128, 64, 8, 1), _cfg(128, 256, 64, 8, 1), _cfg(256, 64, 64, 8, 1),
    _cfg(256, 128, 64, 8, 1),
]  # fmt: skip
_SMALL_B = [
    _cfg(16, 64, 64, 4, 4), _cfg(32, 64, 64, 4, 4), _cfg(32, 128, 64, 4, 2),
    _cfg(64, 64, 64, 4, 2), _cfg(64, 128, 64, 4, 2), _cfg(128, 64, 64, 4, 1),
]  # fmt: skip
# Up to this many rows the small-block candidates (a first guess: below it, 128-row blocks
# leave an H100's SMs idle)
SMALL_BATCH = 8192
_DEFAULT = _cfg(64, 64, 64, 4, 2)


def _chain_cfg(bm, chunk, bk, warps, stages) -> dict:
    return {
        "kind": "chain", "BLOCK_M": bm, "CHUNK": chunk, "BLOCK_K": bk,
        "num_warps": warps, "num_stages": stages,
    }  # fmt: skip


# The chain kernel: one program per BLOCK_M rows (not persistent: a program holds layer 1's
# accumulator in registers, one or two fit an SM). 64 rows and more per program use
# Hopper's warp-group MMA (64 rows per 4 warps); fewer, the older MMA. The configs are the
# best of an H100 sweep: 64 and 128 rows for large batches (within 3% of each other), 16
# to 64 rows for small ones (docs/performance/mlp.md).
_CHAIN_LARGE_B = [
    _chain_cfg(128, 64, 64, 8, 3), _chain_cfg(128, 64, 64, 8, 2),
    _chain_cfg(128, 128, 64, 8, 2), _chain_cfg(64, 64, 64, 4, 3),
]  # fmt: skip
_CHAIN_SMALL_B = [
    _chain_cfg(16, 64, 64, 4, 3), _chain_cfg(32, 64, 64, 4, 3), _chain_cfg(64, 64, 64, 4, 3),
    _chain_cfg(64, 64, 64, 8, 3),
]  # fmt: skip
# The scratch kernel's configs that came closest where the chain kernel also runs (it lost
# at every batch measured there): kept as candidates.
_SCRATCH_NEXT_TO_CHAIN = [_cfg(32, 128, 64, 4, 2), _cfg(128, 128, 64, 8, 1)]
_LAYERS = {"kind": "layers"}  # not fused: fuseml.ops.linear per layer
_CHAIN_DEFAULT = _chain_cfg(64, 64, 64, 4, 3)


# Split plans whose chain's first layer fits one chunk (256 wide: the kaggle top MLP's
# 512 -> 256): each row block reads its input once instead of once per chunk. Compiled for
# sm_90 without spills (152 and 250 registers a thread).
_SPLIT_WHOLE = [_chain_cfg(64, 256, 64, 8, 2), _chain_cfg(128, 256, 64, 8, 2)]


def _split_cfg(chain: dict) -> dict:
    """The first layer through fuseml.ops.linear, every later one in one chain-kernel
    launch with ``chain``'s tile (the chain's first GEMM then streams layer 1's output)."""
    return {**chain, "kind": "split"}


def split_fits(widths: Sequence[int], dtype: torch.dtype) -> bool:
    """Does tuning time the split plan: a chain whose input is too wide for the chain
    kernel (see CHAIN_SMALL_INPUT) and whose layers after the first form a chain it takes
    (two or more). The kaggle top MLP (367-512-256-1): 512-256-1 in one launch, the head
    a dot in the epilogue, its 256-wide input never written (33.5 MB at 65536 rows)."""
    return len(widths) >= 4 and widths[0] > CHAIN_SMALL_INPUT and chain_fits(widths[1:], dtype)


def _padded(d: int) -> int:
    """A width as a tile dimension: a power of two, at least 16 (tl.dot's minimum).
    (Plain Python: triton.next_power_of_2 is a constexpr function, ~3 us a call.)"""
    return 16 if d <= 16 else 1 << (d - 1).bit_length()


def chain_fits(widths: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether the register-resident chain kernel takes this chain: 16-bit inputs, two
    layers or more, layer 1's output and every later width at most CHAIN_MAX_WIDTH (held
    whole in registers); D0 and D1 any (streamed). float32 stays on the scratch kernel:
    its (BLOCK_M, 256) float32 operands do not fit the registers (compiled for sm_90 with
    exact fp32 dots: 16 KB of spills a thread)."""
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
    elif kind == "split":
        if not launches_skipped() and x2.shape[0]:
            h = linear_rows(x2, weights[0], biases[0], None, 1.0, codes[0], traced=traced)
            _launch_chain(h, out, weights[1:], biases[1:], codes[1:], cfg, traced)
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


def times_layers(widths: Sequence[int], dtype: torch.dtype) -> bool:
    """Does tuning time the layers-one-by-one plan for this chain (``candidates``)? Then
    a chain whose fused kernels lose (heavy weights, a wide input) still runs as fast as
    its layers through fuseml.ops.linear."""
    return not (chain_fits(widths, dtype) and widths[0] <= CHAIN_SMALL_INPUT)


def candidates(m: int, widths: Sequence[int], dtype: torch.dtype) -> list[dict]:
    """The configs tuning times for a batch of m rows through these widths."""
    small = m <= SMALL_BATCH
    chain = _CHAIN_SMALL_B if small else _CHAIN_LARGE_B
    split = []
    if split_fits(widths, dtype):
        whole = _SPLIT_WHOLE if _padded(widths[2]) == 256 else []
        split = [_split_cfg(c) for c in [*chain, *whole]]
    if chain_fits(widths, dtype):
        if widths[0] <= CHAIN_SMALL_INPUT:
            return chain + _SCRATCH_NEXT_TO_CHAIN
        return [*chain, *split, _LAYERS]
    return [*(_SMALL_B if small else _LARGE_B), *split, _LAYERS]


def default_config(widths: Sequence[int], dtype: torch.dtype) -> dict:
    """The config without tuning (interpreter, FUSEML_AUTOTUNE=0, a symbolic batch): the
    chain kernel where it takes the chain with a narrow input, else for 16-bit inputs the
    layers one by one (faster for every such DLRM MLP measured, see
    docs/performance/mlp.md), else the scratch kernel."""
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

    def text_key() -> str:  # (mlp2: the chain kernel joined the candidates; mlp3: split)
        version = 3 if split_fits(widths, x2.dtype) else 2
        return (
            f"mlp{version}:{str(x2.dtype)[6:]}:{precision}:m{bucket}:{'-'.join(map(str, widths))}"
        )

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
