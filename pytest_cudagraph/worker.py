"""The reused worker: a long-lived child process that runs callables in order and keeps its state between
calls, as a reused MPI rank does. Crashes and timeouts come back as reports; the worker is then replaced.

Never forks a process whose CUDA is initialized (the child could not use CUDA): ``auto`` forks when the
parent has not touched CUDA, and spawns (cloudpickle for closures and lambdas) when it has; decided again at
every start, so a restart after the parent initialized CUDA spawns.

The child runs in its own session: a terminal's Ctrl-C reaches only pytest, and ending the worker (close, a
timeout, a crash, an interrupted call) kills the whole session, the child's descendants (read while it lives)
and every process whose environment carries the child's tag, so what left the session (a daemon, Open MPI's
orted) goes too. Not caught: a double-forked daemon that never execs, once the child has crashed.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import multiprocessing as mp
import operator
import os
import pickle
import re
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
import weakref
from typing import Any

from cudagraph_lifecycle.choices import SANITIZE_ENV_OFF
from cudagraph_lifecycle.errors import TORCH_DEFAULT_STREAM_REFUSAL, TORCH_RANDOM_POISONED
from cudagraph_lifecycle.ledger import is_user_file
from cudagraph_lifecycle.sizes import size_text

from . import by_value


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for the other side of a worker's pipe: plain pickle (4x faster than cloudpickle on a
    call) where it pickles everything by reference to something importable, by value otherwise (closures,
    lambdas, what ``__main__`` defines, which a spawned child does not have). Either loads with pickle.loads."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return by_value.dumps(obj)
    return data if b"__main__" not in data else by_value.dumps(obj)


# The pipe carries multiprocessing.Connection's framing (a 4-byte size, or -1 and an 8-byte size), written and
# read on the raw descriptor: Connection.recv_bytes makes two reads and buffers in Python, 2.5 us more per
# message than one read (2-core CPU), on both sides of every call.
_SIZE = struct.Struct("!i")
_LONG_SIZE = struct.Struct("!Q")
_ONE_WRITE = 16384  # up to this, header and payload go in one write (as Connection does), so in one read
_READ_SIZE = _ONE_WRITE + 12


def _send_message(fd: int, payload: bytes) -> None:
    n = len(payload)
    head = _SIZE.pack(n) if n <= 0x7FFFFFFF else _SIZE.pack(-1) + _LONG_SIZE.pack(n)
    if n <= _ONE_WRITE:
        data = head + payload
        sent = os.write(fd, data)
        if sent == len(data):
            return
        rest = memoryview(data)[sent:]
    else:
        _write_all(fd, memoryview(head))
        rest = memoryview(payload)
    _write_all(fd, rest)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]  # a signal can cut a blocking write short


class _Reader:
    """Reads whole messages from one end of the pipe, a small one in a single read. EOFError when the other
    side closed. Where the socket has a receive timeout, a read that waited that long raises BlockingIOError
    and keeps what had come: the next recv() goes on from there."""

    __slots__ = ("fd", "_buf", "_body", "_got")

    def __init__(self, fd: int):
        self.fd = fd
        self._buf = b""  # read, not yet returned: part of a message (the protocol never sends two at once)
        self._body: bytearray | None = None  # a large message, read in place
        self._got = 0

    def _read(self) -> bytes:
        data = os.read(self.fd, _READ_SIZE)
        if not data:
            raise EOFError
        return data

    def recv(self) -> bytes | bytearray:
        if not self._buf and self._body is None:  # the usual case: one read brings exactly one small message
            buf = self._buf = self._read()
            if len(buf) >= _SIZE.size and _SIZE.unpack_from(buf)[0] == len(buf) - _SIZE.size:
                self._buf = b""
                return buf[_SIZE.size:]
        while self._body is None:
            buf = self._buf
            if len(buf) >= _SIZE.size:
                (size,), start = _SIZE.unpack_from(buf), _SIZE.size
                if size == -1 and len(buf) >= _SIZE.size + _LONG_SIZE.size:
                    (size,), start = _LONG_SIZE.unpack_from(buf, _SIZE.size), _SIZE.size + _LONG_SIZE.size
                if size >= 0:
                    end = start + size
                    if len(buf) >= end:
                        self._buf = buf[end:]
                        return buf[start:end]
                    body = bytearray(size)  # the rest goes straight into it, not chunk by chunk
                    body[: len(buf) - start] = memoryview(buf)[start:]
                    self._body, self._got, self._buf = body, len(buf) - start, b""
                    break
            self._buf = buf + self._read()
        body = self._body
        with memoryview(body) as view:
            while self._got < len(body):
                n = os.readv(self.fd, [view[self._got:]])
                if not n:
                    raise EOFError
                self._got += n
        self._body = None
        return body


def _set_receive_timeout(fd: int, seconds: float) -> bool:
    """SO_RCVTIMEO on the socket ``fd``, so that a blocking read gives up after ``seconds`` without data; False
    where the descriptor or the platform does not take it."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        tv = struct.pack("ll", int(seconds), round(seconds % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, len(tv)))
        return abs(sec + usec / 1e6 - seconds) < 0.05  # read back as set: the layout of timeval is right
    except (OSError, AttributeError, struct.error):
        return False
    finally:
        sock.detach()


