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
from .sanitizer import Finding, PoolSanitizer, install_from_env

install_from_env()  # CUDAGRAPH_SANITIZE=1|strict: a sanitizer for the whole program

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CUDAGraphRunner",
    "ConfigError",
    "Finding",
    "PoolSanitizer",
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
