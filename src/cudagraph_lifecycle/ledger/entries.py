"""What the ledger's books hold: one ``GraphEntry`` per captured graph, one ``PoolEntry`` per pool, and the
records of what went wrong at a capture or a reset (``StaleAttempt``, ``DefaultStreamCapture``,
``FailedCapture``, ``TeardownHazard``).

``GraphEntry``'s slots are set directly by the compiled capture path (``observe/_capture.c`` reads their
offsets from the class's member descriptors): their names and order are part of that contract.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from .stacks import Stack, sites_of

PoolId = tuple[int, int]
Key = tuple[Any, int, PoolId]  # (allocator world, device, pool id)


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
