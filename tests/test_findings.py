"""Findings a user can act on: each names the test and the line that captured into its pool, and what pins
a pinned pool (a global, an attribute, a list, the autograd graph of a copy, a library workspace)."""

import dataclasses
import gc
import json
import os
import time
import weakref

import pytest
import torch

from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.conformance import Ctx
from cudagraph_lifecycle.ledger import ledger
from cudagraph_lifecycle.sanitizer import PoolSanitizer, heap_index, holders
from cudagraph_lifecycle.sanitizer.pins import what_pins

HELD = {}  # a module global that pins a pool in the tests below
_STARTED = []  # sanitizers the helpers started: stopped after each test, whatever it asserted


@pytest.fixture(autouse=True)
def _stop_sanitizers():
    yield
    while _STARTED:
        _STARTED.pop().stop()


@pytest.fixture(params=["scanned", "indexed"])
def heap(request, monkeypatch):
    """Holders found by scanning the heap per object (a short search), or from the index a long search builds."""
    if request.param == "indexed":
        monkeypatch.setattr(heap_index, "_INDEX_AFTER", 0)
    return request.param


def _watched(be):
    """A sanitizer on ``be`` (stopped after the test), its helpers, a new pool id and graph."""
    san = PoolSanitizer(be).start()
    _STARTED.append(san)
    return san, Ctx(be), be.graph_pool_handle(), be.new_graph()


def _pinned(hold, grad: bool = False):
    """A released pool of a fresh simulated allocator, one of its outputs handed to ``hold``."""
    be = SimBackend()
    san, c, h, g = _watched(be)
    w = be.randn(16).requires_grad_(grad)
    x = c.tensor(16)
    with torch.set_grad_enabled(grad):
        y = c.capture(g, h, lambda: (x * w).relu())
    hold(y)
    g.reset()
    del y
    be.empty_cache()
    return be, san, (be.world, 0, h)


@pytest.mark.usefixtures("heap")
def test_a_module_global_is_named():
    be, san, key = _pinned(lambda y: HELD.__setitem__("out", y))
    try:
        (pin,) = what_pins(be, [key])
        assert pin.cause == "python_reference" and pin.bytes == 512
        assert "key `out` of a dict (global `HELD` of module test_findings)" in pin.holder
        (f,) = san.findings()
        assert f.kind == "pinned_pool" and f.pins[0]["cause"] == "python_reference"
        assert "global `HELD`" in f.message and "drop that reference" in f.message
    finally:
        HELD.clear()
        san.stop()


class Decoder:
    pass


@pytest.mark.usefixtures("heap")
def test_an_attribute_and_a_list_item_are_named():
    keep = Decoder()
    be, san, key = _pinned(lambda y: setattr(keep, "last_out", y))
    (pin,) = what_pins(be, [key])
    assert "attribute `last_out` of a Decoder object" in pin.holder
    san.stop()
    cache = []
    be, san, key = _pinned(cache.append)
    (pin,) = what_pins(be, [key])
    assert pin.holder.startswith("a tensor (16,) float32 held as an item of a list")
    san.stop()


def _decode_steps(y):
    last = y  # a view of the pool, kept by the suspended generator
    while True:
        yield last.sum()


@pytest.mark.usefixtures("heap")
def test_a_suspended_generator_and_who_keeps_it_are_named():
    """A decode generator never exhausted: its frame keeps the output, and something keeps the generator."""
    be, san, key = _pinned(lambda y: HELD.__setitem__("active", _decode_steps(y)) or next(HELD["active"]))
    try:
        (pin,) = what_pins(be, [key])
        assert pin.cause == "python_reference", pin
        assert "held as a local variable of the suspended generator _decode_steps (" in pin.holder
        assert "test_findings.py:" in pin.holder and pin.holder.endswith(
            "(key `active` of a dict (global `HELD` of module test_findings))"), pin.holder
    finally:
        HELD.clear()
        san.stop()


def _reader_of(y):
    def read():
        return y.sum()
    return read


@pytest.mark.usefixtures("heap")
def test_a_closure_of_the_users_is_named_with_who_keeps_the_function():
    be, san, key = _pinned(lambda y: HELD.__setitem__("readers", [_reader_of(y)]))  # a cache of callables
    try:
        (pin,) = what_pins(be, [key])
        assert pin.holder == ("a tensor (16,) float32 held as a closure variable of _reader_of.<locals>.read "
                              f"({__file__}) (an item of a list (key `readers` of a dict (global `HELD` of module "
                              "test_findings)))")
    finally:
        HELD.clear()


@pytest.mark.usefixtures("heap")
def test_a_buffer_of_a_module_is_named():
    mod = torch.nn.Module()
    be, san, key = _pinned(lambda y: mod.register_buffer("cached", y))
    (pin,) = what_pins(be, [key])
    assert "buffer `cached` of a Module object" in pin.holder
    san.stop()


# torch.cuda.make_graphed_callables' closures, as torch 2.11 builds them: the static tensors and graphs in
# an autograd Function's methods, that class in the closure of the function it returns (for a module, in the
# closure of the forward it sets on the module). Compiled under torch's file name: library code, not the user's.
_GRAPHED_SOURCE = """
import torch

def make_graphed_callables(callable, static_outputs, graph):
    def make_graphed_autograd_function(graph, static_outputs):
        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                graph.replay()
                return tuple(o.detach() for o in static_outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                return grads

        def functionalized(*user_args):
            return Graphed.apply(*user_args)

        return functionalized

    graphed = make_graphed_autograd_function(graph, static_outputs)
    if isinstance(callable, torch.nn.Module):
        def make_graphed_forward(func, graphed, orig_fwd):
            def new_fwd(*user_args):
                return graphed(*user_args) if func.training else orig_fwd(*user_args)
            return new_fwd

        callable.forward = make_graphed_forward(callable, graphed, callable.forward)
        return callable
    return graphed
"""


def _torch_style_graphed():
    import torch.cuda.graphs

    names = {"__name__": "torch.cuda.graphs"}
    exec(compile(_GRAPHED_SOURCE, torch.cuda.graphs.__file__, "exec"), names)
    return names["make_graphed_callables"]


class Server:
    pass


@pytest.mark.usefixtures("heap")
def test_what_torch_keeps_in_closures_is_named_by_what_the_user_holds():
    """make_graphed_callables keeps its static outputs and graphs in closures of its own: the holder a user
    can drop is the callable it returned (memoised in a global) or the module whose forward it replaced."""
    make_graphed = _torch_style_graphed()
    be, san, key = _pinned(lambda y: HELD.__setitem__("decode", make_graphed(len, (y,), None)))
    try:
        (pin,) = what_pins(be, [key])
        assert pin.holder.endswith("(a closure variable inside the `functionalized` that "
                                   "torch.cuda.graphs.make_graphed_callables made, held as key `decode` of a dict "
                                   "(global `HELD` of module test_findings))"), pin.holder
    finally:
        HELD.clear()
        san.stop()
    server = Server()
    be, san, key = _pinned(lambda y: setattr(server, "model", make_graphed(torch.nn.Linear(1, 1), (y,), None)))
    (pin,) = what_pins(be, [key])
    assert "inside the `new_fwd` that torch.cuda.graphs.make_graphed_callables made, held as attribute `forward` " \
           "of a Linear object (attribute `model` of a Server object" in pin.holder, pin.holder
    san.stop()
    # the module is referred to by torch's closure too (new_fwd's `func`): the user's holder is named first
    be, san, key = _pinned(lambda y: HELD.__setitem__("model", make_graphed(torch.nn.Linear(1, 1), (y,), None)))
    try:
        (pin,) = what_pins(be, [key])
        assert pin.holder.endswith("held as attribute `forward` of a Linear object (key `model` of a dict (global "
                                   "`HELD` of module test_findings)))"), pin.holder
    finally:
        HELD.clear()
        san.stop()


@pytest.mark.usefixtures("heap")
def test_a_graphed_module_only_its_own_reference_cycle_keeps_is_named_as_that_cycle():
    # the module holds torch's new_fwd as its forward, and new_fwd's closure holds the module: dropped by the
    # engine, both live until the next garbage collection (seen on the GPU: release_incomplete of a
    # make_graphed_callables engine)
    from cudagraph_lifecycle.sanitizer.pins import graph_holder

    g = SimBackend().new_graph()
    enabled = gc.isenabled()
    gc.disable()  # a collection would free the cycle before it is named
    try:
        _torch_style_graphed()(torch.nn.Linear(1, 1), (), g)
        named = graph_holder([weakref.ref(g)])
    finally:
        if enabled:
            gc.enable()
    assert named.endswith("held as attribute `forward` of a Linear object (nothing but a reference cycle: a closure "
                          "variable of make_graphed_callables.<locals>.make_graphed_forward.<locals>.new_fwd "
                          f"({torch.cuda.graphs.__file__}), the function it holds as attribute `forward`; no other "
                          "Python object holds either, so the next garbage collection (gc.collect()) frees both)"), named


class _Lone:
    pass


def test_the_searchs_own_closures_are_no_holder():
    # naming who holds an object runs in a closure that refers to it (memoised words): on the H100 a module
    # only a reference cycle kept was named "a closure variable of _up.<locals>.words (.../pins.py)"
    assert holders._up(_Lone(), set(), 3) == ""


def test_a_graph_torch_keeps_in_a_closure_is_named_by_what_the_user_holds():
    from cudagraph_lifecycle.sanitizer.pins import graph_holder

    be = SimBackend()
    g = be.new_graph()
    HELD["graphed"] = _torch_style_graphed()(len, (), g)
    try:
        assert graph_holder([weakref.ref(g)]).endswith(
            "inside the `functionalized` that torch.cuda.graphs.make_graphed_callables made, held as key "
            "`graphed` of a dict (global `HELD` of module test_findings)")
    finally:
        HELD.clear()


class _Slot:
    pass


