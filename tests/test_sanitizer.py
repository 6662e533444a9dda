"""The pool sanitizer's ledger, driven through the simulated allocator."""

import collections
import os

import pytest
import torch

from cudagraph_lifecycle import (
    CUDAGraphRunner,
    DefaultStreamCaptureError,
    LazyPool,
    PoolSanitizer,
    StalePoolError,
)
from cudagraph_lifecycle.backends.sim import SimBackend, SimGraph
from cudagraph_lifecycle.conformance import Ctx
from cudagraph_lifecycle.ledger import ledger
from cudagraph_lifecycle.sanitizer import install_from_env


@pytest.fixture
def sim():
    be = SimBackend()
    with PoolSanitizer(be) as san:
        yield be, san, Ctx(be)


def mint_here(be):
    return be.graph_pool_handle()


def release_here(g):
    g.reset()


def released_pool(be, c):
    """A handle whose only graph was captured, reset, and its output dropped: only the caches still hold it."""
    h = be.graph_pool_handle()
    g = be.new_graph()
    c.step(g, h)
    g.reset()
    return h


def test_sanitizer_catches_stale_pool_before_the_allocator(sim):
    be, san, c = sim
    h = mint_here(be)
    g = be.new_graph()
    y = c.step(g, h)  # noqa: F841 - the output pins the pool
    release_here(g)
    with pytest.raises(StalePoolError) as e:
        c.step(be.new_graph(), h)
    msg = str(e.value)
    assert "in mint_here" in msg and "in release_here" in msg
    assert "(unknown): nothing the garbage collector sees reaches it: a local variable of a function still" in msg
    assert be.poisoned is None and san.stale_caught == 1  # the allocator never saw it
    # the line that tried, in the first line of the error and as a stack of its own
    assert e.value.site.endswith("in test_sanitizer_catches_stale_pool_before_the_allocator")
    first = msg.splitlines()[0]  # the line a table shows: where it captured, and where the kept id was minted
    assert f"at {e.value.site} (its id minted at " in first and "in mint_here):" in first, first
    assert "--- the capture began at ---" in msg
    assert c.step(be.new_graph(), be.graph_pool_handle()).numel() > 0  # the process goes on


KEPT = {}


def test_a_stale_pool_error_names_what_pins_the_pool(sim):
    be, _, c = sim
    h = be.graph_pool_handle()
    g = be.new_graph()
    KEPT["last"] = c.step(g, h)
    g.reset()
    try:
        with pytest.raises(StalePoolError) as e:
            c.step(be.new_graph(), h)
    finally:
        KEPT.clear()
    first = str(e.value).splitlines()[0]
    assert "pinned by a tensor (4096,) float32 held as key `last` of a dict (global `KEPT` of module" in first
    assert "(python_reference): drop that reference" in first


def test_a_pool_no_block_keeps_is_dead_until_a_flush_and_the_error_says_so(sim):
    """Every block freed, no cache flush since the reset: still dead (the allocator still has it), and the
    error says that, not that a tensor pins it; outside any engine both fixes are offered."""
    be, _, c = sim
    h = be.graph_pool_handle()
    g = be.new_graph()
    c.step(g, h)  # the output is dropped at once
    g.reset()
    assert be.pool_state(h, 0).allocated_bytes == 0 < be.pool_state(h, 0).reserved_bytes
    with pytest.raises(StalePoolError) as e:
        c.step(be.new_graph(), h)
    first = str(e.value).splitlines()[0]
    assert "no block of it is alive: no cache flush (empty_cache) ran since its last graph was reset" in first
    assert "pins" not in first and "a new pool id" in first and "capture the new graph before resetting" in first


def _recaptures_in_one_engine():
    """An engine that evicts its one graph and recaptures into the same pool (an LRU of one)."""
    from cudagraph_lifecycle.cycle import run_cycle

    class Evicting:
        def __init__(self, be):
            self.be, self.c, self.h = be, Ctx(be), be.graph_pool_handle()
            self.g = be.new_graph()
            self.c.step(self.g, self.h)

        def run(self, x):
            self.g.reset()  # evicted: the pool's last graph
            self.g = self.be.new_graph()
            self.c.step(self.g, self.h)  # recaptured into the same pool: stale
            return x

        def release(self):
            self.g.reset()

        def example_input(self):
            return torch.ones(2)

    (rec,) = run_cycle(Evicting, "sim", 0)
    return rec["verdict"], rec["problems"][0]["message"]


