"""The reused worker: a long-lived child process that runs callables in order and keeps its state between
calls, as a reused MPI rank does. Crashes and timeouts come back as reports; the worker is then replaced.

Never forks a process whose CUDA is initialized (the child could not use CUDA): ``auto`` forks when the
parent has not touched CUDA, and spawns (cloudpickle for closures and lambdas) when it has.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any

import cloudpickle

START_METHODS = ("auto", "fork", "spawn", "forkserver")
_POISON_MARKERS = ("INTERNAL ASSERT FAILED", "Offset increment outside graph capture")
_CAUSE = re.compile(r"terminate called|terminating due to|what\(\)|Fatal Python error|INTERNAL ASSERT|"
                    r"Error:|Exception|Segmentation fault|Aborted|died during the call")


class WorkerError(Exception):
    """Base of the worker's reports."""


class WorkerCrashed(WorkerError):
    """The child died during a call: signal or exit code, and the tail of its stderr."""

    def __init__(self, message: str, exitcode: int | None, stderr_tail: str):
        super().__init__(message)
        self.exitcode = exitcode
        self.stderr_tail = stderr_tail


class WorkerTimeout(WorkerError):
    """A call ran past the timeout; the worker's process group was killed."""


class RemoteError(WorkerError):
    """The callable raised in the child: the child's type, message and traceback."""

    def __init__(self, type_name: str, message: str, remote_traceback: str):
        super().__init__(f"{type_name}: {message}\n\n--- worker traceback ---\n{remote_traceback}")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback

    @property
    def poisons_process(self) -> bool:
        # A StalePoolError quotes the assert it prevented: that process is fine.
        return self.type_name != "StalePoolError" and any(m in self.remote_message for m in _POISON_MARKERS)


class UnpicklableCallableError(WorkerError, TypeError):
    """A callable or argument could not be sent to the worker."""


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


def _set_parent_death_signal() -> None:
    # Linux: the worker dies with the pytest process, even on SIGKILL of the parent.
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_PARENT_PID = os.getpid()


def _forked() -> bool:
    # Module state survives fork but not spawn: a child that still sees another process's pid was forked.
    return _PARENT_PID != os.getpid()


def _child_main(conn, stderr_path: str, sys_path: list[str], env: dict[str, str]) -> None:
    os.setpgrp()  # its own process group: a timeout kills everything it started
    _set_parent_death_signal()
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # A fatal signal dumps the worker's Python stack into its own stderr, which the crash report quotes.
    faulthandler.enable(file=sys.stderr)
    # On a timeout the parent sends SIGUSR1 first: every thread's stack goes into the report.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    sys.path[:] = sys_path
    torch = sys.modules.get("torch")
    if torch is not None and _forked():
        # A forked child inherits an OpenMP pool whose threads did not survive the fork: the first parallel
        # CPU op would hang. One thread, as torch's DataLoader workers do.
        torch.set_num_threads(1)
    os.environ.update(env)
    os.environ["CUDAGRAPH_IN_WORKER"] = "1"
    if os.environ.get("CUDAGRAPH_SANITIZE"):
        from cudagraph_lifecycle.sanitizer import install_from_env

        install_from_env()  # before any user code: the first capture in this process is watched
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not payload:
            return
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            value = fn(*args, **kwargs)
            try:
                reply = cloudpickle.dumps(("ok", value))
            except Exception as e:
                reply = cloudpickle.dumps(
                    ("err", "UnpicklableResult", f"the worker's return value cannot be pickled: {e}", "")
                )
        except BaseException as e:  # report everything, SystemExit included, and keep serving
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            reply = cloudpickle.dumps(("err", type(e).__qualname__, str(e), tb))
            del e
        conn.send_bytes(reply)


_live: weakref.WeakSet[ReusedWorker] = weakref.WeakSet()


def close_all_workers() -> None:
    for w in list(_live):
        w.close()


atexit.register(close_all_workers)


