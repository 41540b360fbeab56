"""``FusedMLP``: an nn.Sequential MLP whose forward is one fused launch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from fuseml.nn._common import (
    activation_module,
    activation_of,
    call_backend,
    check_activation,
    check_backend,
    inductor_traces,
)
from fuseml.ops.mlp import mlp as fused_mlp
from fuseml.serving import replay_cache, replay_key


class FusedMLP(nn.Sequential):
    """An ``nn.Sequential`` of ``nn.Linear`` layers, each optionally followed by one
    activation module, run by ``fuseml.ops.mlp`` (one launch: the chain kernel or the
    scratch kernel, or layer by layer where tuning found that faster).

    The children are the plain modules (``nn.Linear``, ``nn.ReLU``, ...) at the same
    indices as in the equivalent ``nn.Sequential``, so ``state_dict`` keys ("0.weight",
    "2.bias", ...) are identical and checkpoints load both ways. Activations come from the
    children (ReLU, GELU (none/tanh), SiLU, Sigmoid, Tanh, LeakyReLU(0.01)); nn.Identity
    children are skipped.

    ``FusedMLP(widths, activations)``: widths (in, h1, ..., out); activations one name for
    every layer or one per layer (None: no activation). ``FusedMLP.from_sequential(seq)``
    wraps the modules of an existing Sequential (shared, not copied).

    Training: the fused kernel is forward-only, so while autograd records the call the
    forward runs the eager reference (same result; logged once).
    """

    def __init__(
        self,
        widths: Sequence[int],
        activations: str | Sequence[str | None] | None = "relu",
        *,
        bias: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        owner = "FusedMLP"
        if isinstance(widths, (str, torch.Tensor)) or not isinstance(widths, Sequence):
            raise TypeError(f"{owner}: widths must be a sequence of ints (in, ..., out)")
        widths = list(widths)
        if len(widths) < 2 or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths
        ):
            raise ValueError(
                f"{owner}: widths must be at least two positive ints (in, ..., out), got {widths}"
            )
        n = len(widths) - 1
        if activations is None or isinstance(activations, str):
            activations = [activations] * n
        activations = list(activations)
        if len(activations) != n:
            raise ValueError(
                f"{owner}: activations must be one name or one per layer ({n}), got "
                f"{len(activations)}"
            )
        activations = [check_activation(owner, a) for a in activations]
        modules: list[nn.Module] = []
        for i, act in enumerate(activations):
            modules.append(nn.Linear(widths[i], widths[i + 1], bias, device=device, dtype=dtype))
            if act is not None:
                modules.append(activation_module(act))
        super().__init__(*modules)
        self.backend = check_backend(owner, backend)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, *, backend: str = "auto") -> FusedMLP:
        """A FusedMLP holding ``seq``'s modules under the same names (shared, not copied).

        ``seq`` must be nn.Linear layers, each optionally followed by one supported
        activation module (nn.Identity anywhere is allowed); ValueError names the first
        child that does not fit.
        """
        if not isinstance(seq, nn.Sequential):
            raise TypeError(
                f"FusedMLP.from_sequential: seq must be an nn.Sequential, got {type(seq).__name__}"
            )
        fused = cls.__new__(cls)
        nn.Sequential.__init__(fused, OrderedDict(seq._modules))  # keeps repeated modules
        fused.backend = check_backend("FusedMLP", backend)
        fused.layers()  # validate now rather than at the first forward
        fused.train(seq.training)
        return fused

    @classmethod
    def from_linears(
        cls,
        linears: Sequence[nn.Linear],
        activations: str | Sequence[str | None] | None = "relu",
        *,
        backend: str = "auto",
    ) -> FusedMLP:
        """A FusedMLP of existing nn.Linear layers (shared) with the given activations."""
        linears = list(linears)
        if activations is None or isinstance(activations, str):
            activations = [activations] * len(linears)
        activations = list(activations)
        if len(activations) != len(linears):
            raise ValueError(
                f"FusedMLP.from_linears: activations must be one name or one per layer "
                f"({len(linears)}), got {len(activations)}"
            )
        modules: list[nn.Module] = []
        for lin, act in zip(linears, activations):
            modules.append(lin)
            act = check_activation("FusedMLP.from_linears", act)
            if act is not None:
                modules.append(activation_module(act))
        return cls.from_sequential(nn.Sequential(*modules), backend=backend)

    def layers(self) -> list[tuple[nn.Linear, str | None]]:
        """(linear, activation name or None) per layer, read from the children."""
        plan: list[list] = []
        for name, m in self._modules.items():
            if type(m) is nn.Linear:  # exactly: a subclass may change forward
                plan.append([m, None])
                continue
            if m is None or isinstance(m, nn.Identity):
                continue
            act, why = activation_of(m)
            if act is None:
                raise ValueError(
                    f"FusedMLP: child {name!r} ({type(m).__name__}) must be nn.Linear or a "
                    f"supported activation module{': ' + why if why else ''}"
                )
            if not plan or plan[-1][1] is not None:
                raise ValueError(
                    f"FusedMLP: child {name!r} ({type(m).__name__}) must follow an nn.Linear "
                    "(one activation per layer)"
                )
            plan[-1][1] = act
        if not plan:
            raise ValueError("FusedMLP: needs at least one nn.Linear child")
        return [(lin, act) for lin, act in plan]

    def _layers_now(self) -> tuple[list[nn.Linear], list[str | None]]:
        """``layers()`` split in two lists, read again only when the children change (or
        the two activation settings the epilogue depends on: GELU's approximation and
        LeakyReLU's slope)."""
        children = tuple(
            (m, m.__dict__.get("approximate"), m.__dict__.get("negative_slope"))
            for m in self._modules.values()
        )
        cached = self.__dict__.get("_layers_cache")
        if cached is None or cached[0] != children:
            plan = self.layers()
            cached = (children, [lin for lin, _ in plan], [act for _, act in plan])
            self.__dict__["_layers_cache"] = cached
        return cached[1], cached[2]

    # Repeated eager inference calls (eval mode, no autograd) of one signature replay a
    # CUDA graph of the forward (at most this many graphs, see fuseml.serving.ReplayCache);
    # 0: every call launches.
    replay_graphs = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if inductor_traces():  # the children's own math: the plain Sequential's guards
            return super().forward(x)
        linears, acts = self._layers_now()
        weights = [lin.weight for lin in linears]
        biases = [lin.bias for lin in linears]
        backend = call_backend("FusedMLP", self.backend, x, [*weights, *biases])
        key = self._replay_key(x, acts, backend) if self.replay_graphs else None
        if key is None:
            return fused_mlp(x, weights, biases, acts, backend=backend)
        run = lambda t: fused_mlp(t, weights, biases, acts, backend=backend)
        return replay_cache(self, "FusedMLP").run(key, run, [x])

    def _replay_key(self, x: torch.Tensor, acts, backend: str) -> tuple | None:
        """The signature of an eager call whose replays a CUDA graph can serve, or None
        (fuseml.serving.replay_key)."""
        return replay_key(self, x, tuple(acts), backend)

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # a part of the chain is a plain Sequential
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def to_sequential(self) -> nn.Sequential:
        """The same modules (shared) in a plain nn.Sequential: the unfused twin."""
        return nn.Sequential(OrderedDict(self._modules))

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"
