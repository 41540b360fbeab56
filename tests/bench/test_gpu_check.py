"""The gpu-check summary: counts from pytest's JUnit report, the demo's exit code."""

import pytest

from fuseml.bench import gpu_check

DEVICE = ("NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)", "2.11.0", "3.6.0")
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
errors="{errors}" failures="{failures}" skipped="1" tests="5" time="12.5">
<testcase classname="tests.ops.test_mlp" name="test_a"/>
<testcase classname="tests.ops.test_mlp" name="test_b">{failure}</testcase>
</testsuite></testsuites>"""


def _run(tmp_path, *, failures=0, errors=0, demo_rc=None):
    failure = '<failure message="boom"/>' if failures else ""
    xml = JUNIT.format(errors=errors, failures=failures, failure=failure)
    (tmp_path / "tests.xml").write_text(xml)
    (tmp_path / "tests.paths").write_text("tests/ops\n")
    if demo_rc is not None:
        (tmp_path / "demo.rc").write_text(f"{demo_rc}\n")
    return gpu_check.report(tmp_path, "abc123", DEVICE)


def test_a_clean_run_passes(tmp_path):
    text = _run(tmp_path, demo_rc=0)
    assert "device:  NVIDIA H100 80GB HBM3" in text and "commit:  abc123" in text
    assert "tests:   4 passed, 0 failed, 0 errors, 1 skipped of 5 (pytest -m gpu tests/ops" in text
    assert "demo:    passed (fuseml demo, exit 0)" in text and "suites:  none run" in text
    assert text.rstrip().endswith("result:  PASS")


def test_a_failed_test_or_demo_fails_the_check(tmp_path):
    text = _run(tmp_path, failures=1)
    assert "1 failed" in text and "failed: tests.ops.test_mlp::test_b" in text
    assert "demo:    not run" in text and text.rstrip().endswith("FAIL")
    assert _run(tmp_path, demo_rc=1).rstrip().endswith("FAIL")
    assert _run(tmp_path, errors=1, demo_rc=0).rstrip().endswith("FAIL")


def test_no_tests_run_is_reported(tmp_path):
    assert gpu_check.report(tmp_path, "abc123", DEVICE).rstrip().endswith("FAIL")  # nothing ran
    (tmp_path / "demo.rc").write_text("0")
    text = gpu_check.report(tmp_path, "abc123", DEVICE)
    assert "tests:   not run" in text and text.rstrip().endswith("PASS")


def test_main_writes_the_summary_file(tmp_path, capsys, monkeypatch):
    _run(tmp_path, demo_rc=0)
    monkeypatch.setattr(gpu_check, "_device", lambda: DEVICE)
    assert gpu_check.main([str(tmp_path), "--commit", "abc123"]) == 0
    assert (tmp_path / "gpu-check.txt").read_text() == capsys.readouterr().out


def test_parts_of_a_split_check_are_summed_and_an_unfinished_one_fails(tmp_path):
    a, b = tmp_path / "ops", tmp_path / "rest"
    a.mkdir(), b.mkdir()
    _run(a)
    _run(b, demo_rc=0)
    text = gpu_check.report([a, b], "abc123", DEVICE)
    assert text.count("tests:   4 passed") == 2 and "demo:    passed" in text
    assert text.rstrip().endswith("PASS")
    (a / "tests.xml").unlink()  # pytest cut short: its paths file, no report
    text = gpu_check.report([a, b], "abc123", DEVICE)
    assert "NO REPORT (did not finish)" in text and text.rstrip().endswith("FAIL")


def test_main_writes_where_asked(tmp_path, monkeypatch, capsys):
    _run(tmp_path, demo_rc=0)
    monkeypatch.setattr(gpu_check, "_device", lambda: DEVICE)
    target = tmp_path / "h100.txt"
    assert gpu_check.main([str(tmp_path), "--commit", "abc", "--write", str(target)]) == 0
    assert target.read_text() == capsys.readouterr().out


def test_a_run_cut_short_counts_what_its_log_shows(tmp_path):
    (tmp_path / "tests.paths").write_text("tests/ops\n")
    (tmp_path / "tests.txt").write_text(
        "tests/ops/test_a.py::test_x[1] \n"  # (a test started: no outcome yet)
        "[gw0] [ 10%] PASSED tests/ops/test_a.py::test_x[1] \n"
        "[gw1] [ 20%] SKIPPED tests/ops/test_a.py::test_y \n"
        "[gw0] [ 41%] FAILED tests/ops/test_b.py::test_z \n"
        "tests/ops/test_c.py::test_w PASSED                          [ 42%]\n"
    )
    (tmp_path / "demo.rc").write_text("0")
    text = gpu_check.report(tmp_path, "abc123", DEVICE)
    assert (
        "NO REPORT (did not finish; cut at 42%: 2 passed, 1 failed, 0 errors, 1 skipped so far)"
        in text
    )
    assert "failed: tests/ops/test_b.py::test_z" in text and text.rstrip().endswith("FAIL")


def _summary(part, device="NVIDIA H200 (sm_90, 132 SMs)", tree="tree 3f4ae6a1c101", date="T1"):
    (part / "gpu-check.txt").write_text(
        f"fuseml gpu-check\ndevice:  {device}\ntorch:   2.11.0+cu130\ntriton:  3.6.0\n"
        f"commit:  547b9f8+dirty\nsrc/:    {tree}\ndate:    {date}\nresult:  PASS\n"
    )


def test_parts_summed_elsewhere_keep_the_machine_and_code_they_ran_on(tmp_path, monkeypatch):
    """Parts fetched from a GPU machine and summed on another: the summary names the GPU
    machine, its torch and triton and the tree it ran, not the machine summing them."""
    monkeypatch.setattr(gpu_check, "_device", lambda: ("no CUDA device", "2.13.0+cpu", "3.9"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _run(a)
    _run(b, demo_rc=0)
    _summary(a, date="2026-11-29T01:34:27Z")
    _summary(b, date="2026-11-29T01:40:46Z")
    text = gpu_check.report([a, b])
    assert "device:  NVIDIA H200 (sm_90, 132 SMs)" in text and "torch:   2.11.0+cu130" in text
    assert "triton:  3.6.0" in text and "commit:  547b9f8+dirty" in text
    assert "src/:    tree 3f4ae6a1c101" in text and "date:    2026-11-29T01:40:46Z" in text
    assert text.count("tests:   4 passed") == 2 and text.rstrip().endswith("PASS")
    _summary(b, device="NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)")
    with pytest.raises(ValueError, match="device differ"):
        gpu_check.report([a, b])
    _summary(b, tree="tree 000000000000")
    with pytest.raises(SystemExit):
        gpu_check.main([str(a), str(b), "--write", str(tmp_path / "x.txt")])
    assert not (tmp_path / "x.txt").exists()
