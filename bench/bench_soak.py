"""Soak: many engines in sequence in ONE reused worker, as a long-lived MPI rank or server holds them.

    python bench/bench_soak.py [--backend auto|sim|cuda] [--engines 200] [--json PATH]

Per engine: its graph pools' bytes after release (the caller copies each output out, so every pool must be
gone: 0), the process's reserved bytes after the settle, the default pool's growth, and the cycle's wall
time, and beside it the time of a fixed reference (eager matmuls on the same device, no lifecycle code).
Pass (issue 14): graph-pool bytes after release are 0 for every engine, and the cycle shows no trend against
the reference (the median of the last 20 cycle/reference ratios within the spread of the first 20): a host
that slows down partway (another tenant, a clock change) slows both, growth in what a cycle does shows
alone. The raw cycle times are reported too. Exit status 1 where it does not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402,F401 - imported before forking, as in a test session

from bench.common import emit  # noqa: E402
from pytest_cudagraph.worker import ReusedWorker  # noqa: E402


def soak(backend: str, engines: int) -> list[dict]:
    """Runs in the worker: ``engines`` cycles of the runner-based example engine."""
    from engines import make_mlp_engine

    from cudagraph_lifecycle.backends import get_backend
    from cudagraph_lifecycle.cycle import finish_sequence, run_cycle

    be = get_backend(backend)
    x, w = be.randn(8, 256), be.randn(256, 256)

    def reference() -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(64):
            y = torch.relu(y @ w)
        be.synchronize(0)
        return (time.perf_counter() - t0) * 1e3

    rows = []
    for i in range(engines):
        t0 = time.perf_counter()
        (rec,) = run_cycle(make_mlp_engine, backend, i, 1e-3, "drop", test="soak")
        dt = time.perf_counter() - t0
        rows.append({"index": i, "verdict": rec["verdict"], "failed": rec["failed"],
                     "pool_bytes_after_release": rec["leaked_bytes"] + rec["held_bytes"],
                     "reserved_after": be.memory_reserved(0), "growth_bytes": rec["growth_bytes"],
                     "cycle_ms": dt * 1e3, "reference_ms": reference()})
    finish_sequence(backend)
    return rows


def summarize(rows: list[dict], window: int = 20) -> dict:
    first = [r["cycle_ms"] for r in rows[1:window + 1]]  # the first cycle pays for lazy initialisation
    last = [r["cycle_ms"] for r in rows[-window:]]
    spread = (min(first), max(first))
    ratios = [r["cycle_ms"] / r["reference_ms"] for r in rows]
    first_r, last_r = ratios[1:window + 1], ratios[-window:]
    spread_r = (min(first_r), max(first_r))
    no_trend = spread_r[0] <= statistics.median(last_r) <= spread_r[1]
    return {
        "engines": len(rows),
        "verdicts": {v: sum(r["verdict"] == v for r in rows) for v in sorted({r["verdict"] for r in rows})},
        "failed": sum(r["failed"] for r in rows),
        "max_pool_bytes_after_release": max(r["pool_bytes_after_release"] for r in rows),
        "reserved_after_first_mib": rows[0]["reserved_after"] / 2**20,
        "reserved_after_last_mib": rows[-1]["reserved_after"] / 2**20,
        "growth_after_first_engine_bytes": sum(r["growth_bytes"] for r in rows[1:]),
        "cycle_ms_first20_median": statistics.median(first),
        "cycle_ms_first20_spread": list(spread),
        "cycle_ms_last20_median": statistics.median(last),
        "reference_ms_first20_median": statistics.median(r["reference_ms"] for r in rows[1:window + 1]),
        "reference_ms_last20_median": statistics.median(r["reference_ms"] for r in rows[-window:]),
        "ratio_first20_median": statistics.median(first_r),
        "ratio_first20_spread": list(spread_r),
        "ratio_last20_median": statistics.median(last_r),
        "no_trend": no_trend,
        "pass": all(r["pool_bytes_after_release"] == 0 for r in rows) and no_trend,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--engines", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    with ReusedWorker(start_method="auto", name="soak") as w:
        rows = w.call(soak, a.backend, a.engines)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": a.backend, "torch": torch.__version__}
    summary = summarize(rows)
    emit({"meta": meta, "summary": summary}, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    if not summary["pass"]:
        sys.exit(1)

if __name__ == "__main__":
    main()
