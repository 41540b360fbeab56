"""Modules wrapping the fused ops; plain ``nn.Module`` s with nn.Linear's state_dict layout.

* :class:`FusedLinear` - nn.Linear + activation in one GEMM (``fuseml.ops.linear``).
* :class:`FusedMLP` - an nn.Sequential of Linear(+activation) layers in one launch
  (``fuseml.ops.mlp``), same children and state_dict keys as the plain Sequential.
* :class:`LoRALinear` - a linear layer with peft-style LoRA adapters, unmerged, single or
  per-row (multi-adapter) (``fuseml.ops.lora_linear``).

``fuseml.optimize(model)`` swaps a model's modules for these.
"""

from fuseml.nn.linear import FusedLinear
from fuseml.nn.lora import LoRALinear
from fuseml.nn.mlp import FusedMLP

__all__ = ["FusedLinear", "FusedMLP", "LoRALinear"]
