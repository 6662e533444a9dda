"""The child's side of a reused worker: how the child sets itself up (its own session, a subreaper that dies
with pytest, its stderr and faulthandler, the sanitizer) and the loop that runs the calls it is sent, one at
a time, until the parent closes the pipe. Also what runs around a call in a child or an MPI rank: the test it
is attributed to, the heap frozen before the first, whether it poisoned the process, the findings asked for.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback

from .protocol import _Reader, _send_message, dumps

_PARENT_PID = os.getpid()


def _forked() -> bool:
    # Module state survives fork but not spawn: a child that still sees another process's pid was forked.
    return _PARENT_PID != os.getpid()


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


def _child_main(conn, stderr_path: str, sys_path: list[str], env: dict[str, str],
                parent_pid: int | None) -> None:
    # Its own session (and process group): no terminal signal reaches it, and ending the worker kills
    # everything it started.
    os.setsid()
    # SIGINT was blocked across the start (process.start_child): one that came meanwhile was the
    # session's Ctrl-C, meant for pytest. Drop it (ignoring discards a pending signal), then restore the usual
    # handler.
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
            value = _run_call(fn, args, kwargs)
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


def _run_call(fn, args, kwargs):
    # A frame of its own: a hung worker's stack then shows whether the call had begun (crash.py reads it).
    return fn(*args, **kwargs)


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
