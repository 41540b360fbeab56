"""``FusedDLRM``: the DLRM forward with the embedding gather and the dot interaction in one
kernel (``fuseml.ops.embedding_interaction``) writing the top MLP's input directly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fuseml.models.dlrm import DLRM, SparseInput
from fuseml.nn._common import activation_of, call_backend, check_backend, inductor_traces
from fuseml.nn.linear import FusedLinear
from fuseml.ops._utils import needs_dispatch
from fuseml.ops.embedding_interaction import embedding_interaction
from fuseml.ops.linear import padded_weight, padded_width
from fuseml.ops.mlp import mlp as fused_mlp
from fuseml.serving import ReplayCache, module_state, replay_cache, state_key

__all__ = ["STAGES", "FusedDLRM", "stage_ranges"]

# (a FusedDLRM runs embeddings + interaction as one stage, embedding_interaction)
STAGES = ("bottom_mlp", "embeddings", "interaction", "embedding_interaction", "top_mlp")

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
    # Eager calls: how many CUDA graphs of repeated call signatures to keep (see
    # fuseml.serving.ReplayCache); 0: every call launches its kernels.
    replay_graphs = 4

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
        emb = self.embeddings
        # ids checked in the kernel, which flags a table with an id outside it (no sync);
        # the flags read once the forward is queued (a sync, as the DLRM's own check)
        check = emb.check_ids and not emb.hash_ids and not torch.compiler.is_compiling()
        key = self._replay_key(dense, sparse, return_logits, check) if self.replay_graphs else None
        if key is None:
            out = self._fused(dense, sparse, return_logits, check)
        else:
            out = self._replays().run(
                key, lambda d, s: self._fused(d, s, return_logits, check), [dense, sparse]
            )
        if check:
            emb.raise_if_bad_ids()
        return out

    def _replays(self) -> ReplayCache:
        return replay_cache(self, "FusedDLRM")

    def _replay_key(self, dense, sparse, return_logits: bool, check: bool) -> tuple | None:
        """The signature of an eager call whose replays a CUDA graph can serve, or None:
        inference on CUDA with one-hot ids (bags vary in length), not inside a capture,
        a compilation or a profile's stage ranges."""
        if (
            torch.is_grad_enabled()
            or self.training
            or type(sparse) is not torch.Tensor
            or type(dense) is not torch.Tensor
            or not dense.is_cuda
            or self.stage_range is not None
            or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()
            or torch.is_autocast_enabled("cuda")
            or needs_dispatch(dense, sparse)
        ):
            return None
        versions = state_key(self)
        if versions is None:  # inference tensors keep no version: nothing to key on
            return None
        return (
            tuple(dense.shape), dense.stride(), dense.dtype, dense.device,
            tuple(sparse.shape), sparse.stride(), sparse.dtype, return_logits,
            torch.backends.cuda.matmul.allow_tf32, versions,
            # the settings the forward reads besides its tensors
            check, self.embeddings.hash_ids, self.interaction.self_interaction,
        )  # fmt: skip

    def _state_tensors(self) -> list[torch.Tensor | None]:
        return module_state(self)

    def _fused(self, dense, sparse, return_logits: bool, check: bool) -> torch.Tensor:
        """The fused forward (flags of bad ids set, not read)."""
        self._check_dense(dense)
        emb = self.embeddings
        x = self._bottom(dense)  # (B, d)
        if x.dtype != emb.weight.dtype:  # e.g. under autocast: the DLRM's own stages
            logits = self.top_mlp(self.interaction(x, emb(sparse))).squeeze(1)
            return logits if return_logits else torch.sigmoid(logits)
        one_hot = isinstance(sparse, torch.Tensor)
        if one_hot:
            ids = emb.one_hot_ids(sparse, range_check=False)
        else:
            ids = emb.bag_ids(sparse, range_check=False)
        flags = emb.bad_id_flags(x.device) if check else None
        k = self.interaction.output_dim(x.shape[1])
        top = self._chain("top_mlp", x.dtype)
        width = interaction_width(k) if top is not None else k
        with self._stage("embedding_interaction"):
            z = embedding_interaction(
                x,
                emb.weight,
                emb.table_offsets,
                ids,
                self_interaction=self.interaction.self_interaction,
                out_width=width,
                bad_ids=flags,
                # auto: the op's own pick between its Triton kernel and CUDA twin
                backend="auto" if self.backend == "auto" else "triton",
            )
        return self._top(z, top, k, width, return_logits)

    def _bottom(self, dense: torch.Tensor) -> torch.Tensor:
        """The bottom MLP. Traced, a chain of linear layers in dense's dtype runs as one
        ``fuseml.ops.mlp`` call, as the top MLP does: a FusedMLP hands a tracer its layers'
        math, and Inductor's GEMMs on the narrow bottom chain (13 -> 512 -> 256 -> 16) take
        about twice the time of fuseml's chain (H200, kaggle: the compiled model 364
        against 204 us at 65,536 rows)."""
        if inductor_traces():
            chain = self._chain("bottom_mlp", dense.dtype)
            if chain is not None:
                return fused_mlp(dense, *chain, backend="triton")
        return self.bottom_mlp(dense)

    def _top(self, z, top, k: int, width: int, return_logits: bool) -> torch.Tensor:
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

    def _chain(self, name: str, dtype: torch.dtype) -> tuple[list, list, list] | None:
        """The MLP ``name`` (top_mlp, bottom_mlp) as (weights, biases, activation names)
        when it is a chain of linear layers (nn.Linear or FusedLinear, each optionally
        followed by an activation or an Identity) in ``dtype``, run by one
        ``fuseml.ops.mlp`` call (which tunes between its chain kernels and the layers one
        by one); else None."""
        plan = self._plan(name)
        if plan is None:
            return None
        linears, acts = plan
        weights = [m.weight for m in linears]
        if any(w.dtype != dtype or (w.requires_grad and torch.is_grad_enabled()) for w in weights):
            return None
        return weights, [m.bias for m in linears], acts

    def _plan(self, name: str) -> tuple[list, list] | None:
        """(linear modules, activation names) of the MLP ``name`` as a chain, or None; read
        again only when it or its children change (or an activation module's settings, or
        a FusedLinear's activation): every call asks."""
        mlp = getattr(self, name)
        children = tuple(
            (m, m.__dict__.get("activation"), m.__dict__.get("approximate"),
             m.__dict__.get("negative_slope"))
            for m in mlp._modules.values()
        )  # fmt: skip
        key = "_plan_of_" + name
        cached = self.__dict__.get(key)
        if cached is not None and cached[0] is mlp and cached[1] == children:
            return cached[2]
        linears, acts = [], []
        plan = (linears, acts)
        for m in mlp._modules.values():
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
        self.__dict__[key] = (mlp, children, plan)
        return plan

    def _fused_path(self, dense, sparse) -> bool:
        """Whether this call can take the fused kernel (else the DLRM's forward)."""
        if not isinstance(dense, torch.Tensor) or not isinstance(
            sparse, (torch.Tensor, list, tuple)
        ):
            return False  # a bad argument: the DLRM's forward names it
        weight = self.embeddings.weight
        # (under torch.compile too: the gather + interaction kernel traced into Inductor's
        # graph beats Inductor's own code, 235 against 838 us at 65536 rows, H200)
        backend = call_backend("FusedDLRM", self.backend, dense, [weight])
        return backend == "triton"


