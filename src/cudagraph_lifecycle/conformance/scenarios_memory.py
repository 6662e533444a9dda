"""Conformance scenarios of pool bytes: size classes and segments, what ``empty_cache`` frees, what pins a
released pool (a kept output, an autograd clone), sharing one pool against separate ones, and the runner's
and ``LazyPool``'s releases."""

from __future__ import annotations

import contextlib

import torch

from ..backends.base import MiB
from .context import Ctx, N, attempt, mib


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
    from ..runner import CUDAGraphRunner

    r = CUDAGraphRunner(lambda x: (x * 2 + 1).relu(), [1, 2, 4, 8], (256,), backend=c.be)
    x = c.be.randn(3, 256)
    ok = torch.allclose(r.run(x), (x * 2 + 1).relu())
    rep = r.release()
    return f"equal={ok} clean={rep.clean}"


def s_runner_kept_output_pins(c: Ctx) -> str:
    from ..runner import CUDAGraphRunner

    r = CUDAGraphRunner(lambda x: (x * 2 + 1).relu(), [1, 2, 4, 8], (256,), backend=c.be)
    y = r.run(c.be.randn(3, 256))
    rep = r.release()
    del y
    c.be.empty_cache()
    (pid,) = [p for _, p in r.pool_ids]
    return f"pinned={mib(rep.pinned_bytes)} after-drop={mib(c.reserved(pid))}"


def s_lazy_pool_fresh_after_retire(c: Ctx) -> str:
    from ..pool import LazyPool

    lp = LazyPool(c.be)
    p1 = lp.acquire(0)
    g1 = c.be.new_graph()
    y = c.step(g1, p1)  # noqa: F841 - the old engine's output stays alive
    g1.reset()
    lp.retire()
    p2 = lp.acquire(0)
    return f"new_id={p1 != p2} capture={attempt(lambda: c.step(c.be.new_graph(), p2))}"


def _matmul_captured(c: Ctx, warm: bool, inference: bool = False) -> str:
    """A matmul captured on a new stream into a fresh pool, the stream warmed up first or not; then every graph
    reset, the output dropped, both caches flushed: is the pool still held, and does a capture into it assert?
    ``inference``: all of it under ``torch.inference_mode``, the capture a ``linear``, which reaches a dispatch
    mode whole there (the simulation must still see the matmul in it)."""
    x = c.tensor(N).view(64, 64)
    with torch.inference_mode() if inference else contextlib.nullcontext():
        x @ x  # the cuBLAS handle is made outside any capture (cublasCreate fails inside one: measured)
        if warm:
            with c.be.stream(c.stream):
                x @ x
        h = c.be.graph_pool_handle()
        g = c.be.new_graph()
        y = c.capture(g, h, (lambda: torch.nn.functional.linear(x, x)) if inference else (lambda: x @ x))
        g.reset()
        del y
        c.be.synchronize()
        c.be.empty_cache()
        c.be.host_empty_cache()
        pinned = c.reserved(h) > 0
        again = attempt(lambda: c.capture(c.be.new_graph(), h, lambda: x * 2))
    return f"pinned={pinned} recapture={again}"


def s_workspace_made_in_capture_pins_pool(c: Ctx) -> str:
    return _matmul_captured(c, warm=False)  # the stream's cuBLAS workspace is made inside the capture


def s_workspace_made_in_inference_mode_capture_pins_pool(c: Ctx) -> str:
    return _matmul_captured(c, warm=False, inference=True)


def s_workspace_made_before_capture_pins_nothing(c: Ctx) -> str:
    return _matmul_captured(c, warm=True)
