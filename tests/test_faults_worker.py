"""What a reused worker does when the code it runs fails, one row per fault.

Each row names a fault, what it does, the exception the caller gets and the words its message must contain,
and whether the worker's process is replaced. Every row runs the same way, which is the rest of the
specification:

1. the worker serves a call (its state: one call made), and a call that starts two ``sleep 60`` (grandchildren:
   one in the worker's session, one that made its own, as a daemon or Open MPI's orted does);
2. the fault: the caller gets exactly that exception type with those words (or no exception);
3. the SAME worker object serves the next call: in a new process with fresh state (``replaced``, counted in
   ``restarts``) or in the same process with its state kept;
4. after ``close()``, no process the worker ever ran is left: its children and both grandchildren are gone,
   whatever state the fault left them in (and a replaced process's grandchildren right at the replacement).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_cudagraph.worker import (
    RemoteError,
    ReusedWorker,
    UnpicklableCallableError,
    WorkerCrashed,
    WorkerTimeout,
)

STATE = {"n": 0}


def bump() -> tuple[int, int]:
    STATE["n"] += 1
    return STATE["n"], os.getpid()


def start_sleepers() -> tuple[int, int]:
    return subprocess.Popen(["sleep", "60"]).pid, subprocess.Popen(["sleep", "60"], start_new_session=True).pid


def segv_here():
    import ctypes

    return ctypes.string_at(0)  # a real SIGSEGV, in C, under this Python frame


SEGV_AT = f"{__file__}:{segv_here.__code__.co_firstlineno + 3} in segv_here"


def exit_3():
    print("about to exit", file=sys.stderr, flush=True)
    os._exit(3)


def out_of_memory():
    raise MemoryError("cannot allocate the KV cache")


def system_exit():
    sys.exit(4)


def nap(seconds: float) -> None:
    time.sleep(seconds)


def _loaded_slowly() -> SlowToLoad:
    if os.environ.get("CUDAGRAPH_IN_WORKER"):
        time.sleep(30)
    return SlowToLoad()


class SlowToLoad:
    """A callable that takes 30 s to unpickle in a worker, as one whose module is slow to import does."""

    def __reduce__(self):
        return _loaded_slowly, ()

    def __call__(self) -> None:
        return None


def gone(pid: int, within: float = 5.0) -> bool:
    """The process is gone or a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def signal_mid_call(sig: signal.Signals) -> Callable[[ReusedWorker], Any]:
    def act(w: ReusedWorker) -> Any:
        threading.Timer(0.3, os.kill, (w.pid, sig)).start()
        return w.call(nap, 30)

    return act


def ctrl_c_mid_call(w: ReusedWorker) -> Any:
    # SIGINT to this (pytest's) process, as a terminal's Ctrl-C; the call is short so that, if the
    # interrupted child were kept, its late reply would answer the next call (step 3 would see it).
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        return w.call(nap, 3)
    finally:
        timer.cancel()


def unpicklable_closure(w: ReusedWorker) -> Any:
    lock = threading.Lock()
    return w.call(lambda: lock)


@dataclass(frozen=True)
class Row:
    id: str
    does: str
    act: Callable[[ReusedWorker], Any]
    raises: type[BaseException] | None
    words: tuple[str, ...]
    replaced: bool
    start_method: str = "fork"
    timeout: float = 30
    frame: str | None = None  # among the innermost frames the error carries (a crash's or a hang's dump)


