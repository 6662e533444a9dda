"""Peer-style CUDA-graph engines: the ways public inference engines hold their graph pools, as test material.

Every engine runs the same small MLP (3 x Linear(256) + ReLU) through CUDA graphs captured for batch sizes
1, 2, 4 and 8, largest first, and differs only in where its pool handle lives and what ``release()`` does
with it. Styles (a)-(h), (k)-(n) and (p) use only the ``Backend`` API, so they run on ``sim`` and on ``cuda``;
(i), (j) and (o) use ``torch.cuda`` / ``torch.compile`` directly and run on ``cuda`` only. (m) runs a second,
one-layer draft model beside the MLP (speculative decoding); its result is the MLP's.

The protocol a harness calls: ``capture()``, ``run(x)`` (a view of the static output, sliced to the batch),
``eager(x)``, ``example_input()`` and ``release()``. No engine exposes its pools, except (b), which offers
``pool_ids()`` so that a cross-check against the engine's own account can be tested.

Module-level state (the class handle of (a), ``_GLOBAL_POOL``, ``_HANDLES``, ``_PROFILE_RESULTS``,
``_SHARED_GRAPH_POOL``, ``_LOADER``, the draft engines of (m) in ``_DRAFTS``) lives as long as the process,
as it does in the engines these mimic: call ``reset_module_state()`` between independent runs in one process
(a pool id means nothing in another allocator world).

(n) frees nothing itself: its graphs go when the garbage collector collects the engine's reference cycle
with its runner, so a harness that releases an engine and does not run ``gc.collect()`` keeps its pools.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from cudagraph_lifecycle.backends.base import Backend, PoolId
from cudagraph_lifecycle.errors import BackendUnavailableError

HIDDEN = 256
LAYERS = 3
BATCH_SIZES = (1, 2, 4, 8)
MODEL_NAME = "mlp"

_GLOBAL_POOL: PoolId | None = None  # (d) and (f): one handle for every engine of the process
_HANDLES: dict[str, PoolId] = {}  # (h): one handle per model name, kept across reloads
_PROFILE_RESULTS: list[Any] = []  # (d) keeps profiling outputs here; (e) keeps plain numbers
_SHARED_GRAPH_POOL: PoolId | None = None  # (k): the pool the first graph of the process minted
_DRAFTS: dict[str, DraftEngine] = {}  # (m): one draft engine per model name, reused by every later target


class _Loader:
    """(l) A model server's loader: its pool handle outlives every engine it loads."""

    def __init__(self) -> None:
        self.pool: PoolId | None = None


_LOADER = _Loader()


def reset_module_state() -> None:
    """Forget every process-wide handle and profiling result (between independent runs in one process)."""
    global _GLOBAL_POOL, _SHARED_GRAPH_POOL
    _GLOBAL_POOL = None
    _SHARED_GRAPH_POOL = None
    _LOADER.pool = None
    _HANDLES.clear()
    _PROFILE_RESULTS.clear()
    _DRAFTS.clear()  # a dropped draft's graphs reset as they are destroyed
    ClassHandleEngine._pool = None


def _global_pool(backend: Backend) -> PoolId:
    global _GLOBAL_POOL
    if _GLOBAL_POOL is None:
        _GLOBAL_POOL = backend.graph_pool_handle()
    return _GLOBAL_POOL


def capture_one(backend: Backend, fn, x: torch.Tensor, stream: Any, pool: Any, *, via_context: bool):
    """Warm ``fn(x)`` up eagerly on ``stream``, then capture it into a new graph on the same stream.

    ``via_context`` captures through ``backend.graph`` (``torch.cuda.graph``: synchronize, empty both caches,
    capture); otherwise through raw ``capture_begin``/``capture_end``, which empties nothing. Returns
    ``(graph, static_output)``. Grad mode is the caller's.
    """
    with backend.stream(stream):
        fn(x)  # lazy library setup (cuBLAS handles, workspaces) must happen before the capture, not in it
    backend.synchronize()
    g = backend.new_graph()
    if via_context:
        with backend.graph(g, pool=pool, stream=stream):
            out = fn(x)
    else:
        with backend.stream(stream):
            g.capture_begin(pool=pool)
            try:
                out = fn(x)
            finally:
                g.capture_end()
    return g, out


