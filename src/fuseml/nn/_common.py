"""Shared by the fused modules: activation modules <-> epilogue names, backend choice."""

from __future__ import annotations

import logging

import torch
from torch import nn

from fuseml.ops.bias_act import ACTIVATIONS
from fuseml.runtime import resolve_backend

log = logging.getLogger("fuseml")

# Backends a module may be given; no fused module has a CUDA C++ twin.
MODULE_BACKENDS = ("auto", "eager", "compile", "triton")
LEAKY_SLOPE = 0.01  # the fused epilogue's only LeakyReLU slope (fuseml.ops._elementwise)

# Exact module types (a subclass may override forward) and their epilogue names.
_SIMPLE = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh"}


def check_activation(owner: str, activation) -> str | None:
    """None or a name of ACTIVATIONS ('none' becomes None); ValueError otherwise."""
    if activation is None or activation == "none":
        return None
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"{owner}: activation must be None or one of {ACTIVATIONS}, got {activation!r}"
        )
    return activation


def check_backend(owner: str, backend) -> str:
    if backend not in MODULE_BACKENDS:
        raise ValueError(f"{owner}: backend must be one of {MODULE_BACKENDS}, got {backend!r}")
    return backend


def activation_of(module: nn.Module) -> tuple[str | None, str | None]:
    """(epilogue name, None) for a supported activation module, (None, why) for an
    activation module the epilogue cannot express, (None, None) for anything else."""
    kind = type(module)
    if kind in _SIMPLE:
        return _SIMPLE[kind], None
    if kind is nn.GELU:
        if module.approximate == "none":
            return "gelu", None
        if module.approximate == "tanh":
            return "gelu_tanh", None
        return None, f"GELU(approximate={module.approximate!r}) has no fused epilogue"
    if kind is nn.LeakyReLU:
        if module.negative_slope == LEAKY_SLOPE:
            return "leaky_relu", None
        return None, (
            f"LeakyReLU(negative_slope={module.negative_slope}): the fused epilogue has "
            f"slope {LEAKY_SLOPE} only"
        )
    if (
        kind.__module__ == "torch.nn.modules.activation" and kind is not nn.MultiheadAttention
    ) or any(issubclass(kind, k) for k in (*_SIMPLE, nn.GELU, nn.LeakyReLU)):
        return None, f"{kind.__name__} has no fused epilogue"
    return None, None


def activation_module(name: str | None) -> nn.Module:
    """The torch module computing the epilogue ``name`` (None: nn.Identity)."""
    modules = {
        None: nn.Identity,
        "relu": nn.ReLU,
        "leaky_relu": nn.LeakyReLU,  # default slope 0.01, the epilogue's
        "gelu": nn.GELU,
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "silu": nn.SiLU,
        "sigmoid": nn.Sigmoid,
        "tanh": nn.Tanh,
    }
    return modules[name]()


_told_training: set[str] = set()


def inductor_traces() -> bool:
    """Is torch.compile or torch.export tracing this call? Then the swapped layers
    (FusedLinear, FusedMLP, LoRALinear) hand the tracer the math of the modules they
    replaced, which Inductor fuses as it would in the original model: their GEMM kernels
    traced into Inductor's graph run the pointer loop on untuned tiles (no TMA descriptors,
    no padded K), slower than Inductor's own code on most of the models suite (the kaggle
    top MLP 1.6-10x at 64-65536 rows, H200; docs/performance/host.md). (Dynamo folds
    torch.compiler.is_exporting() to True under torch.compile too, on torch 2.11: the two
    cannot be told apart there.)"""
    return torch.compiler.is_compiling()


def call_backend(owner: str, backend: str, x, params) -> str:
    """The concrete backend for one call of a forward-only fused op.

    ``fuseml.ops.lora_linear`` and ``fuseml.ops.mlp`` have no backward on their fused
    kernels. When autograd must record the call (grad mode on and x or a parameter
    requiring grad), the module runs the eager reference instead: the same result, with
    torch's backward. Said once per module class. (Under torch.compile the swapped
    layers return their math before asking: ``inductor_traces``.)
    """
    if not isinstance(x, torch.Tensor):
        return backend  # the op raises its own TypeError naming x
    resolved = resolve_backend(backend, x.device, owner, cuda_twin=False)
    if resolved != "triton" or not torch.is_grad_enabled():
        return resolved
    if not (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return resolved
    if owner not in _told_training:
        _told_training.add(owner)
        log.info(
            "%s: autograd is recording (training), so the forward runs the eager reference "
            "(the fused kernel is forward-only; same result). Use torch.no_grad() or "
            "torch.inference_mode() for the fused kernel.",
            owner,
        )
    return "eager"
