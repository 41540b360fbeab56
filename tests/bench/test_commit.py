"""The commit stamp comes from git itself: clean, dirty, or plainly unknown."""

import subprocess

import pytest

from fuseml.bench import gpu_check
from fuseml.bench.commit import (
    DIRTY,
    NO_GIT,
    commit_label,
    dirty_paths,
    git_commit,
    source_tree,
)


def _git(repo, *args):
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository with src/, tests/ and a benchmarks results file, all committed."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    for rel in ("src/pkg/a.py", "tests/test_a.py", "benchmarks/results/gpu/suite.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "init")
    return tmp_path


def test_clean_tree_is_its_commit(repo, monkeypatch):
    monkeypatch.setenv("FUSEML_COMMIT", "1234567")  # a hand-set value is never used
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert git_commit(repo) == head
    assert git_commit(repo / "src" / "pkg") == head  # asked from a subfolder
    assert git_commit(repo, short=False) == _git(repo, "rev-parse", "HEAD")


def test_changed_tracked_file_marks_dirty(repo):
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "src/pkg/a.py").write_text("x = 2\n")
    assert git_commit(repo) == head + DIRTY
    _git(repo, "checkout", "--", "src/pkg/a.py")
    (repo / "tests/test_a.py").write_text("x = 2\n")  # the tree differs outside src/ too
    assert git_commit(repo) == head + DIRTY


def test_untracked_source_marks_dirty_other_untracked_files_do_not(repo):
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "notes.txt").write_text("scratch\n")
    assert git_commit(repo) == head
    (repo / "src/pkg/b.py").write_text("y = 1\n")
    assert git_commit(repo) == head + DIRTY


def test_results_written_by_the_run_do_not_mark_dirty(repo):
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "benchmarks/results/gpu/suite.json").write_text("[]\n")
    (repo / "benchmarks/results/gpu/other.json").write_text("[]\n")
    assert git_commit(repo) == head


def test_no_repository_or_no_git_is_said_plainly(tmp_path_factory, monkeypatch, repo):
    copied = tmp_path_factory.mktemp("copy")
    assert git_commit(copied) == NO_GIT  # a copied tree: no .git above it
    assert git_commit(copied / "missing") == NO_GIT
    monkeypatch.setenv("PATH", "")  # no git executable at all
    assert git_commit(repo) == NO_GIT


def test_dirty_paths_reads_porcelain():
    porcelain = "\n".join([
        " M src/fuseml/ops/add.py",
        "M  README.md",
        " M benchmarks/results/h100/linear.json",
        "?? benchmarks/results/h100/new.json",
        "?? scratch.py",
        "?? src/fuseml/new.py",
        "R  src/old.py -> src/new.py",
    ])  # fmt: skip
    assert dirty_paths(porcelain) == [
        "src/fuseml/ops/add.py", "README.md", "src/fuseml/new.py", "src/new.py",
    ]  # fmt: skip


def test_gpu_check_asks_git_when_no_commit_is_given(repo, monkeypatch):
    monkeypatch.setenv("FUSEML_COMMIT", "typed-by-hand")
    monkeypatch.setattr(gpu_check, "git_commit", lambda short: git_commit(repo, short=short))
    assert gpu_check._commit(None) == _git(repo, "rev-parse", "HEAD")
    assert gpu_check._commit("abc123") == "abc123"


def test_source_tree_names_src_as_on_disk_without_touching_the_index(repo):
    committed = _git(repo, "rev-parse", "HEAD:src")[:12]
    assert source_tree(repo) == committed
    status = _git(repo, "status", "--porcelain")
    (repo / "src/pkg/a.py").write_text("x = 2\n")
    changed = source_tree(repo)
    assert changed != committed
    (repo / "src/pkg/b.py").write_text("y = 1\n")  # untracked: imported, so counted
    assert source_tree(repo) not in (committed, changed)
    (repo / "notes.txt").write_text("scratch\n")  # outside src/: not the code
    assert _git(repo, "status", "--porcelain") != status  # (the files), but the index:
    assert _git(repo, "diff", "--cached", "--name-only") == ""


def test_a_stale_history_is_labelled_by_the_commit_whose_src_was_measured(repo):
    old = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "src/pkg/a.py").write_text("x = 2\n")
    measured = source_tree(repo)
    stamp = git_commit(repo)  # as a copy whose history stops at `old` would stamp it
    assert stamp == old + DIRTY
    _git(repo, "commit", "-q", "-am", "the change")
    new = _git(repo, "rev-parse", "--short", "HEAD")
    assert commit_label(stamp, measured, repo) == f"{new} (src/; stamped {old}{DIRTY})"
    assert commit_label(stamp, "0" * 12, repo) == stamp  # no commit has it: as stamped
    assert commit_label(old, measured, repo) == old  # a clean stamp stands
    assert commit_label(stamp, None, repo) == stamp


def test_the_label_stays_with_the_commit_that_made_the_src(repo):
    old = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "src/pkg/a.py").write_text("x = 3\n")
    measured = source_tree(repo)
    stamp = git_commit(repo)
    _git(repo, "commit", "-q", "-am", "the change")
    made = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "notes.txt").write_text("results\n")  # a later commit outside src/
    _git(repo, "add", "notes.txt")
    _git(repo, "commit", "-q", "-m", "results")
    assert commit_label(stamp, measured, repo) == f"{made} (src/; stamped {old}{DIRTY})"


def test_a_gpu_check_summary_is_relabelled_from_its_src_tree(repo, capsys):
    """gpu_check --relabel: a summary written where the history stopped at an older
    commit names the local commit with the tested src/ tree; a second run changes
    nothing, and a summary of a clean commit stands."""
    old = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "src/pkg/a.py").write_text("x = 4\n")
    text = (
        "fuseml gpu-check\n"
        f"commit:  {git_commit(repo, short=False)}\n"
        f"src/:    tree {source_tree(repo)}\n"
        "result:  PASS\n"
    )
    _git(repo, "commit", "-q", "-am", "the change")
    new = _git(repo, "rev-parse", "--short", "HEAD")
    summary = repo / "benchmarks" / "gpu.txt"
    summary.write_text(text)
    assert gpu_check.main(["--relabel", str(summary)]) == 0
    relabelled = summary.read_text()
    assert f"commit:  {new} (src/; stamped {old}" in relabelled
    assert relabelled.replace(relabelled.splitlines()[1], "") == text.replace(
        text.splitlines()[1], ""
    )  # only the commit line changed
    assert gpu_check.relabel(relabelled, repo) == relabelled
    clean = f"commit:  {new}\nresult:  PASS\n"
    assert gpu_check.relabel(clean, repo) == clean
    with pytest.raises(SystemExit):
        gpu_check.main(["--relabel", str(summary), str(repo)])
    assert "--relabel" in capsys.readouterr().err
