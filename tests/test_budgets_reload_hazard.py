"""Memory and capture budgets, reloads that leave graphs reading old tensors, and the expandable-segments
teardown hazard: each catches its bug and passes a correct engine (simulated allocator)."""

import budget_cases
import pytest
import torch

from cudagraph_lifecycle import PoolSanitizer
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
''')
    res.assert_outcomes(passed=3)


def test_budgets_of_a_cudagraph_marked_test(pytester):
    budget_cases.check(run(pytester, budget_cases.SIM_CAPTURE + budget_cases.MARKED_TESTS))


def test_budgets_of_an_engine_sequence(pytester):
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

@pytest.mark.cudagraph(max_pool_bytes=2 << 20, max_captures=3, require_replay=True)
def test_within(engine_sequence):
    (rec,) = engine_sequence(checked, 1)
    assert rec["graphs"] == 3 and rec["replays"] >= 1 and sum(rec["graph_bytes"].values()) == rec["pool_bytes"]
''')
    res.assert_outcomes(passed=3)


def _expandable(mode: str | None):
    be = SimBackend(expandable_segments=True)
    c = Ctx(be)
    san = PoolSanitizer(be, mode=mode).start() if mode else None
    g = be.new_graph()
    y = c.step(g, be.graph_pool_handle())
    return be, g, y, san


def test_expandable_teardown_runs_on_as_measured_and_is_reported_by_on_refused_by_strict():
    be, g, y, _ = _expandable(None)
    g.reset()  # the last graph goes while `y` lives: on the H200 with torch 2.11 plain PyTorch carries on
    del y
    be.empty_cache()
    assert torch.isfinite(be.randn(4)).all() and be.pool_state(g.pool(), 0).reserved_bytes == 0

    be, g, y, san = _expandable("on")
    g.reset()  # on: reported, not refused
    del y
    finding = san.findings()
    assert [f.kind for f in finding] == ["expandable_teardown"] and finding[0].bytes == 16384
    assert "can crash the process" in finding[0].message
    assert finding[0].sites and "test_budgets_reload_hazard.py" in finding[0].sites[0]
    san.stop()

    be, g, y, san = _expandable("strict")
    with pytest.raises(ExpandableSegmentsHazardError, match="while 16384 bytes allocated in its captures are alive"):
        g.reset()
    del y  # the right order: blocks first, then the graph
    g.reset()
    be.randn(4)
    assert [f.kind for f in san.findings()] == ["expandable_teardown"]
    san.stop()


def test_without_expandable_segments_the_same_order_is_fine():
    be = SimBackend()
    with PoolSanitizer(be, mode="strict") as san:
        g = be.new_graph()
        y = Ctx(be).step(g, be.graph_pool_handle())
        g.reset()
        del y
        assert torch.isfinite(be.randn(4)).all() and "expandable_teardown" not in [f.kind for f in san.findings()]