def test_the_heap_index_gives_what_a_scan_gives_but_the_searchs_own_lists():
    t = torch.ones(3)
    slot, pair, cell_fn = _Slot(), (t, t), (lambda: t)
    slot.t, keep = t, {"t": t, "pair": pair}
    own = heap_index.Found([t, slot])  # a search's own list is left out of the index, not out of a scan
    looked_up = (t, slot, pair, keep, cell_fn.__closure__[0])
    index = heap_index._heap_index()
    for obj in looked_up:
        found = index.get(id(obj))
        found = list(found) if type(found) is heap_index._Multi else [] if found is None else [found]
        scanned = [r for r in gc.get_referrers(obj) if r is not own and r is not index and type(r) is not heap_index._Multi]
        assert {id(r) for r in found} == {id(r) for r in scanned}, f"{type(obj)}: {[type(r) for r in found]} " \
                                                                    f"indexed, {[type(r) for r in scanned]} scanned"
        assert len(found) == len(scanned)
        del found, scanned  # (a list of one object's referrers refers to them too)
    assert own in gc.get_referrers(t)
    assert index[id(keep)] is looked_up  # one referrer is kept bare
    assert [r is pair for r in index[id(t)]].count(True) == 1  # the pair refers to t twice: one referrer


def test_a_long_search_indexes_the_heap_once(monkeypatch):
    built = []
    real = heap_index._heap_index
    monkeypatch.setattr(heap_index, "_heap_index", lambda: built.append(1) or real())
    monkeypatch.setattr(heap_index, "_INDEX_AFTER", 3)
    be, san, key = _pinned(lambda y: HELD.__setitem__("out", y))
    try:
        (pin,) = what_pins(be, [key])
        assert "global `HELD` of module test_findings" in pin.holder
        assert built == [1]
    finally:
        HELD.clear()


@pytest.mark.usefixtures("heap")
def test_the_autograd_graph_of_a_copy_is_named():
    kept = []
    be, san, key = _pinned(lambda y: kept.append(y.clone()), grad=True)  # the clone carries the capture's history
    (pin,) = what_pins(be, [key])
    assert pin.cause == "autograd_history" and "torch.no_grad()" in pin.fix
    assert "held as an item of a list" in pin.holder
    kept.clear()
    be.empty_cache()
    assert what_pins(be, [key]) == []  # nothing pins it any more
    san.stop()


def _workspace_pinned(keep_graph_alive: bool):
    """A released pool that cuBLAS's (simulated) workspace pins: the first matmul on torch.cuda.graph's own
    stream ran inside the capture, so the stream's workspace was made there, in the pool, for good."""
    from cudagraph_lifecycle.backends.sim import WORKSPACE_BYTES

    be = SimBackend()
    san, _, h, g = _watched(be)
    w, x = be.randn(8, 8), be.randn(4, 8)
    with be.graph(g, pool=h):  # no stream given: torch.cuda.graph's own, where no matmul ran yet
        y = x @ w
    del y
    other = None
    if keep_graph_alive:
        other = be.new_graph()
        with be.graph(other, pool=be.graph_pool_handle()):
            x @ w
    g.reset()
    be.empty_cache()
    assert be.pool_state(h).allocated_bytes == WORKSPACE_BYTES  # the workspace alone
    return be, san, (be.world, 0, h), other


@pytest.mark.parametrize("graphs_alive", [False, True])
def test_a_library_workspace_is_named_without_freeing_it(graphs_alive):
    """Named by what the backend knows of it, while graphs live too, and never freed to find out: the pool
    stays dead, as it does in the user's process (a capture into it would assert)."""
    from cudagraph_lifecycle.backends.sim import WORKSPACE_BYTES

    be, san, key, other = _workspace_pinned(keep_graph_alive=graphs_alive)
    (pin,) = what_pins(be, [key])
    assert (pin.cause, pin.bytes) == ("library_workspace", WORKSPACE_BYTES), pin
    assert "simulated cuBLAS workspace of stream" in pin.holder and "clearCublasWorkspaces" in pin.fix
    be.empty_cache()
    assert be.pool_state(key[2]).allocated_bytes == WORKSPACE_BYTES and be.would_assert(key[2])
    san.stop()


def test_a_backend_without_library_workspaces_names_none():
    be, san, key, other = _workspace_pinned(keep_graph_alive=True)
    be.has_library_workspaces = False  # a backend that cannot tell a workspace: what nothing names is unknown
    (pin,) = what_pins(be, [key])
    assert (pin.cause, pin.holder) == ("unknown", "a holder the garbage collector does not see")
    assert "record allocation stacks" in pin.fix
    san.stop()


def test_telling_the_users_frames_reads_where_the_libraries_live_once_a_file(monkeypatch):
    """A cycle's verdict shows every pool's capture sites, a frame at a time: where the standard library lives
    (sysconfig, ~0.2 ms a read) is read once for a file, not for every frame shown."""
    import sysconfig

    from cudagraph_lifecycle import ledger as ledger_module

    reads = []
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: reads.append(1) or real(*a, **k))
    ledger_module._user_file.cache_clear()
    name = os.path.join(os.path.dirname(__file__), "peer_engines.py")
    assert ledger_module.is_user_file(name) and reads  # read for this file
    first = len(reads)
    assert [ledger_module.is_user_file(name) for _ in range(50)] == [True] * 50 and len(reads) == first
    assert not ledger_module.is_user_file(os.__file__) and not ledger_module.is_user_file(os.__file__)
    ledger_module._user_file.cache_clear()  # (the next test reads with the real sysconfig again)


def test_findings_carry_the_capture_site_and_the_test():
    be = SimBackend()
    with PoolSanitizer(be) as san:
        ledger.test = "tests/test_x.py::test_y"
        try:
            g = be.new_graph()
            Ctx(be).step(g, be.graph_pool_handle())  # never reset
        finally:
            ledger.test = None
        (f,) = san.findings()
    assert f.kind == "unreleased_graph" and f.tests == ("tests/test_x.py::test_y",)
    # the user's line, not the library's Ctx.capture nor torch's
    assert len(f.sites) == 1 and "test_findings.py" in f.sites[0] and "test_findings_carry" in f.sites[0]
    assert f.sites[0] in f.message
    d = f.as_dict()
    assert d["sites"] == list(f.sites) and d["tests"] == ["tests/test_x.py::test_y"]
    g.reset()


def _captures_in_worker():
    from cudagraph_lifecycle.backends import get_backend

    be = get_backend("sim")
    g = be.new_graph()
    Ctx(be).step(g, be.graph_pool_handle())
    e = ledger.pool(be.world, 0, g.pool())
    g.reset()
    return e.tests, e.capture_sites()


def test_captures_in_a_worker_belong_to_the_calling_test(cudagraph_worker, request):
    tests, sites = cudagraph_worker.call(_captures_in_worker)
    assert tests == [request.node.nodeid]
    assert sites and "_captures_in_worker" in sites[0]


SESSION_TESTS = '''
import torch
from cudagraph_lifecycle import get_backend

CACHE = {}
GRAPHS = []

def _capture(be):
    g = be.new_graph()
    x = torch.ones(64)
    with be.stream(be.new_stream(0)):
        g.capture_begin(pool=be.graph_pool_handle())
        y = x * 2
        g.capture_end()
    return g, y

def pin_a_pool():
    be = get_backend("sim")
    g, y = _capture(be)
    CACHE["last"] = y
    g.reset()
    be.empty_cache()

def test_pins_a_pool():
    pin_a_pool()

def test_keeps_a_graph():
    GRAPHS.append(_capture(get_backend("sim")))

def test_clean():
    be = get_backend("sim")
    g, y = _capture(be)
    del y
    g.reset()
'''


@pytest.mark.parametrize("xdist", [False, True], ids=["one process", "xdist -n 2"])
def test_a_session_wide_sanitizer_names_the_test_and_the_line(pytester, monkeypatch, xdist):
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "1")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s=SESSION_TESTS)
    report = pytester.path / "r.json"
    args = ["-p", "cudagraph", "-p", "no:cacheprovider", f"--cudagraph-report={report}"]
    res = pytester.runpytest_subprocess(*args, *(["-n", "2"] if xdist else []))
    res.assert_outcomes(passed=3)
    res.stdout.fnmatch_lines([
        "*= cudagraph sanitizer =*",
        "test_s.py::test_pins_a_pool: pinned_pool: pool (0, *) on device 0*",
        "*pinned by a tensor (64,) float32 held as key `last` of a dict (global `CACHE` of module test_s)*",
    ], consecutive=False)
    res.stdout.fnmatch_lines(["    pool (0, *) (captured at *test_s.py:11 in _capture) was released*"])
    res.stdout.fnmatch_lines(["test_s.py::test_keeps_a_graph: unreleased_graph: pool*", "2 sanitizer finding(s)"])
    data = json.loads(report.read_text())
    by_kind = {f["kind"]: f for f in data["sanitizer"]}
    assert set(by_kind) == {"pinned_pool", "unreleased_graph"}  # test_clean left nothing
    pinned = by_kind["pinned_pool"]
    assert pinned["tests"] == ["test_s.py::test_pins_a_pool"] and pinned["sites"][0].endswith("test_s.py:11 in _capture")
    assert pinned["pins"][0]["cause"] == "python_reference"
    assert data["totals"]["sanitizer_findings"] == 2
    assert "cudagraph sanitizer: " not in res.stderr.str()  # the plugin took them: no process prints them at exit


@pytest.mark.parametrize("mode, rc", [("1", 0), ("strict", 1)])
def test_a_session_wide_strict_sanitizer_fails_the_session_on_a_finding(pytester, monkeypatch, mode, rc):
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", mode)
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s=SESSION_TESTS)
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", f"--cudagraph-report={report}")
    res.assert_outcomes(passed=3)  # each test passed: the findings come at the session's end
    assert res.ret == rc
    strict_line = "2 sanitizer finding(s); CUDAGRAPH_SANITIZE=strict: they fail the session"
    res.stdout.fnmatch_lines([strict_line if rc else "2 sanitizer finding(s)"])
    assert (strict_line in res.stdout.str()) == bool(rc)
    t = json.loads(report.read_text())["totals"]  # the documented gate agrees with the exit code
    assert (t["lifecycle_failures"], t["strict_session_findings"]) == ((1, 2) if rc else (0, 0))
    assert "cudagraph sanitizer: " not in res.stderr.str()  # reported under the tests, not again at exit


ONE_ENGINE = """
import torch
from cudagraph_lifecycle import CUDAGraphRunner


class Engine:
    def __init__(self, backend):
        self.w = backend.randn(8, 8)
        self.runner = CUDAGraphRunner(lambda x: x @ self.w, batch_sizes=[2], feature_shape=(8,), backend=backend)

    def run(self, x):
        return self.runner.run(x)

    def release(self):
        self.runner.release()

    def example_input(self):
        return torch.ones(2, 8)


def test_engines(engine_sequence):
    engine_sequence(Engine, 1)
"""


