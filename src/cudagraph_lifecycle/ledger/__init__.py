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

The :class:`Ledger` is one object made of parts, one module each: the pool table (``pools``), the graph
books (``graphs``), the flush accounting (``flushes``), the event queue (``event_queue``) and the event log
(``event_log``); what the books hold is in ``entries``, and how stacks are taken and shown in ``stacks``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

from .entries import (
    DefaultStreamCapture,
    FailedCapture,
    GraphEntry,
    Key,
    PoolEntry,
    PoolId,
    StaleAttempt,
    TeardownHazard,
)
from .event_log import HAZARD_FILE, EventLog
from .event_queue import EventQueue
from .flushes import FlushAccounting
from .graphs import GraphBooks
from .pools import _REMEMBERED as _REMEMBERED  # (read by a benchmark)
from .pools import DeadPools, PoolTable
from .stacks import (
    CAPTURE_STACK_DEPTH,
    SITES,
    STACK_DEPTH,
    Stack,
    capture_frames,
    graph_sites,
    innermost_user_frames,
    is_machinery,
    is_user_file,
    raised_at,
    raised_site,
    shown_traceback,
    sites_of,
)
from .stacks import _line_of as _line_of  # (read by the capture-path tests)
from .stacks import _user_file as _user_file  # (its cache cleared by a test)


class Ledger(PoolTable, GraphBooks, FlushAccounting, EventQueue, EventLog):
    """See the module docstring. One instance per process: :data:`ledger`.

    One object, not parts held by it: the capture wrappers, Python and compiled (``observe/_capture.c``), bind
    its containers once and read ``scope``, ``test`` and ``generation`` and set ``seq`` on it at every
    capture, and the parts call one another under its one lock (a reset restates a pool; a restated pool arms
    the flush gates; a drain counts captures). Each part keeps its own state, made, cleared at a fork and
    forgotten with a world by its own methods."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.scope: str | None = None
        self.test: str | None = None  # the test running now, set by the pytest plugin (in workers: per call)
        self._init_pools()
        self._init_graphs()
        self._init_flushes()
        self._init_queue()
        self._init_log()
        self.generation = 0
        self.seq_counter = itertools.count(1)  # sequence numbers of events; a capture's is its graph's id too
        self.seq = 0

    # process lifetime --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything (a forked child). Containers are cleared in place: wrappers hold them."""
        self.lock = threading.RLock()
        self._clear_pools()
        self._clear_graphs()
        self._clear_flushes()
        self._clear_queue()
        self._clear_log()
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
            self._forget_flushes(world)
            self._forget_pools(world)
            self._forget_graphs(world)
            self._forget_log(world)


ledger = Ledger()
os.register_at_fork(after_in_child=ledger.reset)

__all__ = [
    "CAPTURE_STACK_DEPTH",
    "HAZARD_FILE",
    "SITES",
    "STACK_DEPTH",
    "DeadPools",
    "DefaultStreamCapture",
    "FailedCapture",
    "GraphEntry",
    "Key",
    "Ledger",
    "PoolEntry",
    "PoolId",
    "StaleAttempt",
    "Stack",
    "TeardownHazard",
    "capture_frames",
    "graph_sites",
    "innermost_user_frames",
    "is_machinery",
    "is_user_file",
    "ledger",
    "raised_at",
    "raised_site",
    "shown_traceback",
    "sites_of",
]
