"""The simulated allocator's graph-API objects: streams, ``MemPool``, ``CUDAGraph``, and what a capture
records and a replay re-runs.

The capture rules they follow (measured on the H200 with torch 2.11; docs/ARCHITECTURE.md):

* after a ``use_count > 0`` assert the CUDA RNG is poisoned for eager use (``torch.randn`` fails; other
  allocations, captures, and random ops inside a new capture work);
* a capture invalidated by a host sync (``.item()``) raises at ``capture_end``; ``reset()`` then gives back
  neither pool reference (nor does its destructor), the RNG is poisoned, and the allocator's record of the
  capture stays open (PyTorch #180395) until ``_cuda_endAllocateToPool`` closes it; ``empty_cache`` still
  works and eager allocations on the stream are not routed to the pool;
* a capture on the default stream is refused, after torch opened the RNG's capture: poisoned too.

What a capture allocated is observed, not assumed: a ``TorchDispatchMode`` active during the capture sees
every tensor the forward creates; a storage born inside the capture is a block of the pool
(``sim_allocator.py``), and a weak reference to it tells when the block dies (an output the caller keeps, a
clone whose autograd history keeps saved activations). Replay re-runs the recorded ops into the captured
tensors, so outputs equal eager.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

try:  # what the simulation observes captures with; public names only from torch 2.x on
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    _MISSING = None if hasattr(torch.UntypedStorage, "_new_with_weak_ptr") else "UntypedStorage._new_with_weak_ptr"
except ImportError as e:  # pragma: no cover - older or stripped torch builds
    StorageWeakRef, _MISSING = None, str(e)
    TorchDispatchMode = TorchFunctionMode = object

from ..trees import leaves, map_leaves
from .base import PoolId
from .sim_allocator import SimAllocator, storage_key

POISON_MESSAGE = "Offset increment outside graph capture encountered unexpectedly."
CAPTURE_SYNC_MESSAGE = "CUDA error: operation not permitted when stream is capturing (simulated)"
CAPTURE_INVALIDATED_MESSAGE = (
    "CUDA error: operation failed due to a previous error during capture (simulated)"
)
DEFAULT_STREAM_MESSAGE = (
    "CUDA graphs must be captured on a non-default stream. "
    "(However, after capture, it's ok to replay them on the default stream.)"
)
REPLAY_MESSAGE = "Called CUDAGraph::replay without a preceding successful capture."
POOL_MESSAGE = "Called CUDAGraph::pool() without a preceding successful capture."

HOST_COPY_MESSAGE = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is "
                     "pinned. (simulated)")
# Ops that need the host to wait for the device: illegal while a stream is capturing, and the capture is
# invalidated (``nonzero``, ``masked_select`` and a boolean mask's index wait for their output's size:
# measured on the H100 with torch 2.11, scripts/probes/host_reads.py, GPU run 36)
_HOST_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                  torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default}
_MASK_DTYPES = (torch.bool, torch.uint8)


def _host_sync(func: Any, args: tuple) -> bool:
    if func in _HOST_SYNC_OPS:
        return True
    # x[mask]: an index by a boolean tensor
    return func is torch.ops.aten.index.Tensor and len(args) > 1 and any(
        isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in args[1] or ())


class HostReadMode(TorchFunctionMode):
    """Active with a simulated capture: the host reads a dispatch mode cannot tell from a device op, the
    simulated device being the host. Copies to host memory (``tolist``, ``cpu``) raise and leave
    the capture valid; a print waits for the device (its formatting reads values) and invalidates the
    capture, as on CUDA (scripts/probes/host_reads.py). ``x.to("cpu")`` is not told apart: on ``sim`` the
    device is ``cpu``."""

    def __init__(self, graph: SimGraph):
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_COPIES:
            raise RuntimeError(HOST_COPY_MESSAGE)
        if func is torch.Tensor.__repr__:
            self.graph._invalidated = True
            raise RuntimeError(CAPTURE_SYNC_MESSAGE)
        return func(*args, **(kwargs or {}))


_HOST_COPIES = (torch.Tensor.tolist, torch.Tensor.cpu)
# Ops that run through cuBLAS on CUDA: the first one on a (thread, stream) makes that stream's workspace
# (SimBackend.library_workspace_for), in the capture's pool when it runs inside one.
BLAS_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten.baddbmm.default, torch.ops.aten.mv.default, torch.ops.aten.addmv.default})


_COMPOSITE: dict[Any, bool] = {}


def split_composite(mode: TorchDispatchMode, func: Any, args: tuple, kwargs: dict) -> Any:
    """Under ``torch.inference_mode`` an op with only a composite kernel (``linear``, ``matmul``, ``to``,
    ``reshape``) reaches a dispatch mode whole; with autograd on or off it arrives split into the ops that
    run (an ``addmm``, a ``_to_copy``). Split it here, inside ``mode``, so the simulation sees the ops CUDA
    runs in either case (a ``linear`` is a cuBLAS call). NotImplemented: ``func`` is not such an op."""
    composite = _COMPOSITE.get(func)
    if composite is None:
        name = getattr(func, "name", None)
        composite = _COMPOSITE[func] = callable(name) and hasattr(func, "decompose") and \
            torch._C._dispatch_has_kernel_for_dispatch_key(name(), "CompositeImplicitAutograd")
    if not composite:
        return NotImplemented
    with mode:
        return func.decompose(*args, **kwargs)


class SimWorld(Protocol):
    """What the objects here use of the simulated world they belong to: a ``SimBackend`` (sim.py, which
    imports this module; they are handed their world, and this module imports nothing of it)."""

    _alloc: SimAllocator
    _capturing: SimGraph | None
    _routing_open: set[tuple[int, PoolId]]
    poisoned: str | None

    @property
    def _current_stream(self) -> SimStream: ...

    def _collect_now(self) -> None: ...

    def _next_user_pool_id(self) -> PoolId: ...

    def _next_graph_pool_id(self) -> PoolId: ...

    def _incref_pool(self, pool_id: PoolId, device: int) -> None: ...

    def _decref_pool(self, pool_id: PoolId, device: int) -> None: ...

    def _incref_host_pool(self, pool_id: PoolId) -> None: ...

    def _decref_host_pool(self, pool_id: PoolId) -> None: ...

    def library_workspace_for(self, device: int, stream: int, into: tuple[int, PoolId] | None) -> None: ...


class SimStream:
    """A stream on a simulated device. Only its identity matters: captures need a non-default one."""

    _ids = itertools.count(1)

    def __init__(self, device: int, default: bool = False, backend: SimWorld | None = None):
        self.device = device
        self.default = default
        self.id = 0 if default else next(self._ids)
        self._backend = weakref.ref(backend) if backend is not None else None  # no cycle with its backend

    def wait_stream(self, other: SimStream) -> None:
        """Outside a capture simulated ops run in order on the host: nothing to wait for. A capture that forks
        onto another stream and joins back (fork/join) is not simulated: refused with the way out."""
        be = self._backend() if self._backend is not None else None
        graph = be._capturing if be is not None else None
        if graph is not None and graph._stream in (self.id, other.id) and self.id != other.id:
            raise RuntimeError("a capture that forks onto another stream (wait_stream inside the capture) cannot "
                               "be simulated: the sim backend captures on one stream; run this engine on cuda "
                               "(mark its test gpu)")

    def __repr__(self) -> str:
        return f"SimStream(device={self.device}, id={self.id})"


class EagerBlasWatch(TorchDispatchMode):
    """Active in a ``backend.stream(s)`` block whose stream has no library workspace for this thread yet: the
    first cuBLAS op there makes it, outside any capture, in the default pool (as an engine's warm-up on its
    capture stream does on CUDA). Inside a capture, the capture's own mode made it in the pool first."""

    def __init__(self, backend: SimWorld, stream: SimStream):
        super().__init__()
        self.backend, self.stream = backend, stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        split = split_composite(self, func, args, kwargs or {})
        if split is not NotImplemented:
            return split
        if func in BLAS_OPS:
            self.backend.library_workspace_for(self.stream.device, self.stream.id, None)
        return func(*args, **(kwargs or {}))


