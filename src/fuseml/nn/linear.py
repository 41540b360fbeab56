"""``FusedLinear``: nn.Linear with its activation fused into the GEMM's epilogue."""

from __future__ import annotations

import torch
from torch import nn

from fuseml.nn._common import check_activation, check_backend, inductor_traces
from fuseml.ops.linear import linear as fused_linear
from fuseml.ops.linear import linear_ref


class FusedLinear(nn.Module):
    """act(x @ weight^T + bias) in one kernel (``fuseml.ops.linear``).

    Same parameters, initialisation and state_dict keys as ``nn.Linear`` (``weight``
    (out, in), ``bias`` (out,) or None), so checkpoints load both ways. ``activation`` is
    None or a name of ``fuseml.ops.ACTIVATIONS``; ``backend`` is passed to the op (auto:
    the Triton kernel on CUDA tensors, the eager reference on CPU). Trains too: the op has
    a backward.
    """

    __constants__ = ("in_features", "out_features")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.activation = check_activation("FusedLinear", activation)
        self.backend = check_backend("FusedLinear", backend)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.Linear.reset_parameters(self)  # nn.Linear's initialisation, unchanged

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, activation: str | None = None, *, backend: str = "auto"
    ) -> FusedLinear:
        """A FusedLinear sharing ``linear``'s parameters (not a copy): training one trains
        the other, and weight ties survive."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"FusedLinear.from_linear: linear must be an nn.Linear, got {type(linear).__name__}"
            )
        fused = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            activation=activation,
            device="meta",  # placeholders, replaced below: nothing allocated or initialised
            dtype=linear.weight.dtype,
            backend=backend,
        )
        fused.weight = linear.weight
        fused.bias = linear.bias
        fused.train(linear.training)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if inductor_traces():  # the replaced modules' math, and no more guards (see there)
            return linear_ref(x, self.weight, self.bias, self.activation)
        return fused_linear(x, self.weight, self.bias, self.activation, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation!r}, "
            f"backend={self.backend!r}"
        )
