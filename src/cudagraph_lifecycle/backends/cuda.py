"""The real ``torch.cuda`` backend. Pool books come from ``torch.cuda.memory_snapshot()``.

Private torch APIs are looked up when used, never at import: where a build lacks one, the feature that
needs it says so and is off (see :func:`missing_features`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch

from ..errors import BackendUnavailableError
from .base import Backend, Block, GraphAPI, PoolId, PoolState, expandable_from_env
from .workspaces import MeasuredWorkspaces

# private torch functions this backend uses, and what is off without each
_PRIVATE = {
    "_cuda_getPoolUseCount": "pool use counts read from the allocator (the ledger's counts are used instead)",
    "_host_emptyCache": "the host allocator's flush (its ledger of graph pools is then never cleared here)",
    "_cuda_endAllocateToPool": "closing the allocator's record after a failed capture",
    "_cuda_releasePool": "giving back a failed capture's pool reference",
}


def missing_features() -> dict[str, str]:
    """The private torch APIs this build lacks, each with the feature that is off without it."""
    return {name: why for name, why in _PRIVATE.items() if not callable(getattr(torch._C, name, None))}


def _private(name: str):
    fn = getattr(torch._C, name, None)
    return fn if callable(fn) else None


class CudaBackend(MeasuredWorkspaces, Backend):
    name = "cuda"
    world = "cuda"  # one CUDA caching allocator per process
    _process: CudaBackend | None = None
    _lock = threading.Lock()
    _expandable: bool | None = None

    @classmethod
    def process(cls) -> CudaBackend:
        """The process's one CUDA backend (a forked child builds its own)."""
        be = cls._process
        if be is not None:  # every observed capture asks: no lock once it exists
            return be
        with cls._lock:
            if cls._process is None:
                cls._process = cls()
            return cls._process

    # devices
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def torch_device(self, index: int) -> torch.device:
        self.check_device(index)
        return torch.device("cuda", index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def prewarm(self, device: int = 0, backward: bool = False, torch_capture_stream: bool = False) -> None:
        # the library's capture stream is new at the first prewarm: what its first matmuls leave alive are
        # the workspaces' sizes (measured, so no size is assumed for any GPU or setting)
        self._measure_workspaces(device, self.capture_stream(device))
        streams = [torch.cuda.current_stream(self.torch_device(device)), self.capture_stream(device)]
        # torch.cuda.graph's own stream (make_graphed_callables captures there too) is the engine's: a
        # process's first capture on it leaves cuBLAS's workspace in that graph's pool, which plain PyTorch
        # loses too. Warmed only on request (a probe), never by a cycle.
        default_capture = getattr(torch.cuda.graph, "default_capture_stream", None)
        if torch_capture_stream and default_capture is not None and default_capture.device.index == device:
            streams.append(default_capture)
        self._warm(device, streams, backward)

    def _warm(self, device: int, streams: list, backward: bool = False, sync: bool = True) -> None:
        dev = self.torch_device(device)
        for stream in streams:
            with torch.cuda.stream(stream), torch.no_grad():
                for dtype in (torch.float32, torch.float16, torch.bfloat16):
                    a = torch.ones(64, 64, device=dev, dtype=dtype)
                    torch.mm(a, a)
                    torch.addmm(a[0], a, a)  # the bias epilogue goes through cuBLASLt
            if backward:  # autograd's device thread has a cuBLAS handle (and so workspaces) of its own
                with torch.cuda.stream(stream), torch.enable_grad():
                    w = torch.ones(64, 64, device=dev, requires_grad=True)
                    (w @ w).sum().backward()
        if sync:
            torch.cuda.synchronize(dev)

    # pools
    def graph_pool_handle(self) -> PoolId:
        return tuple(torch.cuda.graph_pool_handle())

    def has_mempool(self) -> bool:
        return hasattr(torch.cuda, "MemPool")

    def mempool(self, device: int = 0) -> Any:
        self.check_device(device)
        with torch.cuda.device(device):
            return torch.cuda.MemPool()

    # graphs and streams
    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def new_stream(self, device: int = 0) -> torch.cuda.Stream:
        self.check_device(device)
        return torch.cuda.Stream(device=device)

    def stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def graph(self, graph, pool: PoolId | None = None, stream=None) -> contextlib.AbstractContextManager:
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def synchronize(self, device: int | None = None) -> None:
        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def host_empty_cache(self) -> None:
        fn = _private("_host_emptyCache")
        if fn is not None:
            fn()

    def expandable_segments(self) -> bool:
        # PyTorch reads the setting once, when its allocator starts: so do we (every flush asks)
        on = self._expandable
        if on is None:
            on = self._expandable = expandable_from_env()
        return on

    def invalidation_probe(self) -> None:
        # torch reads an invalidated capture as still capturing (is_current_stream_capturing() is True for
        # cudaStreamCaptureStatusInvalidated: measured on the H200) and exposes no other status
        return None

    def end_capture_routing(self, pool_id: PoolId, device: int = 0) -> bool:
        fn = _private("_cuda_endAllocateToPool")
        if fn is None:
            return False
        try:
            fn(device, tuple(pool_id))
        except RuntimeError:  # "not currently recording to mempool_id": this torch already ended it
            return False
        return True

    def release_pool_reference(self, pool_id: PoolId, device: int = 0) -> None:
        fn = _private("_cuda_releasePool")
        if fn is not None:
            fn(device, tuple(pool_id))

    # books
    def _segments(self, device: int) -> list[dict]:
        return [s for s in torch.cuda.memory_snapshot() if s.get("device") == device]

    def pool_state(self, pool_id: PoolId, device: int = 0) -> PoolState:
        pool_id = tuple(pool_id)
        segs = [s for s in self._segments(device) if _segment_pool(s) == pool_id]
        reserved = sum(s["total_size"] for s in segs)
        allocated = sum(s["allocated_size"] for s in segs)
        use_count = None
        reader = _private("_cuda_getPoolUseCount")
        if reader is not None:
            with contextlib.suppress(Exception):
                use_count = int(reader(device, pool_id))
        # A pool with no segment may still exist in the allocator's books (a live graph that allocated
        # nothing); without a use-count reader, segments are the only evidence.
        exists = bool(segs) or bool(use_count)
        return PoolState(pool_id, device, exists, use_count, reserved, allocated, len(segs))

    def segments(self, device: int = 0) -> list[dict[str, Any]]:
        return [{"address": s["address"], "size": s["total_size"], "allocated": s["allocated_size"],
                 "pool_id": _segment_pool(s), "stream": s.get("stream"), "small": s.get("segment_type") == "small"}
                for s in self._segments(device)]

    def pool_ids(self, device: int = 0) -> list[PoolId]:
        ids = {_segment_pool(s) for s in self._segments(device)}
        ids.discard((0, 0))
        return sorted(ids)

    # The nested stats, not torch.cuda.memory_reserved(): that flattens every counter first (measured on
    # the H200: 124 us a call vs 16 us), and the runner reads this twice per captured graph.
    def memory_reserved(self, device: int = 0) -> int:
        return _current(device, "reserved_bytes")

    def memory_allocated(self, device: int = 0) -> int:
        return _current(device, "allocated_bytes")

    def live_blocks(self, pool_id: PoolId, device: int = 0) -> list[Block]:
        out = []
        for seg in self._segments(device):
            if _segment_pool(seg) != tuple(pool_id):
                continue
            address = seg.get("address", 0)
            for blk in seg.get("blocks", []):
                if blk.get("state") == "active_allocated":
                    frames = blk.get("frames") or []
                    out.append(Block(blk.get("size", 0), "".join(
                        f"  {f['filename']}:{f['line']} in {f['name']}\n" for f in frames[:12]),
                        blk.get("address", address)))
                address += blk.get("size", 0)
        return out

    def storage_span(self, t: torch.Tensor) -> tuple[int, int] | None:
        if not t.is_cuda:
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass or a meta view without storage
            return None
        return st.data_ptr(), st.data_ptr() + st.nbytes()

    def record_history(self, on: bool = True) -> str | None:
        fn = getattr(torch.cuda.memory, "_record_memory_history", None)
        if fn is None:
            return "this torch build has no torch.cuda.memory._record_memory_history"
        fn(max_entries=100000) if on else fn(enabled=None)
        return None

    def dump_snapshot(self, path: str) -> str | None:
        if not torch.cuda.is_initialized():
            return None
        fn = getattr(torch.cuda.memory, "_dump_snapshot", None)
        if fn is None:
            return None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fn(path)
        return path

    # tensors
    def randn(self, *shape: int, device: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=self.torch_device(device), dtype=dtype)

    def empty(self, *shape: int, device: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(*shape, device=self.torch_device(device), dtype=dtype)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if torch.cuda.is_available():
            d["gpu"] = torch.cuda.get_device_name(0)
            d["cuda"] = torch.version.cuda
        missing = missing_features()
        if missing:
            d["missing_features"] = missing
        return d

    @classmethod
    def graph_api(cls) -> GraphAPI | None:
        graph_cls = getattr(torch.cuda, "CUDAGraph", None)
        if graph_cls is None:
            return None

        def backend(_graph: Any) -> CudaBackend:
            return cls._process or cls.process()

        reader = _private("_cuda_getDevice")  # cheap: the capture is underway, so CUDA is initialized

        def capture_device(_graph: Any) -> int:
            return reader() if reader is not None else torch.cuda.current_device()

        current_stream, default_stream = _private("_cuda_getCurrentStream"), _private("_cuda_getDefaultStream")
        defaults: dict[int, int] = {}  # device -> its default stream's id (it never changes)

        def on_default_stream(graph: Any) -> bool:
            if current_stream is None or default_stream is None:
                return torch.cuda.current_stream() == torch.cuda.default_stream()
            device = capture_device(graph)
            default = defaults.get(device)
            if default is None:
                default = defaults[device] = default_stream(device)[0]
            return current_stream(device)[0] == default

        def handle(args, kwargs, result):
            return cls.process(), tuple(result)

        def mempool(mp):
            return cls.process(), torch.cuda.current_device(), tuple(mp.id)

        def take(args, kwargs):  # (device, pool): cudagraph trees' warm-up allocations take a reference
            return cls.process(), int(args[0]), tuple(args[1]), +1

        def give(args, kwargs):
            return cls.process(), int(args[0]), tuple(args[1]), -1

        owners = [(mod, "graph_pool_handle", handle) for mod in (torch.cuda, torch.cuda.graphs)
                  if "graph_pool_handle" in vars(mod)]
        refs = [(torch._C, name, parse) for name, parse in (
            ("_cuda_beginAllocateCurrentThreadToPool", take), ("_cuda_beginAllocateToPool", take),
            ("_cuda_releasePool", give)) if hasattr(torch._C, name)]
        return GraphAPI(
            kind="cuda",
            graph_cls=graph_cls,
            graph_backend=backend,
            capture_device=capture_device,
            current_device=reader,
            process_cls=cls,
            on_default_stream=on_default_stream,
            current_stream=current_stream if default_stream is not None else None,
            default_stream=default_stream if current_stream is not None else None,
            handles=tuple(owners),
            mempool_cls=getattr(torch.cuda, "MemPool", None),
            mempool_parse=mempool,
            device_flush=(torch.cuda, "empty_cache", lambda a, k: cls.process()),
            host_flush=(torch._C, "_host_emptyCache", lambda a, k: cls.process())
            if hasattr(torch._C, "_host_emptyCache") else None,
            pool_refs=tuple(refs),
        )


def _segment_pool(seg: dict) -> PoolId:
    # Without the pool id every segment would read as the default pool's, and every graph pool as empty:
    # a release check would pass whatever it held. Refuse instead.
    if "segment_pool_id" not in seg:
        raise BackendUnavailableError(
            "torch.cuda.memory_snapshot() in this torch build has no 'segment_pool_id': the books of graph pools "
            f"cannot be read (torch {torch.__version__}); pytest-cudagraph needs torch >= 2.11")
    return tuple(seg["segment_pool_id"])


def _forget_process_backend() -> None:
    CudaBackend._process = None
    CudaBackend._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_process_backend)


def _current(device: int, stat: str) -> int:
    """One allocator counter now; 0 before CUDA is initialized (the nested stats are empty then)."""
    return torch.cuda.memory_stats_as_nested_dict(device).get(stat, {}).get("all", {}).get("current", 0)
