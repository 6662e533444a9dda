"""Two engines for the lifecycle suite: one built on CUDAGraphRunner, one with the seed bug.

Both run a multi-layer MLP decode step (Linear + ReLU layers), small enough for the CPU and launch-bound
on a GPU. ``NaiveEngine`` keeps its pool handle at class level and captures into it again after an earlier
instance released its graphs: the bug that hit TensorRT-LLM, vLLM and PyTorch.
"""

from __future__ import annotations

import torch

from cudagraph_lifecycle import Backend, CUDAGraphRunner

HIDDEN = 256
LAYERS = 4
BATCH_SIZES = (1, 2, 4, 8)


class _MLP:
    def __init__(self, backend: Backend, hidden: int = HIDDEN, layers: int = LAYERS, seed: int = 0):
        self.backend = backend
        self.hidden = hidden
        dev = backend.torch_device(0)
        gen = torch.Generator().manual_seed(seed)
        scale = hidden**-0.5
        self.weights = [
            ((torch.randn(hidden, hidden, generator=gen) * scale).to(dev), torch.zeros(hidden, device=dev))
            for _ in range(layers)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in self.weights:
            x = torch.relu(torch.addmm(b, x, w))
        return x

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.forward(x)

    def example_input(self, batch: int = 3) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1234 + batch)
        return torch.randn(batch, self.hidden, generator=gen).to(self.backend.torch_device(0))


class MLPEngine(_MLP):
    """The fixed engine: every graph lives in the runner, which mints a fresh pool and retires it."""

    def __init__(self, backend: Backend, batch_sizes=BATCH_SIZES, **kw):
        super().__init__(backend, **kw)
        self.runner = CUDAGraphRunner(self.forward, batch_sizes, (self.hidden,), backend=backend, name="mlp")

    def capture(self) -> None:
        self.runner.capture()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner.run(x)

    def release(self) -> None:
        self.runner.release()


class NaiveEngine(_MLP):
    """The seed bug: one pool handle for every instance, minted once and kept after release."""

    _pool = None  # class level: survives the engine that minted it
    _pool_backend = None

    def __init__(self, backend: Backend, batch_sizes=BATCH_SIZES, **kw):
        super().__init__(backend, **kw)
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[int, tuple] = {}
        if NaiveEngine._pool is None or NaiveEngine._pool_backend is not backend:
            NaiveEngine._pool = backend.graph_pool_handle()
            NaiveEngine._pool_backend = backend
        self.static_in = torch.zeros(self.batch_sizes[-1], self.hidden, device=backend.torch_device(0))

    def capture(self) -> None:
        be = self.backend
        stream = be.capture_stream(0)
        with torch.no_grad():
            for bs in reversed(self.batch_sizes):
                x = self.static_in[:bs]
                with be.stream(stream):
                    self.forward(x)
                be.synchronize()
                g = be.new_graph()
                with be.stream(stream):
                    g.capture_begin(pool=NaiveEngine._pool)
                    try:
                        out = self.forward(x)
                    finally:
                        g.capture_end()
                self.graphs[bs] = (g, out)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        bs = next(s for s in self.batch_sizes if s >= b)
        g, out = self.graphs[bs]
        self.static_in[:b].copy_(x)
        self.static_in[b:bs].zero_()
        g.replay()
        return out[:b]

    def pool_ids(self):
        return [(0, NaiveEngine._pool)]

    def num_graphs(self) -> int:
        return len(self.graphs)

    def release(self) -> None:
        while self.graphs:
            self.graphs.popitem()[1][0].reset()
        # the bug: NaiveEngine._pool is kept for the next instance


def make_mlp_engine(backend: Backend) -> MLPEngine:
    return MLPEngine(backend)


def make_naive_engine(backend: Backend) -> NaiveEngine:
    return NaiveEngine(backend)
