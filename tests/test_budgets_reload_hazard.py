"""Memory and capture budgets, reloads that leave graphs reading old tensors, and the expandable-segments
teardown hazard: each catches its bug and passes a correct engine (simulated allocator)."""

import budget_cases
import pytest
import torch

from cudagraph_lifecycle import PoolSanitizer, StalePoolError
from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.conformance import Ctx
from cudagraph_lifecycle.errors import ExpandableSegmentsHazardError

ENGINES = '''
import torch
from cudagraph_lifecycle import CUDAGraphRunner

class Engine:
    def __init__(self, backend, checked=True, enabled=True):
        self.lin = torch.nn.Linear(8, 8).to(backend.torch_device(0)).requires_grad_(False)
        self.device = backend.torch_device(0)
        self.runner = CUDAGraphRunner(self.lin, [1, 2, 4], (8,), backend=backend, checked=checked,
                                      names=self.lin, enabled=enabled)
    def run(self, x): return self.runner.run(x)
    def eager(self, x): return self.lin(x)
    def example_input(self): return torch.ones(3, 8, device=self.device)
    def release(self): self.runner.release()

def checked(backend): return Engine(backend)
def unchecked(backend): return Engine(backend, checked=False)
def eager_only(backend): return Engine(backend, enabled=False)

def reload_into_new_memory(engine):
    engine.lin.weight = torch.nn.Parameter(torch.randn(8, 8, device=engine.device), requires_grad=False)

def reload_in_place(engine):
    engine.lin.weight.copy_(torch.randn(8, 8, device=engine.device))
'''


def run(pytester, body, *args):
    pytester.makepyfile(engines_mod=ENGINES)
    pytester.makepyfile(test_a=body)
    return pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", *args)


def test_reloads_that_leave_graphs_on_old_tensors_fail_naming_the_tensor(pytester):
    res = run(pytester, '''
import pytest
from engines_mod import checked, unchecked, reload_into_new_memory, reload_in_place
from pytest_cudagraph import EngineCycleError

def test_named_by_the_checked_runner(engine_sequence):
    with pytest.raises(EngineCycleError, match="captured_address: after reload: weight: captured at 0x"):
        engine_sequence(checked, 1, reload=reload_into_new_memory)

def test_seen_by_eager_without_names(engine_sequence):
    with pytest.raises(EngineCycleError, match="the graphs still read tensors from before the reload"):
        engine_sequence(unchecked, 1, reload=reload_in_place.__globals__["reload_into_new_memory"])

def test_an_in_place_reload_passes(engine_sequence):
    assert not engine_sequence(checked, 2, reload=reload_in_place)[0]["failed"]

def test_a_reload_that_raises_is_named(engine_sequence):
    def broken(engine):
        raise ValueError("no such checkpoint")
    # named with the line that raised it (the traceback travels in the record's stacks)
    with pytest.raises(EngineCycleError, match=r"ValueError during reload at .*test_a.py:[0-9]+ in broken: no such checkpoint"):
        engine_sequence(checked, 1, reload=broken)
''')
    res.assert_outcomes(passed=4)


def test_default_pool_growth_over_the_budget_names_the_setting_and_the_size(pytester, monkeypatch):
    """An engine that leaves a workspace in the default pool: over CUDAGRAPH_MAX_GROWTH it fails, the message
    in units and bytes and naming the variable as set; under a larger budget the same engine passes."""
    pytester.makepyfile(engines_mod=ENGINES + '''
KEPT = []  # a workspace cache that outlives its engine

def leaves_a_workspace(backend):
    KEPT.append(backend.randn(1 << 20))  # 4 MiB: a 20 MiB segment of the default pool
    return Engine(backend)
''')
    pytester.makepyfile(test_a='''
from engines_mod import leaves_a_workspace

def test_growth(engine_sequence):
    engine_sequence(leaves_a_workspace, 1, output="drop")
''')
    monkeypatch.setenv("CUDAGRAPH_MAX_GROWTH", "1MiB")
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*growth_over_budget: the default pool grew by 20 MiB (20971520 bytes) of segments and "
                              "4 MiB (4194304 bytes) of live blocks over this engine, above the budget of 1 MiB "
                              "(1048576 bytes) set by CUDAGRAPH_MAX_GROWTH=1MiB*"])
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        "--cudagraph-max-growth=64MiB")
    res.assert_outcomes(passed=1)


