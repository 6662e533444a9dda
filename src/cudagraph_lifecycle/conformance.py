"""The conformance table: scenarios of the caching allocator's private-pool rules, one expected outcome each.

Every scenario runs the same code on any backend and returns an outcome string; ``sim`` must give the
same string as ``cuda`` on every scenario. On ``cuda`` each scenario runs in a fresh process (the
allocator's assert poisons the process); on ``sim`` each gets a fresh :class:`SimBackend`.

    python -m cudagraph_lifecycle.conformance --backend sim|cuda [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backends import Backend, get_backend, isolated_backend
from .backends.base import MiB
from .errors import TORCH_RANDOM_POISONED, BackendUnavailableError

N = 64 * 64  # a 16 KiB float32 tensor: one small block


def classify(e: BaseException) -> str:
    """Map an allocator or capture error to a short name that both backends share."""
    msg = str(e)
    if "cudaMalloc_count > 0" in msg:
        return "pool-count-assert"
    if "use_count > 0" in msg:
        return "assert"
    if TORCH_RANDOM_POISONED in msg:
        return "poisoned"
    if "not permitted when stream is capturing" in msg:
        return "capture-sync"
    if "previous error during capture" in msg or "invalidated" in msg:
        return "capture-invalidated"
    if "non-default stream" in msg:
        return "default-stream"
    if "captures_underway" in msg:
        return "captures-underway"
    if "pool() without a preceding successful capture" in msg:
        return "pool-without-capture"
    if "without a preceding successful capture" in msg:
        return "replay-without-capture"
    return f"error:{type(e).__name__}"


def attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
    except RuntimeError as e:
        return classify(e)
    return "ok"


def mib(nbytes: int) -> str:
    return f"{nbytes / MiB:g}MiB"


class Ctx:
    """Helpers shared by every scenario: capture a small elementwise step into a pool, read pool books."""

    def __init__(self, be: Backend):
        self.be = be
        self.stream = be.new_stream(0)

    def tensor(self, numel: int = N) -> torch.Tensor:
        return self.be.randn(numel)

    def capture(self, graph, pool, fn):
        """Raw capture (no synchronize, no empty_cache): what an engine does between its own captures."""
        with self.be.stream(self.stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn()
            finally:
                graph.capture_end()
        return out

    def step(self, graph, pool, x=None, numel: int = N):
        x = self.tensor(numel) if x is None else x
        return self.capture(graph, pool, lambda: x * 2 + 1)

    def reserved(self, pool) -> int:
        return self.be.pool_state(pool).reserved_bytes

    def exists(self, pool) -> bool:
        return self.be.pool_state(pool).reserved_bytes > 0


# scenarios ---------------------------------------------------------------------------------------------


def s_fresh_handle_capture_replay(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g = c.be.new_graph()
    x = c.tensor()
    y = c.step(g, h, x)
    x.copy_(c.tensor())
    g.replay()
    c.be.synchronize()
    return "equal" if torch.allclose(y, x * 2 + 1) else "differ"


def _stale(c: Ctx, keep_output: bool, empty_cache: bool, host_empty_cache: bool = False) -> str:
    h = c.be.graph_pool_handle()
    g1 = c.be.new_graph()
    y = c.step(g1, h)
    g1.reset()
    if not keep_output:
        del y, g1
    if empty_cache:
        c.be.empty_cache()
    if host_empty_cache:
        c.be.host_empty_cache()
    return attempt(lambda: c.step(c.be.new_graph(), h))


def s_stale_handle_output_alive(c: Ctx) -> str:
    return _stale(c, keep_output=True, empty_cache=False)


def s_stale_handle_output_alive_empty_cache(c: Ctx) -> str:
    return _stale(c, keep_output=True, empty_cache=True)


def s_stale_handle_output_deleted_no_empty_cache(c: Ctx) -> str:
    return _stale(c, keep_output=False, empty_cache=False)


def s_stale_handle_output_deleted_empty_cache(c: Ctx) -> str:
    # the device pool is erased, but the host allocator's ledger still has the id at use_count 0
    return _stale(c, keep_output=False, empty_cache=True)


def s_stale_handle_output_deleted_both_caches(c: Ctx) -> str:
    return _stale(c, keep_output=False, empty_cache=True, host_empty_cache=True)


def s_stale_handle_output_alive_both_caches(c: Ctx) -> str:
    return _stale(c, keep_output=True, empty_cache=True, host_empty_cache=True)


def s_stale_handle_host_cache_only(c: Ctx) -> str:
    return _stale(c, keep_output=False, empty_cache=False, host_empty_cache=True)


def s_recreated_pool_keeps_id(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g1 = c.be.new_graph()
    y = c.step(g1, h)
    del y
    g1.reset()
    c.be.empty_cache()
    c.be.host_empty_cache()
    gone = c.be.pool_state(h).reserved_bytes == 0
    g2 = c.be.new_graph()
    y2 = c.step(g2, h)  # noqa: F841 - keeps the block, so the segment shows
    return f"gone={gone} back={h in c.be.pool_ids()} same_id={tuple(g2.pool()) == tuple(h)}"


def _poison(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g1 = c.be.new_graph()
    y = c.step(g1, h)  # noqa: F841
    g1.reset()
    return attempt(lambda: c.step(c.be.new_graph(), h))


def s_poisoned_randn(c: Ctx) -> str:
    first = _poison(c)
    return f"{first} then {attempt(lambda: c.be.randn(4))}"


def s_poisoned_plain_alloc(c: Ctx) -> str:
    first = _poison(c)
    return f"{first} then {attempt(lambda: c.be.empty(4))}"


def s_poisoned_capture_with_random(c: Ctx) -> str:
    first = _poison(c)
    x = c.be.empty(N)
    fn = lambda: torch.randn_like(x)  # noqa: E731
    return f"{first} then {attempt(lambda: c.capture(c.be.new_graph(), c.be.graph_pool_handle(), fn))}"


def s_pool_id_before_capture_end(c: Ctx) -> str:
    g = c.be.new_graph()
    x = c.tensor()
    with c.be.stream(c.stream):
        g.capture_begin(pool=c.be.graph_pool_handle())
        y = x * 2  # noqa: F841
        result = attempt(g.pool)
        g.capture_end()
    return result


def s_poisoned_new_handle_capture(c: Ctx) -> str:
    first = _poison(c)
    x = c.be.empty(N)  # allocate before: the capture itself is what is tested
    return f"{first} then {attempt(lambda: c.step(c.be.new_graph(), c.be.graph_pool_handle(), x))}"


def s_handles_count_up(c: Ctx) -> str:
    a, b, d = (c.be.graph_pool_handle() for _ in range(3))
    return "up" if a[0] == b[0] == d[0] == 0 and a[1] < b[1] < d[1] else f"not-up {a} {b} {d}"


def s_handle_without_capture_creates_nothing(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    return f"segments={c.be.pool_state(h).segments}"


def s_capture_without_pool_mints_graph_id(c: Ctx) -> str:
    g = c.be.new_graph()
    y = c.step(g, None)  # noqa: F841
    p = tuple(g.pool())
    return "graph-id" if p[0] > 0 and p[1] == 0 else f"other {p}"


def s_share_pool_via_graph_pool(c: Ctx) -> str:
    g1 = c.be.new_graph()
    y1 = c.step(g1, None)  # noqa: F841
    g2 = c.be.new_graph()
    return attempt(lambda: c.step(g2, g1.pool()))


def s_share_graph_pool_after_reset_output_alive(c: Ctx) -> str:
    g1 = c.be.new_graph()
    y1 = c.step(g1, None)  # noqa: F841
    p = g1.pool()
    g1.reset()
    return attempt(lambda: c.step(c.be.new_graph(), p))


def s_graph_destruction_releases_like_reset(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g1 = c.be.new_graph()
    y = c.step(g1, h)  # noqa: F841
    del g1
    return attempt(lambda: c.step(c.be.new_graph(), h))


def s_mempool_use_count_cycle(c: Ctx) -> str:
    mp = c.be.mempool(0)
    counts = [mp.use_count()]
    g = c.be.new_graph()
    y = c.step(g, mp.id)  # noqa: F841
    counts.append(mp.use_count())
    g.reset()
    counts.append(mp.use_count())
    return ",".join(map(str, counts))


def s_mempool_two_graphs_use_count(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g1, g2 = c.be.new_graph(), c.be.new_graph()
    y1 = c.step(g1, mp.id)  # noqa: F841
    y2 = c.step(g2, mp.id)  # noqa: F841
    return str(mp.use_count())


def s_mempool_recapture_output_alive(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g1 = c.be.new_graph()
    y = c.step(g1, mp.id)  # noqa: F841
    g1.reset()
    return attempt(lambda: c.step(c.be.new_graph(), mp.id))


def s_mempool_recapture_after_host_empty_cache(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g1 = c.be.new_graph()
    y = c.step(g1, mp.id)  # noqa: F841
    g1.reset()
    c.be.host_empty_cache()
    return attempt(lambda: c.step(c.be.new_graph(), mp.id))


def s_torch_graph_context_recaptures_stale_handle(c: Ctx) -> str:
    # torch.cuda.graph's __enter__ runs synchronize, empty_cache and the host empty_cache
    h = c.be.graph_pool_handle()
    g1 = c.be.new_graph()
    y = c.step(g1, h)
    g1.reset()
    del y, g1
    x = c.tensor()
    g2 = c.be.new_graph()

    def go():
        with c.be.graph(g2, pool=h, stream=c.stream):
            x * 2

    return attempt(go)


def s_mempool_del_frees_all(c: Ctx) -> str:
    mp = c.be.mempool(0)
    pid = mp.id
    g = c.be.new_graph()
    y = c.step(g, pid)
    before = c.reserved(pid)
    g.reset()
    del y, mp
    c.be.empty_cache()
    return f"{mib(before)}->{mib(c.reserved(pid))}"


def s_mempool_del_output_alive_pins(c: Ctx) -> str:
    mp = c.be.mempool(0)
    pid = mp.id
    g = c.be.new_graph()
    y = c.step(g, pid)
    g.reset()
    del mp
    c.be.empty_cache()
    kept = c.reserved(pid)
    del y
    c.be.empty_cache()
    return f"{mib(kept)}->{mib(c.reserved(pid))}"


def s_segment_visible_then_gone(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g = c.be.new_graph()
    y = c.step(g, h)
    seen = h in c.be.pool_ids()
    g.reset()
    del y
    c.be.empty_cache()
    return f"seen={seen} after={h in c.be.pool_ids()}"


def _reserved_for(c: Ctx, numel: int) -> str:
    h = c.be.graph_pool_handle()
    g = c.be.new_graph()
    y = c.step(g, h, c.be.empty(numel).fill_(1.0), numel)  # noqa: F841
    st = c.be.pool_state(h)
    return f"{mib(st.reserved_bytes)} in {st.segments}"


def s_reserved_small_block(c: Ctx) -> str:
    return _reserved_for(c, N)  # 16 KiB -> a 2 MiB small segment


def s_reserved_one_mib_block(c: Ctx) -> str:
    return _reserved_for(c, MiB // 4)  # exactly 1 MiB: still small


def s_reserved_medium_block(c: Ctx) -> str:
    return _reserved_for(c, MiB)  # two 4 MiB blocks -> one 20 MiB large segment


def s_reserved_large_block(c: Ctx) -> str:
    return _reserved_for(c, 3 * MiB)  # 12 MiB blocks (x*2, then +1 while x*2 lives): 2 segments of 12 MiB


def s_reserved_odd_large_block(c: Ctx) -> str:
    return _reserved_for(c, 3 * MiB + 1000)  # just over 12 MiB -> segments rounded up to 14 MiB


def s_intermediates_reused_in_capture(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    x = c.be.randn(64 * 1024)  # 256 KiB

    def chain():
        y = x
        for _ in range(20):
            y = y * 1.01 + 0.5  # each step frees the previous intermediate
        return y

    g = c.be.new_graph()
    y = c.capture(g, h, chain)  # noqa: F841
    return mib(c.reserved(h))


def s_small_outputs_share_one_segment(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    graphs, outs = [], []
    for _ in range(8):
        g = c.be.new_graph()
        outs.append(c.step(g, h))
        graphs.append(g)
    return f"{mib(c.reserved(h))} in {c.be.pool_state(h).segments}"


def s_one_live_output_pins_shared_pool(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    graphs, outs = [], []
    for _ in range(8):
        g = c.be.new_graph()
        outs.append(c.step(g, h, numel=MiB // 2))  # 2 MiB blocks: large segments
        graphs.append(g)
    for g in graphs:
        g.reset()
    keep = outs[3]
    del outs, graphs
    c.be.empty_cache()
    pinned = c.reserved(h)
    del keep
    c.be.empty_cache()
    return f"{mib(pinned)}->{mib(c.reserved(h))}"


def s_empty_cache_keeps_live_pool(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g = c.be.new_graph()
    y = c.step(g, h)
    del y  # the block is free, but the graph still uses the pool
    c.be.empty_cache()
    return mib(c.reserved(h))


def s_output_freed_before_reset(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g = c.be.new_graph()
    y = c.step(g, h)
    del y
    g.reset()
    c.be.empty_cache()
    return mib(c.reserved(h))


def s_reset_twice_is_noop(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g = c.be.new_graph()
    y = c.step(g, mp.id)  # noqa: F841
    g.reset()
    g.reset()
    return str(mp.use_count())


def s_replay_after_reset(c: Ctx) -> str:
    g = c.be.new_graph()
    y = c.step(g, c.be.graph_pool_handle())  # noqa: F841
    g.reset()
    return attempt(g.replay)


def _capture_on_current_stream(c: Ctx) -> str:
    g = c.be.new_graph()
    x = c.tensor()

    def go():
        g.capture_begin(pool=c.be.graph_pool_handle())
        try:
            x * 2
        finally:
            g.capture_end()

    return attempt(go)


def s_capture_on_default_stream(c: Ctx) -> str:
    return _capture_on_current_stream(c)


def s_default_stream_capture_poisons_random(c: Ctx) -> str:
    """A capture refused for the default stream leaves the RNG's capture open: eager random ops fail after."""
    return f"{_capture_on_current_stream(c)}, then random: {attempt(c.tensor)}"


