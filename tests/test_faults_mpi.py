"""What reused MPI ranks (``MPIRanks``) do when the code they run fails, one row per fault.

Each row names a fault, what it does, the exception the caller gets and the words its message must contain,
and whether the ranks are replaced. Every row runs the same way, which is the rest of the specification:

1. two ranks serve a call (their state: one call made);
2. the fault: the caller gets exactly that exception type with those words;
3. replaced ranks: the controller, the MPI daemon (orted) and every rank of before are gone right after the
   fault (a rank that hangs costs its process group, not a process left behind);
4. the SAME ``MPIRanks`` object serves the next call: on new ranks with fresh state (``replaced``) or on the
   same ranks with their state kept;
5. after ``close()``, no process of the controller's tree is left.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_cudagraph.mpi import MPIRanks, RankError, mpi_unavailable_reason
from pytest_cudagraph.worker import UnpicklableCallableError, WorkerCrashed, WorkerTimeout

pytestmark = pytest.mark.skipif(mpi_unavailable_reason() is not None, reason=str(mpi_unavailable_reason()))

STATE = {"n": 0}


def bump() -> int:
    STATE["n"] += 1
    return STATE["n"]


def rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def segv_on_rank_1():
    import ctypes

    if rank() == 1:
        ctypes.string_at(0)  # a real SIGSEGV, in C, under this Python frame


SEGV_AT = f"{__file__}:{segv_on_rank_1.__code__.co_firstlineno + 4} in segv_on_rank_1"


def crash_after_hazard_on_rank_1():
    """Rank 1 tears down a pool with live blocks under expandable segments (only reported), then frees them:
    the simulated allocator crashes the rank, as torch 2.11 did on the H200."""
    if rank() != 1:
        return
    from cudagraph_lifecycle import PoolSanitizer
    from cudagraph_lifecycle.backends.sim import SimBackend
    from cudagraph_lifecycle.conformance import Ctx, _carve

    be = SimBackend(expandable_segments=True)
    PoolSanitizer(be, expandable_teardown="report").start()
    _, g, kept = _carve(Ctx(be), 100 << 20, 20, 2 << 20)
    g.reset()
    be.empty_cache()
    del kept
    be.empty(4)


HAZARD_AT = f"{__file__}:{crash_after_hazard_on_rank_1.__code__.co_firstlineno + 12} in crash_after_hazard_on_rank_1"


def hang_on_rank_0():
    if rank() == 0:
        time.sleep(30)


def raise_on_rank_1():
    if rank() == 1:
        raise ValueError("shard 1 of the weights is missing")


def unpicklable_closure(ranks: MPIRanks) -> Any:
    lock = threading.Lock()
    return ranks.call_all(lambda: lock)


def tree(pid: int) -> set[int]:
    """``pid`` and every process descended from it (orted leaves the controller's session, not its tree)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass
    found, todo = {pid}, [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p} - found
        found |= kids
        todo += kids
    return found


def left(pids: set[int], within: float = 10.0) -> set[int]:
    """The pids still running after ``within`` seconds (a zombie counts as gone: an orphan may never be
    reaped here)."""
    deadline = time.monotonic() + within
    while True:
        running = set()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        running.add(pid)
            except FileNotFoundError:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


@dataclass(frozen=True)
class Row:
    id: str
    does: str
    act: Callable[[MPIRanks], Any]
    raises: type[BaseException]
    words: tuple[str, ...]
    replaced: bool
    timeout: float = 60


ROWS = [
    Row("rank-segfaults", "rank 1 segfaults in C (ctypes.string_at(0))", lambda r: r.call_all(segv_on_rank_1),
        WorkerCrashed, ("rank 1", "died during the call", "Segmentation fault", SEGV_AT), replaced=True),
    Row("rank-crashes-after-a-recorded-hazard", "rank 1 frees blocks of a pool torn down under expandable segments",
        lambda r: r.call_all(crash_after_hazard_on_rank_1), WorkerCrashed,
        ("rank 1", "died during the call", "the sanitizer recorded before the crash",
         f"20 MiB (20971520 bytes) alive at the reset at {HAZARD_AT}"), replaced=True),
    Row("rank-hangs", "rank 0 sleeps 30 s under a 3 s timeout", lambda r: r.call_all(hang_on_rank_0),
        WorkerTimeout, ("past the timeout of 3s", "in _run_batch"), replaced=True, timeout=3),
    Row("rank-raises", "rank 1 raises ValueError", lambda r: r.call_all(raise_on_rank_1),
        RankError, ("rank 1 (pid", "ValueError: shard 1 of the weights is missing", "traceback on rank 1",
                    "in raise_on_rank_1"), replaced=False),
    Row("unpicklable-callable", "a lambda over a lock", unpicklable_closure,
        UnpicklableCallableError, ("closure over an object that cannot be pickled", "module-level function"),
        replaced=False),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_fault(row: Row):
    ranks = MPIRanks(2, timeout=60)
    try:
        before = ranks.call_all(bump)
        assert [v for _, _, v in before] == [1, 1]
        procs = tree(ranks.controller.pid)
        assert {pid for _, pid, _ in before} <= procs, "the ranks are not under the controller"
        ranks.controller.timeout = row.timeout
        with pytest.raises(row.raises) as e:
            row.act(ranks)
        ranks.controller.timeout = 60
        for word in row.words:
            assert word in str(e.value), f"{row.does}: {word!r} not in the report:\n{e.value}"
        if row.replaced:
            assert not left(procs, 0.5), f"{row.does}: processes of the failed ranks still run: {left(procs, 0)}"
        after = ranks.call_all(bump)
        if row.replaced:
            assert [v for _, _, v in after] == [1, 1] and not {p for _, p, _ in after} & procs
        else:
            kept = [(r, p, 2) for r, p, _ in before]
            assert after == kept, f"{row.does}: the ranks lost their process or state"
        procs = tree(ranks.controller.pid)
    finally:
        ranks.close()
    assert not left(procs, 0.5), f"processes outlived close(): {left(procs, 0)}"
