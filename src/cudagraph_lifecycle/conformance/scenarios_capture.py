"""Conformance scenarios of captures themselves: streams (the default stream's refusal, the current stream
per thread), replay after reset, and a capture invalidated by a host sync or refused a copy to host memory."""

from __future__ import annotations

import functools
import threading

from ..backends.base import MiB
from .context import Ctx, attempt


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


def _host_read_in_capture(c: Ctx, read) -> str:
    """A capture whose code reads its result on the host: how the capture ends, then whether eager random ops
    still work, and the pool's references after ``reset()``."""
    mp = c.be.mempool(0)
    g = c.be.new_graph()
    x = c.tensor()
    first = attempt(lambda: c.capture(g, mp.id, lambda: read(x * 2)))
    g.reset()
    after = attempt(lambda: c.be.randn(4))
    return f"{first} then {after}, use_count={mp.use_count()}"


def s_host_sync_in_capture(c: Ctx) -> str:
    return _host_read_in_capture(c, lambda y: y.sum().item())


# The other host reads (measured on the H100, torch 2.11: scripts/probes/host_reads.py): those that wait for
# the device invalidate the capture as .item() does; a copy to host memory is refused and the capture goes on.
def s_nonzero_in_capture(c: Ctx) -> str:
    return _host_read_in_capture(c, lambda y: y.nonzero())


def s_bool_mask_in_capture(c: Ctx) -> str:
    return _host_read_in_capture(c, lambda y: y[y > 0])


def s_print_in_capture(c: Ctx) -> str:
    return _host_read_in_capture(c, lambda y: str(y))


def s_tolist_in_capture(c: Ctx) -> str:
    return _host_read_in_capture(c, lambda y: y.tolist())


def s_cpu_copy_in_capture(c: Ctx) -> str:
    return _host_read_in_capture(c, lambda y: y.cpu())


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
