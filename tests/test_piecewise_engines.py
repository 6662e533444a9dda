"""vLLM v1-style piecewise CUDA graphs: the forward is split at attention, every non-attention piece of every
batch size is its own graph, all in ONE pool; piece i's static output is (after the eager attention op, in
place) the static input of piece i+1. Written on the Backend API only, so it runs on ``sim``.

(P1) a pool minted per engine, dropped at release; (P2) vLLM's module-global pool kept across engines;
(P3) a debug cache (module global) keeping a piece's static output; (P4) an eager op whose fresh
default-pool tensor is appended to an engine attribute every run.
"""

import os
from pathlib import Path

import pytest
import torch

HIDDEN = 64
LAYERS = 3  # 3 pieces, 2 eager attention ops between them
BATCH_SIZES = (1, 2, 4, 8)

_GLOBAL_POOL = None  # (P2) vLLM's process-wide graph pool handle
_DEBUG_CACHE: list = []  # (P3) a debug dump of piece outputs, never cleared


def _line(tag: str) -> int:
    """Line number of the line marked ``# <tag>`` in this file (what a site must name)."""
    lines = Path(__file__).read_text().splitlines()
    (n,) = [i for i, text in enumerate(lines, 1) if text.endswith(f"# <{tag}>")]
    return n


class PiecewiseEngine:
    """(P1) The correct one: a fresh pool at capture, every graph reset and the handle dropped at release."""

    def __init__(self, backend):
        self.backend = backend
        self.device = backend.torch_device(0)
        gen = torch.Generator().manual_seed(0)
        # loaded into the default pool before any capture (empty + copy_, as a weight loader does)
        self.weights = [(backend.empty(HIDDEN, HIDDEN).copy_(torch.randn(HIDDEN, HIDDEN, generator=gen) / 8),
                         backend.empty(HIDDEN).copy_(torch.randn(HIDDEN, generator=gen) / 10))
                        for _ in range(LAYERS)]
        self.static_in = backend.empty(max(BATCH_SIZES), HIDDEN).zero_()
        self.stream = backend.new_stream(0)
        self.pool = None
        self.pieces: dict[int, list] = {}  # batch size -> [(graph, static output)] per piece

    @staticmethod
    def piece(h, w, b):
        return torch.relu(torch.addmm(b, h, w))

    def attention(self, h):
        """The eager op between pieces, in place: piece i's static output becomes piece i+1's input.
        Row-wise, so padding rows never reach real rows."""
        h.mul_(torch.softmax(h, dim=-1) * HIDDEN)

    def _mint(self):
        return self.backend.graph_pool_handle()

    def capture(self):
        self.pool = self._mint()
        with torch.no_grad():
            for bs in sorted(BATCH_SIZES, reverse=True):  # largest first, as vLLM does
                h, graphs = self.static_in[:bs], []
                for i, (w, b) in enumerate(self.weights):
                    with self.backend.stream(self.stream):
                        self.piece(h, w, b)  # warm-up outside the capture
                    g = self.backend.new_graph()
                    with self.backend.graph(g, pool=self.pool, stream=self.stream):  # <capture>
                        out = self.piece(h, w, b)
                    graphs.append((g, out))
                    if i < LAYERS - 1:
                        self.attention(out)  # run eagerly between the captures, as vLLM's forward does
                    h = out
                self.pieces[bs] = graphs

    def run(self, x):
        n = x.shape[0]
        bs = next(s for s in BATCH_SIZES if s >= n)
        self.static_in[:n].copy_(x)
        self.static_in[n:bs].zero_()
        graphs = self.pieces[bs]
        for i, (g, out) in enumerate(graphs):
            g.replay()
            if i < LAYERS - 1:
                self.attention(out)
        return graphs[-1][1][:n]

    def eager(self, x):
        with torch.no_grad():
            h = x.clone()
            for i, (w, b) in enumerate(self.weights):
                h = self.piece(h, w, b)
                if i < LAYERS - 1:
                    self.attention(h)
            return h

    def example_input(self):
        return torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1)).to(self.device)

    def release(self):
        for graphs in self.pieces.values():
            for g, _ in graphs:
                g.reset()
        self.pieces.clear()
        self.pool = None


class GlobalPoolPiecewiseEngine(PiecewiseEngine):
    """(P2) vLLM's global graph pool: minted once per process, kept in a module global across engines."""

    def _mint(self):
        global _GLOBAL_POOL
        if _GLOBAL_POOL is None:
            _GLOBAL_POOL = self.backend.graph_pool_handle()  # <mint-global>
        return _GLOBAL_POOL


