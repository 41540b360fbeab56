"""The apps' shared helpers and the import rules around them: library layers never import
the apps, and no app imports another app's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fuseml
from fuseml import runtime
from fuseml.apps.common import (
    MODEL_BACKENDS,
    OPTIMIZE_BACKENDS,
    check_model_backend,
    resolve_device,
)

SRC = Path(fuseml.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``import``/``from ... import`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_library_modules_do_not_import_the_apps():
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "apps" or rel == Path("__main__.py"):
            continue
        for module, names in _imports(path):
            if module.startswith("fuseml.apps") or (module == "fuseml" and "apps" in names):
                offenders.append(f"{rel}: {module}")
    assert not offenders


def test_apps_import_no_private_name_of_another_app():
    offenders = []
    for path in (SRC / "apps").glob("*.py"):
        for module, names in _imports(path):
            if module.startswith("fuseml.apps.") and module != f"fuseml.apps.{path.stem}":
                offenders += [f"{path.name}: {module}.{n}" for n in names if n.startswith("_")]
    assert not offenders


def test_model_backends_are_names_of_the_one_vocabulary():
    assert set(MODEL_BACKENDS) <= set(runtime.BACKENDS)
    assert set(OPTIMIZE_BACKENDS) == set(MODEL_BACKENDS) - {"eager", "compile"}
    for name in MODEL_BACKENDS:
        assert check_model_backend(name) == name
    with pytest.raises(ValueError, match=r"--backend must be one of .*, got 'fused'"):
        check_model_backend("fused", name="--backend")


def test_optimize_takes_every_optimize_backend_and_not_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    for name in OPTIMIZE_BACKENDS:
        _, report = fuseml.optimize(model, backend=name)
        assert report.changed
    # the apps leave "cuda" out because fuseml.optimize refuses it; once it takes it,
    # OPTIMIZE_BACKENDS should gain it
    with pytest.raises(ValueError, match="backend must be one of"):
        fuseml.optimize(model, backend="cuda")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            resolve_device("cuda")
