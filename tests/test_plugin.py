"""The plugin through pytester, in subprocesses (workers fork)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ENGINES = '''
import os, torch
from cudagraph_lifecycle import CUDAGraphRunner

class Engine:
    def __init__(self, backend):
        self.runner = CUDAGraphRunner(lambda x: torch.relu(x * 2), [1, 2, 4], (8,), backend=backend)
        self.dev = backend.torch_device(0)
    def capture(self): self.runner.capture()
    def run(self, x): return self.runner.run(x)
    def eager(self, x): return torch.relu(x * 2)
    def example_input(self): return torch.randn(3, 8, device=self.dev)
    def release(self): self.runner.release()

def good(backend): return Engine(backend)

def crash_in_capture(backend):
    e = Engine(backend)
    e.capture = lambda: os.abort()
    return e

def factory_raises(backend):
    raise ValueError("no weights found at /nowhere")

class Leaky(Engine):
    kept = []
    def release(self):
        Leaky.kept.append(self.runner.run(self.example_input()))  # keeps a view of the pool
        self.runner.release()

def leaky(backend): return Leaky(backend)

class NeverReleases(Engine):
    def release(self): pass

def never_releases(backend): return NeverReleases(backend)
'''


def run(pytester, *args):
    pytester.makepyfile(engines_mod=ENGINES)
    return pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", *args)


def run_failing_sequence(pytester, call, *args):
    """One test running ``engine_sequence(<call>)`` with an engine of engines_mod that must fail it."""
    factory = call.split(",")[0]
    pytester.makepyfile(test_a=f'''
        from engines_mod import {factory}
        def test_seq(engine_sequence):
            engine_sequence({call})
    ''')
    res = run(pytester, "--tb=long", *args)  # every frame with its source, where pytest would show any
    res.assert_outcomes(failed=1)
    out = res.stdout.str()  # the failure is the engine's: none of the plugin's own source is shown
    assert "def check_record" not in out and "def __call__" not in out and "def call(" not in out, out
    return res


def test_engine_sequence_summary_and_report(pytester):
    pytester.makepyfile(test_a='''
        from engines_mod import good
        def test_seq(engine_sequence):
            recs = engine_sequence(good, 3)
            assert [r["verdict"] for r in recs] == ["held"] * 3
    ''')
    report = pytester.path / "out" / "r.json"
    report.parent.mkdir()
    res = run(pytester, f"--cudagraph-report={report}")
    res.assert_outcomes(passed=1)
    res.stdout.fnmatch_lines(["*cudagraph lifecycle*", "*test_seq*held", "3 engine cycles: 0 fresh, 3 held; 0 failed*"])
    data = json.loads(report.read_text())
    assert data["totals"] == {"tests": 1, "cycles": 3, "fresh": 0, "held": 3, "leaked": 0, "stale": 0, "reused": 0,
                              "error": 0, "failed_cycles": 0, "lifecycle_failures": 0, "not_fresh": 0,
                              "sanitizer_findings": 0, "strict_session_findings": 0,
                              "outcomes": {"passed": 1, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0,
                                           "xpassed": 0}}
    (t,) = data["tests"]
    assert t["outcome"] == "passed" and len(t["cycles"]) == 3 and t["lifecycle_failure"] is False
    assert len({c["pid"] for c in t["cycles"]}) == 1 and data["meta"]["effective_backend"] == "sim"
    from cudagraph_lifecycle.observe import compiled

    assert data["meta"]["capture_path"] == compiled.describe()  # the sanitizer's path: compiled where built
    from importlib import metadata

    meta = data["meta"]  # what ran the engines, and which plugin
    assert (meta["worker"], meta["mpi_ranks"], meta["timeout"]) == ("fork", 2, 300.0), meta
    assert meta["plugin_version"] == metadata.version("pytest-cudagraph")
    # the worker's first capture is marked cold (its process's first use of torch), the later ones not
    assert [c["cold"] for c in t["cycles"]] == [True, False, False]
    res.stdout.fnmatch_lines(["*test_seq *0 *[0-9][*] *held", "[*] the first capture in its worker process*"])


def test_junit_xml_has_the_cycles(pytester):
    pytester.makepyfile(test_a='''
        from engines_mod import good
        def test_seq(engine_sequence):
            engine_sequence(good, 2)
    ''')
    res = run(pytester, "--junitxml=j.xml")
    res.assert_outcomes(passed=1)
    assert 'property name="cudagraph_cycles"' in (pytester.path / "j.xml").read_text()


@pytest.mark.parametrize("where", ["setup", "call", "teardown"])
def test_worker_crash_fails_only_that_test(pytester, where):
    pytester.makepyfile(test_a=f'''
        import os, pytest

        @pytest.fixture
        def crashing(cudagraph_worker):
            if "{where}" == "setup":
                cudagraph_worker.call(os.abort)
            yield cudagraph_worker
            if "{where}" == "teardown":
                cudagraph_worker.call(os.abort)

        def test_crash(crashing):
            if "{where}" == "call":
                crashing.call(os.abort)

        def test_after(cudagraph_worker):
            assert cudagraph_worker.call(os.getpid) != os.getpid()
    ''')
    res = run(pytester)
    outcomes = {"setup": dict(errors=1, passed=1), "call": dict(failed=1, passed=1),
                "teardown": dict(errors=1, passed=2)}[where]
    res.assert_outcomes(**outcomes)
    res.stdout.fnmatch_lines(["*WorkerCrashed*killed by signal SIGABRT*"])


def test_crash_inside_engine_sequence_is_reported(pytester):
    report = pytester.path / "r.json"
    res = run_failing_sequence(pytester, "crash_in_capture, 2", f"--cudagraph-report={report}")
    res.stdout.fnmatch_lines(["*EngineCycleError: engine 0 of the sequence failed*SIGABRT*", "*error FAILED*",
                              "*WorkerCrashed*"])
    (problem,) = json.loads(report.read_text())["tests"][0]["cycles"][0]["problems"]
    assert set(problem) == {"kind", "message", "bytes", "stacks", "pins", "sites"}, problem  # as a cycle's
    # where the worker crashed, from its faulthandler dump: the engine's line for a gate, the frames as a stack
    meta = json.loads(report.read_text())["meta"]
    assert meta["report_format"] == 2 and meta["rootdir"] == str(pytester.path), meta
    assert os.path.relpath(problem["sites"][0].split(":")[0], meta["rootdir"]) == "engines_mod.py", problem
    line = ENGINES.strip().splitlines().index("    e.capture = lambda: os.abort()") + 1
    assert [s.rsplit("/", 1)[-1] for s in problem["sites"]] == [f"engines_mod.py:{line} in <lambda>"], problem
    assert f"engines_mod.py:{line} in <lambda>" in problem["stacks"][0], problem
    # the table's row names the child that crashed (gone by then), as the message does
    pid = res.stdout.str().split("(pid ", 1)[1].split(")", 1)[0]
    assert any(line.split()[2:3] == [pid] and "error FAILED" in line for line in res.stdout.lines), res.stdout.str()


def test_a_crash_points_at_the_users_innermost_frame_not_the_standard_librarys():
    import ctypes

    from pytest_cudagraph.sequence import _user_sites

    frames = [f"{ctypes.__file__}:519 in string_at", "/srv/engine/model.py:54 in forward",
              "/srv/engine/runner.py:9 in capture"]
    assert _user_sites(frames) == ["/srv/engine/model.py:54 in forward"]
    assert _user_sites(frames[:1]) == frames[:1]  # none is the user's: the innermost
    assert _user_sites([]) == []


def test_timeout(pytester):
    pytester.makepyfile(test_a='''
        import time
        def test_slow(cudagraph_worker):
            cudagraph_worker.call(time.sleep, 60)
    ''')
    res = run(pytester, "--cudagraph-timeout=1")
    res.assert_outcomes(failed=1)
    # (on a loaded machine the second may run out while the worker still imports: the report then says so)
    res.stdout.fnmatch_lines(["*WorkerTimeout*past the timeout of 1s (--cudagraph-timeout=1) in *call 1 (sleep)*"])


def test_leaky_engine_is_leaked_when_the_caller_copies(pytester):
    res = run_failing_sequence(pytester, "leaky, 2, output='drop'")
    res.stdout.fnmatch_lines(["*EngineCycleError: engine 0 failed: leaked (pool verdict leaked*", "*no output the caller holds pins*",
                              "*test_seq*2.0M*leaked FAILED"])


def test_a_sequences_error_names_every_engine_that_failed(pytester):
    """Held outputs are judged a cycle late, so by the end several engines may have failed: the error shows
    the first in full and names the others."""
    res = run_failing_sequence(pytester, "leaky, 3")
    res.stdout.fnmatch_lines(["*EngineCycleError: engine 0 failed: leaked (pool verdict leaked*",
                              "*also failed: engine 1 (leaked), engine 2 (leaked) (the lifecycle table and the report "
                              "have each one's problems)"])


def test_the_headline_names_the_failing_problem_before_the_pools_verdict():
    """A replay that differs from eager fails a cycle whose pools are fresh: the first line says
    replay_mismatch, and that problem is listed before the ones that did not fail the cycle."""
    from pytest_cudagraph import EngineCycleError
    from pytest_cudagraph.assertions import check_record

    rec = {"index": 0, "pid": 1, "verdict": "fresh", "failed": True, "strict": False, "pool_ids": [[0, [0, 1]]],
           "problems": [{"kind": "reused", "message": "captured into a released id"},
                        {"kind": "replay_mismatch", "message": "replay differs from eager by 0.5"}]}
    with pytest.raises(EngineCycleError) as e:
        check_record(rec)
    head, first, second = str(e.value).splitlines()[:3]
    assert head.startswith("engine 0 failed: replay_mismatch (pool verdict fresh;"), head
    assert first.startswith("- replay_mismatch:") and second.startswith("- reused:")
    with pytest.raises(EngineCycleError, match=r"^engine 0 failed: reused, replay_mismatch \(pool verdict fresh"):
        check_record({**rec, "strict": True})  # strict fails reuse too: both named, in order


LATE_AND_NOW = """
CACHE = {}