def test_a_steady_leak_into_segments_with_room_is_over_the_growth_budget_every_time(pytester):
    """4 MiB kept per engine: the first fills a new 20 MiB segment, the next ones fit in it (no reserved
    growth), but each engine's live blocks grew by 4 MiB: over a 3 MiB budget every time."""
    pytester.makepyfile(engines_mod=ENGINES + '''
KEPT = []

def leaves_a_workspace(backend):
    KEPT.append(backend.randn(1 << 20))
    return Engine(backend)
''')
    pytester.makepyfile(test_a='''
from engines_mod import leaves_a_workspace

def test_growth(engine_sequence):
    recs = engine_sequence(leaves_a_workspace, 3, output="drop", check=False)
    assert [r["kept_bytes"] for r in recs] == [4 << 20] * 3
    assert [r["growth_bytes"] for r in recs] == [20 << 20, 0, 0]
    assert all(any(p["kind"] == "growth_over_budget" for p in r["problems"]) for r in recs)
''')
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        "--cudagraph-max-growth=3MiB")
    res.assert_outcomes(passed=1)


def test_budgets_of_a_cudagraph_marked_test(pytester):
    budget_cases.check(run(pytester, budget_cases.SIM_CAPTURE + budget_cases.MARKED_TESTS))


@pytest.mark.parametrize("sanitize", ["on", "off"])
def test_budgets_of_an_engine_sequence(pytester, sanitize):
    """The worker measures each engine's pools whatever the sanitizer's mode: the budgets hold under off too."""
    res = run(pytester, '''
import pytest
from engines_mod import checked, eager_only
from pytest_cudagraph import EngineCycleError

@pytest.mark.cudagraph(require_replay=True)
def test_silent_eager_fallback(engine_sequence):
    with pytest.raises(EngineCycleError, match="no graph was captured or replayed: the engine ran eagerly"):
        engine_sequence(eager_only, 1)

@pytest.mark.cudagraph(max_pool_bytes=1 << 20)
def test_pool_over_budget(engine_sequence):
    with pytest.raises(EngineCycleError, match="pool_over_budget"):
        engine_sequence(checked, 1)

@pytest.mark.cudagraph(max_pool_bytes="2MiB", max_captures=3, require_replay=True)
def test_within(engine_sequence):
    (rec,) = engine_sequence(checked, 1)
    assert rec["graphs"] == 3 and rec["replays"] >= 1 and sum(rec["graph_bytes"].values()) == rec["pool_bytes"]
''', f"--cudagraph-sanitize={sanitize}")
    res.assert_outcomes(passed=3)


def _expandable(mode: str | None, teardown: str = "refuse"):
    be = SimBackend(expandable_segments=True)
    c = Ctx(be)
    san = PoolSanitizer(be, mode=mode, expandable_teardown=teardown).start() if mode else None
    g = be.new_graph()
    y = c.step(g, be.graph_pool_handle())
    return be, g, y, san


def test_expandable_teardown_is_refused_by_on_unless_report_and_always_by_strict():
    be, g, y, _ = _expandable(None)
    g.reset()  # the last graph goes while `y` lives; freeing `y` before the flush is the safe order
    del y
    be.empty_cache()
    assert torch.isfinite(be.randn(4)).all() and be.pool_state(g.pool(), 0).reserved_bytes == 0

    for mode, teardown in (("on", "refuse"), ("strict", "refuse"), ("strict", "report")):
        be, g, y, san = _expandable(mode, teardown)
        with pytest.raises(ExpandableSegmentsHazardError, match=r"test_budgets_reload_hazard.py:\d+ in test_expandable"
                                                                r".* while 16 KiB \(16384 bytes\) allocated in its captures"):
            g.reset()
        del y  # the right order: blocks first, then the graph
        g.reset()
        be.empty_cache()
        be.randn(4)
        (f,) = san.findings()
        assert f.kind == "expandable_teardown" and f.bytes == 16384 and "test_budgets_reload_hazard.py" in f.sites[0]
        san.stop()

    be, g, y, san = _expandable("on", "report")
    g.reset()  # reported, not refused: the user opted out
    del y
    (f,) = san.findings()
    assert f.kind == "expandable_teardown" and "can crash the process" in f.message
    san.stop()
    with pytest.raises(Exception, match=r"PoolSanitizer\(expandable_teardown='never'\): choose 'refuse'"):
        PoolSanitizer(be, expandable_teardown="never")


