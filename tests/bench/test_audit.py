"""fuseml.bench.audit: committed peer rows far outside their own earlier runs are listed,
and with --write marked noisy; fuseml's arms, host-bound rows and rows within their
history are left alone."""

import json
import subprocess

from fuseml.bench import audit


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)


def _row(case, arm, us, date, mode="events", torch="2.x"):
    return {
        "suite": "t", "case": case, "arm": arm, "mode": mode, "p50_ms": us / 1e3,
        "p20_ms": us / 1e3, "p80_ms": us / 1e3, "date": date, "torch": torch,
    }  # fmt: skip


def _commit(repo, path, rows, message):
    path.write_text(json.dumps({"format": 1, "suite": "t", "rows": rows}))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", message)


def test_peer_rows_outside_their_history_are_listed_and_marked(tmp_path, capsys):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    path = tmp_path / "t.json"
    for i, us in enumerate((72.5, 73.3)):  # two earlier runs
        date = f"2026-01-0{i + 1}"
        _commit(tmp_path, path, [
            _row("a", "compile", us, date), _row("a", "triton", 50.0 + 20 * i, date),
            _row("b", "compile", 10.0, date), _row("c", "eager", 40.0, date),
            _row("d", "compile", 10.0, date, torch="2.y"),
        ], f"run {i}")  # fmt: skip
    latest = "2026-01-09"
    _commit(tmp_path, path, [
        _row("a", "compile", 117.2, latest),  # 1.6x the earlier runs: listed
        _row("a", "triton", 20.0, latest),  # fuseml's own arm: its code changed
        _row("b", "compile", 11.0, latest),  # within 15% of the earlier runs
        _row("c", "eager", 400.0, latest, mode="wall"),  # host time: not compared
        _row("d", "compile", 30.0, latest),  # another torch: no history
        _row("e", "compile", 30.0, latest),  # a new case: no history
    ], "run 2")  # fmt: skip
    assert audit.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "a | compile | events: median 117.2 us" in out and "(72.5-73.3 us)" in out
    assert "1 rows outside their history" in out
    assert audit.main([str(path), "--write"]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert "not timed again" in rows[0]["noisy"]
    assert [r for r in rows[1:] if r.get("noisy")] == []
    assert audit.main([str(path)]) == 0  # marked rows are no longer listed


def test_peer_arms():
    for arm in ("triton", "triton-ptr", "triton+graph", "cuda", "fuseml", "fuseml-compile",
                "fuseml:top_mlp", "triton@tma/128x128x64"):  # fmt: skip
        assert not audit.is_peer(arm), arm
    for arm in ("eager", "compile", "compile-max", "cublaslt", "compile:top_mlp", "merged"):
        assert audit.is_peer(arm), arm
