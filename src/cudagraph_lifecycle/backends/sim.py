"""The caching allocator's private-pool rules, simulated on the CPU.

The rules (c10/cuda/CUDACachingAllocator.cpp; docs/ARCHITECTURE.md), nothing looser:

* capture into pool P: if P does not exist it is created with use_count 1; if it exists, ``use_count > 0``
  is asserted (the assert poisons the process), then use_count += 1;
* graph reset or destruction: use_count -= 1; at 0 the pool becomes *freeable*;
* ``empty_cache`` releases the fully free segments of freeable pools and erases a pool once it holds no
  segment; a live block pins its whole segment, and so its pool;
* a MemPool holds one reference of its own, so its pool never reaches 0 while the object lives;
* torch 2.11 keeps a second ledger of graph pools in the *host* caching allocator: a capture increfs the id
  there too (after the device incref), reset decrefs it, and only ``torch._C._host_emptyCache()`` erases a
  host pool at 0 (``torch.cuda.graph`` calls it; ``torch.cuda.empty_cache`` does not). A MemPool holds no
  host reference. A capture into an id whose host pool is at 0 asserts like the device one;
* after such an assert the CUDA RNG is poisoned for eager use (``torch.randn`` fails; other allocations,
  captures, and random ops inside a new capture work: measured on the H200);
* a capture invalidated by a host sync (``.item()``) raises at ``capture_end``; ``reset()`` then gives back
  neither pool reference (nor does its destructor: measured), the RNG is poisoned, and the allocator's
  record of the capture stays open (PyTorch #180395) until ``_cuda_endAllocateToPool`` closes it;
  ``empty_cache`` still works and eager allocations on the stream are not routed to the pool (measured).

What a capture allocated is observed, not assumed: a ``TorchDispatchMode`` active during the capture sees
every tensor the forward creates; a storage born inside the capture is a block of the pool, and a weak
reference to it tells when the block dies (an output the caller keeps, a clone whose autograd history keeps
saved activations). Blocks are placed in segments with the allocator's size classes, so "bytes of pool P"
means what it means on CUDA. Replay re-runs the recorded ops into the captured tensors, so outputs equal
eager.

The default pool holds what the backend's own factories (``randn``, ``empty``) allocate, with the same size
classes, so an engine whose weights or buffers outlive it grows the default pool as on CUDA; library
workspaces are not modeled.

``get_backend("sim")`` is the process's one simulated allocator (``SimBackend.process()``); each
``SimBackend()`` built directly is an isolated world: a poisoned one does not poison the Python process.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import signal
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # what the simulation observes captures with; public names only from torch 2.x on
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    _MISSING = None if hasattr(torch.UntypedStorage, "_new_with_weak_ptr") else "UntypedStorage._new_with_weak_ptr"
except ImportError as e:  # pragma: no cover - older or stripped torch builds
    StorageWeakRef, _MISSING = None, str(e)
    TorchDispatchMode = object

from ..trees import leaves, map_leaves
from .base import Backend, Block, GraphAPI, MiB, PoolId, PoolState, expandable_from_env
from .sim_expandable import ExpandablePool

DEFAULT_POOL: PoolId = (0, 0)  # where the backend's factories allocate; never a graph pool

# Size classes of the caching allocator.
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB  # blocks up to this size live in small segments
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB  # segment for a large block under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB

ASSERT_MESSAGE = (
    'it->second->use_count > 0 INTERNAL ASSERT FAILED at "c10/cuda/CUDACachingAllocator.cpp" '
    "(simulated by cudagraph_lifecycle.sim), please report a bug to PyTorch."
)
HOST_ASSERT_MESSAGE = (
    'it->second->use_count > 0 INTERNAL ASSERT FAILED at "ATen/core/CachingHostAllocator.h" '
    "(simulated by cudagraph_lifecycle.sim), please report a bug to PyTorch."
)
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

# Ops that need the host to wait for the device: illegal while a stream is capturing.
_HOST_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    if nbytes <= SMALL_SIZE:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    offset: int
    size: int
    ref: StorageWeakRef
    key: int
    stack: list[str] | None = None

    def alive(self) -> bool:
        return not self.ref.expired()


@dataclass(eq=False)
class _Segment:
    size: int
    small: bool
    blocks: list[_Block] = field(default_factory=list)

    def allocated(self) -> int:
        return sum(b.size for b in self.blocks)

    def free_gaps(self) -> list[tuple[int, int]]:
        """(offset, size) of each free region, lowest offset first: the segment's free blocks, coalesced."""
        gaps, cursor = [], 0
        for b in sorted(self.blocks, key=lambda b: b.offset):
            if b.offset > cursor:
                gaps.append((cursor, b.offset - cursor))
            cursor = b.offset + b.size
        if self.size > cursor:
            gaps.append((cursor, self.size - cursor))
        return gaps


