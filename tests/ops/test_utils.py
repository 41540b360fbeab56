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
    version = t._version
    t.data = torch.arange(6.0) + 10  # another storage, the version unchanged
    assert t._version == version
    assert torch.equal(_utils.kept_derived(t, "x2", derive), t * 2) and len(calls) == 5


DEFERRED_SCAN = """
import sys
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from fuseml.ops import _utils


@triton.jit
def _twice(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@_utils.fused_op("fuseml_test::twice")
def twice(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    wrap_triton(_twice)[(1,)](x, out, x.numel(), BLOCK=16)
    return out


from torch._library import triton as library

kernels = library.get_triton_kernels_for_op("fuseml_test::twice")
assert type(kernels) is _utils._DeferredKernels, type(kernels)
assert "torch._inductor" not in sys.modules  # registered without torch's scan
assert list(kernels) == [_twice], list(kernels)  # read: scanned then, as torch would
assert len(kernels) == 1 and kernels[0] is _twice
print("ok")
"""


def test_triton_op_kernels_are_found_on_first_read(tmp_path):
    """fused_op (compiled Triton) registers through torch.library.triton_op without the
    scan of the op's source that imports torch._inductor; the kernels are found when
    torch.compile first reads them."""
    import os
    import subprocess
    import sys

    import fuseml

    script = tmp_path / "deferred_scan.py"  # (the scan reads the op's source from a file)
    script.write_text(DEFERRED_SCAN)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(fuseml.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