class DebugCachePiecewiseEngine(PiecewiseEngine):
    """(P3) Keeps piece 0's static output (largest batch) in a module-level debug list, never cleared."""

    def capture(self):
        super().capture()
        _DEBUG_CACHE.append(self.pieces[max(BATCH_SIZES)][0][1])


class GrowingPiecewiseEngine(PiecewiseEngine):
    """(P4) The eager op writes into a fresh default-pool tensor each run and keeps it on the engine (a
    per-run KV log): default-pool growth over the engine's life, its graph pools untouched."""

    def __init__(self, backend):
        super().__init__(backend)
        self.kv_log = []

    def attention(self, h):
        fresh = self.backend.empty(*h.shape)  # outside any capture: the default pool
        torch.mul(h, torch.softmax(h, dim=-1) * HIDDEN, out=fresh)
        self.kv_log.append(fresh)
        h.copy_(fresh)


# the classes are the factories: factory(backend) -> engine
make_p1, make_p2, make_p3, make_p4 = (PiecewiseEngine, GlobalPoolPiecewiseEngine, DebugCachePiecewiseEngine,
                                      GrowingPiecewiseEngine)


def _problems(rec, kind):
    return [p for p in rec["problems"] if p["kind"] == kind]


def _ok(records):
    return all(r["replay_max_abs_err"] is not None and r["replay_max_abs_err"] < 1e-4 for r in records)


@pytest.mark.cudagraph
@pytest.mark.parametrize("output, verdict", [("hold", "held"), ("drop", "fresh")])
def test_p1_per_engine_pool_is_held_or_fresh(engine_sequence, output, verdict):
    records = engine_sequence(make_p1, 3, output=output)
    assert [r["verdict"] for r in records] == [verdict] * 3, [r["problems"] for r in records]
    assert _ok(records) and not any(r["problems"] for r in records)
    # one pool per engine holds all 3 pieces x 4 batch sizes, and no engine reuses another's
    assert [r["graphs"] for r in records] == [LAYERS * len(BATCH_SIZES)] * 3
    assert len({tuple(p[1]) for r in records for p in r["pool_ids"]}) == 3
    assert all(len(r["pool_ids"]) == 1 for r in records)
    if output == "hold":
        assert all(r["held_bytes"] > 0 and r["leaked_bytes"] == 0 for r in records)


@pytest.mark.cudagraph
@pytest.mark.parametrize("sanitize", ["on", "off"])
def test_p2_global_pool_with_held_output_is_stale_naming_mint_and_capture(request, sanitize):
    request.node.add_marker(pytest.mark.cudagraph_engines(3, sanitize=sanitize))
    engine_sequence = request.getfixturevalue("engine_sequence")
    records = engine_sequence(make_p2, 3, output="hold", check=False)
    assert [r["verdict"] for r in records][:2] == ["held", "stale"], [r["problems"] for r in records]
    (stale,) = _problems(records[1], "stale")
    here, msg = Path(__file__).name, stale["message"]
    # on: refused before the allocator; off: the allocator's assert, named as such
    assert ("StalePoolError" in msg) == (sanitize == "on") and "[engine 0]" in msg, msg
    assert "use_count > 0" in msg, msg
    # the line that tried the capture and the line that minted the kept handle, in message and sites
    assert f"{here}:{_line('capture')}" in msg, msg
    assert f'{here}", line {_line("mint-global")}' in msg, msg
    # the line the lifecycle table shows names both too; off, the allocator's own words come first
    assert f"{here}:{_line('mint-global')}" in (msg.splitlines()[0] if sanitize == "on" else msg), msg
    for tag in ("capture", "mint-global"):
        assert any(f"{here}:{_line(tag)}" in s for s in stale["sites"]), (tag, stale["sites"])
    if sanitize == "on":  # what pins the dead pool: the output the caller still holds from engine 0
        assert stale["pins"] and "output" in stale["pins"][0]["holder"], stale["pins"]


@pytest.mark.cudagraph
def test_p2_global_pool_with_dropped_output_is_reused(engine_sequence):
    records = engine_sequence(make_p2, 3, output="drop", check=False)
    assert [r["verdict"] for r in records] == ["fresh", "reused", "reused"], [r["problems"] for r in records]
    assert len({tuple(p[1]) for r in records for p in r["pool_ids"]}) == 1  # one id for every engine
    (reused,) = _problems(records[1], "reused")
    assert f"{Path(__file__).name}:{_line('mint-global')}" in reused["message"], reused["message"]


