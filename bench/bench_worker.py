"""Reused-worker costs, side by side with bare multiprocessing in the same run.

    python bench/bench_worker.py [--backend auto|sim|cuda] [--engines N] [--json PATH]

Targets (issue 3): a call into a live worker <= 3x a bare Pipe round trip; a forked worker ready to take
calls <= 1.5x a bare fork + first result; per engine, a reused worker >= 20x cheaper than a fresh process
per engine (start + import torch + CUDA init), measured on the GPU.
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


def bare_roundtrip_us(n):
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(b,), daemon=True)
    p.start()
    for _ in range(100):
        a.send(1)
        a.recv()
    t0 = time.perf_counter()
    for _ in range(n):
        a.send(1)
        a.recv()
    dt = (time.perf_counter() - t0) / n * 1e6
    a.send(None)
    p.join()
    return dt


def worker_roundtrip_us(n):
    with ReusedWorker(start_method="fork") as w:
        for _ in range(100):
            w.call(noop, 1)
        t0 = time.perf_counter()
        for _ in range(n):
            w.call(noop, 1)
        return (time.perf_counter() - t0) / n * 1e6


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


def med(fn, reps, *args):
    return statistics.median(fn(*args) for _ in range(reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "backend": a.backend}}
    bare, ours = med(bare_roundtrip_us, 5, 2000), med(worker_roundtrip_us, 5, 2000)
    out["call"] = {"bare_pipe_roundtrip_us": bare, "worker_call_us": ours, "ratio": ours / bare, "target": 3.0}
    bf, wr = med(bare_fork_ms, 9), med(worker_ready_ms, 9)
    out["start"] = {"bare_fork_first_result_ms": bf, "worker_ready_ms": wr, "ratio": wr / bf, "target": 1.5}
    reused = per_engine_reused_s(a.backend, a.engines)
    fresh = per_engine_fresh_process_s(a.backend, a.engines)
    out["per_engine"] = {"reused_worker_s": reused, "fresh_process_s": fresh, "ratio": fresh / reused,
                         "target": 20.0}
    emit(out, a.json)


if __name__ == "__main__":
    main()