def test_a_session_a_strict_sanitizer_failed_is_not_called_a_failed_test(pytester, monkeypatch):
    """Every test passed, and CUDAGRAPH_SANITIZE=strict failed the session on its findings: the table's last
    line says that, not that a test failed (the report's total still counts the session as one)."""
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "strict")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s=SESSION_TESTS, test_e=ONE_ENGINE)
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        f"--cudagraph-report={report}")
    res.assert_outcomes(passed=4)
    assert res.ret == 1
    res.stdout.fnmatch_lines(["1 engine cycle: *; 0 failed; 0 test(s) failed for lifecycle reasons, and the session "
                              "failed on 2 strict sanitizer finding(s); backend sim"])
    assert json.loads(report.read_text())["totals"]["lifecycle_failures"] == 1


def test_without_the_plugin_the_findings_are_printed_when_pytest_exits(pytester, monkeypatch):
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "strict")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s=SESSION_TESTS)
    res = pytester.runpytest_subprocess("-p", "no:cudagraph", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=3)
    assert res.ret == 1  # nobody reported them under their tests: the exit does, and strict fails it
    res.stderr.fnmatch_lines(["cudagraph sanitizer: pinned_pool: pool (0, *) (captured at *test_s.py:11 in _capture)*",
                              "cudagraph sanitizer: CUDAGRAPH_SANITIZE=strict and 2 finding(s): exit status 1"],
                             consecutive=False)


WORKER_TESTS = SESSION_TESTS.split("def test_pins_a_pool")[0] + '''
def test_in_its_worker(cudagraph_worker):
    cudagraph_worker.call(pin_a_pool)

def test_in_the_modules_worker(cudagraph_module_worker):
    cudagraph_module_worker.call(pin_a_pool)

def capture_and_release():
    g, y = _capture(get_backend("sim"))
    del y
    g.reset()

def test_clean_in_its_worker(cudagraph_worker):
    cudagraph_worker.call(capture_and_release)
'''


@pytest.mark.parametrize("mode", ["on", "strict"])
def test_findings_in_the_plugins_workers_are_reported_under_their_tests(pytester, mode):
    pytester.makepyfile(test_w=WORKER_TESTS)
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", f"--cudagraph-report={report}",
                                        f"--cudagraph-sanitize={mode}", "--cudagraph-backend=sim")
    if mode == "on":
        res.assert_outcomes(passed=3)
    else:  # a test's own worker's findings fail it at teardown; a shared worker's are the session's
        res.assert_outcomes(passed=3, errors=1)
        res.stdout.fnmatch_lines(["*pool sanitizer findings in the test's worker:*", "- pinned_pool: pool (0, *",
                                  "*pinned by a tensor (64,) float32 held as key `last` of a dict*",
                                  "*--- the pool's first capture began at ---", "*test_w.py*"])
        out = res.stdout.str()  # the error shows it whole; the section names it in one line
        assert out.count("pinned by a tensor (64,) float32 held as key `last`") == 2, out  # and the shared worker's
        res.stdout.fnmatch_lines(["test_w.py::test_in_its_worker: pinned_pool: pool (0, *",
                                  "    failed the test: its error above shows the whole finding"])
    data = json.loads(report.read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in data["tests"]}
    (own,) = tests["test_in_its_worker"]["sanitizer"]
    assert own["kind"] == "pinned_pool" and own["pins"][0]["cause"] == "python_reference", own
    # the worker froze its modules at its first call (gc.freeze): the holder is still named
    assert own["pins"][0]["holder"].endswith("held as key `last` of a dict (global `CACHE` of module test_w)"), own
    assert own["sites"][0].endswith("test_w.py:11 in _capture") and own["pid"] > 0
    assert not tests["test_clean_in_its_worker"].get("sanitizer")
    (shared,) = data["sanitizer"]  # the module worker's, under the test that captured into its pool
    assert shared["kind"] == "pinned_pool" and shared["tests"] == ["test_w.py::test_in_the_modules_worker"]
    assert data["totals"]["sanitizer_findings"] == 2
    # under strict the shared worker's finding, found after its test ended, fails the session
    assert data["totals"]["strict_session_findings"] == (mode == "strict")
    assert (("--cudagraph-sanitize=strict: 1 of them, found in shared workers when they closed, fails the session"
             in res.stdout.str()) == (mode == "strict"))


def test_a_poisoned_workers_findings_are_read_before_it_is_replaced(pytester):
    pytester.makepyfile(test_w=WORKER_TESTS.split("def test_in_its_worker")[0] + '''
import pytest
from pytest_cudagraph import RemoteError

def poisoned():
    raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (as the allocator raises it)")

def test_pin_then_poison(cudagraph_worker):
    cudagraph_worker.call(pin_a_pool)
    with pytest.raises(RemoteError) as e:
        cudagraph_worker.call(poisoned)
    assert e.value.poisons_process
    first = cudagraph_worker.pid
    cudagraph_worker.call(int)  # on a new child
    assert cudagraph_worker.pid != first
''')
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", f"--cudagraph-report={report}",
                                        "--cudagraph-backend=sim")
    res.assert_outcomes(passed=1)
    (t,) = json.loads(report.read_text())["tests"]
    assert [f["kind"] for f in t.get("sanitizer") or []] == ["pinned_pool"], t


def test_a_busy_worker_does_not_hold_up_its_close(pytester):
    """A call still running in another thread at teardown: the findings are not waited for (the close ends
    the child after a second, as it always did)."""
    pytester.makepyfile(test_w='''
import threading, time

def test_busy(cudagraph_worker):
    cudagraph_worker.call(int)
    threading.Thread(target=cudagraph_worker.call, args=(time.sleep, 120), daemon=True).start()
    time.sleep(0.5)
''')
    t0 = time.monotonic()
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim")
    res.assert_outcomes(passed=1)
    assert time.monotonic() - t0 < 60  # not the 120 s of the call, nor the 300 s timeout


@pytest.mark.parametrize("xdist", [False, True], ids=["one process", "xdist -n 2"])
def test_the_same_pool_id_in_two_processes_is_two_findings(pytester, monkeypatch, xdist):
    """Pool ids start at (0, 1) in every process: a marked test's finding in one xdist worker does not hide
    the program-wide sanitizer's in another."""
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "1")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pin = SESSION_TESTS.split("def test_pins_a_pool")[0]
    pytester.makepyfile(test_p=pin + "import pytest\n\n@pytest.mark.cudagraph\ndef test_p():\n"
                                     "    g, y = _capture(get_backend('sim'))\n    CACHE['p'] = y\n    g.reset()\n",
                        test_q=pin + "def test_q():\n    g, y = _capture(get_backend('sim'))\n    CACHE['q'] = y\n"
                                     "    g.reset()\n")
    report = pytester.path / "r.json"
    args = ["-p", "cudagraph", "-p", "no:cacheprovider", f"--cudagraph-report={report}"]
    res = pytester.runpytest_subprocess(*args, *(["-n", "2", "--dist", "loadfile"] if xdist else []))
    res.assert_outcomes(passed=2)
    data = json.loads(report.read_text())
    where = sorted(nodeid.split("::")[1] for nodeid in [t["nodeid"] for t in data["tests"] if t.get("sanitizer")]
                   + [f["tests"][0] for f in data["sanitizer"]])
    assert where == ["test_p", "test_q"] and data["totals"]["sanitizer_findings"] == 2, data


def test_an_engine_sequences_own_worker_reports_a_plain_calls_finding(pytester):
    """``cudagraph_engines(sanitize=...)`` gives the sequence a worker of its own, in that mode."""
    pytester.makepyfile(test_w=WORKER_TESTS.split("def test_in_its_worker")[0] + '''
import pytest

@pytest.mark.cudagraph_engines(sanitize="strict")
def test_sequence_worker(engine_sequence):
    engine_sequence.worker.call(pin_a_pool)
''')
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim")
    res.assert_outcomes(passed=1, errors=1)  # strict: the marker's mode, though the session's is on
    res.stdout.fnmatch_lines(["*pool sanitizer findings in the test's worker:*"])


def test_the_plugins_strict_mode_leaves_the_program_wide_sanitizers_findings_to_it(pytester, monkeypatch):
    """``--cudagraph-sanitize=strict`` fails the session on shared workers' findings, not on what the
    program-wide ``CUDAGRAPH_SANITIZE=1`` (not strict) found in the pytest process."""
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "1")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s=SESSION_TESTS)
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-sanitize=strict",
                                        f"--cudagraph-report={report}")
    res.assert_outcomes(passed=3)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["2 sanitizer finding(s)"])
    # the header and the report tell the two sanitizers apart (their variables differ by one word)
    res.stdout.fnmatch_lines(["cudagraph: *sanitize=strict (and program-wide CUDAGRAPH_SANITIZE=1), engines held*"])
    meta = json.loads(report.read_text())["meta"]  # the report in the plugin's words for both
    assert meta["sanitize"] == "strict" and meta["program_sanitize"] == "on"


SHARED_POOL_TESTS = """
import pytest
from cudagraph_lifecycle import get_backend
from cudagraph_lifecycle.conformance import Ctx

be = get_backend("sim")
POOL = be.graph_pool_handle()
KEEP = []

@pytest.mark.xfail(reason="keeps a graph on purpose", strict=False)
def test_a_xfail():
    g = be.new_graph()
    KEEP.append((g, Ctx(be).step(g, POOL)))
    assert False

def test_b_passes():
    g = be.new_graph()
    KEEP.append((g, Ctx(be).step(g, POOL)))
"""


def test_graphs_of_two_tests_in_one_pool_are_two_findings_and_the_passing_tests_fails_strict(pytester, monkeypatch):
    """One finding per pool and test: the xfailed test's graph does not excuse the passing test's."""
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "strict")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_share=SHARED_POOL_TESTS)
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim")
    res.assert_outcomes(passed=1, xfailed=1)
    assert res.ret == 1, res.stdout.str()
    res.stdout.fnmatch_lines(["test_share.py::test_a_xfail: unreleased_graph: *",
                              "test_share.py::test_b_passes: unreleased_graph: *",
                              "2 sanitizer finding(s); CUDAGRAPH_SANITIZE=strict: 1 of them fail the session*"],
                             consecutive=False)


def test_a_shared_workers_finding_alone_fails_a_strict_session(pytester):
    pytester.makepyfile(test_w=WORKER_TESTS.replace("def test_in_its_worker", "def _not_collected"))
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-sanitize=strict",
                                        "--cudagraph-backend=sim")
    res.assert_outcomes(passed=2)
    assert res.ret == 1


