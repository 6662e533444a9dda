"""What every conformance scenario shares: the ``Ctx`` helpers (capture a small step into a pool, read the
pool's books) and the short outcome names that an allocator or capture error gets on both backends."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..backends import Backend
from ..backends.base import MiB
from ..errors import TORCH_RANDOM_POISONED

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
    if "Cannot copy between CPU and CUDA tensors during CUDA graph capture" in msg:
        return "host-copy"
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

