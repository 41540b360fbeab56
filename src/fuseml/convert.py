"""``fuseml.optimize(model)``: swap a model's modules for fused ones, like a quantizer.

    model, report = fuseml.optimize(model)    # a converted copy; the input is left as is
    print(report)                             # what was swapped, what was left and why

Swaps (every replacement shares the original's parameters, so state_dict keys and
values are unchanged and checkpoints load both ways; the one exception, peft adapters
cast to the base dtype, is below):

* ``nn.Linear`` -> :class:`fuseml.nn.FusedLinear`.
* A :class:`fuseml.models.DLRM` with the dot interaction -> :class:`fuseml.nn.FusedDLRM`
  (the same submodules; the embedding gather and the interaction in one kernel), its
  MLPs swapped as below.
* Inside an ``nn.Sequential``: a Linear (or peft LoRA Linear) followed by ReLU, GELU
  (approximate none/tanh), SiLU, Sigmoid, Tanh or LeakyReLU(0.01) takes the activation
  into its epilogue; the activation's slot becomes ``nn.Identity`` so indices stay.
* An ``nn.Sequential`` that is only Linear(+activation) layers (at least two, every width
  <= 1024; above 512 KiB of weights only where the FusedMLP's tuning also times the layers
  one by one: an input wider than 64, or a chain the register-resident kernel does not
  take) ->
  :class:`fuseml.nn.FusedMLP` (``mlp=False`` to keep per-layer swaps). A
  FusedMLP is a Sequential with the same children, so its keys are the same too.
* peft's LoRA ``Linear`` (``peft.tuners.lora.layer.Linear``) -> :class:`fuseml.nn.LoRALinear`
  with the same adapters, unmerged and shared (peft's state_dict keys). The converted
  model is called like the original; peft's ``adapter_names=`` keyword is not supported
  (use ``LoRALinear(x, adapter_ids)`` directly). Adapters in another float dtype than the
  base weight (peft's default: float32 over a bfloat16/float16 base) are cast to the base
  weight's dtype, which the fused kernel takes, and the report names the cast ("adapter
  'default' cast float32 -> bfloat16 to fuse"). Those adapters are then copies stored in
  the base dtype: the state_dict keys are the same, its adapter values 16-bit; checkpoints
  still load both ways (``load_state_dict`` casts).

Left, with the reason in the report: subclasses of nn.Linear (their forward may differ),
modules with forward hooks, unsupported dtypes, activations the epilogue cannot express
(e.g. LeakyReLU(0.2)), peft layers with DoRA or another LoRA variant, lora_bias,
fan_in_fan_out, several active adapters, merged or disabled adapters, dropout p > 0 in
train mode, and other peft tuner layers.

Why the function returns ``(model, report)`` rather than hanging the report on the model:
the model stays a plain module (nothing extra to save, copy or script), and a model with
nothing to fuse comes back as the very same object.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from fuseml.models.dlrm import DLRM, ConcatEmbeddingBags, DotInteraction
from fuseml.nn._common import activation_of, check_backend
from fuseml.nn.dlrm import FusedDLRM
from fuseml.nn.linear import FusedLinear
from fuseml.nn.lora import LoRALinear
from fuseml.nn.mlp import FusedMLP
from fuseml.ops._mlp_plan import times_layers
from fuseml.ops.mlp import MAX_WIDTH
from fuseml.runtime import FLOAT_DTYPES

__all__ = ["Left", "OptimizeReport", "Swapped", "optimize"]

# A fused MLP kernel re-reads all of the weights from L2 for every block of rows, so it
# pays only while they are small: the kaggle bottom MLP (310 KiB) is faster fused than
# eager (13.0 vs 27.4 us, H100, bf16, B = 4096). Heavier chains become a FusedMLP only
# where its tuning also times the layers one by one (``times_layers``: the kaggle top,
# 640 KiB, runs so), which keeps the FusedMLP's eager-call replays (see
# fuseml.serving.ReplayCache); else they stay separate FusedLinear layers
# (docs/performance/mlp.md).
MLP_MAX_WEIGHT_BYTES = 512 * 1024


@dataclass(frozen=True)
class Swapped:
    path: str  # "" is the model itself
    before: str  # the original module's class
    after: str  # what it became
    note: str = ""


@dataclass(frozen=True)
class Left:
    path: str
    module: str  # its class
    reason: str


@dataclass
class OptimizeReport:
    """What ``fuseml.optimize`` swapped and what it left (with why). ``str()`` is a table."""

    swapped: list[Swapped] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.swapped)

    def __str__(self) -> str:
        if self.changed:
            head = f"fuseml.optimize: {len(self.swapped)} swapped, {len(self.left)} left"
        else:
            head = "fuseml.optimize: nothing to fuse; the model is returned unchanged"
            if self.left:
                head += f" ({len(self.left)} left)"
        swapped = [(s.path or "(model)", s.before, s.after, s.note) for s in self.swapped]
        left = [(s.path or "(model)", s.module, s.reason, "") for s in self.left]
        rows = swapped + left
        if not rows:
            return head
        w = [max(len(r[i]) for r in rows) for i in range(2)]
        w2 = max((len(r[2]) for r in swapped), default=0)
        lines = [head]
        for title, part in (("swapped:", swapped), ("left:", left)):
            if part:
                lines.append(title)
            for path, cls, what, note in part:
                cells = [path.ljust(w[0]), cls.ljust(w[1]), what.ljust(w2) if note else what]
                lines.append("  " + "  ".join([*cells, note]).rstrip())
        return "\n".join(lines)


# ---------------------------------------------------------------------------- planning
@dataclass
class _Action:
    path: str
    kind: str  # "linear" | "lora" | "mlp" | "dlrm" | "identity"
    before: str
    activation: str | None = None
    note: str = ""
    folded_into: str = ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _cls(m: nn.Module) -> str:
    """The class name, with peft's tuner for peft layers ("peft.lora.Linear")."""
    kind = type(m)
    parts = kind.__module__.split(".")
    if parts[0] == "peft" and len(parts) > 2:
        return f"peft.{parts[2]}.{kind.__name__}"
    return kind.__name__


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _dtype_reason(t: torch.Tensor) -> str | None:
    if t.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        return f"dtype {str(t.dtype).replace('torch.', '')} (fused kernels take {names})"
    return None


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtypes(a: nn.Linear, b: nn.Linear) -> str:
    """The adapter's dtype ("float32"), or both when A and B differ ("float32/float16")."""
    da, db = _short(a.weight.dtype), _short(b.weight.dtype)
    return da if da == db else f"{da}/{db}"