def test_under_expandable_segments_a_released_pool_stays_dead_after_the_flush():
    """All blocks freed and the cache flushed, the allocator may still keep the pool (no segment, a count of
    expansions not unmapped): a capture into its id asserts. The sanitizer stops it before."""
    be = SimBackend(expandable_segments=True)
    c = Ctx(be)
    with PoolSanitizer(be) as san:
        h, g = be.graph_pool_handle(), be.new_graph()
        xs = c.capture(g, h, lambda: [be.empty(2 << 18) for _ in range(20)])
        del xs
        g.reset()  # nothing alive: no hazard
        be.empty_cache()
        be.host_empty_cache()
        assert be.pool_state(h).reserved_bytes == 0 and be.would_assert(h)  # a zombie: nothing shows, it asserts
        with pytest.raises(StalePoolError):
            c.step(be.new_graph(), h)
        assert san.stale_caught == 1 and [f.kind for f in san.findings()] == ["stale_capture"]  # that one only
    assert torch.isfinite(be.randn(4)).all()  # stopped before the allocator: the process is fine


CRASHING_TEARDOWN = """
from cudagraph_lifecycle.backends import get_backend
from cudagraph_lifecycle.conformance import Ctx, _carve

def crash():
    be = get_backend("sim")
    _, g, kept = _carve(Ctx(be), 100 << 20, 20, 2 << 20)
    g.reset()        # reported only (CUDAGRAPH_EXPANDABLE_TEARDOWN=report)
    be.empty_cache()
    del kept          # a use after free: the simulated allocator crashes the process, as CUDA did
    be.empty(4)
"""


