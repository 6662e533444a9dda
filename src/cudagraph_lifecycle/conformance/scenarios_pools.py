"""Conformance scenarios of pool references: use counts of graphs and MemPools, pool ids, the stale
capture's ``use_count > 0`` assert (device and host ledgers) and the poisoned RNG it leaves."""

from __future__ import annotations

import torch

from .context import Ctx, N, attempt


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


def s_reset_twice_is_noop(c: Ctx) -> str:
    mp = c.be.mempool(0)
    g = c.be.new_graph()
    y = c.step(g, mp.id)  # noqa: F841
    g.reset()
    g.reset()
    return str(mp.use_count())
