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

from .choices import SANITIZE_ENV_OFF
from .errors import (
    BackendUnavailableError,
    ConfigError,
    CudaGraphLifecycleError,
    DefaultStreamCaptureError,
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


def _run_as_sanitizer_command(argv: list[str] | None = None) -> bool:
    """``python -m cudagraph_lifecycle.sanitizer``: the command installs the sanitizer itself, and reports a
    bad setting as a message rather than a traceback out of this import. Reads the interpreter's own command
    line as its option parser does: options that take a value (``-X dev``, ``-W ignore``), grouped flags
    (``-Im``), and the end of the options at a script, ``-c`` or ``-``."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--check-hash-based-pycs":
            i += 2
            continue
        if arg == "-" or not arg.startswith("-"):
            return False  # stdin or a script: what follows are its arguments
        if arg.startswith("--"):
            i += 1
            continue
        for j, flag in enumerate(arg[1:], 1):
            if flag == "m":
                module = arg[j + 1:] or (argv[i + 1] if i + 1 < len(argv) else "")
                return module in ("cudagraph_lifecycle.sanitizer", "cudagraph_lifecycle.sanitizer.__main__")
            if flag == "c":
                return False
            if flag in "WX":  # its value is the rest of the group, or the next argument
                i += arg[j + 1:] == ""
                break
        i += 1
    return False


if os.environ.get("CUDAGRAPH_SANITIZE", "").strip().lower() not in SANITIZE_ENV_OFF \
        and not _run_as_sanitizer_command():
    from .sanitizer import install_from_env as _install

    _install(report_at_exit=True)  # a sanitizer for the whole program, its findings printed at exit

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CUDAGraphRunner",
    "ConfigError",
    "CudaGraphLifecycleError",
    "DefaultStreamCaptureError",
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
