"""Call stacks as the ledger keeps and shows them: taken cheaply at a capture (code objects and offsets, no
line decoded), shown without the machinery's frames, and read down to the user's line (a site,
``file:line in function``) that a finding or an error points at.

Whose frame is whose is decided by location: the machinery (this package, the plugin, pytest, pluggy,
multiprocessing, mpi4py, Python's frozen modules, contextlib), the libraries (torch, the standard library),
and the user's code (everything else).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import sys
import traceback

STACK_DEPTH = 12  # frames kept per stack
# frames kept per capture: each frame reached on a live stack is materialized as a Python object, which after a
# model's warm-up costs ~0.7 us a frame on the H200's host (bench/bench_wrapper_cost.py); 6 reach the user's
# line through torch.cuda.graph and make_graphed_callables, with two or more of its callers
CAPTURE_STACK_DEPTH = 6
SITES = 4  # capture stacks kept per pool (its first captures): where a finding says the pool came from


def capture_frames(skip: int = 1) -> list:
    """The caller's stack as a capture keeps it (CAPTURE_STACK_DEPTH frames, flat as :class:`Stack` holds them)."""
    frames: list = []
    f = sys._getframe(skip)
    while f is not None and len(frames) < 2 * CAPTURE_STACK_DEPTH:
        frames += (f.f_code, f.f_lasti)
        f = f.f_back
    return frames


def _line_of(code, lasti: int) -> int:
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


