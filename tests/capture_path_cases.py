"""Captures down every branch of the observed capture_begin, on ``sim``, and what the ledger made of them, as
JSON on stdout: run once per capture path (``CUDAGRAPH_CAPTURE_PATH``) by tests/test_capture_paths.py, which
compares the two field by field. Every world is a fresh SimBackend; worlds are named by first appearance."""

import gc
import json
import sys
import weakref

from cudagraph_lifecycle import CUDAGraphRunner, PoolSanitizer, observe
from cudagraph_lifecycle.backends.sim import SimBackend, SimGraph
from cudagraph_lifecycle.ledger import GraphEntry, _line_of, ledger
from cudagraph_lifecycle.observe import hooks

worlds: dict = {}
kept: list = []  # every graph made, so every entry can be read at the end
entries: list[GraphEntry] = []
made: list = []  # weak references to every backend and graph made: none may outlive the run's references


def world_name(world) -> str:
    return worlds.setdefault(id(world), f"w{len(worlds)}")


class Slotted(SimGraph):
    """A graph class that takes no new attribute: its entry is kept beside it."""

    __slots__ = ("_backend", "_pool", "_device", "_mode", "_ops", "_captured", "_replayable", "_invalidated",
                 "_ever_captured", "_holds_refs", "_stream", "_thread")


def new_graph(be, cls=SimGraph):
    g = cls(be)
    kept.append(g)
    made.extend((weakref.ref(be), weakref.ref(g)))
    return g


