"""The call protocol between a reused worker and its child: what a call and a reply are made of, how a
message crosses the pipe (one write and one read each), and how the parent waits for a reply (the read is
the wait). Also the errors a reply can carry and a payload's refusal.

A call is ``(fn, args, kwargs, test)`` pickled by reference where the child can import it, by value
(cloudpickle, :mod:`.by_value`) otherwise; a reply is ``("ok", poisoned, value)`` or
``("err", poisoned, type name, message, traceback)``. An empty message asks the child to leave.
"""

from __future__ import annotations

import operator
import os
import pickle
import select
import socket
import struct
import sys
import time
import types
import weakref
from typing import Any

from cudagraph_lifecycle.errors import TORCH_DEFAULT_STREAM_REFUSAL, TORCH_RANDOM_POISONED

from .. import by_value

# A wait for a reply checks this often that the child lives (and a deadline, if any).
LIVENESS_S = 0.5

# the allocator's assert, torch's refusal of a capture on the default stream (it leaves the RNG's capture open),
# and what random ops raise after either
POISON_MARKERS = ("INTERNAL ASSERT FAILED", TORCH_RANDOM_POISONED, TORCH_DEFAULT_STREAM_REFUSAL)
_PREVENTED = ("StalePoolError", "DefaultStreamCaptureError")  # they quote what they stopped: that process is fine


class WorkerError(Exception):
    """Base of the worker's reports."""

    __module__ = "pytest_cudagraph.worker"  # named as it is imported, in tracebacks too

    pid: int | None = None  # the child's, where it crashed or hung
    frames: tuple[str, ...] | list[str] = ()  # its innermost frames there ("file:line in function"), if dumped


# ``__tracebackhide__`` of the calls that raise them: pytest leaves out those frames for these errors only (a
# bug of ours keeps its frames); made once, since a worker call is timed
HIDE_WORKER_ERRORS = operator.methodcaller("errisinstance", WorkerError)


class RemoteError(WorkerError):
    """The callable raised in the child: the child's type, message and traceback."""

    __module__ = "pytest_cudagraph.worker"  # named as it is imported, in tracebacks too

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
    return type_name not in _PREVENTED and any(m in message for m in POISON_MARKERS)


class UnpicklableCallableError(WorkerError, TypeError):
    """A callable or argument could not be sent to the worker."""

    __module__ = "pytest_cudagraph.worker"  # named as it is imported, in tracebacks too


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for the other side of a worker's pipe: plain pickle (4x faster than cloudpickle on a
    call) where it pickles everything by reference to something importable, by value otherwise (closures,
    lambdas, what ``__main__`` defines, which a spawned child does not have). Either loads with pickle.loads."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return by_value.dumps(obj)
    return data if b"__main__" not in data else by_value.dumps(obj)


def current_test() -> str | None:
    """The test pytest is running in this process (``PYTEST_CURRENT_TEST`` without its phase), or None."""
    now = os.environ.get("PYTEST_CURRENT_TEST")
    return now.rsplit(" (", 1)[0] if now else None


def main_callables() -> dict[str, Any]:
    """The functions and classes ``__main__`` binds now (read before and after a fork: what the child has)."""
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
    Whatever else in the call refers to ``__main__`` sends the whole call by value."""
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


class NoReply(Exception):
    """No reply came: the child died (``died``) or the deadline passed first."""

    def __init__(self, died: bool):
        super().__init__("the child died" if died else "the deadline passed")
        self.died = died


class Channel:
    """The parent's end of one child's pipe (a ``multiprocessing`` Connection, kept for its poll and its
    close): sends a call and waits for its reply."""

    __slots__ = ("conn", "reader", "timed", "poller")

    def __init__(self, conn):
        self.conn = conn
        self.reader = _Reader(conn.fileno())
        self.timed = _set_receive_timeout(conn.fileno(), LIVENESS_S)  # the wait is then the read itself
        self.poller = None  # one poll object per child: Connection.poll builds a selector at every call
        if hasattr(select, "poll"):
            self.poller = select.poll()
            self.poller.register(conn.fileno(), select.POLLIN)

    def exchange(self, payload: bytes, proc, limit: float | None) -> bytes | bytearray:
        """Sends one message to the child ``proc`` and returns its reply, waiting ``limit`` seconds (None: as
        long as it lives); :class:`NoReply` where the child died or the time ran out first."""
        reader = self.reader
        try:
            _send_message(reader.fd, payload)
        except OSError:  # BrokenPipeError included
            raise NoReply(died=True) from None
        deadline = None if limit is None else time.monotonic() + limit
        # The wait wakes every LIVENESS_S to see whether the child still lives, since the child's end may be
        # held open by what it started (no EOF when it dies). It is the read itself, under the socket's receive
        # timeout: with a poll before the read, a call took 1.2-1.5x as long when parent and child ran on
        # different cores (2-core VM). The poll stays where the socket takes no timeout, and for the last
        # LIVENESS_S before a deadline, which it keeps exactly. (A signal handled during the read restarts it
        # with the full timeout: only signals handled more often than every LIVENESS_S, for as long as the
        # call lasts, could put the check off.)
        timed, poller = self.timed, self.poller
        while True:
            if deadline is not None and timed:
                timed = deadline - time.monotonic() >= LIVENESS_S
            if timed:
                ready = True
            else:
                wait = LIVENESS_S if deadline is None else max(0.0, min(LIVENESS_S, deadline - time.monotonic()))
                ready = poller.poll(wait * 1e3) if poller is not None else self.conn.poll(wait)
            if ready:
                try:
                    return reader.recv()
                except BlockingIOError:
                    pass  # nothing for LIVENESS_S; what came of a message is kept for the next read
                except (EOFError, OSError):
                    pass
            if not proc.is_alive():
                raise NoReply(died=True)
            if deadline is not None and time.monotonic() >= deadline:
                raise NoReply(died=False)
