"""Specification: the paths the plugin writes make their folders, as pytest's ``--junitxml`` does.

A missing folder of ``--cudagraph-report`` (``CUDAGRAPH_REPORT``, ``cudagraph_report``) is made with its parents
at the start; one that cannot be made (a file where a folder goes, no permission) is a usage error (exit code 4)
naming what the user set; a folder removed during the session is made again at its end.
"""

import json
import os

import pytest

PLAIN_TEST = "def test_x(cudagraph_backend_name): pass"


def _report(path) -> dict:
    data = json.loads(path.read_text())
    assert data["totals"]["outcomes"]["passed"] == 1, data["totals"]
    return data


@pytest.mark.parametrize("args, env, ini", [
    (["--cudagraph-report=reports/ci/nightly/cudagraph.json"], {}, ""),
    ([], {"CUDAGRAPH_REPORT": "reports/ci/nightly/cudagraph.json"}, ""),
    ([], {}, "cudagraph_report = reports/ci/nightly/cudagraph.json"),
], ids=["cli", "env", "ini"])
def test_a_nested_missing_folder_is_made(pytester, monkeypatch, args, env, ini):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph", *args)
    assert res.ret == pytest.ExitCode.OK, res.stdout.str() + res.stderr.str()
    report = pytester.path / "reports" / "ci" / "nightly" / "cudagraph.json"
    _report(report)
    res.stdout.fnmatch_lines([f"cudagraph report: {report}"])


def test_the_readme_gate_needs_no_mkdir(pytester):
    """The CI gate's two reports in one missing folder: ours and pytest's own junit XML."""
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph", "--cudagraph-report=reports/cudagraph.json",
                                       "--junitxml=reports/junit.xml")
    assert res.ret == pytest.ExitCode.OK, res.stdout.str() + res.stderr.str()
    _report(pytester.path / "reports" / "cudagraph.json")
    assert (pytester.path / "reports" / "junit.xml").is_file()


def test_xdist_workers_find_the_folder_the_controller_made(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_a=PLAIN_TEST)
    report = pytester.path / "out" / "deep" / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-n", "2", "--cudagraph-report=out/deep/r.json")
    assert res.ret == pytest.ExitCode.OK, res.stdout.str() + res.stderr.str()
    _report(report)


@pytest.mark.parametrize("args, env, ini, given", [
    (["--cudagraph-report=notes.txt/out/r.json"], {}, "", "--cudagraph-report=notes.txt/out/r.json"),
    (["--cudagraph-report=notes.txt/r.json"], {}, "", "--cudagraph-report=notes.txt/r.json"),
    ([], {"CUDAGRAPH_REPORT": "notes.txt/out/r.json"}, "", "CUDAGRAPH_REPORT=notes.txt/out/r.json"),
    ([], {}, "cudagraph_report = notes.txt/out/r.json", "ini key cudagraph_report=notes.txt/out/r.json"),
], ids=["cli, nested", "cli", "env", "ini"])
def test_a_parent_that_is_a_file_is_a_usage_error(pytester, monkeypatch, args, env, ini, given):
    """Nothing is made, and the message names what the user set, the file in the way and the fix."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    (pytester.path / "notes.txt").write_text("a file, not a folder\n")
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph", *args)
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str()
    words = f"ERROR: {given}: {pytester.path / 'notes.txt'} is a file, not a folder; choose another path"
    assert words in res.stderr.str() and "Traceback" not in res.stderr.str(), res.stderr.str()
    assert (pytester.path / "notes.txt").read_text() == "a file, not a folder\n"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a /proc, where no folder can be made")
def test_a_folder_that_cannot_be_made_is_a_usage_error(pytester):
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph", "--cudagraph-report=/proc/cudagraph/r.json")
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str()
    assert ("ERROR: --cudagraph-report=/proc/cudagraph/r.json: the folder /proc/cudagraph cannot be created ("
            in res.stderr.str()), res.stderr.str()
    assert "); choose a path under a folder you can write to" in res.stderr.str(), res.stderr.str()


def test_a_folder_removed_during_the_session_is_made_again(pytester):
    """As --junitxml makes its folder when it writes: the report is written, the session passes."""
    pytester.makepyfile(test_a="import shutil\ndef test_x(cudagraph_backend_name):\n    shutil.rmtree('out')\n")
    res = pytester.runpytest_inprocess("-p", "cudagraph", "--cudagraph-report=out/r.json")
    assert res.ret == pytest.ExitCode.OK, res.stdout.str() + res.stderr.str()
    _report(pytester.path / "out" / "r.json")
