"""The captured graphs and what each does to its pool's use counts: a capture counted into its pool (the
capture path only queues it: counted at the ledger's next operation), its pool bound at capture_end, a
reset, the graph destroyed or captured again; the captures and replays of each engine scope; and the
queries that read them.
"""

from __future__ import annotations

from typing import Any

from .entries import GraphEntry, PoolId
from .stacks import SITES, Stack


class GraphBooks:
    """The graph books, a part of the :class:`~cudagraph_lifecycle.ledger.Ledger` (whose lock guards them):
    every use count they move is kept in the pool table's entries (``entry``, ``restate``)."""

    def _init_graphs(self) -> None:
        self.graphs: dict[int, GraphEntry] = {}
        self.captures_by_scope: dict[str, int] = {}
        self.replays_by_scope: dict[str, int] = {}  # replays of the scope's graphs that are gone
        self.unreplayed_by_scope: dict[str, int] = {}  # the scope's graphs that went without one replay

    def _clear_graphs(self) -> None:
        for container in (self.graphs, self.captures_by_scope, self.replays_by_scope, self.unreplayed_by_scope):
            container.clear()

    def _forget_graphs(self, world: Any) -> None:
        for gid in [gid for gid, g in self.graphs.items() if g.world == world]:
            del self.graphs[gid]

    # events (the observation layer calls these) -----------------------------------------------------
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

    # queries -----------------------------------------------------------------------------------------
    def live_graphs(self, world: Any = None) -> list[GraphEntry]:
        with self.lock:
            self.drain()
            return [g for g in list(self.graphs.values())
                    if g.alive and g.captured and (world is None or g.world == world)]

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
