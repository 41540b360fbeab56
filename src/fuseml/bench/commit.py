"""The commit a benchmark or a GPU check ran from, asked of git itself.

Never a value set by hand: a stamp typed in is a stamp that can be wrong. Where git or
the repository is missing (a copied tree, an installed package) the stamp says so.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

NO_GIT = "unknown (no git)"
DIRTY = "+dirty"
# Written by the benchmarks themselves while they run: a change there is the run's output,
# not a change to the code measured.
OUTPUT_DIRS = ("benchmarks/",)


def _git(where: Path, *args: str) -> str | None:
    """stdout of ``git -C where args``, or None where git or the repo is absent."""
    try:
        out = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def dirty_paths(porcelain: str) -> list[str]:
    """The paths of ``git status --porcelain`` output that make the tree differ from its
    commit: a tracked file changed anywhere but the benchmarks' output, or a file under
    src/ that git does not track yet (it would be imported)."""
    paths = []
    for line in porcelain.splitlines():
        if len(line) < 4:
            continue
        status, path = line[:2], line[3:].split(" -> ")[-1].strip('"')
        if status == "??":
            if path.startswith("src/"):
                paths.append(path)
        elif not path.startswith(OUTPUT_DIRS):
            paths.append(path)
    return paths


def git_commit(where: Path | str | None = None, *, short: bool = True) -> str:
    """The commit checked out where this package's source lies (or ``where``), from
    ``git rev-parse HEAD``, with DIRTY appended when the tree differs from it (see
    :func:`dirty_paths`); NO_GIT where there is no git or no repository."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    if not where.is_dir():
        return NO_GIT
    sha = (_git(where, "rev-parse", *(["--short"] if short else []), "HEAD") or "").strip()
    top = (_git(where, "rev-parse", "--show-toplevel") or "").strip()
    if not sha or not top:
        return NO_GIT
    # (porcelain lines start with a space for a change not staged: not to be stripped)
    status = _git(Path(top), "status", "--porcelain")
    if status is None:
        return sha + "+unknown (git status failed)"
    return sha + (DIRTY if dirty_paths(status) else "")