START_METHODS = ("auto", "fork", "spawn", "forkserver")
# the allocator's assert, torch's refusal of a capture on the default stream (it leaves the RNG's capture open),
# and what random ops raise after either
_POISON_MARKERS = ("INTERNAL ASSERT FAILED", TORCH_RANDOM_POISONED, TORCH_DEFAULT_STREAM_REFUSAL)
_PREVENTED = ("StalePoolError", "DefaultStreamCaptureError")  # they quote what they stopped: that process is fine
_CAUSE = re.compile(r"terminate called|terminating due to|what\(\)|Fatal Python error|INTERNAL ASSERT|"
                    r"Error:|Exception|Segmentation fault|Aborted|died during the call")


class WorkerError(Exception):
    """Base of the worker's reports."""

    pid: int | None = None  # the child's, where it crashed or hung
    frames: tuple[str, ...] | list[str] = ()  # its innermost frames there ("file:line in function"), if dumped


# ``__tracebackhide__`` of the calls that raise them: pytest leaves out those frames for these errors only (a
# bug of ours keeps its frames); made once, since a worker call is timed
HIDE_WORKER_ERRORS = operator.methodcaller("errisinstance", WorkerError)


class WorkerCrashed(WorkerError):
    """The child died during a call: signal or exit code, the tail of its stderr, and the teardown hazards
    the sanitizer recorded in it before (``hazards``: dicts with pool_id, live_bytes, reset_site, test)."""

    def __init__(self, message: str, exitcode: int | None, stderr_tail: str, hazards: list[dict] | None = None):
        super().__init__(message)
        self.exitcode = exitcode
        self.stderr_tail = stderr_tail
        self.hazards = list(hazards or [])


class WorkerTimeout(WorkerError):
    """A call ran past the timeout; the worker and everything it started were killed."""


class RemoteError(WorkerError):
    """The callable raised in the child: the child's type, message and traceback."""

    def __init__(self, type_name: str, message: str, remote_traceback: str):
        super().__init__(f"{type_name}: {message}\n\n--- worker traceback ---\n{remote_traceback}")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback

    @property
    def poisons_process(self) -> bool:
        return poisons(self.type_name, self.remote_message)


def poisons(type_name: str, message: str) -> bool:
    """Whether an error a child raised leaves that process of no use (its CUDA or its random ops)."""
    return type_name not in _PREVENTED and any(m in message for m in _POISON_MARKERS)


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


def _set_parent_death_signal(parent_pid: int | None) -> None:
    # Linux: the worker dies with the pytest process, even on SIGKILL of the parent. And it adopts its
    # orphaned descendants (a double-forked daemon that never execs carries no tag and leaves the worker's
    # session): re-parented to the worker, not to init, they stay among the descendants its end kills.
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the signal was armed: nobody would ever end this child


_PARENT_PID = os.getpid()


