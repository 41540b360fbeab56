"""scripts/ holds a few maintained tools: each says how to run it at the top and uses only
fuseml's public names (a private one can change under it without a test noticing)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TOOLS = sorted(p for p in SCRIPTS.iterdir() if p.is_file())
PRIVATE = re.compile(
    r"^\s*(from|import)\s+fuseml(\.\w+)*\._\w+|^\s*from\s+fuseml\S*\s+import\s+.*\b_\w+", re.M
)


def test_at_most_five_tools():
    assert 1 <= len(TOOLS) <= 5, [p.name for p in TOOLS]


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_usage_line_at_the_top(path):
    head = path.read_text().splitlines()[:3]
    assert any("Usage:" in line for line in head), f"{path.name}: no 'Usage:' in its first lines"


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_public_names_only(path):
    found = PRIVATE.findall(path.read_text())
    assert not found, f"{path.name} imports a private fuseml name"


def test_private_import_pattern():
    assert PRIVATE.search("from fuseml.ops._gemm import SMEM_LIMIT")
    assert PRIVATE.search("from fuseml.ops import _gemm, _tune")
    assert PRIVATE.search("import fuseml.ops._utils")
    assert not PRIVATE.search("from fuseml.bench.suites import SUITES\nimport fuseml")


@pytest.mark.parametrize("path", [p for p in TOOLS if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_tools_answer_help_without_a_gpu(path):
    out = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(SCRIPTS.parent / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
