"""Correct CUDA graph lifecycles: a lazy per-device pool, a runner owning every graph of an engine, one
ledger per process fed by watching the graph API, a sanitizer judging it, and two allocator backends (real
CUDA, and a CPU simulation of the caching allocator's private-pool rules).

Names are imported on first use, so ``import cudagraph_lifecycle`` costs nothing until something is used
(the pytest plugin relies on that). ``CUDAGRAPH_SANITIZE=1|strict`` in the environment installs a sanitizer
for the whole program at import.
"""

from __future__ import annotations

import importlib
import os

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

_LAZY = {
    "Backend": "backends",
    "PoolState": "backends",
    "available_backends": "backends",
    "get_backend": "backends",
    "LazyPool": "pool",
    "CUDAGraphRunner": "runner",
    "RunnerStats": "runner",
    "Finding": "sanitizer",
    "PoolSanitizer": "sanitizer",
    "install_from_env": "sanitizer",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cudagraph_lifecycle' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if os.environ.get("CUDAGRAPH_SANITIZE", "").strip().lower() not in ("", "0", "off", "false", "no"):
    from .sanitizer import install_from_env as _install

    _install()  # a sanitizer for the whole program

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CUDAGraphRunner",
    "ConfigError",
    "CudaGraphLifecycleError",
    "Finding",
    "GraphInputError",
    "LazyPool",
    "PoolNotReleasedError",
    "PoolSanitizer",
    "PoolState",
    "RetiredPoolError",
    "RunnerReleasedError",
    "RunnerStats",
    "StalePoolError",
    "available_backends",
    "get_backend",
    "install_from_env",
]
__version__ = "0.1.0"
