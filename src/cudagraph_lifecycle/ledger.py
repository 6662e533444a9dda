"""The process's one record of graph-pool lifecycles, fed by watching the graph API (``observe``).

For every pool a graph captured into, per allocator world: where its id was minted, which graphs captured
into it (from which stack, in which engine scope and which test), the device and host use counts the allocator keeps,
where its last graph was released, whether each allocator has erased it, and which engine scopes captured
into it over the process's life. The pool handle, the runner, the engine-cycle verdicts, the sanitizer's
findings and the report all read this one ledger; nothing else keeps pool sets. A forked child starts
with an empty ledger (its parent's pools belong to the parent's allocator).

Why use counts are kept here and not read from the allocator: most torch builds do not expose them, and
the ledger sees the same events the allocator does (capture, reset, destruction, MemPool life, cache
flushes), so it can say a pool is *dead* -- all its graphs released while an allocator still holds it --
before a capture into it trips ``use_count > 0 INTERNAL ASSERT FAILED``.

Weak-reference callbacks (a graph or MemPool destroyed) apply their event at once where no ledger operation
is under way; inside one (a garbage collection while a query walks the books) they queue it, and the queue is
applied under the lock at the next operation, so the books never change underneath a reader.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import json
import os
import re
import sys
import threading
import traceback
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

HAZARD_FILE = "CUDAGRAPH_HAZARD_FILE"  # where a worker's teardown hazards go as they happen (JSON lines)

PoolId = tuple[int, int]
Key = tuple[Any, int, PoolId]  # (allocator world, device, pool id)

STACK_DEPTH = 12  # frames kept per stack
# frames kept per capture: each frame reached on a live stack is materialized as a Python object, which after a
# model's warm-up costs ~0.7 us a frame on the H200's host (bench/bench_wrapper_cost.py); 6 reach the user's
# line through torch.cuda.graph and make_graphed_callables, with two or more of its callers
CAPTURE_STACK_DEPTH = 6
SITES = 4  # capture stacks kept per pool (its first captures): where a finding says the pool came from
_REMEMBERED = 4096  # erased pools and unused mints remembered, oldest forgotten first


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
    dirs = [os.path.dirname(os.path.abspath(__file__))]
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
    from .errors import ConfigError, CudaGraphLifecycleError, GraphInputError

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
    from .errors import first_line

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


class GraphEntry(weakref.ref):
    """One captured graph, as the ledger keeps it. It is itself a weak reference to the graph, whose callback
    sees the graph's destruction: one object per capture, built without a Python ``__init__`` (captures are
    timed: the observation layer's recorder sets the fields, and queues :meth:`Ledger.add_graph`). Compared
    and hashed by identity."""

    __slots__ = ("gid", "world", "pool_id", "device", "frames", "scope", "test", "generation", "seq", "captured",
                 "replays", "alive", "counted")
    gid: int  # its key in the books: the capture's sequence number
    world: Any
    pool_id: PoolId | None  # None until capture_end for a capture without a pool argument
    device: int
    frames: list  # where it was captured, as Stack keeps them
    scope: str | None  # the engine scope it was captured in
    test: str | None  # the test running when it was captured (the pytest plugin says which)
    generation: int  # the ledger's generation: entries from before a fork are not this process's
    seq: int  # ledger sequence number of the capture
    captured: bool  # capture_end succeeded: reset() gives the references back
    replays: int
    alive: bool
    counted: bool  # its references are counted in its pool's entry

    __eq__, __ne__, __hash__ = object.__eq__, object.__ne__, object.__hash__  # not the referent's

    def __repr__(self) -> str:
        return (f"GraphEntry(gid={self.gid}, pool_id={self.pool_id}, device={self.device}, scope={self.scope!r}, "
                f"captured={self.captured}, alive={self.alive})")

    @property
    def captured_at(self) -> Stack:
        return Stack(self.frames)

    @property
    def site(self) -> str:
        return self.captured_at.site()


class DeadPools(dict):
    """The dead pools, ``{key: entry}``, and ``ids``: how many of them carry each pool id. A capture asks
    ``ids`` first, which needs neither its device nor a key built (captures are timed). Changed only through
    ``[]=``, ``del``, ``pop`` and ``clear``."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[PoolId, int] = {}

    def __setitem__(self, key: Key, e: PoolEntry) -> None:
        if key not in self:
            self.ids[key[2]] = self.ids.get(key[2], 0) + 1
        super().__setitem__(key, e)

    def __delitem__(self, key: Key) -> None:
        super().__delitem__(key)
        left = self.ids[key[2]] - 1
        if left:
            self.ids[key[2]] = left
        else:
            del self.ids[key[2]]

    def pop(self, key: Key, *default: Any) -> Any:
        if key in self:
            e = self[key]
            del self[key]
            return e
        return super().pop(key, *default)

    def clear(self) -> None:
        super().clear()
        self.ids.clear()


