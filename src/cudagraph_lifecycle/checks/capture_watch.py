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
from dataclasses import dataclass
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
    op: str  # the first op that read it


_Tensor = torch.Tensor  # one global lookup per isinstance instead of two
# A tensor's storage identity (the StorageImpl's address, as ``untyped_storage()._cdata``) without making a
# storage object: half the cost per tensor, and most tensors an op passes are seen for their identity only.
_storage_id = getattr(torch._C, "_storage_id", None) or (lambda t: t.untyped_storage()._cdata)
storage_key = _storage_id
# op -> (readable name, what to call, the arguments it writes, whether its outputs alias an argument)
_OPS: dict[Any, tuple[str, Any, tuple, bool]] = {}


def _written(func: Any) -> tuple:
    """The positions and keyword names of the tensor arguments ``func`` writes in place (``add_``'s self,
    ``index_copy_``'s self, an ``out=``): () for the ops that write none, most of them."""
    schema = getattr(func, "_schema", None)
    if schema is None or not getattr(schema, "is_mutable", False):
        return ()
    return tuple(i if not a.kwarg_only else a.name for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _aliases(func: Any) -> bool:
    """May ``func`` return a view of an argument or the argument itself (``slice``, ``view``, ``add_``)? Such an
    output's storage is the argument's, not one born in the capture, unless the op copied: ``to``, ``reshape``
    and ``contiguous`` say they alias but copy where they must, and under ``torch.inference_mode`` they reach
    a dispatch mode whole, undecomposed. So the watches look at such an op's outputs' storages. No schema:
    taken as born (an output wrongly taken as read from outside would be reported as freed once it dies)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _tensors(items: Any):
    """The tensors in ``items``, in its lists and tuples too (aten ops pass no dicts: ``trees.leaves``, which
    also walks dicts and dataclasses, costs more on this path, taken once per captured op)."""
    for t in items:
        if isinstance(t, _Tensor):
            yield t
        elif isinstance(t, (list, tuple)):
            yield from _tensors(t)


def _op(func: Any) -> tuple[str, Any, tuple, bool]:
    entry = _OPS.get(func)
    if entry is None:
        name = str(func)  # "aten.mm.default": the readable form is the op without its default overload
        if name.endswith(".default"):
            name = name[: -len(".default")]
        # An OpOverload's own __call__ only forwards to its C++ op: call that directly, one frame less per op.
        entry = _OPS[func] = (name, getattr(func, "_op", func), _written(func), _aliases(func))
    return entry


class WriteWatch(TorchDispatchMode):
    """Active during one capture: records the storages from outside it that its ops write in place (a KV
    cache, a step counter). A replay changes them, so a check that replays an extra time must put them back
    (``checks/padding.py``). What the padding check needs where the full op watch is off for a graph."""

    offender: str | None = None  # (the full watch's: the op that broke the capture)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps a mode's __torch_dispatch__ in a dynamo-disable wrapper: ~2 of an empty
        # mode's ~9 us per op on the H200's host (measured). Captured forwards run eagerly, and compiled ones
        # (eager, aot_eager, inductor, a graph break) watched the same with and without it: the watch opts out.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.born: set[int] = set()
        self.writes: dict[int, Any] = {}  # storage key -> StorageWeakRef

    def _born(self, out: Any) -> None:
        if isinstance(out, _Tensor):  # the common output, without a generator
            self.born.add(_storage_id(out))
        else:
            self.born.update(_storage_id(t) for t in _tensors((out,)))

    def _born_copies(self, out: Any, args: tuple, kwargs: dict | None) -> None:
        """An op that may alias an argument: its outputs on a storage none of its arguments has are born."""
        keys = {_storage_id(t) for t in _tensors((args, tuple(kwargs.values())) if kwargs else args)}
        for t in _tensors((out,)):
            key = _storage_id(t)
            if key not in keys:
                self.born.add(key)

    def _wrote(self, written: tuple, args: tuple, kwargs: dict) -> None:
        for w in written:
            t = kwargs.get(w) if isinstance(w, str) else (args[w] if w < len(args) else None)
            if isinstance(t, _Tensor):
                key = _storage_id(t)
                if key not in self.born and key not in self.writes:
                    self.writes[key] = StorageWeakRef(t.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _, call, written, aliases = _OPS.get(func) or _op(func)
        if written:
            self._wrote(written, args, kwargs or {})
        out = call(*args, **kwargs) if kwargs else call(*args)
        if not aliases:
            self._born(out)
        else:  # (a view of an argument, a KV cache's slice, has that argument's storage: not born)
            self._born_copies(out, args, kwargs)
        return out


class CaptureWatch(WriteWatch):
    """Active during one capture: records external reads, the writes a :class:`WriteWatch` records, and the
    first op that broke the capture.

    Every op of a capture passes through here, so the path is kept short: the op's name is computed once per
    op kind, arguments are walked directly (aten ops take tensors and lists of them, never dicts), a storage is
    known by its id without making a storage object, and one already read or born is skipped at once.
    """

    def __init__(self, invalidated: Callable[[], bool] | None, known: dict[int, tuple] | None = None) -> None:
        """``known``: shared by the watches of one capture set (storage key -> (its read, the storage)), so a
        storage every graph reads (a weight) is looked at once a set: the first look (a weak reference, its
        address and size) is most of what the watch adds to an op. Its entries hold their storages until the
        set ends, so a key cannot come to name another storage meanwhile."""
        super().__init__()
        self._invalidated = invalidated  # () -> bool: has the backend's capture been invalidated? (None: unknown)
        self.reads: dict[int, ReadStorage] = {}
        self._known: dict[int, tuple] = {} if known is None else known

    def _read(self, t: Any, key: int, name: str) -> None:
        known = self._known.get(key)
        if known is None:
            st = t.untyped_storage()
            nbytes = st.nbytes()
            if not nbytes:
                return
            known = self._known[key] = (ReadStorage(StorageWeakRef(st), st.data_ptr(), nbytes, name), st)
        self.reads[key] = known[0]

    def _read_all(self, items: Any, name: str) -> None:
        for t in items:
            if isinstance(t, _Tensor):
                key = _storage_id(t)
                if key not in self.born and key not in self.reads:
                    self._read(t, key, name)
            elif isinstance(t, (list, tuple)):
                self._read_all(t, name)

    def _failed(self, name: str) -> None:
        if self.offender is None:
            self.offender = f"{name} at {user_frame()}"

    def _after(self, name: str) -> None:
        if self.offender is None and self._invalidated():
            self.offender = f"{name} at {user_frame()} (the capture was invalid after it)"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, call, written, aliases = _OPS.get(func) or _op(func)
        if written:
            self._wrote(written, args, kwargs or {})
        born, reads, known = self.born, self.reads, self._known
        for a in args:  # inlined: the common argument is a tensor, read by an earlier graph of the set
            if isinstance(a, _Tensor):
                key = _storage_id(a)
                if key not in born and key not in reads:
                    seen = known.get(key)
                    if seen is None:
                        self._read(a, key, name)
                    else:
                        reads[key] = seen[0]
            elif isinstance(a, (list, tuple)):
                self._read_all(a, name)
        if kwargs:
            self._read_all(kwargs.values(), name)
        try:
            out = call(*args, **kwargs) if kwargs else call(*args)
        except BaseException:
            self._failed(name)
            raise
        if aliases:  # (as in WriteWatch; inlined for the common output, one tensor)
            self._born_copies(out, args, kwargs)
        elif isinstance(out, _Tensor):
            born.add(_storage_id(out))
        else:
            self._born(out)
        if self._invalidated is not None:
            self._after(name)
        return out
