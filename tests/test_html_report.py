"""pytest-html's report with the plugin (pytester, in subprocesses): each test's engine cycles in its row and
under it (a table and the memory picture) where pytest-html is loaded; nothing of it imported where not."""

import base64
import html
import json
import re

import pytest
from test_plugin import ENGINES as BASE_ENGINES

from pytest_cudagraph import picture

ENGINES = BASE_ENGINES  # test_plugin's engines: good, leaky, and the ones that crash or hang

TESTS = '''
from engines_mod import good, leaky
def test_good(engine_sequence):
    engine_sequence(good, 2)
def test_leaky(engine_sequence):
    engine_sequence(leaky, 2)
def test_plain():
    pass
'''


def _run(pytester, *args):
    pytester.makepyfile(engines_mod=ENGINES, test_a=TESTS)
    return pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", *args)


def _html_tests(path) -> dict:
    """What pytest-html's page shows, per test id: its rows (cells, extras), from the JSON the page renders."""
    blob = re.search(r'data-jsonblob="([^"]*)"', path.read_text()).group(1)
    return json.loads(html.unescape(blob))["tests"]


def _cell(entry: dict) -> str:
    return html.unescape(next(c for c in entry["resultsTableRow"] if 'class="col-cudagraph"' in c))


def _check_page(pytester, tests: dict) -> None:
    report = json.loads((pytester.path / "r.json").read_text())
    records = {t["nodeid"]: t["cycles"] for t in report["tests"]}
    assert set(tests) == {"test_a.py::test_good", "test_a.py::test_leaky", "test_a.py::test_plain"}
    good, leaky, plain = (tests[f"test_a.py::{n}"][0] for n in ("test_good", "test_leaky", "test_plain"))
    shown = {"good": _cell(good), "leaky": _cell(leaky), "records": records}  # what a failure below shows
    # each row carries its own test's cycles, and only those
    assert "#0 held · pools 0:1 · held 2 MiB · leaked 0" in _cell(good) and "FAILED" not in _cell(good), shown
    assert "#1 leaked FAILED" in _cell(leaky) and "leaked 2 MiB" in _cell(leaky), shown
    assert _cell(plain) == '<td class="col-cudagraph"></td>'
    # the first problem's headline and its line, as the record has them
    problem = picture.first_problem(records["test_a.py::test_leaky"][0])  # the one an error leads with
    head = f"{problem['kind']}: {problem['message'].splitlines()[0]}"
    site = problem["sites"][0].removeprefix(str(pytester.path) + "/")
    assert site.startswith("engines_mod.py:") and f"(at {site})" in _cell(leaky), shown
    assert head[:120] in _cell(leaky), shown
    table = html.unescape(next(x["content"] for x in leaky["extras"] if x["format_type"] == "html"))
    assert head in table and site in table and "cudagraph engine cycles" in table, table
    # the picture is embedded (--self-contained-html): a PNG per test that ran an engine
    for entry in (good, leaky):
        image = next(x["content"] for x in entry["extras"] if x["format_type"] == "image")
        assert image.startswith("data:image/png;base64,")
        assert base64.b64decode(image.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert plain["extras"] == []


def test_the_html_report_shows_each_tests_cycles_and_picture(pytester):
    pytest.importorskip("pytest_html")
    pytest.importorskip("matplotlib")
    result = _run(pytester, "--html=report.html", "--self-contained-html", f"--cudagraph-report={pytester.path}/r.json")
    result.assert_outcomes(passed=2, failed=1)
    _check_page(pytester, _html_tests(pytester.path / "report.html"))


def test_the_html_report_under_xdist(pytester):
    """The workers make the extras, the controller the rows, from the reports the workers send."""
    pytest.importorskip("pytest_html")
    pytest.importorskip("matplotlib")
    pytest.importorskip("xdist")
    result = _run(pytester, "-p", "xdist", "-n", "2", "--html=report.html", "--self-contained-html",
                  f"--cudagraph-report={pytester.path}/r.json")
    result.assert_outcomes(passed=2, failed=1)
    _check_page(pytester, _html_tests(pytester.path / "report.html"))


# pytest-html 4 has two entry points: html (the report) and html_fixtures (the `extras` fixture, which imports
# the package); blocking both is a session without pytest-html
OFF = ["-p", "no:html", "-p", "no:html_fixtures"]


@pytest.mark.parametrize("args", [OFF, ["-p", "no:html"], []], ids=["pytest-html off", "html off", "no --html"])
def test_without_an_html_report_nothing_of_it_is_imported(pytester, args):
    if args != OFF:
        pytest.importorskip("pytest_html")
    pytester.makeconftest('''
        import sys
        def pytest_sessionfinish(session):
            off = "no:html_fixtures" in session.config.invocation_params.args
            assert not (off and "pytest_html" in sys.modules), "pytest_html was imported"
            assert "pytest_cudagraph.html_report" not in sys.modules, "the plugin's html module was imported"
            print("CHECKED: nothing of pytest-html's report imported")
    ''')
    result = _run(pytester, "-s", *args)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*CHECKED: nothing of pytest-html's report imported*",
                                 "*cudagraph lifecycle*", "*test_a.py::test_leaky*leaked FAILED*"])
    assert not (pytester.path / "report.html").exists()