@dataclass(slots=True, eq=False)
class PoolEntry:
    world: Any
    device: int
    pool_id: PoolId
    minted_at: Stack | str | None = None
    held: int = 0  # references held by captured graphs (the device and host allocators count these)
    device_extra: int = 0  # MemPool objects alive and references taken outside graphs, minus those given back
    device_alive: bool = False  # the device allocator has books for it
    host_alive: bool = False  # the host allocator's ledger has the id
    captures: int = 0
    graphs: dict[int, GraphEntry] = field(default_factory=dict)  # its graphs still alive
    released_at: Stack | str | None = None
    scopes: list[str] = field(default_factory=list)  # engine scopes that captured into it, first first
    tests: list[str] = field(default_factory=list)  # tests that captured into it, first first
    sites: list[list] = field(default_factory=list)  # the stacks of its first SITES captures
    last_seq: int = 0  # ledger sequence number of its latest capture
    retired: bool = False  # a LazyPool retired it: never to be captured into again
    checked: int = 0  # the world's flush count when the books last showed it (or it was released): a flush
    # after that may have erased it, which the next settle() reads

    @property
    def key(self) -> Key:
        return (self.world, self.device, self.pool_id)

    @property
    def device_count(self) -> int:
        return self.held + self.device_extra

    @property
    def host_count(self) -> int:
        return self.held

    @property
    def dead(self) -> bool:
        """A capture into it would trip the allocator's ``use_count > 0`` assert."""
        return (self.held + self.device_extra <= 0 and self.device_alive) or (self.held <= 0 and self.host_alive)

    @property
    def owner(self) -> str | None:
        """The engine scope whose capture made the pool."""
        return self.scopes[0] if self.scopes else None

    def live_graphs(self) -> list[GraphEntry]:
        return [g for g in list(self.graphs.values()) if g.alive and g.captured]

    def capture_sites(self) -> list[str]:
        """Where its captures were made: ``file:line in function`` of the user's code, distinct."""
        return sites_of(self.sites)


@dataclass(frozen=True)
class TeardownHazard:
    """With expandable segments: the last graph of a pool about to be reset while blocks of it are alive."""

    key: Key
    scope: str | None
    seq: int
    owner: str | None
    live_bytes: int
    stacks: tuple[str, ...]
    reset_at: str
    test: str | None = None
    sites: tuple[str, ...] = ()  # where the pool's captures were made
    reset_site: str = ""  # file:line in function of the user's code that reset the graph


@dataclass(frozen=True)
class FailedCapture:
    """A capture whose end raised (a host sync such as ``.item()`` inside it invalidated it): torch gives back
    none of its pool's references, neither at reset nor when the graph goes, and leaves the CUDA RNG's
    capture open, so eager random ops fail until a later capture ends (measured on the H200)."""

    key: Key
    scope: str | None
    seq: int
    test: str | None
    at: str  # the capture's stack, as shown
    site: str  # file:line in function of the user's code that began the capture
    error: str  # the first line of what capture_end raised
    broken_at: str = ""  # where the user's code raised inside the capture, where an error did: the cause


@dataclass(frozen=True)
class DefaultStreamCapture:
    """A capture begun on its device's default stream. torch refuses it, but only after opening the CUDA RNG's
    capture, which it leaves open: every later eager random op of the process fails (measured on the H200).
    ``refused``: a judge stopped it before torch ran, so the process is fine."""

    key: tuple  # (allocator world, device)
    scope: str | None
    seq: int
    test: str | None
    at: str  # the stack, as shown
    site: str  # file:line in function of the user's code that began the capture
    pool_id: PoolId | None  # the pool it asked for, if any
    refused: bool


