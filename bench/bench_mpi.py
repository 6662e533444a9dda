"""Per engine: a reused MPI rank vs a fresh ``mpirun`` per engine, side by side in one run.

    python bench/bench_mpi.py [--backend auto|sim|cuda] [--ranks 2] [--engines 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from bench.bench_worker import engine_cycle  # noqa: E402
from bench.common import emit  # noqa: E402
from pytest_cudagraph.mpi import MPI_ENV, MPIRanks  # noqa: E402


def reused_s(backend, ranks, engines):
    with MPIRanks(ranks, timeout=600) as r:
        r.call_all(engine_cycle, backend)  # first engine pays for start, import and device init
        t0 = time.perf_counter()
        for _ in range(engines):
            assert all(v for _, _, v in r.call_all(engine_cycle, backend))
        return (time.perf_counter() - t0) / engines


def fresh_mpirun_s(backend, ranks, engines):
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    code = f"from bench.bench_worker import engine_cycle; assert engine_cycle({backend!r})"
    paths = [ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    t0 = time.perf_counter()
    for _ in range(engines):
        subprocess.run([mpirun, "-n", str(ranks), sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
    return (time.perf_counter() - t0) / engines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    reused = reused_s(a.backend, a.ranks, a.engines)
    fresh = fresh_mpirun_s(a.backend, a.ranks, a.engines)
    out = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": a.backend, "ranks": a.ranks,
                    "engines": a.engines},
           "per_engine": {"reused_rank_s": reused, "fresh_mpirun_s": fresh, "ratio": fresh / reused}}
    emit(out, a.json)


if __name__ == "__main__":
    main()
