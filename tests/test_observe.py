"""The observation layer: installed once per process, reference-counted, restoring the very same graph API
objects when the last holder stops; and the ledger it feeds stays consistent while garbage collection runs."""

import gc
import itertools

import pytest

from cudagraph_lifecycle import PoolSanitizer, get_backend, observe
from cudagraph_lifecycle.backends import graph_apis
from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.conformance import Ctx
from cudagraph_lifecycle.ledger import ledger


def api_objects():
    """Every attribute the observation layer may wrap, by identity (vars() tells inherited from own)."""
    out = {}
    for api in graph_apis():
        owners = [(api.graph_cls, n) for n in ("capture_begin", "capture_end", "reset", "replay")]
        owners += [(o, n) for o, n, _ in api.handles] + [(o, n) for o, n, _ in api.pool_refs]
        owners += [(h[0], h[1]) for h in (api.device_flush, api.host_flush) if h is not None]
        if api.mempool_cls is not None:
            owners.append((api.mempool_cls, "__init__"))
        for owner, name in owners:
            out[(id(owner), name)] = (vars(owner).get(name), getattr(owner, name))
    return out


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_sanitizers_stopped_in_any_order_restore_the_api_by_identity(order):
    before = api_objects()
    sans = [PoolSanitizer("sim").start(), PoolSanitizer(SimBackend()).start(), PoolSanitizer("sim", mode="strict").start()]
    assert observe.installed() and api_objects() != before
    for i in order:
        sans[i].stop()
        sans[i].stop()  # idempotent
        assert observe.installed() == any(s.active for s in sans)
    after = api_objects()
    assert after.keys() == before.keys()
    for key in before:
        assert after[key][0] is before[key][0] and after[key][1] is before[key][1], key


def test_acquire_release_nest_with_sanitizers():
    before = api_objects()
    observe.acquire()
    with PoolSanitizer("sim"):
        pass
    assert observe.installed()  # the outer hold keeps it
    observe.release()
    observe.release()  # one more than held: ignored
    assert not observe.installed() and api_objects() == before


def test_findings_are_safe_while_weak_reference_callbacks_run():
    """Graphs in reference cycles die inside garbage collections that run during findings()."""
    be = SimBackend()
    c = Ctx(be)
    thresholds = gc.get_threshold()
    with PoolSanitizer(be) as san:
        h = be.graph_pool_handle()
        keep = []
        for _ in range(40):
            g = be.new_graph()
            y = c.step(g, h)
            g.cycle = g  # only a collection frees it
            keep.append((g, y))
        del g, y
        try:
            gc.set_threshold(1, 1, 1)
            for _ in range(3):
                keep.pop()
                found = san.findings()
                assert all(f.kind == "unreleased_graph" for f in found)
            keep.clear()
            gc.collect()
            assert san.findings() == [] and ledger.live_graphs(be.world) == []
        finally:
            gc.set_threshold(*thresholds)


def test_a_forked_child_starts_unobserved():
    import multiprocessing as mp

    def child(q):
        q.put((observe.installed(), len(ledger.pools)))

    with PoolSanitizer("sim"):
        be = get_backend("sim")
        g = be.new_graph()
        y = Ctx(be).step(g, be.graph_pool_handle())  # noqa: F841 - one pool in the parent's ledger
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        installed, pools = q.get(timeout=60)
        p.join(30)
        g.reset()
    assert (installed, pools) == (False, 0)


def test_capture_into_a_dead_pool_is_recorded_even_without_a_judge():
    be = SimBackend()
    c = Ctx(be)
    observe.acquire()
    try:
        h = be.graph_pool_handle()
        g = be.new_graph()
        y = c.step(g, h)  # noqa: F841
        g.reset()
        since = ledger.seq
        with pytest.raises(RuntimeError, match="use_count > 0"):  # no sanitizer: the allocator decides
            c.step(be.new_graph(), h)
        (attempt,) = ledger.stale_since(since, be.world)
        assert attempt.key == (be.world, 0, h) and attempt.device_dead and "test_observe.py" in attempt.minted_at
    finally:
        observe.release()