def attempt(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def step(be, g, pool=None, how="positional") -> str:
    """One capture of a small step, capture_begin called the way ``how`` says."""
    x = be.randn(8)

    def go():
        if how == "positional":
            g.capture_begin(pool)
        elif how == "keyword":
            g.capture_begin(pool=pool, capture_error_mode="global")
        elif how == "bare":
            g.capture_begin()
        elif how == "both":
            g.capture_begin(pool, pool=pool)
        try:
            kept.append(x * 2 + 1)
        finally:
            g.capture_end()

    with be.stream(be.new_stream()):
        return attempt(go)


def scenarios() -> tuple[dict, dict]:
    """What each scenario did, the pools' books at the end, and the compiled wrapper's counts (None on the Python path)."""
    observe.acquire()  # one install for the whole run: its counts are read at the end
    try:
        out = _scenarios({}, SimBackend())
        with ledger.lock:
            ledger.drain()
        out["pools"] = sorted([world_name(k[0]), k[1], list(k[2]), e.held, e.captures, e.dead]
                              for k, e in ledger.pools.items())
        out["flushes"] = sorted([world_name(w), n] for w, n in ledger.flushes.items())
        methods = [(SimGraph, "capture_begin"), (SimGraph, "capture_end"), (SimBackend, "empty_cache"),
                   (SimBackend, "host_empty_cache")]
        counts = {f"{name}.{count}": getattr(getattr(owner, name), count, None)
                  for owner, name in methods for count in ("compiled_calls", "python_calls")}
        counts["direct.record"] = type(observe.direct_capture(SimGraph).record).__name__
        return out, counts
    finally:
        observe.release()


def _scenarios(out: dict, be) -> dict[str, str]:
    with PoolSanitizer(be):
        h = be.graph_pool_handle()
        out["positional"] = step(be, new_graph(be), h)
        out["keyword"] = step(be, new_graph(be), h, "keyword")
        out["bare"] = step(be, new_graph(be), None, "bare")
        out["pool given twice"] = step(be, new_graph(be), h, "both")
        out["pool as a list"] = step(be, new_graph(be), list(h))
        out["the unpooled id"] = step(be, new_graph(be), (0, 0))
        with ledger.engine_scope("scoped"):
            ledger.test = "tests/x.py::test_scoped"
            out["scope and test"] = step(be, new_graph(be), h)
            ledger.test = None
        g = new_graph(be)
        step(be, g, h)
        g.reset()
        out["the same graph again"] = step(be, g, be.graph_pool_handle())
        out["no attribute"] = step(be, new_graph(be, Slotted), h)
        for _ in range(3):  # torch.cuda.graph's way: two flushes, its own stream, the pool positional
            with be.graph(new_graph(be)):
                kept.append(be.randn(4) * 3)
        g = new_graph(be)
        with be.graph(g, pool=be.graph_pool_handle()):
            kept.append(be.randn(4))
        g.reset()  # a released pool now waits for a flush: the next ones are recorded
        with be.graph(new_graph(be)):
            kept.append(be.randn(4) * 3)
        dead = be.graph_pool_handle()
        g = new_graph(be)
        step(be, g, dead)
        g.reset()  # every graph of it released, its block kept: dead
        out["a dead pool, judged"] = step(be, new_graph(be), dead)
        out["default stream, judged"] = attempt(lambda: new_graph(be).capture_begin(h))
        gone = new_graph(be)
        step(be, gone, be.graph_pool_handle())
        with ledger.lock:  # its destruction queued under a held lock: the next capture applies it first
            kept.remove(gone)
            del gone
            gc.collect()
        out["an event queued"] = step(be, new_graph(be), be.graph_pool_handle())
        # the runner's own path (observe.DirectCapture): its entries made by the installed path's record
        with ledger.engine_scope("runner"):
            runner = CUDAGraphRunner(lambda x: x * 2 + 1, [1, 2, 4], (8,), backend=be)
            kept.append(runner)
            out["a runner's captures"] = attempt(runner.capture)
        released = CUDAGraphRunner(lambda x: x - 1, [1, 2], (8,), backend=be)
        out["a runner released"] = attempt(lambda: (released.capture(), released.release()))
        for i in range(300):  # more than the queue holds before it is drained
            step(be, new_graph(be), h if i % 2 else None)
        out["many"] = "300 captures"
    other = SimBackend()  # observed, not judged: the allocator and torch decide
    observe.acquire()
    try:
        dead = other.graph_pool_handle()
        g = new_graph(other)
        step(other, g, dead)
        g.reset()
        out["a dead pool, not judged"] = step(other, new_graph(other), dead)
        third = SimBackend()
        out["default stream, torch's refusal"] = attempt(lambda: new_graph(third).capture_begin(None))
        fresh = SimBackend()
        out["a new world"] = step(fresh, new_graph(fresh), None)
        out["end fails"] = attempt(lambda: _end_fails(SimBackend()))
    finally:
        observe.release()
    return out


def _end_fails(be):
    g = new_graph(be)
    with be.stream(be.new_stream()):
        g.capture_begin()
        try:
            be.synchronize()  # not allowed under capture: capture_end then fails
        finally:
            g.capture_end()


def entry_fields(g: GraphEntry) -> dict:
    frames = [(code.co_name, _line_of(code, lasti)) for code, lasti in zip(g.frames[::2], g.frames[1::2])]
    return {"gid": g.gid, "seq": g.seq, "world": world_name(g.world), "pool_id": g.pool_id, "device": g.device,
            "frames": frames, "scope": g.scope, "test": g.test, "generation": g.generation, "captured": g.captured,
            "replays": g.replays, "alive": g.alive, "counted": g.counted, "referent": g() is not None}


def event_fields(e) -> dict:
    d = {"type": type(e).__name__}
    for name in ("key", "scope", "seq", "test", "site", "pool_id", "refused", "message", "raised_at"):
        v = getattr(e, name, None)
        if name == "key" and v is not None:
            v = [world_name(v[0]), *v[1:]]
        d[name] = v if isinstance(v, (int, str, bool, type(None), list)) else repr(v)
    return d


def main() -> None:
    outcomes, counts = scenarios()
    with ledger.lock:
        ledger.drain()
    seen = {id(g) for g in entries}
    for graph in kept:
        g = hooks.entry_of(graph)  # (tagged on the graph, or kept beside one that takes no attribute)
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            entries.append(g)
    entries.extend(g for g in ledger.graphs.values() if id(g) not in seen)
    out = {"counts": counts, "outcomes": outcomes,
           "entries": [entry_fields(g) for g in sorted(entries, key=lambda g: g.gid)],
           "stale": [event_fields(e) for e in ledger.stale],
           "default_stream": [event_fields(e) for e in ledger.default_stream],
           "failed_captures": [event_fields(e) for e in ledger.failed_captures]}
    kept.clear()
    entries.clear()
    del graph, g  # (the loop's last)
    gc.collect()
    # a reference the capture path took and never gave back keeps its object alive
    out["alive_after"] = sorted({type(o).__name__ for o in (r() for r in made) if o is not None})
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