def s_current_stream_is_per_thread(c: Ctx) -> str:
    """A side stream made current in one thread is not current in another: there a capture is on the
    default stream (last: that refusal poisons random ops)."""
    other: list[str] = []

    def in_other_thread() -> None:
        try:
            other.append(_capture_on_current_stream(c))
        except BaseException as e:  # whatever it is, it is the outcome
            other.append(f"error:{type(e).__name__}")

    with c.be.stream(c.stream):
        here = _capture_on_current_stream(c)
        t = threading.Thread(target=in_other_thread)
        t.start()
        t.join()
    return f"this thread: {here}, other thread: {other[0]}"


def s_shared_pool_largest_first_smaller(c: Ctx) -> str:
    sizes = [1, 2, 4, 8, 16, 32]

    def total(order) -> int:
        h = c.be.graph_pool_handle()
        keep = []
        for s in order:
            x = c.be.randn(s * 32 * 1024)  # s * 128 KiB

            def fwd(x=x):
                a = x * 2
                b = a + 1
                return (b * 3).sum(0, keepdim=True)

            g = c.be.new_graph()
            keep.append((g, c.capture(g, h, fwd)))
        return c.reserved(h)

    largest, smallest = total(sorted(sizes, reverse=True)), total(sorted(sizes))
    return f"largest-first<=smallest-first: {largest <= smallest}"