@dataclass(eq=False)
class _Pool:
    pool_id: PoolId
    device: int
    use_count: int = 1
    segments: list = field(default_factory=list)  # _Segment; ExpandableSegment under expandable segments
    exp: ExpandablePool | None = None  # a private pool under expandable segments (sim_expandable.py)

    def __post_init__(self) -> None:
        if self.exp is not None:
            self.segments = self.exp.segments

    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    def allocated(self) -> int:
        return sum(s.allocated() for s in self.segments)

    def mapped(self) -> list:
        """Its segments that hold memory (an expandable segment whose pages were all unmapped holds none)."""
        return [s for s in self.segments if s.size]


class SimStream:
    """A stream on a simulated device. Only its identity matters: captures need a non-default one."""

    _ids = itertools.count(1)

    def __init__(self, device: int, default: bool = False, backend: SimBackend | None = None):
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


class SimMemPool:
    """``torch.cuda.MemPool`` on the simulated allocator: the object holds one reference to its pool."""

    def __init__(self, backend: SimBackend, device: int):
        self._backend = backend
        self.device = device
        self.id = backend._next_user_pool_id()
        backend._incref_pool(self.id, device, create=True)
        self._released = False

    def use_count(self) -> int:
        pool = self._backend._pools.get((self.device, self.id))
        return 0 if pool is None else pool.use_count

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
        if func in _HOST_SYNC_OPS:
            g._invalidated = True
            raise RuntimeError(CAPTURE_SYNC_MESSAGE)
        flat_in = leaves((args, kwargs))
        in_keys = {_storage_key(t) for t in flat_in if isinstance(t, torch.Tensor)}
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
            key = _storage_key(t)
            if key not in in_keys and key not in self.born and t.untyped_storage().nbytes() > 0:
                g._backend._allocate_block(g, t)
                self.born.add(key)
            slot = self.next_slot
            self.next_slot += 1
            self.slots[id(t)] = (weakref.ref(t), slot)
            weak = StorageWeakRef(t.untyped_storage()) if key in self.born else None
            outs.append((slot, weak, (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())))
        g._ops.append(_RecordedOp(func, t_args, t_kwargs, outs))
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class SimGraph:
    """``torch.cuda.CUDAGraph`` on the simulated allocator."""

    def __init__(self, backend: SimBackend):
        self._backend = backend
        self._pool: PoolId | None = None
        self._device: int | None = None
        self._mode: _CaptureMode | None = None
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
            # fail from then on (measured on the H200, docs/gpu-results/2026-12-04-run11)
            be.poisoned = POISON_MESSAGE
            raise RuntimeError(DEFAULT_STREAM_MESSAGE)
        if be._capturing is not None:
            raise RuntimeError("Cannot begin a capture while another capture is underway (simulated)")
        if self._captured:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph; call reset() first")
        device = stream.device
        self._stream = stream.id
        pool_id = tuple(pool) if pool is not None and tuple(pool) != (0, 0) else be._next_graph_pool_id()
        be._incref_pool(pool_id, device, create=True)  # may assert and poison
        be._incref_host_pool(pool_id)  # after the device incref: a host assert leaks that reference
        self._pool, self._device = pool_id, device
        self._holds_refs = True
        self._invalidated = False
        self._ops = []
        be._capturing = self
        self._thread = threading.get_ident()  # a dispatch mode sees its own thread's ops only
        self._mode = _CaptureMode(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        be = self._backend
        if be._capturing is not self:
            raise RuntimeError("capture_end() called without a matching capture_begin() (simulated)")
        self._mode.__exit__(None, None, None)
        self._mode = None
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


class SimBackend(Backend):
    """A CPU model of the CUDA caching allocator's private pools, with ``devices`` simulated devices.

    ``SimBackend()`` is an isolated world of its own; ``SimBackend.process()`` (what ``get_backend("sim")``
    returns) is the process's one simulated allocator.
    """

    name = "sim"
    isolates_in_process = True
    _worlds = itertools.count(1)
    _process: SimBackend | None = None
    _process_lock = threading.Lock()

    @classmethod
    def process(cls) -> SimBackend:
        """The process's one simulated allocator (a forked child builds its own)."""
        with cls._process_lock:
            if cls._process is None:
                cls._process = cls()
            return cls._process

    def __init__(self, devices: int = 2, record_stacks: bool = False, expandable_segments: bool | None = None):
        # expandable_segments: private pools follow sim_expandable.py (None: as PYTORCH_CUDA_ALLOC_CONF says,
        # like the real allocator); the default pool keeps the plain segments either way.
        if _MISSING is not None:
            from ..errors import BackendUnavailableError

            raise BackendUnavailableError(
                f"the simulated allocator needs torch's dispatch modes and weak storage references, which this "
                f"torch {torch.__version__} lacks ({_MISSING}): use torch >= 2.11")
        if not isinstance(devices, int) or devices < 1:
            from ..errors import ConfigError

            raise ConfigError(f"SimBackend(devices={devices!r}): give a positive int number of simulated devices")
        self._devices = devices
        self.world = ("sim", next(SimBackend._worlds))  # each SimBackend is its own allocator
        self._lock = threading.RLock()
        self._pools: dict[tuple[int, PoolId], _Pool] = {}
        self._freeable: set[tuple[int, PoolId]] = set()
        self._host_pools: dict[PoolId, int] = {}  # the host allocator's ledger: id -> use_count
        self._routing_open: set[tuple[int, PoolId]] = set()  # captures the allocator still believes underway
        self._user_ids = itertools.count(1)  # graph_pool_handle() and MemPool: (0, n)
        self._graph_ids = itertools.count(1)  # a capture with no pool: (n, 0)
        self._default_streams = [SimStream(d, default=True, backend=self) for d in range(devices)]
        self._streams = threading.local()  # as CUDA's, the current stream is each thread's own
        self._capturing: SimGraph | None = None
        self.poisoned: str | None = None
        self.record_stacks = record_stacks
        self._expandable = expandable_from_env() if expandable_segments is None else bool(expandable_segments)
        self._dangling: list[_Block] = []  # live blocks of pools erased under them (expandable segments)

    # devices
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._devices

    def torch_device(self, index: int) -> torch.device:
        self.check_device(index)
        return torch.device("cpu")

    @property
    def _current_stream(self) -> SimStream:
        return getattr(self._streams, "current", None) or self._default_streams[0]

    def current_device(self) -> int:
        return self._current_stream.device

    # pool ids
    def _next_user_pool_id(self) -> PoolId:
        return (0, next(self._user_ids))

    def _next_graph_pool_id(self) -> PoolId:
        return (next(self._graph_ids), 0)

    def graph_pool_handle(self) -> PoolId:
        return self._next_user_pool_id()

    def has_mempool(self) -> bool:
        return True

    def mempool(self, device: int = 0) -> SimMemPool:
        self.check_device(device)
        return SimMemPool(self, device)

    # the allocator's pool rules
    def _incref_pool(self, pool_id: PoolId, device: int, create: bool) -> None:
        with self._lock:
            key = (device, pool_id)
            pool = self._pools.get(key)
            if pool is None:
                self._pools[key] = _Pool(pool_id, device, exp=ExpandablePool() if self._expandable else None)
                return
            if pool.use_count <= 0:
                # The real allocator asserts here, after the capture's generator bookkeeping began:
                # nothing random works in this process afterwards.
                self.poisoned = POISON_MESSAGE
                raise RuntimeError(ASSERT_MESSAGE)
            pool.use_count += 1

    def _incref_host_pool(self, pool_id: PoolId) -> None:
        with self._lock:
            count = self._host_pools.get(pool_id)
            if count is None:
                self._host_pools[pool_id] = 1
                return
            if count <= 0:
                self.poisoned = POISON_MESSAGE
                raise RuntimeError(HOST_ASSERT_MESSAGE)
            self._host_pools[pool_id] = count + 1

    def _decref_host_pool(self, pool_id: PoolId) -> None:
        with self._lock:
            self._host_pools[pool_id] -= 1

    def host_empty_cache(self) -> None:
        """``torch._C._host_emptyCache()``: erase host pools at use_count 0 (captures hold no host block)."""
        with self._lock:
            for pid in [p for p, n in self._host_pools.items() if n == 0]:
                del self._host_pools[pid]

    def _decref_pool(self, pool_id: PoolId, device: int) -> None:
        with self._lock:
            key = (device, pool_id)
            pool = self._pools[key]
            pool.use_count -= 1
            assert pool.use_count >= 0, "use_count went negative"
            if pool.use_count == 0:
                self._freeable.add(key)

    def _allocate_block(self, graph: SimGraph, t: torch.Tensor) -> None:
        with self._lock:
            pool = self._pools[(graph._device, graph._pool)]
            if pool.exp is not None:
                self._place_expandable(pool, t, graph._stream)
            else:
                self._place(pool, t)

    def _place_expandable(self, pool: _Pool, t: torch.Tensor, stream: int) -> None:
        self._collect()
        size = round_size(t.untyped_storage().nbytes())
        seg, offset, size = pool.exp.allocate(size, size <= SMALL_SIZE, stream)
        stack = traceback.format_stack(limit=13)[:-4] if self.record_stacks else None
        seg.blocks.append(_Block(offset, size, StorageWeakRef(t.untyped_storage()), _storage_key(t), stack))

    def _allocate_default(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """A tensor made by the backend's factories: a block of the device's default pool."""
        with self._lock:
            key = (device, DEFAULT_POOL)
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(DEFAULT_POOL, device, use_count=0)
            self._place(pool, t)
        return t

    def _place(self, pool: _Pool, t: torch.Tensor) -> None:
        """Put a new storage's block in the pool as the caching allocator would."""
        self._collect()
        size = round_size(t.untyped_storage().nbytes())
        small = size <= SMALL_SIZE
        # Best fit over every free block of the size class in the pool (the smallest that fits, then the
        # oldest segment, then the lowest offset), as the caching allocator's get_free_block does.
        best: tuple[int, int, _Segment, int] | None = None
        for i, seg in enumerate(pool.segments):
            if seg.small != small:
                continue
            for off, gap in seg.free_gaps():
                if gap >= size and (best is None or (gap, i) < best[:2]):
                    best = (gap, i, seg, off)
        if best is None:
            seg = _Segment(segment_size(size), small)
            pool.segments.append(seg)
            off, gap = 0, seg.size
        else:
            gap, _, seg, off = best
        if not small and gap - size <= SMALL_SIZE:
            size = gap  # a large block is split only if more than 1 MiB would remain (should_split)
        stack = traceback.format_stack(limit=13)[:-4] if self.record_stacks else None
        seg.blocks.append(_Block(off, size, StorageWeakRef(t.untyped_storage()), _storage_key(t), stack))

    def _collect(self) -> None:
        """Return the blocks whose storage died to their segments' free space."""
        for pool in self._pools.values():
            for seg in pool.segments:
                if seg.blocks:
                    seg.blocks = [b for b in seg.blocks if b.alive()]
        if self._dangling and not all(b.alive() for b in self._dangling):
            # a block of a pool the allocator erased was freed: a use after free (sim_expandable.py)
            os.kill(os.getpid(), signal.SIGSEGV)

    def capture_invalidated(self) -> bool:
        return self._capturing is not None and self._capturing._invalidated

    def invalidation_probe(self) -> Callable[[], bool]:
        return self.capture_invalidated

    def would_assert(self, pool_id: PoolId, device: int = 0) -> bool:
        """The allocator's own verdict on a capture into ``pool_id`` now: True if it would assert
        (``use_count > 0`` on the device pool, or on the host allocator's ledger)."""
        with self._lock:
            pool = self._pools.get((device, tuple(pool_id)))
            return (pool is not None and pool.use_count <= 0) or self._host_pools.get(tuple(pool_id), 1) <= 0

    def _check_not_poisoned(self) -> None:
        self._collect_now()
        if self.poisoned:
            raise RuntimeError(self.poisoned)

    def _collect_now(self) -> None:
        with self._lock:
            self._collect()

    def expandable_segments(self) -> bool:
        return self._expandable

    # graphs and streams
    def new_graph(self) -> SimGraph:
        return SimGraph(self)

    def new_stream(self, device: int = 0) -> SimStream:
        self.check_device(device)
        return SimStream(device, backend=self)

    @contextlib.contextmanager
    def stream(self, stream: SimStream):
        prev = getattr(self._streams, "current", None)
        self._streams.current = stream
        try:
            yield stream
        finally:
            self._streams.current = prev

    @contextlib.contextmanager
    def graph(self, graph: SimGraph, pool: PoolId | None = None, stream: SimStream | None = None):
        self.synchronize()
        self.empty_cache()
        self.host_empty_cache()
        stream = stream or self.capture_stream(self.current_device())  # torch.cuda.graph's one default stream
        with self.stream(stream):
            graph.capture_begin(pool)
            try:
                yield graph
            finally:
                graph.capture_end()

    def synchronize(self, device: int | None = None) -> None:
        if self._capturing is not None:
            self._capturing._invalidated = True
            raise RuntimeError(CAPTURE_SYNC_MESSAGE)

    def empty_cache(self) -> None:
        if self._capturing is not None:
            raise RuntimeError("empty_cache() during a capture is not permitted (simulated)")
        with self._lock:
            self._collect()
            for key in sorted(self._freeable):
                pool = self._pools[key]
                if pool.exp is not None:
                    if pool.exp.release():  # may raise the allocator's cudaMalloc_count assert
                        self._dangling += [b for seg in pool.segments for b in seg.blocks]
                        del self._pools[key]
                        self._freeable.discard(key)
                    continue
                pool.segments = [s for s in pool.segments if s.blocks]
                if not pool.segments:
                    del self._pools[key]
                    self._freeable.discard(key)
            for (_, pid), pool in self._pools.items():
                if pid == DEFAULT_POOL:
                    pool.segments = [s for s in pool.segments if s.blocks]

    # books
    def pool_state(self, pool_id: PoolId, device: int = 0) -> PoolState:
        with self._lock:
            self._collect()
            pool = self._pools.get((device, tuple(pool_id)))
            if pool is None:
                return PoolState(tuple(pool_id), device, False, 0, 0, 0, 0)
            held = pool.mapped()
            # as CUDA shows it: a pool with no segment and no reference reads as gone (under expandable
            # segments the allocator may still keep it: sim_expandable.py)
            return PoolState(pool.pool_id, device, bool(held) or pool.use_count > 0, pool.use_count,
                             pool.reserved(), pool.allocated(), len(held))

    def pool_ids(self, device: int = 0) -> list[PoolId]:
        with self._lock:
            return sorted(p.pool_id for (d, pid), p in self._pools.items()
                          if d == device and p.mapped() and pid != DEFAULT_POOL)

    def segments(self, device: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            self._collect()
            return [{"address": id(seg), "size": seg.size, "allocated": seg.allocated(), "pool_id": p.pool_id,
                     "stream": 0, "small": seg.small} for (d, _), p in self._pools.items() if d == device
                    for seg in p.mapped()]

    def memory_reserved(self, device: int = 0) -> int:
        with self._lock:
            self._collect()
            return sum(p.reserved() for (d, _), p in self._pools.items() if d == device)

    def memory_allocated(self, device: int = 0) -> int:
        with self._lock:
            self._collect()
            return sum(p.allocated() for (d, _), p in self._pools.items() if d == device)

    def live_blocks(self, pool_id: PoolId, device: int = 0) -> list[Block]:
        with self._lock:
            self._collect()
            pool = self._pools.get((device, tuple(pool_id)))
            if pool is None:
                return []
            return [Block(b.size, "".join(b.stack or []), b.key, 1) for s in pool.segments for b in s.blocks]

    def record_history(self, on: bool = True) -> str | None:
        self.record_stacks = on
        return None

    def storage_span(self, t: torch.Tensor) -> tuple[int, int] | None:
        # a block is known by its storage's identity: one "address" per storage
        if t.device.type != "cpu" or t.is_meta:
            return None
        try:
            key = _storage_key(t)
        except (RuntimeError, NotImplementedError):
            return None
        return key, key + 1

    # tensors: blocks of the default pool, outside any capture
    def randn(self, *shape: int, device: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self.check_device(device)
        self._check_not_poisoned()
        return self._factory(torch.randn(*shape, dtype=dtype), device)

    def empty(self, *shape: int, device: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self.check_device(device)
        self._collect_now()
        return self._factory(torch.empty(*shape, dtype=dtype), device)

    def _factory(self, t: torch.Tensor, device: int) -> torch.Tensor:
        capturing = self._capturing
        if (capturing is not None and capturing._thread == threading.get_ident()) or t.untyped_storage().nbytes() == 0:
            return t  # inside a capture the capture's own mode books it in the graph's pool
        return self._allocate_default(t, device)  # (another thread's, on its own stream: the default pool)

    def release_pool_reference(self, pool_id: PoolId, device: int = 0) -> None:
        self._decref_pool(tuple(pool_id), device)

    def end_capture_routing(self, pool_id: PoolId, device: int = 0) -> bool:
        key = (device, tuple(pool_id))
        if key not in self._routing_open:
            return False
        self._routing_open.discard(key)
        return True

    @classmethod
    def graph_api(cls) -> GraphAPI:
        def mine(args) -> SimBackend | None:
            return args[0] if args and isinstance(args[0], SimBackend) else None

        def release(args, kwargs):
            be = mine(args)
            if be is None:
                return None
            device = args[2] if len(args) > 2 else kwargs.get("device", 0)
            return be, device, tuple(args[1]), -1

        return GraphAPI(
            kind="sim",
            graph_cls=SimGraph,
            graph_backend=operator.attrgetter("_backend"),  # no Python frame: captures are timed
            capture_device=lambda g: g._backend._current_stream.device,
            on_default_stream=lambda g: g._backend._current_stream.default,
            handles=((cls, "graph_pool_handle", lambda a, k, result: (mine(a), result)),),
            mempool_cls=SimMemPool,
            mempool_parse=lambda mp: (mp._backend, mp.device, tuple(mp.id)),
            device_flush=(cls, "empty_cache", lambda a, k: mine(a)),
            host_flush=(cls, "host_empty_cache", lambda a, k: mine(a)),
            pool_refs=((cls, "release_pool_reference", release),),
        )


def _forget_process_backend() -> None:
    SimBackend._process = None
    SimBackend._process_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_process_backend)
