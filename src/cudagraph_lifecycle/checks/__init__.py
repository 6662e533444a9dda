"""Replay-correctness checks no engine ships: captured addresses that died or moved, outputs used after a
later replay overwrote them, poisoned padding and rows a replay never wrote, the op that broke a capture.
The runner runs them in checked mode (``CUDAGraphRunner(checked=True)``, ``CUDAGRAPH_CHECKED=1``, or any
sanitizer in ``strict`` mode)."""

from .addresses import AddressBook, named_tensors
from .capture_watch import CaptureWatch, WriteWatch, storage_key, user_frame
from .mode import CHECKS, enabled, selected
from .outputs import CheckedOutput, OutputGuard
from .padding import checked_replay

__all__ = ["CHECKS", "AddressBook", "CaptureWatch", "CheckedOutput", "OutputGuard",
           "WriteWatch", "checked_replay", "enabled", "named_tensors", "selected", "storage_key", "user_frame"]
