"""Fresh-pool and released-pool checks, usable in any test (no fixture needed)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cudagraph_lifecycle.backends import Backend


class EngineCycleError(AssertionError):
    """An engine cycle in a reused worker failed: not fresh, crashed, or the allocator asserted."""


def assert_pool_released(backend: Backend, pool_id, device: int = 0) -> None:
    """The pool has no graph left (use count 0 or unreadable) and holds no segment.

    Run ``empty_cache`` first if you want freeable segments gone; drop or copy out any output view you
    still hold, or it pins its segment.
    """
    st = backend.pool_state(pool_id, device)
    problems = []
    if st.use_count:
        problems.append(f"use_count is {st.use_count}: a graph captured into it was never reset")
    if st.reserved_bytes:
        problems.append(
            f"it still holds {st.reserved_bytes} bytes in {st.segments} segment(s): a tensor allocated in the "
            "capture is alive (an output you hold, or a clone with autograd history)"
        )
    if problems:
        raise AssertionError(f"pool {tuple(pool_id)} on device {device} is not released: " + "; ".join(problems))


def assert_no_graphs(runner: Any) -> None:
    """A runner (or engine with ``.runner``) holds no graph and no output after release."""
    runner = getattr(runner, "runner", runner)
    if runner.keys or runner.outputs_alive():
        raise AssertionError(
            f"runner {runner.name!r} still holds {len(runner.keys)} graph(s) and {runner.outputs_alive()} "
            "output(s): call release()"
        )


def assert_fresh_pool(backend: Backend, pool_id, previous: list | tuple = (), device: int = 0) -> None:
    """``pool_id`` is new to this process and every ``previous`` pool id is released."""
    previous = [tuple(p) for p in previous]
    if tuple(pool_id) in previous:
        raise AssertionError(f"pool {tuple(pool_id)} was already used by an earlier engine: it is not fresh")
    for p in previous:
        assert_pool_released(backend, p, device)


def check_record(rec: dict, also: list[dict] = ()) -> None:
    """Raise :class:`EngineCycleError` if an engine cycle failed: its verdict and every problem, in full, and
    which other engines of the sequence (``also``: their records) failed too."""
    __tracebackhide__ = operator.methodcaller("errisinstance", EngineCycleError)  # the engine's failure: the test's line
    if not rec.get("failed"):
        return
    from cudagraph_lifecycle.record import failing_kinds

    who = f"worker pid {rec.get('pid')}" + (f", rank {rec['rank']}" if rec.get("rank") is not None else "")
    pools = ", ".join(str(tuple(p[1])) for p in rec.get("pool_ids") or []) or "none observed"
    failing = failing_kinds(rec.get("strict", False))
    # the problems that failed the cycle first: the headline names what failed, not only the pools' verdict
    ordered = sorted(rec.get("problems") or [], key=lambda p: p["kind"] not in failing)
    failed_on = list(dict.fromkeys(p["kind"] for p in ordered if p["kind"] in failing)) or ["(no problem recorded)"]
    problems = "\n".join(f"- {p['kind']}: {p['message']}" for p in ordered) or "- (none recorded)"
    others = [r for r in also if r.get("failed") and r is not rec]
    more = ("\nalso failed: " + ", ".join(f"engine {r['index']}"
                                          + (f" (rank {r['rank']})" if r.get("rank") is not None else "")
                                          + f" ({r.get('verdict', '?')})" for r in others)
            + " (the lifecycle table and the report have each one's problems)") if others else ""
    raise EngineCycleError(
        f"engine {rec['index']} failed: {', '.join(failed_on)} (pool verdict {rec.get('verdict', '?')}; {who}; "
        f"pools {pools}):\n{problems}{more}")
