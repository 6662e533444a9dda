"""What the sanitizer's one-op `torch.cuda.graph` figure depends on: released pools pinned (0 or 8), the heap
frozen or live, and whether the sanitizer is started for each round or once for the whole process (as
`CUDAGRAPH_SANITIZE=1` and the plugin's workers run it, and as bench_runner's flush part measures it).

    python scripts/probes/pinned_flush.py [--backend auto] [--rounds 60] [--warmup-s 3] [--json PATH]

Plain captures run for --warmup-s seconds first. The four cases run twice, the second time in the reverse order, so that a case's place in the process (the
first cases run in a fresh process; the bench's flush part runs after every other part) shows apart from
what it measures. Each case: paired rounds of 8 one-op captures into one pool, each side first in turn, a
collection before each side. Sides: plain; the sanitizer started for the round; one sanitizer started once
before the case, its wrappers set back in front of the graph API for its rounds and taken off for the
others (its ledger, judge and wrappers' state live on, as in a process); the four calls wrapped by
functions that only call through (the floor any Python observer pays). For each: the median of the
per-round ratios to plain with its 95 % interval, and the µs a capture added (the median of the per-round
differences over 8).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench import bench_wrapper_cost as wrapper_cost  # noqa: E402
from bench.bench_runner import median_ci95  # noqa: E402
from bench.common import StartedOnce, emit, pinned_pools  # noqa: E402
from cudagraph_lifecycle import PoolSanitizer, get_backend  # noqa: E402


def case(be, pinned: int, frozen: bool, rounds: int) -> dict:
    dev = be.torch_device(0)
    x = torch.ones(64, 256, device=dev)
    stream = be.new_stream()
    with be.stream(stream):
        (x + 1).relu_()
    be.synchronize()
    kept = pinned_pools(be, stream, x, pinned)

    def capture_ms() -> float:
        gc.collect()
        pool, gs = be.graph_pool_handle(), []
        t0 = time.perf_counter()
        for _ in range(8):
            g = be.new_graph()
            with be.graph(g, pool=pool, stream=stream):
                (x + 1).relu_()
            gs.append(g)
        dt = (time.perf_counter() - t0) * 1e3
        for g in gs:
            g.reset()
        return dt

    def per_round() -> float:
        with PoolSanitizer(be):
            return capture_ms()

    once = StartedOnce(be)

    tgts = wrapper_cost.targets(be.name)

    def bare() -> float:
        saved = wrapper_cost.patch_bare(tgts)
        try:
            return capture_ms()
        finally:
            wrapper_cost.unpatch(saved)

    sides = {"plain": capture_ms, "sanitizer started once": lambda: once.run(capture_ms),
             "sanitizer per round": lambda: once.aside(per_round), "call-through wrappers": bare}
    times: dict[str, list[float]] = {k: [] for k in sides}
    gc.collect()
    if frozen:
        gc.freeze()
    try:
        for fn in sides.values():
            fn()
        names = list(sides)
        for i in range(rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                times[name].append(sides[name]())
    finally:
        if frozen:
            gc.unfreeze()
        once.stop()
    del kept
    plain = times["plain"]
    lo, hi = median_ci95(rounds)
    out: dict = {"pinned": pinned, "heap": "frozen" if frozen else "live", "rounds": rounds,
                 "plain_ms": statistics.median(plain)}
    for name in names[1:]:
        ratios = sorted(b / a for a, b in zip(plain, times[name]))
        diffs = sorted((b - a) / 8 * 1e3 for a, b in zip(plain, times[name]))
        out[name] = {"overhead": statistics.median(ratios) - 1, "ci95": [ratios[lo] - 1, ratios[hi] - 1],
                     "us_per_capture": statistics.median(diffs), "ms": statistics.median(times[name])}
    return out


def warm_up(be, seconds: float) -> int:
    """Plain one-op captures for ``seconds`` before any case: a fresh process's first seconds (lazy inits, a
    host core's clock coming up) would otherwise land in the first cases only."""
    x = torch.ones(64, 256, device=be.torch_device(0))
    stream, n, end = be.new_stream(), 0, time.perf_counter() + seconds
    with be.stream(stream):
        (x + 1).relu_()
    be.synchronize()
    while time.perf_counter() < end:
        g = be.new_graph()
        with be.graph(g, pool=be.graph_pool_handle(), stream=stream):
            (x + 1).relu_()
        g.reset()
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    be = get_backend(a.backend)
    warmed = warm_up(be, a.warmup_s)
    order = [(frozen, n) for n in (0, 8) for frozen in (True, False)]
    cases = [case(be, n, frozen, a.rounds) | {"place": i} for i, (frozen, n) in enumerate(order + order[::-1])]
    res = {"backend": be.name, "torch": torch.__version__, "warm_up": {"seconds": a.warmup_s, "captures": warmed},
           "cases": cases}
    if be.name == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    emit(res, a.json)


if __name__ == "__main__":
    main()