def _peft_class(m: nn.Module) -> str | None:
    """'lora_linear' for peft's LoRA Linear, 'other' for any other peft tuner layer, else
    None. peft is never imported here: if it is not loaded, no module can be one."""
    lora = sys.modules.get("peft.tuners.lora.layer")
    if lora is not None and type(m) is lora.Linear:
        return "lora_linear"
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is not None and isinstance(m, tuners.BaseTunerLayer):
        return "other"
    return None


def _peft_reason(m: nn.Module) -> tuple[str | None, str]:
    """(why a peft LoRA Linear cannot be converted or None, a note for the report)."""
    base = m.base_layer
    if type(base) is not nn.Linear:
        return f"its base layer is {type(base).__name__}, not nn.Linear", ""
    if getattr(m, "fan_in_fan_out", False):
        return "fan_in_fan_out=True (transposed base weight)", ""
    if getattr(m, "merged", False):
        return f"adapters {m.merged_adapters} are merged into the base weight", ""
    if getattr(m, "disable_adapters", False):
        return "its adapters are disabled", ""
    if _hooked(m) or _hooked(base):
        return "it has forward hooks", ""
    why = _dtype_reason(base.weight)
    if why:
        return why, ""
    active = [a for a in m.active_adapters if a in m.lora_A]
    if len(active) > 1:
        return f"several active adapters {active} (peft sums them)", ""
    notes = []
    for name in m.lora_A:
        if getattr(m, "use_dora", {}).get(name, False):
            return f"adapter {name!r} uses DoRA (use_dora)", ""
        variant = getattr(m, "lora_variant", {}).get(name)
        if variant is not None:
            return f"adapter {name!r} uses the LoRA variant {type(variant).__name__}", ""
        if getattr(m, "lora_bias", {}).get(name, False):
            return f"adapter {name!r} has lora_bias", ""
        a, b = m.lora_A[name], m.lora_B[name]
        if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None:
            return f"adapter {name!r}: lora_A/lora_B are not bias-free nn.Linear", ""
        w = base.weight
        for t in (a.weight, b.weight):
            if t.device != w.device or t.dtype not in FLOAT_DTYPES:
                return (
                    f"adapter {name!r} is {t.dtype} on {t.device} but the base weight is "
                    f"{w.dtype} on {w.device}"
                ), ""
        if a.weight.dtype != w.dtype or b.weight.dtype != w.dtype:
            notes.append(f"adapter {name!r} cast {_dtypes(a, b)} -> {_short(w.dtype)} to fuse")
        drop = m.lora_dropout[name]
        if isinstance(drop, nn.Dropout) and type(drop) is nn.Dropout:
            if drop.p > 0 and m.training:
                return f"adapter {name!r} has lora_dropout p={drop.p} in train mode", ""
            if drop.p > 0:
                notes.append(f"lora_dropout p={drop.p} not kept (eval mode: identity)")
        elif not isinstance(drop, nn.Identity):
            return f"adapter {name!r} has lora_dropout {type(drop).__name__}", ""
    return None, "; ".join(notes)


