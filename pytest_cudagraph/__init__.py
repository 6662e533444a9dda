"""pytest-cudagraph: the pytest face of cudagraph_lifecycle (load it with ``pytest -p cudagraph``)."""

from .assertions import EngineCycleError, assert_fresh_pool, assert_no_graphs, assert_pool_released
from .worker import RemoteError, ReusedWorker, WorkerCrashed, WorkerTimeout

__all__ = [
    "EngineCycleError",
    "RemoteError",
    "ReusedWorker",
    "WorkerCrashed",
    "WorkerTimeout",
    "assert_fresh_pool",
    "assert_no_graphs",
    "assert_pool_released",
]
