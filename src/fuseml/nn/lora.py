"""``LoRALinear``: a linear layer with LoRA adapters kept unmerged, run as one fused GEMM."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fuseml.nn._common import (
    call_backend,
    check_activation,
    check_backend,
    inductor_traces,
    log,
)
from fuseml.ops._utils import check_same
from fuseml.ops.linear import check_linear_args, linear_ref
from fuseml.ops.linear import linear as fused_linear
from fuseml.ops.lora import (
    capturing,
    check_adapter_ids,
    check_adapter_ids_tensor,
    device_scales,
    fast_call,
    lora_linear,
    lora_linear_ref,
    lora_stacked,
    stack_adapters,
)
from fuseml.serving import replay_cache, replay_key

_OWNER = "LoRALinear"


def _version(t: torch.Tensor) -> int | None:
    """t's in-place modification counter (None for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


class LoRALinear(nn.Module):
    """act(x @ W^T + b + scaling * (x @ A^T) @ B^T) with the adapters unmerged.

    Stored as peft stores a LoRA ``Linear``: ``base_layer`` (nn.Linear), and per adapter
    name ``lora_A[name]`` (nn.Linear in -> r, weight (r, in)) and ``lora_B[name]``
    (nn.Linear r -> out, weight (out, r)), ``r[name]``, ``lora_alpha[name]`` and
    ``scaling[name]`` (lora_alpha / r). So the state_dict keys are peft's
    ("base_layer.weight", "lora_A.default.weight", ...). The adapters are held in the base
    weight's dtype, the one dtype the fused kernel takes: ``load_state_dict`` casts a
    checkpoint's adapters to it (peft saves float32 adapters over a 16-bit base by
    default), and ``fuseml.optimize`` casts a peft layer's adapters likewise.

    * ``forward(x)``: the active adapter (``set_adapter``), or the base layer alone when
      none is active, through ``fuseml.ops.lora_linear``.
    * ``forward(x, adapter_ids)``: one adapter per row, ids indexing ``adapters``
      (insertion order), -1 for the base layer alone. Adapters of different ranks are
      zero-padded to the largest rank (exact). The stacked weights are cached and rebuilt
      when an adapter, its weights (in-place updates included) or a scaling change.
    * ``merge()`` / ``unmerge()``: W += scaling * B @ A for the active adapter, then plain
      ``fuseml.ops.linear``; unmerge restores the kept copy of W bit for bit (or, if W was
      modified while merged, subtracts the delta again).
    * Training: the fused kernel is forward-only; while autograd records the call the
      forward runs the eager reference (same result; logged once).

    ``base`` is an nn.Linear (shared, not copied) or (in_features, out_features); with
    ``r`` an adapter ``adapter_name`` is added with peft's initialisation.
    """

    def __init__(
        self,
        base: nn.Linear | tuple[int, int],
        r: int | None = None,
        lora_alpha: float | None = None,
        *,
        adapter_name: str = "default",
        activation: str | None = None,
        bias: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if isinstance(base, nn.Linear):
            self.base_layer = base
        elif (
            isinstance(base, Sequence)
            and len(base) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in base)
        ):
            self.base_layer = nn.Linear(base[0], base[1], bias, device=device, dtype=dtype)
        else:
            raise TypeError(
                f"{_OWNER}: base must be an nn.Linear or (in_features, out_features), got "
                f"{base!r:.80}"
            )
        self.in_features = self.base_layer.in_features
        self.out_features = self.base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.r: dict[str, int] = {}
        self.lora_alpha: dict[str, float] = {}
        self.scaling: dict[str, float] = {}
        self.active_adapter: str | None = None
        self.activation = check_activation(_OWNER, activation)
        self.backend = check_backend(_OWNER, backend)
        self.merged_adapter: str | None = None
        # W before merge(), restored by unmerge(); a buffer so .to() moves it, not saved.
        self.register_buffer("_unmerged_weight", None, persistent=False)
        self._merged_version: int | None = None
        self._stack_cache: tuple | None = None  # (adapter tensors, key, stacked form)
        if r is not None:
            self.add_adapter(adapter_name, r, lora_alpha)
            self.set_adapter(adapter_name)

    # ------------------------------------------------------------------ parameters
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def adapters(self) -> list[str]:
        """Adapter names in insertion order: ``adapter_ids`` index this list."""
        return list(self.lora_A.keys())

    @property
    def merged(self) -> bool:
        return self.merged_adapter is not None

    # -------------------------------------------------------------------- adapters
    def add_adapter(
        self,
        name: str,
        r: int | None = None,
        lora_alpha: float | None = None,
        *,
        init="peft",
        scaling: float | None = None,
    ) -> None:
        """Add adapter ``name`` (it does not become active: see ``set_adapter``).

        init: "peft" (A kaiming-uniform as nn.Linear, B zeros: the layer starts unchanged),
        or a pair (lora_A, lora_B) of tensors (A (r, in), B (out, r); copied) or of
        bias-free nn.Linear modules (in -> r, r -> out; shared, as peft holds them).
        r defaults to the given A's rows; lora_alpha defaults to r; scaling defaults to
        lora_alpha / r (pass it for rsLoRA's lora_alpha / sqrt(r)).
        """
        op = f"{_OWNER}.add_adapter"
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"{op}: name must be a non-empty string without '.', got {name!r}")
        if name in self.lora_A:
            raise ValueError(f"{op}: an adapter named {name!r} exists (adapters: {self.adapters})")
        w = self.weight
        if isinstance(init, str):
            if init != "peft":
                raise ValueError(
                    f"{op}: init must be 'peft' or a pair (lora_A, lora_B), got {init!r}"
                )
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(f"{op}: r must be a positive int, got {r!r}")
            a_mod = nn.Linear(self.in_features, r, bias=False, device=w.device, dtype=w.dtype)
            b_mod = nn.Linear(r, self.out_features, bias=False, device=w.device, dtype=w.dtype)
            nn.init.kaiming_uniform_(a_mod.weight, a=math.sqrt(5))  # peft's init_lora_weights=True
            nn.init.zeros_(b_mod.weight)
        else:
            a_mod, b_mod = self._adapter_modules(op, init, r)
            r = a_mod.weight.shape[0]
        if lora_alpha is None:
            lora_alpha = r
        if scaling is None:
            scaling = lora_alpha / r
        for arg, v in (("lora_alpha", lora_alpha), ("scaling", scaling)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{op}: {arg} must be a real number, got {type(v).__name__}")
        self.lora_A[name] = a_mod
        self.lora_B[name] = b_mod
        self.r[name] = r
        self.lora_alpha[name] = lora_alpha
        self.scaling[name] = float(scaling)
        self._invalidate()

    def _adapter_modules(self, op: str, init, r) -> tuple[nn.Linear, nn.Linear]:
        if not (isinstance(init, (tuple, list)) and len(init) == 2):
            raise ValueError(
                f"{op}: init must be 'peft' or a pair (lora_A, lora_B), got {init!r:.80}"
            )
        a, b = init
        w = self.weight
        if all(isinstance(t, nn.Linear) for t in init):
            for arg, m in (("lora_A", a), ("lora_B", b)):
                if m.bias is not None:
                    raise ValueError(
                        f"{op}: {arg} must have no bias (LoRA with a bias term is not supported)"
                    )
            a_mod, b_mod = a, b
        elif all(isinstance(t, torch.Tensor) for t in init):
            a_mod, b_mod = self._linear_of(a), self._linear_of(b)
        else:
            raise TypeError(
                f"{op}: init must be 'peft' or a pair of tensors or nn.Linear modules, got "
                f"({type(a).__name__}, {type(b).__name__})"
            )
        aw, bw = a_mod.weight, b_mod.weight
        rank = aw.shape[0] if aw.dim() == 2 else -1
        if r is not None and r != rank:
            raise ValueError(f"{op}: r={r} but lora_A has shape {tuple(aw.shape)} (r, in)")
        if aw.dim() != 2 or rank < 1 or aw.shape[1] != self.in_features:
            raise ValueError(
                f"{op}: lora_A must be (r, {self.in_features}) (r, in_features), got "
                f"{tuple(aw.shape)}"
            )
        if tuple(bw.shape) != (self.out_features, rank):
            raise ValueError(
                f"{op}: lora_B must be ({self.out_features}, {rank}) (out_features, r), got "
                f"{tuple(bw.shape)}"
            )
        check_same(op, "weight", w, "lora_A", aw)
        check_same(op, "weight", w, "lora_B", bw)
        return a_mod, b_mod

    def _linear_of(self, t: torch.Tensor) -> nn.Linear:
        """A bias-free nn.Linear whose weight is a copy of t, on the base weight's device
        and in its dtype."""
        w = self.weight
        m = nn.Linear(1, 1, bias=False, device="meta")
        m.weight = nn.Parameter(t.detach().to(device=w.device, dtype=w.dtype, copy=True))
        if t.dim() == 2:
            m.out_features, m.in_features = t.shape
        return m

    def delete_adapter(self, name: str) -> None:
        self._check_name(f"{_OWNER}.delete_adapter", name)
        if name == self.merged_adapter:
            raise RuntimeError(f"{_OWNER}.delete_adapter: {name!r} is merged; unmerge() first")
        del self.lora_A[name], self.lora_B[name]
        del self.r[name], self.lora_alpha[name], self.scaling[name]
        if self.active_adapter == name:
            self.active_adapter = None
        self._invalidate()

    def set_adapter(self, name: str | None) -> None:
        """The adapter a forward without adapter_ids uses (None: the base layer alone)."""
        if name is not None:
            self._check_name(f"{_OWNER}.set_adapter", name)
        if self.merged and name != self.active_adapter:
            raise RuntimeError(
                f"{_OWNER}.set_adapter: adapter {self.merged_adapter!r} is merged; unmerge() first"
            )
        self.active_adapter = name

    def _check_name(self, op: str, name) -> None:
        if name not in self.lora_A:
            raise ValueError(f"{op}: no adapter named {name!r} (adapters: {self.adapters})")

    def _invalidate(self) -> None:
        self._stack_cache = None

    # --------------------------------------------------------------------- merging
    def _delta(self, name: str) -> torch.Tensor:
        """scaling * B @ A in float32 (or W's dtype if wider)."""
        w = self.weight
        acc = torch.promote_types(w.dtype, torch.float32)
        a = self.lora_A[name].weight.detach().to(acc)
        b = self.lora_B[name].weight.detach().to(acc)
        return (b @ a) * self.scaling[name]

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the active adapter into the weight: W += scaling * B @ A (one rounding).

        Forward then runs the plain fused linear. No-op when already merged.
        """
        if self.merged:
            return
        name = self.active_adapter
        if name is None:
            raise RuntimeError(f"{_OWNER}.merge: no active adapter to merge (set_adapter first)")
        w = self.weight
        self._unmerged_weight = w.detach().clone()
        delta = self._delta(name)
        w.copy_((w.to(delta.dtype) + delta).to(w.dtype))
        self._merged_version = _version(w)
        self.merged_adapter = name

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo merge(): W as it was before, bit for bit. No-op when not merged."""
        if not self.merged:
            return
        w = self.weight
        kept = self._unmerged_weight
        unchanged = (
            kept is not None
            and self._merged_version is not None
            and _version(w) == self._merged_version
            and kept.shape == w.shape
            and kept.dtype == w.dtype
            and kept.device == w.device
        )
        if unchanged:
            w.copy_(kept)
        else:  # W was written while merged (training, load_state_dict, .to()): subtract
            log.warning(
                "%s.unmerge: the weight changed while merged; subtracting the adapter "
                "(exact up to rounding) instead of restoring the kept copy",
                _OWNER,
            )
            delta = self._delta(self.merged_adapter)
            w.copy_((w.to(delta.dtype) - delta).to(w.dtype))
        self._unmerged_weight = None
        self._merged_version = None
        self.merged_adapter = None

    # --------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, adapter_ids: torch.Tensor | None = None) -> torch.Tensor:
        w, b = self.weight, self.bias
        if adapter_ids is None and inductor_traces():  # the replaced layer's math, no more
            name = None if self.merged else self.active_adapter  # guards (inductor_traces)
            if name is None:
                return linear_ref(x, w, b, self.activation)
            a, bb = self.lora_A[name].weight, self.lora_B[name].weight
            return lora_linear_ref(x, w, b, a, bb, self.scaling[name], self.activation)
        if self.merged:
            if adapter_ids is not None:
                raise RuntimeError(
                    f"{_OWNER}: adapter_ids needs unmerged adapters, but "
                    f"{self.merged_adapter!r} is merged; unmerge() first"
                )
            return fused_linear(x, w, b, self.activation, backend=self.backend)
        if adapter_ids is not None:
            return self._forward_multi(x, adapter_ids)
        name = self.active_adapter
        if name is None:
            return fused_linear(x, w, b, self.activation, backend=self.backend)
        a = self.lora_A[name].weight
        bb = self.lora_B[name].weight
        scaling, act = self.scaling[name], self.activation
        # A repeat call the C++ fast path serves costs less host time than a replay (one
        # launch against a copy in, a replay and a copy out; at 16 rows on an H200 host,
        # 16.8 us a layer against 196 for three replayed layers), and its eager launch is
        # near the captured one's GPU time up to the fast path's 512 rows (host.md)
        out = fast_call(x, w, b, a, bb, scaling, act, self.backend)
        if out is not None:
            return out
        backend = call_backend(_OWNER, self.backend, x, (w, b, a, bb))
        key = self._replay_key(x, name, scaling, backend) if self.replay_graphs else None
        if key is None:
            return lora_linear(x, w, b, a, bb, scaling, act, backend=backend)
        run = lambda t: lora_linear(t, w, b, a, bb, scaling, act, backend=backend)
        return replay_cache(self, _OWNER).run(key, run, [x])

    # Repeated eager inference calls (eval mode, no autograd) of one signature (one active
    # adapter) that the C++ fast path does not serve replay a CUDA graph of the layer (at
    # most this many graphs a layer, see fuseml.serving.ReplayCache: a call's host time,
    # about 100 us, for a copy in, a replay and a copy out); 0: off.
    replay_graphs = 2

    def _replay_key(self, x: torch.Tensor, name: str, scaling: float, backend: str):
        """The signature of an eager call whose replays a CUDA graph can serve, or None
        (fuseml.serving.replay_key)."""
        return replay_key(self, x, name, float(scaling), self.activation, backend)

    def _check_ids(self, x: torch.Tensor, ids, n: int) -> None:
        check_adapter_ids_tensor(_OWNER, x, ids)
        # (a host sync: not while tracing, nor inside a CUDA-graph capture, where the ids
        # are checked by the eager call made before capturing, not by each replay)
        if not (torch.compiler.is_compiling() or capturing(x)):
            check_adapter_ids(_OWNER, ids, n)  # names adapter_ids and the valid range

    def _padded(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, r_max, in) and (n, out, r_max): every adapter zero-padded to the largest rank."""
        r_max = max(self.r[n] for n in names)
        a = [F.pad(self.lora_A[n].weight, (0, 0, 0, r_max - self.r[n])) for n in names]
        b = [F.pad(self.lora_B[n].weight, (0, r_max - self.r[n])) for n in names]
        return torch.stack(a), torch.stack(b)

    def _stacked(self, names: list[str]) -> tuple:
        """The kernel's stacked form (A (n*r, in), B (out, n*r), r, scales), cached.

        The cache is valid while the adapter weights are the same tensor objects (held by
        the cache, so their ids cannot be reused) with the same storage and version
        counters (in-place updates bump them), and the scalings and W's dtype/device match.
        Not used inside a CUDA-graph capture: the graph stacks the adapters itself, so that
        its replays see in-place writes to them made after the capture (loading new adapter
        weights into the same tensors), as the functional op's graphs do.
        """
        w = self.weight
        refs = [t for n in names for t in (self.lora_A[n].weight, self.lora_B[n].weight)]
        key = None
        if not (torch.compiler.is_compiling() or capturing(w)):
            key = (
                tuple(names),
                tuple((t.data_ptr(), _version(t)) for t in refs),
                tuple(self.scaling[n] for n in names),
                w.dtype,
                w.device,
            )
            cached = self._stack_cache
            if (
                cached is not None
                and cached[1] == key
                and all(v is not None for _, v in key[1])
                and len(cached[0]) == len(refs)
                and all(a is b for a, b in zip(cached[0], refs))
            ):
                return cached[2]
        with torch.no_grad():
            for n in names:
                check_same(_OWNER, "weight", w, f"lora_A[{n!r}]", self.lora_A[n].weight)
                check_same(_OWNER, "weight", w, f"lora_B[{n!r}]", self.lora_B[n].weight)
            a3, b3 = self._padded(names)
            a_s, b_s, rank = stack_adapters(a3, b3, in_place=False)  # kept: see there
            # (uploaded once and kept: a host-to-device copy cannot be captured)
            scales = device_scales([self.scaling[n] for n in names], len(names), w.device)
        stack = (a_s, b_s, rank, scales)
        if key is not None:
            self._stack_cache = (tuple(refs), key, stack)
        return stack

    def _forward_multi(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        names = self.adapters
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_OWNER}: x must be a torch.Tensor, got {type(x).__name__}")
        self._check_ids(x, ids, len(names))
        if not names:  # every id is -1 (checked): the base layer alone
            return fused_linear(x, w, b, self.activation, backend=self.backend)
        params = [
            w,
            b,
            *(self.lora_A[n].weight for n in names),
            *(self.lora_B[n].weight for n in names),
        ]
        # (under torch.compile the fused op: the reference's masked passes sync with the host)
        backend = call_backend(_OWNER, self.backend, x, params)
        if backend != "triton":  # eager / compile: the reference, differentiable
            a3, b3 = self._padded(names)
            scales = [self.scaling[n] for n in names]
            return lora_linear(
                x, w, b, a3, b3, scales, self.activation, adapter_ids=ids, check_ids=False,
                backend=backend,
            )  # fmt: skip
        activation = check_linear_args(_OWNER, x, w, b, None, 1.0, self.activation)
        a_s, b_s, rank, scales = self._stacked(names)
        return lora_stacked(x, w, b, a_s, b_s, rank, 1.0, scales, ids, activation)

    def extra_repr(self) -> str:
        adapters = ", ".join(
            f"{n}: r={self.r[n]} scaling={self.scaling[n]:g}" for n in self.adapters
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"adapters={{{adapters}}}, active_adapter={self.active_adapter!r}, "
            f"merged={self.merged}, activation={self.activation!r}, backend={self.backend!r}"
        )
