"""The sanitizer's own memory: Python objects it keeps per live graph and per pool, and what is left once the
graphs are gone, with 10,000 captures in one process.

    python bench/bench_sanitizer_memory.py [--backend auto|cuda|sim] [--captures 10000] [--json PATH]

tracemalloc counts every Python object's bytes, in rounds of the same work with and without the sanitizer:
what a live graph costs is the difference per capture (the compiled capture path allocates the ledger's
entries from C, where tracemalloc sees the caller's file, not ours, so the count is not filtered by file).
The bytes left after each sanitized round's graphs are destroyed (and their pools erased) must not grow from
round to round: in this package's files (what stays is the bounded record of erased pools,
``ledger._REMEMBERED`` of them), and in all (what a reference the compiled path failed to drop would leave:
hundreds of bytes a capture; the interpreter's own caches move a few KiB).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from bench.common import emit  # noqa: E402
from cudagraph_lifecycle import PoolSanitizer, get_backend  # noqa: E402
from cudagraph_lifecycle.ledger import ledger  # noqa: E402

OURS = tracemalloc.Filter(True, "*cudagraph_lifecycle*")


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def ours() -> int:
    snap = tracemalloc.take_snapshot().filter_traces([OURS])
    return sum(s.size for s in snap.statistics("filename"))


def one_round(be, captures: int, per_pool: int) -> dict:
    x = torch.ones(16, device=be.torch_device(0))
    stream = be.new_stream(0)
    before, before_ours = traced(), ours()
    graphs = []
    t0 = time.perf_counter()
    with be.stream(stream):
        for i in range(captures):
            if i % per_pool == 0:
                pool = be.graph_pool_handle()
            g = be.new_graph()
            g.capture_begin(pool=pool)
            (x * 2).relu_()
            g.capture_end()
            graphs.append(g)
    capture_s = time.perf_counter() - t0
    live = traced()
    pools = captures // per_pool
    for g in graphs:
        g.reset()
    del graphs, g
    gc.collect()
    be.synchronize()
    be.empty_cache()
    be.host_empty_cache()
    ledger.snapshot(be.world)  # applies the destroyed graphs' events and settles the flushes
    after, after_ours = traced(), ours()
    return {"captures": captures, "pools": pools, "capture_s": capture_s, "bytes_before": before,
            "bytes_with_live_graphs": live, "bytes_per_live_graph": (live - before) / captures,
            "bytes_after_destroyed": after, "bytes_before_ours": before_ours, "bytes_after_destroyed_ours": after_ours, "ledger_pools": len(ledger.pools), "ledger_graphs": len(ledger.graphs),
            "ledger_erased": len(ledger.erased)}


def _remembered() -> int:
    from cudagraph_lifecycle import ledger as module

    return module._REMEMBERED


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--captures", type=int, default=10000)
    # 2 graphs a pool: 5,000 pools a round, more than the ledger's bound on erased records (4,096), so the
    # first round fills it and later rounds show the steady state
    ap.add_argument("--per-pool", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    be = get_backend(a.backend)
    from cudagraph_lifecycle.observe import compiled

    tracemalloc.start()
    plain = [one_round(be, a.captures, a.per_pool) for _ in range(2)]  # the first warms torch's own caches
    with PoolSanitizer(be):
        rounds = [one_round(be, a.captures, a.per_pool) for _ in range(a.rounds)]
    first, last = rounds[0], rounds[-1]
    out = {"meta": be.describe() | {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "capture_path": compiled.describe()},
           "rounds": rounds, "plain_rounds": plain,
           "bytes_per_live_graph": first["bytes_per_live_graph"] - plain[-1]["bytes_per_live_graph"],
           # (allocated by the ledger's Python code: counted in this package's files)
           "bytes_per_erased_pool_record": (first["bytes_after_destroyed_ours"] - first["bytes_before_ours"])
           / first["pools"],
           "growth_after_first_round": last["bytes_after_destroyed"] - first["bytes_after_destroyed"],
           "growth_last_round": last["bytes_after_destroyed"] - rounds[-2]["bytes_after_destroyed"],
           "growth_last_round_ours": last["bytes_after_destroyed_ours"] - rounds[-2]["bytes_after_destroyed_ours"],
           "erased_records_bound": _remembered(),
           "target_growth_after_first_round": 0}
    emit(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
