"""fuseml.ops._utils: copies kept between calls (kept_derived)."""

import pytest
import torch

from fuseml.ops import _utils


def _counting_derive(calls):
    def derive(t):
        calls.append(t)
        return t * 2

    return derive


@pytest.mark.parametrize("state", ["compile_only", "skipped"])
def test_kept_derived_keeps_nothing_derived_while_launches_do_not_run(state):
    """The tuner's compile-only pass (and an op's fake) run derivations whose kernels do
    not launch: their unwritten results must not be kept for the real calls after them
    (a padded weight kept from the compile-only pass made a tuned MLP return garbage)."""
    t = torch.arange(6.0)
    calls = []
    derive = _counting_derive(calls)
    flag = _utils.compile_only() if state == "compile_only" else _utils._skipping_launches()
    with flag:
        assert not _utils.keeps_derived(t)
        _utils.kept_derived(t, "x2", derive)
        _utils.kept_derived(t, "x2", derive, keep=_utils.keeps_derived(t))
    assert len(calls) == 2 and (id(t), "x2") not in _utils._KEPT
    first = _utils.kept_derived(t, "x2", derive)  # a real call derives anew, and keeps it
    assert len(calls) == 3 and torch.equal(first, t * 2)
    assert _utils.kept_derived(t, "x2", derive) is first and len(calls) == 3
    t.add_(1)  # an in-place write: the kept copy is stale
    assert torch.equal(_utils.kept_derived(t, "x2", derive), t * 2) and len(calls) == 4
