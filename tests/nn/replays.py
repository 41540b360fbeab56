"""Shared steps of the modules' graph-replay GPU tests (FusedMLP, LoRALinear)."""

from __future__ import annotations

import torch

from fuseml.testing import assert_close_verbose, poison_allocator


def counted(monkeypatch, owner, name: str) -> list:
    """Count the calls of ``owner.name`` (the fused op a module calls): the list returned
    grows by one each call."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def fresh_calls(module, shape, dtype, ref, n: int = 6) -> torch.Tensor:
    """``n`` eager calls of ``module`` on fresh inputs over NaN-poisoned free memory, each
    against ``ref(module, x)``, each output a tensor of its own (not overwritten by a later
    replay); the last input."""
    outs = []
    for _ in range(n):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        poison_allocator()
        out = module(x)
        assert_close_verbose(out, ref(module, x), dtype)
        outs.append((out, out.clone()))
    assert all(torch.equal(o, kept) for o, kept in outs)
    return x
