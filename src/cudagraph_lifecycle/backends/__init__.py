"""Allocator backends: ``cuda`` (real torch.cuda) and ``sim`` (the private-pool rules on the CPU).

``get_backend(kind)`` returns the process's ONE object of each kind, so every runner, pool, engine and
sanitizer in a process shares one allocator world and one capture stream per device; a forked child gets
fresh ones. ``SimBackend()`` called directly is the one way to build an isolated simulated world (tests,
conformance scenarios).
"""

from __future__ import annotations

from ..choices import BACKEND_NAMES
from ..errors import BackendUnavailableError, ConfigError
from .base import Backend, Block, GraphAPI, PoolId, PoolState


def cuda_usable() -> bool:
    """True when this process can use CUDA, asked without creating a CUDA context (so the process can still
    fork workers): a CPU build, no visible GPU, or a forked child of a CUDA process cannot."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return False
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if bad_fork is not None and bad_fork():
        return False
    # device_count() reads NVML before CUDA is initialized; is_available() would initialize the driver.
    return torch.cuda.device_count() > 0


def available_backends() -> list[str]:
    return ["cuda", "sim"] if cuda_usable() else ["sim"]


def get_backend(name: str | Backend = "auto") -> Backend:
    """The process's backend of kind ``cuda`` or ``sim``; ``auto`` is cuda when a GPU is usable, else sim.
    The same object for the same kind on every call (``get_backend(k) is get_backend(k)``)."""
    if isinstance(name, Backend):
        return name
    if name not in BACKEND_NAMES:
        raise ConfigError(f"unknown backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "cuda" if cuda_usable() else "sim"
    if name == "cuda":
        if not cuda_usable():
            raise BackendUnavailableError(
                "backend 'cuda' was asked for but no usable GPU is visible to this process "
                "(a CPU build of torch, no GPU, or a forked child of a CUDA process): "
                "run on a GPU machine, or choose backend 'sim' or 'auto'"
            )
        from .cuda import CudaBackend

        return CudaBackend.process()
    from .sim import SimBackend

    return SimBackend.process()


def isolated_backend(name: str) -> Backend:
    """An allocator world of its own for one scenario: a new simulated allocator for ``sim``; for ``cuda``
    the process's one allocator (run each scenario in its own process to isolate it)."""
    be = get_backend(name)
    if be.name == "sim":
        from .sim import SimBackend

        return SimBackend()
    return be


def graph_apis() -> list[GraphAPI]:
    """Every kind's graph API, for the observation layer (the cuda one exists on CPU builds too: wrapping it
    initializes nothing)."""
    from .cuda import CudaBackend
    from .sim import SimBackend

    return [api for api in (SimBackend.graph_api(), CudaBackend.graph_api()) if api is not None]


__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "Block",
    "GraphAPI",
    "PoolId",
    "PoolState",
    "available_backends",
    "cuda_usable",
    "get_backend",
    "graph_apis",
    "isolated_backend",
]
