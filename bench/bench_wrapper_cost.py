"""Where the sanitizer's time goes on the capture path: each observed graph-API call timed twice, around our
wrapper (outer) and around the original it calls (inner), in the real capture flow (so the host's caches are
as cold as a real capture leaves them). outer - inner is the wrapper's own cost for that call; the library
times nothing of its own.

    python bench/bench_wrapper_cost.py [--backend cuda|sim] [--rounds N] [--json PATH]

Two flows: the runner's (8 graphs into one pool) and ``torch.cuda.graph``'s (a device and a host flush before
each capture), with 0 and 8 released pools pinned. The runner captures through ``observe.DirectCapture``
(the originals, one record call a graph); it is also measured with the shims in front of the capture
wrappers, which sends it through them: what raw ``capture_begin``/``capture_end`` callers pay in that flow.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import weakref
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import emit, pinned_pools  # noqa: E402
from bench.models import launch_bound_model  # noqa: E402
from cudagraph_lifecycle import CUDAGraphRunner, PoolSanitizer, get_backend  # noqa: E402
from cudagraph_lifecycle.backends import graph_apis  # noqa: E402

clock = time.perf_counter_ns
inner: dict[str, list[int]] = defaultdict(list)
outer: dict[str, list[int]] = defaultdict(list)


def shim(fn, name, store):
    def timed(*a, **k):
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            store[name].append(clock() - t0)

    timed.__wrapped__ = fn
    return timed


def targets(kind):
    api = next(a for a in graph_apis() if a.kind == kind)
    out = [(api.graph_cls, "capture_begin"), (api.graph_cls, "capture_end")]
    for hook in (api.device_flush, api.host_flush):
        if hook is not None:
            out.append(hook[:2])
    return out


def patch(tgts, store):
    saved = []
    for owner, name in tgts:
        fn = getattr(owner, name)
        saved.append((owner, name, fn, name in vars(owner)))
        setattr(owner, name, shim(fn, name, store))
    return saved


def patch_bare(tgts):
    """A Python wrapper that does nothing but call through, on each target: the floor any Python observer of
    these calls pays."""
    saved = []
    for owner, name in tgts:
        fn = getattr(owner, name)
        saved.append((owner, name, fn, name in vars(owner)))

        def bare(*a, _fn=fn, **k):
            return _fn(*a, **k)

        setattr(owner, name, bare)
    return saved


def unpatch(saved):
    for owner, name, fn, own in reversed(saved):
        if own:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)


def model(be):
    dtype = torch.float16 if be.name == "cuda" else torch.float32
    return launch_bound_model(be.torch_device(0), dtype), dtype


def runner_flow(be, fwd, dtype):
    r = CUDAGraphRunner(fwd, [1, 2, 4, 8, 16, 32, 64, 128], (256,), dtype=dtype, backend=be, warmup=1)
    gc.collect()
    r.capture()
    r.release()


def graph_flow(be, stream, x):
    pool, gs = be.graph_pool_handle(), []
    for _ in range(8):
        g = be.new_graph()
        with be.graph(g, pool=pool, stream=stream):
            (x + 1).relu_()
        gs.append(g)
    for g in gs:
        g.reset()


def measure(be, flow, rounds, tgts, direct=False):
    """Each observed call's wrapper cost in ``flow``, sanitized: outer minus inner time per call. With
    ``direct``, the runner's own path (observe.DirectCapture): its capture_begin and capture_end are the
    originals, so what the sanitizer adds per graph is the record call (timed from outside, nothing inside) and
    the flushes' wrappers; the capture methods are left unshimmed, or the runner would leave that path."""
    from cudagraph_lifecycle import observe

    inner.clear()
    outer.clear()
    if direct:
        tgts = [t for t in tgts if t[1] not in ("capture_begin", "capture_end")]
    cls = next(a for a in graph_apis() if a.kind == be.name).graph_cls
    saved_in = patch(tgts, inner)
    try:
        with PoolSanitizer(be):
            saved_out = patch(tgts, outer)
            path = observe.direct_capture(cls) if direct else None
            if direct:
                assert path is not None, "the runner's direct path is not in place"
                record = path.record
                path.record = shim(record, "record", outer)
            try:
                flow()  # warm
                inner.clear()
                outer.clear()
                for _ in range(rounds):
                    flow()
            finally:
                if path is not None:
                    path.record = record
                unpatch(saved_out)
    finally:
        unpatch(saved_in)
    res = {}
    for name in outer:
        o, i = outer[name], inner.get(name) or [0] * len(outer[name])
        diff = [a - b for a, b in zip(o, i)]
        res[name] = {"calls": len(o), "wrapper_us_median": statistics.median(diff) / 1e3,
                     "wrapper_us_mean": statistics.fmean(diff) / 1e3, "original_us_median": statistics.median(i) / 1e3,
                     "wrapper_us_per_round": sum(diff) / rounds / 1e3}
        per = len(o) // rounds
        if per > 1 and len(o) == per * rounds:
            # a round's first call pays for the previous round's release (a flush records it; the capture after
            # it may find the books changed): apart from the rest, it shows what a release costs the next round
            res[name]["wrapper_us_first_of_round_median"] = statistics.median(diff[::per]) / 1e3
            res[name]["wrapper_us_rest_median"] = statistics.median(
                d for k, d in enumerate(diff) if k % per) / 1e3
    res["wrapper_us_per_capture"] = sum(v["wrapper_us_mean"] * v["calls"] for v in res.values()) / (8 * rounds)
    return res


