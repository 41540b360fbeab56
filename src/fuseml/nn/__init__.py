"""Modules wrapping the fused ops; plain ``nn.Module`` s with nn.Linear's state_dict layout.

* :class:`FusedLinear` - nn.Linear + activation in one GEMM (``fuseml.ops.linear``).
* :class:`FusedMLP` - an nn.Sequential of Linear(+activation) layers in one launch
  (``fuseml.ops.mlp``), same children and state_dict keys as the plain Sequential.
* :class:`LoRALinear` - a linear layer with peft-style LoRA adapters, unmerged, single or
  per-row (multi-adapter) (``fuseml.ops.lora_linear``).

* :class:`FusedDLRM` - a DLRM whose embedding gather and dot interaction run as one
  kernel (``fuseml.ops.embedding_interaction``), same submodules and state_dict keys.

``fuseml.optimize(model)`` swaps a model's modules for these.
"""

from fuseml.nn.dlrm import FusedDLRM
from fuseml.nn.linear import FusedLinear
from fuseml.nn.lora import LoRALinear
from fuseml.nn.mlp import FusedMLP

__all__ = ["FusedDLRM", "FusedLinear", "FusedMLP", "LoRALinear"]
