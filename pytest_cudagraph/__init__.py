"""pytest-cudagraph: the pytest face of cudagraph_lifecycle (load it with ``pytest -p cudagraph``)."""

__version__ = "0.2.0"  # the package's version (pyproject.toml); tests/test_packaging.py holds them equal

try:
    import cudagraph_lifecycle  # noqa: F401 - reads CUDAGRAPH_SANITIZE and its companions at its import
except Exception as e:
    # a bad value there: a usage error naming the variable (pytest's exit code 4, one line), not a traceback
    # out of loading a plugin
    if type(e).__module__ != "cudagraph_lifecycle.errors":
        raise
    import pytest

    raise pytest.UsageError(str(e)) from None

from .assertions import EngineCycleError, assert_fresh_pool, assert_no_graphs, assert_pool_released  # noqa: E402
from .records import EngineRecord  # noqa: E402
from .worker import RemoteError, ReusedWorker, WorkerCrashed, WorkerTimeout  # noqa: E402

__all__ = [
    "EngineCycleError",
    "EngineRecord",
    "RemoteError",
    "ReusedWorker",
    "WorkerCrashed",
    "WorkerTimeout",
    "assert_fresh_pool",
    "assert_no_graphs",
    "assert_pool_released",
]
