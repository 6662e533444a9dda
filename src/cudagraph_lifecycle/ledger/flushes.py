"""Cache flushes as the ledger accounts for them: arming the flush gates (something starts waiting for a
flush), the device flushes counted per world and the released pools waiting for one, the settle that
reads an allocator's books once to learn which flushed pools went, the host flush, and a budget's peak pool
bytes, read just before each device flush.

Most flushes pass straight through the observation layer's gates (``observe.wrappers.FlushGate``): a gate is
armed, through :attr:`~FlushAccounting.flush_watchers`, only while a released pool, a host-dead pool, a
queued event or a watched budget waits for a flush.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .entries import Key, PoolEntry, PoolId


class FlushAccounting:
    """The flush accounting, a part of the :class:`~cudagraph_lifecycle.ledger.Ledger` (whose lock guards it);
    a settle restates what it decided in the pool table."""

    def _init_flushes(self) -> None:
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
        # called whenever a flush may have something to record (an event queued, a released pool waiting for a
        # flush, a budget watched): the flush wrappers that passed straight through read the books again
        self.flush_watchers: list[Callable[[], None]] = []

    def _clear_flushes(self) -> None:
        # (not the watchers: the observation layer registers them, and drops them when it uninstalls)
        for container in (self.peak_bytes, self.unsettled, self.flushes, self.unflushed):
            container.clear()

    def _forget_flushes(self, world: Any) -> None:
        self.unsettled.pop(world, None)
        self.flushes.pop(world, None)
        self.unflushed.pop(world, None)

    def _arm_flushes(self) -> None:
        for arm in self.flush_watchers:
            arm()

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

    def host_flushed(self, world: Any) -> None:
        """The host allocator's flush erases its graph pools at use count 0 (captures hold no host block)."""
        if not (self.host_dead or self.pending_keys):
            return
        with self.lock:
            self.drain()
            for e in [e for e in self.host_dead.values() if e.world == world]:
                e.host_alive = False
                self.restate(e)

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