@dataclass(frozen=True)
class StaleAttempt:
    """A capture into a dead pool, seen before the allocator ran it. ``refused``: a judge was there to stop
    it (the sanitizer raises ``StalePoolError``); otherwise the allocator asserts, and the process is poisoned."""

    key: Key
    scope: str | None
    seq: int
    owner: str | None  # the engine scope that made the pool
    minted_at: str
    released_at: str
    device_dead: bool
    host_dead: bool
    test: str | None = None
    at: str = ""  # the capture's stack, as shown
    site: str = ""  # file:line in function of the user's code that began the capture
    refused: bool = False
    minted_site: str = ""  # file:line in function of the user's code that minted the pool's id
    # what the dead pool held when the capture came (read before the allocator ran it, in every sanitizer
    # mode, so a refusal and the allocator's assert are explained alike): its reserved bytes, and what pins
    # its live blocks (``sanitizer.pins.Pin`` as dicts)
    held_bytes: int = 0
    pins: tuple = ()

    def stacks(self) -> list[str]:
        """Where it began, where its pool was minted and released: each stack under its heading."""
        return [f"--- {what} ---\n{text or '(not seen)'}" for what, text in (
            ("the capture began at", self.at), ("pool minted at", self.minted_at),
            ("its last graph was released at", self.released_at))]


