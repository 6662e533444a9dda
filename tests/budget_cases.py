"""The budgets of a ``cudagraph``-marked test, as a test file: the same six tests and the same report lines
on the simulated allocator (test_budgets_reload_hazard.py) and on CUDA (test_gpu.py); only ``capture`` and
``flush`` differ."""

SIM_CAPTURE = '''
import pytest, torch
from cudagraph_lifecycle import get_backend

def capture(n, replay):
    be = get_backend("sim")
    x, graphs = torch.ones(4, 8), []
    with be.stream(be.capture_stream(0)):
        for _ in range(n):
            g = be.new_graph()
            g.capture_begin(pool=be.graph_pool_handle())
            y = x * 2
            g.capture_end()
            graphs.append((g, y))
    for g, _ in graphs[:replay]:
        g.replay()
    return graphs

def flush():
    get_backend("sim").empty_cache()
'''

CUDA_CAPTURE = '''
import pytest, torch

def capture(n, replay):
    s = torch.cuda.Stream()
    x, graphs = torch.ones(4, 8, device="cuda"), []
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y = x * 2
        graphs.append((g, y))
    for g, _ in graphs[:replay]:
        g.replay()
    return graphs

def flush():
    torch.cuda.empty_cache()
'''

MARKED_TESTS = '''
@pytest.mark.cudagraph(max_captures=2)
def test_too_many_captures():
    keep = capture(3, 3)

@pytest.mark.cudagraph(require_replay=True)
def test_never_replayed():
    keep = capture(2, 0)

@pytest.mark.cudagraph(max_pool_bytes=1000)
def test_over_budget():
    keep = capture(1, 1)

@pytest.mark.cudagraph(max_pool_bytes=1000)
def test_over_budget_then_released_and_flushed():
    keep = capture(1, 1)
    for g, y in keep:
        g.reset()
    del keep, g, y  # the output too: a live output pins the pool's segment through the flush
    flush()  # the pool's segment is gone by the end: its peak still counts

@pytest.mark.cudagraph(max_pool_bytes=3 << 20)
def test_pools_one_after_another_count_once():
    for _ in range(3):  # 2 MiB at a time: the peak is what the pools hold together, not added up over time
        keep = capture(1, 1)
        for g, y in keep:
            g.reset()
        del keep, g, y
        flush()

@pytest.mark.cudagraph(max_pool_bytes=2 << 20, max_captures=2, require_replay=True)
def test_within_budget():
    keep = capture(1, 1)
    for g, _ in keep:
        g.reset()
'''


def check(res) -> None:
    """Four budgets broken (each fails its test at teardown), two kept."""
    res.assert_outcomes(passed=6, errors=4)
    over = "*pool_over_budget: its graph pools held 2 MiB (2097152 bytes) at their peak, over the max_pool_bytes " \
        "budget of 1000 bytes*"
    res.stdout.fnmatch_lines(["*too_many_captures: 3 captures, over max_captures=2*",
                              "*never_replayed: 2 graph(s) captured, none replayed*", over, over])