def _mlp_chain(seq: nn.Sequential) -> tuple[bool, str | None]:
    """Can this Sequential become one FusedMLP? (yes/no, why not when worth saying)."""
    linears, dtypes, devices = [], set(), set()
    prev_linear = False
    for m in seq._modules.values():
        if type(m) is nn.Linear and not _hooked(m):
            linears.append(m)
            dtypes.add(m.weight.dtype)
            devices.add(m.weight.device)
            prev_linear = True
        elif isinstance(m, nn.Identity) and not _hooked(m):
            continue
        else:
            act, _ = activation_of(m)
            if act is None or not prev_linear or _hooked(m):
                return False, None
            prev_linear = False
    if len(linears) < 2:
        return False, None
    widths = [linears[0].in_features, *(lin.out_features for lin in linears)]
    if any(lin.in_features != w for lin, w in zip(linears, widths)):
        return False, None  # mismatched widths: the model itself would fail
    if max(widths) > MAX_WIDTH:
        return False, (
            f"not one FusedMLP: a width above {MAX_WIDTH} (widths {widths}); its layers are "
            "swapped one by one"
        )
    if len(dtypes) > 1 or len(devices) > 1:
        return False, "not one FusedMLP: its layers differ in dtype or device"
    if _dtype_reason(linears[0].weight):
        return False, None  # each Linear reports it
    if _hooked(seq):
        return False, "not one FusedMLP: it has forward hooks; its layers are swapped one by one"
    weight_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    if weight_bytes > MLP_MAX_WEIGHT_BYTES and not times_layers(widths, linears[0].weight.dtype):
        return False, (
            f"not one FusedMLP: {weight_bytes / 1024:,.0f} KiB of weights (> "
            f"{MLP_MAX_WEIGHT_BYTES // 1024} KiB), which the fused kernel re-reads for every "
            "block of rows; its layers are swapped one by one"
        )
    return True, None


def _dlrm_reason(m: DLRM) -> str | None:
    """Why a DLRM's embeddings + interaction cannot be fused, or None."""
    if type(m) is not DLRM:
        return "a subclass of DLRM (its forward may differ)"
    if m.config.interaction != "dot":
        return f"interaction {m.config.interaction!r}: the fused kernel computes 'dot'"
    if type(m.embeddings) is not ConcatEmbeddingBags or type(m.interaction) is not DotInteraction:
        return "its embeddings or interaction module was replaced"
    if any(_hooked(x) for x in (m, m.embeddings, m.interaction)):
        return "it, its embeddings or its interaction has forward hooks"
    return _dtype_reason(m.embeddings.weight)


