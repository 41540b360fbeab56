"""GPU A/B of the CUDA twins' store instruction, in one process: the shipped sources (weak
stores, `st.global[.v4].bN`, STG.E[.128] in the SASS) against a copy of them built with
`st.global.wb` (what __stwb emits: STG.E[.128].STRONG.SM). The copy is compiled into a
second extension under the op namespace `fuseml_ab`, so both run side by side, timed as the
suites time them (CUDA-graph replay, inputs rotating past twice the L2, arms interleaved
over PROBE_ROUNDS rounds).

    PYTHONPATH=src python scripts/probe_store_ab.py
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch
from probe_launch_bound import rotated, row_sets, table
from torch.utils import cpp_extension

import fuseml
from fuseml import _cuda_ext
from fuseml.ops._elementwise import ACT_CODE

WEAK_STORE = re.compile(r'"st\.global\.(b16|b32|v4\.b32) ')


def build_strong() -> None:
    """Build the copy with write-back (strong) stores as extension fuseml_store_ab."""
    folder = Path(tempfile.mkdtemp(prefix="fuseml_store_ab_"))
    # the .cu files and the header they include (common.cuh holds the weak stores)
    headers = sorted(_cuda_ext.SOURCES[0].parent.glob("*.cuh"))
    total = 0
    for src in (*_cuda_ext.SOURCES, *headers):
        text, stores = WEAK_STORE.subn(r'"st.global.wb.\1 ', src.read_text())
        total += stores
        text = re.sub(r"\bfuseml\b", "fuseml_ab", text)
        print(f"{src.name}: {stores} store(s) rewritten to st.global.wb")
        (folder / src.name).write_text(text)
    if total == 0:
        raise SystemExit("no weak store found to rewrite")
    sources = [str(folder / src.name) for src in _cuda_ext.SOURCES]
    cpp_extension.load(
        name="fuseml_store_ab",
        sources=sources,
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", _cuda_ext._arch_flag(), "-lineinfo"],
        extra_ldflags=_cuda_ext._libstdcxx_ldflags(),
        is_python_module=False,
        build_directory=str(folder),
    )


def bias_act_arms(activation: str, with_bias: bool, with_y: bool) -> dict:
    code = ACT_CODE[activation]

    def twin(ns):
        op = getattr(torch.ops, ns).bias_act_cuda_out

        def run(x, y, b):  # the op takes 2-D views: (1, numel) for a flat tensor
            out = torch.empty_like(x)
            two_d = (lambda t: t.view(1, -1)) if x.dim() == 1 else (lambda t: t)
            op(two_d(x), two_d(y) if with_y else None, b if with_bias else None, 1.0, code,
               two_d(out))  # fmt: skip
            return out

        return run

    return {
        "triton": lambda x, y, b: fuseml.ops.bias_act(
            x,
            b if with_bias else None,
            y if with_y else None,
            activation=activation,
            backend="triton",
        ),
        "copy (x.clone)": lambda x, y, b: x.clone(),
        "cuda weak (shipped)": twin("fuseml"),
        "cuda strong (__stwb)": twin("fuseml_ab"),
    }


def elementwise(shape: tuple[int, ...], dtype, activation: str, with_bias: bool, with_y: bool):
    es = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    sets = rotated(
        lambda: (
            torch.randn(shape, device="cuda", dtype=dtype),
            torch.randn(shape, device="cuda", dtype=dtype),
            torch.randn(shape[-1], device="cuda", dtype=dtype),
        ),
        (2 + with_y) * numel * es,
    )
    arms = bias_act_arms(activation, with_bias, with_y)
    if activation == "none" and with_y and not with_bias:
        arms = {"torch.add": lambda x, y, b: x + y, **arms}
        del arms["copy (x.clone)"]
    name = f"{activation}{' +bias' if with_bias else ''}{' +y' if with_y else ''}"
    table(f"{name} {str(dtype)[6:]} {'x'.join(map(str, shape))}", arms, sets)


def softmax(n: int, dtype, m: int = 4096) -> None:
    sets = row_sets(n, dtype, m)

    def twin(ns):
        op = getattr(torch.ops, ns).softmax_cuda_out

        def run(x):
            out = torch.empty_like(x)
            op(x, False, out)
            return out

        return run

    arms = {
        "torch": lambda x: torch.softmax(x, -1),
        "triton": lambda x: fuseml.ops.softmax(x, -1, backend="triton"),
        "cuda weak (shipped)": twin("fuseml"),
        "cuda strong (__stwb)": twin("fuseml_ab"),
    }
    table(f"softmax {str(dtype)[6:]} {m}x{n}", arms, sets)


def main() -> None:
    _cuda_ext.require("bias_act")
    build_strong()
    elementwise((1_000_000,), torch.float32, "none", False, True)
    elementwise((1_000_000,), torch.bfloat16, "none", False, True)
    elementwise((4096, 4096), torch.bfloat16, "gelu", True, False)
    elementwise((4096, 4096), torch.float32, "gelu", True, False)
    elementwise((4096, 512), torch.float32, "gelu", True, False)
    elementwise((16384, 16384), torch.bfloat16, "gelu", True, True)
    for n, dtype in ((1000, torch.float32), (1024, torch.bfloat16), (4096, torch.bfloat16),
                     (4096, torch.float32), (32768, torch.bfloat16), (50257, torch.bfloat16)):  # fmt: skip
        softmax(n, dtype)


if __name__ == "__main__":
    main()
