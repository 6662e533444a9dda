"""What the runner, the pool and the checks need from an allocator backend.

Two implementations stand behind this interface: ``cuda`` (real ``torch.cuda``) and ``sim`` (the caching
allocator's private-pool rules on the CPU). Code above this layer never asks which one it runs on.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

PoolId = tuple[int, int]
MiB = 1 << 20


def expandable_from_env(environ: dict[str, str] | None = None) -> bool:
    """Whether the caching allocator runs with ``expandable_segments:True``, as PyTorch reads it at start:
    ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), comma-separated ``key:value`` pairs."""
    env = os.environ if environ is None else environ
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    settings = dict(kv.split(":", 1) for kv in conf.replace(" ", "").split(",") if ":" in kv)
    return settings.get("expandable_segments", "").lower() in ("true", "1")


@dataclass(frozen=True)
class PoolState:
    """The allocator's books for one private pool on one device.

    ``exists`` is False once the allocator erased the pool (its id may then be created afresh).
    ``use_count`` is None where the backend cannot read it. A pool whose graphs were all released
    (use_count 0) but that still holds a segment is *dead*: capturing into it again trips the allocator's
    ``use_count > 0`` assert.
    """

    pool_id: PoolId
    device: int
    exists: bool
    use_count: int | None
    reserved_bytes: int
    allocated_bytes: int
    segments: int

    @property
    def dead(self) -> bool:
        return self.exists and self.use_count == 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pool_id"] = list(self.pool_id)
        return d


Hook = tuple[Any, str, Callable[..., Any]]  # (owner, attribute name, parse: the call -> what it did)


@dataclass(frozen=True)
class GraphAPI:
    """Where one backend kind's graph API lives, and how to read an observed call of it.

    The observation layer (``cudagraph_lifecycle.observe``) wraps these attributes once per process and feeds
    the ledger from what it sees; it never asks which backend it is watching. Each ``parse`` returns the
    :class:`Backend` (allocator world) the call belongs to, plus what it did, or None when the call is not one
    this kind answers for.

    * ``graph_cls``: the class whose ``capture_begin``, ``capture_end`` and ``reset`` are wrapped;
      ``graph_backend(graph)`` and ``capture_device(graph)`` read a graph's world and the device it captures on
      (``current_device()``, where given, reads the latter without a Python call, and ``process_cls._process``,
      where given and set, the former: captures are timed). ``on_default_stream(graph)``: whether a capture
      begun now would be on its device's default stream, which torch refuses only after opening the CUDA RNG's
      capture (every later eager random op then fails), so a judge can refuse it first;
      ``current_stream(device)`` and ``default_stream(device)``, where given, read it without a Python frame
      (their first items compared; captures are timed).
    * ``handles``: functions returning a new pool id; ``parse(args, kwargs, result) -> (backend, pool_id)``.
    * ``mempool_cls`` and ``mempool_parse(mp) -> (backend, device, pool_id)``: pool objects that hold a device
      reference of their own while alive.
    * ``device_flush`` / ``host_flush``: ``empty_cache`` and the host allocator's flush;
      ``parse(args, kwargs) -> backend``.
    * ``pool_refs``: functions that take (+1) or give back (-1) one device reference to a pool outside any graph;
      ``parse(args, kwargs) -> (backend, device, pool_id, delta)``.
    """

    kind: str
    graph_cls: type
    graph_backend: Callable[[Any], Backend | None]
    capture_device: Callable[[Any], int]
    current_device: Callable[[], int] | None = None
    process_cls: type | None = None  # one world per process: every graph's backend is this class's ``_process``
    on_default_stream: Callable[[Any], bool] | None = None
    current_stream: Callable[[int], Any] | None = None
    default_stream: Callable[[int], Any] | None = None
    handles: tuple[Hook, ...] = ()
    mempool_cls: type | None = None
    mempool_parse: Callable[[Any], tuple] | None = None
    device_flush: Hook | None = None
    host_flush: Hook | None = None
    pool_refs: tuple[Hook, ...] = ()


@dataclass(frozen=True)
class Block:
    """One live block of a private pool: its size, where it was allocated when that was recorded, and where
    it lies, ``[address, address + extent)`` in the units of :meth:`Backend.storage_span` (None where
    unknown; the extent is its size where addresses are bytes)."""

    size: int
    stack: str = ""
    address: int | None = None
    extent: int | None = None

    @property
    def span(self) -> tuple[int, int] | None:
        if self.address is None:
            return None
        return self.address, self.address + max(self.size if self.extent is None else self.extent, 1)


class Backend(ABC):
    """One allocator world: devices, pool ids, graphs, streams and the books of every private pool.

    ``get_backend(kind)`` returns the process's one object of each kind; ``world`` names the allocator it
    models, so records made through different objects of one allocator agree.
    """

    name: str = "base"
    world: object = "base"
    # True where an isolated world can be built in this process (the simulated allocator); the real one
    # exists once per process, so a scenario that must not share it runs in a process of its own.
    isolates_in_process: bool = False

    # devices
    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def torch_device(self, index: int) -> torch.device: ...

    @abstractmethod
    def current_device(self) -> int: ...

    def check_device(self, index: int) -> int:
        n = self.device_count()
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
            from ..errors import ConfigError

            raise ConfigError(
                f"device index {index!r} is not valid on backend {self.name!r}, which has {n} device(s): "
                f"pass an int in 0..{n - 1}"
            )
        return index

    # pools
    @abstractmethod
    def graph_pool_handle(self) -> PoolId:
        """A new pool id; the pool itself is created by the first capture into it."""

    @abstractmethod
    def has_mempool(self) -> bool: ...

    @abstractmethod
    def mempool(self, device: int) -> Any:
        """A pool object that holds a reference of its own (``torch.cuda.MemPool`` semantics)."""

    # graphs and streams
    @abstractmethod
    def new_graph(self) -> Any: ...

    @abstractmethod
    def new_stream(self, device: int) -> Any: ...

    @abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager: ...

    def prewarm(self, device: int = 0, backward: bool = False, torch_capture_stream: bool = False) -> None:
        """Create the per-stream library workspaces (cuBLAS, cuBLASLt) of the streams this library owns (the
        default stream, the process's capture stream) now: a workspace created inside a capture pins that
        graph's pool for good, and one created between two baselines counts as growth.
        ``backward``: also those of autograd's device thread, whose cuBLAS handle is its own.
        ``torch_capture_stream``: also torch.cuda.graph's own stream, where it exists (to make again what
        clearing the caches took; a cycle leaves it alone: what lands there is what the engine does).
        Cheap when they exist; ``torch._dynamo.reset()`` frees them, so cycles call this every time."""
        return None

    def capture_stream(self, device: int = 0) -> Any:
        """One capture stream per device for the whole process: every new stream gets its own library
        workspaces (cuBLAS), so a stream per engine grows reserved memory engine after engine. The backend
        object is the process's one (``get_backend``), so every runner shares these streams."""
        streams = self.__dict__.setdefault("_capture_streams", {})
        if device not in streams:
            streams[device] = self.new_stream(device)
        return streams[device]

    @abstractmethod
    def graph(self, graph: Any, pool: PoolId | None = None, stream: Any = None) -> contextlib.AbstractContextManager:
        """``torch.cuda.graph`` semantics: synchronize, empty_cache, then capture on ``stream``."""

    @abstractmethod
    def synchronize(self, device: int | None = None) -> None: ...

    @abstractmethod
    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: frees device segments; erases freeable device pools with none left."""

    @abstractmethod
    def host_empty_cache(self) -> None:
        """``torch._C._host_emptyCache``: erases the host allocator's graph pools at use_count 0."""

    def expandable_segments(self) -> bool:
        """Whether the allocator runs with ``expandable_segments:True`` (where tearing down a pool whose blocks
        are alive crashes the process once they are freed)."""
        return False

    def invalidation_probe(self) -> Callable[[], bool] | None:
        """A function saying whether the capture underway on the current stream is no longer valid (an op
        broke it without raising), for the op watch to ask after each op; None where the backend cannot
        tell (the watch then names the op that raised)."""
        return None

    def end_capture_routing(self, pool_id: PoolId, device: int = 0) -> bool:
        """After a capture that failed at ``capture_end``: close the allocator's record of the capture if it
        is still open (torch 2.11 leaves it open when ``cudaStreamEndCapture`` fails, PyTorch #180395:
        measured on the H200; while open, the allocator believes a capture is underway). True if it was."""
        return False

    @abstractmethod
    def release_pool_reference(self, pool_id: PoolId, device: int = 0) -> None:
        """Give back one device reference to a pool (``torch._C._cuda_releasePool``)."""

    # books
    @abstractmethod
    def pool_state(self, pool_id: PoolId, device: int = 0) -> PoolState: ...

    @abstractmethod
    def pool_ids(self, device: int = 0) -> list[PoolId]:
        """Ids of the private pools that hold at least one segment on ``device``."""

    @abstractmethod
    def segments(self, device: int = 0) -> list[dict[str, Any]]:
        """Every segment on ``device``: address, size, pool id, stream, and whether it is a small segment (the
        allocator keeps blocks of up to 1 MiB in 2 MiB segments of their own)."""

    def pool_bytes(self, device: int = 0) -> dict[PoolId, int]:
        """Reserved bytes of every pool that holds a segment on ``device``, from one read of the books."""
        out: dict[PoolId, int] = {}
        for s in self.segments(device):
            out[s["pool_id"]] = out.get(s["pool_id"], 0) + s["size"]
        return out

    def pool_bytes_reader(self) -> Callable[[int, PoolId], int]:
        """``read(device, pool_id)``: a pool's reserved bytes, the books read once per device at first use (a
        ``memory_snapshot()`` on CUDA, ~300 us: once per cache flush or query, not once per pool)."""
        books: dict[int, dict[PoolId, int]] = {}

        def read(device: int, pool_id: PoolId) -> int:
            if device not in books:
                books[device] = self.pool_bytes(device)
            return books[device].get(tuple(pool_id), 0)

        return read

    @abstractmethod
    def memory_reserved(self, device: int = 0) -> int: ...

    def default_pool_reserved(self, device: int = 0) -> int:
        """Reserved bytes outside every private pool (weights, inputs, library workspaces)."""
        return self.memory_reserved(device) - sum(s["size"] for s in self.segments(device) if s["pool_id"] != (0, 0))

    def default_pool_allocated(self, device: int = 0) -> int:
        """Bytes in live blocks outside every private pool: what is kept there, whatever segments it fills."""
        return sum(s["allocated"] for s in self.segments(device) if s["pool_id"] == (0, 0))

    def live_blocks(self, pool_id: PoolId, device: int = 0) -> list[Block]:
        """The live blocks of a pool, with allocation stacks where they were recorded
        (``record_history``); empty where the backend cannot list them."""
        return []

    def record_history(self, on: bool = True) -> str | None:
        """Record an allocation stack for every block from now on. None when done, else why it cannot be."""
        return "this backend cannot record allocation stacks"

    def storage_span(self, t: torch.Tensor) -> tuple[int, int] | None:
        """Where a tensor's storage lies, in the units of :attr:`Block.address`; None if it is not on this
        backend's devices."""
        return None

    # whether libraries keep per-stream workspaces in this allocator (cuBLAS on CUDA, its model on sim): where
    # they do, a block nothing names may be one, and a pin that cannot tell says so
    has_library_workspaces = False

    def library_workspace(self, block: Block, device: int = 0) -> str | None:
        """Why the live ``block`` is a library's workspace (cuBLAS keeps one per thread's handle and stream,
        for the process's life: one made inside a capture lies in that graph's pool), in words; None where it
        is not, or this backend cannot tell. Reads, never frees: nothing the user's process would still hold
        is let go to find out."""
        return None

    def workspace_bytes(self, device: int = 0) -> int | None:
        """The bytes of libraries' workspaces one new stream gets on ``device`` (None: unknown here)."""
        return None

    def dump_snapshot(self, path: str) -> str | None:
        """Write the allocator's memory snapshot (PyTorch's memory visualizer opens it); None if it cannot."""
        return None

    @classmethod
    def graph_api(cls) -> GraphAPI | None:
        """Where this kind's graph API lives, for the observation layer."""
        return None

    @abstractmethod
    def memory_allocated(self, device: int = 0) -> int: ...

    # tensors on the backend's devices (probes and buffers)
    @abstractmethod
    def randn(self, *shape: int, device: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    @abstractmethod
    def empty(self, *shape: int, device: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "torch": torch.__version__, "devices": self.device_count()}
