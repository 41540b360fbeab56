"""Models in plain PyTorch, built from swappable submodules (``fuseml.optimize`` swaps them
for fused ones).

* :mod:`fuseml.models.dlrm` - DLRM with the reference's (facebookresearch/dlrm) semantics.
* :mod:`fuseml.models.bench_cases` - DLRM inference cases for the benchmark harness.
"""

from fuseml.models.dlrm import (
    CONFIG_NAMES,
    DLRM,
    CatInteraction,
    ConcatEmbeddingBags,
    DLRMConfig,
    DotInteraction,
    SparseInput,
    mlp,
)

__all__ = [
    "CONFIG_NAMES",
    "DLRM",
    "CatInteraction",
    "ConcatEmbeddingBags",
    "DLRMConfig",
    "DotInteraction",
    "SparseInput",
    "mlp",
]
