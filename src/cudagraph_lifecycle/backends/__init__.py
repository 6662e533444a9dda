"""Allocator backends: ``cuda`` (real torch.cuda) and ``sim`` (the private-pool rules on the CPU)."""

from __future__ import annotations

from ..errors import BackendUnavailableError, ConfigError
from .base import Backend, PoolId, PoolState

BACKEND_NAMES = ("auto", "cuda", "sim")


def cuda_usable() -> bool:
    """True when this process can use CUDA (a forked child of a CUDA parent cannot)."""
    import torch

    if not torch.cuda.is_available():
        return False
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    return not (bad_fork is not None and bad_fork())


def available_backends() -> list[str]:
    return ["cuda", "sim"] if cuda_usable() else ["sim"]


def get_backend(name: str | Backend = "auto", **sim_options) -> Backend:
    """``cuda`` or ``sim`` by name; ``auto`` takes cuda when a GPU is usable, else sim."""
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
                "(torch.cuda.is_available() is False, or this is a forked child of a CUDA process): "
                "run on a GPU machine, or choose backend 'sim' or 'auto'"
            )
        from .cuda import CudaBackend

        return CudaBackend()
    from .sim import SimBackend

    return SimBackend(**sim_options)


__all__ = ["BACKEND_NAMES", "Backend", "PoolId", "PoolState", "available_backends", "cuda_usable", "get_backend"]
