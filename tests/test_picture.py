"""The memory picture (pytest_cudagraph/picture.py), drawn from synthetic reports: a panel per test, failing
tests first, the width bounded whatever the run's size, the height growing up to a cap, a large run's passing
tests folded into a line; and no picture, and no error, without matplotlib."""

import json
import struct
import sys

import pytest

from pytest_cudagraph import picture
from pytest_cudagraph.report import timeline_png

MiB = 2**20


def _cycle(i, verdict="fresh", failed=False, leaked=0, held=0, site="/srv/app/engine.py:212 in capture"):
    problems = [{"kind": verdict, "message": f"after release its pools [(0, {i + 1})] (captured at {site}) still "
                 f"hold {leaked} bytes", "bytes": leaked, "sites": [site]}] if failed else []
    return {"index": i, "verdict": verdict, "failed": failed, "pool_bytes": 2 * MiB, "held_bytes": held,
            "leaked_bytes": leaked, "problems": problems, "pool_ids": [[0, [0, i + 1]]]}


def _run(n_tests, failing=(), cycles=2, long_test=None):
    """``n_tests`` tests of ``cycles`` engine cycles each; those in ``failing`` leak in their last cycle."""
    tests = []
    for k in range(n_tests):
        bad = k in failing
        cs = [_cycle(i, "held", held=2 * MiB) for i in range(cycles - 1)]
        cs.append(_cycle(cycles - 1, "leaked", True, leaked=2 * MiB) if bad else _cycle(cycles - 1))
        tests.append({"nodeid": f"tests/serving/test_engines.py::test_family_variant_{k:03d}[bf16-tp2-piecewise]",
                      "outcome": "failed" if bad else "passed", "cycles": cs, "lifecycle_failure": bad})
    if long_test:
        tests.append({"nodeid": "tests/test_long.py::test_many_engines", "outcome": "failed", "lifecycle_failure": True,
                      "cycles": [_cycle(i, "stale", i == long_test - 3) for i in range(long_test)]})
    tests.append({"nodeid": "tests/test_other.py::test_no_engine", "outcome": "passed", "cycles": []})
    return tests


def _png_size(path) -> tuple[int, int]:
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _drawn(plan) -> list[str]:
    return list(dict.fromkeys(p.nodeid for p in plan.panels))


def test_a_small_run_draws_every_test_failing_first(tmp_path):
    pytest.importorskip("matplotlib")
    tests = _run(4, failing={2})
    plan = picture.render(tests, tmp_path / "p.png")
    assert _drawn(plan) == [tests[2]["nodeid"]] + [tests[k]["nodeid"] for k in (0, 1, 3)]  # not the no-engine test
    assert plan.folded == []
    assert plan.header[0].startswith("cudagraph lifecycle: 5 tests, 8 engine cycles")
    assert plan.header[1].startswith("1 failed cycle(s) in 1 test(s); 1 test(s) failed for lifecycle reasons")
    width, height = _png_size(tmp_path / "p.png")
    assert (width, height) == tuple(round(x * picture.DPI) for x in plan.size)
    assert width == 1200 and height < 1000


@pytest.mark.parametrize("n_tests", [64, 1000])
def test_a_large_run_draws_its_failing_tests_folds_the_rest_and_stays_bounded(tmp_path, n_tests):
    pytest.importorskip("matplotlib")
    failing = {3, 37, n_tests - 1}
    tests = _run(n_tests, failing=failing, cycles=96 // 64 + 1, long_test=40)
    plan = picture.render(tests, tmp_path / "p.png")
    # the failing tests, and only they, get panels; the one with 40 cycles wraps into panels of its own
    assert set(_drawn(plan)) == {tests[k]["nodeid"] for k in failing} | {"tests/test_long.py::test_many_engines"}
    long_panels = [p for p in plan.panels if p.nodeid.endswith("test_many_engines")]
    assert len(long_panels) == picture.MAX_PANELS_PER_TEST and long_panels[-1].note == \
        "8 more cycles not drawn, none failed"
    assert any(c["failed"] for p in long_panels for c in p.cycles)  # its failed cycle is among those drawn
    assert plan.folded == [f"and {n_tests - 3} more test(s) not drawn, none with a failed cycle: "
                           f"{2 * (n_tests - 3)} cycles, {n_tests - 3} fresh, {n_tests - 3} held"]
    width, height = _png_size(tmp_path / "p.png")
    assert width == 1200
    assert 600 < height < 2000  # 7 panels in 4 rows: grown in height, not in width


def test_the_height_grows_with_the_failing_tests_up_to_a_cap_and_the_rest_is_named(tmp_path):
    pytest.importorskip("matplotlib")
    sizes = []
    for n in (1, 6, 20, 100):
        tests = _run(300, failing=set(range(0, 3 * n, 3)))
        plan = picture.render(tests, tmp_path / f"{n}.png")
        sizes.append(_png_size(tmp_path / f"{n}.png"))
    assert {w for w, _ in sizes} == {1200}
    heights = [h for _, h in sizes]
    assert heights[0] < heights[1] < heights[2] < heights[3] < 3000
    assert len(plan.panels) == picture.MAX_PANELS
    assert plan.failing_folded and plan.folded[0].startswith(
        f"and {100 - picture.MAX_PANELS} more test(s) with failed cycles, not drawn (the JSON report has every "
        "cycle): test_engines.py::")
    assert "…_072…" in plan.folded[0]  # the first one left out, by what tells it from the others
    assert plan.folded[1].startswith("and 200 more test(s) not drawn, none with a failed cycle")


def test_a_cut_test_name_keeps_what_tells_it_from_the_others():
    ids = [f"tests/serving/test_engines.py::test_family_variant_{k:03d}[bf16-tp2-piecewise]" for k in range(64)]
    shared = picture._shared(ids)
    for k in (0, 37, 63):
        name = picture.short_name(ids[k], 40, True, shared[ids[k]])
        assert len(name) <= 40 and f"{k:03d}"[1:] in name, name
    assert picture.short_name("a/b/test_x.py::test_y[1]", 80) == "test_x.py::test_y[1]"


def test_the_picture_of_a_saved_report_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"tests": _run(64, failing={5})}))
    assert picture.main([str(report), str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path / 'r.png'}: 1200 x ") and "and 63 more test(s) not drawn" in out
    report.write_text(json.dumps({"tests": [{"nodeid": "t.py::test_a", "outcome": "passed", "cycles": []}]}))
    assert picture.main([str(report), str(tmp_path / "none.png")]) == 1
    assert "no engine cycles" in capsys.readouterr().err and not (tmp_path / "none.png").exists()
    report.write_text("[1, 2]")
    assert picture.main([str(report), str(tmp_path / "none.png")]) == 2
    assert "not a --cudagraph-report file" in capsys.readouterr().err


def test_without_matplotlib_no_picture_and_no_error(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib...` raises ImportError
    tests = _run(3, failing={1})
    assert picture.render(tests, tmp_path / "p.png") is None
    assert picture.png_bytes(tests, columns=1, summary=False) is None
    assert timeline_png(tests, str(tmp_path / "r.json")) is None
    assert not list(tmp_path.iterdir())
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"tests": tests}))
    assert picture.main([str(report), str(tmp_path / "r.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
