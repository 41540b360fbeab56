"""A plain ``pip install .`` has no pytest: every fuseml module and the command line must
work without it (fuseml.testing imports pytest only in its pytest helpers)."""

from __future__ import annotations

import os
import subprocess
import sys

# Makes ``import pytest`` fail, as in an environment without it.
_NO_PYTEST = "import sys; sys.modules['pytest'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _NO_PYTEST + code],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=300,
    )


def test_every_module_imports_without_pytest():
    result = _run(
        "import importlib, pkgutil\n"
        "import fuseml\n"
        "import fuseml.testing\n"
        "names = [m.name for m in pkgutil.walk_packages(fuseml.__path__, 'fuseml.')\n"
        "         if m.name != 'fuseml.__main__']\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names), 'imported')\n"
    )
    assert result.returncode == 0, result.stderr
    assert "imported" in result.stdout


def test_python_m_fuseml_help_runs_without_pytest():
    result = _run(
        "import runpy\n"
        "sys.argv = ['fuseml', '--help']\n"
        "runpy.run_module('fuseml', run_name='__main__', alter_sys=True)\n"
    )
    assert result.returncode == 0, result.stderr
    for command in ("env", "bench", "demo", "train", "predict", "profile"):
        assert command in result.stdout