def test_without_the_plugin_an_xdist_worker_says_it_cannot_fail_the_run(pytester, monkeypatch):
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "strict")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s=SESSION_TESTS)
    res = pytester.runpytest_subprocess("-p", "no:cudagraph", "-p", "no:cacheprovider", "-n", "2")
    res.assert_outcomes(passed=3)
    res.stderr.fnmatch_lines(["*pytest-xdist worker gw*: its exit status does not fail the run; load the plugin*"])


def test_a_strict_session_does_not_fail_on_an_xfailed_tests_finding(pytester, monkeypatch):
    monkeypatch.setenv("CUDAGRAPH_SANITIZE", "strict")
    monkeypatch.setenv("CUDAGRAPH_SANITIZE_BACKEND", "sim")
    pytester.makepyfile(test_s="import pytest\n" + SESSION_TESTS.replace(
        "def test_keeps_a_graph():\n    GRAPHS.append(_capture(get_backend(\"sim\")))",
        "@pytest.mark.xfail(reason=\"keeps a graph on purpose\", strict=True)\n"
        "def test_keeps_a_graph():\n    GRAPHS.append(_capture(get_backend(\"sim\")))\n    assert False"))
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=2, xfailed=1)
    assert res.ret == 1  # test_pins_a_pool's finding still fails it
    res.stdout.fnmatch_lines(["2 sanitizer finding(s); CUDAGRAPH_SANITIZE=strict: 1 of them fail the session*"])


def test_a_users_folder_named_like_the_package_is_still_the_users(tmp_path):
    """Frames are the machinery's by where the package lives, not by a folder's name."""
    import cudagraph_lifecycle
    from cudagraph_lifecycle.ledger import Stack

    theirs = compile("x = 1\n", str(tmp_path / "cudagraph_lifecycle" / "serve.py"), "exec")
    ours = compile("x = 1\n", os.path.join(os.path.dirname(cudagraph_lifecycle.__file__), "runner.py"), "exec")
    stack = Stack([ours, 0, theirs, 0])  # innermost first, as a capture records it
    assert stack.site().startswith(f"{theirs.co_filename}:") and stack.site().endswith(" in <module>")
    assert theirs.co_filename in str(stack) and ours.co_filename not in str(stack)


@pytest.mark.usefixtures("heap")
def test_an_unreadable_autograd_graph_is_blamed_only_for_what_nothing_else_explains():
    """A kept tensor whose autograd graph saved tensors that were modified in place since (autograd refuses
    to hand them back) is inferred to pin what is left, but only after library workspaces were looked for: the
    workspace is named as such."""
    w = torch.ones(4, requires_grad=True)
    y = (w * 2).relu()
    kept = [y.clone()]  # its history: ReluBackward, which saved y
    y.add_(1)  # ... modified in place since: autograd will not give it back
    be, san, key, _ = _workspace_pinned(keep_graph_alive=False)
    (pin,) = what_pins(be, [key])
    assert pin.cause == "library_workspace", pin
    assert kept


class DefaultStreamEngine:
    """Captures with raw capture_begin and forgets the side stream: torch refuses it, after opening the RNG's
    capture."""

    def __init__(self, be):
        self.be, self.w, self.g = be, be.randn(8), None

    def capture(self):
        self.g = self.be.new_graph()
        self.g.capture_begin(pool=self.be.graph_pool_handle())  # no `with stream(...)`
        self.y = self.w * 2
        self.g.capture_end()

    def run(self, x):
        return x * self.w

    def release(self):
        self.g = None


class SwallowingEngine(DefaultStreamEngine):
    """Runs eagerly when its capture fails, as engines do: the refusal never reaches the cycle."""

    def capture(self):
        try:
            super().capture()
        except RuntimeError:
            self.g = None


def _default_stream_cycle(engine, sanitized):
    """One cycle in an isolated sim world (the worker's own sanitizer judges another): its record, and what an
    eager random op does after it. Runs in a worker: run_cycle holds the observation layer for life."""
    from cudagraph_lifecycle.cycle import run_cycle

    be = SimBackend()
    san = PoolSanitizer(be).start() if sanitized else None
    try:
        (rec,) = run_cycle(engine, be, 0, test="t")
    finally:
        if san:
            san.stop()
    try:
        random = f"ok {be.randn(2).numel()}"
    except RuntimeError as e:
        random = str(e)
    return rec, random


@pytest.mark.parametrize("engine, sanitized", [(DefaultStreamEngine, False), (DefaultStreamEngine, True),
                                               (SwallowingEngine, False)])
def test_an_engine_capturing_on_the_default_stream(cudagraph_worker, engine, sanitized):
    """Unjudged, torch's refusal poisons random ops: the cycle says so and marks the process poisoned (a worker
    is replaced), also where the engine caught the error and ran eagerly. Under a sanitizer the capture is
    refused first: an error naming the line, the process fine."""
    rec, random = cudagraph_worker.call(_default_stream_cycle, engine, sanitized)
    (p,) = rec["problems"]
    assert rec["verdict"] == "error" and rec["failed"] and p["kind"] == "error"
    assert "side stream" in p["message"] and rec["poisoned"] is not sanitized
    if sanitized:
        assert p["message"].startswith("DefaultStreamCaptureError during capture") and "in capture" in p["message"]
        assert random == "ok 2"
    else:
        assert "every later eager random op" in p["message"] and "CUDAGRAPH_SANITIZE=1" in p["message"]
        assert "test_findings.py" in p["message"] and "in capture" in p["message"]  # the line, as the ledger saw it
        assert "Offset increment" in random
    if engine is SwallowingEngine:
        assert "test_findings.py" in p["message"] and "whose error the engine caught" in p["message"]


class KeptHandleEngine:
    """Keeps its pool id on the class across engines (the seed bug, written by hand)."""

    pool = None

    def __init__(self, be):
        self.be, self.w, self.g = be, be.randn(8), None

    def capture(self):
        be = self.be
        if KeptHandleEngine.pool is None:
            KeptHandleEngine.pool = be.graph_pool_handle()
        g = be.new_graph()
        with be.stream(be.capture_stream(0)):
            g.capture_begin(pool=KeptHandleEngine.pool)
            self.y = self.captured_body()
            g.capture_end()
        self.g = g

    def captured_body(self):
        return self.w * 2

    def run(self, x):
        if self.g is None:
            return self.w * 2  # eager
        self.g.replay()
        return self.y

    def eager(self, x):
        return self.w * 2

    def example_input(self):
        return self.w

    def release(self):
        if self.g is not None:
            self.g.reset()
        self.g = self.y = None


class LazyKeptHandleEngine:
    """Captures at its first run (no capture step, as engines that graph each batch size at first use), into
    a pool id kept on the class across engines."""

    def __init__(self, be):
        self.inner = KeptHandleEngine(be)

    def run(self, x):
        if self.inner.g is None:
            self.inner.capture()
        return self.inner.run(x)

    def eager(self, x):
        return self.inner.eager(x)

    def example_input(self):
        return self.inner.example_input()

    def release(self):
        self.inner.release()


class KeptHandleCatching(KeptHandleEngine):
    """Runs eagerly when its capture fails (it catches the error), as servers do: a kept handle's stale
    capture never reaches the cycle."""

    def capture(self):
        try:
            super().capture()
        except RuntimeError:
            self.g = None


class KeptHandleWrapping(KeptHandleEngine):
    """Wraps the capture's error in its own, as servers and compilers do."""

    def capture(self):
        try:
            super().capture()
        except RuntimeError as e:
            raise RuntimeError("the engine could not capture its graphs") from e


def _kept_handle_cycles(engine, sanitized=True):
    """Two cycles of ``engine`` in an isolated sim world, the caller holding the first engine's output."""
    from cudagraph_lifecycle.cycle import run_cycle

    KeptHandleEngine.pool = None
    be = SimBackend()
    san = PoolSanitizer(be).start() if sanitized else None
    try:
        return run_cycle(engine, be, 0, test="t") + run_cycle(engine, be, 1, test="t")
    finally:
        if san:
            san.stop()


@pytest.mark.parametrize("sanitized", [True, False])
def test_a_stale_capture_the_engine_wrapped_in_its_own_error_is_stale(cudagraph_worker, sanitized):
    last = cudagraph_worker.call(_kept_handle_cycles, KeptHandleWrapping, sanitized)[-1]
    assert last["verdict"] == "stale" and last["poisoned"] is not sanitized, last
    (p,) = last["problems"]
    assert "(raised as RuntimeError: the engine could not capture its graphs)" in p["message"], p
    assert p["message"].startswith("StalePoolError: " if sanitized else "the allocator asserted during capture")
    if not sanitized:  # torch's words without its plea to report a bug, and the fix
        assert "please report a bug" not in p["message"] and "Mint a fresh pool per engine" in p["message"], p


@pytest.mark.parametrize("sanitized", [True, False])
def test_a_lazy_engine_captures_while_the_caller_still_holds_the_previous_output(cudagraph_worker, sanitized):
    """The caller holds the previous output until this engine has captured, and a lazy engine captures at its
    first run: the kept id's pool is still pinned then, so the second engine is stale, not latent reuse."""
    recs = cudagraph_worker.call(_kept_handle_cycles, LazyKeptHandleEngine, sanitized)
    # a stale capture ends judging in every mode alike (cycle.ends_here); the held engine's record comes back
    # with it, made final from what pinned the pool as the stale capture came: the held output alone
    final = {r["index"]: r for r in recs}
    assert [(i, r["verdict"]) for i, r in final.items()] == [(0, "held"), (1, "stale")], recs
    assert not final[0]["problems"], final[0]["problems"]
    assert recs[-1]["poisoned"] is not sanitized and recs[-1]["failed"], recs[-1]
    if sanitized:
        assert "held as the previous engine's output" in recs[-1]["problems"][0]["message"], recs[-1]