def _require_cuda(backend: Backend, style: str, what: str) -> None:
    if backend.name != "cuda":
        raise BackendUnavailableError(
            f"peer engine style ({style}) uses {what} directly and runs only on the 'cuda' backend, "
            f"not on {backend.name!r}: run it on a GPU, or pick one of the styles in SIM_STYLES"
        )


class _MLP:
    """Weights, the eager forward, the example input and the static input buffer shared by every style."""

    weights_require_grad = False

    def __init__(self, backend: Backend, seed: int = 0):
        self.backend = backend
        self.device = backend.torch_device(0)
        gen = torch.Generator().manual_seed(seed)
        scale = HIDDEN**-0.5
        self.weights = []
        for _ in range(LAYERS):
            w = (torch.randn(HIDDEN, HIDDEN, generator=gen) * scale).to(self.device)
            b = (torch.randn(HIDDEN, generator=gen) * 0.1).to(self.device)
            self.weights.append((w.requires_grad_(self.weights_require_grad),
                                 b.requires_grad_(self.weights_require_grad)))
        self.static_in = torch.zeros(max(BATCH_SIZES), HIDDEN, device=self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in self.weights:
            x = torch.relu(torch.addmm(b, x, w))
        return x

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.forward(x)

    def example_input(self) -> torch.Tensor:
        # batch 3: the engine pads it to its batch-4 graph
        gen = torch.Generator().manual_seed(1234)
        return torch.randn(3, HIDDEN, generator=gen).to(self.device)

    def _stage(self, x: torch.Tensor) -> tuple[int, int]:
        """Copy ``x`` into the static input, zero the padding; return (batch, graphed batch size)."""
        b = x.shape[0]
        bs = next((s for s in BATCH_SIZES if s >= b), None)
        if bs is None:
            raise ValueError(f"batch {b} exceeds the largest graphed batch size {max(BATCH_SIZES)}")
        self.static_in[:b].copy_(x)
        self.static_in[b:bs].zero_()
        return b, bs

    def _sequential(self) -> torch.nn.Sequential:
        """The same weights as an eval-mode ``nn.Sequential`` (for the engines that graph modules)."""
        layers = []
        for w, b in self.weights:
            lin = torch.nn.Linear(HIDDEN, HIDDEN, device=self.device)
            with torch.no_grad():
                lin.weight.copy_(w.t())
                lin.bias.copy_(b)
            layers += [lin, torch.nn.ReLU()]
        return torch.nn.Sequential(*layers).eval().requires_grad_(False)


class _GraphEngine(_MLP):
    """One graph per batch size over the backend API; the styles differ in pools and release."""

    capture_grad = False  # real engines capture under no_grad; style (c) does not

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.stream = self._capture_stream()

    def _capture_stream(self) -> Any:
        return self.backend.new_stream(0)  # most engines make a side stream of their own

    def _capture_all(self, pool: Any, *, via_context: bool) -> None:
        grad = contextlib.nullcontext() if self.capture_grad else torch.no_grad()
        with grad:
            # largest first: the smaller graphs reuse the blocks the largest one freed in the shared pool
            for bs in sorted(BATCH_SIZES, reverse=True):
                self.graphs[bs] = capture_one(self.backend, self.forward, self.static_in[:bs], self.stream,
                                              pool, via_context=via_context)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if not self.graphs:
            raise RuntimeError(f"{type(self).__name__}.run() before capture(): call capture() first")
        b, bs = self._stage(x)
        g, out = self.graphs[bs]
        g.replay()
        return out[:b]

    def _reset_graphs(self) -> None:
        while self.graphs:
            g, _ = self.graphs.popitem()[1]
            g.reset()


class ClassHandleEngine(_GraphEngine):
    """(a) A pool handle stored on the class: minted by the first instance and kept for the life of the
    process, so every later instance captures into the id an earlier one released (the TensorRT-LLM bug
    that reused workers exposed). Raw capture_begin/capture_end, on the process-wide capture stream."""

    _pool: PoolId | None = None

    def __init__(self, backend: Backend):
        super().__init__(backend)
        if ClassHandleEngine._pool is None:
            ClassHandleEngine._pool = backend.graph_pool_handle()

    def _capture_stream(self) -> Any:
        return self.backend.capture_stream(0)

    def capture(self) -> None:
        self._capture_all(ClassHandleEngine._pool, via_context=False)

    def release(self) -> None:
        self._reset_graphs()  # the class keeps its handle for the next instance


class _FreshHandleEngine(_GraphEngine):
    """A handle minted lazily at the first capture and retired at release: no later capture reuses it."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self._pool: PoolId | None = None

    def capture(self) -> None:
        if self._pool is None:
            self._pool = self._mint()
        self._capture_all(self._pool, via_context=False)

    def _mint(self) -> PoolId:
        return self.backend.graph_pool_handle()

    def release(self) -> None:
        self._reset_graphs()
        self._pool = None


class FreshHandleEngine(_FreshHandleEngine):
    """(b) The fix for (a): an instance handle minted at the first capture and
    set to None at release, after every graph was reset. Reports its pool for a cross-check."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self._minted: PoolId | None = None

    def _mint(self) -> PoolId:
        self._minted = super()._mint()
        return self._minted

    def pool_ids(self) -> list[tuple[int, PoolId]]:
        """(device, pool id) of the pool this engine captured into, also after release."""
        return [] if self._minted is None else [(0, self._minted)]


class GradCaptureEngine(_FreshHandleEngine):
    """(c) Like (b), but the weights require grad and the capture runs with autograd on, as a model loaded
    for training and then graphed for serving would: outputs carry autograd history that keeps the
    capture's saved activations alive in the pool (a caller's clone keeps them too)."""

    weights_require_grad = True
    capture_grad = True


class _ProfilingEngine(_GraphEngine):
    """Engines that run a throwaway "profiling" capture of the largest batch before the real captures."""

    def _profile(self, pool: Any) -> torch.Tensor:
        with torch.no_grad():
            g, out = capture_one(self.backend, self.forward, self.static_in, self.stream, pool,
                                 via_context=True)
            g.replay()
        self.backend.synchronize()
        g.reset()
        return out

    def release(self) -> None:
        self._reset_graphs()


class ProfiledGlobalPoolEngine(_ProfilingEngine):
    """(d) vLLM's pattern: one module-global pool receives both the memory-profiling captures and the real
    ones. The profiler keeps its run's output as a measurement, so the reset profiling graph leaves its
    block in the global pool: the first real capture then targets a dead pool."""

    def capture(self) -> None:
        pool = _global_pool(self.backend)
        _PROFILE_RESULTS.append(self._profile(pool))
        self._capture_all(pool, via_context=True)


class ThrowawayProfileEngine(_ProfilingEngine):
    """(e) The fix for (d): the profiling capture goes to a throwaway pool and only a number is kept; the
    real graphs go to a pool minted per engine at capture, forgotten at release."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self._pool: PoolId | None = None

    def capture(self) -> None:
        _PROFILE_RESULTS.append(float(self._profile(self.backend.graph_pool_handle()).sum()))
        self._pool = self.backend.graph_pool_handle()
        self._capture_all(self._pool, via_context=True)

    def release(self) -> None:
        super().release()
        self._pool = None


class GlobalPoolEngine(_GraphEngine):
    """(f) One module-global pool handle shared by every engine in the process, captured through the
    torch.cuda.graph context manager (whose empty_cache hides the reuse unless something pins the pool);
    release resets the graphs, the module keeps the handle."""

    def capture(self) -> None:
        self._capture_all(_global_pool(self.backend), via_context=True)

    def release(self) -> None:
        self._reset_graphs()


class MemPoolEngine(_GraphEngine):
    """(g) A torch.cuda.MemPool per engine, captured into through torch.cuda.graph(pool=mp.id): the object
    holds a reference of its own, so its pool never turns dead while the engine has it; release resets
    the graphs and drops the MemPool."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self._mempool = None

    def capture(self) -> None:
        self._mempool = self.backend.mempool(0)
        self._capture_all(self._mempool.id, via_context=True)

    def release(self) -> None:
        self._reset_graphs()
        self._mempool = None


class ReloadHandleEngine(_GraphEngine):
    """(h) One handle per model name, kept in a module-level registry across model reloads: release resets
    the graphs and calls empty_cache, trusting it to clear the pool, and the reloaded engine captures into
    the same handle again ("one handle reused after empty_cache")."""

    def capture(self) -> None:
        if MODEL_NAME not in _HANDLES:
            _HANDLES[MODEL_NAME] = self.backend.graph_pool_handle()
        self._capture_all(_HANDLES[MODEL_NAME], via_context=True)

    def release(self) -> None:
        self._reset_graphs()
        self.backend.empty_cache()


class GraphedCallablesEngine(_MLP):
    """(i) torch.cuda.make_graphed_callables over an eval-mode nn.Sequential, one graphed module per batch
    size, all in the pool that make_graphed_callables mints for the call. Release drops the graphed modules
    and the model; each graphed module's forward closes over the module itself, so only gc frees them."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.model = self._sequential()
        self.graphed: dict[int, torch.nn.Module] | None = None

    def capture(self) -> None:
        if self.graphed is not None:
            return
        sizes = sorted(BATCH_SIZES, reverse=True)
        # make_graphed_callables replaces a module's forward: one top-level Sequential per batch size,
        # all sharing the same layers (and so the same weights)
        copies = tuple(torch.nn.Sequential(*self.model).eval() for _ in sizes)
        samples = tuple((self.static_in[:bs],) for bs in sizes)  # run() passes these same slices
        with torch.no_grad():
            graphed = torch.cuda.make_graphed_callables(copies, samples)
        self.graphed = dict(zip(sizes, graphed))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        self.capture()
        b, bs = self._stage(x)
        with torch.no_grad():
            out = self.graphed[bs](self.static_in[:bs])
        return out[:b]

    def release(self) -> None:
        self.graphed = None
        self.model = None


class GraphedAtBuildEngine:
    """(o) A training-style model graphed for serving, the way a user first meets make_graphed_callables:
    ``nn.Sequential`` built with torch's defaults (its weights require grad, as a loaded checkpoint's do),
    wrapped at construction (no ``capture()``; make_graphed_callables also captures the backward graphs,
    on autograd's own thread), then run forward only under ``no_grad``. Nothing of ``_MLP`` is reused: it
    shares no weights layout, stream or helper with the other styles. Release drops the graphed callable
    and the model. On a cold process its captures are the first matmuls on make_graphed_callables' capture
    stream, so cuBLAS's workspaces for that stream land in its pool."""

    def __init__(self, backend: Backend):
        self.device = backend.torch_device(0)
        torch.manual_seed(7)
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(HIDDEN, HIDDEN, device=self.device), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers)
        self.sample = torch.randn(max(BATCH_SIZES), HIDDEN, device=self.device)
        self.graphed = torch.cuda.make_graphed_callables(self.model, (self.sample,))

    def example_input(self) -> torch.Tensor:
        return torch.randn(max(BATCH_SIZES), HIDDEN, generator=torch.Generator().manual_seed(5)).to(self.device)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.graphed(x)

    def release(self) -> None:
        self.graphed = None
        self.model = None


