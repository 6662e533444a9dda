"""Real reused MPI ranks: an ``mpi4py.futures.MPIPoolExecutor`` whose ranks hold engines across calls, the
way TensorRT-LLM deploys them (a module-scoped pool of 2, 4 or 8 ranks).

The executor lives in a controller process (a :class:`ReusedWorker`), not in pytest: when a rank dies,
the MPI runtime may abort the whole job, and with it the process that spawned the ranks. Behind the
controller that costs one worker, reported as a crash with the rank's stderr. On a timeout the controller is
ended with everything it started: the MPI daemon (Open MPI's orted runs in a session of its own) and the
ranks carry the controller's tag in their environment and are killed with it. The next call starts fresh ranks.
"""

from __future__ import annotations

import operator
import os
import pickle
import shutil
import socket
import sys
from typing import Any

from . import by_value
from .worker import (
    ReusedWorker,
    WorkerError,
    attribute_to,
    dumps_call,
    freeze_startup_heap,
    ledger_seq,
    poisoned_since,
    poisons,
    program_findings,
)

# Open MPI refuses root and more ranks than cores unless told: CI machines and containers are both.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def mpi_unavailable_reason() -> str | None:
    """None when mpi4py and an MPI runtime are here, else why not (one line)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install mpi4py; it needs an MPI runtime such as Open MPI)"
    if shutil.which("mpiexec") is None and shutil.which("mpirun") is None:
        return "no MPI runtime: mpiexec is not on PATH (e.g. apt-get install openmpi-bin)"
    return None


_executor = None
_executor_size = 0
_rank_procs: dict[int, tuple[str, int]] = {}  # rank -> (hostname, pid), recorded when the ranks start


def _on_rank(payload: bytes) -> bytes:
    import faulthandler

    from mpi4py import MPI

    if not faulthandler.is_enabled():
        faulthandler.enable()  # a fatal signal on a rank names its Python frames in the crash report

    comm = MPI.COMM_WORLD
    comm.Barrier()  # every rank takes exactly one task of the batch
    rank = comm.Get_rank()
    seq = ledger_seq()
    try:
        fn, args, kwargs, test = pickle.loads(payload)
        attribute_to(test)
        freeze_startup_heap()  # as in a reused worker: once, before the first user code on this rank
        value = fn(*args, **kwargs)
        return by_value.dumps((rank, os.getpid(), "ok", value, poisoned_since(seq)))
    except BaseException as e:
        from cudagraph_lifecycle.ledger import shown_traceback

        return by_value.dumps((rank, os.getpid(), "err", (type(e).__qualname__, str(e), shown_traceback(e)),
                               poisoned_since(seq)))


def rank_dead(host: str, pid: int, here: str | None = None) -> bool:
    """Whether the rank process ``pid`` on ``host`` is known to be dead.

    Only a rank on this host can be judged (its pid is gone, or a zombie where /proc exists); a pid from
    another host means nothing here, so a rank there is never declared dead: a rank that dies on another
    host is caught by the call timeout (``--cudagraph-timeout``) instead."""
    if host != (here or socket.gethostname()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists
    try:  # a zombie still answers os.kill
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False  # no /proc here (os.kill found it), or it went just now (the next check sees it)


def _run_batch(ranks: int, payload: bytes) -> list[tuple]:
    from concurrent.futures import wait

    futs = [_executor.submit(_on_rank, payload) for _ in range(ranks)]
    while True:
        _, pending = wait(futs, timeout=0.5)
        if not pending:
            return sorted((pickle.loads(f.result()) for f in futs), key=lambda r: r[0])
        here = socket.gethostname()
        dead = [(r, host, pid) for r, (host, pid) in _rank_procs.items() if rank_dead(host, pid, here)]
        if dead:
            # A dead rank leaves the batch waiting forever, and the MPI job is broken: end this controller
            # so the caller reports a crash (the rank's own stderr is above) and starts fresh ranks.
            rank, host, pid = dead[0]
            print(f"cudagraph mpi: rank {rank} (pid {pid} on {host}) died during the call", file=sys.stderr,
                  flush=True)
            os._exit(70)


def _call_all(ranks: int, payload: bytes, path: list[str]) -> list[tuple]:
    """Runs in the controller: the same call on every rank; results sorted by rank."""
    global _executor, _executor_size
    from mpi4py.futures import MPIPoolExecutor

    if _executor is None or _executor_size != ranks:
        if _executor is not None:
            _executor.shutdown(wait=True)
        _executor = MPIPoolExecutor(max_workers=ranks, path=path)
        _executor_size = ranks
        _rank_procs.clear()
        for rank, pid, _, host, _ in _run_batch(ranks, by_value.dumps((socket.gethostname, (), {}, None))):
            _rank_procs[rank] = (host, pid)
    return _run_batch(ranks, payload)


def _ranks_findings(ranks: int, path: list[str]) -> list[dict]:
    """Runs in the controller: what each rank's program-wide sanitizer found, with its rank."""
    results = _call_all(ranks, dumps_call(program_findings, (), {}), path)
    return [{**f, "rank": rank} for rank, _, status, found, _ in results if status == "ok" for f in found]


