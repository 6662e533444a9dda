"""The reused worker: a long-lived child process that runs callables in order and keeps its state between
calls, as a reused MPI rank does (``ReusedWorker``). The names the plugin, its tests and its users import,
from the files that hold them: ``reused`` (ReusedWorker), ``process`` (the child from the parent's side),
``protocol`` (calls and replies), ``crash`` (a crashed or hung child as a report), ``child`` (the child's side).
"""

from .child import attribute_to, freeze_startup_heap, ledger_seq, poisoned_since, program_findings
from .crash import (
    HAZARD_VAR,
    WorkerCrashed,
    WorkerTimeout,
    crash_frames,
    describe_hazards,
    hang_frames,
    read_hazards,
)
from .process import START_METHODS, TAG_VAR, cuda_initialized, resolve_start_method
from .protocol import (
    HIDE_WORKER_ERRORS,
    RemoteError,
    UnpicklableCallableError,
    WorkerError,
    current_test,
    dumps,
    dumps_call,
    poisons,
)
from .reused import ReusedWorker, close_all_workers, finding_key

__all__ = [
    "HAZARD_VAR",
    "HIDE_WORKER_ERRORS",
    "START_METHODS",
    "TAG_VAR",
    "RemoteError",
    "ReusedWorker",
    "UnpicklableCallableError",
    "WorkerCrashed",
    "WorkerError",
    "WorkerTimeout",
    "attribute_to",
    "close_all_workers",
    "crash_frames",
    "cuda_initialized",
    "current_test",
    "describe_hazards",
    "dumps",
    "dumps_call",
    "finding_key",
    "freeze_startup_heap",
    "hang_frames",
    "ledger_seq",
    "poisoned_since",
    "poisons",
    "program_findings",
    "read_hazards",
    "resolve_start_method",
]
