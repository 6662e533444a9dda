"""Reused-worker costs, side by side with bare multiprocessing in the same run.

    python bench/bench_worker.py [--backend auto|sim|cuda] [--engines N] [--rounds N] [--json PATH]

Targets (issue 3): a call into a live worker, ``w.call(noop, 1)`` end to end, <= 1.5x a bare Pipe round trip
(an echo child: ``send`` then ``recv``); a forked worker ready to take calls <= 1.5x a bare fork + first
result; per engine, a reused worker >= 200x cheaper than a fresh process per engine (start + import torch +
CUDA init), measured on the GPU.

The call figures come from one run with the echo child and the worker both up: rounds of 2000 bare round
trips and 2000 worker calls, the order swapped every round; ``ratio`` is the median of the rounds' ratios
(paired, so a load that drifts during the run moves both sides of a round alike), the times the medians of
the rounds. ``noop`` is this script's, so a function of ``__main__``, as a script's own callables are. The
start figures pair a bare fork with a worker start the same way, 15 times.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402,F401 - imported before forking, as in a test session

from bench.common import emit  # noqa: E402
from pytest_cudagraph.worker import ReusedWorker  # noqa: E402


def noop(x=None):
    return x


def _echo(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def _bare_us(a, n):
    t0 = time.perf_counter()
    for _ in range(n):
        a.send(1)
        a.recv()
    return (time.perf_counter() - t0) / n * 1e6


def _worker_us(w, n):
    t0 = time.perf_counter()
    for _ in range(n):
        w.call(noop, 1)
    return (time.perf_counter() - t0) / n * 1e6


def call_costs(rounds, n):
    """(bare round trip us, worker call us, median of the rounds' ratios), measured side by side."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(b,), daemon=True)
    p.start()
    try:
        with ReusedWorker(start_method="fork") as w:
            _bare_us(a, 200)
            _worker_us(w, 200)
            bare, ours, ratios = [], [], []
            for r in range(rounds):
                if r % 2:
                    o, b_ = _worker_us(w, n), _bare_us(a, n)
                else:
                    b_, o = _bare_us(a, n), _worker_us(w, n)
                bare.append(b_)
                ours.append(o)
                ratios.append(o / b_)
    finally:
        a.send(None)
        p.join()
    return statistics.median(bare), statistics.median(ours), statistics.median(ratios)


def _first(conn):
    conn.send(os.getpid())


def bare_fork_ms():
    ctx = mp.get_context("fork")
    t0 = time.perf_counter()
    a, b = ctx.Pipe()
    p = ctx.Process(target=_first, args=(b,), daemon=True)
    p.start()
    a.recv()
    dt = (time.perf_counter() - t0) * 1e3
    p.join()
    return dt


def worker_ready_ms():
    t0 = time.perf_counter()
    w = ReusedWorker(start_method="fork")
    w.call(os.getpid)
    dt = (time.perf_counter() - t0) * 1e3
    w.close()
    return dt


def engine_cycle(backend):
    from engines import make_mlp_engine

    from cudagraph_lifecycle.cycle import run_cycle

    return not run_cycle(make_mlp_engine, backend, 0, 1e-2, "drop")[-1]["failed"]


def per_engine_reused_s(backend, engines):
    with ReusedWorker(start_method="auto") as w:
        w.call(engine_cycle, backend)  # the worker's first engine pays for import and CUDA init
        t0 = time.perf_counter()
        for _ in range(engines):
            assert w.call(engine_cycle, backend)
        return (time.perf_counter() - t0) / engines


def per_engine_fresh_process_s(backend, engines):
    code = (
        "import sys; sys.path.insert(0, 'examples'); "
        "from bench.bench_worker import engine_cycle; "
        f"assert engine_cycle({backend!r})"
    )
    t0 = time.perf_counter()
    for _ in range(engines):
        subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
    return (time.perf_counter() - t0) / engines


def start_costs(reps):
    """(bare fork + first result ms, worker ready ms, median of the pairs' ratios), the order swapped every pair."""
    bare, ours, ratios = [], [], []
    for r in range(reps):
        if r % 2:
            o, b = worker_ready_ms(), bare_fork_ms()
        else:
            b, o = bare_fork_ms(), worker_ready_ms()
        bare.append(b)
        ours.append(o)
        ratios.append(o / b)
    return statistics.median(bare), statistics.median(ours), statistics.median(ratios)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15, help="alternations of bare round trips and worker calls")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "backend": a.backend}}
    bare, ours, ratio = call_costs(a.rounds, 2000)
    out["call"] = {"bare_pipe_roundtrip_us": bare, "worker_call_us": ours, "ratio": ratio, "target": 1.5,
                   "rounds": a.rounds}
    bf, wr, ratio = start_costs(15)
    out["start"] = {"bare_fork_first_result_ms": bf, "worker_ready_ms": wr, "ratio": ratio, "target": 1.5}
    reused = per_engine_reused_s(a.backend, a.engines)
    fresh = per_engine_fresh_process_s(a.backend, a.engines)
    out["per_engine"] = {"reused_worker_s": reused, "fresh_process_s": fresh, "ratio": fresh / reused,
                         "target": 200.0}
    emit(out, a.json)


if __name__ == "__main__":
    main()