def _forked() -> bool:
    # Module state survives fork but not spawn: a child that still sees another process's pid was forked.
    return _PARENT_PID != os.getpid()


def _child_main(conn, stderr_path: str, sys_path: list[str], env: dict[str, str],
                parent_pid: int | None) -> None:
    # Its own session (and process group): no terminal signal reaches it, and ending the worker kills
    # everything it started.
    os.setsid()
    # SIGINT was blocked across the start (ReusedWorker.start): one that came meanwhile was the session's
    # Ctrl-C, meant for pytest. Drop it (ignoring discards a pending signal), then restore the usual handler.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _set_parent_death_signal(parent_pid)
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
    _drop_inherited_log_capture()
    if os.environ.get("CUDAGRAPH_SANITIZE"):
        from cudagraph_lifecycle.sanitizer import install_from_env

        install_from_env()  # before any user code: the first capture in this process is watched
    reader = _Reader(conn.fileno())
    while True:
        try:
            payload = reader.recv()
        except (EOFError, OSError):
            return
        if not payload:
            return
        seq = ledger_seq()
        try:
            fn, args, kwargs, test = pickle.loads(payload)
            if test is not None:
                attribute_to(test)
            if not _heap_frozen:
                freeze_startup_heap()
            value = fn(*args, **kwargs)
            try:
                reply = dumps(("ok", poisoned_since(seq), value))
            except Exception as e:
                reply = dumps(("err", poisoned_since(seq), "UnpicklableResult",
                               f"the worker's return value cannot be pickled: {e}", ""))
        except BaseException as e:  # report everything, SystemExit included, and keep serving
            print(traceback.format_exc(), file=sys.stderr, flush=True)  # in full, for a crash report
            from cudagraph_lifecycle.ledger import shown_traceback

            reply = dumps(("err", poisoned_since(seq), type(e).__qualname__, str(e), shown_traceback(e)))
            del e
        _send_message(reader.fd, reply)


def _drop_inherited_log_capture() -> None:
    """A forked child inherits pytest's log-capture handlers, which would keep every record the child logs: an
    engine that logs a caught exception would keep its traceback, its frames and the tensors their locals hold,
    and its pools would read as pinned by those locals. The child's records go to its stderr instead (Python's
    last-resort handler: warnings and errors), which a crash report quotes."""
    logging = sys.modules.get("logging")
    if logging is None:
        return
    loggers = [logging.getLogger(), *(lg for lg in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for h in list(lg.handlers):  # (a --log-file handler stays: it only writes)
            if type(h).__module__ == "_pytest.logging" and type(h).__name__ != "_FileHandler":
                lg.removeHandler(h)


_DUMPED_FRAME = re.compile(r'^\s+File "(.+)", line \d+ in ')  # a frame as faulthandler dumps it


def _without_pytest_frames(text: str) -> str:
    """A faulthandler dump without pytest's and pluggy's frames (a forked worker's stack holds the pytest
    session it was forked from, below the call): the user's frames and ours (where a rank runs the call)
    stay, and a count of the rest."""
    dirs = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in (sys.modules.get(n) for n in ("_pytest", "pytest", "pluggy")) if getattr(m, "__file__", None))
    kept, dropped = [], 0
    for line in text.splitlines(keepends=True):
        m = _DUMPED_FRAME.match(line)
        if dirs and m and os.path.abspath(m.group(1)).startswith(dirs):
            dropped += 1
            continue
        kept.append(line)
    return "".join(kept) + (f"  ({dropped} frames of pytest left out)\n" if dropped else "")


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
                                  RuntimeWarning, stacklevel=4)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        except Warning:
            pass


def ledger_seq() -> int:
    led = sys.modules.get("cudagraph_lifecycle.ledger")
    return -1 if led is None else led.ledger.seq


def poisoned_since(seq: int) -> bool:
    """torch refused a capture on the default stream during the call, whether or not its error reached the
    call's end (an engine that caught it and ran eagerly): this process's random ops are poisoned."""
    led = sys.modules.get("cudagraph_lifecycle.ledger")
    return led is not None and bool(led.ledger.torch_refusals(seq))


