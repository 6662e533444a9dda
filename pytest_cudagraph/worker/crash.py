"""Crash reports: a child that died or hung during a call becomes a :class:`WorkerCrashed` or a
:class:`WorkerTimeout` that says why, from what the child left behind: its exit code or signal, the
faulthandler dump in its stderr (the innermost frames, the lines that name a cause), the allocator's
message, and the teardown hazards its ledger wrote to ``CUDAGRAPH_HAZARD_FILE`` before it died."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from cudagraph_lifecycle.sizes import size_text

from .protocol import POISON_MARKERS, WorkerError

HAZARD_VAR = "CUDAGRAPH_HAZARD_FILE"  # where the child's ledger writes teardown hazards as they happen

_CAUSE = re.compile(r"terminate called|terminating due to|what\(\)|Fatal Python error|INTERNAL ASSERT|"
                    r"Error:|Exception|Segmentation fault|Aborted|died during the call")


class WorkerCrashed(WorkerError):
    """The child died during a call: signal or exit code, the tail of its stderr, and the teardown hazards
    the sanitizer recorded in it before (``hazards``: dicts with pool_id, live_bytes, reset_site, test)."""

    __module__ = "pytest_cudagraph.worker"  # named as it is imported, in tracebacks too

    def __init__(self, message: str, exitcode: int | None, stderr_tail: str, hazards: list[dict] | None = None):
        super().__init__(message)
        self.exitcode = exitcode
        self.stderr_tail = stderr_tail
        self.hazards = list(hazards or [])


class WorkerTimeout(WorkerError):
    """A call ran past the timeout; the worker and everything it started were killed."""

    __module__ = "pytest_cudagraph.worker"  # named as it is imported, in tracebacks too


def read_stderr(path: str | None) -> str:
    """The child's whole stderr (its file), or "" where there is none."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def tail_of(text: str, lines: int = 20) -> str:
    return "".join(text.splitlines(keepends=True)[-lines:])


def cause_lines(text: str, limit: int = 8) -> list[str]:
    """The lines of a child's whole stderr that name a cause (a tail misses them under a long stack)."""
    return [ln.rstrip() for ln in text.splitlines() if _CAUSE.search(ln)][-limit:]


# the file of the worker's loop (child.py, beside this one), as a dumped frame names it
_CHILD_FILE = os.sep + os.path.join("worker", "child.py")
_DUMPED_FRAME = re.compile(r'^\s+File "(.+)", line \d+ in ')  # a frame as faulthandler dumps it


def _without_outer_frames(text: str) -> str:
    """A faulthandler dump without the frames below the call: in a thread that runs the worker's loop,
    every frame outside it (multiprocessing's start and, in a forked worker, the pytest session it was
    forked from, as far as the test's ``worker.call``); elsewhere (an MPI rank runs the call inside its own
    pytest) pytest's and pluggy's frames; and the import system's. The user's frames and ours stay, with a
    count of the rest."""
    dirs = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in (sys.modules.get(n) for n in ("_pytest", "pytest", "pluggy")) if getattr(m, "__file__", None))
    kept, below_loop, of_pytest, of_imports = [], 0, 0, 0
    in_loop_thread = False  # past the loop's frame in this thread's dump (most recent call first)
    for line in text.splitlines(keepends=True):
        m = _DUMPED_FRAME.match(line)
        if m is not None and in_loop_thread:
            below_loop += 1
            continue
        if below_loop:  # the thread's frames ended: the count stands where they were
            kept.append(f"  ({below_loop} frames below the worker's loop left out)\n")
            below_loop = 0
        in_loop_thread = m is not None and _is_loop_frame(line)
        if m is not None and m.group(1).startswith("<frozen importlib"):
            of_imports += 1  # the module being imported is the frame above them
            continue
        if m is not None and dirs and os.path.abspath(m.group(1)).startswith(dirs):
            of_pytest += 1
            continue
        kept.append(line)
    if below_loop:
        kept.append(f"  ({below_loop} frames below the worker's loop left out)\n")
    return ("".join(kept) + (f"  ({of_imports} frames of Python's import system left out)\n" if of_imports else "")
            + (f"  ({of_pytest} frames of pytest left out)\n" if of_pytest else ""))