class Engine:
    def __init__(self, be):
        self.be, self.w = be, be.randn(8)
        self.index = len(CACHE.setdefault("n", []))
        CACHE["n"].append(1)

    def capture(self):
        be = self.be
        self.g = be.new_graph()
        with be.stream(be.capture_stream(0)):
            self.g.capture_begin(pool=be.graph_pool_handle())
            self.y = self.w * 2
            self.g.capture_end()

    def run(self, x):
        if self.index == 1:
            raise ValueError("engine 1 breaks")
        self.g.replay()
        CACHE["last"] = self.y  # the very tensor the caller holds: held now, leaked once the caller drops it
        return self.y

    def release(self):
        self.g.reset()
        self.g = self.y = None

    def example_input(self):
        return self.w


def test_two_failures(engine_sequence):
    engine_sequence(Engine, 2)
"""


def test_a_late_verdict_that_comes_with_a_failing_engine_is_named_first(pytester):
    """Engine 0's held output is judged while engine 1 runs, and engine 1 fails too: both are named, the
    first failure in full."""
    pytester.makepyfile(test_a=LATE_AND_NOW)
    res = run(pytester, "--cudagraph-backend=sim")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*EngineCycleError: engine 0 failed: leaked (pool verdict leaked*", "*global `CACHE` of module test_a*",
                              "*also failed: engine 1 (error)*"])


def test_the_report_says_what_a_gate_needs_per_test_and_per_problem(pytester):
    """Which test failed for lifecycle reasons, why a test was skipped, and the user's lines each problem is
    about (to annotate them), not only inside its message."""
    pytester.makepyfile(test_a='''
        import pytest
        from engines_mod import leaky

        def test_leaks(engine_sequence):
            engine_sequence(leaky, 1, output="drop")

        @pytest.mark.skip(reason="no checkpoint on this runner")
        def test_skipped():
            pass
    ''')
    report = pytester.path / "r.json"
    res = run(pytester, f"--cudagraph-report={report}")
    res.assert_outcomes(failed=1, skipped=1)
    data = json.loads(report.read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in data["tests"]}
    assert tests["test_leaks"]["lifecycle_failure"] is True and tests["test_skipped"]["lifecycle_failure"] is False
    assert tests["test_skipped"]["reason"] == "no checkpoint on this runner", tests["test_skipped"]
    assert data["totals"]["outcomes"]["failed"] == 1 and data["totals"]["outcomes"]["skipped"] == 1
    (leaked,) = [p for p in tests["test_leaks"]["cycles"][0]["problems"] if p["kind"] == "leaked"]
    assert leaked["sites"] and all(":" in s and " in " in s for s in leaked["sites"]), leaked
    assert leaked["sites"][0].split(" in ")[0].rsplit(":", 1)[0].endswith(".py"), leaked["sites"]


def test_factory_error_and_bad_n(pytester):
    pytester.makepyfile(test_a='''
        import pytest
        from cudagraph_lifecycle import ConfigError
        from engines_mod import factory_raises, good
        def test_raises(engine_sequence):
            engine_sequence(factory_raises, 1)
        @pytest.mark.parametrize("n", [0, -1, 1.5])
        def test_bad_n(engine_sequence, n):
            with pytest.raises(ConfigError, match="n >= 1"):
                engine_sequence(good, n)
    ''')
    res = run(pytester)
    res.assert_outcomes(failed=1, passed=3)
    res.stdout.fnmatch_lines(["*no weights found at /nowhere*"])


def test_spawn_start_method(pytester):
    pytester.makepyfile(test_a='''
        import sys
        from engines_mod import good
        def test_seq(engine_sequence):
            assert engine_sequence.worker.start_method == "spawn"
            assert not any(r["failed"] for r in engine_sequence(good, 2))
    ''')
    res = run(pytester, "--cudagraph-start-method=spawn")
    res.assert_outcomes(passed=1)
    res.stdout.fnmatch_lines(["*workers start by spawn*"])
    # which copy of the plugin runs (a system-wide pytest may load another checkout's install)
    import pytest_cudagraph

    res.stdout.fnmatch_lines([f"cudagraph: plugin from {os.path.dirname(os.path.abspath(pytest_cudagraph.__file__))}"])


def test_unpicklable_closure_under_spawn(pytester):
    pytester.makepyfile(test_a='''
        import threading
        def test_closure(cudagraph_worker):
            lock = threading.Lock()
            cudagraph_worker.call(lambda: lock.locked())
    ''')
    res = run(pytester, "--cudagraph-start-method=spawn")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*UnpicklableCallableError*module-level function*"])


def test_require_gpu_without_gpu_stops_the_session(pytester):
    pytester.makepyfile(test_a="def test_x(): pass")
    res = run(pytester, "--cudagraph-require-gpu")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--cudagraph-require-gpu: no usable GPU*"])


def test_gpu_marker_skips_without_gpu(pytester):
    pytester.makepyfile(test_a='''
        import pytest
        @pytest.mark.gpu
        def test_needs_gpu(): pass
    ''')
    run(pytester).assert_outcomes(skipped=1)


def test_an_engines_marker_on_a_test_without_engine_sequence_is_warned(pytester):
    """Only engine_sequence reads cudagraph_engines: written on a test without it, it does nothing, and the
    user is told where (a module's marker, which covers tests of every kind, is not warned)."""
    pytester.makepyfile(test_a='''
        import pytest
        pytestmark = pytest.mark.cudagraph_engines(2)

        @pytest.mark.cudagraph_engines(3, scope="module")
        def test_worker_only(cudagraph_worker): pass

        @pytest.mark.cudagraph_engines(3)
        def test_sequence(engine_sequence): pass

        def test_plain(): pass

        @pytest.mark.cudagraph_engines(2)
        @pytest.mark.cudagraph_engines(5)
        def test_twice(engine_sequence): pass
    ''')
    res = run(pytester, "-W", "always::pytest.PytestWarning")
    res.assert_outcomes(passed=4, warnings=2)
    res.stdout.fnmatch_lines(["*cudagraph_engines is written 2 times on test_twice: only cudagraph_engines(5), the "
                              "one nearest the function, is read (cudagraph_engines(2) ignored); keep one*"])
    res.stdout.fnmatch_lines(["*test_a.py:*: PytestWarning: cudagraph_engines(3, scope='module') on "
                              "test_worker_only does nothing: only the engine_sequence fixture reads it*"])


@pytest.mark.parametrize(
    "args, env, message",
    [(["--cudagraph-backend=tpu"], {}, "*--cudagraph-backend='tpu' is not one of*"),
     ([], {"CUDAGRAPH_TIMEOUT": "soon"}, "*CUDAGRAPH_TIMEOUT='soon' is not a number*"),
     (["--cudagraph-report=/proc/cudagraph/dir/r.json"], {}, "*folder /proc/cudagraph/dir cannot be created*"),
     (["--cudagraph-start-method=thread"], {}, "*is not one of*"),
     (["--cudagraph-mpi-ranks=0"], {}, "*--cudagraph-mpi-ranks='0' is below 1*"),
     ([], {"CUDAGRAPH_TIMEOUT": "-3"}, "*CUDAGRAPH_TIMEOUT='-3' is below 0 (0 means no limit)*"),
     (["--cudagraph-worker=threads"], {}, "*--cudagraph-worker='threads' is not one of: fork, mpi*")],
)
def test_bad_options(pytester, monkeypatch, args, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pytester.makepyfile(test_a="def test_x(): pass")
    res = run(pytester, *args)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines([message])


def test_precedence_cli_over_env_over_ini(pytester, monkeypatch):
    pytester.makeini("[pytest]\ncudagraph_timeout = 11\n")
    pytester.makepyfile(test_a="def test_x(cudagraph_backend_name): pass")
    run(pytester).stdout.fnmatch_lines(["*timeout=11s*"])
    monkeypatch.setenv("CUDAGRAPH_TIMEOUT", "22")
    run(pytester).stdout.fnmatch_lines(["*timeout=22s*"])
    run(pytester, "--cudagraph-timeout=33").stdout.fnmatch_lines(["*timeout=33s*"])


def test_a_flag_switches_off_what_a_variable_switched_on(pytester, monkeypatch):
    """command line > environment holds for the on/off options too: --no-cudagraph-require-gpu."""
    monkeypatch.setenv("CUDAGRAPH_REQUIRE_GPU", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU here either way
    pytester.makepyfile(test_a="def test_x(cudagraph_backend_name): pass")
    assert run(pytester).ret == pytest.ExitCode.USAGE_ERROR  # the variable asks for a GPU: none
    run(pytester, "--no-cudagraph-require-gpu").assert_outcomes(passed=1)


def test_disable_and_explicit_load(pytester, monkeypatch):
    pytester.makepyfile(test_a="def test_x(engine_sequence): pass")
    pytester.makepyfile(engines_mod=ENGINES)
    res = pytester.runpytest_subprocess("-p", "no:cudagraph")
    res.stdout.fnmatch_lines(["*fixture 'engine_sequence' not found*"])
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.runpytest_subprocess("-p", "cudagraph").assert_outcomes(passed=1)


def test_xdist_two_workers(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_a='''
        import pytest
        from engines_mod import good
        @pytest.mark.parametrize("i", range(4))
        def test_seq(engine_sequence, i):
            assert not any(r["failed"] for r in engine_sequence(good, 2))
    ''')
    report = pytester.path / "r.json"
    res = run(pytester, "-n", "2", f"--cudagraph-report={report}")
    res.assert_outcomes(passed=4)
    # the controller collects nothing: it prints its workers' header lines, once each (they agree)
    import pytest_cudagraph

    res.stdout.fnmatch_lines(["cudagraph: backend=auto (effective sim), gpus=0, workers start by *, "
                              "engines held by reused workers (worker=fork)",
                              f"cudagraph: plugin from {os.path.dirname(os.path.abspath(pytest_cudagraph.__file__))}"])
    assert sum(line.startswith("cudagraph:") for line in res.stdout.lines) == 2, res.stdout.str()
    res.stdout.fnmatch_lines(["8 engine cycles: 0 fresh, 8 held; 0 failed*; backend sim"])
    data = json.loads(report.read_text())
    assert data["totals"]["cycles"] == 8
    assert (data["meta"]["effective_backend"], data["meta"]["gpus"]) == ("sim", 0)  # the controller ran no test
    from cudagraph_lifecycle.observe import compiled

    assert data["meta"]["capture_path"] == compiled.describe()  # the workers said it: the controller imports nothing
    assert data["meta"]["rootdir"] == str(pytester.path)


def test_a_crashed_xdist_worker_is_replaced_and_the_session_runs_on(pytester):
    """xdist names the replacement gw2 with -n 2: the plugin gives it a device slot too, so the other tests run
    and the crash is one failure (the backend left at auto, where the plugin pins devices)."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_a="""
        import os
        import pytest
        def test_dies():
            os._exit(7)
        @pytest.mark.parametrize("i", range(12))
        def test_plain(i):
            pass
    """)
    report = pytester.path / "r.json"
    res = run(pytester, "-n", "2", f"--cudagraph-report={report}")
    assert "INTERNALERROR" not in res.stdout.str() + res.stderr.str()
    res.assert_outcomes(passed=12, failed=1)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    data = json.loads(report.read_text())
    assert len(data["tests"]) == 13 and data["totals"]["outcomes"]["failed"] == 1  # as the terminal counts it
    dies = next(t for t in data["tests"] if t["nodeid"].endswith("test_dies"))
    assert (dies["outcome"], dies["failed_phases"]) == ("failed", ["crash"]), dies
    assert "crashed while running" in dies["crash"], dies
    assert all(t["sanitizer"] == [] for t in data["tests"])  # the key is always there


def test_no_worker_left_after_session(pytester):
    pytester.makepyfile(test_a='''
        import os
        def test_pid(cudagraph_session_worker, tmp_path_factory):
            pid = cudagraph_session_worker.call(os.getpid)
            open(os.environ["PIDFILE"], "w").write(str(pid))
    ''')
    pidfile = pytester.path / "pid"
    os.environ["PIDFILE"] = str(pidfile)
    try:
        run(pytester).assert_outcomes(passed=1)
    finally:
        del os.environ["PIDFILE"]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)


def test_report_timeline_png(pytester):
    pytest.importorskip("matplotlib")
    pytester.makepyfile(test_a='''
        from engines_mod import good
        def test_seq(engine_sequence):
            engine_sequence(good, 3)
    ''')
    report = pytester.path / "r.json"
    run(pytester, f"--cudagraph-report={report}").assert_outcomes(passed=1)
    png = json.loads(report.read_text())["meta"]["timeline_png"]
    assert png.endswith("r.png") and os.path.getsize(png) > 1000


def test_sanitizer_findings_in_report_and_strict(pytester):
    pytester.makepyfile(test_a='''
        import pytest, torch
        from cudagraph_lifecycle import get_backend
        @pytest.mark.cudagraph
        def test_leaves_a_graph():
            be = get_backend("sim")
            g = be.new_graph()
            x = torch.ones(4)
            with be.stream(be.new_stream(0)):
                g.capture_begin(pool=be.graph_pool_handle())
                y = x * 2
                g.capture_end()
            test_leaves_a_graph.keep = (g, y)
    ''')
    report = pytester.path / "r.json"
    res = run(pytester, f"--cudagraph-report={report}")
    res.assert_outcomes(passed=1)
    (t,) = json.loads(report.read_text())["tests"]
    assert t["sanitizer"][0]["kind"] == "unreleased_graph"
    res.stdout.fnmatch_lines(["*= cudagraph sanitizer =*",
                              "test_a.py::test_leaves_a_graph: unreleased_graph: pool (*) on device 0*",
                              "*at *test_a.py:9 in test_leaves_a_graph was never reset: it is held as an item of "
                              "a tuple (attribute `keep` of function test_leaves_a_graph (test_a))",
                              "1 sanitizer finding(s)"])
    assert "    captured at " not in res.stdout.str()  # the message names the line: not twice
    res = run(pytester, "--cudagraph-sanitize=strict")
    res.assert_outcomes(passed=1, errors=1)
    # the test's error shows the finding whole, the section in one line: the message is printed once
    res.stdout.fnmatch_lines(["*pool sanitizer findings:", "- unreleased_graph: pool (*) on device 0*",
                              "*test_a.py:9 in test_leaves_a_graph was never reset*",
                              "*= cudagraph sanitizer =*",
                              "test_a.py::test_leaves_a_graph: unreleased_graph: pool (*) on device 0*",
                              "    failed the test: its error above shows the whole finding", "1 sanitizer finding(s)"])
    assert res.stdout.str().count("was never reset") == 1


def test_forked_incompatibility_rule():
    from pytest_cudagraph.plugin import forked_incompatibility

    assert forked_incompatibility("9.2.0", True).startswith("--forked (pytest-forked) does not work with pytest 9.2.0")
    assert forked_incompatibility("10.0.1", True)
    assert forked_incompatibility("9.1.3", True) is None
    assert forked_incompatibility("8.4.2", True) is None
    assert forked_incompatibility("9.2.0", False) is None


def test_forked_where_it_works(pytester):
    pytest.importorskip("pytest_forked")
    if tuple(int(p) for p in pytest.__version__.split(".")[:2]) >= (9, 2):
        pytest.skip("pytest-forked cannot run on pytest >= 9.2")
    pytester.makepyfile(test_a='''
        from engines_mod import good
        def test_seq(engine_sequence):
            assert not any(r["failed"] for r in engine_sequence(good, 2))
    ''')
    run(pytester, "--forked").assert_outcomes(passed=1)


def test_engine_that_never_releases(pytester):
    pytester.makepyfile(test_a='''
        from engines_mod import never_releases
        def test_seq(engine_sequence):
            recs = engine_sequence(never_releases, 2)
            assert [p["kind"] for p in recs[0]["problems"]] == ["release_incomplete"]
    ''')
    run(pytester).assert_outcomes(passed=1)  # the graphs went when the engine object did: noted, not failed
    res = run(pytester, "--cudagraph-sanitize=strict")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*release_incomplete: release() left 3 graph(s) captured (at *test_*.py:* in *): "
                              "reset them in release()*"])


def test_default_pool_growth_is_what_an_engine_leaves_in_the_table_units(pytester):
    pytester.makepyfile(growth_engines='''
        import torch
        from cudagraph_lifecycle import CUDAGraphRunner
        CACHE = []

        class Engine:
            def __init__(self, backend):
                self.be = backend
                self.runner = CUDAGraphRunner(lambda x: x * 2, [1, 2], (8,), backend=backend)
            def run(self, x): return self.runner.run(x)
            def release(self):
                self.runner.release()
                if CACHE:
                    CACHE.clear()  # drops what the engine before it left behind
                else:
                    CACHE.append(self.be.empty(1 << 20))  # 4 MiB left in the default pool

        def make(backend): return Engine(backend)
    ''', test_g='''
        from growth_engines import make
        def test_seq(engine_sequence):
            first, second = engine_sequence(make, 2, output="drop")
            assert first["growth_bytes"] >= 4 << 20 and first["freed_earlier_bytes"] == 0
            assert second["growth_bytes"] == 0 and second["freed_earlier_bytes"] >= 4 << 20
    ''')
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim")
    res.assert_outcomes(passed=1)
    out = res.stdout.str()
    assert "-4194304B" not in out and "B fresh" not in out
    # the first row's growth in MiB like the other columns (20 MiB: the segment the 4 MiB block took)
    res.stdout.fnmatch_lines(["*test_g.py::test_seq * 0 * 20.0M fresh", "*test_g.py::test_seq * 1 * 0 fresh",
                              "*default pool: 20.0M held from before this engine went during it*"])


def test_a_long_test_id_in_the_lifecycle_table_keeps_its_files_name():
    from pytest_cudagraph.terminal import short_id

    cut = short_id("examples/test_lifecycle.py::test_naive_engine_fails_on_its_second_instance", 44)
    assert len(cut) == 44 and cut.startswith("test_lifecycle.py::…") and cut.endswith("its_second_instance")
    assert short_id("t.py::test_x", 44) == "t.py::test_x"
    cut = short_id("examples/test_mpi_lifecycle.py::test_each_rank_gets_a_fresh_pool_per_engine", 44)
    assert cut.startswith("test_mpi_lifecycle.py::…") and cut.endswith("_pool_per_engine"), cut
    # a long file name with a short test: the file's name is cut, the test's is not (no ellipsis before it)
    assert short_id("a/test_an_extremely_long_module_name_for_testing.py::test_x", 44) == \
        "test_an_extremely_long_module_name_…::test_x"
    assert short_id("a/b.py::test_x", 44) == "a/b.py::test_x"
    cut = short_id("no_separator_path_that_is_long_enough_to_be_cut_here_x", 44)
    assert len(cut) == 44 and cut.startswith("…") and cut.endswith("cut_here_x") and cut.count("…") == 1


def test_tests_whose_cut_names_read_alike_are_numbered_with_a_legend():
    from pytest_cudagraph.terminal import table_names

    tail = "_builds_three_engines_and_checks_every_pool"
    ids = [f"pkg_a/test_engines.py::test_x{tail}", f"pkg_b/test_engines.py::test_x{tail}",
           "t.py::test_short", f"pkg_a/test_engines.py::test_x{tail}"]
    names, legend = table_names(ids, 44)
    a, b = names[ids[0]], names[ids[1]]
    assert a != b and a.endswith(" [1]") and b.endswith(" [2]") and len(a) <= 44, names
    assert names["t.py::test_short"] == "t.py::test_short"
    assert legend == [f"[1] {ids[0]}", f"[2] {ids[1]}"]
    assert table_names(ids[2:3], 44) == ({"t.py::test_short": "t.py::test_short"}, [])

    from pytest_cudagraph.terminal import lifecycle_section

    class Terminal:
        lines: list = []

        def section(self, title):
            self.lines.append(f"== {title}")

        def write_line(self, line):
            self.lines.append(line)

    cycle = {"index": 0, "pid": 1, "verdict": "fresh", "pool_ids": [], "graphs": 1}
    state = {"tests": {n: {"nodeid": n, "outcome": "passed", "cycles": [dict(cycle)]} for n in ids[:2]}}
    tr = Terminal()
    lifecycle_section(tr, state, "sim")
    text = "\n".join(tr.lines)
    assert f"tests whose cut ids read alike: [1] {ids[0]}" in text and f"[2] {ids[1]}" in text, text
    assert a in text and b in text, text
    assert "@" not in text, text  # one device (here none): ids alone

    one = dict(cycle, pool_ids=[[0, [1, 3]], [1, [1, 3]]])  # tensor parallel in one process: the same id twice
    tr = Terminal()
    tr.lines = []
    lifecycle_section(tr, {"tests": {"t.py::test_tp": {"nodeid": "t.py::test_tp", "outcome": "passed", "cycles": [one]}}}, "cuda")
    text = "\n".join(tr.lines)
    assert "1:3@0,1:3@1" in text and "after @, the device" in text, text


def test_the_report_keeps_a_failed_call_whose_teardown_errors_too(pytester):
    pytester.makepyfile(test_a='''
        import pytest

        @pytest.fixture
        def breaks_at_teardown():
            yield
            raise RuntimeError("teardown broke")

        def test_x(breaks_at_teardown):
            assert False
    ''')
    report = pytester.path / "r.json"
    res = run(pytester, f"--cudagraph-report={report}")
    res.assert_outcomes(failed=1, errors=1)
    (t,) = json.loads(report.read_text())["tests"]
    assert t["outcome"] == "failed" and t["failed_phases"] == ["call", "teardown"], t


def test_an_engine_that_captures_no_graph_is_warned_as_checking_nothing(pytester):
    """run(x) and release() alone make a valid engine that captures nothing: fresh, and said to check nothing."""
    pytester.makepyfile(test_a='''
        import torch
        from engines_mod import good

        class Eager:
            def run(self, x): return x * 2
            def release(self): pass
            def example_input(self): return torch.ones(3)

        def make_eager(backend): return Eager()

        def test_eager(engine_sequence):
            assert [r["verdict"] for r in engine_sequence(make_eager, 2)] == ["fresh", "fresh"]

        def test_graphed(engine_sequence):
            engine_sequence(good, 2)
    ''')
    res = run(pytester, "-W", "always::pytest.PytestWarning")
    res.assert_outcomes(passed=2, warnings=1)
    res.stdout.fnmatch_lines(["*test_eager*", "*engine_sequence(make_eager): engines 0, 1 captured no CUDA graph, so "
                              "its fresh verdict says nothing about graph pools*"])


def test_a_misspelled_variable_is_warned_with_the_name_that_is_read(pytester, monkeypatch):
    monkeypatch.setenv("CUDAGRAPH_SANITISE", "1")
    monkeypatch.setenv("CUDAGRAPH_WORKER", "mpi")
    pytester.makepyfile(test_a="def test_x(): pass")
    res = run(pytester, "-W", "always::pytest.PytestConfigWarning")
    res.assert_outcomes(passed=1, warnings=2)
    # both near names, each with what it sets: the plugin's mode is not the program-wide sanitizer
    res.stdout.fnmatch_lines(["*CUDAGRAPH_SANITISE is set but nothing of pytest-cudagraph reads it: did you mean "
                              "CUDAGRAPH_SANITIZE (the program-wide sanitizer) or CUDAGRAPH_SANITIZE_MODE "
                              "(--cudagraph-sanitize)?*",
                              "*CUDAGRAPH_WORKER is set but nothing of pytest-cudagraph reads it: did you mean "
                              "CUDAGRAPH_WORKER_KIND (--cudagraph-worker)?*"], consecutive=False)


@pytest.mark.parametrize("ini_name, text, where", [
    ("pytest.ini", "[pytest]\ncudagraph_sanitise = strict\ncudagraph_wroker = mpi\n", "[pytest] section of pytest.ini"),
    ("pyproject.toml", '[tool.pytest.ini_options]\ncudagraph_sanitise = "strict"\ncudagraph_wroker = "mpi"\n',
     "[tool.pytest.ini_options] section of pyproject.toml"),
])
def test_a_misspelled_ini_key_is_warned_with_the_key_that_is_read(pytester, ini_name, text, where):
    (pytester.path / ini_name).write_text(text)
    pytester.makepyfile(test_a="def test_x(): pass")
    res = run(pytester, "-W", "always::pytest.PytestConfigWarning")
    res.assert_outcomes(passed=1)
    out = res.stdout.str()
    assert (f"ini key cudagraph_sanitise in the {where} is not one pytest-cudagraph reads: did you mean "
            "cudagraph_sanitize (--cudagraph-sanitize)?\n") in out, out
    assert (f"ini key cudagraph_wroker in the {where} is not one pytest-cudagraph reads: did you mean "
            "cudagraph_worker (--cudagraph-worker)?\n") in out, out


def test_strict_with_expandable_teardown_report_is_warned_and_reported_as_applied(pytester):
    """strict always refuses the teardown: a warning names both settings, and the report says what the
    workers do (and what was set)."""
    pytester.makeini("[pytest]\ncudagraph_sanitize = strict\ncudagraph_expandable_teardown = report\n")
    pytester.makepyfile(test_a="def test_x(): pass")
    report = pytester.path / "r.json"
    res = run(pytester, f"--cudagraph-report={report}", "-W", "always::pytest.PytestConfigWarning")
    res.assert_outcomes(passed=1, warnings=1)
    res.stdout.fnmatch_lines(["*PytestConfigWarning: ini key cudagraph_expandable_teardown=report is overridden by "
                              "ini key cudagraph_sanitize=strict: strict always refuses*; drop one of them"])
    meta = json.loads(report.read_text())["meta"]
    assert (meta["expandable_teardown"], meta["expandable_teardown_set"]) == ("refuse", "report"), meta
    res = run(pytester, f"--cudagraph-report={report}", "--cudagraph-sanitize=on",
              "-W", "always::pytest.PytestConfigWarning")
    res.assert_outcomes(passed=1)  # no warning: report is what on does
    assert json.loads(report.read_text())["meta"]["expandable_teardown"] == "report"


def test_the_failures_line_tells_failed_tests_from_a_session_strict_findings_failed():
    from pytest_cudagraph.report import lifecycle_line

    # a program-wide strict sanitizer failed a session whose tests all passed: lifecycle_failures counts it as 1
    t = {"lifecycle_failures": 1, "strict_session_findings": 2}
    assert lifecycle_line(t) == ("0 test(s) failed for lifecycle reasons, and the session failed on 2 strict "
                                 "sanitizer finding(s)")
    assert lifecycle_line({"lifecycle_failures": 3, "strict_session_findings": 1}).startswith(
        "2 test(s) failed for lifecycle reasons, and the session failed on 1 strict")
    assert lifecycle_line({"lifecycle_failures": 0, "strict_session_findings": 0}) == \
        "0 test(s) failed for lifecycle reasons"


def _gate_script() -> str:
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [b for b in re.findall(r"^```bash\n(.*?)^```$", readme, re.M | re.S) if "lifecycle_failures" in b]
    return block


@pytest.mark.parametrize("pytest_exit, lifecycle_failures, job_fails, words", [
    (0, 0, False, None),
    (1, 1, True, "1 lifecycle failure(s): see reports/cudagraph.json"),  # read after pytest failed too
    (1, 0, True, None),  # a failure of another kind still fails the job
    (0, 2, True, "2 lifecycle failure(s)"),
    (4, None, True, None),  # a usage error writes no report: the job exits 4, as pytest did
], ids=["green", "lifecycle", "other failure", "report only", "usage error"])
def test_the_readmes_ci_gate_reads_the_report_whatever_pytest_returned(tmp_path, pytest_exit, lifecycle_failures,
                                                                        job_fails, words):
    """The gate's report check runs also where pytest failed (under ``set -e`` it never ran)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # `python3 -m pytest` stands for the session: writes the report, exits as told
    report = "" if lifecycle_failures is None else \
        ("mkdir -p reports && "  # as the plugin makes the report's folder
         f"echo '{{\"totals\": {{\"lifecycle_failures\": {lifecycle_failures}}}}}' > reports/cudagraph.json")
    fake.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m pytest" ]; then
  {report}
  exit {pytest_exit}
fi
exec {shlex.quote(sys.executable)} "$@"
""")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run(["bash", "-e", "-c", _gate_script()], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert (p.returncode != 0) == job_fails, p.stdout + p.stderr
    assert p.returncode in (0, pytest_exit or 1), p.returncode  # pytest's own code where it failed
    if words:
        assert words in p.stderr, p.stderr
