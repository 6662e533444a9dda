"""The output a caller held, judged late: ``check_held`` once the next engine has captured (the caller drops
the output, and what its pools still hold was not the output's), ``final_held`` where that engine ends the
process first (stale or poisoned: the worker goes before the output is dropped)."""

from __future__ import annotations

from ..backends import Backend
from ..ledger import Key, ledger
from ..record import CycleRecord
from ..sanitizer.pins import Pin, describe, mempool_notes, what_pins
from ..sizes import size_text
from .caller import Caller
from .steps import _captured_at, _pool_sites, _stacks, settle


def check_held(be: Backend, caller: Caller, current: set[Key]) -> CycleRecord | None:
    """Drop the output the caller held from the previous engine, and judge that engine's pools now: bytes
    still there are not the output's. Pools the current engine captured into are left out (they are
    judged as reused)."""
    rec = caller.held_record
    if rec is None:
        return None
    pools = [k for k in caller.held_pools if k not in current]
    caller.held = None
    caller.held_record, caller.held_pools = None, []
    settle(be)
    left = sum(be.pool_state(k[2], k[1]).reserved_bytes for k in pools)
    if not left:
        rec.settle_verdict()
        return rec
    # judged leaked at release already (holders beyond the output): counted in blocks then, in the pools' bytes
    # now, and told again only for a holder not named then
    earlier = rec.leaked_bytes
    named = {(p["cause"], p["holder"]) for problem in rec.problems if problem.kind == "leaked" for p in problem.pins}
    rec.held_bytes = max(0, rec.held_bytes + earlier - max(left, earlier))
    rec.leaked_bytes = max(left, earlier)
    pins = what_pins(be, pools)
    if earlier and all((p.cause, p.holder) in named for p in pins):
        rec.settle_verdict()
        return rec
    more = left - min(left, earlier)
    why = "; ".join(([describe(pins)] if pins else []) + list(mempool_notes(pools).values())) or \
        "something else pins them"
    rec.add("leaked", f"once the caller dropped this engine's output, its pools "
                      f"{[k[2] for k in pools]}{_captured_at(pools)} still held {size_text(left)}: " + why,
            more or left, _stacks(be, pools), [p.as_dict() for p in pins], _pool_sites(pools))
    return rec


def final_held(be: Backend, caller: Caller, rec: CycleRecord, since: int) -> CycleRecord | None:
    """The previous engine's ``held``, made final where the cycle ``rec`` ends the process before the caller
    drops that engine's output (``check_held`` would run once the next engine captured). Where ``rec``'s engine
    captured into one of those pools (stale), what pinned it was read as the capture came, in every sanitizer
    mode alike: bytes pinned by anything but the held output make that engine ``leaked``. Otherwise nothing
    more can be learnt in this process: the record says its ``held`` is unconfirmed, and why. Nothing is
    dropped, freed or flushed here (with no sanitizer the allocator has asserted)."""
    prev = caller.held_record
    if prev is None:
        return None
    pools = set(caller.held_pools)
    # judged once; the output itself stays held, as the caller holds it, until this process ends
    caller.held_record, caller.held_pools = None, []
    attempts = [a for a in ledger.stale_since(since, be.world) if a.key in pools]
    if attempts:
        a = attempts[-1]
        others = [Pin(**p) for p in a.pins if Caller.HOLDER_WORDS["held"] not in p["holder"]]
        extra = max(0, sum(p.bytes for p in others) - prev.leaked_bytes)  # leaked at once already: counted
        if extra:
            prev.held_bytes = max(0, prev.held_bytes - extra)
            prev.leaked_bytes += extra
            prev.add("leaked", f"when engine {rec.index} captured into its pool {a.key[2]} (stale), "
                               f"{size_text(extra)} of it were pinned by something other than the output the "
                               f"caller held: {describe(others)}", extra, a.stacks(), [p.as_dict() for p in others],
                     _pool_sites([a.key]))
        return prev
    if prev.verdict == "held":
        why = "its capture went into a dead pool" if rec.verdict == "stale" else "it poisoned the process"
        prev.add("held_unconfirmed", f"engine {rec.index} ended this worker ({why}) before the caller dropped this "
                                     "engine's output, so whether its pools empty once the output goes was never "
                                     "checked: the verdict rests on what pinned them at its release")
    return prev