@functools.lru_cache(maxsize=1)
def _machinery_dirs() -> tuple[str, ...]:
    """Where this package, the plugin, pytest and pluggy, multiprocessing and mpi4py live: their frames are the
    machinery's, not the user's, and are dropped when a stack is shown (a finding points at the user's line
    that called the runner, the pool, a backend or torch, and a test's stack starts at the test). Found by
    location, not by name: a user's folder may share one. Read when a stack is first shown, never at capture;
    nothing is imported to find them."""
    # this package: the folder above the ledger's own
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for name in ("pytest_cudagraph", "pytest", "_pytest", "pluggy", "multiprocessing", "mpi4py"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        dirs += [os.path.abspath(d) for d in (spec.submodule_search_locations or [])] if spec else []
    return tuple(d + os.sep for d in dirs)


def is_machinery(filename: str) -> bool:
    """Whether a frame of ``filename`` is the machinery's (this package, the plugin, pytest, pluggy,
    multiprocessing, mpi4py, Python's frozen modules, contextlib), not the user's."""
    return _machinery(filename)


@functools.lru_cache(maxsize=4096)
def _machinery(filename: str) -> bool:
    if filename.startswith("<frozen "):  # runpy and the import system, as Python runs them frozen
        return True
    path = os.path.abspath(filename)  # (a code object's file may be relative)
    # a `with` statement's own frame (contextlib's __enter__/__exit__) is never where the user's fix goes
    return path.startswith(_machinery_dirs()) or path == os.path.abspath(contextlib.__file__)


def shown_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as a user reads it: without the machinery's frames (as :class:`Stack` shows a stack),
    and without the closing ``Type: message`` lines, which the caller shows. All frames stay where nothing
    else is left, and where the error was raised in the machinery and is none of the errors it means to
    raise (a bug of ours: where it happened matters)."""
    from ..errors import ConfigError, CudaGraphLifecycleError, GraphInputError

    try:
        te = traceback.TracebackException.from_exception(exc)
        seen: set[int] = set()
        todo = [(te, exc)]
        while todo:  # the exception and those chained to it
            t, e = todo.pop()
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            # raised by our own Python code (not by torch's C++ under one of our wrappers), and not as one of
            # our errors: a bug of ours
            last = t.stack[-1] if t.stack else None
            ours = last is not None and _machinery(last.filename) and (last.line or "").startswith(("raise", "assert")) \
                and not isinstance(e, (ConfigError, CudaGraphLifecycleError, GraphInputError))
            kept = [f for f in t.stack if not _machinery(f.filename)]
            if kept and not ours:
                t.stack = traceback.StackSummary.from_list(kept)
            todo += [(t.__cause__, getattr(e, "__cause__", None)), (t.__context__, getattr(e, "__context__", None))]
        text, tail = "".join(te.format()), "".join(te.format_exception_only())
        return text[:-len(tail)] if text.endswith(tail) else text
    except Exception:  # never lose the report for its formatting
        return "".join(traceback.format_exception(exc))


class Stack:
    """A call stack taken cheaply and formatted when shown: code objects and instruction offsets, flat
    (code, offset, code, offset, ...). No line number is decoded and no frame is kept alive: captures are
    timed, and the capture path takes one of these per graph."""

    __slots__ = ("_frames", "_text")

    def __init__(self, frames: list):
        self._frames = frames
        self._text: str | None = None

    @classmethod
    def here(cls, skip: int = 1) -> Stack:
        frames: list = []
        f = sys._getframe(skip + 1)
        while f is not None and len(frames) < 2 * STACK_DEPTH:
            frames.append(f.f_code)
            frames.append(f.f_lasti)
            f = f.f_back
        return cls(frames)

    def __str__(self) -> str:
        if self._text is None:
            fr = self._frames
            keep = [
                traceback.FrameSummary(code.co_filename, _line_of(code, lasti), code.co_name)
                for code, lasti in reversed(list(zip(fr[0::2], fr[1::2])))
                if not _machinery(code.co_filename)
            ][-STACK_DEPTH:]
            self._text = "".join(traceback.format_list(keep))
        return self._text

    def __contains__(self, item: str) -> bool:
        return item in str(self)

    def site(self) -> str:
        """``file:line in function`` of the innermost frame of the user's code: not this package's, not
        torch's, not the standard library's (``torch.cuda.graph``'s ``__enter__`` is not where a user
        captured). The innermost frame that is not this package's where no frame is the user's."""
        fr = self._frames
        frames = [(code, lasti) for code, lasti in zip(fr[0::2], fr[1::2]) if not _machinery(code.co_filename)]
        user = [f for f in frames if is_user_file(f[0].co_filename)]
        if not (user or frames):
            return ""
        code, lasti = (user or frames)[0]
        return f"{code.co_filename}:{_line_of(code, lasti)} in {code.co_name}"


def _library_dirs() -> tuple[str, ...]:
    """Where torch and the standard library live: frames there are the library's, not the user's. Read when
    a site is shown (never at capture); torch is found without importing it (the pytest process shows the
    stacks its workers took, and may never import torch)."""
    import sysconfig

    dirs = [sysconfig.get_paths()["stdlib"] + os.sep]
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        dirs.append(os.path.dirname(torch.__file__) + os.sep)
    else:
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            spec = None
        dirs += [os.path.abspath(d) + os.sep for d in (spec.submodule_search_locations or [])] if spec else []
    return tuple(dirs)


def raised_site(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame of the user's code in ``exc``'s traceback (not ours,
    torch's or the standard library's); "" where there is none."""
    tb, site = exc.__traceback__, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_user_file(code.co_filename):
            site = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return site


def raised_at(exc: BaseException) -> str:
    """``file:line in function: Type: message`` (:func:`raised_site`, and what was raised there); "" where
    no frame is the user's."""
    site = raised_site(exc)
    if not site:
        return ""
    from ..errors import first_line

    return f"{site}: {type(exc).__name__}: {first_line(exc)}"


def is_user_file(filename: str) -> bool:
    """Whether a frame of ``filename`` is the user's code: not the machinery's, not torch's, not the standard
    library's."""
    return _user_file(filename, "torch" in sys.modules)


@functools.lru_cache(maxsize=4096)
def _user_file(filename: str, torch_imported: bool) -> bool:
    # cached: a cycle's verdict shows every pool's sites, and finding the standard library (sysconfig) costs
    # ~0.2 ms a call; torch's place is found another way once it is imported, hence the key
    return not _machinery(filename) and not os.path.abspath(filename).startswith(_library_dirs())


_SHORT_FRAME = re.compile(r"^\s+(\S.*):\d+ in \S+$")  # a frame as an allocation stack shows it (cuda.py)


def _frame_file(line: str) -> str | None:
    if line.startswith('  File "'):  # as traceback.format_list and Stack show it
        return line[len('  File "'):].partition('", line ')[0]
    m = _SHORT_FRAME.match(line)
    return m.group(1) if m else None


def innermost_user_frames(text: str, n: int) -> list[str]:
    """The lines of the innermost ``n`` frames of a shown stack (as :class:`Stack` shows it, or an allocation
    stack's ``file:line in function``) that are the user's code, not torch's nor the standard library's
    (``torch.cuda.graph``'s ``__enter__``, a ``contextlib`` wrapper); the innermost ``n`` frames where none is
    the user's; the last lines where no frame can be read."""
    frames: list[tuple[str, list[str]]] = []
    lines = text.rstrip().splitlines()
    for line in lines:
        path = _frame_file(line)
        if path is not None:
            frames.append((path, [line]))
        elif frames:
            frames[-1][1].append(line)
    if not frames:
        return lines[-2 * n:]
    user = [f for f in frames if is_user_file(f[0])] or frames
    # an allocation stack lists its innermost frame first, a traceback last
    kept = user[:n] if _SHORT_FRAME.match(lines[0]) else user[-n:]
    return [line for _, shown in kept for line in shown]


def graph_sites(graphs: list) -> list[str]:
    """The distinct user sites where these graphs (ledger entries) were captured, first seen first, at most
    SITES of them."""
    return list(dict.fromkeys(g.site for g in graphs if g.site))[:SITES]


def sites_of(stacks: list[list]) -> list[str]:
    """The distinct user sites of some capture stacks (as :class:`Stack` keeps them), first seen first."""
    out: list[str] = []
    for frames in stacks:
        site = Stack(frames).site()
        if site and site not in out:
            out.append(site)
    return out
