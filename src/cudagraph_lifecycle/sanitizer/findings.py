"""Findings about graph pools, read from the ledger: graphs never reset, released pools whose bytes a live
tensor pins, pools that hold references with no live graph. Each names the engine whose capture made it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends import Backend, PoolId
from ..ledger import ledger

FINDING_KINDS = ("unreleased_graph", "pinned_pool", "pool_never_retired", "expandable_teardown")


@dataclass(frozen=True)
class Finding:
    kind: str  # one of FINDING_KINDS
    pool_id: PoolId
    device: int
    bytes: int
    message: str
    stacks: tuple[str, ...] = ()
    engine: str | None = None  # the engine scope whose capture made the pool

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "pool_id": list(self.pool_id), "device": self.device, "bytes": self.bytes,
                "message": self.message, "stacks": list(self.stacks), "engine": self.engine}


def collect(backend: Backend, since: int = 0, scope: str | None = None) -> list[Finding]:
    """Findings about the pools of ``backend``'s world captured into after ledger sequence ``since`` (and,
    with ``scope``, by that engine scope)."""
    world = backend.world
    out: list[Finding] = []
    for h in list(ledger.hazards):
        if h.key[0] == world and h.seq > since and (scope is None or h.scope == scope):
            out.append(Finding(
                "expandable_teardown", h.key[2], h.key[1], h.live_bytes,
                f"the last graph of pool {h.key[2]} was reset while {h.live_bytes} bytes of it were alive, under "
                "expandable_segments:True: peers report that freeing them then crashes the process",
                h.stacks or (h.reset_at,), h.owner))
    for g in ledger.live_graphs(world):
        if g.seq > since and (scope is None or g.scope == scope):
            out.append(Finding(
                "unreleased_graph", g.pool_id, g.device, 0,
                f"a graph captured into pool {g.pool_id} was never reset", (str(g.captured_at),), g.scope))
    for e in ledger.snapshot(world):
        if e.last_seq <= since or (scope is not None and scope not in e.scopes):
            continue
        st = backend.pool_state(e.pool_id, e.device)
        if e.device_count <= 0 and st.allocated_bytes:  # free segments alone go at empty_cache
            stacks = tuple(b.stack for b in backend.live_blocks(e.pool_id, e.device) if b.stack)
            out.append(Finding(
                "pinned_pool", e.pool_id, e.device, st.reserved_bytes,
                f"pool {e.pool_id} was released but {st.reserved_bytes} bytes stay reserved: a tensor allocated "
                "in its captures is still alive (an output kept, or a clone with autograd history)",
                stacks, e.owner))
        elif e.device_count > 0 and not e.live_graphs() and e.captures:
            out.append(Finding(
                "pool_never_retired", e.pool_id, e.device, st.reserved_bytes,
                f"pool {e.pool_id} has no live graph but {e.device_count} reference(s): a MemPool still alive, "
                "or a failed capture that kept its reference", (str(e.minted_at or ""),), e.owner))
    return out
