"""scripts/compare_outcomes.py: PyTorch's graph tests judged plain against under the sanitizer, test by test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _xml(path, cases: dict) -> str:
    body = {"passed": "", "failed": '<failure message="AssertionError: boom">tb</failure>',
            "skipped": '<skipped type="pytest.skip" message="no CUDA"/>',
            "xfailed": '<skipped type="pytest.xfail" message="known"/>'}
    rows = "".join(f'<testcase classname="m.TestCuda" name="{n}">{body[o]}</testcase>' for n, o in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return str(path)


def _compare(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_outcomes.py"), *args],
                          capture_output=True, text=True)


def test_failures_of_the_version_alike_in_both_runs_are_no_difference(tmp_path):
    cases = {"test_a": "passed", "test_b": "failed", "test_c": "skipped", "test_d": "xfailed"}
    out = tmp_path / "c.json"
    r = _compare(_xml(tmp_path / "p.xml", cases), _xml(tmp_path / "s.xml", cases), "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["differ"] == [] and data["plain"] == {"failed": 1, "passed": 1, "skipped": 1, "xfailed": 1}
    assert data["tests"]["m.TestCuda::test_b"] == {"plain": "failed", "with_tool": "failed"}


def test_an_outcome_the_tool_changed_fails_and_is_named(tmp_path):
    p = _xml(tmp_path / "p.xml", {"test_a": "passed", "test_b": "passed"})
    s = _xml(tmp_path / "s.xml", {"test_a": "passed", "test_b": "failed"})
    r = _compare(p, s)
    assert r.returncode == 1
    assert "m.TestCuda::test_b: passed plain, failed with the tool (AssertionError: boom)" in r.stdout


def test_a_test_only_one_run_has_is_a_difference(tmp_path):
    r = _compare(_xml(tmp_path / "p.xml", {"test_a": "passed", "test_b": "passed"}),
                 _xml(tmp_path / "s.xml", {"test_a": "passed"}))
    assert r.returncode == 1 and "test_b: passed plain, absent with the tool" in r.stdout


def test_a_run_with_no_tests_or_no_xml_fails(tmp_path):
    assert _compare(_xml(tmp_path / "p.xml", {}), _xml(tmp_path / "s.xml", {})).returncode == 1
    r = _compare(_xml(tmp_path / "p.xml", {"test_a": "passed"}), str(tmp_path / "missing.xml"))
    assert r.returncode == 1 and "cannot read the with_tool run's XML" in r.stderr