def test_a_recapture_within_the_engine_that_made_the_pool_gets_the_recapture_fix(cudagraph_worker):
    verdict, message = cudagraph_worker.call(_recaptures_in_one_engine)
    assert verdict == "stale", message
    assert "The engine that made the pool captures into it again after resetting all its graphs" in message
    assert "Mint a fresh pool per engine" not in message


def test_a_refused_stale_capture_is_a_finding_even_when_the_error_was_caught(sim):
    """An engine that catches the StalePoolError and runs eagerly hides it from its caller: the finding
    names the line that tried, and that the sanitizer refused it."""
    be, san, c = sim
    h = mint_here(be)
    g = be.new_graph()
    y = c.step(g, h)  # noqa: F841 - the output pins the pool
    release_here(g)
    try:
        c.step(be.new_graph(), h)
    except StalePoolError:
        pass  # falls back to eager
    (f,) = [f for f in san.findings() if f.kind == "stale_capture"]
    assert f.pool_id == tuple(h) and f.sites[0].endswith("in test_a_refused_stale_capture_is_a_finding_even_when_"
                                                         "the_error_was_caught")
    assert "refused before the allocator saw it" in f.message and "in mint_here" in "".join(f.stacks)


def test_an_unjudged_stale_capture_is_a_finding_that_says_the_allocator_asserted():
    """Observed but judged by no sanitizer (one of another world): the allocator asserts, and the finding of a
    sanitizer of that world says the process is poisoned."""
    be, other = SimBackend(), SimBackend()
    with PoolSanitizer(other):
        c = Ctx(be)
        h = be.graph_pool_handle()
        g = be.new_graph()
        y = c.step(g, h)  # noqa: F841
        g.reset()
        with pytest.raises(RuntimeError, match="use_count > 0"):
            c.step(be.new_graph(), h)
        (f,) = [f for f in PoolSanitizer(be).findings() if f.kind == "stale_capture"]
        assert "the allocator asserted 'use_count > 0' and the process is poisoned" in f.message


def test_sanitizer_stale_after_empty_cache_names_the_host_ledger(sim):
    be, _, c = sim
    h = released_pool(be, c)
    be.empty_cache()
    with pytest.raises(StalePoolError, match="host allocator's ledger") as e:
        c.step(be.new_graph(), h)
    assert "device allocator still holds" not in str(e.value)


def test_sanitizer_allows_legal_reuse_after_both_caches(sim):
    be, san, c = sim
    h = released_pool(be, c)
    be.empty_cache()
    be.host_empty_cache()
    c.step(be.new_graph(), h)  # legal: the pool is created afresh under the same id
    assert san.stale_caught == 0


def _quiet_flushes(be):
    for _ in range(2):  # nothing waits for a flush: from the first call on, both wrappers pass straight through
        be.empty_cache()
        be.host_empty_cache()


def test_a_host_flush_after_quiet_flushes_still_erases_a_released_pool(sim):
    """Flush wrappers pass straight through while nothing waits for a flush, until the ledger arms them again.
    A MemPool keeps its pool on the device, so releasing the graph leaves only the host allocator holding it
    dead: that alone must arm the host flush, or the flush that erases it goes unseen and the legal capture
    below is refused as stale."""
    be, san, c = sim
    mp = be.mempool()
    g = be.new_graph()
    c.step(g, mp.id)
    _quiet_flushes(be)
    g.reset()
    be.host_empty_cache()
    c.step(be.new_graph(), mp.id)
    assert san.stale_caught == 0 and be.poisoned is None


def test_a_device_flush_after_quiet_flushes_still_erases_a_pool_read_as_pinned(sim):
    """The device side alone: a released pool still pinned when the ledger read the books waits for the next
    device flush again (the host allocator erased it already), and that must arm the device flush."""
    be, san, c = sim
    h = be.graph_pool_handle()
    g = be.new_graph()
    y = c.step(g, h)
    g.reset()
    be.empty_cache()  # y pins the pool: not erased
    be.host_empty_cache()
    _quiet_flushes(be)
    san.findings()  # a query reads the books: still there, so it waits for the next device flush
    del y
    be.empty_cache()
    c.step(be.new_graph(), h)  # legal: the pool is created afresh under the same id
    assert san.stale_caught == 0 and be.poisoned is None


