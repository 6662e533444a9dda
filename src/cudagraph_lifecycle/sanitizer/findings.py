"""Findings about graph pools, read from the ledger: graphs never reset, released pools whose bytes a live
tensor pins, pools that hold references with no live graph, pools torn down with live blocks under
expandable segments, captures begun on the default stream (refused, or poisoning the process's random ops),
and captures into dead pools (refused, or the allocator's assert), also where the engine caught the error.
Each names where it came from: the user's lines that captured into the pool
(``sites``), the tests that did (``tests``, when the pytest plugin is loaded) and the engine whose capture
made it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends import Backend, PoolId
from ..errors import EXPANDABLE_TEARDOWN_FIX, stale_fix
from ..ledger import Stack, graph_sites, ledger
from ..sizes import size_text
from .stale import side_stream_fix

FINDING_KINDS = ("unreleased_graph", "pinned_pool", "pool_never_retired", "expandable_teardown",
                 "default_stream_capture", "stale_capture")
# captures the sanitizer refused that torch or the allocator would have turned into a poisoned process: an
# engine cycle whose engine caught the error and went on passes only because the sanitizer was there, so they
# fail it in every mode (the rest fail under strict)
PREVENTED_KINDS = ("default_stream_capture", "stale_capture")


@dataclass(frozen=True)
class Finding:
    kind: str  # one of FINDING_KINDS
    pool_id: PoolId | None  # None: a capture refused before it had a pool (``default_stream_capture``)
    device: int
    bytes: int
    message: str
    stacks: tuple[str, ...] = ()
    engine: str | None = None  # the engine scope whose capture made the pool
    # file:line in function of the user's code that captured into the pool (for a capture refused or asserted on,
    # ``stale_capture`` and ``default_stream_capture``: the line that tried)
    sites: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()  # the tests that captured into it
    pins: tuple[dict, ...] = ()  # what keeps its bytes alive, where it can be known (sanitizer.pins)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "pool_id": None if self.pool_id is None else list(self.pool_id),
                "device": self.device, "bytes": self.bytes,
                "message": self.message, "stacks": list(self.stacks), "engine": self.engine,
                "sites": list(self.sites), "tests": list(self.tests), "pins": list(self.pins)}


def collect(backend: Backend, since: int = 0, scope: str | None = None,
            kinds: tuple[str, ...] = FINDING_KINDS) -> list[Finding]:
    """Findings about the pools of ``backend``'s world captured into after ledger sequence ``since`` (and,
    with ``scope``, by that engine scope), of ``kinds``. Read from the ledger alone: no sanitizer need run."""
    from .pins import describe, graph_holder, mempool_notes, what_pins

    world = backend.world
    out: list[Finding] = []
    for h in list(ledger.hazards) if "expandable_teardown" in kinds else ():
        if h.key[0] == world and h.seq > since and (scope is None or h.scope == scope):
            out.append(Finding(
                "expandable_teardown", h.key[2], h.key[1], h.live_bytes,
                f"the last graph of pool {h.key[2]} was reset at {h.reset_site or '(unknown)'} while "
                f"{size_text(h.live_bytes)} of it were alive, under expandable_segments:True: freeing them after the "
                f"pool's teardown can crash the process (SIGSEGV). {EXPANDABLE_TEARDOWN_FIX}",
                h.stacks or (h.reset_at,), h.owner, h.sites, tuple(t for t in (h.test,) if t)))
    for d in list(ledger.default_stream) if "default_stream_capture" in kinds else ():
        if d.key[0] == world and d.seq > since and (scope is None or d.scope == scope):
            what = ("refused before torch ran it" if d.refused else
                    "torch refused it and every later eager random op of this process fails ('Offset increment "
                    "outside graph capture') until a later capture ends (measured on the H200; a new process is the sure "
                    "way back)")
            out.append(Finding(
                "default_stream_capture", d.pool_id, d.key[1], 0,
                f"a capture began on the default stream of device {d.key[1]} at {d.site or '(unknown)'}: {what}. "
                f"{side_stream_fix(world)}", (d.at,), d.scope, (d.site,) if d.site else (),
                tuple(t for t in (d.test,) if t)))
    for a in ledger.stale_since(since, world) if "stale_capture" in kinds else ():
        if scope is None or a.scope == scope:
            what = ("refused before the allocator saw it (StalePoolError)" if a.refused else
                    "the allocator asserted 'use_count > 0' and the process is poisoned: only a new one recovers")
            made = f" (made by {a.owner})" if a.owner else ""
            out.append(Finding(
                "stale_capture", a.key[2], a.key[1], 0,
                f"a capture into pool {a.key[2]}{made} at {a.site or '(unknown)'}, after all its graphs were "
                f"released: {what}. {stale_fix(a.owner, a.scope)}", tuple(a.stacks()), a.owner, (a.site,) if a.site else (), tuple(t for t in (a.test,) if t)))
    unreleased: dict[tuple, list] = {}  # one finding per pool, engine and test, however many graphs
    for g in ledger.live_graphs(world) if "unreleased_graph" in kinds else ():
        if g.seq > since and (scope is None or g.scope == scope):
            unreleased.setdefault((g.pool_id, g.device, g.scope, g.test), []).append(g)
    for (pool_id, device, owner, _), graphs in unreleased.items():
        sites = tuple(graph_sites(graphs))
        tests = tuple(dict.fromkeys(g.test for g in graphs if g.test))
        held_by = graph_holder(graphs)
        n = len(graphs)
        out.append(Finding(
            "unreleased_graph", pool_id, device, 0,
            f"{'a graph' if n == 1 else f'{n} graphs'} captured into pool {pool_id} at "
            f"{', '.join(sites) or '(unknown)'} {'was' if n == 1 else 'were'} never reset"
            + (f": {'it is' if n == 1 else 'one is'} held as {held_by}" if held_by else ""),
            (str(graphs[0].captured_at),), owner, sites, tests))
    read = backend.pool_bytes_reader()
    pools = "pinned_pool" in kinds or "pool_never_retired" in kinds
    for e in ledger.snapshot(world) if pools else ():
        if e.last_seq <= since or (scope is not None and scope not in e.scopes):
            continue
        sites, tests = tuple(e.capture_sites()), tuple(e.tests)
        where = f" (captured at {sites[0]})" if sites else ""
        if e.device_count <= 0 and "pinned_pool" in kinds and read(e.device, e.pool_id):
            st = backend.pool_state(e.pool_id, e.device)
            if not st.allocated_bytes:  # free segments alone go at empty_cache
                continue
            stacks = tuple(b.stack for b in backend.live_blocks(e.pool_id, e.device) if b.stack)
            if not stacks and e.sites:  # no allocation history: the first capture's stack, to the caller's line
                stacks = (f"--- the pool's first capture began at ---\n{Stack(e.sites[0])}",)
            # a finding may be read in the middle of a sequence (a test's close): it names holders and changes
            # nothing
            pins = what_pins(backend, [e.key])
            out.append(Finding(
                "pinned_pool", e.pool_id, e.device, st.reserved_bytes,
                f"pool {e.pool_id}{where} was released but {size_text(st.reserved_bytes)} stay reserved: "
                + (describe(pins) if pins else "a tensor allocated in its captures is still alive"),
                stacks, e.owner, sites, tests, tuple(p.as_dict() for p in pins)))
        elif e.device_count > 0 and "pool_never_retired" in kinds and not e.live_graphs() and e.captures:
            held = list(mempool_notes([e.key]).values())
            out.append(Finding(
                "pool_never_retired", e.pool_id, e.device, read(e.device, e.pool_id),
                f"pool {e.pool_id}{where} has no live graph but {e.device_count} reference(s): "
                + (held[0] if held else "a MemPool still alive, or a failed capture that kept its reference"),
                (f"--- pool minted at ---\n{e.minted_at}",) if e.minted_at else (), e.owner, sites, tests))
    return out