class Ledger:
    """See the module docstring. One instance per process: :data:`ledger`."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pools: dict[Key, PoolEntry] = {}
        self.dead = DeadPools()  # kept equal to {k: e for e in pools if e.dead} at every change
        # the dead pools the host allocator still holds (what its next flush erases): torch.cuda.graph flushes
        # at every capture, so the flush must not walk every dead pool
        self.host_dead: dict[Key, PoolEntry] = {}
        self.graphs: dict[int, GraphEntry] = {}
        self.minted: OrderedDict[tuple[Any, PoolId], Stack] = OrderedDict()
        self.retired: set[Key] = set()
        # erased pools: (scopes, mint site, tests), for ``reused``; at most _REMEMBERED of them (~1 KB each)
        self.erased: OrderedDict[Key, tuple[list[str], Any, list[str]]] = OrderedDict()
        self.stale: deque[StaleAttempt] = deque(maxlen=256)
        self.scope: str | None = None
        self.test: str | None = None  # the test running now, set by the pytest plugin (in workers: per call)
        self.captures_by_scope: dict[str, int] = {}
        self.replays_by_scope: dict[str, int] = {}  # replays of the scope's graphs that are gone
        self.unreplayed_by_scope: dict[str, int] = {}  # the scope's graphs that went without one replay
        self.hazards: deque[TeardownHazard] = deque(maxlen=256)
        self.default_stream: deque[DefaultStreamCapture] = deque(maxlen=256)
        self.failed_captures: deque[FailedCapture] = deque(maxlen=256)
        # pool -> a weak reference to the MemPool object that made it: while it lives, the pool does (a leak
        # whose blocks are all free is that object's holder's, and a finding names it)
        self.mempools: dict[Key, weakref.ref] = {}
        # scopes under a pool-bytes budget -> the most bytes their pools were seen to hold together: an
        # allocator frees a dead pool's segments only at a cache flush, so a read before each flush and one
        # at the end give the peak
        self.peak_bytes: dict[str, int] = {}
        # world -> a function returning a reader of pool bytes, read(device, pool_id) (None once the world is
        # gone): how a settle() learns which flushed pools the flushes erased
        self.unsettled: dict[Any, Callable[[], Callable[[int, PoolId], int] | None]] = {}
        self.flushes: dict[Any, int] = {}  # world -> device cache flushes seen
        # world -> its dead pools no flush was counted for since their release (or their last settle): only
        # while one exists does a device flush need counting (the flush wrapper's cheap way out otherwise)
        self.unflushed: dict[Any, set[Key]] = {}
        self.generation = 0
        self.pending: deque = deque()  # captures started (an entry, or (callable, args)), weak-reference callbacks
        # the pools those events touch (None: an event of no known pool): a capture drains only for its own
        self.pending_keys: set[Key | None] = set()
        # called whenever a flush may have something to record (an event queued, a released pool waiting for a
        # flush, a budget watched): the flush wrappers that passed straight through read the books again
        self.flush_watchers: list[Callable[[], None]] = []
        self.seq_counter = itertools.count(1)  # sequence numbers of events; a capture's is its graph's id too
        self.seq = 0

    # process lifetime --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything (a forked child). Containers are cleared in place: wrappers hold them."""
        self.lock = threading.RLock()
        for container in (self.pools, self.dead, self.host_dead, self.graphs, self.minted, self.erased, self.stale,
                          self.pending, self.pending_keys, self.mempools):
            container.clear()
        self.retired.clear()
        for counts in (self.captures_by_scope, self.replays_by_scope, self.unreplayed_by_scope, self.hazards,
                       self.default_stream, self.failed_captures, self.peak_bytes, self.unsettled, self.flushes,
                       self.unflushed):
            counts.clear()
        self.scope = self.test = None
        self.generation += 1

    def next_seq(self) -> int:
        self.seq = next(self.seq_counter)
        return self.seq

    @contextlib.contextmanager
    def engine_scope(self, label: str) -> Iterator[None]:
        """Attribute every capture made inside to ``label`` (an engine of a test)."""
        previous, self.scope = self.scope, label
        try:
            yield
        finally:
            self.scope = previous

    def forget_world(self, world: Any) -> None:
        """An isolated allocator world was destroyed: its pools cannot be captured into again."""
        with self.lock:
            self.drain()
            self.unsettled.pop(world, None)
            self.flushes.pop(world, None)
            self.unflushed.pop(world, None)
            for store in (self.pools, self.dead, self.host_dead, self.erased, self.mempools):
                for key in [k for k in store if k[0] == world]:
                    del store[key]
            self.retired = {k for k in self.retired if k[0] != world}
            for gid in [gid for gid, g in self.graphs.items() if g.world == world]:
                del self.graphs[gid]
            for key in [k for k in self.minted if k[0] == world]:
                del self.minted[key]
            for events in (self.default_stream, self.stale, self.failed_captures):  # (cleared in place)
                others = [d for d in events if d.key[0] != world]
                events.clear()
                events.extend(others)

    # the books ---------------------------------------------------------------------------------------
    def entry(self, world: Any, device: int, pool_id: PoolId) -> PoolEntry:
        key = (world, device, pool_id)
        e = self.pools.get(key)
        if e is None:
            e = self.pools[key] = PoolEntry(world, device, pool_id)
            old = self.erased.pop(key, None)
            if old is not None:  # the allocator created it afresh under an id it had erased
                e.scopes, e.minted_at, e.tests = list(old[0]), old[1], list(old[2])
            else:
                e.minted_at = self.minted.pop((world, pool_id), None)
            e.retired = key in self.retired
        return e

    def restate(self, e: PoolEntry) -> None:
        """Keep ``dead`` current, and move an entry neither allocator holds any more to ``erased``."""
        key = e.key
        if e.held <= 0 and e.host_alive:
            if self.host_dead.get(key) is not e:
                self.host_dead[key] = e
                self._arm_flushes()
        else:
            self.host_dead.pop(key, None)
        if e.dead:
            self.dead[key] = e
            if len(self.dead) > _REMEMBERED:  # under expandable segments dead pools are never settled away
                self._forget_oldest_dead()
            return
        self.dead.pop(key, None)
        self._flushed(e)
        if not (e.device_alive or e.host_alive or e.graphs or e.device_extra):
            self._to_erased(e)

    def _unflushed(self, e: PoolEntry) -> None:
        """The pool was released (or its books read) now: a device flush from here on may erase it."""
        e.checked = self.flushes.get(e.world, 0)
        if e.device_alive and e.device_count <= 0:
            self.unflushed.setdefault(e.world, set()).add(e.key)
            self._arm_flushes()

    def _flushed(self, e: PoolEntry) -> None:
        keys = self.unflushed.get(e.world)
        if keys is not None:
            keys.discard(e.key)
            if not keys:
                del self.unflushed[e.world]

    def _to_erased(self, e: PoolEntry) -> None:
        """Drop a pool's entry, keeping what ``reused`` needs in the bounded record of erased pools."""
        self.pools.pop(e.key, None)
        self.host_dead.pop(e.key, None)
        self._flushed(e)
        self.erased[e.key] = (e.scopes, e.minted_at, e.tests)
        while len(self.erased) > _REMEMBERED:
            self.erased.popitem(last=False)

    def _forget_oldest_dead(self) -> None:
        """A process that never learns whether its released pools went (expandable segments) must not grow
        for ever: forget the oldest dead pool with no graph left (a capture into it is then not judged)."""
        for key, e in self.dead.items():
            if not e.graphs:
                del self.dead[key]
                self._to_erased(e)
                return

    def later(self, key: Key | None, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``, an event about pool ``key`` from a weak-reference callback (a graph or MemPool
        destroyed): applied now, after the captures queued before it, where no ledger operation is under way;
        else queued for the next one (a garbage collection inside an operation, on this thread or another,
        must not change the books underneath it), and dropped if the process forked in between. Applied now,
        the next capture's cache flushes find nothing to drain."""
        lock = self.lock
        if not lock._is_owned() and lock.acquire(blocking=False):
            try:
                if self.pending:
                    self.drain()
                fn(*args)
            finally:
                lock.release()
            return
        self.pending.append((self._in_generation, (self.generation, fn, args)))
        self.pending_keys.add(key)  # None too: an event other than a queued capture is waiting
        self._arm_flushes()

    def _arm_flushes(self) -> None:
        for arm in self.flush_watchers:
            arm()

    def drain_before_capture(self, key: Key) -> None:
        """A capture into ``key`` is about to be judged: apply what concerns it (and everything, once the
        queue is long: a process that only captures must not grow it for ever)."""
        if key in self.pending_keys or len(self.pending) > 256:
            with self.lock:
                self.drain()

    def _in_generation(self, generation: int, fn: Callable[..., None], args: tuple) -> None:
        if generation == self.generation:
            fn(*args)

    def drain(self) -> None:
        """Apply the queued events: captures started (the capture path only queues them) and graphs destroyed
        (weak-reference callbacks), in the order they happened."""
        pending = self.pending
        self.pending_keys.clear()
        while pending:
            item = pending.popleft()
            if type(item) is GraphEntry:  # a capture the capture path queued
                self.add_graph(item)
            else:
                fn, args = item
                fn(*args)

    # events (the observation layer calls these) -----------------------------------------------------
    def note_minted(self, world: Any, pool_id: PoolId, where: Stack) -> None:
        with self.lock:
            self.minted[(world, pool_id)] = where
            while len(self.minted) > _REMEMBERED:
                self.minted.popitem(last=False)
            e = self.pools.get((world, 0, pool_id))
            if e is not None and e.minted_at is None:
                e.minted_at = where

    def stale_attempt(self, e: PoolEntry, where: Stack | None = None, refused: bool = False,
                      facts: tuple[int, tuple] = (0, ())) -> StaleAttempt:
        """Record a capture into the dead pool ``e``; ``facts``: (held bytes, pins) read just before."""
        attempt = StaleAttempt(
            e.key, self.scope, self.next_seq(), e.owner, str(e.minted_at or ""), str(e.released_at or ""),
            e.device_count <= 0 and e.device_alive, e.host_count <= 0 and e.host_alive, self.test,
            str(where or ""), where.site() if where is not None else "", refused,
            e.minted_at.site() if isinstance(e.minted_at, Stack) else "", *facts)
        self.stale.append(attempt)
        return attempt

    def add_graph(self, g: GraphEntry) -> None:
        """Count a started capture into its pool (the observation layer queues this for the next operation)."""
        with self.lock:
            if g.generation != self.generation:
                return
            self.graphs[g.gid] = g
            world, device, pool, seq, frames = g.world, g.device, g.pool_id, g.seq, g.frames
            if pool is None:
                return
            e = self.pools.get((world, device, pool))
            if e is None or e.held <= 0 or not (e.device_alive and e.host_alive) \
                    or (g.scope is not None and g.scope not in e.scopes) \
                    or (g.test is not None and g.test not in e.tests):
                self._count(g)
            else:  # the common case, inline (captures are timed): a live pool taking one more graph stays live
                e.held += 1
                e.captures += 1
                e.graphs[g.gid] = g
                e.last_seq = seq
                if len(e.sites) < SITES:
                    e.sites.append(frames)
                if g.scope is not None:
                    self.captures_by_scope[g.scope] = self.captures_by_scope.get(g.scope, 0) + 1
                g.counted = True

    def capture_bound(self, g: GraphEntry, pool: PoolId) -> None:
        """A capture without a pool argument ended: its graph-minted pool id is readable only now."""
        with self.lock:
            self.drain()  # its start may still be queued
            g.pool_id = pool
            self._count(g)

    def _count(self, g: GraphEntry) -> None:
        e = self.entry(g.world, g.device, g.pool_id)
        e.device_alive = e.host_alive = True
        e.held += 1
        e.captures += 1
        e.graphs[g.gid] = g
        e.last_seq = g.seq
        if len(e.sites) < SITES:
            e.sites.append(g.frames)
        if g.test is not None and g.test not in e.tests:
            e.tests.append(g.test)
        if g.scope is not None:
            self.captures_by_scope[g.scope] = self.captures_by_scope.get(g.scope, 0) + 1
            if g.scope not in e.scopes:
                e.scopes.append(g.scope)
        g.counted = True
        self.restate(e)

    def released(self, g: GraphEntry, where: Stack | str) -> None:
        """A captured graph was reset: its references go back."""
        with self.lock:
            self.drain()
            if g.captured:
                g.captured = False
                self._give_back(g, where)

    def _give_back(self, g: GraphEntry, where: Stack | str) -> None:
        if not g.counted:
            return
        g.counted = False
        e = self.entry(g.world, g.device, g.pool_id)
        e.held -= 1
        if e.device_count <= 0 or e.host_count <= 0:
            e.released_at = where
            self._unflushed(e)
        self.restate(e)

    def graph_destroyed(self, g: GraphEntry) -> None:
        """Queued by the graph's weak reference: destruction resets a captured graph."""
        with self.lock:
            if not g.alive or g.generation != self.generation:
                return
            g.alive = False
            self._forget_replays(g)
            if g.captured:
                g.captured = False
                self._give_back(g, "(the graph object was destroyed)\n")
            # forget it: a long-lived process (a server that reloads models) must not grow with every capture
            self.graphs.pop(g.gid, None)
            if g.pool_id is not None:
                e = self.pools.get((g.world, g.device, g.pool_id))
                if e is not None:
                    e.graphs.pop(g.gid, None)
                    self.restate(e)

    def replaced(self, old: GraphEntry) -> None:
        """A graph object captured again after reset: its old entry describes nothing alive."""
        with self.lock:
            old.alive = False
            self._forget_replays(old)
            self.graphs.pop(old.gid, None)

    def _forget_replays(self, g: GraphEntry) -> None:
        if g.scope is not None and g.pool_id is not None:
            self.replays_by_scope[g.scope] = self.replays_by_scope.get(g.scope, 0) + g.replays
            if not g.replays:
                self.unreplayed_by_scope[g.scope] = self.unreplayed_by_scope.get(g.scope, 0) + 1

    def torch_refusals(self, since: int = 0, worlds: Any = None) -> list[DefaultStreamCapture]:
        """torch's own refusals of a capture on the default stream after sequence ``since`` (in ``worlds``, a
        container of worlds, if given), oldest first: each left the process's random ops poisoned."""
        return [d for d in list(self.default_stream)
                if not d.refused and d.seq > since and (worlds is None or d.key[0] in worlds)]

    def failed_captures_since(self, since: int = 0, worlds: Any = None) -> list[FailedCapture]:
        """Captures whose end raised after sequence ``since`` (in ``worlds``, if given), oldest first."""
        with self.lock:
            return [f for f in self.failed_captures if f.seq > since and (worlds is None or f.key[0] in worlds)]

    def allocator_asserts(self, since: int = 0, worlds: Any = None) -> list[StaleAttempt]:
        """Captures into dead pools no judge refused after sequence ``since`` (in ``worlds``, if given), oldest
        first: the allocator asserted on each, leaving the process poisoned."""
        with self.lock:
            return [a for a in self.stale
                    if not a.refused and a.seq > since and (worlds is None or a.key[0] in worlds)]

    def note_hazard(self, hazard: TeardownHazard) -> None:
        """Record a teardown hazard, and (where ``CUDAGRAPH_HAZARD_FILE`` names a file: a reused worker or
        rank) append it there at once: the crash it announces may leave no other record."""
        with self.lock:
            self.hazards.append(hazard)
        path = os.environ.get(HAZARD_FILE)
        if path:
            line = json.dumps({"pid": os.getpid(), "pool_id": list(hazard.key[2]), "device": hazard.key[1],
                               "live_bytes": hazard.live_bytes, "reset_site": hazard.reset_site,
                               "test": hazard.test, "engine": hazard.scope, "sites": list(hazard.sites)})
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, (line + "\n").encode())
                finally:
                    os.close(fd)
            except OSError:
                pass  # the hazard is still in the ledger

    def pool_reference(self, world: Any, device: int, pool: PoolId, delta: int, where: Stack | str) -> None:
        """A reference taken (MemPool born, warm-up allocation begun) or given back outside any graph."""
        with self.lock:
            self.drain()
            e = self.entry(world, device, pool)
            e.device_extra += delta
            if delta > 0:
                e.device_alive = True
            elif e.device_count <= 0:
                e.released_at = where
                self._unflushed(e)
            self.restate(e)

    def device_flushed(self, world: Any, reader: Callable[[], Callable[[int, PoolId], int] | None]) -> None:
        """``empty_cache`` ran: a pool at use count 0 whose segments were all free is erased. Which ones is
        decided at the next :meth:`settle` (a query, or a capture into one of them), not here: torch.cuda.graph
        flushes at every capture, and reading the allocator's books costs ~300 us on CUDA. Deferring is exact:
        a pool's segments go only at a flush, so a pool that has none at the settle had no live block at one
        of the flushes since it was released (and was erased there), and one that still has some was not.
        Nothing here walks the pools: the flush is counted, and a released pool counts as flushed once the
        count passed what it was at its release (``PoolEntry.checked``)."""
        with self.lock:
            # graphs destroyed before the flush were released before it; queued captures alone change nothing a
            # flush decides (torch.cuda.graph flushes at each capture): they wait for the next query
            if self.pending_keys:
                self.drain()
            self.flushes[world] = self.flushes.get(world, 0) + 1
            self.unsettled[world] = reader
            self.unflushed.pop(world, None)

    def maybe_erased(self, e: PoolEntry) -> bool:
        """A released pool that a device flush since its release (or its last settle) may have erased."""
        return e.device_count <= 0 and e.device_alive and self.flushes.get(e.world, 0) > e.checked

    def settle(self, world: Any = None) -> None:
        """Decide which flushed pools the flushes erased: one read of the books per world (and device), only
        where a released pool may have gone. A read that raises changes nothing: the reader stays for the
        next settle."""
        with self.lock:
            for w in [w for w in self.unsettled if world is None or w == world]:
                flushed = [e for e in list(self.dead.values()) if e.world == w and self.maybe_erased(e)]
                read = self.unsettled[w]() if flushed else None
                erased = [e for e in flushed if read is not None and read(e.device, e.pool_id) == 0]
                del self.unsettled[w]
                for e in flushed:
                    if e in erased:
                        e.device_alive = False
                        self.restate(e)
                    else:  # still there when read: the next flush may erase it
                        self._unflushed(e)

    def watch_pool_bytes(self, scope: str) -> None:
        """Keep the peak bytes of the pools ``scope`` captures into (a budget's test): see :meth:`before_flush`."""
        with self.lock:
            self.peak_bytes[scope] = 0
            self._arm_flushes()

    def unwatch_pool_bytes(self, scope: str) -> None:
        with self.lock:
            self.peak_bytes.pop(scope, None)

    def before_flush(self, world: Any, read: Callable[[int, PoolId], int]) -> None:
        """A device cache flush is about to free the segments of dead pools: remember what the watched
        scopes' pools hold first. ``read(device, pool_id)`` gives a pool's reserved bytes now."""
        with self.lock:
            for scope in self.peak_bytes:
                held = sum(read(d, p) for _, d, p in self.pools_of_scope(world, scope))
                self.peak_bytes[scope] = max(self.peak_bytes[scope], held)

    def peak_pool_bytes(self, world: Any, scope: str, read: Callable[[int, PoolId], int]) -> int:
        """The most bytes ``scope``'s pools held together: the larger of what they hold now and what they held
        before each flush since :meth:`watch_pool_bytes` (without a watch, what they hold now). Pools used one
        after another count once each, not added up."""
        with self.lock:
            held = sum(read(d, p) for _, d, p in self.pools_of_scope(world, scope))
            return max(self.peak_bytes.get(scope, 0), held)

    def host_flushed(self, world: Any) -> None:
        """The host allocator's flush erases its graph pools at use count 0 (captures hold no host block)."""
        if not (self.host_dead or self.pending_keys):
            return
        with self.lock:
            self.drain()
            for e in [e for e in self.host_dead.values() if e.world == world]:
                e.host_alive = False
                self.restate(e)

    def retire(self, world: Any, device: int, pool: PoolId) -> None:
        """A LazyPool retired the id: it is never to be captured into again."""
        with self.lock:
            self.drain()
            key = (world, device, pool)
            self.retired.add(key)
            e = self.pools.get(key)
            if e is not None:
                e.retired = True

    # queries -----------------------------------------------------------------------------------------
    def snapshot(self, world: Any = None) -> list[PoolEntry]:
        """The pool entries (of one world, or all), after applying queued events and settling flushes."""
        with self.lock:
            self.drain()
            self.settle(world)
            return [e for e in list(self.pools.values()) if world is None or e.world == world]

    def live_graphs(self, world: Any = None) -> list[GraphEntry]:
        with self.lock:
            self.drain()
            return [g for g in list(self.graphs.values())
                    if g.alive and g.captured and (world is None or g.world == world)]

    def pool(self, world: Any, device: int, pool: PoolId) -> PoolEntry | None:
        with self.lock:
            self.drain()
            self.settle(world)
            return self.pools.get((world, device, tuple(pool)))

    def scopes_of(self, world: Any, device: int, pool: PoolId) -> list[str]:
        """Every engine scope that captured into the pool, also after the allocator erased it."""
        with self.lock:
            self.drain()
            key = (world, device, tuple(pool))
            e = self.pools.get(key)
            if e is not None:
                return list(e.scopes)
            old = self.erased.get(key)
            return list(old[0]) if old else []

    def pools_of_scope(self, world: Any, scope: str) -> list[Key]:
        """The pools captured into within an engine scope, whether or not the allocator still holds them."""
        with self.lock:
            self.drain()
            keys = [e.key for e in self.pools.values() if e.world == world and scope in e.scopes]
            keys += [k for k, old in self.erased.items() if k[0] == world and scope in old[0]]
            return sorted(set(keys), key=lambda k: (k[1], k[2]))

    def captures_in(self, scope: str) -> int:
        with self.lock:
            self.drain()
            return self.captures_by_scope.get(scope, 0)

    def replays_in(self, scope: str) -> tuple[int, int]:
        """(replays of the scope's graphs, how many of its graphs were never replayed), alive or gone."""
        with self.lock:
            self.drain()
            alive = [g for g in self.graphs.values() if g.scope == scope and g.pool_id is not None]
            return (self.replays_by_scope.get(scope, 0) + sum(g.replays for g in alive),
                    self.unreplayed_by_scope.get(scope, 0) + sum(1 for g in alive if not g.replays))

    def stale_since(self, seq: int, world: Any = None) -> list[StaleAttempt]:
        with self.lock:
            return [s for s in self.stale if s.seq > seq and (world is None or s.key[0] == world)]

    def was_minted(self, world: Any, pool: PoolId) -> bool:
        with self.lock:
            pool = tuple(pool)
            return (world, pool) in self.minted or any(k[0] == world and k[2] == pool for k in self.pools) \
                or any(k[0] == world and k[2] == pool for k in self.erased)

    def is_retired(self, world: Any, device: int, pool: PoolId) -> bool:
        with self.lock:
            return (world, device, tuple(pool)) in self.retired


ledger = Ledger()
os.register_at_fork(after_in_child=ledger.reset)