def test_a_destroyed_graph_is_applied_at_once_outside_a_ledger_operation(sim):
    be, san, c = sim
    h = be.graph_pool_handle()
    g1, g2 = be.new_graph(), be.new_graph()
    c.step(g1, h)
    c.step(g2, h)
    with ledger.lock:
        ledger.drain()
    del g1
    assert not ledger.pending and not ledger.pending_keys  # nothing left for the next capture's flushes
    assert san.use_count(h) == 1


def test_an_event_queued_inside_a_ledger_operation_arms_the_flushes(sim):
    """Inside an operation (a garbage collection while a query walks the books) a weak reference's event is
    queued: flushes that passed straight through must apply it before they count, or a release would land
    after the flush that erased its pool."""
    be, san, c = sim
    _quiet_flushes(be)
    seen = []
    with ledger.lock:
        ledger.later(None, seen.append, "applied")
    assert seen == []
    be.empty_cache()
    assert seen == ["applied"]


def test_sanitizer_allows_torch_graph_context_reuse(sim):
    be, san, c = sim
    h = released_pool(be, c)
    x = c.tensor()
    with be.graph(be.new_graph(), pool=h):
        x * 2
    assert san.stale_caught == 0


def test_sanitizer_allows_shared_pool_while_a_graph_lives(sim):
    be, san, c = sim
    h = be.graph_pool_handle()
    keep = [(g, c.step(g, h)) for g in (be.new_graph(), be.new_graph(), be.new_graph())]
    (f,) = san.findings()  # one finding for the pool, however many graphs
    assert f.kind == "unreleased_graph" and f.message.startswith("3 graphs captured into pool")
    assert "one is held as an item of a tuple (an item of a list" in f.message, f.message  # `keep`: a running frame
    del keep


def test_sanitizer_mempool_owner_keeps_pool_live_on_device(sim):
    be, san, c = sim
    mp = be.mempool(0)
    g = be.new_graph()
    y = c.step(g, mp.id)  # noqa: F841
    g.reset()
    # the MemPool keeps the device count up, but the host ledger is at 0: torch 2.11 would assert
    with pytest.raises(StalePoolError, match="host allocator"):
        c.step(be.new_graph(), mp.id)
    be.host_empty_cache()
    c.step(be.new_graph(), mp.id)


def test_sanitizer_destruction_counts_as_release(sim):
    be, _, c = sim
    h = be.graph_pool_handle()
    g = be.new_graph()
    y = c.step(g, h)  # noqa: F841
    del g
    with pytest.raises(StalePoolError):
        c.step(be.new_graph(), h)


def test_sanitizer_findings_pinned_pool_with_block_stacks():
    be = SimBackend()
    with PoolSanitizer(be, record_history=True) as san:
        c = Ctx(be)
        h = be.graph_pool_handle()
        g = be.new_graph()
        y = c.step(g, h)
        g.reset()
        (f,) = san.findings()
        assert f.kind == "pinned_pool" and f.bytes == 2 << 20
        assert any("in step" in s for s in f.stacks)
        del y
        assert san.findings() == []


def test_sanitizer_failed_capture_is_pool_never_retired(sim):
    be, san, c = sim
    h = be.graph_pool_handle()
    g = be.new_graph()
    x = c.tensor()
    with pytest.raises(RuntimeError):
        c.capture(g, h, lambda: (x * 2).sum().item())
    g.reset()
    kinds = [f.kind for f in san.findings()]
    assert kinds == ["pool_never_retired"]


def test_sanitizer_no_false_positive_on_runner_engines(sim):
    be, san, _ = sim
    for _ in range(3):
        with CUDAGraphRunner(lambda x: torch.relu(x * 2), [1, 2, 4], (8,), backend=be) as r:
            r.run(torch.randn(3, 8))
    assert san.stale_caught == 0 and san.findings() == []