def test_a_worker_that_crashes_after_a_recorded_hazard_says_so(tmp_path, monkeypatch):
    from pytest_cudagraph.worker import ReusedWorker, WorkerCrashed

    (tmp_path / "crashing_teardown.py").write_text(CRASHING_TEARDOWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import crashing_teardown

    env = {"CUDAGRAPH_SANITIZE": "on", "CUDAGRAPH_SANITIZE_BACKEND": "sim", "CUDAGRAPH_EXPANDABLE_TEARDOWN": "report",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with ReusedWorker(env=env, name="hazard") as w:
        with pytest.raises(WorkerCrashed) as e:
            w.call(crashing_teardown.crash)
    assert "killed by signal SIGSEGV" in str(e.value)
    (h,) = e.value.hazards
    assert h["live_bytes"] == 10 * (2 << 20) and h["reset_site"].endswith("crashing_teardown.py:8 in crash")
    assert "the sanitizer recorded before the crash" in str(e.value)
    assert "20 MiB (20971520 bytes) alive at the reset at" in str(e.value)


def test_without_expandable_segments_the_same_order_is_fine():
    be = SimBackend()
    with PoolSanitizer(be, mode="strict") as san:
        g = be.new_graph()
        y = Ctx(be).step(g, be.graph_pool_handle())
        g.reset()
        del y
        assert torch.isfinite(be.randn(4)).all() and "expandable_teardown" not in [f.kind for f in san.findings()]


TEARDOWN_ENGINE = '''
from cudagraph_lifecycle.conformance import Ctx, _carve

class KeepsBlocks:
    """Keeps every other block of its capture across its release: the order that crashed torch 2.11."""
    def __init__(self, backend):
        self.be = backend
    def capture(self):
        self.pool, self.graph, self.kept = _carve(Ctx(self.be), 100 << 20, 20, 2 << 20)
    def run(self, x):
        return x
    def release(self):
        self.graph.reset()
        self.be.empty_cache()
        del self.kept
        self.be.empty(4)

def keeps_blocks(backend):
    return KeepsBlocks(backend)
'''


@pytest.mark.parametrize("teardown", ["refuse", "report"])
def test_engine_sequence_under_expandable_segments(pytester, monkeypatch, teardown):
    """refuse (the default): the reset is refused, the cycle fails with expandable_teardown and the worker
    lives; report: the worker crashes, and the cycle's record says what the sanitizer saw first."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    pytester.makepyfile(teardown_engines=TEARDOWN_ENGINE, test_t='''
        import pytest
        from pytest_cudagraph import EngineCycleError
        from teardown_engines import keeps_blocks

        def test_seq(engine_sequence):
            with pytest.raises(EngineCycleError):
                engine_sequence(keeps_blocks, 1)
            (rec,) = engine_sequence.records
            print("KINDS", [p["kind"] for p in rec["problems"]])
            print("MESSAGES", [p["message"].splitlines()[0] for p in rec["problems"]])
    ''')
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "-s", "--cudagraph-backend=sim",
                                        f"--cudagraph-expandable-teardown={teardown}")
    res.assert_outcomes(passed=1)
    out = res.stdout.str()
    site = "teardown_engines.py:12 in release while 20 MiB (20971520 bytes)"
    if teardown == "refuse":
        assert "KINDS ['expandable_teardown', " in out and "killed by signal" not in out
        assert "ExpandableSegmentsHazardError: reset of the last graph of pool (0, 1)" in out and site in out
    else:
        assert "KINDS ['error', 'expandable_teardown']" in out
        assert "killed by signal SIGSEGV" in out and "was reset at " in out and site in out


RESETS_FIRST = '''
from cudagraph_lifecycle.conformance import Ctx

class ResetsFirst:
    """Resets its graph, then drops the static output it keeps: a block of the pool is alive at the reset."""
    def __init__(self, backend):
        self.be = backend
    def capture(self):
        self.graph = self.be.new_graph()
        self.out = Ctx(self.be).step(self.graph, self.be.graph_pool_handle())
    def run(self, x):
        self.graph.replay()
        return self.out.clone()
    def release(self):
        self.graph.reset()
        del self.out

def resets_first(backend):
    return ResetsFirst(backend)
'''


def test_a_reported_teardown_that_did_not_crash_is_in_its_engines_record(pytester, monkeypatch):
    """report: the reset goes through and nothing crashes (the block went before any flush), yet the cycle's
    record and the session's section carry the finding, with its fix; it fails the cycle only under strict."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    pytester.makepyfile(resets_first=RESETS_FIRST, test_t='''
        from resets_first import resets_first

        def test_seq(engine_sequence):
            engine_sequence(resets_first, 2, output="drop")
            for rec in engine_sequence.records:
                print("REC", rec["verdict"], rec["failed"], [p["kind"] for p in rec["problems"]],
                      [f["kind"] for f in rec["sanitizer"]])
    ''')
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "-s", "--cudagraph-backend=sim",
                                        "--cudagraph-expandable-teardown=report")
    res.assert_outcomes(passed=1)
    out = res.stdout.str()
    assert out.count("REC fresh False ['sanitizer'] ['expandable_teardown']") == 2
    assert "! sanitizer: expandable_teardown: the last graph of pool (0, 1) was reset at " in out
    assert "resets_first.py:14 in release while 16 KiB (16384 bytes) of it were alive" in out
    assert "so the graph goes last" in out and "2 sanitizer finding(s)" in out
    # with no sanitizer the observation still saw it: the records are the same (the verdict does not depend on
    # what watches)
    off = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "-s", "--cudagraph-backend=sim",
                                        "--cudagraph-expandable-teardown=report", "--cudagraph-sanitize=off")
    off.assert_outcomes(passed=1)
    assert [ln for ln in off.stdout.lines if ln.startswith("REC")] == [ln for ln in res.stdout.lines
                                                                     if ln.startswith("REC")]