def test_a_stale_pool_error_in_a_cycle_names_the_callers_held_output(cudagraph_worker):
    """What pins the dead pool is the output the caller holds (output="hold"), said in those words."""
    last = cudagraph_worker.call(_kept_handle_cycles, KeptHandleEngine)[-1]
    assert last["verdict"] == "stale", last
    p = last["problems"][0]
    assert "held as the previous engine's output, which the caller holds until the next engine has captured" in \
        p["message"]
    # the same facts as data, for a gate that reads the report: what pins the pool, its bytes, the stacks
    (pin,) = p["pins"]
    assert pin["cause"] == "python_reference" and pin["bytes"] == 512 and "previous engine's output" in pin["holder"]
    assert p["bytes"] == 2 << 20, p  # the dead pool's segment, still reserved
    assert [s.splitlines()[0] for s in p["stacks"]] == [
        "--- the capture began at ---", "--- pool minted at ---", "--- its last graph was released at ---"], p
    assert "test_findings.py" in p["stacks"][0], p
    # the lines a gate annotates: the capture into the dead pool, and where its kept id was minted
    assert [x.rsplit(" in ", 1)[1] for x in p["sites"]] == ["capture", "capture"], p["sites"]
    assert [int(x.rsplit(" in ", 1)[0].rsplit(":", 1)[1]) for x in p["sites"]] == [
        _line_of(KeptHandleEngine.capture, "g.capture_begin("), _line_of(KeptHandleEngine.capture, "be.graph_pool_handle()")]


def _line_of(fn, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, ln in enumerate(lines) if text in ln)


@pytest.mark.parametrize("sanitized", [True, False])
def test_a_stale_capture_the_engine_caught_is_still_stale(cudagraph_worker, sanitized):
    """The engine catches the error and runs eagerly: the cycle is stale all the same, naming the line that
    tried and what pinned the pool; without a sanitizer the allocator asserted, so the process is poisoned."""
    recs = cudagraph_worker.call(_kept_handle_cycles, KeptHandleCatching, sanitized)
    last = recs[-1]
    assert last["index"] == 1 and last["verdict"] == "stale" and last["poisoned"] is not sanitized, last
    (p,) = [p for p in last["problems"] if p["kind"] == "stale"]
    assert "whose error the engine caught" in p["message"] and "test_findings.py" in p["message"]
    assert ("sanitizer refused it" in p["message"]) is sanitized and "[engine 0]" in p["message"]
    # what pinned the pool is read as the capture came, before the allocator ran it: named in every mode
    pinned = "the pool was pinned: 512 bytes pinned by a tensor (8,) float32 held as the previous engine's output, " \
        "which the caller holds"
    assert pinned in p["message"], p["message"]
    assert len(p["stacks"]) == 3 and "test_findings.py" in p["stacks"][0], p
    assert len(p["sites"]) == 2 and p["sites"][1].endswith("in capture"), p  # the capture; the id's mint
    assert [(x["cause"], x["bytes"]) for x in p["pins"]] == [("python_reference", 512)], p  # as data too
    assert p["bytes"] == 2 << 20, p


class MemPoolOnTheClass(KeptHandleEngine):
    """Keeps one MemPool on the class across engines (a model server's reload keeps it): after release its
    pool keeps its segments reserved, with every block free."""

    POOL = None

    def __init__(self, be):
        super().__init__(be)
        if MemPoolOnTheClass.POOL is None:
            MemPoolOnTheClass.POOL = be.mempool(0)

    def capture(self):
        self.g = self.be.new_graph()
        with self.be.graph(self.g, pool=MemPoolOnTheClass.POOL.id):
            self.y = self.w * 2


def _mempool_on_the_class_cycle(output):
    from cudagraph_lifecycle.cycle import run_cycle

    MemPoolOnTheClass.POOL = None
    return run_cycle(MemPoolOnTheClass, SimBackend(), 0, output=output, test="t")


@pytest.mark.parametrize("output", ["drop", "hold"])
def test_a_mempool_kept_on_a_class_is_named_as_what_keeps_the_pool(cudagraph_worker, output):
    """Every block of the pool is free (or only the held output's), so no tensor pins it: its MemPool object
    does, and who holds that is named (in a reused worker, whose start-up heap is frozen, as in a plain
    process). Leaked at once, held output or not: the next engine would capture into the same pool."""
    (rec,) = cudagraph_worker.call(_mempool_on_the_class_cycle, output)
    assert rec["verdict"] == "leaked", rec
    (p,) = [p for p in rec["problems"] if p["kind"] == "leaked"]
    assert "MemPool object is alive, held as class attribute `POOL` of MemPoolOnTheClass" in p["message"], p
    assert "a tensor allocated in its captures" not in p["message"]


def test_a_mempool_kept_on_a_class_is_named_in_a_finding():
    be = SimBackend()
    with PoolSanitizer(be) as san:
        MemPoolOnTheClass.POOL = None
        eng = MemPoolOnTheClass(be)
        eng.capture()
        eng.release()
        (f,) = san.findings()
        assert f.kind == "pool_never_retired" and "class attribute `POOL` of MemPoolOnTheClass" in f.message, f
    MemPoolOnTheClass.POOL = None


def _under_the_workers_sanitizer(engine, strict=False):
    from cudagraph_lifecycle.cycle import run_cycle

    return run_cycle(engine, "sim", 0, test="t", strict=strict)


def test_a_refused_capture_that_reached_the_cycle_is_one_problem(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_under_the_workers_sanitizer, DefaultStreamEngine)
    assert [p["kind"] for p in rec["problems"]] == ["error"] and not rec["poisoned"]
    assert rec["problems"][0]["message"].startswith("DefaultStreamCaptureError during capture")


@pytest.mark.parametrize("strict", [False, True])
def test_a_refused_capture_the_engine_caught_is_in_its_cycle(cudagraph_worker, strict):
    """Under the worker's sanitizer the refusal never poisons, and the engine runs eagerly: the cycle still
    carries the finding (the worker's own findings leave an engine's to its record), and fails in every mode:
    without the sanitizer the same engine poisons its process."""
    (rec,) = cudagraph_worker.call(_under_the_workers_sanitizer, SwallowingEngine, strict)
    (p,) = rec["problems"]
    assert p["kind"] == "error" and p["message"].startswith("default_stream_capture, whose error the engine caught")
    assert "refused before torch ran it" in p["message"] and "in capture" in p["message"] and not rec["poisoned"]
    assert rec["failed"] and rec["verdict"] == "error"
    assert [f["kind"] for f in rec["sanitizer"]] == ["default_stream_capture"]


FALLS_BACK_TO_EAGER = """
import pytest
from cudagraph_lifecycle import get_backend


def try_to_capture(be, g):
    g.capture_begin()  # no side stream


@pytest.mark.cudagraph
def test_engine_falls_back_to_eager():
    be = get_backend("sim")
    try:
        try_to_capture(be, be.new_graph())
    except RuntimeError:
        pass  # an engine that runs eagerly when a capture fails: the error never reaches the test
    assert be.randn(4).numel() == 4
"""


def test_a_refused_capture_that_failed_its_test_is_not_failed_again_at_teardown(pytester):
    pytester.makepyfile(test_raw="""
import pytest
from cudagraph_lifecycle import get_backend


@pytest.mark.cudagraph
def test_raw():
    get_backend("sim").new_graph().capture_begin()
""")
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        "--cudagraph-sanitize=strict")
    res.assert_outcomes(failed=1)  # once: the refusal; its finding is reported, not a second failure
    res.stdout.fnmatch_lines(["*test_raw: default_stream_capture: device 0*"])


@pytest.mark.parametrize("mode, outcome", [("on", {"passed": 1}), ("strict", {"passed": 1, "errors": 1})])
def test_a_swallowed_default_stream_capture_is_still_a_finding(pytester, mode, outcome):
    """An engine that catches the capture's error and runs eagerly hides it from the test: the finding still
    names the test and the line, and fails it under strict (in a marked test the catch may be the test's own
    `pytest.raises`; an engine cycle, where it cannot be, fails in every mode)."""
    pytester.makepyfile(test_eager=FALLS_BACK_TO_EAGER)
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        f"--cudagraph-sanitize={mode}", f"--cudagraph-report={report}")
    res.assert_outcomes(**outcome)
    (t,) = json.loads(report.read_text())["tests"]
    (f,) = t["sanitizer"]
    assert f["kind"] == "default_stream_capture" and f["tests"] == ["test_eager.py::test_engine_falls_back_to_eager"]
    assert f["pool_id"] is None  # it had none: not torch's (0, 0)
    assert f["sites"][0].endswith("test_eager.py:6 in try_to_capture") and "refused before torch ran it" in f["message"]
    message = "*a capture began on the default stream of device 0 at *test_eager.py:6 in try_to_capture: refused*"
    headline = "test_eager.py::test_engine_falls_back_to_eager: default_stream_capture: device 0"
    if mode == "on":
        res.stdout.fnmatch_lines([headline, message])
    else:  # the test's error shows it whole (the test made it: no "made by"), the section in one line
        res.stdout.fnmatch_lines(["- default_stream_capture: device 0", message, headline,
                                  "    failed the test: its error above shows the whole finding"])
    assert "    began at " not in res.stdout.str()  # named once, in the message


CAUGHT_STALE = """
import pytest
from cudagraph_lifecycle import StalePoolError, get_backend
from cudagraph_lifecycle.conformance import Ctx

KEPT = []


@pytest.mark.cudagraph
def test_a_reload_that_catches_the_stale_capture():
    be = get_backend("sim")
    c, h = Ctx(be), be.graph_pool_handle()
    g = be.new_graph()
    KEPT.append(c.step(g, h))
    g.reset()
    try:
        c.step(be.new_graph(), h)
    except StalePoolError:
        pass  # falls back to eager
"""


@pytest.mark.parametrize("mode, outcome", [("on", {"passed": 1}), ("strict", {"passed": 1, "errors": 1})])
def test_a_caught_stale_capture_in_a_marked_test_is_a_finding(pytester, mode, outcome):
    """The engine's fallback (or the test's own pytest.raises) hides the refusal: the stale_capture finding
    names it, with its line, and fails the test under strict."""
    pytester.makepyfile(test_caught=CAUGHT_STALE)
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        f"--cudagraph-sanitize={mode}")
    res.assert_outcomes(**outcome)
    headline = "test_caught.py::test_a_reload_that_catches_the_stale_capture: stale_capture: pool (0, 1) on device 0"
    message = "*a capture into pool (0, 1) * at *test_caught.py:16 in test_a_reload_that_catches*"
    if mode == "on":
        res.stdout.fnmatch_lines([headline, message])
    else:  # the test's error shows it whole, the section in one line
        res.stdout.fnmatch_lines(["- stale_capture: pool (0, 1) on device 0", message, headline,
                                  "    failed the test: its error above shows the whole finding"])