def test_a_runner_judges_only_a_pool_whose_id_a_dead_pool_carries(sim, monkeypatch):
    """Released pools stay dead until a query settles them; a runner capturing into a fresh pool beside them
    is not judged graph by graph (as the capture wrapper, it asks the pool id first: a dead pool of any world
    may carry it), and a stale one still is."""
    from cudagraph_lifecycle.observe.wrappers import DirectCapture

    be, san, _ = sim
    carried = []  # for each judgment: whether a dead pool carried the id, or an event was queued, at the time
    judge = DirectCapture.judge
    monkeypatch.setattr(DirectCapture, "judge", lambda d, *a: (
        carried.append(a[2] in ledger.dead.ids or bool(ledger.pending_keys)), judge(d, *a))[1])
    kept = LazyPool(be, mode="handle")  # shared, never retired by the runners: the first one's id stays
    with CUDAGraphRunner(lambda x: x + 1, [1, 2], (8,), backend=be, pool=kept) as first:
        first.run(torch.randn(2, 8, device=be.torch_device(0)))
        out = first.run(torch.randn(1, 8, device=be.torch_device(0)))  # pins the pool once released
    assert ledger.dead and all(carried)
    with CUDAGraphRunner(lambda x: x * 2, [1, 2, 4], (8,), backend=be) as r:
        r.run(torch.randn(3, 8, device=be.torch_device(0)))
    assert all(carried) and san.stale_caught == 0
    with pytest.raises(StalePoolError), CUDAGraphRunner(lambda x: x - 1, [1], (8,), backend=be, pool=kept) as again:
        again.capture()
    assert carried and all(carried) and san.stale_caught == 1
    del out


def test_sanitizer_strict_check_raises():
    be = SimBackend()
    with PoolSanitizer(be, mode="strict") as san:
        g = be.new_graph()
        y = Ctx(be).step(g, be.graph_pool_handle())  # noqa: F841
        with pytest.raises(AssertionError, match="unreleased_graph"):
            san.check()


def test_sanitizer_stop_restores_the_api():
    before = (SimGraph.capture_begin, SimGraph.reset, SimBackend.graph_pool_handle)
    be = SimBackend()
    with PoolSanitizer(be):
        assert SimGraph.capture_begin is not before[0]
    assert (SimGraph.capture_begin, SimGraph.reset, SimBackend.graph_pool_handle) == before


def test_sanitizer_watches_only_its_own_sim_world(sim):
    be, san, _ = sim
    other = SimBackend()
    c2 = Ctx(other)
    h = other.graph_pool_handle()
    g = other.new_graph()
    y = c2.step(g, h)  # noqa: F841
    g.reset()
    with pytest.raises(RuntimeError, match="use_count > 0"):  # not ours: the allocator itself asserts
        c2.step(other.new_graph(), h)
    assert san.ledger() == []


def test_sanitizer_lazy_pool_ids_are_never_stale(sim):
    be, san, c = sim
    lp = LazyPool(be)
    outs = []
    for _ in range(3):
        g = be.new_graph()
        outs.append(c.step(g, lp.acquire(0)))
        g.reset()
        lp.retire()
    assert san.stale_caught == 0 and len({f.pool_id for f in san.findings()}) == 3  # pinned by `outs`


def test_sanitizer_env_install(monkeypatch):
    assert install_from_env({}) is None
    san = install_from_env({"CUDAGRAPH_SANITIZE": "strict", "CUDAGRAPH_SANITIZE_BACKEND": "sim"})
    try:
        assert san.active and san.mode == "strict"
    finally:
        san.stop()