def layers(be, flow, rounds):
    """The floor under our capture_begin wrapper, layer by layer, in the same cold flow and without the
    sanitizer: a bare Python pass-through, + the stack our wrapper takes (CAPTURE_STACK_DEPTH frames), + the
    ledger's entry (a weak reference to the graph) made, tagged on the graph and queued, as the wrapper does
    it (into a ledger of its own). What ours costs above the last is the judging; what the first costs no
    Python observer can avoid."""
    from cudagraph_lifecycle.ledger import CAPTURE_STACK_DEPTH, Ledger
    from cudagraph_lifecycle.observe import wrappers

    record = wrappers.recorder(wrappers.Hooks(Ledger(), {}))  # a ledger of its own: counted nowhere else

    owner = next(a for a in graph_apis() if a.kind == be.name).graph_cls
    getframe, more = sys._getframe, range(CAPTURE_STACK_DEPTH - 1)

    def passthrough(orig):
        def w(graph, pool=None, *a, **k):
            return orig(graph, pool, *a, **k)
        return w

    def layer(orig, entry):  # the stack walk as the wrapper inlines it; then, with entry, the tag
        def w(graph, pool=None, *a, **k):
            orig(graph, pool, *a, **k)
            f = getframe(1)
            frames = [f.f_code, f.f_lasti]
            for _ in more:
                f = f.f_back
                if f is None:
                    break
                frames += (f.f_code, f.f_lasti)
            if entry:
                record(graph, be, 0, pool, frames)
        return w

    res = {}
    variants = (("python_passthrough", passthrough), ("plus_stack", lambda o: layer(o, False)),
                ("plus_entry", lambda o: layer(o, True)))
    for name, make in variants:
        inner.clear()
        outer.clear()
        saved_in = patch([(owner, "capture_begin")], inner)
        original = owner.capture_begin
        owner.capture_begin = make(original)
        saved_out = patch([(owner, "capture_begin")], outer)
        try:
            flow()
            inner.clear()
            outer.clear()
            for _ in range(rounds):
                flow()
        finally:
            unpatch(saved_out)
            owner.capture_begin = original
            unpatch(saved_in)
        diff = [a - b for a, b in zip(outer["capture_begin"], inner["capture_begin"])]
        res[name] = {"us_median": statistics.median(diff) / 1e3, "us_mean": statistics.fmean(diff) / 1e3}
    return res


def segment_round(be, stream, x, graphs):
    """One round of the segment profile: ``graphs`` one-op captures into one pool through ``torch.cuda.graph``,
    each timed as (entering the context, the captured op, leaving it) in ns; then the graphs are reset."""
    gc.collect()
    pool, gs, seg = be.graph_pool_handle(), [], []
    for _ in range(graphs):
        g = be.new_graph()
        t0 = clock()
        with be.graph(g, pool=pool, stream=stream):
            t1 = clock()
            (x + 1).relu_()
            t2 = clock()
        t3 = clock()
        gs.append(g)
        seg.append((t1 - t0, t2 - t1, t3 - t2))
    for g in gs:
        g.reset()
    return seg