class RankError(Exception):
    """The callable raised on one or more ranks: each rank's type, message and traceback."""

    def __init__(self, failures: list[tuple[int, int, tuple]]):
        self.failures = failures
        lines = [f"rank {rank} (pid {pid}): {t}: {m}" for rank, pid, (t, m, _) in failures]
        tb = failures[0][2][2]
        super().__init__("; ".join(lines) + f"\n\n--- traceback on rank {failures[0][0]} ---\n{tb}")


_HIDE_RANK_ERRORS = operator.methodcaller("errisinstance", (RankError, WorkerError))  # as HIDE_WORKER_ERRORS


class MPIRanks:
    """``n`` reused MPI ranks behind a controller worker: :meth:`call_all` runs a callable on every rank.

    Returns ``[(rank, pid, value), ...]``; raises :class:`RankError` if it raised on any rank, and the
    controller's :class:`WorkerCrashed` / :class:`WorkerTimeout` when a rank crashed or hung (the ranks are
    then replaced at the next call). A rank that dies on this host ends the call at once; one on another
    host only through the timeout, so give one when ranks span hosts.
    """

    def __init__(self, ranks: int = 2, timeout: float | None = None, env: dict[str, str] | None = None):
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"ranks must be a positive int, got {ranks!r}")
        reason = mpi_unavailable_reason()
        if reason:
            raise RuntimeError(f"MPI ranks are not available: {reason}")
        self.ranks = ranks
        # spawn: the controller must not inherit a parent's MPI or CUDA state
        self.controller = ReusedWorker(start_method="spawn", timeout=timeout, env={**MPI_ENV, **(env or {})},
                                       name=f"mpi{ranks}")
        self.controller.findings_call = (_ranks_findings, (ranks, list(sys.path)))

    def call_all(self, fn, *args: Any, **kwargs: Any) -> list[tuple[int, int, Any]]:
        # a rank's error points at the test's call (its own traceback is in the message); a bug of ours does not
        __tracebackhide__ = _HIDE_RANK_ERRORS
        payload = dumps_call(fn, args, kwargs)
        results = self.controller.call(_call_all, self.ranks, payload, list(sys.path))
        failures = [(rank, pid, v) for rank, pid, status, v, _ in results if status == "err"]
        if any(r[4] for r in results) or any(poisons(t, m) for _, _, (t, m, _) in failures):
            self.restart_before_next_call()  # a rank's random ops (or its allocator) are poisoned
        if failures:
            raise RankError(failures)
        return [(rank, pid, v) for rank, pid, _, v, _ in results]

    def restart_before_next_call(self) -> None:
        """A rank's CUDA is unusable (the allocator asserted): start fresh ranks at the next call."""
        self.controller.restart_before_next_call()

    def findings(self) -> list[dict]:
        """What each rank's sanitizer found outside engine cycles, with its rank (as
        :meth:`ReusedWorker.findings` reads them: also from ranks poisoned before they were replaced)."""
        return self.controller.findings()

    def close(self) -> None:
        self.controller.close()

    def __enter__(self) -> MPIRanks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
