"""The lazy pool handle: one private pool per device, minted on first capture, retired at release.

Why lazy: an id minted at import or construction time outlives the engine that used it. A reused worker
that builds a second engine would capture into the first engine's id after all its graphs were reset,
and the caching allocator asserts ``use_count > 0`` (docs/ARCHITECTURE.md, measured facts). Minting on first capture and
retiring at release makes every engine's pool fresh; the retired set makes "never again" checkable.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from .backends import Backend, PoolId, PoolState, get_backend
from .choices import POOL_MODES
from .errors import ConfigError, RetiredPoolError
from .ledger import Stack, ledger


@dataclass(frozen=True)
class PoolRecord:
    """One pool a LazyPool minted: where, when (generation), and the stack that minted it."""

    pool_id: PoolId
    device: int
    generation: int
    mode: str
    minted_at: str


class LazyPool:
    """A private memory pool per device for all graphs of one engine.

    * ``acquire(device)`` mints the device's pool on first use (never at construction), and returns the
      same id until ``retire()``;
    * ``retire()`` drops every pool; a retired id is never handed out again, and capturing into one
      through :meth:`check_capturable` raises :class:`RetiredPoolError`;
    * after ``retire()`` the next ``acquire`` mints a new pool (a new generation), so even a LazyPool kept
      at class level is safe across engines;
    * thread-safe; a forked child starts with no pool.

    ``mode="mempool"`` owns the pool through ``torch.cuda.MemPool`` (its own reference keeps the pool
    alive while the engine lives, so no capture into it can hit the dead-pool assert); ``mode="handle"``
    uses a raw ``graph_pool_handle()`` id. ``auto`` takes mempool where the backend has it.
    """

    def __init__(self, backend: Backend | str = "auto", mode: str = "auto", name: str = "pool"):
        if mode not in POOL_MODES:
            raise ConfigError(f"unknown pool mode {mode!r}: choose one of {', '.join(POOL_MODES)}")
        self.backend = get_backend(backend)
        if mode == "auto":
            mode = "mempool" if self.backend.has_mempool() else "handle"
        elif mode == "mempool" and not self.backend.has_mempool():
            raise ConfigError(
                f"pool mode 'mempool' needs torch.cuda.MemPool, which backend {self.backend.name!r} "
                "lacks in this torch build: use mode='handle' or 'auto'"
            )
        self.mode = mode
        self.name = name
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._generation = 0
        self._pools: dict[int, tuple[PoolId, Any]] = {}  # device -> (id, owner object or None)
        self._records: list[PoolRecord] = []

    def _after_fork_check(self) -> None:
        if os.getpid() != self._pid:
            # The parent's pools belong to the parent's allocator: forget them without releasing.
            self._pid = os.getpid()
            self._pools = {}
            self._generation += 1

    @property
    def generation(self) -> int:
        return self._generation

    def acquire(self, device: int = 0) -> PoolId:
        """The device's pool id, minted now if this is the first capture since construction or retire."""
        self.backend.check_device(device)
        with self._lock:
            self._after_fork_check()
            entry = self._pools.get(device)
            if entry is not None:
                return entry[0]
            owner = None
            if self.mode == "mempool":
                owner = self.backend.mempool(device)
                pool_id = tuple(owner.id)
            else:
                pool_id = self.backend.graph_pool_handle()
            if ledger.is_retired(self.backend.world, device, pool_id):  # never use a retired id again
                raise RetiredPoolError(
                    f"the allocator returned pool id {pool_id} on device {device}, which was already "
                    "retired; this should not happen: please report it with your torch version"
                )
            ledger.note_minted(self.backend.world, pool_id, Stack.here())
            self._pools[device] = (pool_id, owner)
            stack = "".join(traceback.format_stack(limit=8)[:-1])
            self._records.append(PoolRecord(pool_id, device, self._generation, self.mode, stack))
            return pool_id

    def current(self, device: int = 0) -> PoolId | None:
        """The device's pool id if one was minted and not retired, else None (mints nothing)."""
        with self._lock:
            self._after_fork_check()
            entry = self._pools.get(device)
            return None if entry is None else entry[0]

    def use_count(self, device: int = 0) -> int | None:
        """The allocator's use count of the device's current pool, where it can be read (else None)."""
        with self._lock:
            self._after_fork_check()
            entry = self._pools.get(device)
            if entry is None:
                return None
            pool_id, owner = entry
            if owner is not None:
                return int(owner.use_count())
            return self.backend.pool_state(pool_id, device).use_count

    def devices(self) -> list[int]:
        with self._lock:
            self._after_fork_check()
            return sorted(self._pools)

    def check_capturable(self, pool_id: PoolId, device: int = 0) -> None:
        """Raise :class:`RetiredPoolError` if ``pool_id`` was retired (by any LazyPool of this world)."""
        if ledger.is_retired(self.backend.world, device, pool_id):
            raise RetiredPoolError(
                f"pool {tuple(pool_id)} on device {device} was retired when its engine was released; "
                f"capturing into it again is the stale-pool bug (use_count > 0 INTERNAL ASSERT on CUDA). "
                f"Call {self.name}.acquire(device) for a fresh pool instead of keeping an old id"
            )

    def retire(self) -> list[PoolId]:
        """Drop every pool of this LazyPool; their ids are never handed out again. Idempotent."""
        with self._lock:
            self._after_fork_check()
            retired = []
            for device, (pool_id, _owner) in self._pools.items():
                ledger.retire(self.backend.world, device, pool_id)
                retired.append(pool_id)
            self._pools = {}  # drops the MemPool owners: their own references go now
            if retired:
                self._generation += 1
            return retired

    def state(self, device: int = 0, pool_id: PoolId | None = None) -> PoolState | None:
        """The allocator's books for the device's current pool (or ``pool_id``); None if none was minted."""
        pid = pool_id if pool_id is not None else self.current(device)
        return None if pid is None else self.backend.pool_state(pid, device)

    @property
    def records(self) -> list[PoolRecord]:
        return list(self._records)

    def __repr__(self) -> str:
        pools = {d: p for d, (p, _) in self._pools.items()}
        return f"LazyPool(name={self.name!r}, mode={self.mode!r}, generation={self._generation}, pools={pools})"