def segments(be, stream, x, rounds, graphs=8):
    """The ``torch.cuda.graph`` flow timed in three segments per capture, with no timer inside any wrapper:
    entering the context (the two flushes and ``capture_begin``), the captured op (torch's own work only),
    leaving it (``capture_end``). Sides, in the same rounds, each first in turn: plain; the four calls wrapped
    by functions that only call through; the least an observer of each graph's destruction does (a weak
    reference set on the graph); the sanitizer; and the sanitizer with its ``capture_begin`` wrapper replaced by
    a call-through. What the sanitizer adds to the op segment, where none of its code runs, is what its work
    costs torch's code after it (the host's caches it evicted); what the last side saves is the
    ``capture_begin`` wrapper's cost (without it the sanitizer records no graph, so that side also skips the
    flushes' and ``capture_end``'s work on recorded graphs). The parts inside that wrapper are measured by
    scripts/probe_capture_path.py."""
    tgts = targets(be.name)

    def one_round():
        return segment_round(be, stream, x, graphs)

    def bare():
        saved = patch_bare(tgts)
        try:
            return one_round()
        finally:
            unpatch(saved)

    def sanitized(without=()):
        with PoolSanitizer(be):
            saved = [(owner, name, getattr(owner, name)) for owner, name in without]
            for owner, name, ours in saved:  # our wrappers keep what they wrap (functools.wraps)
                def through(*a, _fn=ours.__wrapped__, **k):
                    return _fn(*a, **k)
                setattr(owner, name, through)
            try:
                return one_round()
            finally:
                for owner, name, ours in saved:
                    setattr(owner, name, ours)

    def weak_reference_alone():
        """The least a Python observer that sees each graph's destruction does: capture_begin wrapped by a
        function that calls through and sets a weak reference with a callback on the graph; the flushes and
        capture_end are left alone. What the sanitizer costs above it is its own bookkeeping."""
        owner, name = tgts[0]
        original = getattr(owner, name)
        saved = [(owner, name, original, name in vars(owner))]

        def gone(_ref):
            pass

        def observed(graph, *a, **k):
            original(graph, *a, **k)
            graph._bench_observed = weakref.ref(graph, gone)

        setattr(owner, name, observed)
        try:
            return one_round()
        finally:
            unpatch(saved)

    sides = {"plain": one_round, "bare_wrappers": bare, "weak_reference_alone": weak_reference_alone,
             "sanitizer": sanitized, "sanitizer_capture_begin_call_through": lambda: sanitized(tgts[:1])}
    seen: dict = {name: [] for name in sides}
    order = list(sides)
    for name in order:  # warm
        sides[name]()
    for i in range(rounds):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            seen[name].append(sides[name]())
    res: dict = {"graphs": graphs, "rounds": rounds}
    totals = {name: [sum(sum(s) for s in r) for r in rounds_] for name, rounds_ in seen.items()}
    base = seen["plain"]
    for name, rounds_ in seen.items():
        row = {part: statistics.median(s[k] for r in rounds_ for s in r) / 1e3
               for k, part in enumerate(("enter_us", "op_us", "exit_us"))}
        row["round_us"] = statistics.median(totals[name]) / 1e3
        if name != "plain":
            ratios = sorted(b / a for a, b in zip(totals["plain"], totals[name]))
            row["overhead"] = statistics.median(ratios) - 1
            row["overhead_iqr"] = [ratios[len(ratios) // 4] - 1, ratios[-len(ratios) // 4 - 1] - 1]
            # per capture, against plain in the same round: the median over rounds of the mean difference
            for k, part in enumerate(("enter", "op", "exit")):
                diffs = [statistics.fmean(s[k] for s in r) - statistics.fmean(s[k] for s in p)
                         for r, p in zip(rounds_, base)]
                row[f"extra_{part}_us"] = statistics.median(diffs) / 1e3
        res[name] = row
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--segment-rounds", type=int, help="rounds of the segment profile (default 100 on cuda)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.segment_rounds is not None and a.segment_rounds < 2:
        ap.error(f"--segment-rounds {a.segment_rounds}: give 2 or more (the spread it reports needs two rounds)")
    be = get_backend(a.backend)
    tgts = targets(be.name)
    fwd, dtype = model(be)
    out = {"backend": be.name, "torch": torch.__version__}
    out["runner"] = measure(be, lambda: runner_flow(be, fwd, dtype), a.rounds, tgts, direct=True)
    # the same flow with a shim in front of the capture wrappers, which turns the runner's direct path off:
    # what a caller of raw capture_begin/capture_end pays in it
    out["runner_through_wrappers"] = measure(be, lambda: runner_flow(be, fwd, dtype), a.rounds, tgts)
    out["runner_capture_begin_layers"] = layers(be, lambda: runner_flow(be, fwd, dtype), a.rounds)
    dev = be.torch_device(0)
    x = torch.ones(64, 256, device=dev)
    stream = be.new_stream()
    out["graph_0_pinned"] = measure(be, lambda: graph_flow(be, stream, x), a.rounds, tgts)
    kept = pinned_pools(be, stream, x, 8)
    out["graph_8_pinned"] = measure(be, lambda: graph_flow(be, stream, x), a.rounds, tgts)
    del kept
    out["graph_segments"] = segments(be, stream, x, a.segment_rounds or (100 if be.name == "cuda" else 10))
    emit(out, a.json)


if __name__ == "__main__":
    main()