_heap_frozen = False


def freeze_startup_heap() -> None:
    """Called before each call's user code; acts once, before the first: moves every object alive then (the
    modules, what a forked child inherited) out of the collector's reach. Engine cycles collect garbage twice
    per engine, and a full collection over torch's heap took 62 ms of a 145 ms engine cycle on the simulated
    allocator (21 ms once frozen). Nothing an engine makes exists yet, so nothing of an engine is frozen. No
    collection first: one over torch's heap made a worker's first call 16x slower than a bare fork (125 ms on
    the H200); the start-up garbage it would free is small and frozen objects are still freed by refcount."""
    global _heap_frozen
    if _heap_frozen:
        return
    import gc

    gc.freeze()
    _heap_frozen = True


def current_test() -> str | None:
    """The test pytest is running in this process (``PYTEST_CURRENT_TEST`` without its phase), or None."""
    now = os.environ.get("PYTEST_CURRENT_TEST")
    return now.rsplit(" (", 1)[0] if now else None


_ledger_module = None


def attribute_to(test: str | None) -> None:
    """In a worker or a rank: the captures of this call belong to ``test`` (the ledger keeps which test
    captured into each pool, so a finding names it)."""
    global _ledger_module
    if test is not None:
        if _ledger_module is None:  # an import statement per call cost a microsecond
            import importlib

            _ledger_module = importlib.import_module("cudagraph_lifecycle.ledger")
        _ledger_module.ledger.test = test


def program_findings() -> list[dict]:
    """In a worker: what its program-wide sanitizer found about pools no engine cycle made (an engine's pools
    are judged in its record), as the report keeps them, with the worker's pid; none without one."""
    env = sys.modules.get("cudagraph_lifecycle.sanitizer.env")
    san = env.global_sanitizer() if env is not None else None
    if san is None:
        return []
    return [{**f.as_dict(), "pid": os.getpid()} for f in san.findings() if f.engine is None]


def finding_key(f: dict) -> tuple:
    """What tells two findings apart across processes: pool ids are unique only within one (pid), pids are
    reused (the worker's child), and MPI ranks share a worker."""
    key = f.get("pid"), f.get("worker"), f.get("rank"), f["kind"], tuple(f["pool_id"] or ()), f["device"]
    if f["kind"] in ("default_stream_capture", "stale_capture"):  # about a line and a test, not only a pool
        key += (tuple(f.get("sites") or ()), tuple(f.get("tests") or ()))
    return key


def _main_callables() -> dict[str, Any]:
    main = sys.modules.get("__main__")
    items = list(vars(main).items()) if main else []  # one step: another thread may bind names meanwhile
    return {k: v for k, v in items if isinstance(v, (types.FunctionType, type))}


def _forked_has(fn, forked_main: dict[str, weakref.ref]) -> bool:
    if getattr(fn, "__module__", None) != "__main__":
        return False
    ref = forked_main.get(getattr(fn, "__qualname__", None))
    return ref is not None and ref() is fn


def dumps_call(fn, args: tuple, kwargs: dict, forked_main: dict[str, weakref.ref] | None = None) -> bytes:
    """``(fn, args, kwargs)`` pickled for a worker or a rank, with the test running now;
    :class:`UnpicklableCallableError` says why not.

    ``forked_main``: the functions and classes of ``__main__`` that a forked receiver has, the very objects
    (bound there both before and after its fork). Such an ``fn`` travels by reference, as one of an importable
    module does, instead of by value through cloudpickle (20 us to pickle and 7 us to load on a 2-core CPU,
    against 30 us for the rest of a call); its globals are then the receiver's, as for any module's function.
    Whatever else in the call refers to ``__main__`` sends the whole call by value, as before."""
    call = (fn, args, kwargs, current_test())
    try:
        if forked_main and _forked_has(fn, forked_main):
            try:
                data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
                if b"__main__" not in pickle.dumps(call[1:], protocol=pickle.HIGHEST_PROTOCOL):
                    return data
            except Exception:
                pass  # dumps decides
        return dumps(call)
    except Exception as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise UnpicklableCallableError(
            f"cannot send {name} to the worker: {type(e).__name__}: {e}. It is probably a closure over "
            "an object that cannot be pickled (a lock, a CUDA tensor, an open file, a generator). "
            "Make it a module-level function and pass plain values as arguments, or build the "
            "object inside the worker"
        ) from None


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


