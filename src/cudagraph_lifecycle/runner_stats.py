"""What a runner reports: its counters (``RunnerStats``: captures, failures, replays, eager fallbacks by
reason, its pool's bytes, capture time, the bytes each graph's capture added), what the allocator's books say
after its release (``ReleaseReport``), and what a caller reads it through (``RunnerReports``: its stats, its
pools, the outputs it holds, the captured tensors that died or moved since).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import checks
from .backends import PoolId, PoolState
from .errors import CapturedAddressError, ConfigError
from .trees import leaves

FALLBACK_REASONS = ("batch_over_max", "key_not_captured", "disabled", "capture_failed")


@dataclass
class RunnerStats:
    captures: int = 0
    capture_failures: int = 0
    replays: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    pool_id: PoolId | None = None
    pool_bytes: int = 0
    capture_ms: float = 0.0
    failures: list[str] = field(default_factory=list)
    graph_bytes: dict[str, int] = field(default_factory=dict)  # "batch {extra}": pool bytes its capture added

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pool_id"] = None if self.pool_id is None else list(self.pool_id)
        return d


@dataclass(frozen=True)
class ReleaseReport:
    """What the allocator's books say after a release: ``clean`` when no segment of the pool is left."""

    pools: tuple[PoolState, ...]
    reserved_before: int
    reserved_after: int

    @property
    def clean(self) -> bool:
        return all(s.reserved_bytes == 0 for s in self.pools)

    @property
    def pinned_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self.pools)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pools": [s.as_dict() for s in self.pools],
            "reserved_before": self.reserved_before,
            "reserved_after": self.reserved_after,
            "clean": self.clean,
            "pinned_bytes": self.pinned_bytes,
        }


class RunnerReports:
    """What a caller reads a runner through: released, the pools it captured into, its stats, the outputs it
    holds, and the address check. The state is the runner's (``CUDAGraphRunner`` derives from this)."""

    @property
    def released(self) -> bool:
        return self._released

    @property
    def pool_ids(self) -> list[tuple[int, PoolId]]:
        return list(self._pool_ids)

    @property
    def stats(self) -> RunnerStats:
        s = self._stats
        s.fallbacks = {r: self._fallbacks[r] for r in FALLBACK_REASONS if self._fallbacks[r]}
        if s.pool_id is not None:
            s.pool_bytes = self.backend.pool_state(s.pool_id, self.device).reserved_bytes
        return s

    def outputs_alive(self) -> int:
        """How many static output tensors the runner still holds (0 after release)."""
        return sum(
            1 for _, out in self._graphs.values() for t in leaves(out) if isinstance(t, torch.Tensor)
        )

    def check_addresses(self, raise_: bool = True) -> list[str]:
        """Every tensor a graph read at capture (weights, static inputs, caches) that died or moved since:
        name (where ``names`` knows it), old and new address, the graphs that read it. Raises
        :class:`CapturedAddressError` listing them (``raise_=False``: returns them). Needs the ``capture`` check."""
        if "capture" not in self.checks:
            raise ConfigError(f"runner {self.name!r}: check_addresses() needs checked=True or a checked list with "
                              f"'capture' (checked={sorted(self.checks)!r}): the capture then records what each "
                              "graph reads")
        found = self._addresses.problems(checks.named_tensors(self._names))
        if found and raise_:
            raise CapturedAddressError(f"runner {self.name!r}: {len(found)} captured tensor(s) died or moved since "
                                       "the capture:\n" + "\n".join(f"- {p}" for p in found))
        return found
