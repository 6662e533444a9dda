"""bench/common.StartedOnce, which the sanitizer's flush figures rest on: its rounds are watched, the plain
rounds between them are not, a sanitizer started aside installs the layer afresh, and stopping restores the
graph API exactly."""

import os
import sys

import torch

from cudagraph_lifecycle import get_backend, observe
from cudagraph_lifecycle.ledger import ledger

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import StartedOnce  # noqa: E402

sys.path.pop(0)


def test_started_once_watches_its_rounds_only_and_restores_the_api():
    be = get_backend("sim")
    cls = type(be.new_graph())
    before = {name: vars(cls).get(name) for name in ("capture_begin", "capture_end", "reset")}
    x = torch.ones(4, device=be.torch_device(0))
    stream = be.new_stream()

    def capture() -> int:
        seq = ledger.seq
        g = be.new_graph()
        with be.graph(g, stream=stream):
            x.add(1)
        g.reset()
        return ledger.seq - seq  # graphs the ledger recorded

    once = StartedOnce(be)
    try:
        assert observe.installed()
        assert capture() == 0  # between its rounds: the originals stand in front
        assert once.run(capture) == 1
        wrapper = once.run(lambda: vars(cls)["capture_begin"])
        assert wrapper is not before["capture_begin"]
        fresh = []

        def per_round() -> int:
            from cudagraph_lifecycle import PoolSanitizer

            with PoolSanitizer(be):
                fresh.append(vars(cls)["capture_begin"])
                return capture()

        gates = [w for _, _, w, _ in once._ours if hasattr(w, "armed")]
        assert gates
        for g in gates:
            g.armed = False
        assert once.aside(per_round) == 1  # a sanitizer started aside watches its round with its own wrappers
        assert fresh[0] is not wrapper
        assert all(g.armed for g in gates)  # what it released waits for a flush the long-lived one must see
        assert observe.installed() and once.run(capture) == 1  # and the long-lived one comes back untouched
        assert once.run(lambda: vars(cls)["capture_begin"]) is wrapper
    finally:
        once.stop()
    assert not observe.installed()
    assert {name: vars(cls).get(name) for name in before} == before
