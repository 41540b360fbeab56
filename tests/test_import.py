"""Importing fuseml is cheap and changes nothing outside fuseml; its modules import
one another without cycles."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fuseml

SRC = Path(fuseml.__file__).resolve().parent.parent
EXTRA_IMPORT_S = 1.0  # at most this much more than `import torch` alone, on 2 CPU cores

IMPORT_PROBE = """
import json, sys, time
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
from torch._library import triton as library  # (loaded by torch already)
scan = getattr(library, "get_inner_triton_kernels", None)
start = time.perf_counter()
import fuseml.ops
fuseml_s = time.perf_counter() - start
heavy = [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]
import triton.compiler.compiler, triton.runtime.cache
keys = {n: m.triton_key for n, m in list(sys.modules.items())
        if n.startswith("triton") and hasattr(m, "triton_key")}
print(json.dumps({
    "torch_s": torch_s,
    "extra_s": fuseml_s,
    "heavy": heavy,
    "key_modules": len(keys),
    "patched": sorted(n for n, fn in keys.items()
                      if not getattr(fn, "__module__", "").startswith("triton")
                      or getattr(fn, "_fuseml_cached", False)),
    "scan_restored": getattr(library, "get_inner_triton_kernels", None) is scan,
}))
"""


def _import_probe() -> dict:
    """``import torch`` then ``import fuseml.ops`` in a fresh interpreter, with compiled
    Triton as a user has it (not the interpreter the tests run kernels with)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_is_fast_and_patches_nothing():
    """`import fuseml.ops` costs at most EXTRA_IMPORT_S over `import torch` (the fastest of
    three fresh interpreters: a busy machine slows single runs), loads neither dynamo nor
    inductor, and leaves Triton's triton_key (and torch's op registration) as they were:
    the on-disk key is opt-in (fuseml.runtime.enable_triton_key_cache)."""
    runs = []
    for _ in range(3):
        runs.append(_import_probe())
        if runs[-1]["extra_s"] < EXTRA_IMPORT_S:
            break
    probe = runs[-1]
    assert probe["heavy"] == []
    assert probe["key_modules"] >= 1 and probe["patched"] == []
    assert probe["scan_restored"]
    extra = min(run["extra_s"] for run in runs)
    times = [(round(r["torch_s"], 2), round(r["extra_s"], 2)) for r in runs]
    assert extra < EXTRA_IMPORT_S, f"(import torch, then import fuseml.ops) in s: {times}"


# ----------------------------------------------------------------------------- cycles
def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "fuseml").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _module_level(body: list) -> list:
    """The import statements a module runs when imported: its top level, inside top-level
    if / try / with blocks, but not under ``if TYPE_CHECKING``, and not in functions."""
    found = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                found += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse):
                found += _module_level(block)
            found += _module_level(node.finalbody)
        elif isinstance(node, ast.With):
            found += _module_level(node.body)
    return found


def _import_graph(everywhere: bool) -> dict[str, set[str]]:
    """fuseml module -> the fuseml modules it imports (at module level, or ``everywhere``:
    inside functions too). ``from a import b`` names module a.b where that is a module."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = [
            n
            for n in (ast.walk(tree) if everywhere else _module_level(tree.body))
            if isinstance(n, ast.Import | ast.ImportFrom)
        ]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
                continue
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    edges.add(f"{base}.{alias.name}")
                elif base in modules:
                    edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("everywhere", [False, True], ids=["module-level", "everywhere"])
def test_no_import_cycle(everywhere):
    """No two fuseml modules import each other, directly or through others: at module
    level (where a cycle breaks the import), and counting the imports inside functions
    too (a cycle there is a layering knot: each module needs the other to be read)."""
    graph = _import_graph(everywhere)
    assert len(graph) > 20 and "fuseml.ops._utils" in graph["fuseml.ops.add"]
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
