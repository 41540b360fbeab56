import json

import pytest

from fuseml.bench import compare
from fuseml.bench.report import FORMAT_VERSION


def _write(folder, suite, rows):
    path = folder / "test-gpu" / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT_VERSION, "suite": suite, "meta": {}, "ceilings": {}, "rows": rows}
    path.write_text(json.dumps(doc))


def _row(case, arm, p50, spread=0.0, mode="events"):
    return {"case": case, "arm": arm, "mode": mode, "p50_ms": p50 / 1e3,
            "p20_ms": (p50 - spread) / 1e3, "p80_ms": (p50 + spread) / 1e3}  # fmt: skip


def test_slower_needs_the_limit_and_apart_ranges(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    _write(before, "softmax", [_row("a", "triton", 10.0), _row("b", "triton", 10.0, 0.5),
                               _row("c", "triton", 10.0), _row("c", "torch", 10.0),
                               _row("d", "triton", 10.0)])  # fmt: skip
    _write(after, "softmax", [_row("a", "triton", 10.5), _row("b", "triton", 10.5, 0.5),
                              _row("c", "triton", 10.1), _row("c", "torch", 20.0),
                              _row("e", "triton", 10.0)])  # fmt: skip
    entries = {e["case"]: e for e in compare.compare(before, after)}
    assert set(entries) == {"a", "b", "c"}  # in both runs, fuseml's arms only
    assert entries["a"]["slower"] and entries["a"]["ratio"] == pytest.approx(1.05)
    assert not entries["b"]["slower"]  # 5% slower, but within the spread
    assert not entries["c"]["slower"]  # 1%: within the limit
    out = tmp_path / "cmp.md"
    assert compare.main([str(before), str(after), "--write", str(out)]) == 1
    text = out.read_text()
    assert "slower (after / before > 1.02 and the p20-p80 ranges apart): 1." in text
    assert "| softmax | a | triton | events | 10.0 | 10.5 | 1.050 | slower |" in text
    assert capsys.readouterr().out == text


def test_bad_folders_and_nothing_in_common(tmp_path):
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "no"), str(tmp_path)])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "a"), str(tmp_path / "b")])