def call_began(frames: list[str]) -> bool | None:
    """Whether a hung worker's stack (:func:`hang_frames`, down to its loop) shows its call running (the loop's
    call frame): False while the worker was still starting or loading the call (its imports), None where the
    loop's frame is not in it (an MPI rank, a dump that did not come)."""
    if not frames or not _is_loop_frame(frames[-1]):
        return None
    return any(f.rstrip().endswith(" in _run_call") and _CHILD_FILE in f for f in frames)


def _is_loop_frame(line: str) -> bool:
    # the worker's loop: every frame below it was there before the worker ran its first call
    return line.rstrip().endswith(" in _child_main") and _CHILD_FILE in line


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
        if _is_loop_frame(ln):
            break  # the frames below are the stack the worker was started from
    return frames


def hazard_path(stderr_path: str | None) -> str | None:
    """The child's hazard file: next to its stderr file, and removed with it."""
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


def crash_report(proc, name: str, stderr_path: str | None, during: str) -> WorkerCrashed:
    """What the child ``proc`` of worker ``name`` left when it died during ``during``, as the error to raise."""
    proc.join(5)
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            cause = f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            cause = f"killed by signal {-code}"
    else:
        cause = f"exited with code {code}"
    tail = tail_of(read_stderr(stderr_path))
    assert_lines = [ln for ln in tail.splitlines() if any(m in ln for m in POISON_MARKERS)]
    msg = f"worker {name} (pid {proc.pid}) {cause} during {during}"
    if assert_lines:
        msg += f"\nallocator: {assert_lines[-1].strip()}"
    frames = crash_frames(read_stderr(stderr_path))
    if frames:
        msg += ("\n--- innermost frames at the crash (faulthandler, most recent call first) ---\n"
                + "\n".join(frames))
    hazards = read_hazards(hazard_path(stderr_path))
    msg += describe_hazards(hazards)
    causes = [ln for ln in cause_lines(read_stderr(stderr_path)) if ln not in tail]
    if causes:
        msg += "\n--- cause lines from the worker's stderr ---\n" + "\n".join(causes)
    shown = tail_of(_without_outer_frames(read_stderr(stderr_path)))  # (a forked worker's dump holds its parent's stack)
    if shown.strip():
        msg += f"\n--- last lines of the worker's stderr ---\n{shown.rstrip()}"
    err = WorkerCrashed(msg, code, tail, hazards)
    err.pid = proc.pid  # the child is gone: its record still names it
    err.frames = [f.strip() for f in frames]
    return err


def timeout_report(proc, name: str, stderr_path: str | None, during: str, limit: float,
                   source: str | None = None) -> WorkerTimeout:
    """Has the hung child ``proc`` dump its stacks, and returns the error to raise; ``source`` says where the
    timeout was set. The caller kills the child."""
    try:
        os.kill(proc.pid, signal.SIGUSR1)  # dump the hung worker's stacks before the kill
        time.sleep(0.5)
    except ProcessLookupError:
        pass
    stderr = read_stderr(stderr_path)
    tail = tail_of(_without_outer_frames(stderr), 60)
    stack = [f.strip() for f in hang_frames(stderr, limit=1000)]  # (faulthandler prints at most 100)
    frames = stack[:10]
    if call_began(stack) is False:
        during = (f"the worker's start, before {during} began (what a call imports and the worker's own "
                  "set-up count toward its time)")
    err = WorkerTimeout(
        f"worker {name} (pid {proc.pid}) ran past the timeout of {limit:g}s"
        + (f" ({source})" if source else "")
        + f" in {during}; the worker and everything it started were killed (its session)"
        + (f"\n--- last lines of the worker's stderr ---\n{tail.rstrip()}" if tail.strip() else "")
    )
    err.pid = proc.pid  # the child is gone: its record still names it
    err.frames = frames
    return err