def s_separate_pools_not_smaller(c: Ctx) -> str:
    shared = c.be.graph_pool_handle()
    keep = []
    for _ in range(4):
        g = c.be.new_graph()
        keep.append((g, c.step(g, shared)))
    sep = []
    for _ in range(4):
        g, h = c.be.new_graph(), c.be.graph_pool_handle()
        keep.append((g, c.step(g, h)))
        sep.append(h)
    return f"shared={mib(c.reserved(shared))} separate={mib(sum(c.reserved(h) for h in sep))}"


def s_host_sync_in_capture(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g = c.be.new_graph()
    x = c.tensor()
    first = attempt(lambda: c.capture(g, mp.id, lambda: (x * 2).sum().item()))
    g.reset()
    after = attempt(lambda: c.be.randn(4))
    return f"{first} then {after}, use_count={mp.use_count()}"


def s_failed_capture_destructor_gives_back(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g = c.be.new_graph()
    x = c.tensor()
    attempt(functools.partial(c.capture, g, mp.id, lambda: (x * 2).sum().item()))
    g.reset()
    after_reset = mp.use_count()
    del g
    return f"after reset {after_reset}, after del {mp.use_count()}"


def s_failed_capture_leaves_routing_on(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    g = c.be.new_graph()
    x = c.tensor()
    attempt(functools.partial(c.capture, g, h, lambda: (x * 2).sum().item()))
    g.reset()
    first = attempt(c.be.empty_cache)
    before = c.reserved(h)
    with c.be.stream(c.stream):  # is an eager allocation on the failed capture's stream routed to the pool?
        t = c.be.empty(4 * MiB // 4)
    routed = c.reserved(h) > before
    del t
    on = c.be.end_capture_routing(h, 0)
    again = c.be.end_capture_routing(h, 0)
    return (f"empty_cache: {first}, stream alloc routed: {routed}, routing was on: {on}, "
            f"after ending: {again}, then empty_cache: {attempt(c.be.empty_cache)}")


def s_autograd_clone_pins_pool(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    w = c.be.randn(N).requires_grad_()
    x = c.tensor()
    g = c.be.new_graph()
    with torch.enable_grad():
        y = c.capture(g, h, lambda: (x * w).relu())
    kept = y.clone()  # carries autograd history back into the capture
    g.reset()
    del y
    c.be.empty_cache()
    pinned = c.reserved(h)
    del kept
    c.be.empty_cache()
    return f"{mib(pinned)}->{mib(c.reserved(h))}"


def s_no_grad_clone_does_not_pin(c: Ctx) -> str:
    h = c.be.graph_pool_handle()
    w = c.be.randn(N).requires_grad_()
    x = c.tensor()
    g = c.be.new_graph()
    with torch.no_grad():
        y = c.capture(g, h, lambda: (x * w).relu())
    kept = y.clone()  # noqa: F841
    g.reset()
    del y
    c.be.empty_cache()
    return mib(c.reserved(h))


def s_runner_release_clean(c: Ctx) -> str:
    from .runner import CUDAGraphRunner

    r = CUDAGraphRunner(lambda x: (x * 2 + 1).relu(), [1, 2, 4, 8], (256,), backend=c.be)
    x = c.be.randn(3, 256)
    ok = torch.allclose(r.run(x), (x * 2 + 1).relu())
    rep = r.release()
    return f"equal={ok} clean={rep.clean}"


def s_runner_kept_output_pins(c: Ctx) -> str:
    from .runner import CUDAGraphRunner

    r = CUDAGraphRunner(lambda x: (x * 2 + 1).relu(), [1, 2, 4, 8], (256,), backend=c.be)
    y = r.run(c.be.randn(3, 256))
    rep = r.release()
    del y
    c.be.empty_cache()
    (pid,) = [p for _, p in r.pool_ids]
    return f"pinned={mib(rep.pinned_bytes)} after-drop={mib(c.reserved(pid))}"


def s_lazy_pool_fresh_after_retire(c: Ctx) -> str:
    from .pool import LazyPool

    lp = LazyPool(c.be)
    p1 = lp.acquire(0)
    g1 = c.be.new_graph()
    y = c.step(g1, p1)  # noqa: F841 - the old engine's output stays alive
    g1.reset()
    lp.retire()
    p2 = lp.acquire(0)
    return f"new_id={p1 != p2} capture={attempt(lambda: c.step(c.be.new_graph(), p2))}"


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


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Ctx], str]
    expected: str
    env: dict[str, str] | None = None  # run in a fresh process with these set, on every backend


SCENARIOS: list[Scenario] = [
    Scenario("fresh_handle_capture_replay", s_fresh_handle_capture_replay, "equal"),
    Scenario("stale_handle_output_alive", s_stale_handle_output_alive, "assert"),
    Scenario("stale_handle_output_alive_empty_cache", s_stale_handle_output_alive_empty_cache, "assert"),
    Scenario("stale_handle_output_deleted_no_empty_cache", s_stale_handle_output_deleted_no_empty_cache, "assert"),
    Scenario("stale_handle_output_deleted_empty_cache", s_stale_handle_output_deleted_empty_cache, "assert"),
    Scenario("stale_handle_output_deleted_both_caches", s_stale_handle_output_deleted_both_caches, "ok"),
    Scenario("stale_handle_output_alive_both_caches", s_stale_handle_output_alive_both_caches, "assert"),
    Scenario("stale_handle_host_cache_only", s_stale_handle_host_cache_only, "assert"),
    Scenario("torch_graph_context_recaptures_stale_handle", s_torch_graph_context_recaptures_stale_handle, "ok"),
    Scenario("recreated_pool_keeps_id", s_recreated_pool_keeps_id, "gone=True back=True same_id=True"),
    Scenario("poisoned_randn", s_poisoned_randn, "assert then poisoned"),
    Scenario("poisoned_plain_alloc", s_poisoned_plain_alloc, "assert then ok"),
    Scenario("poisoned_new_handle_capture", s_poisoned_new_handle_capture, "assert then ok"),
    Scenario("poisoned_capture_with_random", s_poisoned_capture_with_random, "assert then ok"),
    Scenario("pool_id_before_capture_end", s_pool_id_before_capture_end, "pool-without-capture"),
    Scenario("handles_count_up", s_handles_count_up, "up"),
    Scenario("handle_without_capture_creates_nothing", s_handle_without_capture_creates_nothing, "segments=0"),
    Scenario("capture_without_pool_mints_graph_id", s_capture_without_pool_mints_graph_id, "graph-id"),
    Scenario("share_pool_via_graph_pool", s_share_pool_via_graph_pool, "ok"),
    Scenario("share_graph_pool_after_reset_output_alive", s_share_graph_pool_after_reset_output_alive, "assert"),
    Scenario("graph_destruction_releases_like_reset", s_graph_destruction_releases_like_reset, "assert"),
    Scenario("mempool_use_count_cycle", s_mempool_use_count_cycle, "1,2,1"),
    Scenario("mempool_two_graphs_use_count", s_mempool_two_graphs_use_count, "3"),
    Scenario("mempool_recapture_output_alive", s_mempool_recapture_output_alive, "assert"),
    Scenario("mempool_recapture_after_host_empty_cache", s_mempool_recapture_after_host_empty_cache, "ok"),
    Scenario("mempool_del_frees_all", s_mempool_del_frees_all, "2MiB->0MiB"),
    Scenario("mempool_del_output_alive_pins", s_mempool_del_output_alive_pins, "2MiB->0MiB"),
    Scenario("segment_visible_then_gone", s_segment_visible_then_gone, "seen=True after=False"),
    Scenario("reserved_small_block", s_reserved_small_block, "2MiB in 1"),
    Scenario("reserved_one_mib_block", s_reserved_one_mib_block, "2MiB in 1"),
    Scenario("reserved_medium_block", s_reserved_medium_block, "20MiB in 1"),
    Scenario("reserved_large_block", s_reserved_large_block, "24MiB in 2"),
    Scenario("reserved_odd_large_block", s_reserved_odd_large_block, "28MiB in 2"),
    Scenario("intermediates_reused_in_capture", s_intermediates_reused_in_capture, "2MiB"),
    Scenario("small_outputs_share_one_segment", s_small_outputs_share_one_segment, "2MiB in 1"),
    Scenario("one_live_output_pins_shared_pool", s_one_live_output_pins_shared_pool, "20MiB->0MiB"),
    Scenario("empty_cache_keeps_live_pool", s_empty_cache_keeps_live_pool, "2MiB"),
    Scenario("output_freed_before_reset", s_output_freed_before_reset, "0MiB"),
    Scenario("reset_twice_is_noop", s_reset_twice_is_noop, "1"),
    Scenario("replay_after_reset", s_replay_after_reset, "replay-without-capture"),
    Scenario("capture_on_default_stream", s_capture_on_default_stream, "default-stream"),
    Scenario("default_stream_capture_poisons_random", s_default_stream_capture_poisons_random,
             "default-stream, then random: poisoned"),
    Scenario("current_stream_is_per_thread", s_current_stream_is_per_thread,
             "this thread: ok, other thread: default-stream"),
    Scenario("shared_pool_largest_first_smaller", s_shared_pool_largest_first_smaller, "largest-first<=smallest-first: True"),
    Scenario("separate_pools_not_smaller", s_separate_pools_not_smaller, "shared=2MiB separate=8MiB"),
    Scenario("host_sync_in_capture", s_host_sync_in_capture, "capture-invalidated then poisoned, use_count=2"),
    Scenario("failed_capture_destructor_gives_back", s_failed_capture_destructor_gives_back,
             "after reset 2, after del 2"),
    Scenario("failed_capture_leaves_routing_on", s_failed_capture_leaves_routing_on,
             "empty_cache: ok, stream alloc routed: False, routing was on: True, after ending: False, "
             "then empty_cache: ok"),
    Scenario("autograd_clone_pins_pool", s_autograd_clone_pins_pool, "2MiB->0MiB"),
    Scenario("no_grad_clone_does_not_pin", s_no_grad_clone_does_not_pin, "0MiB"),
    Scenario("runner_release_clean", s_runner_release_clean, "equal=True clean=True"),
    Scenario("runner_kept_output_pins", s_runner_kept_output_pins, "pinned=2MiB after-drop=0MiB"),
    Scenario("lazy_pool_fresh_after_retire", s_lazy_pool_fresh_after_retire, "new_id=True capture=ok"),
    Scenario("expandable_kept_blocks_freed_after_flush", s_expandable_kept_blocks_freed_after_flush,
             "crashed: SIGSEGV", EXPANDABLE),
    Scenario("expandable_kept_blocks_freed_before_flush", s_expandable_kept_blocks_freed_before_flush,
             "empty_cache: ok, then: ok", EXPANDABLE),
    Scenario("expandable_flush_unmaps_more_runs_than_expansions", s_expandable_flush_unmaps_more_runs_than_expansions,
             "empty_cache: pool-count-assert", EXPANDABLE),
    Scenario("expandable_no_temporary_survives", s_expandable_no_temporary_survives,
             "first: ok, after the blocks went: ok", EXPANDABLE),
    Scenario("expandable_second_flush_asserts", s_expandable_second_flush_asserts,
             "first: ok, after the blocks went: pool-count-assert", EXPANDABLE),
    Scenario("expandable_zombie_pool_asserts_on_recapture", s_expandable_zombie_pool_asserts_on_recapture,
             "reserved=0MiB recapture=assert", EXPANDABLE),
    Scenario("expandable_erased_pool_recaptures", s_expandable_erased_pool_recaptures,
             "reserved=0MiB recapture=ok", EXPANDABLE),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def run_scenario(name: str, backend: str | Backend = "sim") -> str:
    """Run one scenario on a fresh allocator world (a new SimBackend, or this process's CUDA)."""
    sc = BY_NAME[name]
    be = backend if isinstance(backend, Backend) else isolated_backend(backend)
    try:
        return sc.fn(Ctx(be))
    except Exception as e:  # an unexpected error is an outcome too: it must match on both backends
        return f"raised {classify(e)}: {str(e).splitlines()[0][:120]}"


def run_isolated(name: str, backend: str, timeout: float = 120.0) -> str:
    """Run one scenario in a fresh Python process (needed on CUDA: the assert poisons the process; and for a
    scenario with its own environment, on every backend). A process killed by a signal is ``crashed: NAME``."""
    code = (
        "import sys; from cudagraph_lifecycle.conformance import run_scenario; "
        f"sys.stdout.write('@@' + run_scenario({name!r}, {backend!r})); sys.stdout.flush()"
    )
    env = {**os.environ, **(BY_NAME[name].env or {})}
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout:g}s"
    if "@@" in p.stdout:
        return p.stdout.split("@@", 1)[1].strip()
    if p.returncode < 0:
        try:
            return f"crashed: {signal.Signals(-p.returncode).name}"
        except ValueError:
            return f"crashed: signal {-p.returncode}"
    tail = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    return f"crashed rc={p.returncode}: {tail[:160]}"


def run_one(name: str, backend: str) -> str:
    """A scenario as the table runs it: in a fresh process where it sets its own environment (a crash must
    not take this process with it), else in this process on an isolated world."""
    if BY_NAME[name].env:
        return run_isolated(name, backend)
    return run_scenario(name, backend)


def run_table(backend: str = "sim", isolate: bool | None = None, jobs: int = 4) -> list[dict]:
    isolate = (not get_backend(backend).isolates_in_process) if isolate is None else isolate
    rows = []
    if isolate:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(jobs) as ex:
            outcomes = list(ex.map(lambda s: run_isolated(s.name, backend), SCENARIOS))
    else:
        outcomes = [run_one(s.name, backend) for s in SCENARIOS]
    for sc, got in zip(SCENARIOS, outcomes):
        rows.append({"scenario": sc.name, "expected": sc.expected, "outcome": got, "match": got == sc.expected})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="sim", choices=["sim", "cuda", "auto"])
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--jobs", type=int, default=4)
    a = ap.parse_args(argv)
    try:
        backend = get_backend(a.backend).name
    except BackendUnavailableError as e:
        print(f"conformance: --backend {a.backend}: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = run_table(backend, jobs=a.jobs)
    width = max(len(r["scenario"]) for r in rows)
    for r in rows:
        print(f"{'ok ' if r['match'] else 'BAD'} {r['scenario']:<{width}}  {r['outcome']}"
              + ("" if r["match"] else f"   (expected {r['expected']})"))
    bad = sum(not r["match"] for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} scenarios match on {backend} in {time.time() - t0:.1f}s")
    if a.json:
        meta = {"backend": backend, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "host": os.uname().nodename} | get_backend(backend).describe()
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
