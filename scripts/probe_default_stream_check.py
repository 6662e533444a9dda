"""Probe (CPU): what the default-stream check adds to a judged capture_begin wrapper, with C builtins standing
in for CUDA's device and stream reads (``int`` for the device, ``chr``/``str`` for the current and default
stream: never equal, so the check runs to its end and lets the capture through) and ``slice`` for the
original. The wrapper, the recorder and the ledger are the library's own; side by side, interleaved rounds:

- ``unjudged``: no judge for the world (the check is skipped; the device is read after the original);
- ``judged``: a judge that rules nothing (the device is read before, then the current stream).

    python3 scripts/probe_default_stream_check.py [--rounds N] [--captures N]

On the H200 the real reads are torch's C functions; this probe says what the Python around them costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cudagraph_lifecycle.backends.base import GraphAPI
from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.ledger import ledger
from cudagraph_lifecycle.observe import hooks, wrappers


class Graph:  # takes the ledger's tag as an attribute, as torch's graph does
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--captures", type=int, default=20000)
    a = ap.parse_args()
    be = SimBackend()
    api = GraphAPI(kind="probe", graph_cls=Graph, graph_backend=lambda g: be, capture_device=lambda g: 0,
                   current_device=int, current_stream=chr, default_stream=str)
    wrapper = wrappers.capture_begin(api, hooks, slice, wrappers.recorder(hooks))

    def rounds(judged: bool) -> float:
        if judged:
            hooks.judges[be.world] = [lambda event: None]
        else:
            hooks.judges.pop(be.world, None)
        graphs = [Graph() for _ in range(a.captures)]
        t0 = time.perf_counter()
        for g in graphs:
            wrapper(g)
        dt = (time.perf_counter() - t0) / a.captures * 1e6
        with ledger.lock:
            ledger.drain()
        return dt

    times: dict[str, list[float]] = {"unjudged": [], "judged": []}
    try:
        for _ in range(a.rounds):
            times["unjudged"].append(rounds(False))
            times["judged"].append(rounds(True))
    finally:
        hooks.judges.pop(be.world, None)
    for side, values in times.items():
        print(f"{side}: {statistics.median(values):.3f} us a capture (median of {a.rounds} rounds)")
    print(f"the check: {statistics.median(times['judged']) - statistics.median(times['unjudged']):+.3f} us")


if __name__ == "__main__":
    main()