TAG_VAR = "CUDAGRAPH_WORKER_TAG"  # in a child's environment, inherited by everything it starts
HAZARD_VAR = "CUDAGRAPH_HAZARD_FILE"  # where the child's ledger writes teardown hazards as they happen


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


_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


def crash_frames(stderr: str, limit: int = 10) -> list[str]:
    """The innermost ``limit`` frames of the crashing thread in the last faulthandler dump of a fatal error
    in ``stderr``, as ``file:line in function``.

    faulthandler prints the stack most recent call FIRST, so the tail of stderr shows only the outermost
    frames (pytest, pluggy, the worker loop); the crashing frame is at the top of the dump."""
    lines = stderr.splitlines()
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    if not fatal:
        return []  # no dump of a crash (SIGKILL, os._exit): nothing to quote
    return _dumped_frames(lines, fatal[-1], limit)


def hang_frames(stderr: str, limit: int = 10) -> list[str]:
    """The innermost ``limit`` frames of the last stack dump in ``stderr`` (a hung worker's, asked for with
    SIGUSR1), as :func:`crash_frames` gives them."""
    lines = stderr.splitlines()
    dumps = [i for i, ln in enumerate(lines) if ln.startswith(("Current thread", "Stack ("))]
    return _dumped_frames(lines, dumps[-1], limit) if dumps else []


def _dumped_frames(lines: list[str], start: int, limit: int) -> list[str]:
    # the crashing thread is the dump's "Current thread" (the others print as "Thread 0x..."); "Stack" when
    # faulthandler dumps one thread only
    heads = (i for i in range(start, len(lines)) if lines[i].startswith(("Current thread", "Stack (")))
    head = next(heads, None)
    frames = []
    for ln in lines[head + 1:] if head is not None else []:
        m = _FRAME.match(ln)
        if m is None or len(frames) == limit:
            break
        frames.append(f"  {m['file']}:{m['line']} in {m['func']}")
    return frames


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
    for path in (stderr_path, _hazard_path(stderr_path)):
        if path and os.path.exists(path):
            os.unlink(path)


def _hazard_path(stderr_path: str | None) -> str | None:
    return None if not stderr_path else stderr_path + ".hazards"


def read_hazards(path: str | None) -> list[dict]:
    """The teardown hazards a child wrote before it died (JSON lines; a torn last line is skipped)."""
    import json

    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def describe_hazards(hazards: list[dict]) -> str:
    """The crash report's lines for hazards recorded before the crash."""
    if not hazards:
        return ""
    lines = ["--- the sanitizer recorded before the crash: a pool torn down while blocks of it lived, under "
             "expandable_segments:True (freeing them crashes the process) ---"]
    for h in hazards:
        lines.append(f"pool {tuple(h['pool_id'])} on device {h['device']}: {size_text(h['live_bytes'])} alive at the "
                     f"reset at {h.get('reset_site') or '(unknown)'}" + (f" (test {h['test']})" if h.get("test") else ""))
    return "\n" + "\n".join(lines)


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


_live: weakref.WeakSet[ReusedWorker] = weakref.WeakSet()
_tags = itertools.count(1)


def close_all_workers() -> None:
    for w in list(_live):
        w.close()


atexit.register(close_all_workers)

# A wait for a reply checks this often that the child lives (and a deadline, if any).
_LIVENESS_S = 0.5

