"""The pool table: one entry per pool a graph captured into, per allocator world, and the pool's life around
its graphs: its id minted, references taken or given back outside a graph (a MemPool, a warm-up
allocation), dead (every reference given back while an allocator still holds it), retired by a LazyPool,
erased (neither allocator holds it any more: a bounded record keeps who captured into it, for ``reused``);
and the queries that read it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

from .entries import Key, PoolEntry, PoolId
from .stacks import Stack

_REMEMBERED = 4096  # erased pools and unused mints remembered, oldest forgotten first


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


class PoolTable:
    """The pool table, a part of the :class:`~cudagraph_lifecycle.ledger.Ledger` (whose lock guards it).
    :meth:`restate` keeps an entry's standing current after every change, whichever part made it; through the
    flush accounting it arms the flush gates and ends a pool's wait for a flush."""

    def _init_pools(self) -> None:
        self.pools: dict[Key, PoolEntry] = {}
        self.dead = DeadPools()  # kept equal to {k: e for e in pools if e.dead} at every change
        # the dead pools the host allocator still holds (what its next flush erases): torch.cuda.graph flushes
        # at every capture, so the flush must not walk every dead pool
        self.host_dead: dict[Key, PoolEntry] = {}
        self.minted: OrderedDict[tuple[Any, PoolId], Stack] = OrderedDict()
        self.retired: set[Key] = set()
        # erased pools: (scopes, mint site, tests), for ``reused``; at most _REMEMBERED of them (~1 KB each)
        self.erased: OrderedDict[Key, tuple[list[str], Any, list[str]]] = OrderedDict()
        # pool -> a weak reference to the MemPool object that made it: while it lives, the pool does (a leak
        # whose blocks are all free is that object's holder's, and a finding names it)
        self.mempools: dict[Key, weakref.ref] = {}

    def _clear_pools(self) -> None:
        for container in (self.pools, self.dead, self.host_dead, self.minted, self.erased, self.mempools,
                          self.retired):
            container.clear()

    def _forget_pools(self, world: Any) -> None:
        for store in (self.pools, self.dead, self.host_dead, self.erased, self.mempools):
            for key in [k for k in store if k[0] == world]:
                del store[key]
        self.retired = {k for k in self.retired if k[0] != world}
        for key in [k for k in self.minted if k[0] == world]:
            del self.minted[key]

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

    # events (the observation layer calls these) -----------------------------------------------------
    def note_minted(self, world: Any, pool_id: PoolId, where: Stack) -> None:
        """A pool id was minted (a handle, a MemPool): kept until its first capture makes the entry. An id is
        new when minted, so no entry of it exists yet."""
        with self.lock:
            self.minted[(world, pool_id)] = where
            while len(self.minted) > _REMEMBERED:
                self.minted.popitem(last=False)

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

    def was_minted(self, world: Any, pool: PoolId) -> bool:
        with self.lock:
            pool = tuple(pool)
            return (world, pool) in self.minted or any(k[0] == world and k[2] == pool for k in self.pools) \
                or any(k[0] == world and k[2] == pool for k in self.erased)

    def is_retired(self, world: Any, device: int, pool: PoolId) -> bool:
        with self.lock:
            return (world, device, tuple(pool)) in self.retired
