"""What went wrong at a capture or a reset, as the ledger keeps it (the latest 256 of each kind): captures
into dead pools, captures begun on the default stream, captures whose end raised, and teardown hazards
(each also written at once, where a worker asks, to ``CUDAGRAPH_HAZARD_FILE``: the crash it announces may
leave no other record); and the queries that read them.
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any

from .entries import DefaultStreamCapture, FailedCapture, PoolEntry, StaleAttempt, TeardownHazard
from .stacks import Stack

HAZARD_FILE = "CUDAGRAPH_HAZARD_FILE"  # where a worker's teardown hazards go as they happen (JSON lines)


class EventLog:
    """The event log, a part of the :class:`~cudagraph_lifecycle.ledger.Ledger` (whose lock guards it, and
    whose engine scope, test and sequence numbers an attempt records). The observation layer appends
    default-stream captures and failed captures itself, under the lock."""

    def _init_log(self) -> None:
        self.stale: deque[StaleAttempt] = deque(maxlen=256)
        self.hazards: deque[TeardownHazard] = deque(maxlen=256)
        self.default_stream: deque[DefaultStreamCapture] = deque(maxlen=256)
        self.failed_captures: deque[FailedCapture] = deque(maxlen=256)

    def _clear_log(self) -> None:
        for events in (self.stale, self.hazards, self.default_stream, self.failed_captures):
            events.clear()

    def _forget_log(self, world: Any) -> None:
        for events in (self.default_stream, self.stale, self.failed_captures):  # (cleared in place)
            others = [d for d in events if d.key[0] != world]
            events.clear()
            events.extend(others)

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

    # queries -----------------------------------------------------------------------------------------
    def torch_refusals(self, since: int = 0, worlds: Any = None) -> list[DefaultStreamCapture]:
        """torch's own refusals of a capture on the default stream after sequence ``since`` (in ``worlds``, a
        container of worlds, if given), oldest first: each left the process's random ops poisoned."""
        with self.lock:
            return [d for d in self.default_stream
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

    def stale_since(self, seq: int, world: Any = None) -> list[StaleAttempt]:
        with self.lock:
            return [s for s in self.stale if s.seq > seq and (world is None or s.key[0] == world)]