class SimMemPool:
    """``torch.cuda.MemPool`` on the simulated allocator: the object holds one reference to its pool."""

    def __init__(self, backend: SimWorld, device: int):
        self._backend = backend
        self.device = device
        self.id = backend._next_user_pool_id()
        backend._incref_pool(self.id, device)
        self._released = False

    def use_count(self) -> int:
        return self._backend._alloc.use_count(self.id, self.device)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._backend._decref_pool(self.id, self.device)

    def __del__(self) -> None:  # mirrors ~MemPool
        try:  # (no module global here: at interpreter exit they may be None already)
            self.release()
        except Exception:
            pass


class _Slot:
    """A recorded op's argument that is an earlier op's output (a leaf to trees.map_leaves, not a dataclass)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


@dataclass
class _RecordedOp:
    func: Any
    args: Any
    kwargs: Any
    outs: list[tuple[int, StorageWeakRef | None, tuple]]  # (slot, weak storage if born, meta)


class _CaptureMode(TorchDispatchMode):
    """Sees every op of a simulated capture: registers new storages as pool blocks and records the ops."""

    def __init__(self, graph: SimGraph):
        super().__init__()
        self.graph = graph
        self.slots: dict[int, tuple[weakref.ref, int]] = {}
        self.next_slot = 0
        self.born: set[int] = set()  # storage keys born in this capture

    def _slot_of(self, t: torch.Tensor) -> int | None:
        entry = self.slots.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.graph
        if _host_sync(func, args):
            g._invalidated = True
            raise RuntimeError(CAPTURE_SYNC_MESSAGE)
        split = split_composite(self, func, args, kwargs)
        if split is not NotImplemented:
            return split
        if func in BLAS_OPS:
            g._backend.library_workspace_for(g._device, g._stream, (g._device, g._pool))
        flat_in = leaves((args, kwargs))
        in_keys = {storage_key(t) for t in flat_in if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)

        def to_template(x):
            if isinstance(x, torch.Tensor):
                slot = self._slot_of(x)
                return _Slot(slot) if slot is not None else x
            return x

        t_args = map_leaves(to_template, args)
        t_kwargs = map_leaves(to_template, kwargs)
        outs = []
        flat_out = leaves(out)
        for t in flat_out:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if key not in in_keys and key not in self.born and t.untyped_storage().nbytes() > 0:
                g._backend._alloc.allocate((g._device, g._pool), t, g._stream)
                self.born.add(key)
            slot = self.next_slot
            self.next_slot += 1
            self.slots[id(t)] = (weakref.ref(t), slot)
            weak = StorageWeakRef(t.untyped_storage()) if key in self.born else None
            outs.append((slot, weak, (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())))
        g._ops.append(_RecordedOp(func, t_args, t_kwargs, outs))
        return out


class SimGraph:
    """``torch.cuda.CUDAGraph`` on the simulated allocator."""

    def __init__(self, backend: SimWorld):
        self._backend = backend
        self._pool: PoolId | None = None
        self._device: int | None = None
        self._mode: _CaptureMode | None = None
        self._reads: HostReadMode | None = None
        self._ops: list[_RecordedOp] = []
        self._captured = False  # capture_end ran: the graph holds a pool reference until reset
        self._replayable = False
        self._invalidated = False
        self._ever_captured = False
        self._holds_refs = False
        self._stream = 0
        self._thread: int | None = None

    # capture
    def capture_begin(self, pool: PoolId | None = None, capture_error_mode: str = "global") -> None:
        be = self._backend
        be._collect_now()
        stream = be._current_stream
        if stream.default:
            # torch opens the RNG's capture before it checks the stream, and leaves it open: eager random ops
            # fail from then on (measured on the H200 in run 11, 2026-12-04; in git history under docs/gpu-results/)
            be.poisoned = POISON_MESSAGE
            raise RuntimeError(DEFAULT_STREAM_MESSAGE)
        if be._capturing is not None:
            raise RuntimeError("Cannot begin a capture while another capture is underway (simulated)")
        if self._captured:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph; call reset() first")
        device = stream.device
        self._stream = stream.id
        pool_id = tuple(pool) if pool is not None and tuple(pool) != (0, 0) else be._next_graph_pool_id()
        be._incref_pool(pool_id, device)  # may assert and poison
        be._incref_host_pool(pool_id)  # after the device incref: a host assert leaks that reference
        self._pool, self._device = pool_id, device
        self._holds_refs = True
        self._invalidated = False
        self._ops = []
        be._capturing = self
        self._thread = threading.get_ident()  # a dispatch mode sees its own thread's ops only
        self._mode = _CaptureMode(self)
        self._mode.__enter__()
        self._reads = HostReadMode(self)
        self._reads.__enter__()

    def capture_end(self) -> None:
        be = self._backend
        if be._capturing is not self:
            raise RuntimeError("capture_end() called without a matching capture_begin() (simulated)")
        self._reads.__exit__(None, None, None)
        self._mode.__exit__(None, None, None)
        self._mode = self._reads = None
        be._capturing = None
        if self._invalidated:
            # torch 2.11: the graph never counts as captured, so reset() gives no pool reference back,
            # the RNG's capture bookkeeping is left open, and so is the allocator's capture record
            # (capture_end throws before endAllocateToPool: PyTorch #180395).
            self._ops = []
            be.poisoned = POISON_MESSAGE
            be._routing_open.add((self._device, self._pool))
            raise RuntimeError(CAPTURE_INVALIDATED_MESSAGE)
        self._captured = True  # the pool references are now the graph's, given back by reset()
        self._replayable = True
        self._ever_captured = True

    def replay(self) -> None:
        if not self._replayable:
            raise RuntimeError(REPLAY_MESSAGE)
        env: dict[int, torch.Tensor] = {}

        def resolve(x):
            return env[x.index] if isinstance(x, _Slot) else x

        for op in self._ops:
            out = op.func(*map_leaves(resolve, op.args), **map_leaves(resolve, op.kwargs))
            flat_out = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
            for t, (slot, weak, meta) in zip(flat_out, op.outs):
                env[slot] = t
                if weak is not None:
                    _copy_into_storage(weak, meta, t)

    def reset(self) -> None:
        if self._captured:
            self._captured = False
            self._replayable = False
            self._ops = []
            self._give_back()

    def _give_back(self) -> None:
        if self._holds_refs:
            self._holds_refs = False
            self._backend._decref_pool(self._pool, self._device)
            self._backend._decref_host_pool(self._pool)

    def pool(self) -> PoolId:
        if not self._ever_captured:  # as on CUDA: the id is readable only after a successful capture
            raise RuntimeError(POOL_MESSAGE)
        return self._pool

    def __del__(self) -> None:  # ~CUDAGraph resets (a failed capture's references stay: measured)
        try:  # (no module global here: at interpreter exit they may be None already)
            self.reset()
        except Exception:
            pass


def _copy_into_storage(weak: StorageWeakRef, meta: tuple, value: torch.Tensor) -> None:
    storage = torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
    if storage is None:
        return
    dtype, shape, stride, offset = meta
    target = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    if target.data_ptr() != value.data_ptr():
        target.copy_(value)
