"""Errors raised by cudagraph_lifecycle. Each message says what was wrong and how to fix it."""

from __future__ import annotations

# torch's own words, where only they tell what happened: its refusal of a capture on the default stream (after it
# opened the CUDA RNG's capture), and what every eager random op raises once that capture is left open
TORCH_DEFAULT_STREAM_REFUSAL = "captured on a non-default stream"
TORCH_RANDOM_POISONED = "Offset increment outside graph capture"
TORCH_POOL_ASSERT = "use_count > 0"  # the caching allocator's assert on a capture into a dead pool


class CudaGraphLifecycleError(RuntimeError):
    """Base class of every lifecycle error this library raises."""


class ConfigError(ValueError):
    """A runner, pool or backend was configured with values that cannot work."""


class GraphInputError(ValueError):
    """An input handed to a runner does not fit its static buffers."""


class BackendUnavailableError(CudaGraphLifecycleError):
    """The backend that was asked for cannot run on this machine."""


class RetiredPoolError(CudaGraphLifecycleError):
    """A capture was attempted into a pool that was already retired."""


class RunnerReleasedError(CudaGraphLifecycleError):
    """A runner was used after ``release()``."""


class StalePoolError(CudaGraphLifecycleError):
    """A capture targets a pool whose graphs were all released while it still holds memory.

    On CUDA the same capture would trip ``use_count > 0 INTERNAL ASSERT FAILED`` and poison the process.
    """


class DefaultStreamCaptureError(CudaGraphLifecycleError):
    """A capture would begin on its device's default stream (raised by the sanitizer before torch runs it).

    torch refuses such a capture, but only after opening the CUDA RNG's capture, which it leaves open: every
    later eager random op of the process would fail.
    """


class PoolNotReleasedError(CudaGraphLifecycleError, AssertionError):
    """A released pool still holds graphs or memory (raised by the fresh-pool checks)."""


class ReplayCheckError(CudaGraphLifecycleError):
    """Checked mode: a replay wrote nothing to rows it must write, or its real rows depend on the padding."""


class OverwrittenOutputError(CudaGraphLifecycleError):
    """Checked mode: an output returned by one replay was used after a later replay of the same graph
    overwrote it (outputs are views of the graph's static buffers)."""


class CapturedAddressError(CudaGraphLifecycleError):
    """A tensor a captured graph reads (a weight, a static input, a cache) died or moved since the capture:
    the graph still reads the old address."""


class ExpandableSegmentsHazardError(CudaGraphLifecycleError):
    """With ``expandable_segments:True``, the last graph of a pool would be reset while blocks allocated in its
    captures are alive (raised by the sanitizer unless ``expandable_teardown="report"``, by the strict one always).
    Freeing such blocks after the teardown crashed torch 2.11 on the H200 (docs/gpu-results)."""


# the fix for a pool id kept across engines, in every message that finds one
FRESH_POOL_FIX = "Mint a fresh pool per engine (cudagraph_lifecycle.LazyPool) instead of keeping its id"
# the fix for a pool's last graph reset while blocks of it live, under expandable segments
EXPANDABLE_TEARDOWN_FIX = ("Drop (or copy out and drop) every output and tensor of the pool's captures before the "
                           "reset, so the graph goes last")
RECAPTURE_FIX = ("The engine that made the pool captures into it again after resetting all its graphs (an eviction, "
                 "a recapture at a new size): capture the new graph before resetting the old one (a pool lives "
                 "while one of its graphs is captured), or give the recapture a new pool id (graph_pool_handle() "
                 "again, or a new LazyPool)")




def stale_fix(owner: str | None, scope: str | None) -> str:
    """The fix for a capture into a dead pool: a kept id across engines, or a recapture within the engine
    that made the pool (``owner``, the scope that minted it, is the capturing ``scope``); both where no
    engine scope tells them apart (a program outside the plugin)."""
    if owner is not None and scope is not None:
        return RECAPTURE_FIX if owner == scope else FRESH_POOL_FIX
    return ("Give each capture that follows the reset of all of a pool's graphs a new pool id (graph_pool_handle() "
            "again, or a LazyPool per engine), or capture the new graph before resetting the old one (a pool lives "
            "while one of its graphs is captured)")


def first_line(e: BaseException) -> str:
    """An error's message's first line (its type's name where it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (``__cause__``, ``__context__``),
    outermost first: an engine that wraps torch's error in its own still failed for torch's reason."""
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 16:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out