def test_a_stale_pool_error_in_a_test_shows_no_frame_of_the_sanitizer(pytester):
    """The judge's frames (the capture wrapper, the sanitizer) are left out: the failure ends at the user's
    capture."""
    pytester.makepyfile(test_stale="""
from cudagraph_lifecycle import PoolSanitizer
from cudagraph_lifecycle.backends.sim import SimBackend


def test_stale():
    be = SimBackend()
    x = be.randn(16)
    with PoolSanitizer(be):
        h, g = be.graph_pool_handle(), be.new_graph()
        with be.stream(be.new_stream()):
            g.capture_begin(pool=h)
            y = x * 2
            g.capture_end()
        g.reset()
        with be.stream(be.new_stream()):
            be.new_graph().capture_begin(pool=h)
""")
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--tb=long")
    res.assert_outcomes(failed=1)
    out = res.stdout.str()
    assert "StalePoolError: capture into stale pool" in out and "be.new_graph().capture_begin(pool=h)" in out
    assert "def _judge" not in out and "def wrapper" not in out and "def judge" not in out, out


POISONING_TESTS = """
import pytest
from cudagraph_lifecycle import get_backend


def test_a_forgets_the_side_stream():
    get_backend("sim").new_graph().capture_begin()


def test_b_draws_random_numbers():
    get_backend("sim").randn(4)


@pytest.mark.cudagraph
def test_c_refused_by_the_sanitizer():
    get_backend("sim").new_graph().capture_begin()


def test_d_only_mentions_it():
    assert "captured on a non-default stream" == "Offset increment outside graph capture"
"""


def test_a_poisoned_process_failure_says_what_poisons_it_and_how_to_have_it_refused(pytester):
    """Unmarked tests are not watched: torch's refusal poisons the process, and the tests that fail for it say
    why, instead of leaving 'Offset increment outside graph capture' to the user. Not where the sanitizer
    refused it, nor where the words are only in a test's source."""
    pytester.makepyfile(test_poison=POISONING_TESTS)
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        "--show-capture=no")
    res.assert_outcomes(failed=4)
    res.stdout.fnmatch_lines([
        "*test_a_forgets_the_side_stream*", "*- cudagraph -*",
        "torch refused a capture on the default stream after opening the CUDA RNG's capture: from now on every "
        "eager random op of this process fails, in later tests too. Capture on a side stream*",
        "*test_b_draws_random_numbers*", "*- cudagraph -*",
        "this process's eager CUDA random ops were poisoned by a capture on the default stream (newest first): "
        "test_poison.py::test_a_forgets_the_side_stream at *test_poison.py:6 in test_a_forgets_the_side_stream."
        "*CUDAGRAPH_SANITIZE=1*",
        "*test_c_refused_by_the_sanitizer*", "*DefaultStreamCaptureError*"], consecutive=False)
    assert res.stdout.str().count("- cudagraph -") == 2, res.stdout.str()


def _poison_the_process_sim_world_watched():
    """In a worker (it poisons the process's sim world): a refusal the ledger saw, then the note."""
    from cudagraph_lifecycle import get_backend, observe
    from cudagraph_lifecycle.ledger import ledger
    from cudagraph_lifecycle.sanitizer import global_sanitizer
    from pytest_cudagraph.terminal import poison_note

    global_sanitizer().stop()  # the worker's own sanitizer would refuse it
    be = get_backend("sim")
    observe.acquire()  # watched, not judged
    ledger.test = "test_x.py::test_forgets"
    try:
        be.new_graph().capture_begin()
    except RuntimeError:
        pass
    finally:
        ledger.test = None
    SimBackend().new_graph()  # an isolated world's events are not this process's: none here, and none named
    try:
        be.randn(2)
    except RuntimeError as e:
        return poison_note(e)


def test_the_poison_note_names_the_test_and_line_the_ledger_saw(cudagraph_worker):
    note = cudagraph_worker.call(_poison_the_process_sim_world_watched)
    assert "poisoned by a capture on the default stream (newest first): test_x.py::test_forgets at " in note
    assert "in _poison_the_process_sim_world_watched" in note and note.count(" at ") == 1


def _assert_in_the_process_sim_world_watched():
    """In a worker: a kept handle's capture that the allocator asserts on (watched, not judged), the note for
    that failure, then the note for a random op after it."""
    from cudagraph_lifecycle import get_backend, observe
    from cudagraph_lifecycle.conformance import Ctx
    from cudagraph_lifecycle.ledger import ledger
    from cudagraph_lifecycle.sanitizer import global_sanitizer
    from pytest_cudagraph.terminal import poison_note

    global_sanitizer().stop()  # the worker's own sanitizer would refuse it
    be = get_backend("sim")
    observe.acquire()
    c, h = Ctx(be), be.graph_pool_handle()
    g = be.new_graph()
    kept = c.step(g, h)  # noqa: F841 - pins the pool
    g.reset()
    ledger.test = "test_x.py::test_keeps_a_handle"
    try:
        c.step(be.new_graph(), h)
    except RuntimeError as e:
        at_the_assert = poison_note(e)
    finally:
        ledger.test = None
    try:
        be.randn(2)
    except RuntimeError as e:
        return at_the_assert, poison_note(e)
    return at_the_assert, "random ops were not poisoned"


def test_the_poison_note_names_the_allocators_assert_the_ledger_saw(cudagraph_worker):
    at_the_assert, later = cudagraph_worker.call(_assert_in_the_process_sim_world_watched)
    assert at_the_assert.startswith("the caching allocator asserted on a capture into a released pool")
    assert "Mint a fresh pool per engine" in at_the_assert
    assert ("poisoned by the allocator's `use_count > 0` assert on a capture into a released pool (newest first): "
            "test_x.py::test_keeps_a_handle at ") in later
    assert "in _assert_in_the_process_sim_world_watched" in later


def test_no_poison_note_for_what_the_sanitizer_stopped_or_another_error():
    from cudagraph_lifecycle import DefaultStreamCaptureError, StalePoolError
    from pytest_cudagraph.terminal import poison_note

    assert poison_note(DefaultStreamCaptureError("... captured on a non-default stream ... Offset increment")) is None
    assert poison_note(StalePoolError("... would poison the process")) is None
    assert poison_note(AssertionError("1 != 2")) is None
    wrapped = RuntimeError("the engine failed")
    wrapped.__cause__ = RuntimeError("CUDA graphs must be captured on a non-default stream.")
    assert poison_note(wrapped).startswith("torch refused a capture on the default stream")


class CudaItself:
    """Written against torch.cuda, not the backend it is given: on a CPU run it cannot build."""

    def __init__(self, be):
        self.w = torch.ones(4, device="cuda")

    def run(self, x):
        return x

    def release(self):
        pass


