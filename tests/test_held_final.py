"""A ``held`` verdict is final before its worker goes: where the next engine ends the process (a stale capture,
a poisoned process, a crash) before the caller drops the held output, the held engine is judged from what
pinned its pool as the next engine captured into it, or its record says the verdict is unconfirmed and why.
Nothing of the process is changed to find out (the held output stays held)."""

import threading

import pytest
from test_findings import KeptHandleEngine

from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.cycle import run_cycle

_RELEASE = threading.Event()  # lets the thread that hides a block go


def _last(records: list[dict]) -> dict[int, dict]:
    """The final record of each engine (a later call completes an earlier engine's)."""
    out = {}
    for r in records:
        out[r["index"]] = r
    return out


def _sequence(engine, n: int, output: str = "hold") -> dict[int, dict]:
    """Runs in a worker (a cycle observes its process for good): ``n`` engines, their final records."""
    KeptHandleEngine.pool = None
    _RELEASE.clear()
    be = SimBackend()  # an allocator world of its own: no sanitizer, so the allocator's assert is simulated
    try:
        return _last([r for i in range(n) for r in run_cycle(engine, be, i, test="t", output=output)])
    finally:
        KeptHandleEngine.pool = None
        _RELEASE.set()


def test_a_held_output_alone_pinning_the_pool_the_next_engine_hit_keeps_the_verdict_held(cudagraph_worker):
    recs = cudagraph_worker.call(_sequence, KeptHandleEngine, 2)
    assert [recs[0]["verdict"], recs[1]["verdict"]] == ["held", "stale"] and recs[1]["poisoned"], recs
    assert {p["kind"] for p in recs[0]["problems"]} == set(), recs[0]["problems"]  # confirmed by the pins


class HiddenBlockEngine(KeptHandleEngine):
    """The seed bug, and a second tensor of its capture handed to a thread that keeps it in a local variable:
    a holder the garbage collector does not see, so the release's judgment cannot tell it from the output."""

    def captured_body(self):
        self.box = [self.w * 3]  # a second block of the capture
        return super().captured_body()

    def capture(self):
        super().capture()
        started = threading.Event()
        threading.Thread(target=_keep, args=(self.box, started), daemon=True).start()
        started.wait(10)


def _keep(box: list, started: threading.Event) -> None:
    t = box.pop()  # now only this running frame's local holds it
    started.set()
    _RELEASE.wait(30)
    del t


def test_a_pin_beyond_the_held_output_seen_as_the_next_engine_captures_makes_the_held_engine_leaked(cudagraph_worker):
    recs = cudagraph_worker.call(_sequence, HiddenBlockEngine, 2)
    first, second = recs[0], recs[1]
    assert second["verdict"] == "stale", second["problems"]
    assert first["verdict"] == "leaked" and first["leaked_bytes"] > 0, first
    (leak,) = [p for p in first["problems"] if p["kind"] == "leaked"]
    assert "when engine 1 captured into its pool" in leak["message"], leak["message"]
    assert [pin["cause"] for pin in leak["pins"]] == ["unknown"], leak["pins"]


class FreshPoolEngine(KeptHandleEngine):
    def capture(self):
        KeptHandleEngine.pool = None  # a pool of its own each time
        super().capture()


class HostSyncEngine(FreshPoolEngine):
    """Its capture is broken by a host sync (the error let through): the process is poisoned in every mode."""

    def capture(self):
        be = self.be
        g = be.new_graph()
        with be.stream(be.capture_stream(0)):
            g.capture_begin(pool=be.graph_pool_handle())
            try:
                (self.w * 2).sum().item()
            finally:
                g.capture_end()


def _mixed(be):
    """Engine 0 well behaved (its output held), engine 1 poisons the process."""
    _MIXED.append(be)
    return FreshPoolEngine(be) if len(_MIXED) == 1 else HostSyncEngine(be)


_MIXED: list = []


def _mixed_sequence() -> dict[int, dict]:
    _MIXED.clear()
    return _sequence(_mixed, 2)


def test_a_held_verdict_the_next_engine_ends_the_worker_before_checking_says_unconfirmed(cudagraph_worker):
    recs = cudagraph_worker.call(_mixed_sequence)
    cudagraph_worker.restart_before_next_call()
    assert recs[1]["poisoned"] and recs[1]["verdict"] == "error", recs[1]
    first = recs[0]
    assert first["verdict"] == "held" and not first["failed"], first
    (note,) = [p for p in first["problems"] if p["kind"] == "held_unconfirmed"]
    assert "engine 1 ended this worker (it poisoned the process)" in note["message"], note


@pytest.mark.parametrize("output", ["hold"])
def test_a_crashed_next_worker_leaves_the_held_record_unconfirmed(pytester, output):
    pytester.makepyfile(f"""
        import os
        import torch
        import pytest

        class Engine:
            n = 0

            def __init__(self, be):
                Engine.n += 1
                self.be, self.crash = be, Engine.n > 1
                self.w = be.randn(8)

            def capture(self):
                if self.crash:
                    os._exit(3)
                g = self.be.new_graph()
                with self.be.stream(self.be.capture_stream(0)):
                    g.capture_begin(pool=self.be.graph_pool_handle())
                    self.y = self.w * 2
                    g.capture_end()
                self.g = g

            def run(self, x):
                self.g.replay()
                return self.y

            def example_input(self):
                return self.w

            def release(self):
                self.g.reset()
                self.g = self.y = None

        def test_two(engine_sequence):
            with pytest.raises(Exception):
                engine_sequence(Engine, 2, output="{output}")
            recs = engine_sequence.records
            assert recs[0]["verdict"] == "held", recs[0]
            kinds = [p["kind"] for p in recs[0]["problems"]]
            assert kinds == ["held_unconfirmed"], recs[0]["problems"]
            assert "worker crashed" in recs[0]["problems"][0]["message"]
    """)
    result = pytester.runpytest("-p", "cudagraph", "--cudagraph-backend=sim", "-q")
    result.assert_outcomes(passed=1)