class _Planner:
    def __init__(self, mlp: bool) -> None:
        self.mlp = mlp
        self.actions: list[_Action] = []
        self.report = OptimizeReport()
        self._stack: list[int] = []

    def left(self, path: str, m: nn.Module, reason: str) -> None:
        self.report.left.append(Left(path, _cls(m), reason))

    def visit(self, m: nn.Module, path: str) -> _Action | None:
        """Plan m's swap (returned when it may take a following activation) or recurse."""
        if isinstance(m, (FusedLinear, FusedMLP, LoRALinear)):
            self.left(path, m, "already a fuseml module")
            return None
        if isinstance(m, torch.jit.ScriptModule):
            self.left(path, m, "TorchScript module")
            return None
        peft = _peft_class(m)
        if peft == "other":
            self.left(path, m, "this peft layer type is not supported")
            return None
        if peft == "lora_linear":
            why, note = _peft_reason(m)
            if why:
                self.left(path, m, why)
                return None
            return self.add(_Action(path, "lora", _cls(m), note=note))
        if isinstance(m, nn.Linear):
            if type(m) is not nn.Linear:
                self.left(path, m, "a subclass of nn.Linear (its forward may differ)")
            elif _hooked(m):
                self.left(path, m, "it has forward hooks")
            elif why := _dtype_reason(m.weight):
                self.left(path, m, why)
            else:
                return self.add(_Action(path, "linear", "Linear"))
            return None
        if type(m) is DLRM or (isinstance(m, DLRM) and not isinstance(m, FusedDLRM)):
            why = _dlrm_reason(m)
            if why:
                self.left(path, m, why)
            else:
                note = "gather + interaction: one fuseml.ops.embedding_interaction call"
                self.add(_Action(path, "dlrm", "DLRM", note=note))
        if id(m) in self._stack:  # a module containing itself: do not loop
            return None
        self._stack.append(id(m))
        if type(m) is nn.Sequential:
            self.visit_sequential(m, path)
        else:  # any other container: its children, without folding (order unknown)
            for name, child in m._modules.items():
                if child is not None:
                    self.visit(child, _join(path, name))
        self._stack.pop()
        return None

    def visit_sequential(self, seq: nn.Sequential, path: str) -> None:
        if self.mlp:
            ok, why = _mlp_chain(seq)
            if ok:
                n = sum(type(m) is nn.Linear for m in seq._modules.values())
                self.add(
                    _Action(path, "mlp", "Sequential", note=f"{n} layers, one fuseml.ops.mlp call")
                )
                return
            if why:
                self.left(path, seq, why)
        items = [(k, v) for k, v in seq._modules.items() if v is not None]
        i = 0
        while i < len(items):
            name, child = items[i]
            action = self.visit(child, _join(path, name))
            if action is not None and i + 1 < len(items):
                nxt_name, nxt = items[i + 1]
                nxt_path = _join(path, nxt_name)
                act, why = activation_of(nxt)
                if act is not None and not _hooked(nxt):
                    action.activation = act
                    self.add(
                        _Action(nxt_path, "identity", type(nxt).__name__, folded_into=action.path)
                    )
                    i += 2
                    continue
                if why:
                    self.left(nxt_path, nxt, f"not folded into {action.path}: {why}")
                    i += 2  # nothing inside an activation module to visit
                    continue
            i += 1

    def add(self, action: _Action) -> _Action:
        self.actions.append(action)
        return action


def _describe(a: _Action) -> Swapped:
    act = f"activation={a.activation!r}" if a.activation else ""
    after = {
        "linear": f"FusedLinear({act})" if act else "FusedLinear",
        "lora": f"LoRALinear({act})" if act else "LoRALinear",
        "mlp": "FusedMLP",
        "dlrm": "FusedDLRM",
        "identity": f"Identity (folded into {a.folded_into})",
    }[a.kind]
    return Swapped(a.path, a.before, after, a.note)


