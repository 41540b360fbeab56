"""Usage: python scripts/offline_sm90.py MODULE:KERNEL [NAME=VALUE ...] [--dtype bf16]
    [--type NAME=TYPE ...] [--divisible NAME,...] [--warps 4] [--stages 3] [--maxnreg N]
    [--ptx FILE]        or        python scripts/offline_sm90.py --list MODULE

Compile one of fuseml's Triton kernels for sm_90 (H100 / H200) on a machine without a GPU,
nothing timed, and print what the GPU would run: registers a thread and spills (ptxas -v,
with the ptxas that ships with the installed triton), shared memory, and the PTX's memory
instructions (global loads and stores by width, cp.async copies and their waits, TMA
copies, wgmma, barriers). --list MODULE names the module's kernels and their arguments.

NAME=VALUE sets a constexpr argument (an int, a float, True / False, or a string such as
tf32); a constexpr with a default may be left out. NAME=1 for an integer argument
specializes it as the launcher does for a 1 (a unit stride: without it, loads along that
axis compile to scalar loads). Every other argument is typed from its name: ``*_ptr`` a
pointer to --dtype elements, ``alpha`` / ``*scale`` fp32, anything else i32; --type
NAME=TYPE gives another Triton signature type (``*fp32``, ``i64``,
``tensordesc<bf16[64, 64]>``). Pointers, and the integers named by --divisible, are marked
16-divisible as the launchers' real arguments are: without it pointer accesses compile to
scalar loads and stores, which is not what runs.

Registers depend on the triton version: run this with the GPU machines' triton to predict
their count. Example (the elementwise epilogue's 2-D tile, bf16 with a bias):

    PYTHONPATH=src python scripts/offline_sm90.py fuseml.ops._elementwise:_bias_act_kernel \\
        HAS_Y=False HAS_BIAS=True ACTIVATION=1 BLOCK_M=16 BLOCK_N=512 FAST=True VEC=8 \\
        --divisible n_cols,stride_xm,stride_om --warps 8
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled for the GPU, not interpreted
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

MEMORY_OPS = re.compile(
    r"\b(ld\.global[\w.]*|st\.global[\w.]*|atom[\w.]*|bar\.sync|"
    r"cp\.async\.(?:cg|ca)\.shared\.global|cp\.async\.wait_group\s+\d+|"
    r"cp\.async\.bulk\.tensor[\w.:]*|wgmma\.mma_async[\w.]*)"
)


def kernels(module) -> dict:
    """The module's Triton JIT functions, kernels and the helpers they inline alike."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, triton.runtime.jit.JITFunction)
    }


def value(text: str):
    """A constexpr's value from the command line: bool, int, float, else the string."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def arg_type(name: str, dtype: str, given: dict[str, str]) -> str:
    if name in given:
        return given[name]
    if name.endswith("_ptr"):
        return f"*{dtype}"
    return "fp32" if name == "alpha" or name.endswith("scale") else "i32"


def compile_sm90(kernel, consts: dict, types: dict, divisible: set[str], options: dict):
    """``kernel`` compiled for sm_90: ``consts`` as its constexprs (and integer arguments
    given as 1, specialized as the launcher does for a 1), the rest typed."""
    signature, constexprs, attrs = {}, {}, {}
    for param in kernel.params:
        i, name = param.num, param.name
        if param.is_constexpr or name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts.get(name, param.default)
            continue
        signature[name] = types[name]
        if name in divisible or types[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )


def ptxas_report(ptx: str) -> list[str]:
    """ptxas -v's registers / spills lines for ``ptx`` (sm_90a)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            # a newer triton writes PTX 9.x, which its own bundled ptxas (8.8) does not take
            f.write(re.sub(r"^\.version 9\.\d+", ".version 8.8", ptx, flags=re.M))
        info = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    keep = ("registers", "spill", "error")
    return [line.strip() for line in info.stderr.splitlines() if any(k in line for k in keep)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", nargs="?", help="MODULE:KERNEL, e.g. fuseml.ops.softmax:_x_kernel")
    ap.add_argument("consts", nargs="*", metavar="NAME=VALUE", help="constexpr arguments")
    ap.add_argument("--list", metavar="MODULE", help="name the module's kernels and arguments")
    ap.add_argument("--dtype", default="bf16", help="pointers' element type (Triton's name)")
    ap.add_argument("--type", action="append", default=[], metavar="NAME=TYPE")
    ap.add_argument("--divisible", default="", help="integer arguments marked 16-divisible")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, help="register cap (the PTX's .maxnreg)")
    ap.add_argument("--ptx", help="also write the PTX here")
    a = ap.parse_args(argv)
    if a.list:
        for name, kernel in kernels(importlib.import_module(a.list)).items():
            args = [
                p.name + ("" if not p.is_constexpr else "=?" if not p.has_default
                          else f"={p.default}")
                for p in kernel.params
            ]  # fmt: skip
            print(f"{a.list}:{name}({', '.join(args)})")
        return 0
    if not a.kernel or ":" not in a.kernel:
        ap.error("give MODULE:KERNEL (or --list MODULE)")
    module_name, kernel_name = a.kernel.split(":", 1)
    kernel = getattr(importlib.import_module(module_name), kernel_name)
    consts = dict(c.split("=", 1) for c in a.consts)
    consts = {k: value(v) for k, v in consts.items()}
    missing = [p.name for p in kernel.params
               if p.is_constexpr and not p.has_default and p.name not in consts]  # fmt: skip
    ones = {p.name for p in kernel.params if not p.is_constexpr and consts.get(p.name) == 1}
    unknown = sorted(set(consts) - {p.name for p in kernel.params if p.is_constexpr} - ones)
    if missing or unknown:
        ap.error(f"constexprs missing: {missing or 'none'}; not constexprs of {kernel_name}: "
                 f"{unknown or 'none'} (see --list {module_name})")  # fmt: skip
    given = dict(t.split("=", 1) for t in a.type)
    types = {p.name: arg_type(p.name, a.dtype, given) for p in kernel.params}
    options = {"num_warps": a.warps, "num_stages": a.stages}
    if a.maxnreg:
        options["maxnreg"] = a.maxnreg
    divisible = {d for d in a.divisible.split(",") if d}
    compiled = compile_sm90(kernel, consts, types, divisible, options)
    ptx = compiled.asm["ptx"]
    if a.ptx:
        with open(a.ptx, "w") as f:
            f.write(ptx)
    print(f"{kernel_name} for sm_90, triton {triton.__version__}, {a.warps} warps, "
          f"{a.stages} stages: shared memory {compiled.metadata.shared} bytes")  # fmt: skip
    for line in ptxas_report(ptx):
        print(" ", line)
    ops = collections.Counter(" ".join(m.group(0).split()) for m in MEMORY_OPS.finditer(ptx))
    for op, count in sorted(ops.items()):
        print(f"  {count:4d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