def test_a_forked_child_installs_its_own_program_wide_sanitizer():
    """The plugin's workers fork from a process whose import may have installed the program-wide sanitizer:
    the copy a fork leaves watches nothing there, so the child's install_from_env must install its own."""
    from cudagraph_lifecycle.sanitizer import global_sanitizer

    env = {"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}
    san = install_from_env(env)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child reports through the pipe and leaves without running pytest's exit
            verdict = b"?"
            try:
                was = global_sanitizer()
                mine = install_from_env(env)
                be = mine.backend
                pool = be.graph_pool_handle()
                g = be.new_graph()
                with be.stream(be.capture_stream(0)):
                    g.capture_begin(pool=pool)
                    kept = torch.ones(4) * 2
                    g.capture_end()
                g.reset()
                try:
                    with be.stream(be.capture_stream(0)):
                        be.new_graph().capture_begin(pool=pool)  # into the dead pool `kept` pins
                    verdict = b"not stopped"
                except StalePoolError:
                    verdict = b"ok" if was is None and mine is not san else b"inherited"
                del kept
            finally:
                os.write(w, verdict)
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        assert os.read(r, 64) == b"ok"
        os.close(r)
    finally:
        san.stop()


def test_sanitizer_bad_mode():
    with pytest.raises(ValueError, match=r"PoolSanitizer\(mode=.loud.\): choose .on. or .strict."):
        PoolSanitizer(SimBackend(), mode="loud")


def test_sanitizer_tracks_graph_minted_pools(sim):
    be, san, c = sim
    g1 = be.new_graph()
    y = c.step(g1, None)  # noqa: F841 - no pool argument: the graph mints (n, 0) at capture
    pid = g1.pool()
    assert pid[1] == 0 and san.use_count(pid) == 1
    g1.reset()
    with pytest.raises(StalePoolError):
        c.step(be.new_graph(), pid)


def test_sanitizer_follows_the_runner_giving_back_a_failed_capture_reference(sim):
    be, san, _ = sim

    def fwd(x):
        if float(x.sum()) > -1e9:  # a host sync: the capture fails
            return x * 2

    r = CUDAGraphRunner(fwd, [1, 2], (4,), backend=be)
    r.run(torch.randn(2, 4))
    (_, pid), = r.pool_ids
    assert r.release().clean
    assert san.use_count(pid) == 0 and san.findings() == []


@pytest.mark.parametrize("seed", range(40))
def test_sanitizer_verdict_equals_the_allocator_on_random_lifecycles(seed):
    """Random mints, captures, resets, drops, cache flushes and MemPools: the sanitizer raises exactly when the
    allocator would assert, the process is never poisoned, and its dead-pool index (which the capture path
    reads instead of the ledger) always equals the ledger's verdict."""
    import random

    rnd = random.Random(seed)
    be = SimBackend()
    c = Ctx(be)
    handles, graphs, outputs, mempools = [], [], [], []
    stale = legal = 0
    with PoolSanitizer(be):
        for _ in range(80):
            op = rnd.choice(["mint", "capture", "capture", "capture", "reset", "drop_graph", "drop_output",
                             "empty_cache", "host_empty_cache", "mempool", "drop_mempool"])
            if op == "mint" or (op == "capture" and not handles):
                handles.append(be.graph_pool_handle())
            elif op == "capture":
                h = rnd.choice(handles)
                would = be.would_assert(h)
                g = be.new_graph()
                try:
                    y = c.step(g, h)
                except StalePoolError:
                    assert would, "the sanitizer refused a capture the allocator accepts"
                    stale += 1
                else:
                    assert not would, "the allocator would have asserted: the sanitizer missed a stale pool"
                    legal += 1
                    graphs.append(g)
                    if rnd.random() < 0.5:
                        outputs.append(y)
                    del y
                del g
            elif op == "reset" and graphs:
                rnd.choice(graphs).reset()
            elif op == "drop_graph" and graphs:
                graphs.pop(rnd.randrange(len(graphs)))
            elif op == "drop_output" and outputs:
                outputs.pop(rnd.randrange(len(outputs)))
            elif op == "empty_cache":
                be.empty_cache()
            elif op == "host_empty_cache":
                be.host_empty_cache()
            elif op == "mempool":
                mempools.append(be.mempool())
                handles.append(mempools[-1].id)
            elif op == "drop_mempool" and mempools:
                mempools.pop(rnd.randrange(len(mempools)))
            assert be.poisoned is None
            with ledger.lock:
                ledger.drain()
                assert set(ledger.dead) == {k for k, e in ledger.pools.items() if e.dead}, op
                assert ledger.dead.ids == collections.Counter(k[2] for k in ledger.dead), op
    assert legal > 0


def test_sanitizer_forgets_destroyed_graphs(sim):
    """A process-wide sanitizer lives as long as a server: destroyed graphs must not pile up in its ledger."""
    be, san, c = sim
    h = be.graph_pool_handle()
    keep = be.new_graph()
    y = c.step(keep, h)  # one graph stays alive and captured
    for _ in range(50):
        g = be.new_graph()
        c.step(g, h)
        g.reset()
        del g
    (row,) = san.ledger()
    assert row["captures"] == 51 and row["use_count"] == 1
    mine = [g for g in ledger.live_graphs(be.world)]
    assert len(mine) == 1 and len([g for g in ledger.graphs.values() if g.world == be.world]) == 1
    del keep, y
    assert ledger.live_graphs(be.world) == [] and san.findings() == []


def begin_on_the_default_stream(g, pool):
    g.capture_begin(pool=pool)


def test_a_capture_on_the_default_stream_is_refused_before_it_poisons_random_ops(sim):
    """torch refuses a capture on the default stream only after opening the RNG's capture, which poisons every
    later eager random op (measured on the H200): the sanitizer refuses it first, names the line, and the
    process goes on."""
    be, san, c = sim
    h = be.graph_pool_handle()
    with pytest.raises(DefaultStreamCaptureError, match="must be captured on a non-default stream") as e:
        begin_on_the_default_stream(be.new_graph(), h)
    assert "test_sanitizer.py" in e.value.site and "begin_on_the_default_stream" in e.value.site
    assert "side stream: `with backend.stream(backend.new_stream()):`" in str(e.value) and "NOT begun" in str(e.value)
    assert be.poisoned is None and be.randn(4).numel() == 4  # random ops still work
    shown = str(e.value).split("--- the capture began at ---\n")[1]
    assert "in test_a_capture_on_the_default_stream" in shown  # the stack starts at the test: no pytest frames
    assert not [line for line in shown.splitlines() if "_pytest" in line or "pluggy" in line], shown
    (f,) = san.findings()
    assert f.kind == "default_stream_capture" and f.sites == (e.value.site,) and f.pool_id == tuple(h)
    assert "refused before torch ran it" in f.message
    with be.stream(be.new_stream()):  # on a side stream the same capture is fine, and so is the pool
        c.step(be.new_graph(), h)
    g = be.new_graph()
    with be.graph(g):  # torch.cuda.graph's own stream
        be.randn(2) * 2
    g.reset()
    assert [x.kind for x in san.findings()] == ["default_stream_capture"]


def test_without_a_judge_the_default_stream_refusal_is_recorded_as_poisoning():
    """Observed but not judged (no sanitizer for this world): torch's own refusal runs, random ops are poisoned,
    and the ledger says where; a sanitizer of another world does not judge it."""
    be, other = SimBackend(), SimBackend()
    with PoolSanitizer(other) as san:
        with pytest.raises(RuntimeError, match="must be captured on a non-default stream") as e:
            begin_on_the_default_stream(be.new_graph(), None)
        assert not isinstance(e.value, DefaultStreamCaptureError) and san.findings() == []
        with pytest.raises(RuntimeError, match="Offset increment"):
            be.randn(4)
        event = ledger.default_stream[-1]
        assert event.key == (be.world, 0) and not event.refused and event.pool_id is None
        assert "begin_on_the_default_stream" in event.site
        (f,) = PoolSanitizer(be).findings()  # a sanitizer of its world reports it (the findings read the ledger)
        assert f.kind == "default_stream_capture" and "every later eager random op" in f.message
        assert f.pool_id is None and f.as_dict()["pool_id"] is None  # it asked for no pool: none is named


def test_a_judge_that_lets_a_default_stream_capture_through_leaves_torchs_refusal_recorded():
    from cudagraph_lifecycle import observe

    be, seen = SimBackend(), []
    observe.acquire()
    observe.add_judge(be.world, seen.append)  # rules, raises nothing
    try:
        with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
            begin_on_the_default_stream(be.new_graph(), None)
    finally:
        observe.remove_judge(be.world, seen.append)
        observe.release()
    assert [e.refused for e in seen] == [True]  # asked first
    mine = [d for d in ledger.default_stream if d.key[0] == be.world]
    assert [d.refused for d in mine] == [False]  # then torch refused it: that is what happened
