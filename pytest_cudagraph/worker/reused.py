"""The reused worker: a long-lived child process that runs callables in order and keeps its state between
calls, as a reused MPI rank does. Crashes and timeouts come back as reports; the worker is then replaced.

:class:`ReusedWorker` is the face; its jobs live beside it in this package: ``process`` (start method,
starting and ending a child and what it started), ``protocol`` (calls, replies, the wait), ``crash`` (a
crashed or hung child as a report) and ``child`` (the child's side). The names the plugin, its tests and its
users import are exported by the package (``pytest_cudagraph.worker``).
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
import weakref
from typing import Any

from cudagraph_lifecycle.choices import SANITIZE_ENV_OFF

from .child import program_findings
from .crash import cause_lines, crash_report, read_stderr, tail_of, timeout_report
from .process import (
    Child,
    _descendants,
    _end_child,
    _end_dropped,
    _kill_session,
    _made_at,
    resolve_start_method,
    start_child,
)
from .protocol import HIDE_WORKER_ERRORS, Channel, NoReply, RemoteError, WorkerError, dumps_call

# close() waits this long for a call running in another thread before it kills the child anyway, and this
# long for an idle child to leave on its own.
_CLOSE_LOCK_WAIT_S = 1.0
# A call made for a report (ask) gets this long at most, whatever the worker's timeout.
_ASK_WAIT_S = 30.0
_CLOSE_EXIT_WAIT_S = 2.0


def finding_key(f: dict) -> tuple:
    """What tells two findings apart across processes: pool ids are unique only within one (pid), pids are
    reused (the worker's child), and MPI ranks share a worker."""
    key = f.get("pid"), f.get("worker"), f.get("rank"), f["kind"], tuple(f["pool_id"] or ()), f["device"]
    if f["kind"] in ("default_stream_capture", "stale_capture"):  # about a line and a test, not only a pool
        key += (tuple(f.get("sites") or ()), tuple(f.get("tests") or ()))
    return key


class ReusedWorker:
    """A child process that keeps its state across :meth:`call`s.

    ``call(fn, *args, **kwargs)`` returns ``fn``'s value, or raises :class:`RemoteError` with the child's
    traceback, :class:`WorkerCrashed` (the child died: signal name or exit code, the innermost frames of the
    crash, stderr tail, the allocator's message if it printed one) or :class:`WorkerTimeout`. After a crash,
    a timeout, an interrupted call (Ctrl-C), or an error that poisons CUDA in the child, the next call starts
    a new child (``restarts`` counts them).

    The start method is decided at every start from ``requested_method`` and this process's CUDA state then;
    ``start_method`` and ``reason`` say what the current child used (before the first start: what it would).
    """
    __module__ = "pytest_cudagraph.worker"  # named as it is imported, as the errors are

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
        # checked now, so a wrong setting fails where it is made; decided again at every start
        self.start_method, self.reason = resolve_start_method(start_method)
        self.timeout = timeout
        self.timeout_from: str | None = None  # where the timeout was set, for its report (the plugin's option)
        self.env = dict(env or {})
        self.name = name
        self._made_at = _made_at()
        self.calls = 0
        self.restarts = 0
        self._proc = None
        self._conn = None
        self._stderr_path: str | None = None
        self._tag: str | None = None  # in the child's environment: finds what it started wherever it went
        self._channel: Channel | None = None
        self._forked_main: dict[str, weakref.ref] | None = None  # what of __main__ a forked child has
        self._dropped: weakref.finalize | None = None  # ends the child if this object is dropped unclosed
        self._lock = threading.Lock()
        self._needs_restart = False
        self._harvested: list[dict] = []  # findings of poisoned children, asked before they were replaced
        self.findings_call: tuple = (program_findings, ())  # what asks a child for its findings
        self._reported: set[tuple] = set()  # the findings findings() returned already
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
        self._kill()  # a child that died between calls: its session and its stderr file go first
        try:
            self.start_method, self.reason = resolve_start_method(self.requested_method)
        except ValueError as e:
            raise ValueError(f"worker {self.name} cannot start: {e}") from None
        start_child(self.start_method, self.name, self.env, self._started)
        return self

    def _started(self, child: Child) -> None:
        """Records a child just started (Ctrl-C still waits)."""
        self._proc, self._conn, self._stderr_path, self._tag = child.proc, child.conn, child.stderr_path, child.tag
        self._forked_main = child.forked_main
        self._channel = Channel(child.conn)
        self._needs_restart = False
        _live.add(self)  # again after a close(): close_all_workers must find it
        # Dropped without close(), the child would live (and hold its GPU memory) until the session ends:
        # the child keeps a copy of this end of the pipe, so it never sees EOF.
        self._dropped = weakref.finalize(self, _end_dropped, os.getpid(), child.proc, child.conn, child.stderr_path,
                                         child.tag, self.name, self._made_at)
        self._dropped.atexit = False  # at exit close_all_workers ends live workers politely

    def stderr_tail(self, lines: int = 20) -> str:
        return tail_of(read_stderr(self._stderr_path), lines)

    def key_lines(self, limit: int = 8) -> list[str]:
        """The lines of the worker's whole stderr that name a cause (a tail misses them under a long stack)."""
        return cause_lines(read_stderr(self._stderr_path), limit)

    def _kill(self, tree: list[int] | None = None) -> None:
        """Ends the child's whole session, whatever the child's state (alive, exited, killed, crashed)."""
        if self._dropped is not None:
            self._dropped.detach()
            self._dropped = None
        _end_child(self._proc, self._conn, self._stderr_path, self._tag, tree)
        self._proc = self._conn = self._stderr_path = self._tag = self._channel = self._forked_main = None

    def _replace(self) -> None:
        """The child is of no use any more (crashed, hung, interrupted, poisoned): the next call starts one."""
        self._kill()
        self.restarts += 1

    @staticmethod
    def _during(number: int | None, fn) -> str:  # built only for a report
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return f"call {number} ({name})" if number is not None else f"the plugin's call {name}"

    def _exchange(self, payload: bytes, number: int | None, fn, limit: float | None = None) -> bytes:
        """Sends one call and returns the child's reply (waiting ``limit`` seconds, by default the worker's
        timeout); raises the crash or timeout report."""
        proc = self._proc
        limit = self.timeout if limit is None else limit
        try:
            return self._channel.exchange(payload, proc, limit)
        except NoReply as e:
            died = e.died
        during = self._during(number, fn)  # raised out of the except clause: the report is the whole story
        if died:
            raise crash_report(proc, self.name, self._stderr_path, during)
        raise timeout_report(proc, self.name, self._stderr_path, during, limit,
                             self.timeout_from if limit == self.timeout else None)

    def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        # the child's error points at the test's call (its traceback is in the message); a bug of ours does not
        __tracebackhide__ = HIDE_WORKER_ERRORS
        # pickled before the start: a callable that cannot travel fails without starting a child
        forked_main = self._forked_main
        payload = dumps_call(fn, args, kwargs, forked_main)
        with self._lock:
            if self._needs_restart:
                self._harvest()  # a poisoned child's Python still answers
                if self._needs_restart:  # (a failed ask replaced it already)
                    self._replace()
            if self._proc is None or self._proc.exitcode is not None:  # exitcode: is_alive less a getpid
                self.start()
            if forked_main is not None and self._forked_main is not forked_main:
                payload = dumps_call(fn, args, kwargs, self._forked_main)  # for the child started just now
            self.calls += 1
            try:
                reply = self._exchange(payload, self.calls, fn)
            except BaseException:
                # A crash, a timeout, or Ctrl-C / an error here while the child is mid-call: its reply would
                # answer the next call. End it now (promptly: no waiting for the call) and replace it.
                self._replace()
                raise
            status, poisoned, *rest = pickle.loads(reply)
            if poisoned:
                self._needs_restart = True  # its random ops are poisoned, whatever the call returned
            if status == "ok":
                return rest[0]
            err = RemoteError(*rest)
            if err.poisons_process:
                self._needs_restart = True  # CUDA in that process is unusable from now on
            raise err

    def ask(self, fn, *args: Any, wait: float = _ASK_WAIT_S) -> tuple[bool, Any]:
        """A short call made for a report, one that never holds up a close: made only on a running child,
        when no call in another thread holds the worker for more than a second, with a deadline of its own
        (``wait``, or the worker's timeout if shorter); a child that crashes or does not answer in time is
        replaced. ``(True, value)``, or ``(False, None)`` where it could not be made or failed."""
        if not self._lock.acquire(timeout=_CLOSE_LOCK_WAIT_S):
            return False, None
        try:
            return self._ask(fn, args, wait)
        finally:
            self._lock.release()

    def _ask(self, fn, args: tuple, wait: float) -> tuple[bool, Any]:
        if not self.alive:
            return False, None
        payload = dumps_call(fn, args, {}, self._forked_main)
        try:
            reply = self._exchange(payload, None, fn, wait if self.timeout is None else min(self.timeout, wait))
        except BaseException as e:  # its reply may still come: no later call may read it
            self._replace()
            self._needs_restart = False
            if not isinstance(e, WorkerError):
                raise
            return False, None
        status, poisoned, *rest = pickle.loads(reply)
        if poisoned:
            self._needs_restart = True
        return (True, rest[0]) if status == "ok" else (False, None)

    def findings(self) -> list[dict]:
        """What this worker's children's sanitizers found outside engine cycles (``findings_call``, by
        default :func:`program_findings`): the running child's, asked now as :meth:`ask` asks, and those of
        children an error poisoned, asked before they were replaced. A child that crashed or hung took its
        findings with it."""
        if self._lock.acquire(timeout=_CLOSE_LOCK_WAIT_S):
            try:
                self._harvest()
            finally:
                self._lock.release()
        found, self._harvested = self._harvested, []
        new = [f for f in found if finding_key(f) not in self._reported]  # each once, however often asked
        self._reported.update(finding_key(f) for f in new)
        return new

    def sanitized(self) -> bool:
        """Whether the child installs a program-wide sanitizer (``CUDAGRAPH_SANITIZE``, its own or inherited)."""
        value = self.env.get("CUDAGRAPH_SANITIZE", os.environ.get("CUDAGRAPH_SANITIZE", ""))
        return value.strip().lower() not in SANITIZE_ENV_OFF

    def _harvest(self) -> None:
        """Under the lock: keep what the running child's sanitizer found, tagged with the child."""
        if self.sanitized() and self.alive:
            tag, (fn, args) = self._tag, self.findings_call
            ok, found = self._ask(fn, args, _ASK_WAIT_S)
            self._harvested += [{**f, "worker": tag} for f in found] if ok else []

    def restart_before_next_call(self) -> None:
        """The child's CUDA is unusable (the allocator asserted), or a stale capture ended its story (in every
        sanitizer mode, ``record.ends_process``): replace it at the next call."""
        self._needs_restart = True

    def close(self) -> None:
        """Ends the child and everything it started, whatever its state, in bounded time; the worker
        starts a new child if called again."""
        if not self._lock.acquire(timeout=_CLOSE_LOCK_WAIT_S):
            # A call in another thread holds the worker: end its child; that call reports the crash and
            # cleans up.
            proc = self._proc
            if proc is not None:
                _kill_session(proc.pid)
            _live.discard(self)
            return
        try:
            tree = _descendants(self._proc.pid) if self.alive else []  # before it leaves: orphans are reparented
            if not self._needs_restart and self.alive:
                try:  # an idle, healthy child leaves on its own (its atexit handlers run)
                    self._conn.send_bytes(b"")
                    self._proc.join(_CLOSE_EXIT_WAIT_S)
                except OSError:
                    pass
            self._kill(tree)
        finally:
            self._lock.release()
        _live.discard(self)

    def __enter__(self) -> ReusedWorker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReusedWorker(name={self.name!r}, method={self.start_method!r}, pid={self.pid}, calls={self.calls})"


# Every worker that may have a child: close_all_workers ends them at the session's exit.
_live: weakref.WeakSet[ReusedWorker] = weakref.WeakSet()


def close_all_workers() -> None:
    for w in list(_live):
        w.close()


atexit.register(close_all_workers)