# ---------------------------------------------------------------------------- applying
def _in_dtype(m: nn.Linear, dtype: torch.dtype) -> nn.Linear:
    """m itself when it has ``dtype``, else a bias-free nn.Linear holding a cast copy of its
    weight (the original, perhaps still referenced elsewhere, is left as it is)."""
    if m.weight.dtype == dtype:
        return m
    out = nn.Linear(m.in_features, m.out_features, bias=False, device="meta")
    weight = m.weight.detach().to(dtype=dtype, copy=True)
    out.weight = nn.Parameter(weight, requires_grad=m.weight.requires_grad)
    out.train(m.training)
    return out


def _lora_from_peft(layer: nn.Module, activation: str | None, backend: str) -> LoRALinear:
    """LoRALinear sharing the peft layer's base layer and adapter modules.

    Adapters in another dtype than the base weight (peft keeps them in float32 over a
    16-bit base by default) are cast to the base weight's dtype: the fused kernel takes one
    dtype. peft computes that adapter product in float32 and rounds once on the add; the
    cast rounds A and B to 16 bits as well, an error of the size of the output's own
    rounding (tests/test_optimize.py measures it against peft).
    """
    out = LoRALinear(layer.base_layer, activation=activation, backend=backend)
    dtype = layer.base_layer.weight.dtype
    for name in layer.lora_A:
        out.add_adapter(
            name,
            layer.r[name],
            layer.lora_alpha[name],
            init=(_in_dtype(layer.lora_A[name], dtype), _in_dtype(layer.lora_B[name], dtype)),
            scaling=layer.scaling[name],
        )
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    out.set_adapter(active[0] if active else None)
    out.train(layer.training)
    return out


def _build(a: _Action, m: nn.Module, backend: str) -> nn.Module:
    if a.kind == "linear":
        return FusedLinear.from_linear(m, a.activation, backend=backend)
    if a.kind == "lora":
        return _lora_from_peft(m, a.activation, backend)
    if a.kind == "mlp":
        return FusedMLP.from_sequential(m, backend=backend)
    if a.kind == "dlrm":
        return FusedDLRM.from_dlrm(m, backend=backend)
    return nn.Identity()


def optimize(
    model: nn.Module, *, backend: str = "auto", inplace: bool = False, mlp: bool = True
) -> tuple[nn.Module, OptimizeReport]:
    """Swap ``model``'s modules for fused ones; return ``(model, report)``.

    backend: given to every fused module (auto: Triton on CUDA tensors, eager on CPU).
    inplace: modify ``model`` itself (and return it) instead of a deep copy. mlp: fold
    all-Linear(+activation) Sequentials into FusedMLP. Outputs match the original within
    ``fuseml.testing``'s tolerances. With nothing to fuse, ``model`` itself comes back
    and ``report.changed`` is False. See the module docstring for what is swapped.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be an nn.Module, got {type(model).__name__}")
    check_backend("optimize", backend)
    planner = _Planner(mlp)
    planner.visit(model, "")
    report = planner.report
    report.swapped = [_describe(a) for a in planner.actions]
    if not planner.actions:
        return model, report
    target = model if inplace else copy.deepcopy(model)
    # A module reached by two paths is swapped once; the old one is kept alive so that its
    # id is not reused by a module built later.
    built: dict[tuple, tuple[nn.Module, nn.Module]] = {}
    for a in planner.actions:
        parent_path, _, name = a.path.rpartition(".")
        old = target.get_submodule(a.path) if a.path else target
        key = (id(old), a.kind, a.activation)
        if key not in built:
            built[key] = (old, _build(a, old, backend))
        new = built[key][1]
        if not a.path:
            target = new
        else:
            setattr(target.get_submodule(parent_path), name, new)
    return target, report
