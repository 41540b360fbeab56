"""DLRM inference cases for a benchmark harness: plain callables, their inputs and sizes.

Public API::

    cases = dlrm_inference_cases("kaggle", [2048, 16384], torch.bfloat16, "cuda")
    for case in cases:
        case.arms["eager"](), case.arms["compile"]()   # probabilities (B,)
        case.flops, case.bytes                           # for TFLOP/s and GB/s
    dense, sparse = random_inputs(config, batch_size, device, dtype)

Nothing is timed here: the harness in ``fuseml.bench`` owns timing. The model is built
once per call (random reference initialisation, seeded) and cast to ``dtype``; embeddings
are looked up without the id check (its device sync is not part of inference and the
fused arms skip it too). Ids are uniform over each table, so on the large tables nearly
every lookup misses the cache, as on real Criteo traffic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fuseml.models.dlrm import DLRM, DLRMConfig

__all__ = ["DLRMCase", "dlrm_inference_cases", "dlrm_work", "random_inputs"]


@dataclass
class DLRMCase:
    name: str  # "<config>/bs<B>/<dtype>"
    batch_size: int
    inputs: tuple[torch.Tensor, torch.Tensor]  # dense (B, 13), sparse ids (B, 26)
    arms: dict[str, Callable[[], torch.Tensor]]  # "eager", "compile": each returns (B,)
    flops: int  # multiply-adds x 2 of the MLPs and the interaction bmm
    bytes: int  # lower bound of memory traffic: weights + gathered rows + inputs/outputs
    model: DLRM = field(repr=False)


def random_inputs(
    config: DLRMConfig,
    batch_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    ids: str = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense features like log(1 + counts) and one id per table, seeded: ``ids``
    "uniform" over each table (the worst case for caches), or "zipf" (P(rank k) ~ k^-ZIPF_S,
    as real click logs are skewed; the ranks scattered over the table by a multiplicative
    hash, so the hot rows do not sit side by side)."""
    if ids not in ID_LAWS:
        raise ValueError(f"ids must be one of {ID_LAWS}, got {ids!r}")
    g = torch.Generator().manual_seed(seed)
    dense = torch.log1p(torch.rand(batch_size, config.num_dense, generator=g) * 1000)
    cards = torch.tensor(config.cardinalities, dtype=torch.float64)
    u = torch.rand(batch_size, config.num_tables, generator=g, dtype=torch.float64)
    if ids == "uniform":
        sparse = (u * cards).long().clamp_max(cards.long() - 1)
    else:  # inverse CDF of a power law over ranks 1..card, then scattered
        tail = 1.0 - (cards + 1.0) ** (1.0 - ZIPF_S)
        rank = (1.0 - u * tail) ** (1.0 / (1.0 - ZIPF_S))
        rank = rank.floor().long().clamp(1, None) - 1
        rank = torch.minimum(rank, cards.long() - 1)
        sparse = (rank * 2654435761) % cards.long()
    return dense.to(device, dtype), sparse.to(device)


ID_LAWS = ("uniform", "zipf")
ZIPF_S = 1.05  # the skew of Criteo-like categorical features


def dlrm_work(config: DLRMConfig, batch_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(flops, bytes) of one forward pass of ``batch_size`` rows."""
    b, d, f = batch_size, config.embedding_dim, config.num_features
    widths_bottom = (config.num_dense, *config.bottom_mlp)
    widths_top = (config.interaction_dim, *config.top_mlp)
    weights = 0
    flops = 0
    for widths in (widths_bottom, widths_top):
        for n_in, n_out in itertools.pairwise(widths):
            flops += 2 * b * n_in * n_out
            weights += n_in * n_out + n_out
    if config.interaction == "dot":
        flops += 2 * b * f * f * d  # the full bmm T T^T, as computed
    elem = torch.finfo(dtype).bits // 8
    traffic = elem * (weights + b * config.num_tables * d + b * config.num_dense + b)
    traffic += 8 * b * config.num_tables  # int64 ids
    return flops, traffic


def dlrm_inference_cases(
    config_name: str,
    batch_sizes: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cuda",
    *,
    max_cardinality: int | None = None,
    cardinalities: Sequence[int] | None = None,
    seed: int = 0,
    compile_mode: str | None = None,
    ids: str = "uniform",
) -> list[DLRMCase]:
    """One case per batch size, sharing one model; arms "eager" and "compile"; ids as
    ``random_inputs`` draws them.

    The compile arm is ``torch.compile(model, dynamic=False, mode=compile_mode)``, one
    wrapper per batch size; it compiles on its first call (keep that out of the timing).
    """
    config = DLRMConfig.from_name(
        config_name, cardinalities=cardinalities, max_cardinality=max_cardinality
    )
    torch.manual_seed(seed)
    # Built on the device: initialising 26 tables of up to 1M x 128 on the host took
    # minutes per model; on the GPU it is a few uniform_ kernels.
    with torch.device(device):
        model = DLRM(config)
    model = model.to(dtype).eval()
    model.embeddings.check_ids = False
    dtype_name = str(dtype).removeprefix("torch.")
    cases = []
    for b in batch_sizes:
        dense, sparse = random_inputs(config, b, device, dtype, seed=seed + b, ids=ids)
        compiled = torch.compile(model, dynamic=False, mode=compile_mode)

        def eager(dense=dense, sparse=sparse) -> torch.Tensor:
            with torch.no_grad():
                return model(dense, sparse)

        def compile_arm(dense=dense, sparse=sparse, compiled=compiled) -> torch.Tensor:
            with torch.no_grad():
                return compiled(dense, sparse)

        flops, traffic = dlrm_work(config, b, dtype)
        cases.append(
            DLRMCase(
                name=f"{config_name}/bs{b}/{dtype_name}",
                batch_size=b,
                inputs=(dense, sparse),
                arms={"eager": eager, "compile": compile_arm},
                flops=flops,
                bytes=traffic,
                model=model,
            )
        )
    return cases