def _cycle_of(factory):
    from cudagraph_lifecycle.cycle import run_cycle

    return run_cycle(factory, SimBackend(), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine builds where CUDA is")
def test_an_engine_using_cuda_itself_on_a_cpu_run_says_how_to_skip_it(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_cycle_of, CudaItself)
    (p,) = rec["problems"]
    assert rec["verdict"] == "error" and "during build" in p["message"]
    assert "this run has no GPU (backend sim): mark its test @pytest.mark.gpu" in p["message"]


THROUGH_A_CONTEXT_MANAGER = """
import contextlib

import pytest
from cudagraph_lifecycle import get_backend

KEPT = []


@contextlib.contextmanager
def captured(be, g, pool):
    with be.graph(g, pool=pool, stream=be.capture_stream(0)):
        yield


@pytest.mark.cudagraph
def test_an_output_kept_in_a_global():
    be = get_backend("sim")
    x = be.randn(16, device=0)
    g = be.new_graph()
    with captured(be, g, be.graph_pool_handle()):
        KEPT.append(x * 2)
    g.reset()
    be.empty_cache()
"""


def test_a_findings_stack_shows_the_users_frames_not_contextlibs(pytester):
    """A capture made through a contextlib.contextmanager helper: the sanitizer section shows the helper's line
    and the test's, not contextlib's nor torch's frames between them."""
    pytester.makepyfile(test_cm=THROUGH_A_CONTEXT_MANAGER)
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim")
    out = res.stdout.str()
    section = out[out.index("cudagraph sanitizer"):]
    assert "pinned_pool" in section and "in captured" in section and "in test_an_output_kept_in_a_global" in section, out
    assert "contextlib.py" not in section, section
    # without allocation history, the pool's first capture stack, outermost first, to the test's line
    res.stdout.fnmatch_lines(["*--- the pool's first capture began at ---", "*test_cm.py*line 20*",
                              "*with captured(be, g, be.graph_pool_handle()):", "*test_cm.py*line 11, in captured",
                              "*with be.graph(g, pool=pool, stream=be.capture_stream(0)):"])


def test_the_innermost_user_frames_leave_out_torch_and_the_standard_library():
    import contextlib as cl

    from cudagraph_lifecycle.ledger import innermost_user_frames

    def frame(path, line, fn):
        return f'  File "{path}", line {line}, in {fn}\n    code_{fn}()\n'

    text = (frame("/app/test_x.py", 3, "test_x") + frame(cl.__file__, 137, "__enter__")
            + frame("/app/engine.py", 9, "captured") + frame(torch.cuda.graphs.__file__, 200, "__enter__"))
    kept = innermost_user_frames(text, 3)
    assert kept == ['  File "/app/test_x.py", line 3, in test_x', "    code_test_x()",
                    '  File "/app/engine.py", line 9, in captured', "    code_captured()"]
    assert innermost_user_frames(text, 1) == kept[2:]
    only_torch = frame(torch.cuda.graphs.__file__, 200, "__enter__")
    assert innermost_user_frames(only_torch, 3) == only_torch.rstrip().splitlines()  # all where none is the user's
    # an allocation stack as the cuda backend shows it: one line a frame, innermost first
    history = f"  {torch.cuda.graphs.__file__}:200 in __enter__\n  /app/engine.py:9 in captured\n" \
              "  /app/test_x.py:3 in test_x\n"
    assert innermost_user_frames(history, 3) == ["  /app/engine.py:9 in captured", "  /app/test_x.py:3 in test_x"]
    assert innermost_user_frames("no frame here\nat all", 1) == ["no frame here", "at all"]


class LoggingEngine(KeptHandleEngine):
    """A capture whose error the engine logs with its traceback and then runs eagerly: a log record that
    kept the traceback would keep the frame's locals, a tensor of the pool among them."""

    def capture(self):
        import logging

        be = self.be
        g = be.new_graph()
        try:
            with be.stream(be.capture_stream(0)):
                g.capture_begin(pool=be.graph_pool_handle())
                try:
                    y = self.w * 2  # noqa: F841 (a local of this frame, in the pool)
                    raise RuntimeError("an op the engine cannot capture")
                finally:
                    g.capture_end()
        except RuntimeError:
            logging.getLogger("an_engine").exception("capture failed; running eagerly")
        self.g = None


def _logging_engine_cycles():
    import logging

    from cudagraph_lifecycle.cycle import run_cycle

    be = SimBackend()
    handlers = [f"{type(h).__module__}.{type(h).__name__}" for lg in [logging.getLogger()] for h in lg.handlers]
    return handlers, run_cycle(LoggingEngine, be, 0, test="t", output="drop")


def test_a_worker_keeps_no_log_record_of_an_engines_caught_error(cudagraph_worker):
    """pytest's log-capture handlers, inherited by a forked worker, kept every record: the traceback of an
    engine's logged error kept its frame's tensors, and the pool read as pinned by a local variable."""
    handlers, (rec,) = cudagraph_worker.call(_logging_engine_cycles)
    # what keeps records goes; pytest's --log-file handler (it only writes) stays
    assert not [h for h in handlers if h.startswith("_pytest.") and not h.endswith("._FileHandler")], handlers
    assert rec["verdict"] == "fresh", rec
    assert not [p for p in rec["problems"] if "local variable" in p["message"]], rec["problems"]


@pytest.mark.parametrize("own_pool", [True, False], ids=["pool given", "no pool given"])
def test_a_capture_a_host_sync_broke_whose_error_the_engine_caught_is_an_error(cudagraph_worker, own_pool):
    """The engine branches on a tensor's value inside its capture, catches the capture's error and runs
    eagerly: the cycle is an error (the pool's references are never given back, the RNG is poisoned: the
    worker is replaced), naming the line that began the capture and the fix. It read `leaked`, with "something
    else pins them" (and `fresh` where the capture named no pool)."""
    from gpu_cases import host_sync_engine_that_catches

    r = cudagraph_worker.call(host_sync_engine_that_catches, "sim", own_pool)
    cudagraph_worker.restart_before_next_call()
    assert r["verdict"] == "error" and r["poisoned"], r
    text = r["message"]
    into = " into pool (0, 1)" if own_pool else ""
    assert text.startswith(f"the engine caught the error and went on without that graph (eagerly): a capture{into} "
                           "began at ") and "gpu_cases.py" in text and "in capture" in text, text
    assert "failed when it ended" in text and "Move what broke the capture out of the captured code" in text
    assert "contextlib.py" not in text, text  # the `with` statement's own frame is no place for the fix
    # sim refuses the host sync at the op, as CUDA does: the line that broke the capture is named too
    assert "; inside it " in text and "gpu_cases.py" in text.split("; inside it ")[1].split(":")[0] \
        and " in forward: RuntimeError: " in text, text


def test_a_caught_stale_capture_under_the_sanitizer_is_two_findings_on_sim(cudagraph_worker):
    """The GPU test's case on sim (the same expectation on both backends): the second engine's capture into
    the kept pool is refused and is a stale_capture finding; the first engine's output still pins that pool,
    a pinned_pool finding. Both name the engine's capture line."""
    from gpu_cases import naive_engine_that_catches

    r = cudagraph_worker.call(naive_engine_that_catches, True, "sim")
    assert r["first"] == "held" and r["second"] == "stale" and not r["poisoned"] and r["refused"], r
    assert [k for k, _ in r["findings"]] == ["stale_capture", "pinned_pool"], r["findings"]
    assert all("engines.py" in sites[0] for _, sites in r["findings"]), r["findings"]


class OwnPoolEngine(KeptHandleEngine):
    """A pool of its own per engine (what the engines below do wrong is elsewhere)."""

    def captured(self):
        be = self.be
        g = be.new_graph()
        with be.stream(be.capture_stream(0)):
            g.capture_begin(pool=be.graph_pool_handle())
            self.y = self.w * 2
            g.capture_end()
        return g


class EndsTwice(OwnPoolEngine):
    """Ends its capture, then ends it again in a cleanup path and ignores that error: a capture that ended
    well is no failed capture."""

    def capture(self):
        self.g = self.captured()
        try:
            self.g.capture_end()
        except RuntimeError:
            pass


def test_a_second_capture_end_is_no_failed_capture(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_cycles_of, EndsTwice, 1, "drop")
    assert rec["verdict"] == "fresh" and not rec["poisoned"], rec


GRAPH_CACHE = {}


class CachedGraphEngine(OwnPoolEngine):
    """Keeps its graph in a module-level cache, never cleared (vLLM-style): never reset."""

    def capture(self):
        self.g = GRAPH_CACHE[len(GRAPH_CACHE)] = self.captured()

    def release(self):
        self.g = self.y = None


def _cycles_of(engine, n, output):
    from cudagraph_lifecycle.cycle import run_cycle

    KeptHandleEngine.pool = None
    be = SimBackend()
    try:
        return [r for i in range(n) for r in run_cycle(engine, be, i, test="t", output=output)]
    finally:
        GRAPH_CACHE.clear()


@pytest.mark.usefixtures("heap")
def test_the_holders_of_one_cause_share_its_fix_once():
    from cudagraph_lifecycle.sanitizer.pins import FIXES, Pin, describe

    fix = FIXES["python_reference"]
    text = describe([Pin("python_reference", 4096, "key `8` of a dict", fix),
                     Pin("python_reference", 1024, "key `4` of a dict", fix),
                     Pin("unknown", 512, "a holder the garbage collector does not see", FIXES["unknown"])])
    assert text.count(fix) == 1 and text.startswith(
        "4 KiB (4096 bytes) pinned by key `8` of a dict, 1 KiB (1024 bytes) pinned by key `4` of a dict "
        "(python_reference): drop that reference"), text
    assert text.endswith(f"; 512 bytes pinned by a holder the garbage collector does not see (unknown): {FIXES['unknown']}")


def test_leaked_reused_and_unreset_graphs_name_the_lines_that_captured(cudagraph_worker):
    """Each problem says where the user's code captured into the pool (and for a kept id, where it was
    minted), not only in the JSON's stacks."""
    reused = cudagraph_worker.call(_cycles_of, KeptHandleEngine, 2, "drop")[-1]
    (p,) = [p for p in reused["problems"] if p["kind"] == "reused"]
    assert "(captured at " in p["message"] and "test_findings.py" in p["message"] and "in capture)" in p["message"]
    assert ", its id minted at " in p["message"] and "Mint a fresh pool per engine" in p["message"], p
    cached = cudagraph_worker.call(_cycles_of, CachedGraphEngine, 1, "drop")[0]
    kinds = {p["kind"]: p["message"] for p in cached["problems"]}
    assert "1 graph(s) captured by this engine (at " in kinds["graphs_not_reset"], kinds
    assert "global `GRAPH_CACHE`" in kinds["graphs_not_reset"], kinds
    assert "release_incomplete" not in kinds, kinds  # the same graphs: said once, as never reset
    assert "(captured at " in kinds["leaked"] and "in capture" in kinds["leaked"], kinds


@dataclasses.dataclass
class DecodeOutput:
    logits: torch.Tensor


class DataclassOutputEngine(OwnPoolEngine):
    """Returns its static output in a dataclass, as generate-style engines do. ``stale_input``: its replay
    reads a buffer it replaced after the capture, so replay and eager differ."""

    stale_input = False

    def capture(self):
        self.g = self.captured()
        if self.stale_input:
            self.w = self.be.randn(8)  # "resized" after the capture: the graph still reads the old one

    def run(self, x):
        self.g.replay()
        return DecodeOutput(self.y)

    def eager(self, x):
        return DecodeOutput(self.w * 2)

    def release(self):
        self.g.reset()
        self.g = self.y = None


class Opaque:
    def __init__(self, t):
        self.t = t


class StaleInputDataclassEngine(DataclassOutputEngine):
    stale_input = True


def test_a_dataclass_output_is_compared_with_eager_and_copied_by_a_dropping_caller(cudagraph_worker):
    """Its tensors are compared (a replay that reads a replaced buffer differs), and a caller that copies
    results out copies them: the engine is fresh, not blamed for the caller's own copy."""
    (rec,) = cudagraph_worker.call(_cycles_of, DataclassOutputEngine, 1, "drop")
    assert rec["verdict"] == "fresh" and not rec["problems"], rec
    (rec,) = cudagraph_worker.call(_cycles_of, StaleInputDataclassEngine, 1, "drop")
    assert [p["kind"] for p in rec["problems"]] == ["replay_mismatch"], rec


class TakesNoBackend:
    def __init__(self):  # the engine's class handed over as the factory: it is called as factory(backend)
        raise AssertionError("never built")


def raises_type_error(backend):  # a TypeError inside a factory that takes the backend is the engine's own
    raise TypeError("bad dtype")


def test_a_factory_that_cannot_take_the_backend_is_a_usage_error_that_says_how_it_is_called(cudagraph_worker):
    from pytest_cudagraph import RemoteError

    with pytest.raises(RemoteError, match=r"^ConfigError: the engine factory TakesNoBackend cannot be called as "
                                          r"factory\(backend\) "
                                          r"\(too many positional arguments\): give it one parameter for the backend"):
        cudagraph_worker.call(_cycles_of, TakesNoBackend, 1, "drop")
    (rec,) = cudagraph_worker.call(_cycles_of, raises_type_error, 1, "drop")
    assert rec["verdict"] == "error" and "bad dtype" in rec["problems"][0]["message"], rec


def test_an_output_the_comparison_cannot_see_into_is_a_usage_error():
    from cudagraph_lifecycle.cycle.steps import max_abs_err
    from cudagraph_lifecycle.errors import ConfigError

    with pytest.raises(ConfigError, match=r"no tensor the replay-versus-eager comparison can reach \(inside a Opaque\)"):
        max_abs_err(Opaque(torch.ones(2)), Opaque(torch.zeros(2)))
    assert max_abs_err(("a", 1), ("a", 1)) == 0.0  # plain values only: nothing hidden
    jagged = [torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged) for _ in (0, 1)]
    with pytest.raises(ConfigError, match=r"the replay-versus-eager comparison cannot subtract these outputs \("):
        max_abs_err(jagged[0], jagged[1])  # the harness's subtraction, not the engine's run, failed
    with pytest.raises(ConfigError, match=r"^run\(x\) returned 0 tensor\(s\) \(float\), eager\(x\) 1 \(Tensor\): "
                                          r"they must return the same tensors"):
        max_abs_err(0.5, torch.ones(2))  # a run(x) that returns a number: say what it returned