@contextlib.contextmanager
def stage_ranges(model: DLRM, *, nvtx: bool | None = None) -> Iterator[None]:
    """Wrap each stage's forward in ``record_function`` (+ NVTX) ranges named
    ``dlrm.<stage>`` (STAGES), until exit: forward hooks on a DLRM's stage modules, and a
    FusedDLRM's ``stage_range`` for the stages it runs without a module call. The model's
    forward is untouched and pays nothing otherwise (``fuseml profile``, the dlrm bench
    suite's per-stage breakdown)."""
    if nvtx is None:
        nvtx = next(model.parameters()).is_cuda
    handles = []

    @contextlib.contextmanager
    def stage(name: str) -> Iterator[None]:  # a FusedDLRM's stages without a module call
        with torch.profiler.record_function("dlrm." + name):
            if nvtx:
                torch.cuda.nvtx.range_push("dlrm." + name)
            try:
                yield
            finally:
                if nvtx:
                    torch.cuda.nvtx.range_pop()

    fused = isinstance(model, FusedDLRM)
    if fused:
        model.stage_range = stage
    for name in STAGES:
        module = getattr(model, name, None)
        if module is None:
            continue
        open_ranges: list[Any] = []  # per module: a stage never re-enters itself

        def enter(_module, _args, name=name, open_ranges=open_ranges) -> None:
            rf = torch.profiler.record_function("dlrm." + name)
            rf.__enter__()
            open_ranges.append(rf)
            if nvtx:
                torch.cuda.nvtx.range_push("dlrm." + name)

        def leave(_module, _args, _out, open_ranges=open_ranges) -> None:
            if nvtx:
                torch.cuda.nvtx.range_pop()
            open_ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if fused:
            del model.stage_range
