"""Fused ops. Each takes ``backend="auto"|"eager"|"compile"|"triton"|"cuda"``.

Importing registers the ``fuseml::*`` custom ops with torch; nothing is compiled or
launched until an op is called, and nothing of Triton's is changed (the on-disk copy of
Triton's own key is opt-in: fuseml.runtime.enable_triton_key_cache).
"""

from fuseml import _triton_key
from fuseml.ops.add import add, add_ref
from fuseml.ops.bias_act import ACTIVATIONS, bias_act, bias_act_ref
from fuseml.ops.embedding_interaction import embedding_interaction, embedding_interaction_ref
from fuseml.ops.gelu import gelu, gelu_ref
from fuseml.ops.linear import linear, linear_ref
from fuseml.ops.lora import lora_linear, lora_linear_ref
from fuseml.ops.mlp import mlp, mlp_ref
from fuseml.ops.softmax import log_softmax, log_softmax_ref, softmax, softmax_ref

__all__ = [
    "ACTIVATIONS",
    "add",
    "add_ref",
    "bias_act",
    "bias_act_ref",
    "embedding_interaction",
    "embedding_interaction_ref",
    "gelu",
    "gelu_ref",
    "linear",
    "linear_ref",
    "log_softmax",
    "log_softmax_ref",
    "lora_linear",
    "lora_linear_ref",
    "mlp",
    "mlp_ref",
    "softmax",
    "softmax_ref",
]

_triton_key.settle_function_keys()  # the same kernel keys in every process (ditto)
