"""Why the sanitizer's one-op `torch.cuda.graph` figure is higher with 8 released pools pinned than with none
(bench_runner's flush part: runs 16-18 +4.8 / +6.0 / +8.2 % against +3.7 / +2.8 / +4.6 %), where the per-call
costs of its wrappers are the same (bench_wrapper_cost).

    python scripts/probe_pinned_flush.py [--backend auto] [--rounds 40] [--json PATH]

For 0 and 8 pinned pools, paired rounds of 8 one-op captures: plain; sanitized with a sanitizer started for
the round (as the bench does); and sanitized by one sanitizer started once for all rounds (as a process
runs). Also: how many calls of each compiled wrapper took the Python path per round.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import emit, pinned_pools  # noqa: E402
from cudagraph_lifecycle import PoolSanitizer, get_backend  # noqa: E402


def python_calls() -> int:
    """The hand-offs to Python of every live compiled wrapper (capture_begin, capture_end, flush gates)."""
    try:
        from cudagraph_lifecycle.observe import _capture
    except ImportError:  # not built: every call is Python's
        return 0
    kinds = (_capture.CaptureBegin, _capture.CaptureEnd, _capture.FlushGate)
    return sum(o.python_calls for o in gc.get_objects() if type(o) in kinds)  # (isinstance wakes lazy proxies)


def case(be, pinned: int, rounds: int) -> dict:
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

    handoffs: list[int] = []

    def per_round() -> float:
        with PoolSanitizer(be):
            before = python_calls()
            dt = capture_ms()
            handoffs.append(python_calls() - before)
            return dt

    long_lived = PoolSanitizer(be)
    sides = {"plain": capture_ms, "sanitizer per round": per_round}
    times: dict[str, list[float]] = {k: [] for k in (*sides, "sanitizer started once")}
    for fn in sides.values():
        fn()
    for i in range(rounds):
        for name in list(sides)[:: 1 if i % 2 == 0 else -1]:
            times[name].append(sides[name]())
    long_lived.start()
    try:
        capture_ms()
        for _ in range(rounds):  # a long-lived sanitizer is not switched off between rounds: its own rounds,
            times["sanitizer started once"].append(capture_ms())  # against the plain rounds before and after
    finally:
        long_lived.stop()
    plain_again = [capture_ms() for _ in range(rounds // 2)]
    del kept
    plain = times["plain"]
    out = {"pinned": pinned, "rounds": rounds, "median_ms": {k: statistics.median(v) for k, v in times.items()},
           "plain_after_ms": statistics.median(plain_again),
           "overhead_per_round_paired": statistics.median(b / a for a, b in zip(plain, times["sanitizer per round"])) - 1,
           "python_handoffs_per_round": statistics.median(handoffs)}
    out["overhead_started_once_vs_plain_medians"] = out["median_ms"]["sanitizer started once"] / statistics.median(
        plain) - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json")
    a = ap.parse_args()
    be = get_backend(a.backend)
    res = {"backend": be.name, "torch": torch.__version__, "cases": [case(be, n, a.rounds) for n in (0, 8, 0, 8)]}
    if be.name == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    emit(res, a.json)


if __name__ == "__main__":
    main()
