"""The commit a benchmark or a GPU check ran from, asked of git itself.

Never a value set by hand: a stamp typed in is a stamp that can be wrong. Where git or
the repository is missing (a copied tree, an installed package) the stamp says so. A
dirty tree is also stamped with the git tree id of its src/ as it is on disk
(``source_tree``): a tree copied to another machine with an older history is stamped
with that older commit, but its src/ tree id names the code itself, and ``commit_label``
finds the local commit whose src/ it is.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

NO_GIT = "unknown (no git)"
DIRTY = "+dirty"
# Written by the benchmarks themselves while they run: a change there is the run's output,
# not a change to the code measured.
OUTPUT_DIRS = ("benchmarks/",)


def _git(where: Path, *args: str, env: dict | None = None, stdin: str | None = None) -> str | None:
    """stdout of ``git -C where args``, or None where git or the repo is absent."""
    try:
        out = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30,
            env=env, input=stdin,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _top(where: Path | str | None) -> Path | None:
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    if not where.is_dir():
        return None
    top = (_git(where, "rev-parse", "--show-toplevel") or "").strip()
    return Path(top) if top else None


def source_tree(where: Path | str | None = None) -> str | None:
    """The git tree id of src/ as it is on disk (tracked and untracked files, ignored ones
    left out), short; None without git. Built in a temporary index: the repository's own
    index is not touched (the files' blobs are written to its object store)."""
    top = _top(where)
    if top is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if _git(top, "add", "-A", "--", "src", env=env) is None:
            return None
        tree = (_git(top, "write-tree", "--prefix=src/", env=env) or "").strip()
    return tree[:12] or None


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
    top = _top(where)
    if top is None:
        return NO_GIT
    sha = (_git(top, "rev-parse", *(["--short"] if short else []), "HEAD") or "").strip()
    if not sha:
        return NO_GIT
    # (porcelain lines start with a space for a change not staged: not to be stripped)
    status = _git(top, "status", "--porcelain")
    if status is None:
        return sha + "+unknown (git status failed)"
    return sha + (DIRTY if dirty_paths(status) else "")


@functools.cache
def _src_trees(top: Path, head: str, depth: int = 500) -> dict[str, str]:
    """{src/ tree id (12 hex digits): the oldest of the last ``depth`` commits up to
    ``head`` with it} (the commit that made that src/, which later commits of docs or
    results do not change)."""
    shas = (_git(top, "rev-list", f"--max-count={depth}", head) or "").split()
    if not shas:
        return {}
    out = _git(
        top, "cat-file", "--batch-check=%(objectname)",
        stdin="".join(f"{sha}:src\n" for sha in shas),
    )  # fmt: skip
    found: dict[str, str] = {}
    for sha, tree in zip(shas, (out or "").splitlines(), strict=False):
        if len(tree) >= 12 and "missing" not in tree:
            found[tree[:12]] = sha[:7]  # (rev-list lists the newest first)
    return found


def commit_label(commit: str, tree: str | None, where: Path | str | None = None) -> str:
    """How a row's stamp reads: ``commit``, or for a dirty tree whose src/ tree id is that
    of a commit in the local history (the last 500), "<that commit> (src/; stamped ...)"."""
    if not commit.endswith(DIRTY) or not tree:
        return commit
    top = _top(where)
    head = (_git(top, "rev-parse", "HEAD") or "").strip() if top is not None else ""
    found = _src_trees(top, head).get(tree[:12]) if head else None
    return f"{found} (src/; stamped {commit})" if found else commit
