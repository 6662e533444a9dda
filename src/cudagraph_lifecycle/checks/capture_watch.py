"""What a capture did, watched op by op in checked mode: the tensors it read from outside its own pool
(weights, static inputs, caches: their storages and addresses), and the first op that broke it.

A capture fails either at the op that broke it (a host sync raises there) or later, at ``capture_end``, when
an op silently invalidated it (CUDA reports a previous error during capture). The watch records the op that
raised, or the first op after which the backend says the capture is no longer valid, with its Python frame.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ..trees import leaves

try:  # the same machinery the simulated allocator uses
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - torch builds without them: checked mode is then unavailable
    StorageWeakRef, TorchDispatchMode = None, object

_OWN = ("cudagraph_lifecycle" + os.sep, os.sep + "torch" + os.sep)


def user_frame(tb_or_frame: Any = None) -> str:
    """The innermost frame outside torch and this library, as 'file:line in function'."""
    if tb_or_frame is not None and hasattr(tb_or_frame, "tb_frame"):
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(tb_or_frame)]
    else:
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(tb_or_frame or sys._getframe(1))]
    for filename, lineno, name in reversed(frames):
        if not any(own in filename for own in _OWN):
            return f"{filename}:{lineno} in {name}"
    return "(no frame outside torch)"


@dataclass
class ReadStorage:
    """A storage a graph read that was not born in its capture."""

    ref: Any  # StorageWeakRef: tells when the storage dies, keeps nothing alive
    address: int
    nbytes: int
    ops: list[str] = field(default_factory=list)


class CaptureWatch(TorchDispatchMode):
    """Active during one capture: records external reads and the first op that broke the capture."""

    def __init__(self, invalidated) -> None:
        super().__init__()
        self._invalidated = invalidated  # () -> bool: has the backend's capture been invalidated?
        self.born: set[int] = set()
        self.reads: dict[int, ReadStorage] = {}
        self.offender: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)  # "aten.mm.default": the readable form is the op without its default overload
        if name.endswith(".default"):
            name = name[: -len(".default")]
        for t in leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.born:
                    read = self.reads.get(key)
                    if read is None:
                        read = self.reads[key] = ReadStorage(StorageWeakRef(st), st.data_ptr(), st.nbytes())
                    if name not in read.ops:
                        read.ops.append(name)
        try:
            out = func(*args, **kwargs)
        except BaseException:
            if self.offender is None:
                self.offender = f"{name} at {user_frame()}"
            raise
        for t in leaves(out):
            if isinstance(t, torch.Tensor):
                self.born.add(t.untyped_storage()._cdata)
        if self.offender is None and self._invalidated():
            self.offender = f"{name} at {user_frame()} (the capture was invalid after it)"
        return out
