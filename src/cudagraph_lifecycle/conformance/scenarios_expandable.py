"""Conformance scenarios under ``expandable_segments:True``: the teardown crash, the pool-count assert, the
zombie pool (rules in backends/sim_expandable.py). Each runs in a fresh process with ``EXPANDABLE`` set."""

from __future__ import annotations

from ..backends.base import MiB
from .context import Ctx, attempt, mib

# Under expandable_segments:True (each scenario in a fresh process with PYTORCH_CUDA_ALLOC_CONF set; the
# rules in backends/sim_expandable.py; the search on the H200 in scripts/probe_expandable.py).
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _carve(c: Ctx, temp: int, n: int, size: int) -> tuple:
    """A capture that frees a ``temp``-byte temporary, then allocates ``n`` blocks of ``size`` bytes; every
    other block is kept, the rest dropped. Returns (pool, graph, kept)."""
    h, g = c.be.graph_pool_handle(), c.be.new_graph()

    def body():
        if temp:
            t = c.be.empty(temp // 4)
            del t
        return [c.be.empty(size // 4) for _ in range(n)]

    xs = c.capture(g, h, body)
    return h, g, xs[0::2]


def s_expandable_kept_blocks_freed_after_flush(c: Ctx) -> str:
    # one expansion mapped the temporary's pages; the flush unmaps as many runs of free pages as there were
    # expansions, erases the pool under its live blocks, and freeing them is a use after free
    _, g, kept = _carve(c, 100 * MiB, 20, 2 * MiB)
    g.reset()
    c.be.empty_cache()
    del kept
    c.be.empty(4)
    c.be.synchronize()
    return "survived"


def s_expandable_kept_blocks_freed_before_flush(c: Ctx) -> str:
    _, g, kept = _carve(c, 100 * MiB, 20, 2 * MiB)
    g.reset()
    del kept  # the safe order: the blocks go before the flush
    first = attempt(c.be.empty_cache)
    c.be.empty(4)
    return f"empty_cache: {first}, then: {attempt(c.be.empty_cache)}"


def s_expandable_flush_unmaps_more_runs_than_expansions(c: Ctx) -> str:
    _, g, kept = _carve(c, 200 * MiB, 10, 20 * MiB)
    g.reset()
    return f"empty_cache: {attempt(c.be.empty_cache)}"


def _second_flush(c: Ctx, temp: int, small: bool) -> str:
    h, g = c.be.graph_pool_handle(), c.be.new_graph()

    def body():
        if temp:
            t = c.be.empty(temp // 4)
            del t
        xs = [c.be.empty(2 * MiB // 4) for _ in range(20)]
        return xs[0::2] + ([c.be.empty(1024)] if small else [])

    kept = c.capture(g, h, body)
    g.reset()
    first = attempt(c.be.empty_cache)
    del kept
    return f"first: {first}, after the blocks went: {attempt(c.be.empty_cache)}"


def s_expandable_no_temporary_survives(c: Ctx) -> str:
    # two expansions for twenty 2 MiB blocks: the kept ones leave no run of free pages, the count stays up
    return _second_flush(c, 0, small=False)


def s_expandable_second_flush_asserts(c: Ctx) -> str:
    # a kept small block keeps the first flush from erasing the pool; once everything is free, the second
    # flush unmaps the small run and then the large one with the count already at 0
    return _second_flush(c, 100 * MiB, small=True)


def _recapture_after_full_release(c: Ctx, n: int, size: int) -> str:
    h, g = c.be.graph_pool_handle(), c.be.new_graph()
    xs = c.capture(g, h, lambda: [c.be.empty(size // 4) for _ in range(n)])
    g.reset()
    del xs
    c.be.synchronize()
    c.be.empty_cache()
    c.be.host_empty_cache()
    return f"reserved={mib(c.reserved(h))} recapture={attempt(lambda: c.step(c.be.new_graph(), h))}"


def s_expandable_zombie_pool_asserts_on_recapture(c: Ctx) -> str:
    # two expansions, one run unmapped: the count stays at 1, so the pool is kept with no segment at all
    return _recapture_after_full_release(c, 20, 2 * MiB)


def s_expandable_erased_pool_recaptures(c: Ctx) -> str:
    return _recapture_after_full_release(c, 1, 10 * MiB)
