"""``FusedDLRM``: the DLRM forward with the embedding gather and the dot interaction in one
kernel (``fuseml.ops.embedding_interaction``) writing the top MLP's input directly."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fuseml.models.dlrm import DLRM, SparseInput
from fuseml.nn._common import activation_of, call_backend, check_backend
from fuseml.nn.linear import FusedLinear
from fuseml.ops.embedding_interaction import embedding_interaction
from fuseml.ops.linear import padded_weight, padded_width
from fuseml.ops.mlp import mlp as fused_mlp

__all__ = ["FusedDLRM"]

_NO_RANGE = contextlib.nullcontext()


def interaction_width(k: int) -> int:
    """Columns the fused interaction writes for a top MLP of input width k: the width
    ``fuseml.ops.linear`` would pad K to itself (16-byte aligned rows, the GEMM's TMA
    path), written padded in the first place."""
    return padded_width(k)


def _padded(weight: torch.Tensor, width: int) -> torch.Tensor:
    """weight with zero columns up to ``width``: kept per weight version on direct calls
    (one pad launch per version), a traced pad under torch.compile."""
    if torch.compiler.is_compiling():
        return F.pad(weight, (0, width - weight.shape[1]))
    return padded_weight(weight, width)


class FusedDLRM(DLRM):
    """A :class:`fuseml.models.dlrm.DLRM` (dot interaction) whose forward gathers the
    embeddings and computes the interaction in one kernel.

    It holds the very submodules of the DLRM it is built from (``FusedDLRM.from_dlrm``), so
    its parameters, buffers and state_dict keys are that model's; ``fuseml.optimize`` then
    swaps the MLPs inside it for fused ones. When the top MLP is a chain of linear layers
    (nn.Linear or FusedLinear, with activations), the interaction writes ``[x, tril(Z Z^T)]``
    padded with zero columns to an aligned width and the chain runs as one
    ``fuseml.ops.mlp`` call on it, its first weight zero-padded to match (kept per weight
    version, so no pad pass runs per call) and the sigmoid in its last epilogue.

    The fused path takes one-hot ids ((B, T) int32/int64) or multi-hot bags (T
    ``(indices, offsets)`` pairs) on a CUDA device; mixed dtypes (the bottom MLP's output
    and the tables), CPU tensors and training (autograd recording) run the DLRM's own
    stages (the same result).
    """

    # stage_range(name) -> a context manager around a stage (fuseml.apps.profile sets it
    # on an instance while profiling); None: no ranges, no cost
    stage_range = None

    def __init__(self, *args, **kwargs) -> None:
        raise TypeError("FusedDLRM: build it with FusedDLRM.from_dlrm(model)")

    def _stage(self, name: str):
        return _NO_RANGE if self.stage_range is None else self.stage_range(name)

    @classmethod
    def from_dlrm(cls, model: DLRM, *, backend: str = "auto") -> FusedDLRM:
        if not isinstance(model, DLRM):
            raise TypeError(
                f"FusedDLRM.from_dlrm: model must be a DLRM, got {type(model).__name__}"
            )
        if model.config.interaction != "dot":
            raise ValueError(
                "FusedDLRM.from_dlrm: the fused kernel computes the dot interaction; "
                f"this model's interaction is {model.config.interaction!r}"
            )
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.config = model.config
        fused.backend = check_backend("FusedDLRM", backend)
        for name, child in model.named_children():
            setattr(fused, name, child)
        fused.train(model.training)
        return fused

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"

    def forward(
        self, dense: torch.Tensor, sparse: SparseInput, return_logits: bool = False
    ) -> torch.Tensor:
        if not self._fused_path(dense, sparse):
            return super().forward(dense, sparse, return_logits)
        self._check_dense(dense)
        emb = self.embeddings
        x = self.bottom_mlp(dense)  # (B, d)
        if x.dtype != emb.weight.dtype:  # e.g. under autocast: the DLRM's own stages
            logits = self.top_mlp(self.interaction(x, emb(sparse))).squeeze(1)
            return logits if return_logits else torch.sigmoid(logits)
        # checked (or hashed) as the DLRM's forward does
        one_hot = isinstance(sparse, torch.Tensor)
        ids = emb.one_hot_ids(sparse) if one_hot else emb.bag_ids(sparse)
        k = self.interaction.output_dim(x.shape[1])
        top = self._top_chain(x.dtype)
        width = interaction_width(k) if top is not None else k
        with self._stage("embedding_interaction"):
            z = embedding_interaction(
                x,
                emb.weight,
                emb.table_offsets,
                ids,
                self_interaction=self.interaction.self_interaction,
                out_width=width,
                backend="triton",
            )
        if top is None:  # a top MLP of other modules: run as it is
            logits = self.top_mlp(z).squeeze(1)
            return logits if return_logits else torch.sigmoid(logits)
        weights, biases, acts = top
        if width != k:  # the first weight padded with zero columns
            weights = [_padded(weights[0], width), *weights[1:]]
        sigmoid_in_chain = not return_logits and acts[-1] == "none"
        if sigmoid_in_chain:
            acts = [*acts[:-1], "sigmoid"]
        with self._stage("top_mlp"):
            out = fused_mlp(z, weights, biases, acts, backend="triton").squeeze(1)
        if return_logits or sigmoid_in_chain:
            return out
        return torch.sigmoid(out)

    def _top_chain(self, dtype: torch.dtype) -> tuple[list, list, list] | None:
        """The top MLP as (weights, biases, activation names) when it is a chain of linear
        layers (nn.Linear or FusedLinear, each optionally followed by an activation or an
        Identity) in ``dtype``, run by one ``fuseml.ops.mlp`` call (which tunes between
        its chain kernels and the layers one by one); else None."""
        plan = self._top_plan()
        if plan is None:
            return None
        linears, acts = plan
        weights = [m.weight for m in linears]
        if any(w.dtype != dtype or (w.requires_grad and torch.is_grad_enabled()) for w in weights):
            return None
        return weights, [m.bias for m in linears], acts

    def _top_plan(self) -> tuple[list, list] | None:
        """(linear modules, activation names) of the top MLP as a chain, or None; read
        again only when its children change (or an activation module's settings, or a
        FusedLinear's activation): every call asks."""
        top = self.top_mlp
        children = tuple(
            (m, m.__dict__.get("activation"), m.__dict__.get("approximate"),
             m.__dict__.get("negative_slope"))
            for m in top._modules.values()
        )  # fmt: skip
        cached = self.__dict__.get("_top_cache")
        if cached is not None and cached[0] is top and cached[1] == children:
            return cached[2]
        linears, acts = [], []
        plan = (linears, acts)
        for m in top._modules.values():
            if m is None or type(m) is nn.Identity:
                continue
            if type(m) in (nn.Linear, FusedLinear):
                linears.append(m)
                acts.append(getattr(m, "activation", None) or "none")
                continue
            act, _ = activation_of(m)
            if act is None or not acts or acts[-1] != "none":
                plan = None
                break
            acts[-1] = act
        if plan is not None and not linears:
            plan = None
        self.__dict__["_top_cache"] = (top, children, plan)
        return plan

    def _fused_path(self, dense, sparse) -> bool:
        """Whether this call can take the fused kernel (else the DLRM's forward)."""
        if not isinstance(dense, torch.Tensor) or not isinstance(
            sparse, (torch.Tensor, list, tuple)
        ):
            return False  # a bad argument: the DLRM's forward names it
        weight = self.embeddings.weight
        return call_backend("FusedDLRM", self.backend, dense, [weight]) == "triton"