ROWS = [
    Row("sigsegv", "the callable segfaults in C (ctypes.string_at(0))", lambda w: w.call(segv_here),
        WorkerCrashed, ("killed by signal SIGSEGV", "innermost frames", SEGV_AT, "frames below the worker's loop left out"),
        replaced=True, frame=SEGV_AT),
    Row("sigkill-mid-call", "the test SIGKILLs the child during a call", signal_mid_call(signal.SIGKILL),
        WorkerCrashed, ("killed by signal SIGKILL", "during call 3 (nap)"), replaced=True),
    Row("sigterm-mid-call", "the test SIGTERMs the child during a call", signal_mid_call(signal.SIGTERM),
        WorkerCrashed, ("killed by signal SIGTERM",), replaced=True),
    Row("os-exit-3", "the callable prints, then os._exit(3)", lambda w: w.call(exit_3),
        WorkerCrashed, ("exited with code 3", "about to exit"), replaced=True),
    Row("os-abort", "the callable calls os.abort()", lambda w: w.call(os.abort),
        WorkerCrashed, ("killed by signal SIGABRT", "Fatal Python error: Aborted"), replaced=True),
    Row("hang-past-timeout", "the callable sleeps 30 s under a 1 s timeout", lambda w: w.call(nap, 30),
        WorkerTimeout, ("past the timeout of 1s", "in call 3 (nap);", "in nap", "frames below the worker's loop left out"),
        replaced=True, timeout=1, frame=" in nap"),
    Row("hang-loading-the-call", "the callable takes 30 s to unpickle in the worker, under a 1 s timeout",
        lambda w: w.call(SlowToLoad()),
        WorkerTimeout, ("past the timeout of 1s", "in the worker's start, before call 3 (SlowToLoad) began"),
        replaced=True, timeout=1, frame=" in _loaded_slowly"),
    Row("ctrl-c-mid-call", "Ctrl-C (SIGINT) reaches pytest during a call", ctrl_c_mid_call,
        KeyboardInterrupt, (), replaced=True),
    Row("memory-error", "the callable raises MemoryError", lambda w: w.call(out_of_memory),
        RemoteError, ("MemoryError: cannot allocate the KV cache", "in out_of_memory"), replaced=False),
    Row("system-exit", "the callable calls sys.exit(4)", lambda w: w.call(system_exit),
        RemoteError, ("SystemExit: 4", "in system_exit"), replaced=False),
    Row("unpicklable-result", "the callable returns a lock", lambda w: w.call(threading.Lock),
        RemoteError, ("UnpicklableResult", "cannot be pickled"), replaced=False),
    Row("unpicklable-callable", "a lambda over a lock, under spawn", unpicklable_closure,
        UnpicklableCallableError, ("closure over an object that cannot be pickled", "module-level function"),
        replaced=False, start_method="spawn"),
    Row("grandchild-left-running", "no fault: a call leaves `sleep 60` running", lambda w: None,
        None, (), replaced=False),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_fault(row: Row):
    w = ReusedWorker(start_method=row.start_method, timeout=row.timeout, name=row.id)
    try:
        n, pid = w.call(bump)
        sleepers = w.call(start_sleepers)
        with pytest.raises(row.raises) if row.raises else contextlib.nullcontext() as e:
            row.act(w)
        for word in row.words:
            assert word in str(e.value), f"{row.does}: {word!r} not in the report:\n{e.value}"
        if row.frame is not None:
            assert any(row.frame in f for f in e.value.frames), f"{row.does}: frames {e.value.frames}"
            # the stack the child inherited at its start (this test's call, pytest) is not the worker's
            assert "popen_fork.py" not in str(e.value) and " in test_fault" not in str(e.value), str(e.value)
        n2, pid2 = w.call(bump)
        if row.replaced:
            assert (n2, w.restarts) == (1, 1) and pid2 != pid and gone(pid), f"{row.does}: not replaced"
            assert all(gone(p) for p in sleepers), f"{row.does}: the replaced process's grandchildren run on"
        else:
            assert (n2, pid2, w.restarts) == (n + 1, pid, 0), f"{row.does}: lost its process or state"
    finally:
        w.close()
    for p in sleepers:
        assert gone(p), f"a grandchild `sleep 60` (pid {p}) outlived close()"
    assert gone(pid2), f"the worker (pid {pid2}) outlived close()"


def start_double_forked_daemon() -> int:
    """A daemon as a server's engine might start one: fork, setsid, fork again, the middle process exits; it
    never execs, so it carries no tag and has left the worker's session."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            while True:
                time.sleep(1)
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.close(r)
    os.waitpid(middle, 0)
    return pid


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_double_forked_daemon_that_never_execs_ends_with_its_worker(start_method):
    w = ReusedWorker(start_method=start_method, name="daemon")
    try:
        daemon = w.call(start_double_forked_daemon)
        worker = w.call(os.getpid)
        with open(f"/proc/{daemon}/stat") as f:  # re-parented to its worker, not to init
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == worker
    finally:
        w.close()
    assert gone(daemon), f"the daemon (pid {daemon}) outlived its worker's close()"