@pytest.mark.cudagraph
@pytest.mark.parametrize("output", ["hold", "drop"])
def test_p3_debug_cache_leaks_and_names_the_global(engine_sequence, output):
    records = engine_sequence(make_p3, 2, output=output, check=False)
    assert [r["verdict"] for r in records] == ["leaked", "leaked"], [r["problems"] for r in records]
    for r in records:
        (leak,) = _problems(r, "leaked")
        assert leak["bytes"] > 0 and r["leaked_bytes"] > 0
        pins = [p for p in leak["pins"] if p["cause"] == "python_reference"]
        assert any("global `_DEBUG_CACHE`" in p["holder"] for p in pins), leak["pins"]
        assert f"{Path(__file__).name}:{_line('capture')}" in leak["message"], leak["message"]


_PROBE: list = []  # (P4) in the worker: what the KV log held mid-life


def _measure(engine):
    """A no-op reload (between the engine's two runs): it only measures the KV log in the default pool."""
    log = engine.kv_log
    _PROBE.append((len(log), sum(t.untyped_storage().nbytes() for t in log),
                   engine.backend.default_pool_allocated(0)))


def _read_probe():
    return list(_PROBE)


@pytest.mark.cudagraph
@pytest.mark.parametrize("output, verdict", [("hold", "held"), ("drop", "fresh")])
def test_p4_default_pool_growth_is_not_a_pool_leak(engine_sequence, output, verdict):
    records = engine_sequence(make_p4, 3, output=output, reload=_measure)
    assert [r["verdict"] for r in records] == [verdict] * 3, [r["problems"] for r in records]
    assert _ok(records) and not any(r["problems"] for r in records)
    # mid-life the log is real default-pool memory: 2 ops x 4 batch sizes at capture, 2 per run or eager()
    probe = engine_sequence.worker.call(_read_probe)
    assert [n for n, _, _ in probe] == [2 * len(BATCH_SIZES) + 2 + 2] * 3, probe
    assert all(0 < nbytes <= allocated for _, nbytes, allocated in probe), probe
    # but it went with its engine: what is left in the default pool is what the same engine without the log
    # leaves (the cuBLAS workspace of the stream each engine makes: 33 MiB on the H100, 32 MiB modeled on sim)
    (base,) = engine_sequence(make_p1, 1, output=output)
    left = [(r["growth_bytes"], r["kept_bytes"]) for r in records]
    assert left == [(base["growth_bytes"], base["kept_bytes"])] * 3, (left, base)


def _run_inner(pytester, monkeypatch, backend: str, max_growth: str):
    """Run the pytester file in a session of its own (it imports this module) with a growth budget."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                   os.environ.get("PYTHONPATH")])))
    return pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "-p", "no:benchmark",
                                         f"--cudagraph-backend={backend}", f"--cudagraph-max-growth={max_growth}")


def test_p4_under_a_tight_max_growth_budget(pytester, monkeypatch):
    """The budget is about what an engine leaves behind: the log dies with its engine, so 1 KiB over the
    workspace of the stream each engine makes (32 MiB, modeled on sim) passes; the same log kept past release
    (the control) is over it."""
    pytester.makepyfile(test_inner='''
import pytest
from test_piecewise_engines import GrowingPiecewiseEngine, make_p4
from pytest_cudagraph import EngineCycleError

LEFT = []

class LeavesItsLog(GrowingPiecewiseEngine):
    def release(self):
        super().release()
        LEFT.append(self.kv_log)

@pytest.mark.parametrize("output, verdict", [("hold", "held"), ("drop", "fresh")])
def test_log_dies_with_engine(engine_sequence, output, verdict):
    assert [r["verdict"] for r in engine_sequence(make_p4, 3, output=output)] == [verdict] * 3

def test_control_log_left_behind(engine_sequence):
    with pytest.raises(EngineCycleError, match="growth_over_budget.*set by --cudagraph-max-growth=33555456"):
        engine_sequence(LeavesItsLog, 1, output="drop")
''')
    _run_inner(pytester, monkeypatch, "sim", str((32 << 20) + 1024)).assert_outcomes(passed=3)


@pytest.mark.gpu
def test_on_cuda_a_stream_per_engine_is_growth_named_with_its_fix(pytester, monkeypatch):
    """Each piecewise engine makes its own stream: on CUDA its matmuls leave cuBLAS's workspace for that stream
    in the default pool (GPU run 24: 34 MiB reserved, 33 MiB live, on every engine); a budget under it fails
    the engine, and the message says what the growth is and how to avoid it."""
    pytester.makepyfile(test_inner='''
import pytest
from test_piecewise_engines import make_p1
from pytest_cudagraph import EngineCycleError

def test_stream_per_engine(engine_sequence):
    with pytest.raises(EngineCycleError, match="growth_over_budget.*cuBLAS's workspace for that stream"):
        engine_sequence(make_p1, 1, output="drop")
''')
    _run_inner(pytester, monkeypatch, "cuda", "16MiB").assert_outcomes(passed=1)
