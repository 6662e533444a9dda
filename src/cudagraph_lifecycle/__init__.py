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
import sys

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
    "SimBackend": "backends.sim",
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



def _run_as_sanitizer_command() -> bool:
    """``python -m cudagraph_lifecycle.sanitizer``: the command installs the sanitizer itself, and reports a
    bad setting as a message rather than a traceback out of this import."""
    argv = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return argv[i + 1:i + 2] == ["cudagraph_lifecycle.sanitizer"]
        if arg.startswith("-m"):
            return arg == "-mcudagraph_lifecycle.sanitizer"
        if not arg.startswith("-"):
            return False  # a script: what follows are its arguments
    return False


if os.environ.get("CUDAGRAPH_SANITIZE", "").strip().lower() not in ("", "0", "off", "false", "no") \
        and not _run_as_sanitizer_command():
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
    "SimBackend",
    "StalePoolError",
    "available_backends",
    "get_backend",
    "install_from_env",
]
__version__ = "0.1.0"
