"""The conformance runner: plays the table's scenarios on a backend, each on a fresh allocator world (an
isolated ``SimBackend``, or a fresh process where the allocator's assert would poison this one, or where a
scenario sets its own environment), compares each outcome with the expected one, and the command line that
prints the comparison and writes it as JSON."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

from ..backends import Backend, get_backend, isolated_backend
from ..errors import BackendUnavailableError
from .context import Ctx, classify
from .table import BY_NAME, SCENARIOS

DESCRIPTION = "The conformance table: scenarios of the caching allocator's private-pool rules, one expected outcome each."


def run_scenario(name: str, backend: str | Backend = "sim") -> str:
    """Run one scenario on a fresh allocator world (a new SimBackend, or this process's CUDA)."""
    sc = BY_NAME[name]
    be = backend if isinstance(backend, Backend) else isolated_backend(backend)
    try:
        return sc.fn(Ctx(be))
    except Exception as e:  # an unexpected error is an outcome too: it must match on both backends
        return f"raised {classify(e)}: {str(e).splitlines()[0][:120]}"


def run_isolated(name: str, backend: str, timeout: float = 120.0) -> str:
    """Run one scenario in a fresh Python process (needed on CUDA: the assert poisons the process; and for a
    scenario with its own environment, on every backend). A process killed by a signal is ``crashed: NAME``."""
    code = (
        "import sys; from cudagraph_lifecycle.conformance import run_scenario; "
        f"sys.stdout.write('@@' + run_scenario({name!r}, {backend!r})); sys.stdout.flush()"
    )
    env = {**os.environ, **(BY_NAME[name].env or {})}
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout:g}s"
    if "@@" in p.stdout:
        return p.stdout.split("@@", 1)[1].strip()
    if p.returncode < 0:
        try:
            return f"crashed: {signal.Signals(-p.returncode).name}"
        except ValueError:
            return f"crashed: signal {-p.returncode}"
    tail = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    return f"crashed rc={p.returncode}: {tail[:160]}"


def run_one(name: str, backend: str) -> str:
    """A scenario as the table runs it: in a fresh process where it sets its own environment (a crash must
    not take this process with it), else in this process on an isolated world."""
    if BY_NAME[name].env:
        return run_isolated(name, backend)
    return run_scenario(name, backend)


def run_table(backend: str = "sim", isolate: bool | None = None, jobs: int = 4) -> list[dict]:
    isolate = (not get_backend(backend).isolates_in_process) if isolate is None else isolate
    rows = []
    if isolate:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(jobs) as ex:
            outcomes = list(ex.map(lambda s: run_isolated(s.name, backend), SCENARIOS))
    else:
        outcomes = [run_one(s.name, backend) for s in SCENARIOS]
    for sc, got in zip(SCENARIOS, outcomes):
        rows.append({"scenario": sc.name, "expected": sc.expected, "outcome": got, "match": got == sc.expected})
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    ap.add_argument("--backend", default="sim", choices=["sim", "cuda", "auto"])
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--jobs", type=int, default=4)
    a = ap.parse_args(argv)
    try:
        backend = get_backend(a.backend).name
    except BackendUnavailableError as e:
        print(f"conformance: --backend {a.backend}: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = run_table(backend, jobs=a.jobs)
    width = max(len(r["scenario"]) for r in rows)
    for r in rows:
        print(f"{'ok ' if r['match'] else 'BAD'} {r['scenario']:<{width}}  {r['outcome']}"
              + ("" if r["match"] else f"   (expected {r['expected']})"))
    bad = sum(not r["match"] for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} scenarios match on {backend} in {time.time() - t0:.1f}s")
    if a.json:
        meta = {"backend": backend, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "host": os.uname().nodename} | get_backend(backend).describe()
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 1 if bad else 0

