"""The compiled capture path (observe/_capture.c) and the Python one give the ledger the same entries, field by
field, down every branch of capture_begin (tests/capture_path_cases.py, run once per path in a fresh
process); ``CUDAGRAPH_CAPTURE_PATH`` chooses between them, and a bad value names the variable."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cudagraph_lifecycle.choices import capture_path_from_env
from cudagraph_lifecycle.errors import ConfigError

CASES = Path(__file__).with_name("capture_path_cases.py")


def _cases(path: str) -> dict:
    env = {**os.environ, "CUDAGRAPH_CAPTURE_PATH": path}
    env.pop("CUDAGRAPH_SANITIZE", None)
    done = subprocess.run([sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_both_capture_paths_give_the_ledger_the_same_entries():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the compiled capture path cannot have been built")
    compiled, python = _cases("compiled"), _cases("python")
    # the compiled path took the common captures and handed the rest to Python: a pool given twice, a pool as
    # a list, a dead pool judged and one not, the default stream judged, an event queued; and at the end, the
    # captures whose pool is learnt only then and the graph that takes no attribute
    counts = compiled["counts"]
    assert counts["capture_begin.compiled_calls"] >= 300 and counts["capture_begin.python_calls"] >= 6, counts
    assert counts["capture_end.compiled_calls"] >= 150 and counts["capture_end.python_calls"] >= 150, counts
    # torch.cuda.graph's flushes: straight through while nothing waits for one, else recorded in Python
    for flush in ("empty_cache", "host_empty_cache"):
        assert counts[f"{flush}.compiled_calls"] >= 1 and counts[f"{flush}.python_calls"] >= 1, counts
    assert compiled["outcomes"]["flushes"], compiled["outcomes"]
    assert set(python["counts"].values()) == {None, "function"}
    # the runner's entries: made by the compiled record on one path, by wrappers.recorder's on the other
    assert (compiled["counts"]["direct.record"], python["counts"]["direct.record"]) == ("builtin_function_or_method",
                                                                                        "function")
    assert compiled["outcomes"]["a runner's captures"] == "ok", compiled["outcomes"]
    assert [e["scope"] for e in compiled["entries"]].count("runner") == 3
    assert len(compiled["entries"]) > 300 and compiled["stale"] and compiled["default_stream"]
    assert compiled["failed_captures"] and compiled["outcomes"]["pools"]
    # no reference taken on either path outlives the captures: every backend and graph is gone at the end
    assert compiled["alive_after"] == python["alive_after"] == []
    for part in ("outcomes", "stale", "default_stream", "failed_captures"):
        assert compiled[part] == python[part], part
    for c, p in zip(compiled["entries"], python["entries"], strict=True):
        assert c == p
    # the stack each capture keeps starts at the caller of capture_begin, on both paths
    first = compiled["entries"][0]["frames"]
    assert first[0][0] == "go" and first[1][0] == "attempt", first


def test_the_capture_path_variable_is_checked():
    assert capture_path_from_env({}) == "auto"
    assert capture_path_from_env({"CUDAGRAPH_CAPTURE_PATH": " Python "}) == "python"
    with pytest.raises(ConfigError, match=r"CUDAGRAPH_CAPTURE_PATH='c' is not one of auto, compiled, python"):
        capture_path_from_env({"CUDAGRAPH_CAPTURE_PATH": "c"})


def test_a_bad_capture_path_stops_the_install_and_names_the_variable():
    code = ("from cudagraph_lifecycle import observe\n"
            "try:\n    observe.acquire()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "print('installed', observe.installed())\n")
    env = {**os.environ, "CUDAGRAPH_CAPTURE_PATH": "fast"}
    env.pop("CUDAGRAPH_SANITIZE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "ConfigError CUDAGRAPH_CAPTURE_PATH='fast'" in out and "installed False" in out, out


@pytest.mark.parametrize("path, kind, end", [("python", "function", "function"),
                                             ("compiled", "CaptureBegin", "CaptureEnd")])
def test_the_chosen_path_is_the_one_installed_and_unwraps_to_the_original(path, kind, end):
    if path == "compiled" and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the compiled capture path cannot have been built")
    code = ("from cudagraph_lifecycle import observe\n"
            "from cudagraph_lifecycle.backends.sim import SimGraph\n"
            "original = SimGraph.capture_begin\n"
            "observe.acquire()\n"
            "w = SimGraph.capture_begin\n"
            "print(type(w).__name__, w.__wrapped__ is original, w.__name__, observe.compiled.path())\n"
            "print(type(SimGraph.capture_end).__name__)\n"
            "observe.release()\n"
            "print(SimGraph.capture_begin is original)\n")
    env = {**os.environ, "CUDAGRAPH_CAPTURE_PATH": path}
    env.pop("CUDAGRAPH_SANITIZE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == [kind, "True", "capture_begin", path, end, "True"], done.stdout + done.stderr


def test_an_install_without_the_extension_runs_python_or_says_why_compiled_cannot(monkeypatch):
    from cudagraph_lifecycle.observe import compiled

    monkeypatch.setattr(compiled, "_capture", None)
    monkeypatch.setattr(compiled, "_missing", "ImportError: no module named _capture")
    monkeypatch.delenv("CUDAGRAPH_CAPTURE_PATH", raising=False)
    assert compiled.path() == "python"
    assert compiled.describe() == "python (the compiled path was not built: ImportError: no module named _capture)"
    monkeypatch.setenv("CUDAGRAPH_CAPTURE_PATH", "compiled")
    with pytest.raises(ConfigError, match=r"CUDAGRAPH_CAPTURE_PATH=compiled, but the compiled capture path was not "
                                          r"built \(ImportError: no module named _capture\): reinstall where a C compiler and "
                                          r"Python's headers are present \(from a clone: pip install --no-deps -e \.\)"):
        compiled.path()


def test_a_flush_that_recorded_a_release_lets_the_next_flushes_through():
    """torch.cuda.graph flushes both caches before every capture: after a release, the first capture's flushes
    record it in Python and close their gates; the next capture's flushes pass straight through in C. In a
    fresh process: a released pool of another world, left by an earlier test, would keep the gates open."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the compiled capture path cannot have been built")
    code = textwrap.dedent("""
        from cudagraph_lifecycle import PoolSanitizer
        from cudagraph_lifecycle.backends.sim import SimBackend

        be = SimBackend()
        with PoolSanitizer(be):
            gates = SimBackend.empty_cache, SimBackend.host_empty_cache
            pool = be.graph_pool_handle()

            def capture():
                g = be.new_graph()
                with be.graph(g, pool=pool):
                    be.randn(4).mul_(2)
                return g

            capture().reset()  # released: both flushes have something to record
            before = [(gate.python_calls, gate.compiled_calls) for gate in gates]
            kept = [capture(), capture(), capture()]
            after = [(gate.python_calls, gate.compiled_calls) for gate in gates]
            print([(p1 - p0, c1 - c0) for (p0, c0), (p1, c1) in zip(before, after)], len(kept))
    """)
    env = {**os.environ, "CUDAGRAPH_CAPTURE_PATH": "compiled"}
    env.pop("CUDAGRAPH_SANITIZE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[(1, 2), (1, 2)] 3", done.stdout + done.stderr[-2000:]
