"""MPI ranks (mpi4py.futures) through pytester: sequences per rank, a crash and a hang on a rank, skips; how
a dead rank is recognized. One row per fault on a rank is in tests/test_faults_mpi.py."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pytest_cudagraph.mpi import mpi_unavailable_reason, rank_dead

needs_mpi = pytest.mark.skipif(mpi_unavailable_reason() is not None, reason=str(mpi_unavailable_reason()))

ENGINES = '''
import os, time, torch
from cudagraph_lifecycle import CUDAGraphRunner

class Engine:
    def __init__(self, backend):
        self.runner = CUDAGraphRunner(lambda x: torch.relu(x * 2), [1, 2, 4], (8,), backend=backend)
    def capture(self): self.runner.capture()
    def run(self, x): return self.runner.run(x)
    def eager(self, x): return torch.relu(x * 2)
    def example_input(self): return torch.randn(3, 8)
    def release(self): self.runner.release()

def good(backend): return Engine(backend)

def rank():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()

def crash_on_rank1(backend):
    if rank() == 1:
        os.abort()
    return Engine(backend)

def hang_on_rank0(backend):
    if rank() == 0:
        time.sleep(120)
    return Engine(backend)
'''


def run(pytester, *args):
    pytester.makepyfile(engines_mod=ENGINES)
    return pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", *args)


@needs_mpi
def test_mpi_worker_option_runs_sequences_on_every_rank(pytester):
    pytester.makepyfile(test_a='''
        from engines_mod import good
        def test_seq(engine_sequence):
            recs = engine_sequence(good, 2)
            assert sorted((r["index"], r["rank"]) for r in recs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ''')
    report = pytester.path / "r.json"
    res = run(pytester, "--cudagraph-worker=mpi", "--cudagraph-mpi-ranks=2", f"--cudagraph-report={report}")
    res.assert_outcomes(passed=1)
    res.stdout.fnmatch_lines(["*engines held by MPI ranks (worker=mpi, 2 ranks)*", "*/r1*held"])
    cycles = json.loads(report.read_text())["tests"][0]["cycles"]
    assert {c["rank"] for c in cycles} == {0, 1}


@needs_mpi
def test_mpi_module_ranks_are_reused_across_tests(pytester):
    pytester.makepyfile(test_a='''
        import os
        def test_one(cudagraph_mpi_ranks):
            test_one.pids = sorted(p for _, p, _ in cudagraph_mpi_ranks.call_all(os.getpid))
        def test_two(cudagraph_mpi_ranks):
            assert sorted(p for _, p, _ in cudagraph_mpi_ranks.call_all(os.getpid)) == test_one.pids
    ''')
    run(pytester).assert_outcomes(passed=2)


@needs_mpi
def test_what_each_ranks_sanitizer_found_is_reported_with_its_rank(pytester):
    pytester.makepyfile(test_r='''
        import torch
        from cudagraph_lifecycle import get_backend

        KEPT = []

        def pin_a_pool():
            be = get_backend("sim")
            g = be.new_graph()
            with be.stream(be.new_stream(0)):
                g.capture_begin(pool=be.graph_pool_handle())
                KEPT.append(torch.ones(64) * 2)
                g.capture_end()
            g.reset()
            be.empty_cache()

        def test_pins_on_every_rank(cudagraph_mpi_ranks):
            cudagraph_mpi_ranks.call_all(pin_a_pool)

        def test_pins_then_the_ranks_are_poisoned(cudagraph_mpi_ranks):
            import os
            before = cudagraph_mpi_ranks.call_all(os.getpid)
            cudagraph_mpi_ranks.call_all(pin_a_pool)
            cudagraph_mpi_ranks.restart_before_next_call()  # as after the allocator's assert
            assert cudagraph_mpi_ranks.call_all(os.getpid) != before  # new ranks; the old ones were asked first
    ''')
    report = pytester.path / "r.json"
    run(pytester, "--cudagraph-backend=sim", f"--cudagraph-report={report}").assert_outcomes(passed=2)
    found = json.loads(report.read_text())["sanitizer"]
    by_test = {}
    for f in found:
        assert f["kind"] == "pinned_pool" and f["sites"][0].endswith("in pin_a_pool"), f
        by_test.setdefault(f["tests"][0].split("::")[1], []).append(f["rank"])
    assert {t: sorted(r) for t, r in by_test.items()} == {
        "test_pins_on_every_rank": [0, 1], "test_pins_then_the_ranks_are_poisoned": [0, 1]}, found


@needs_mpi
def test_crash_on_a_rank_is_reported_and_ranks_replaced(pytester):
    pytester.makepyfile(test_a='''
        import pytest
        from engines_mod import crash_on_rank1, good
        @pytest.mark.cudagraph_engines(1, ranks=2)
        def test_crash(engine_sequence):
            engine_sequence(crash_on_rank1)
        def test_after(cudagraph_mpi_ranks):
            assert len(cudagraph_mpi_ranks.call_all(len, "ab")) == 2
    ''')
    res = run(pytester, "--cudagraph-timeout=60")
    res.assert_outcomes(failed=1, passed=1)
    res.stdout.fnmatch_lines(["*engine 0 of the sequence failed in the reused worker: worker * exited with code*",
                              "*cudagraph mpi: rank 1 (pid *) died during the call*"])


@needs_mpi
def test_hang_on_a_rank_times_out_and_leaves_no_process(pytester):
    pytester.makepyfile(test_a='''
        import os, pytest
        from engines_mod import hang_on_rank0
        @pytest.mark.cudagraph_engines(1, ranks=2)
        def test_hang(engine_sequence):
            engine_sequence.worker.call_all(os.getpid)
            open(os.environ["PIDFILE"], "w").write(" ".join(str(p) for _, p, _ in engine_sequence.worker.call_all(os.getpid)))
            engine_sequence(hang_on_rank0)
    ''')
    pidfile = pytester.path / "pids"
    os.environ["PIDFILE"] = str(pidfile)
    try:
        res = run(pytester, "--cudagraph-timeout=8")
    finally:
        del os.environ["PIDFILE"]
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*WorkerTimeout*past the timeout of 8s*"])
    for pid in map(int, pidfile.read_text().split()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"), f"rank pid {pid} still runs"
        except FileNotFoundError:
            pass


def test_without_mpi_tests_skip_or_the_session_stops(pytester, monkeypatch):
    # an environment with python but no mpiexec on PATH
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    pytester.makepyfile(test_a='''
        import pytest
        @pytest.mark.mpi
        def test_marked(): pass
        def test_fixture(cudagraph_mpi_ranks): pass
    ''')
    res = run(pytester, "-rs")
    res.assert_outcomes(skipped=2)
    res.stdout.fnmatch_lines(["SKIPPED*needs MPI: *", "SKIPPED*needs MPI: *"])
    res = run(pytester, "--cudagraph-require-mpi")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--cudagraph-require-mpi:*"])


def test_a_rank_is_judged_dead_only_on_its_own_host():
    here = socket.gethostname()
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid is free
    assert rank_dead(here, ended.pid)
    assert not rank_dead("node-7.cluster.example", ended.pid)  # a pid from there means nothing here
    assert not rank_dead("node-7.cluster.example", os.getpid())
    assert not rank_dead(here, os.getpid())


def test_a_zombie_rank_on_this_host_is_dead():
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # not reaped yet: a zombie, which still answers os.kill(pid, 0)
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert rank_dead(socket.gethostname(), child.pid)
    finally:
        child.wait()


@needs_mpi
def test_ranks_whose_random_ops_were_poisoned_are_replaced(pytester):
    """torch's refusal of a capture on the default stream poisons a rank's random ops, whether the call raised
    it or caught it: the next call gets fresh ranks."""
    pytester.makepyfile(test_a='''
        import os

        def caught():
            from cudagraph_lifecycle import get_backend, observe
            from cudagraph_lifecycle.sanitizer import global_sanitizer
            if global_sanitizer() is not None:
                global_sanitizer().stop()  # unjudged: torch's own refusal
            observe.acquire()
            try:
                get_backend("sim").new_graph().capture_begin()
            except RuntimeError:
                pass
            return os.getpid()

        def random():
            from cudagraph_lifecycle import get_backend
            return get_backend("sim").randn(2).numel(), os.getpid()

        def test_ranks(cudagraph_mpi_ranks):
            before = {pid for _, _, pid in cudagraph_mpi_ranks.call_all(caught)}
            after = cudagraph_mpi_ranks.call_all(random)
            assert [v[0] for _, _, v in after] == [2, 2] and not before & {v[1] for _, _, v in after}
    ''')
    run(pytester, "--cudagraph-timeout=60").assert_outcomes(passed=1)
