"""The judgments that raise before torch acts: a capture into a dead pool, a capture on the default stream,
and (under expandable segments) the reset of a pool's last graph while blocks of it are alive."""

from __future__ import annotations

from ..backends import Backend
from ..errors import (
    EXPANDABLE_TEARDOWN_FIX,
    DefaultStreamCaptureError,
    ExpandableSegmentsHazardError,
    StalePoolError,
    stale_fix,
)
from ..ledger import DefaultStreamCapture, StaleAttempt, TeardownHazard
from ..sizes import size_text

SIDE_STREAM_FIX = ("Capture on a side stream: `s = torch.cuda.Stream()`, then `with torch.cuda.stream(s):` around the "
                   "capture (torch.cuda.graph makes one for you)")


def side_stream_fix(world: object) -> str:
    """The fix in the API of the world's backend: torch.cuda's on CUDA, the backend's on ``sim``."""
    if world == "cuda":
        return SIDE_STREAM_FIX
    return ("Capture on a side stream: `with backend.stream(backend.new_stream()):` around the capture, or the "
            "backend's own `backend.capture_stream(device)` (backend.graph(...) uses it)")


def stale_error(backend: Backend, attempt: StaleAttempt) -> StalePoolError:
    """The error for a capture into a dead pool: why the pool is dead, where it was minted and released,
    and which engine made it."""
    _, device, pool_id = attempt.key
    why, pins, held = [], [], 0
    if attempt.device_dead:
        st = backend.pool_state(pool_id, device)
        held = st.reserved_bytes
        if st.allocated_bytes:
            from .pins import Pin

            pins = [Pin(**p) for p in attempt.pins]  # read at the attempt (explain), as in every mode
        why.append(
            f"the device allocator still holds it ({size_text(st.reserved_bytes)} in {st.segments} segment(s)"
            + (f": {pinned_text(pins)})" if st.allocated_bytes else
               "; no block of it is alive: no cache flush (empty_cache) ran since its last graph was reset)"
               if st.reserved_bytes else "; empty_cache has not run)")
        )
    if attempt.host_dead:
        why.append("the host allocator's ledger still has the id (torch._C._host_emptyCache has not run)")
    made_by = f" It was made by {attempt.owner}." if attempt.owner else ""
    at = (f" at {attempt.site}" if attempt.site else "") + (
        f" (its id minted at {attempt.minted_site})" if attempt.minted_site else "")
    err = StalePoolError(
        f"capture into stale pool {tuple(pool_id)} on device {device}{at}: all its graphs were released, but "
        + " and ".join(why)
        + ". The real capture_begin would fail with 'use_count > 0 INTERNAL ASSERT FAILED' and poison the "
        f"process.{made_by} {stale_fix(attempt.owner, attempt.scope)}.\n" + "".join(attempt.stacks())
    )
    err.pool_id, err.device, err.owner, err.site = tuple(pool_id), device, attempt.owner, attempt.site
    # the same facts as data, for reports: what pins the pool, the bytes it holds, the stacks above
    err.pins, err.held_bytes, err.stacks = [p.as_dict() for p in pins], held, attempt.stacks()
    return err


def explain(backend: Backend, key: tuple) -> tuple[int, tuple]:
    """What a dead pool holds as a capture comes into it: its reserved bytes and, where blocks of it live,
    who pins them (``Pin`` dicts). Asked by the observation layer before the allocator runs the capture, in
    every mode (with no sanitizer the allocator asserts next, and nothing can be read after); changes
    nothing (no library workspace is cleared to find a holder)."""
    from .pins import what_pins

    st = backend.pool_state(key[2], key[1])
    if not st.allocated_bytes:
        return st.reserved_bytes, ()
    try:
        pins = what_pins(backend, [key])
    except Exception:  # naming the holder must never replace the error it explains
        pins = []
    return st.reserved_bytes, tuple(p.as_dict() for p in pins)


def pinned_text(pins: list) -> str:
    """What :func:`explain` found, in words."""
    from .pins import describe

    return describe(pins) if pins else "a live tensor from its captures pins it"


def hazard_error(hazard: TeardownHazard, mode: str = "on") -> ExpandableSegmentsHazardError:
    """The error for resetting a pool's last graph while blocks of it live, under expandable segments."""
    _, device, pool_id = hazard.key
    stacks = "".join(f"--- a live block allocated at ---\n{s}" for s in hazard.stacks) or (
        "(allocation stacks: record history, e.g. PoolSanitizer(record_history=True))\n")
    why = "strict sanitizer" if mode == "strict" else (
        "expandable_teardown=refuse; to only report it: CUDAGRAPH_EXPANDABLE_TEARDOWN=report or "
        "--cudagraph-expandable-teardown=report")
    err = ExpandableSegmentsHazardError(
        f"reset of the last graph of pool {tuple(pool_id)} on device {device} at {hazard.reset_site or '(unknown)'} "
        f"while {size_text(hazard.live_bytes)} allocated in its captures are alive, under expandable_segments:True: "
        "freeing such blocks after the pool's teardown crashed torch 2.11 on the H200 (SIGSEGV, a glibc abort, "
        f"or 'cudaMalloc_count > 0 INTERNAL ASSERT FAILED' in empty_cache). {EXPANDABLE_TEARDOWN_FIX}. "
        f"The graph was NOT reset ({why}).{f' The pool was made by {hazard.owner}.' if hazard.owner else ''}\n"
        f"--- the reset at ---\n{hazard.reset_at}{stacks}")
    err.pool_id, err.device, err.live_bytes, err.reset_site = tuple(pool_id), device, hazard.live_bytes, \
        hazard.reset_site
    return err


def default_stream_error(event: DefaultStreamCapture) -> DefaultStreamCaptureError:
    """The error for a capture about to begin on its device's default stream."""
    err = DefaultStreamCaptureError(
        f"capture_begin on the default stream of device {event.key[1]} at {event.site or '(unknown)'}: torch "
        "refuses it ('CUDA graphs must be captured on a non-default stream.'), but only after opening the CUDA "
        "RNG's capture, which it leaves open, so every later eager random op of this process would fail "
        "('Offset increment outside graph capture'). The capture was NOT begun and the process is fine. "
        f"{side_stream_fix(event.key[0])}.\n--- the capture began at ---\n{event.at}")
    err.device, err.site = event.key[1], event.site
    return err
