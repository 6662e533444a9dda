"""Shared by the benchmarks and probes: print the results and write them as JSON; pools left pinned."""

import json


def emit(out: dict, path: str | None) -> None:
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def pinned_pools(be, stream, x, n: int) -> list:
    """``n`` graph pools captured under a sanitizer (so its ledger knows them), released, and pinned by their
    outputs: the returned tensors. Dead pools that every later capture is judged against."""
    from cudagraph_lifecycle import PoolSanitizer

    kept = []
    with PoolSanitizer(be):
        for _ in range(n):
            g = be.new_graph()
            with be.graph(g, pool=be.graph_pool_handle(), stream=stream):
                y = x * 2
            g.reset()
            kept.append(y)
            del g, y
    return kept


class StartedOnce:
    """One pool sanitizer started for a whole bench, as a process runs one (``CUDAGRAPH_SANITIZE=1``, a reused
    worker), whose rounds can still be paired with plain ones: its wrappers are put in front of the graph API
    for its own rounds (:meth:`run`) and taken off for the others; its ledger, judge and wrappers' state live on
    between them. :meth:`aside` sets the whole observation layer aside for a round in which another sanitizer
    starts afresh (as one started for that round does)."""

    def __init__(self, be):
        from cudagraph_lifecycle import PoolSanitizer, observe

        self._observe = observe
        self.sanitizer = PoolSanitizer(be).start()
        # every attribute the layer put in front of the graph API: (owner, name, our wrapper, what it calls)
        self._ours = [(owner, name, getattr(owner, name), calls) for owner, name, _, calls in observe._saved]
        self._take_off()

    def _take_off(self) -> None:
        for owner, name, _, calls in self._ours:
            setattr(owner, name, calls)

    def _put_back(self) -> None:
        for owner, name, wrapper, _ in self._ours:
            setattr(owner, name, wrapper)

    def run(self, fn):
        self._put_back()
        try:
            return fn()
        finally:
            self._take_off()

    def aside(self, fn):
        """``fn()`` with the layer's state (holders, wrappers, flush gates) stashed: a sanitizer started in it
        installs the layer afresh, and this one's comes back as it was, its flush gates armed (what ``fn``
        released waits for a flush, as a process's gates would know)."""
        from cudagraph_lifecycle.ledger import ledger

        ob = self._observe
        stash = (ob._holders, ob._saved[:], dict(ob._direct), ledger.flush_watchers[:])
        ob._holders, ob._saved[:] = 0, []
        ob._direct.clear()
        ledger.flush_watchers.clear()
        try:
            return fn()
        finally:
            ob._holders, ob._saved[:] = stash[0], stash[1]
            ob._direct.update(stash[2])
            ledger.flush_watchers[:] = stash[3]
            for arm in ledger.flush_watchers:
                arm()

    def stop(self) -> None:
        self._put_back()
        self.sanitizer.stop()