class ReleaseRaises(OwnPoolEngine):
    def capture(self):
        self.graphs = {1: self.captured(), 2: self.captured()}

    def release(self):
        for k in self.graphs:  # changes the dict it walks: raises after the first reset
            self.graphs.pop(k).reset()


def test_an_engine_error_names_the_line_that_raised_it(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_cycles_of, ReleaseRaises, 1, "drop")
    err = next(p for p in rec["problems"] if p["kind"] == "error")
    line = next(i for i, s in enumerate(open(__file__), 1) if "self.graphs.pop(k).reset()" in s) - 1
    assert err["message"] == (f"RuntimeError during release at {__file__}:{line} in release: dictionary changed "
                              "size during iteration"), err
    assert err["sites"] == [f"{__file__}:{line} in release"], err  # for a gate to annotate the line
    (stack,) = err["stacks"]
    assert stack.startswith("--- the engine's traceback ---") and "for k in self.graphs" in stack, stack
    # the graph release() left is named with who held it then (the engine, through the harness's wrapper)
    left = next(p for p in rec["problems"] if p["kind"] == "release_incomplete")
    assert "held then as key `2` of a dict (attribute `graphs` of a ReleaseRaises object (the engine the factory " \
           "built))" in left["message"], left
    assert left["sites"] and left["sites"][0].endswith("in captured"), left


MODELS = {}


class KeepsOtherOutputs(OwnPoolEngine):
    """Two graphs in one pool; a module-level model cache keeps both static outputs after release, and the
    caller holds the one `run` returned: the other is pinned whatever the caller does."""

    def capture(self):
        be, h = self.be, self.be.graph_pool_handle()
        self.graphs, outs = [], []
        for scale in (2, 3):
            g = be.new_graph()
            with be.stream(be.capture_stream(0)):
                g.capture_begin(pool=h)
                outs.append(self.w * scale)
                g.capture_end()
            self.graphs.append(g)
        MODELS["static_outputs"] = outs

    def run(self, x):
        self.graphs[0].replay()
        return MODELS["static_outputs"][0]

    def eager(self, x):
        return self.w * 2

    def release(self):
        for g in self.graphs:
            g.reset()
        self.graphs = []


class KeepsOnlyTheHeldOutput(KeepsOtherOutputs):
    def release(self):
        super().release()
        MODELS["static_outputs"] = MODELS["static_outputs"][:1]  # only what the caller holds too


def test_blocks_the_held_output_does_not_hold_are_leaked_at_once(cudagraph_worker):
    """hold: the caller's output explains only its own block; the other one, kept by a global cache, is
    leaked now (the next engine might replace that cache and hide it), named without the caller's output."""
    (rec,) = cudagraph_worker.call(_cycles_of, KeepsOtherOutputs, 1, "hold")
    assert rec["verdict"] == "leaked", rec
    (p,) = rec["problems"]
    assert "and not only for the output the caller holds: 512 bytes pinned by a tensor (8,) float32 held as an " \
           "item of a list (key `static_outputs` of a dict (global `MODELS` of module test_findings))" in p["message"]
    assert "the output the caller holds" not in p["message"].split("caller holds: ", 1)[1], p["message"]


def test_an_output_the_caller_holds_alone_is_held(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_cycles_of, KeepsOnlyTheHeldOutput, 1, "hold")
    assert rec["verdict"] == "held" and not rec["problems"], rec


class MisDeclares(OwnPoolEngine):
    """Its pool_ids() names a pool it never captured into, and not the one it did."""

    def capture(self):
        self.g = self.captured()

    def pool_ids(self):
        return [(0, (0, 99))]


def test_a_pool_ids_mismatch_names_the_line_that_captured_into_the_hidden_pool(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_cycles_of, MisDeclares, 1, "drop")
    msgs = [p["message"] for p in rec["problems"] if p["kind"] == "pool_ids_mismatch"]
    assert msgs[0] == "pool_ids() names [(0, (0, 99))], which it did not capture into", msgs
    assert msgs[1].startswith("pool_ids() hides [(0, (0, 1))], which it captured into (captured at ") \
        and "test_findings.py" in msgs[1] and "in captured)" in msgs[1], msgs
    assert rec["verdict"] == "fresh" and not rec["failed"]  # a mismatch fails only under strict


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.mask = h > 0  # kept on the context, not saved for backward: a block of the pool the output keeps
        return h * 3

    @staticmethod
    def backward(ctx, g):
        return g * ctx.mask


class OutputKeepsMore(OwnPoolEngine):
    """Its output keeps more of the pool than its own storage, through the output itself: nothing else pins
    the pool, so it is held (and freed once the caller drops the output), not leaked."""

    variant = "ctx"

    def __init__(self, be):
        super().__init__(be)
        self.w.requires_grad_(self.variant in ("ctx", "in place"))

    def capture(self):
        be = self.be
        self.g = be.new_graph()
        with be.stream(be.capture_stream(0)):
            self.g.capture_begin(pool=be.graph_pool_handle())
            h = self.w * 2
            if self.variant == "ctx":
                self.y = _Scale.apply(h)
            elif self.variant == "in place":
                self.y = h * h  # saves h, then h changes: autograd will not hand it back
                h.mul_(0.5)
            else:
                self.y = h.clone()
                self.y.scratch = h  # an attribute of the output tensor
            self.g.capture_end()

    def run(self, x):
        self.g.replay()
        return self.y

    def eager(self, x):
        return self.y

    def release(self):
        self.g.reset()
        self.g = self.y = None


OUTPUT_KEEPS = {v: type(f"OutputKeeps_{v.replace(' ', '_')}", (OutputKeepsMore,), {"variant": v})
                for v in ("ctx", "in place", "attribute")}
for _cls in OUTPUT_KEEPS.values():
    globals()[_cls.__name__] = _cls  # importable by name in the worker


@pytest.mark.parametrize("variant", list(OUTPUT_KEEPS))
def test_what_the_held_output_keeps_through_itself_is_held_not_leaked(cudagraph_worker, variant):
    recs = cudagraph_worker.call(_cycles_of, OUTPUT_KEEPS[variant], 2, "hold")
    assert {r["verdict"] for r in recs} == {"held"}, [(r["verdict"], r["problems"]) for r in recs]


class KeepsOtherOutputsWithGrad(KeepsOtherOutputs):
    """As KeepsOtherOutputs, captured with autograd on and a saved input changed in place since (autograd will
    not hand it back), and an output with a long token list beside its tensor: the other output, kept by the
    global, is still found at once."""

    def capture(self):
        be, h = self.be, self.be.graph_pool_handle()
        self.w.requires_grad_(True)
        x = be.randn(8)
        self.graphs, outs = [], []
        for scale in (2, 3):
            g = be.new_graph()
            with be.stream(be.capture_stream(0)):
                g.capture_begin(pool=h)
                outs.append(x * self.w * scale)
                g.capture_end()
            self.graphs.append(g)
        x.add_(1)  # the static input refilled: its version moves, so the saved x cannot be read back
        MODELS["static_outputs"] = outs

    def run(self, x):
        self.graphs[0].replay()
        return {"logits": MODELS["static_outputs"][0], "tokens": list(range(30_000))}

    def eager(self, x):
        return {"logits": MODELS["static_outputs"][0], "tokens": list(range(30_000))}


def test_a_block_another_holder_keeps_is_found_at_once_with_autograd_and_a_long_output(cudagraph_worker):
    (rec,) = cudagraph_worker.call(_cycles_of, KeepsOtherOutputsWithGrad, 1, "hold")
    assert rec["verdict"] == "leaked", rec
    (p,) = rec["problems"]
    assert "and not only for the output the caller holds: 512 bytes pinned by a tensor (8,) float32 held as an " \
           "item of a list (key `static_outputs` of a dict (global `MODELS` of module test_findings))" in p["message"]


class _Books:
    """The parts of a CUDA backend that measuring cuBLAS's workspaces reads: the default pool's live blocks,
    streams, and a warm-up whose matmuls leave a 32 MiB and a 1 MiB block on a stream no matmul ran on."""

    def __init__(self):
        from cudagraph_lifecycle.backends.base import Block

        self.Block = Block
        self.live = [Block(4096, address=1)]
        self.warmed: list = []
        self.streams = 0

    def live_blocks(self, pool, device):
        return list(self.live)

    def new_stream(self, device):
        self.streams += 1
        return f"stream {self.streams}"

    def capture_stream(self, device):
        return self.__dict__.setdefault("_capture_streams", {}).setdefault(device, self.new_stream(device))

    def _warm(self, device, streams, backward=False, sync=True):
        self.warmed.append((streams, sync))
        self.live += [self.Block(32 << 20, address=2), self.Block(1 << 20, address=3)]


def _measured(runner_stream: bool = False):
    from cudagraph_lifecycle.backends.workspaces import MeasuredWorkspaces

    class Books(_Books, MeasuredWorkspaces):
        pass

    books = Books()
    if runner_stream:
        books.capture_stream(0)  # a runner captured on the library's stream: its workspace exists already
    return books


def test_cuda_workspaces_are_measured_when_a_pin_is_named_without_a_cycle(monkeypatch):
    """A program-wide sanitizer (no engine cycle, so no prewarm) names a cuBLAS workspace pin: the sizes are
    measured then, once, on a stream no matmul ran on, without a device sync; never while this thread
    captures (the matmuls would join the capture)."""
    from cudagraph_lifecycle.backends.base import Block

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the GPU")
    books = _measured()
    assert "cuBLAS workspace" in books.library_workspace(Block(32 << 20), 0)
    assert books.library_workspace(Block(1 << 20), 0) is not None
    assert books.library_workspace(Block(4096), 0) is None  # a block that was there before
    assert books.warmed == [(["stream 1"], False)] and books.workspace_bytes(0) == 33 << 20
    elsewhere = _measured(runner_stream=True)
    elsewhere.library_workspace(Block(32 << 20), 0)
    assert elsewhere.warmed == [(["stream 2"], False)]  # a new stream, not the library's used one
    capturing[0] = True
    during = _measured()
    assert during.library_workspace(Block(32 << 20), 0) is None and during.warmed == []
    capturing[0] = False
    assert during.library_workspace(Block(32 << 20), 0) is not None  # measured once it can be