class ReusedWorker:
    """A child process that keeps its state across :meth:`call`s.

    ``call(fn, *args, **kwargs)`` returns ``fn``'s value, or raises :class:`RemoteError` with the child's
    traceback, :class:`WorkerCrashed` (the child died: signal name or exit code, stderr tail, the
    allocator's message if it printed one) or :class:`WorkerTimeout`. After a crash, a timeout, or an
    error that poisons CUDA in the child, the next call starts a new child (``restarts`` counts them).
    """

    def __init__(
        self,
        start_method: str = "auto",
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        name: str = "worker",
    ):
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.requested_method = start_method
        self.start_method, self.reason = resolve_start_method(start_method)
        self.timeout = timeout
        self.env = dict(env or {})
        self.name = name
        self.calls = 0
        self.restarts = 0
        self._proc = None
        self._conn = None
        self._stderr_path: str | None = None
        self._lock = threading.Lock()
        self._needs_restart = False
        _live.add(self)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> ReusedWorker:
        if self.alive:
            return self
        ctx = mp.get_context(self.start_method)
        fd, self._stderr_path = tempfile.mkstemp(prefix=f"cudagraph-{self.name}-", suffix=".stderr")
        os.close(fd)
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child_main, args=(child, self._stderr_path, list(sys.path), self.env), daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        self._needs_restart = False
        return self

    def stderr_tail(self, lines: int = 20) -> str:
        if not self._stderr_path or not os.path.exists(self._stderr_path):
            return ""
        with open(self._stderr_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if proc is None:
            return
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        proc.join(5)

    def key_lines(self, limit: int = 8) -> list[str]:
        """The lines of the worker's whole stderr that name a cause (a tail can miss them under a long stack)."""
        if not self._stderr_path or not os.path.exists(self._stderr_path):
            return []
        with open(self._stderr_path, errors="replace") as f:
            hits = [ln.rstrip() for ln in f if _CAUSE.search(ln)]
        return hits[-limit:]

    def _crash_report(self, proc_exitcode: int | None, during: str) -> WorkerCrashed:
        tail = self.stderr_tail()
        if proc_exitcode is not None and proc_exitcode < 0:
            try:
                cause = f"killed by signal {signal.Signals(-proc_exitcode).name}"
            except ValueError:
                cause = f"killed by signal {-proc_exitcode}"
        else:
            cause = f"exited with code {proc_exitcode}"
        assert_lines = [ln for ln in tail.splitlines() if any(m in ln for m in _POISON_MARKERS)]
        msg = f"worker {self.name} (pid {self.pid}) {cause} during {during}"
        if assert_lines:
            msg += f"\nallocator: {assert_lines[-1].strip()}"
        causes = [ln for ln in self.key_lines() if ln not in tail]
        if causes:
            msg += "\n--- cause lines from the worker's stderr ---\n" + "\n".join(causes)
        if tail.strip():
            msg += f"\n--- last lines of the worker's stderr ---\n{tail.rstrip()}"
        return WorkerCrashed(msg, proc_exitcode, tail)

    def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._needs_restart:
                self._kill()
                self.restarts += 1
            try:
                payload = cloudpickle.dumps((fn, args, kwargs))
            except Exception as e:
                name = getattr(fn, "__qualname__", repr(fn))
                raise UnpicklableCallableError(
                    f"cannot send {name} to the worker: {type(e).__name__}: {e}. It is probably a closure over "
                    "an object that cannot be pickled (a lock, a CUDA tensor, an open file, a generator). "
                    "Make it a module-level function and pass plain values as arguments, or build the "
                    "object inside the worker"
                ) from None
            self.start()
            self.calls += 1
            during = f"call {self.calls} ({getattr(fn, '__qualname__', type(fn).__name__)})"
            try:
                self._conn.send_bytes(payload)
            except (BrokenPipeError, OSError):
                self._proc.join(5)
                report = self._crash_report(self._proc.exitcode, during)
                self._needs_restart = True
                raise report from None
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            while True:
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                if self._conn.poll(wait):
                    try:
                        reply = self._conn.recv_bytes()
                        break
                    except (EOFError, OSError):
                        pass
                if not self._proc.is_alive() or (self._conn.closed if self._conn else True):
                    self._proc.join(5)
                    report = self._crash_report(self._proc.exitcode, during)
                    self._needs_restart = True
                    raise report
                if deadline is not None and time.monotonic() >= deadline:
                    pid = self.pid
                    try:
                        os.kill(pid, signal.SIGUSR1)  # dump the hung worker's stacks before the kill
                        time.sleep(0.5)
                    except ProcessLookupError:
                        pass
                    tail = self.stderr_tail(60)
                    self._kill()
                    self._needs_restart = False
                    self.restarts += 1
                    raise WorkerTimeout(
                        f"worker {self.name} (pid {pid}) ran past the timeout of {self.timeout:g}s in {during}; "
                        f"its process group was killed"
                        + (f"\n--- last lines of the worker's stderr ---\n{tail.rstrip()}" if tail.strip() else "")
                    )
            status, *rest = cloudpickle.loads(reply)
            if status == "ok":
                return rest[0]
            err = RemoteError(*rest)
            if err.poisons_process:
                self._needs_restart = True  # CUDA in that process is unusable from now on
            raise err

    def restart_before_next_call(self) -> None:
        """The child's CUDA is unusable (the allocator asserted): replace it at the next call."""
        self._needs_restart = True

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self.alive:
                try:
                    self._conn.send_bytes(b"")
                    self._proc.join(2)
                except (BrokenPipeError, OSError):
                    pass
            self._kill()
            if self._stderr_path and os.path.exists(self._stderr_path):
                os.unlink(self._stderr_path)
                self._stderr_path = None
        _live.discard(self)

    def __enter__(self) -> ReusedWorker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReusedWorker(name={self.name!r}, method={self.start_method!r}, pid={self.pid}, calls={self.calls})"
