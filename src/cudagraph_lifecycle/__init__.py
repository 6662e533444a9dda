"""Correct CUDA graph lifecycles: a lazy per-device pool, a runner owning every graph of an engine,
and two allocator backends (real CUDA, and a CPU simulation of the caching allocator's private-pool rules)."""

from .backends import Backend, PoolState, available_backends, get_backend
from .errors import (
    BackendUnavailableError,
    ConfigError,
    CudaGraphLifecycleError,
    GraphInputError,
    PoolNotReleasedError,
    RetiredPoolError,
    RunnerReleasedError,
    StalePoolError,
)
from .pool import LazyPool
from .runner import CUDAGraphRunner, RunnerStats

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CUDAGraphRunner",
    "ConfigError",
    "CudaGraphLifecycleError",
    "GraphInputError",
    "LazyPool",
    "PoolNotReleasedError",
    "PoolState",
    "RetiredPoolError",
    "RunnerReleasedError",
    "RunnerStats",
    "StalePoolError",
    "available_backends",
    "get_backend",
]
__version__ = "0.1.0"
