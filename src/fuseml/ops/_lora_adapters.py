"""Adapter stacking and per-adapter scales of ``fuseml.ops.lora_linear``: the peft layouts
turned into the kernels' stacked form, the scalings as a device tensor, and the checks of
a multi-adapter call's ids."""

from __future__ import annotations

import numbers

import torch

from fuseml.ops._utils import kept_derived, next_pow2


def _scale_list(scaling, n: int) -> list[float]:
    if isinstance(scaling, torch.Tensor):
        return [float(v) for v in scaling.reshape(-1).tolist()]
    if isinstance(scaling, numbers.Real):
        return [float(scaling)] * n
    return [float(v) for v in scaling]


def stack_adapters(
    lora_a: torch.Tensor, lora_b: torch.Tensor, *, in_place: bool = True
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """peft layouts -> the kernel's stacked form: A (R, in), B (out, R) or (n, out, r), and
    the rank.

    Single: A (r, in), B (out, r). Multi: A (n, r, in), B (n, out, r) -> R = n * r, adapter
    a owning columns [a*r, (a+1)*r). With ``in_place`` a multi-adapter B is read as given
    (no copy) where it is contiguous and r is a power of two >= 16; else it is stacked
    into (out, R) by a copy, kept between eager calls (``kept_derived``). The stacked copy
    makes the faster kernels (its B steps go 64 columns at a time instead of one adapter's
    16), the copy itself ~4 us a call: modules, which keep their stacked form, pass
    ``in_place=False``; the functional op reads B in place up to B3D_MAX_M rows (a CUDA
    graph of it then holds no copy). See docs/performance/lora.md.
    """
    if lora_a.dim() == 2:
        return lora_a.contiguous(), lora_b.contiguous(), lora_a.shape[0]
    n, r, k = lora_a.shape
    a = lora_a.reshape(n * r, k).contiguous()  # a view when lora_a is contiguous
    if in_place and B3D_MIN_RANK <= r == next_pow2(r) and lora_b.is_contiguous():
        return a, lora_b, r
    # (the copy is a fifth of a 16-row layer's time: kept, not redone per call)
    b = kept_derived(
        lora_b, "stacked", lambda t: t.permute(1, 0, 2).reshape(t.shape[1], n * r).contiguous()
    )
    return a, b, r


B3D_MIN_RANK = 16  # tl.dot's shortest K: the TMA kernel steps through a 3-D B by adapter


def check_adapter_ids_tensor(op: str, x: torch.Tensor, adapter_ids) -> None:
    """An int32/int64 tensor on x's device with x's leading shape (no host sync)."""
    if not isinstance(adapter_ids, torch.Tensor) or adapter_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(
            f"{op}: adapter_ids must be an int32 or int64 tensor, got {adapter_ids!r:.60}"
        )
    if adapter_ids.device != x.device:
        raise ValueError(f"{op}: adapter_ids is on {adapter_ids.device} but x is on {x.device}")
    if tuple(adapter_ids.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{op}: adapter_ids must have shape {tuple(x.shape[:-1])} (one id per row of x), "
            f"got {tuple(adapter_ids.shape)}"
        )


def check_adapter_ids(op: str, adapter_ids: torch.Tensor, n_adapters: int) -> None:
    """Every id in [-1, n_adapters): a host sync (skip with check_ids=False)."""
    if adapter_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(adapter_ids))
    if lo < -1 or hi >= n_adapters:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"{op}: adapter_ids must be in [-1, {n_adapters}) (-1: no adapter; there are "
            f"{n_adapters} adapters), found {bad}"
        )


_SCALES: dict[tuple, torch.Tensor] = {}  # (values, device) -> float32 tensor, reused


def device_scales(scaling, n: int, device: torch.device) -> torch.Tensor:
    """Per-adapter scalings as a float32 tensor on ``device``, without a copy per call:
    a tensor already there is used as is; a list is uploaded once and kept (a host-to-
    device copy per call would also keep the call out of CUDA graphs)."""
    if isinstance(scaling, torch.Tensor) and scaling.device == device:
        return scaling.reshape(-1).to(torch.float32)
    values = tuple(_scale_list(scaling, n))
    key = (values, device)
    found = _SCALES.get(key)
    if found is None:  # (never evicted: a CUDA graph may read it; a few bytes each)
        found = _SCALES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return found
