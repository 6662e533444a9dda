"""What a capture did, watched op by op in checked mode: the tensors it read from outside its own pool
(weights, static inputs, caches: their storages and addresses), and the first op that broke it.

A capture fails either at the op that broke it (a host sync raises there) or later, at ``capture_end``, when
an op silently invalidated it. The watch records the op that raised, or the first op after which the backend
says the capture is no longer valid (where it can tell: torch gives no way to on CUDA), with its frame.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

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


_Tensor = torch.Tensor  # one global lookup per isinstance instead of two
_OPS: dict[Any, tuple[str, Any]] = {}  # op -> (readable name, what to call)


def _op(func: Any) -> tuple[str, Any]:
    entry = _OPS.get(func)
    if entry is None:
        name = str(func)  # "aten.mm.default": the readable form is the op without its default overload
        if name.endswith(".default"):
            name = name[: -len(".default")]
        # An OpOverload's own __call__ only forwards to its C++ op: call that directly, one frame less per op.
        entry = _OPS[func] = (name, getattr(func, "_op", func))
    return entry


class CaptureWatch(TorchDispatchMode):
    """Active during one capture: records external reads and the first op that broke the capture.

    Every op of a capture passes through here, so the path is kept short (on the H200's host the watch cost
    ~21 us per op, now ~12, over an empty mode's ~9, measured): the op's name is computed once per op,
    arguments are walked directly (aten ops take tensors and lists of them, never dicts), and a storage already
    judged for an op is skipped at once.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps a mode's __torch_dispatch__ in a dynamo-disable wrapper: ~2 of an empty
        # mode's ~9 us per op on the H200's host (measured). Captured forwards run eagerly, and compiled ones
        # (eager, aot_eager, inductor, a graph break) watched the same with and without it: the watch opts out.
        return False

    def __init__(self, invalidated: Callable[[], bool] | None) -> None:
        super().__init__()
        self._invalidated = invalidated  # () -> bool: has the backend's capture been invalidated? (None: unknown)
        self.born: set[int] = set()
        self.reads: dict[int, ReadStorage] = {}
        self.offender: str | None = None
        self._ops: dict[Any, tuple[str, Any, set[int]]] = {}  # op -> (name, call, storages judged for it)

    def _entry(self, func: Any) -> tuple[str, Any, set[int]]:
        entry = self._ops[func] = (*(_OPS.get(func) or _op(func)), set())
        return entry

    def _read(self, st: Any, key: int, name: str) -> None:
        read = self.reads.get(key)
        if read is None:
            nbytes = st.nbytes()
            if nbytes:
                self.reads[key] = ReadStorage(StorageWeakRef(st), st.data_ptr(), nbytes, [name])
        else:
            read.ops.append(name)

    def _read_all(self, items: Any, name: str, seen: set[int]) -> None:
        for t in items:
            if isinstance(t, _Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.born and key not in seen:
                    seen.add(key)
                    self._read(st, key, name)
            elif isinstance(t, (list, tuple)):
                self._read_all(t, name, seen)

    def _born(self, out: Any) -> None:
        if isinstance(out, _Tensor):
            self.born.add(out.untyped_storage()._cdata)
        elif isinstance(out, (list, tuple)):
            for t in out:
                self._born(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, call, seen = self._ops.get(func) or self._entry(func)
        born = self.born
        for a in args:  # inlined: the common argument is a tensor
            if isinstance(a, _Tensor):
                st = a.untyped_storage()
                key = st._cdata
                if key not in born and key not in seen:
                    seen.add(key)
                    self._read(st, key, name)
            elif isinstance(a, (list, tuple)):
                self._read_all(a, name, seen)
        if kwargs:
            self._read_all(kwargs.values(), name, seen)
        try:
            out = call(*args, **kwargs) if kwargs else call(*args)
        except BaseException:
            if self.offender is None:
                self.offender = f"{name} at {user_frame()}"
            raise
        if isinstance(out, _Tensor):
            born.add(out.untyped_storage()._cdata)
        else:
            self._born(out)
        if self.offender is None and self._invalidated is not None and self._invalidated():
            self.offender = f"{name} at {user_frame()} (the capture was invalid after it)"
        return out
