"""The ledger's queue of events applied later, in the order they happened: captures the capture path only
queued (counted at the next operation, a runner's graphs together, warm), and weak-reference callbacks (a
graph or MemPool destroyed) that came while a ledger operation was under way, so that nothing changes
underneath a reader.

The queue and its set of pool keys are bound once by the capture wrappers, Python and compiled
(``observe/_capture.c``): they are cleared in place, never rebound.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from .entries import GraphEntry, Key


class EventQueue:
    """The event queue, a part of the :class:`~cudagraph_lifecycle.ledger.Ledger` (whose lock and generation
    it uses); a queued capture is counted by the graph books (``add_graph``)."""

    def _init_queue(self) -> None:
        self.pending: deque = deque()  # captures started (an entry, or (callable, args)), weak-reference callbacks
        # the pools those events touch (None: an event of no known pool): a capture drains only for its own
        self.pending_keys: set[Key | None] = set()

    def _clear_queue(self) -> None:
        self.pending.clear()
        self.pending_keys.clear()

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
