"""The simulated allocator's own rules, beyond the conformance table."""

import pytest
import torch

from cudagraph_lifecycle import ConfigError
from cudagraph_lifecycle.backends.sim import (
    LARGE_SEGMENT,
    SMALL_SEGMENT,
    SimBackend,
    round_size,
    segment_size,
)


def cap(be, g, pool, fn, device=0):
    with be.stream(be.new_stream(device)):
        g.capture_begin(pool=pool)
        try:
            return fn()
        finally:
            g.capture_end()


def test_size_classes():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(512) == SMALL_SEGMENT
    assert segment_size(1 << 20) == SMALL_SEGMENT
    assert segment_size((1 << 20) + 512) == LARGE_SEGMENT
    assert segment_size(10 << 20) == 10 << 20
    assert segment_size((10 << 20) + 1) == 12 << 20


def test_each_backend_is_its_own_world():
    a, b = SimBackend(), SimBackend()
    h = a.graph_pool_handle()
    g = a.new_graph()
    y = cap(a, g, h, lambda: torch.ones(4) * 2)  # noqa: F841
    g.reset()
    with pytest.raises(RuntimeError, match="use_count > 0"):
        cap(a, a.new_graph(), h, lambda: torch.ones(4))
    assert a.poisoned and not b.poisoned
    b.randn(3)  # the other world is fine
    with pytest.raises(RuntimeError, match="Offset increment"):
        a.randn(3)


def test_replay_rereads_inputs_and_writes_outputs_in_place():
    be = SimBackend()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    g = be.new_graph()
    with torch.no_grad():
        y = cap(be, g, be.graph_pool_handle(), lambda: torch.relu(lin(x)) * 3)
        for _ in range(3):
            x.copy_(torch.randn(4, 8))
            g.replay()
            assert torch.allclose(y, torch.relu(lin(x)) * 3)


def test_views_and_inplace_ops_replay():
    be = SimBackend()
    x = torch.randn(6)
    g = be.new_graph()

    def fwd():
        a = x * 2
        a[:3].add_(1)
        return a.view(2, 3).t()

    y = cap(be, g, be.graph_pool_handle(), fwd)
    x.copy_(torch.randn(6))
    g.replay()
    ref = x * 2
    ref[:3] += 1
    assert torch.allclose(y, ref.view(2, 3).t())


def test_a_view_of_an_old_storage_is_no_block():
    be = SimBackend()
    w = torch.randn(8, 8)
    h = be.graph_pool_handle()
    g = be.new_graph()
    out = cap(be, g, h, lambda: w.t())  # noqa: F841 - a view of a pre-capture storage
    assert be.pool_state(h).allocated_bytes == 0


def test_pools_are_per_device():
    be = SimBackend(devices=2)
    h = be.graph_pool_handle()
    g0, g1 = be.new_graph(), be.new_graph()
    y0 = cap(be, g0, h, lambda: torch.ones(4) * 2, device=0)  # noqa: F841
    y1 = cap(be, g1, h, lambda: torch.ones(4) * 2, device=1)  # noqa: F841
    assert be.pool_state(h, 0).use_count == 1 and be.pool_state(h, 1).use_count == 1
    g0.reset()
    assert be.pool_state(h, 0).use_count == 0 and be.pool_state(h, 1).use_count == 1


def test_capture_inside_capture_is_refused():
    be = SimBackend()
    g1, g2 = be.new_graph(), be.new_graph()
    with be.stream(be.new_stream(0)):
        g1.capture_begin(pool=be.graph_pool_handle())
        with pytest.raises(RuntimeError, match="another capture"):
            g2.capture_begin(pool=be.graph_pool_handle())
        g1.capture_end()


def test_another_threads_allocation_during_a_capture_is_in_the_default_pool():
    """The capture sees its own thread's ops; a tensor another thread makes meanwhile (on its own, default,
    stream) is the default pool's, not the graph's, and not lost from both."""
    import threading

    be = SimBackend()
    g, x = be.new_graph(), be.randn(16)
    made = []
    with be.stream(be.new_stream(0)):
        g.capture_begin(pool=be.graph_pool_handle())
        before = be.default_pool_reserved(0)
        x * 2
        t = threading.Thread(target=lambda: made.append(be.randn(1 << 20)))
        t.start()
        t.join()
        during = be.default_pool_reserved(0)
        g.capture_end()
    assert during - before >= 4 << 20 and be.pool_state(g.pool()).allocated_bytes < 4 << 20


def test_synchronize_in_capture_invalidates_it():
    be = SimBackend()
    g = be.new_graph()
    with be.stream(be.new_stream(0)):
        g.capture_begin()
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            be.synchronize()
        with pytest.raises(RuntimeError, match="previous error during capture"):
            g.capture_end()


def test_block_stacks_name_the_allocating_line():
    be = SimBackend(record_stacks=True)
    h = be.graph_pool_handle()
    g = be.new_graph()
    y = cap(be, g, h, lambda: torch.ones(4) * 2)  # noqa: F841
    blocks = be.live_blocks(h)
    assert len(blocks) == 1 and blocks[0].size == 512
    assert "test_block_stacks_name_the_allocating_line" in blocks[0].stack


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5])
def test_bad_device_count(bad):
    with pytest.raises(ConfigError, match="positive int"):
        SimBackend(devices=bad)


def test_bad_device_index():
    with pytest.raises(ConfigError, match="device index 5"):
        SimBackend(devices=2).new_stream(5)


def test_wait_stream_orders_nothing_outside_a_capture_and_refuses_a_fork_inside_one():
    """Engines warm up on a side stream after wait_stream (fine: host order); a capture that forks onto another
    stream and joins back cannot be simulated, so it is refused with the way out, not an AttributeError."""
    be = SimBackend()
    side, capture = be.new_stream(), be.capture_stream()
    side.wait_stream(be._current_stream)  # (the default stream here)
    g = be.new_graph()
    with be.stream(capture):
        g.capture_begin()
        with pytest.raises(RuntimeError, match=r"forks onto another stream .* run this engine on cuda"):
            side.wait_stream(capture)
        capture.wait_stream(capture)  # a stream waiting on itself forks nothing
        g.capture_end()
    side.wait_stream(capture)
    g.reset()


def test_a_sim_graph_alive_at_interpreter_exit_says_nothing(tmp_path):
    """At exit a module's globals may be None before a graph or MemPool still alive is destroyed: their
    destructors must not print 'Exception ignored in ...' (here every global of the modules that define them is gone first)."""
    import subprocess
    import sys

    prog = tmp_path / "exit.py"
    prog.write_text(
        "import cudagraph_lifecycle.backends.sim as sim\n"
        "import cudagraph_lifecycle.backends.sim_graph as sim_graph\n"
        "be = sim.SimBackend()\n"
        "KEEP = [be.new_graph(), be.mempool(0)]\n"
        "with be.graph(KEEP[0], stream=be.new_stream(0)):\n"
        "    KEEP.append(be.empty(4) * 2)\n"
        "for mod in (sim, sim_graph):  # as interpreter shutdown leaves a module's globals\n"
        "    for name in [n for n in vars(mod) if not n.startswith('__')]:\n"
        "        setattr(mod, name, None)\n")
    out = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Exception ignored" not in out.stderr, out.stderr
