"""What one engine cycle found: a verdict about its graph pools, typed problems, and the figures.

Verdicts (about graph pools only; one per engine):

* ``fresh``: every pool it captured into is gone after release;
* ``held``: its pools hold only what the caller's output pins (expected; the pool must be empty once that
  output is dropped, which the next cycle checks);
* ``leaked``: bytes of its pools stay pinned by something other than the caller's output (a module global,
  the autograd history of a copy, a workspace), or a graph was never reset;
* ``stale``: a capture into a dead pool (``StalePoolError`` with the sanitizer on, the allocator's
  ``use_count > 0`` assert with it off);
* ``reused``: it captured into a pool id an earlier, released engine captured into: a latent stale handle
  even when nothing pinned the pool this time;
* ``error``: the engine raised something else (the cycle could not judge its pools).

Default-pool growth (weights, workspaces, per-stream caches) is measured and shown, never a verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

VERDICTS = ("fresh", "held", "leaked", "stale", "reused", "error")
# problem kinds that fail a cycle always, and those that fail it only in strict mode
FAILING = ("stale", "leaked", "graphs_not_reset", "replay_mismatch", "replay_check", "captured_address",
           "growth_over_budget", "pool_over_budget", "too_many_captures", "never_replayed", "expandable_teardown",
           "error")
STRICT_FAILING = ("reused", "pool_ids_mismatch", "release_incomplete", "sanitizer")
# problem kinds that never fail a cycle: what a reader of the verdict should know
NOTES = ("held_unconfirmed",)


def ends_process(poisoned: bool, verdict: str) -> bool:
    """Whether judging stops at a cycle and its worker is replaced: the allocator asserted or torch poisoned the
    process, or a capture went into a dead pool, where the allocator asserts unless a sanitizer refused it
    first. A stale cycle ends alike in every sanitizer mode, so what is judged does not depend on what watched."""
    return bool(poisoned) or verdict == "stale"


def failing_kinds(strict: bool) -> frozenset[str]:
    """The problem kinds that fail a cycle, in strict mode or not."""
    return frozenset(FAILING) | (frozenset(STRICT_FAILING) if strict else frozenset())


@dataclass
class Problem:
    kind: str
    message: str
    bytes: int = 0
    stacks: list[str] = field(default_factory=list)
    pins: list[dict] = field(default_factory=list)  # what pins a leaked pool (sanitizer.pins.Pin as dicts)
    sites: list[str] = field(default_factory=list)  # the user's lines it is about (file:line in function)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CycleRecord:
    index: int
    pid: int
    backend: str
    engine: str  # the engine scope: the test and the engine's index
    verdict: str = "fresh"
    failed: bool = False
    strict: bool = False
    pool_ids: list[list] = field(default_factory=list)  # observed: [[device, [a, b]], ...]
    declared_pool_ids: list[list] | None = None  # what the engine's pool_ids() (or runner) said
    graphs: int = 0  # captures observed in this engine's scope
    replays: int = 0  # replays of those graphs
    graph_bytes: dict[str, int] | None = None  # per graph, where the engine's runner measured it
    capture_ms: float = 0.0
    cold: bool = False  # the first capture timed in its process: it includes the process's first use of torch
    replay_max_abs_err: float | None = None
    pool_bytes: int = 0  # its pools' bytes before release
    held_bytes: int = 0  # after release, pinned by the output the caller holds
    leaked_bytes: int = 0
    growth_bytes: int = 0  # what the engine left in the default pool: its growth from before the build, >= 0
    kept_bytes: int = 0  # the default pool's live blocks the engine left (growth in blocks, not segments), >= 0
    freed_earlier_bytes: int = 0  # default-pool bytes from before the engine that went during it
    # the allocator asserted, or torch refused a capture on the default stream: this process is of no more use
    poisoned: bool = False
    problems: list[Problem] = field(default_factory=list)
    sanitizer: list[dict] = field(default_factory=list)

    def note_pool(self, key: tuple) -> None:
        """A pool (a ledger key: world, device, pool id) this cycle captured into, once."""
        entry = [key[1], list(key[2])]
        if entry not in self.pool_ids:
            self.pool_ids.append(entry)

    def add(self, kind: str, message: str, nbytes: int = 0, stacks: list[str] | None = None,
            pins: list[dict] | None = None, sites: list[str] | None = None) -> None:
        self.problems.append(Problem(kind, message, nbytes, list(stacks or []), list(pins or []),
                                     [s for s in sites or [] if s]))
        self.settle_verdict()

    def settle_verdict(self) -> None:
        """The verdict from the problems (stale > error > leaked > reused > held > fresh), and whether the
        cycle fails (``strict`` fails reuse, pool_ids mismatches and sanitizer findings too)."""
        kinds = {p.kind for p in self.problems}
        if "stale" in kinds:
            self.verdict = "stale"
        elif "error" in kinds:
            self.verdict = "error"
        elif kinds & {"leaked", "graphs_not_reset"}:
            self.verdict = "leaked"
        elif "reused" in kinds:
            self.verdict = "reused"
        elif self.held_bytes:
            self.verdict = "held"
        else:
            self.verdict = "fresh"
        self.failed = bool(kinds & failing_kinds(self.strict))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = [p.as_dict() for p in self.problems]
        return d


def amend(record: dict[str, Any], leaked_bytes: int, message: str) -> dict[str, Any]:
    """Apply what a later check found about an earlier cycle (as a dict, the form records travel in): its
    pools kept ``leaked_bytes`` once the caller's output was dropped."""
    rec = CycleRecord(**{k: v for k, v in record.items() if k not in ("problems",)},
                      problems=[Problem(**p) for p in record.get("problems", [])])
    if leaked_bytes:
        rec.leaked_bytes += leaked_bytes
        rec.held_bytes = max(0, rec.held_bytes - leaked_bytes)
        rec.add("leaked", message, leaked_bytes)
    return rec.as_dict()