def test_cache_flushes_read_the_allocators_books_only_when_asked(monkeypatch):
    # torch.cuda.graph flushes the cache at every capture; which released pools a flush erased is read once,
    # when a query or a capture into one of them needs it (a snapshot costs ~300 us on CUDA)
    import torch

    be = SimBackend()
    reads = []
    books = be.pool_bytes
    monkeypatch.setattr(be, "pool_bytes", lambda device=0: reads.append(device) or books(device))
    x, s = torch.ones(4, 8), be.new_stream()
    gc.collect()  # earlier tests' worlds and graphs gone, their events applied: no flush needs counting
    with PoolSanitizer("sim"):
        get_backend("sim").empty_cache()  # the process's world lives on: its released pools see a flush
    ledger.snapshot()
    assert not (ledger.unflushed or ledger.pending_keys), (ledger.unflushed, ledger.pending_keys)
    with PoolSanitizer(be) as san:
        pinned, kept = [], []
        for _ in range(3):  # released pools, each pinned by its output
            pinned.append(be.graph_pool_handle())
            g = be.new_graph()
            with be.graph(g, pool=pinned[-1], stream=s):
                kept.append(x * 2)
            g.reset()
        # a flush is counted only while a released pool waits for one: before the 2nd and 3rd captures above
        assert ledger.flushes[be.world] == 2
        pool, graphs = be.graph_pool_handle(), []
        for _ in range(5):
            graphs.append(be.new_graph())
            with be.graph(graphs[-1], pool=pool, stream=s):
                x + 1
        assert reads == [] and ledger.flushes[be.world] == 3  # the first flush here saw the third pool's release
        del kept[0]  # its pool unpinned: the next flush erases it (uncounted: every released pool saw one)
        be.empty_cache()
        assert ledger.flushes[be.world] == 3
        alive = {e.pool_id for e in ledger.snapshot(be.world)}
        assert len(reads) == 1
        assert tuple(pinned[0]) not in alive and {tuple(pinned[1]), tuple(pinned[2]), tuple(pool)} <= alive
        g = be.new_graph()  # the erased pool's id may be captured into again; the pinned ones may not
        with be.graph(g, pool=pinned[0], stream=s):
            x + 1
        assert san.stale_caught == 0
        with pytest.raises(Exception, match="stale pool"), be.graph(be.new_graph(), pool=pinned[1], stream=s):
            pass


def _runner_ledger_view(be, run):
    """What the ledger holds about one runner's capture, in order: (pool, device, scope, site, captured)."""
    from cudagraph_lifecycle import CUDAGraphRunner

    def fwd(x):
        return (x * 2).relu()

    with ledger.engine_scope("direct-or-not"):
        r = CUDAGraphRunner(fwd, [1, 2, 4], (8,), backend=be, warmup=1)
        run(r)  # the user's line: where each graph says it was captured
    graphs = sorted(ledger.live_graphs(be.world), key=lambda g: g.seq)
    (_, pid), = r.pool_ids
    view = [(g.pool_id == pid, g.device, g.scope, g.site.rsplit(" in ", 1)[-1], g.captured) for g in graphs]
    pool = ledger.pool(be.world, 0, pid)
    counts = (pool.held, pool.captures, pool.dead)
    r.release()
    return view, counts, ledger.pool(be.world, 0, pid) is None  # released and flushed: erased


def test_the_runners_direct_capture_path_records_what_the_wrappers_record():
    """The runner captures through DirectCapture (no wrapper frames, one stack per capture() call); with
    something else in front of our capture wrapper it calls the graph's methods as anyone would. The ledger
    must hold the same either way: entries, pools, sites, counts; and a dead pool is still judged."""
    be = SimBackend()
    cls = type(be.new_graph())
    with PoolSanitizer(be):
        assert observe.direct_capture(cls) is not None

        def user_captures(r):
            r.capture()

        direct = _runner_ledger_view(be, user_captures)
        ours = cls.capture_begin
        seen = []

        def foreign(graph, *a, **k):  # another tool's wrapper in front of ours: the runner must go through it
            seen.append(type(graph))
            return ours(graph, *a, **k)

        cls.capture_begin = foreign
        try:
            assert observe.direct_capture(cls) is None
            wrapped = _runner_ledger_view(be, user_captures)
        finally:
            cls.capture_begin = ours
        assert len(seen) == 3
    # the same, but where each graph says it was captured: the innermost frame outside the library, which
    # the foreign wrapper is
    assert [v[3] for v in direct[0]] == ["user_captures"] * 3 and [v[3] for v in wrapped[0]] == ["foreign"] * 3
    assert [v[:3] + v[4:] for v in direct[0]] == [v[:3] + v[4:] for v in wrapped[0]]
    assert direct[1:] == wrapped[1:]
    view, counts, erased = direct
    assert [v[4] for v in view] == [True] * 3 and all(v[0] and v[2] == "direct-or-not" for v in view)
    assert counts == (3, 3, False) and erased
    assert observe.direct_capture(cls) is None  # not installed


def test_the_runners_direct_path_judges_a_dead_pool():
    """A LazyPool whose id went dead under another runner: the direct path raises before the allocator."""
    from cudagraph_lifecycle import CUDAGraphRunner, LazyPool, StalePoolError

    be = SimBackend()
    with PoolSanitizer(be):
        pool = LazyPool(be)
        pid = pool.acquire(0)
        g = be.new_graph()
        Ctx(be).step(g, pid)
        g.reset()  # every graph of the pool released: dead until both caches are flushed
        r = CUDAGraphRunner(lambda x: x + 1, [2], (4,), backend=be, warmup=0, pool=pool)
        with pytest.raises(StalePoolError):
            r.capture()
        assert be.poisoned is None


def test_a_graph_entry_is_a_weak_reference_compared_by_identity():
    """Two entries of one graph (it was captured twice) are two records, not equal because their graph is."""
    from cudagraph_lifecycle.ledger import GraphEntry

    be = SimBackend()
    g = be.new_graph()
    seen = []
    a, b = GraphEntry(g, seen.append), GraphEntry(g)
    assert a() is g and a != b and not a == b and a == a and len({a, b}) == 2
    del g
    assert seen == [a] and a() is None  # the callback gets the entry itself