class CompiledEngine(_MLP):
    """(j) torch.compile(mode="reduce-overhead"): cudagraph trees record one graph per input shape in their
    own per-device pool. Release drops the compiled model and calls torch._dynamo.reset(), as test suites
    do between models. Outputs are the trees' static outputs: valid until the next step overwrites them."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.model = self._sequential()
        self.compiled = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
        self._recorded = False

    def _step(self, bs: int) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # earlier outputs may be overwritten from here on
        with torch.no_grad():
            return self.compiled(self.static_in[:bs])

    def capture(self) -> None:
        if self._recorded:
            return
        # cudagraph trees run a shape eagerly on its first call and record it on a later one
        for bs in sorted(BATCH_SIZES, reverse=True):
            for _ in range(3):
                self._step(bs)
        self._recorded = True

    def run(self, x: torch.Tensor) -> torch.Tensor:
        self.capture()
        b, bs = self._stage(x)
        return self._step(bs)[:b]

    def release(self) -> None:
        self.compiled = None
        self.model = None
        torch._dynamo.reset()


class SharedGraphPoolEngine(_GraphEngine):
    """(k) SGLang's pattern: the first graph of the process is captured through torch.cuda.graph with no
    pool, so it mints a private pool of its own; the module global then takes ``graph.pool()`` and every
    later capture (this engine's smaller sizes, every later engine) passes it. Release resets the graphs;
    the module keeps the pool id, as SGLang's global does."""

    def capture(self) -> None:
        global _SHARED_GRAPH_POOL
        with torch.no_grad():
            for bs in sorted(BATCH_SIZES, reverse=True):
                g, out = capture_one(self.backend, self.forward, self.static_in[:bs], self.stream,
                                     _SHARED_GRAPH_POOL, via_context=True)
                self.graphs[bs] = (g, out)
                _SHARED_GRAPH_POOL = g.pool()  # as SGLang does after every capture: the same id from here on

    def release(self) -> None:
        self._reset_graphs()


class LoaderThreadEngine(_GraphEngine):
    """(l) Captures run on a model server's loader thread, on a stream made in that thread, with raw
    capture_begin/capture_end into the loader's one pool handle (minted once, kept across engines); the
    caller joins the thread and re-raises what it raised. Release resets the graphs in the caller's thread
    and leaves the loader its handle."""

    def _capture_stream(self) -> Any:
        return None  # made by the loader thread: a stream is current per thread on CUDA

    def capture(self) -> None:
        errors: list[BaseException] = []

        def load() -> None:
            try:
                if _LOADER.pool is None:
                    _LOADER.pool = self.backend.graph_pool_handle()
                self.stream = self.backend.new_stream(0)
                self._capture_all(_LOADER.pool, via_context=False)  # grad mode is per thread: set in there
            except BaseException as exc:  # a thread's exception dies with it unless handed back
                errors.append(exc)

        loader = threading.Thread(target=load, name="model-loader")
        loader.start()
        loader.join()
        if errors:
            raise errors[0]

    def release(self) -> None:
        self._reset_graphs()


def _to_default_pool(backend: Backend, t: torch.Tensor) -> torch.Tensor:
    """``t`` loaded into a block of the device's default pool, as a weight loader's ``empty`` + ``copy_`` does."""
    out = backend.empty(*t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


class DraftEngine(_GraphEngine):
    """The draft model of (m): the MLP's first layer only (a layer-skip draft), its weights loaded into the
    default pool, its own side stream. It captures into the pool handle the target that built it passed in,
    and keeps that handle for good: every later target reuses the cached draft, which resets its graphs and
    captures them again into that same handle. Not a style of its own: only (m) builds it."""

    def __init__(self, backend: Backend, pool: PoolId):
        super().__init__(backend)
        self.weights = [(_to_default_pool(backend, w), _to_default_pool(backend, b)) for w, b in self.weights[:1]]
        self.pool = pool  # the first target's handle

    def capture(self) -> None:
        self._reset_graphs()  # a new target: drop the graphs captured for the last one
        self._capture_all(self.pool, via_context=True)


class SpeculativeEngine(_GraphEngine):
    """(m) Speculative decoding, the TensorRT-LLM / SGLang draft-model pattern: the target mints one pool
    handle per engine, captures its graphs into it, and hands the handle to its draft engine, which captures
    its graphs into the same pool. The draft is cached in a module-level dict keyed by model name, so the
    next target of the same model reuses the draft object, which keeps the handle it was first given and
    recaptures into it. run() lets the draft propose (its tokens copied out) and the target verify; the
    result is the target's. Release resets the target's graphs only."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self._pool: PoolId | None = None
        self.draft: DraftEngine | None = None
        self.accepted = 0  # rows whose draft token the target confirmed

    def capture(self) -> None:
        self._pool = self.backend.graph_pool_handle()
        self._capture_all(self._pool, via_context=True)
        draft = _DRAFTS.get(MODEL_NAME)
        if draft is None:  # built once, by the first target, and given that target's pool to share
            draft = _DRAFTS[MODEL_NAME] = DraftEngine(self.backend, self._pool)
        draft.capture()  # the target's batch sizes: captured again for every target
        self.draft = draft

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.draft is None:
            raise RuntimeError("SpeculativeEngine.run() before capture(): call capture() first")
        # the draft's output may share blocks with the target's intermediates (one pool): read it out first
        proposal = self.draft.run(x).argmax(-1)
        out = super().run(x)
        self.accepted += int((proposal == out.argmax(-1)).sum())
        return out

    def release(self) -> None:
        self._reset_graphs()  # the target's own graphs: the draft stays cached, its graphs captured
        self._pool = None
        self.draft = None


class _ModelRunner:
    """The model runner of (n): its own stream, the static input in the default pool, and the graphs keyed
    by batch size. It points back at its engine (the model, the config), as model runners do: engine and
    runner form a reference cycle."""

    def __init__(self, engine: GcReleasedEngine):
        self.engine = engine
        be = engine.backend
        self.stream = be.new_stream(0)
        self.static_in = _to_default_pool(be, engine.static_in)
        self.pool: PoolId | None = None
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}

    def capture(self) -> None:
        eng = self.engine
        self.pool = eng.backend.graph_pool_handle()  # a fresh pool per runner
        with torch.no_grad():
            for bs in sorted(BATCH_SIZES, reverse=True):
                self.graphs[bs] = capture_one(eng.backend, eng.forward, self.static_in[:bs], self.stream,
                                              self.pool, via_context=True)


class GcReleasedEngine(_GraphEngine):
    """(n) Graphs released by the garbage collector: they live in a dict on the engine's runner, and runner
    and engine refer to each other. Release resets nothing: it drops the engine's own name for the graphs
    and leaves the rest to the caller dropping the engine, so its pools are freed only when gc collects the
    cycle (the graphs' destructors reset them). Weights in the default pool; a fresh pool per engine."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.weights = [(_to_default_pool(backend, w), _to_default_pool(backend, b)) for w, b in self.weights]
        self.runner = _ModelRunner(self)
        self.static_in = self.runner.static_in
        self.stream = self.runner.stream
        self.graphs = self.runner.graphs  # the same dict: run() replays the runner's graphs

    def _capture_stream(self) -> Any:
        return None  # the runner makes its own

    def capture(self) -> None:
        self.runner.capture()

    def release(self) -> None:
        del self.graphs  # the runner still has them, until the cycle is collected


class RunnerEngine(_MLP):
    """(p) This library's own answer: every graph in a ``CUDAGraphRunner``, which mints a fresh pool at its
    first capture and retires it at release. Its capture path is the one ``--cudagraph-sanitize=strict``
    changes (checked mode watches each captured op and poisons the padding), so the three modes must agree
    on it too."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        from cudagraph_lifecycle import CUDAGraphRunner

        self.runner = CUDAGraphRunner(self.forward, BATCH_SIZES, (HIDDEN,), backend=backend, name="peer-p")

    def capture(self) -> None:
        with torch.no_grad():
            self.runner.capture()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.runner.run(x)

    def release(self) -> None:
        self.runner.release()


def make_a(backend: Backend) -> ClassHandleEngine:
    return ClassHandleEngine(backend)


def make_b(backend: Backend) -> FreshHandleEngine:
    return FreshHandleEngine(backend)


def make_c(backend: Backend) -> GradCaptureEngine:
    return GradCaptureEngine(backend)


def make_d(backend: Backend) -> ProfiledGlobalPoolEngine:
    return ProfiledGlobalPoolEngine(backend)


def make_e(backend: Backend) -> ThrowawayProfileEngine:
    return ThrowawayProfileEngine(backend)


def make_f(backend: Backend) -> GlobalPoolEngine:
    return GlobalPoolEngine(backend)


def make_g(backend: Backend) -> MemPoolEngine:
    return MemPoolEngine(backend)


def make_h(backend: Backend) -> ReloadHandleEngine:
    return ReloadHandleEngine(backend)


def make_i(backend: Backend) -> GraphedCallablesEngine:
    _require_cuda(backend, "i", "torch.cuda.make_graphed_callables")
    return GraphedCallablesEngine(backend)


def make_o(backend: Backend) -> GraphedAtBuildEngine:
    _require_cuda(backend, "o", "torch.cuda.make_graphed_callables")
    return GraphedAtBuildEngine(backend)


def make_p(backend: Backend) -> RunnerEngine:
    return RunnerEngine(backend)


def make_j(backend: Backend) -> CompiledEngine:
    _require_cuda(backend, "j", 'torch.compile(mode="reduce-overhead")')
    return CompiledEngine(backend)


def make_k(backend: Backend) -> SharedGraphPoolEngine:
    return SharedGraphPoolEngine(backend)


def make_l(backend: Backend) -> LoaderThreadEngine:
    return LoaderThreadEngine(backend)


def make_m(backend: Backend) -> SpeculativeEngine:
    return SpeculativeEngine(backend)


def make_n(backend: Backend) -> GcReleasedEngine:
    return GcReleasedEngine(backend)


STYLES = {"a": make_a, "b": make_b, "c": make_c, "d": make_d, "e": make_e,
          "f": make_f, "g": make_g, "h": make_h, "i": make_i, "j": make_j,
          "k": make_k, "l": make_l, "m": make_m, "n": make_n, "o": make_o, "p": make_p}
SIM_STYLES = "abcdefghklmnp"
