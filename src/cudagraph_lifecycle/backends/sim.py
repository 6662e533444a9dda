"""The simulated allocator world behind the ``Backend`` interface: ``SimBackend``.

It keeps what is the world's rather than the allocator's (devices, the current stream of each thread, the
capture under way, pool ids minted, a poisoned RNG) and answers the interface from the allocator's books
(``sim_allocator.py``: blocks, segments, use counts, erasing; ``sim_expandable.py`` under expandable
segments) and its graph-API objects (``sim_graph.py``: streams, MemPool, graphs, capture and replay).

The default pool holds what the backend's own factories (``randn``, ``empty``) allocate, with the same size
classes, so an engine whose weights or buffers outlive it grows the default pool as on CUDA. cuBLAS's
workspace is modeled: one per thread and stream (``WORKSPACE_BYTES``), made by the first matmul there and
kept for the process's life, in the pool of the capture it was made in, where that was inside one (measured
on the H100 and H200: docs/ARCHITECTURE.md). ``torch.cuda.graph``'s own capture stream
(``graph()`` without a stream) is not the library's ``capture_stream()``, as on CUDA.

``get_backend("sim")`` is the process's one simulated allocator (``SimBackend.process()``, built afresh in
a forked child); each ``SimBackend()`` built directly is an isolated world: a poisoned one does not poison
the Python process.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from .base import Backend, Block, GraphAPI, PoolId, PoolState, expandable_from_env
from .sim_allocator import (  # noqa: F401 - the allocator's names, offered here as well
    ASSERT_MESSAGE,
    DEFAULT_POOL,
    HOST_ASSERT_MESSAGE,
    LARGE_SEGMENT,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_SEGMENT,
    SMALL_SIZE,
    SimAllocator,
    round_size,
    segment_size,
    storage_key,
)
from .sim_graph import (  # noqa: F401 - the graph API's names, offered here as well
    _MISSING,
    CAPTURE_INVALIDATED_MESSAGE,
    CAPTURE_SYNC_MESSAGE,
    DEFAULT_STREAM_MESSAGE,
    POISON_MESSAGE,
    POOL_MESSAGE,
    REPLAY_MESSAGE,
    EagerBlasWatch,
    SimGraph,
    SimMemPool,
    SimStream,
)
from .workspaces import WORKSPACE_BYTES, ModeledWorkspaces  # noqa: F401 - offered here as well


class SimBackend(ModeledWorkspaces, Backend):
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
        expandable = expandable_from_env() if expandable_segments is None else bool(expandable_segments)
        self._alloc = SimAllocator(expandable, record_stacks)
        self._routing_open: set[tuple[int, PoolId]] = set()  # captures the allocator still believes underway
        self._user_ids = itertools.count(1)  # graph_pool_handle() and MemPool: (0, n)
        self._graph_ids = itertools.count(1)  # a capture with no pool: (n, 0)
        self._default_streams = [SimStream(d, default=True, backend=self) for d in range(devices)]
        self._streams = threading.local()  # as CUDA's, the current stream is each thread's own
        self._capturing: SimGraph | None = None
        self.poisoned: str | None = None
        # (thread, device, stream id) -> (the workspace's storage, its block's key): the storage alone, as the
        # library's C++ cache holds it (no tensor a holder search could name)
        self._workspaces: dict[tuple[int, int, int], tuple[torch.UntypedStorage, int]] = {}
        self._torch_capture_streams: dict[int, SimStream] = {}  # torch.cuda.graph's own, one per device

    @property
    def record_stacks(self) -> bool:
        """Whether a block keeps the stack that allocated it (``live_blocks``)."""
        return self._alloc.record_stacks

    @record_stacks.setter
    def record_stacks(self, on: bool) -> None:
        self._alloc.record_stacks = on

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

    # the allocator's pool rules; an assert poisons this world's RNG
    def _incref_pool(self, pool_id: PoolId, device: int) -> None:
        if not self._alloc.incref(pool_id, device):
            # The real allocator asserts here, after the capture's generator bookkeeping began:
            # nothing random works in this process afterwards.
            self.poisoned = POISON_MESSAGE
            raise RuntimeError(ASSERT_MESSAGE)

    def _incref_host_pool(self, pool_id: PoolId) -> None:
        if not self._alloc.incref_host(pool_id):
            self.poisoned = POISON_MESSAGE
            raise RuntimeError(HOST_ASSERT_MESSAGE)

    def _decref_host_pool(self, pool_id: PoolId) -> None:
        self._alloc.decref_host(pool_id)

    def host_empty_cache(self) -> None:
        """``torch._C._host_emptyCache()``: erase host pools at use_count 0 (captures hold no host block)."""
        self._alloc.host_empty_cache()

    def _decref_pool(self, pool_id: PoolId, device: int) -> None:
        self._alloc.decref(pool_id, device)

    def capture_invalidated(self) -> bool:
        return self._capturing is not None and self._capturing._invalidated

    def invalidation_probe(self) -> Callable[[], bool]:
        return self.capture_invalidated

    def would_assert(self, pool_id: PoolId, device: int = 0) -> bool:
        """The allocator's own verdict on a capture into ``pool_id`` now: True if it would assert
        (``use_count > 0`` on the device pool, or on the host allocator's ledger)."""
        return self._alloc.would_assert(tuple(pool_id), device)

    def _check_not_poisoned(self) -> None:
        self._collect_now()
        if self.poisoned:
            raise RuntimeError(self.poisoned)

    def _collect_now(self) -> None:
        self._alloc.collect()

    def expandable_segments(self) -> bool:
        return self._alloc.expandable

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
        # the first matmul on a stream without a workspace makes one: watched only until it exists
        watch = None if stream.default or self._has_workspace(stream) else EagerBlasWatch(self, stream)
        try:
            if watch is None:
                yield stream
            else:
                with watch:
                    yield stream
        finally:
            self._streams.current = prev

    @contextlib.contextmanager
    def graph(self, graph: SimGraph, pool: PoolId | None = None, stream: SimStream | None = None):
        self.synchronize()
        self.empty_cache()
        self.host_empty_cache()
        stream = stream or self.torch_capture_stream(self.current_device())
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
        self._alloc.empty_cache()

    # books
    def pool_state(self, pool_id: PoolId, device: int = 0) -> PoolState:
        return self._alloc.pool_state(tuple(pool_id), device)

    def pool_ids(self, device: int = 0) -> list[PoolId]:
        return self._alloc.pool_ids(device)

    def segments(self, device: int = 0) -> list[dict[str, Any]]:
        return self._alloc.segments(device)

    def memory_reserved(self, device: int = 0) -> int:
        return self._alloc.memory_reserved(device)

    def memory_allocated(self, device: int = 0) -> int:
        return self._alloc.memory_allocated(device)

    def live_blocks(self, pool_id: PoolId, device: int = 0) -> list[Block]:
        return self._alloc.live_blocks(tuple(pool_id), device)

    def record_history(self, on: bool = True) -> str | None:
        self.record_stacks = on
        return None

    def storage_span(self, t: torch.Tensor) -> tuple[int, int] | None:
        # a block is known by its storage's identity: one "address" per storage
        if t.device.type != "cpu" or t.is_meta:
            return None
        try:
            key = storage_key(t)
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
        return self._alloc.allocate_default(t, device)  # (another thread's, on its own stream: the default pool)

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