# close() waits this long for a call running in another thread before it kills the child anyway, and this
# long for an idle child to leave on its own.
_CLOSE_LOCK_WAIT_S = 1.0
# A call made for a report (ask) gets this long at most, whatever the worker's timeout.
_ASK_WAIT_S = 30.0
_CLOSE_EXIT_WAIT_S = 2.0


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
        self._poller = None  # select.poll on the pipe's end, where the platform has it
        self._reader: _Reader | None = None
        self._timed_reads = False  # the pipe's end has a receive timeout: the wait is the read itself
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
        ctx = mp.get_context(self.start_method)
        fd, stderr_path = tempfile.mkstemp(prefix=f"cudagraph-{self.name}-", suffix=".stderr")
        os.close(fd)
        parent, child = ctx.Pipe(duplex=True)
        parent_pid = None if self.start_method == "forkserver" else os.getpid()  # forkserver's is its server
        tag = f"{os.getpid()}-{next(_tags)}"
        env = {**self.env, TAG_VAR: tag, HAZARD_VAR: _hazard_path(stderr_path)}
        proc = ctx.Process(target=_child_main, args=(child, stderr_path, list(sys.path), env, parent_pid),
                           daemon=True)
        if self.start_method != "fork":
            # spawn and forkserver start multiprocessing's resource tracker on first use, and that UNBLOCKS
            # SIGINT in this thread afterwards: start it before blocking.
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        # Ctrl-C waits until the child is started and recorded: the child must not get it before it is in
        # its own session (it inherits the blocked mask and unblocks there), and a child started but not
        # recorded would never be ended.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            main_before = _main_callables() if self.start_method == "fork" else None
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
            self._forked_main = None
            if main_before is not None:  # both before and after the fork: the child has that very object
                main_after = _main_callables()
                self._forked_main = {k: weakref.ref(v) for k, v in main_before.items() if main_after.get(k) is v}
            self._proc, self._conn, self._stderr_path, self._tag = proc, parent, stderr_path, tag
            self._reader = _Reader(parent.fileno())
            self._timed_reads = _set_receive_timeout(parent.fileno(), _LIVENESS_S)
            self._poller = None
            if hasattr(select, "poll"):
                self._poller = select.poll()
                self._poller.register(parent.fileno(), select.POLLIN)
            self._needs_restart = False
            _live.add(self)  # again after a close(): close_all_workers must find it
            # Dropped without close(), the child would live (and hold its GPU memory) until the session ends:
            # the child keeps a copy of this end of the pipe, so it never sees EOF.
            self._dropped = weakref.finalize(self, _end_dropped, os.getpid(), proc, parent, stderr_path, tag,
                                             self.name, self._made_at)
            self._dropped.atexit = False  # at exit close_all_workers ends live workers politely
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return self

    def _read_stderr(self) -> str:
        if not self._stderr_path or not os.path.exists(self._stderr_path):
            return ""
        with open(self._stderr_path, errors="replace") as f:
            return f.read()

    def stderr_tail(self, lines: int = 20) -> str:
        return "".join(self._read_stderr().splitlines(keepends=True)[-lines:])

    def key_lines(self, limit: int = 8) -> list[str]:
        """The lines of the worker's whole stderr that name a cause (a tail misses them under a long stack)."""
        return [ln.rstrip() for ln in self._read_stderr().splitlines() if _CAUSE.search(ln)][-limit:]

    def _kill(self, tree: list[int] | None = None) -> None:
        """Ends the child's whole session, whatever the child's state (alive, exited, killed, crashed)."""
        if self._dropped is not None:
            self._dropped.detach()
            self._dropped = None
        _end_child(self._proc, self._conn, self._stderr_path, self._tag, tree)
        self._proc = self._conn = self._stderr_path = self._tag = self._reader = self._forked_main = None

    def _replace(self) -> None:
        """The child is of no use any more (crashed, hung, interrupted, poisoned): the next call starts one."""
        self._kill()
        self.restarts += 1

    def _crash_report(self, proc, during: str) -> WorkerCrashed:
        proc.join(5)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                cause = f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                cause = f"killed by signal {-code}"
        else:
            cause = f"exited with code {code}"
        tail = self.stderr_tail()
        assert_lines = [ln for ln in tail.splitlines() if any(m in ln for m in _POISON_MARKERS)]
        msg = f"worker {self.name} (pid {proc.pid}) {cause} during {during}"
        if assert_lines:
            msg += f"\nallocator: {assert_lines[-1].strip()}"
        frames = crash_frames(self._read_stderr())
        if frames:
            msg += ("\n--- innermost frames at the crash (faulthandler, most recent call first) ---\n"
                    + "\n".join(frames))
        hazards = read_hazards(_hazard_path(self._stderr_path))
        msg += describe_hazards(hazards)
        causes = [ln for ln in self.key_lines() if ln not in tail]
        if causes:
            msg += "\n--- cause lines from the worker's stderr ---\n" + "\n".join(causes)
        shown = _without_pytest_frames(tail)  # a forked worker's dump holds the session it was forked from
        if shown.strip():
            msg += f"\n--- last lines of the worker's stderr ---\n{shown.rstrip()}"
        err = WorkerCrashed(msg, code, tail, hazards)
        err.pid = proc.pid  # the child is gone: its record still names it
        err.frames = [f.strip() for f in frames]
        return err

    def _timeout_report(self, proc, during: str, limit: float) -> WorkerTimeout:
        try:
            os.kill(proc.pid, signal.SIGUSR1)  # dump the hung worker's stacks before the kill
            time.sleep(0.5)
        except ProcessLookupError:
            pass
        tail = _without_pytest_frames(self.stderr_tail(60))
        frames = [f.strip() for f in hang_frames(self._read_stderr())]
        err = WorkerTimeout(
            f"worker {self.name} (pid {proc.pid}) ran past the timeout of {limit:g}s"
            + (f" ({self.timeout_from})" if self.timeout_from and limit == self.timeout else "")
            + f" in {during}; the worker and everything it started were killed (its session)"
            + (f"\n--- last lines of the worker's stderr ---\n{tail.rstrip()}" if tail.strip() else "")
        )
        err.pid = proc.pid  # the child is gone: its record still names it
        err.frames = frames
        return err

    @staticmethod
    def _during(number: int | None, fn) -> str:  # built only for a report
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return f"call {number} ({name})" if number is not None else f"the plugin's call {name}"

    def _exchange(self, payload: bytes, number: int | None, fn, limit: float | None = None) -> bytes:
        """Sends one call and returns the child's reply (waiting ``limit`` seconds, by default the worker's
        timeout); raises the crash or timeout report."""
        proc, conn, reader = self._proc, self._conn, self._reader
        try:
            _send_message(reader.fd, payload)
        except OSError:  # BrokenPipeError included
            raise self._crash_report(proc, self._during(number, fn)) from None
        limit = self.timeout if limit is None else limit
        deadline = None if limit is None else time.monotonic() + limit
        # The wait wakes every _LIVENESS_S to see whether the child still lives, since the child's end may be
        # held open by what it started (no EOF when it dies). It is the read itself, under the socket's receive
        # timeout: with a poll before the read, a call took 1.2-1.5x as long when parent and child ran on
        # different cores (2-core VM). The poll stays where the socket takes no timeout, and for the last
        # _LIVENESS_S before a deadline, which it keeps exactly. (A signal handled during the read restarts it
        # with the full timeout: only signals handled more often than every _LIVENESS_S, for as long as the
        # call lasts, could put the check off.) One poll object per child: Connection.poll builds a selector
        # at every call.
        timed, poller = self._timed_reads, self._poller
        while True:
            if deadline is not None and timed:
                timed = deadline - time.monotonic() >= _LIVENESS_S
            if timed:
                ready = True
            else:
                wait = _LIVENESS_S if deadline is None else max(0.0, min(_LIVENESS_S, deadline - time.monotonic()))
                ready = poller.poll(wait * 1e3) if poller is not None else conn.poll(wait)
            if ready:
                try:
                    return reader.recv()
                except BlockingIOError:
                    pass  # nothing for _LIVENESS_S; what came of a message is kept for the next read
                except (EOFError, OSError):
                    pass
            if not proc.is_alive():
                raise self._crash_report(proc, self._during(number, fn))
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timeout_report(proc, self._during(number, fn), limit)

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
        sanitizer mode, ``cycle.ends_here``): replace it at the next call."""
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
