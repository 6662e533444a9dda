"""The reused worker's child process, from the parent's side: the start method, starting a child, and ending
it with everything it started.

Never forks a process whose CUDA is initialized (the child could not use CUDA): ``auto`` forks when the
parent has not touched CUDA, and spawns (cloudpickle for closures and lambdas) when it has; decided again at
every start, so a restart after the parent initialized CUDA spawns.

The child runs in its own session: a terminal's Ctrl-C reaches only pytest, and ending the worker (close, a
timeout, a crash, an interrupted call, a worker dropped unclosed, the session's exit) kills the whole
session, the child's descendants (read while it lives; the child is their subreaper) and every process whose
environment carries the child's tag, so what left the session (a daemon, Open MPI's orted) goes too. Not
caught: a double-forked daemon that never execs, once the child has crashed.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable

from cudagraph_lifecycle.ledger import is_user_file

from .child import _child_main
from .crash import HAZARD_VAR, hazard_path
from .protocol import main_callables

START_METHODS = ("auto", "fork", "spawn", "forkserver")
TAG_VAR = "CUDAGRAPH_WORKER_TAG"  # in a child's environment, inherited by everything it starts


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def resolve_start_method(method: str) -> tuple[str, str]:
    """The start method to use and a one-line reason."""
    if method not in START_METHODS:
        raise ValueError(f"unknown start method {method!r}: choose one of {', '.join(START_METHODS)}")
    cuda = cuda_initialized()
    if method == "auto":
        if cuda:
            return "spawn", "spawn: this process already initialized CUDA, and a forked child could not use it"
        if "fork" not in mp.get_all_start_methods():
            return "spawn", "spawn: fork is not available on this platform"
        return "fork", "fork: this process has not initialized CUDA"
    if method == "fork" and cuda:
        raise ValueError(
            "start method 'fork' was asked for, but this process already initialized CUDA: a forked child "
            "fails with 'Cannot re-initialize CUDA in forked subprocess'. Use 'spawn' or 'auto', or keep "
            "CUDA out of the pytest process (do GPU work inside the worker)"
        )
    return method, f"{method}: as configured"


_THREADS_WARNED = False


def _warn_forked_with_threads(said: list) -> None:
    """Python 3.12 warns at every fork of a process that runs threads (a lock another thread held is held
    for good in the child): once a session, with what to do about it; other warnings pass on as they were."""
    global _THREADS_WARNED
    for w in said:
        try:  # (a filter that makes warnings errors must not lose the started child)
            if issubclass(w.category, DeprecationWarning) and "is multi-threaded, use of fork()" in str(w.message):
                if not _THREADS_WARNED:
                    _THREADS_WARNED = True
                    warnings.warn("workers fork from a process that runs other threads (native ones count too; "
                                  f"Python's: {', '.join(t.name for t in threading.enumerate())}): a lock another "
                                  "thread held at the fork stays held in the worker. Should a worker hang at its "
                                  "start, set --cudagraph-start-method=spawn (CUDAGRAPH_START_METHOD=spawn)",
                                  RuntimeWarning, stacklevel=5)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        except Warning:
            pass


class Child:
    """One started child: its process, the parent's end of its pipe, its stderr file, its tag, and what of
    ``__main__`` it has from a fork (None where it was not forked)."""

    __slots__ = ("proc", "conn", "stderr_path", "tag", "forked_main")

    def __init__(self, proc, conn, stderr_path: str, tag: str, forked_main: dict[str, weakref.ref] | None):
        self.proc, self.conn, self.stderr_path, self.tag = proc, conn, stderr_path, tag
        self.forked_main = forked_main


_tags = itertools.count(1)


def start_child(method: str, name: str, env: dict[str, str], record: Callable[[Child], None]) -> None:
    """Starts a child with ``method`` (as resolved) and hands it to ``record``, which runs before Ctrl-C can
    land: a child started but not recorded would never be ended."""
    ctx = mp.get_context(method)
    fd, stderr_path = tempfile.mkstemp(prefix=f"cudagraph-{name}-", suffix=".stderr")
    os.close(fd)
    parent, child = ctx.Pipe(duplex=True)
    parent_pid = None if method == "forkserver" else os.getpid()  # forkserver's is its server
    tag = f"{os.getpid()}-{next(_tags)}"
    env = {**env, TAG_VAR: tag, HAZARD_VAR: hazard_path(stderr_path)}
    proc = ctx.Process(target=_child_main, args=(child, stderr_path, list(sys.path), env, parent_pid), daemon=True)
    if method != "fork":
        # spawn and forkserver start multiprocessing's resource tracker on first use, and that UNBLOCKS
        # SIGINT in this thread afterwards: start it before blocking.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    # Ctrl-C waits until the child is started and recorded: the child must not get it before it is in its
    # own session (it inherits the blocked mask and unblocks there).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        main_before = main_callables() if method == "fork" else None
        said: list = []
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always", DeprecationWarning)
                proc.start()
        except BaseException:
            os.unlink(stderr_path)
            parent.close()
            raise
        finally:
            child.close()
        _warn_forked_with_threads(said)  # the child is started: its start must be recorded below either way
        forked_main = None
        if main_before is not None:  # both before and after the fork: the child has that very object
            main_after = main_callables()
            forked_main = {k: weakref.ref(v) for k, v in main_before.items() if main_after.get(k) is v}
        record(Child(proc, parent, stderr_path, tag, forked_main))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every process as pid -> (parent pid, process group, session) (Linux /proc; empty elsewhere)."""
    table: dict[int, tuple[int, int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    _, ppid, pgrp, sid = f.read().rsplit(")", 1)[1].split()[:4]  # state, ppid, pgrp, session
                table[int(entry)] = (int(ppid), int(pgrp), int(sid))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return table


def _session_members(sid: int) -> list[int]:
    """Pids of session ``sid`` that left its process group."""
    return [pid for pid, (_, pgrp, s) in _processes().items() if s == sid and pgrp != sid]


def _descendants(root: int) -> list[int]:
    """Pids descended from ``root``: what a live child forked, also what left its session without an exec
    (which carries no tag). Read before the kill: orphans are reparented."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in _processes().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _pid_in_use(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``tag``: what a child started, also where it left the child's
    session (a daemon's setsid, Open MPI's orted) and was reparented. Linux only; elsewhere none."""
    needle = f"{TAG_VAR}={tag}\0".encode()
    me, pids = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    pids.append(int(entry))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return pids


def _kill_session(sid: int) -> None:
    """SIGKILL every process of the worker's session: its process group, and members that made their own."""
    for kill, pid in [(os.killpg, sid)] + [(os.kill, p) for p in _session_members(sid)]:
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _end_child(proc, conn, stderr_path: str | None, tag: str | None = None, tree: list[int] | None = None) -> None:
    """Ends a child's whole session, its descendants (``tree``: read while it lived) and whatever carries its
    tag, whatever its state (alive, exited, killed, crashed), and its files."""
    tree = list(tree or ())
    if proc is not None:
        if proc.exitcode is None:  # alive, so its pid (= its session id) is still its own
            tree += _descendants(proc.pid)
            _kill_session(proc.pid)
            proc.kill()  # in case it is not in its own session yet
        elif not _pid_in_use(proc.pid):
            # Gone, but what it started may live on in its session. (A process that now has its pid is
            # someone else's, and then its session is empty: a number is reused only once unreferenced.)
            _kill_session(proc.pid)
        proc.join(5)
    for pid in tree + (_tagged(tag) if tag else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if conn is not None:
        conn.close()
    for path in (stderr_path, hazard_path(stderr_path)):
        if path and os.path.exists(path):
            os.unlink(path)


def _end_dropped(owner: int, proc, conn, stderr_path: str, tag: str, name: str,
                 made_at: tuple[str, int] | None) -> None:
    """A worker garbage-collected without close(): end its child now, and say so, at the line that made it
    (a finalizer's caller is the collector, not user code). Only in the process that started it: a forked
    process that collects its inherited copy of the worker must not end the parent's."""
    if os.getpid() != owner:
        return
    pid = proc.pid
    _end_child(proc, conn, stderr_path, tag)  # first: under -W error the warning raises
    text = (f"ReusedWorker {name!r} (pid {pid}) was dropped without close(): its child and everything it started "
            "were killed. Close workers (or use them as context managers).")
    if made_at is None:
        warnings.warn(text, ResourceWarning, stacklevel=1)
    else:
        warnings.warn_explicit(text, ResourceWarning, made_at[0], made_at[1])


def _made_at() -> tuple[str, int] | None:
    """The file and line of the user's code that made a worker (not ours, pytest's, torch's nor the standard
    library's: a thread's run, a console script's)."""
    f = sys._getframe(2)
    while f is not None and not is_user_file(f.f_code.co_filename):
        f = f.f_back
    return None if f is None else (f.f_code.co_filename, f.f_lineno)

