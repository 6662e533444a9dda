"""The real ``torch.cuda`` backend. Pool books come from ``torch.cuda.memory_snapshot()``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .base import Backend, PoolId, PoolState


def _use_count_reader():
    # Not every build exposes the allocator's pool use count; without it, use_count reads None.
    fn = getattr(torch._C, "_cuda_getPoolUseCount", None)
    return fn if callable(fn) else None


class CudaBackend(Backend):
    name = "cuda"
    world = "cuda"

    def __init__(self) -> None:
        self._use_count = _use_count_reader()

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

    def prewarm(self, device: int = 0) -> None:
        dev = self.torch_device(device)
        for stream in (torch.cuda.current_stream(dev), self.capture_stream(device)):
            with torch.cuda.stream(stream), torch.no_grad():
                for dtype in (torch.float32, torch.float16, torch.bfloat16):
                    a = torch.ones(64, 64, device=dev, dtype=dtype)
                    torch.mm(a, a)
                    torch.addmm(a[0], a, a)  # the bias epilogue goes through cuBLASLt
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
        fn = getattr(torch._C, "_host_emptyCache", None)
        if fn is not None:
            fn()

    def end_capture_routing(self, pool_id: PoolId, device: int = 0) -> bool:
        fn = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if fn is None:
            return False
        try:
            fn(device, tuple(pool_id))
        except RuntimeError:  # "not currently recording to mempool_id": this torch already ended it
            return False
        return True

    def release_pool_reference(self, pool_id: PoolId, device: int = 0) -> None:
        torch._C._cuda_releasePool(device, tuple(pool_id))

    # books
    def _segments(self, device: int) -> list[dict]:
        return [s for s in torch.cuda.memory_snapshot() if s.get("device") == device]

    def pool_state(self, pool_id: PoolId, device: int = 0) -> PoolState:
        pool_id = tuple(pool_id)
        segs = [s for s in self._segments(device) if tuple(s.get("segment_pool_id", (0, 0))) == pool_id]
        reserved = sum(s["total_size"] for s in segs)
        allocated = sum(s["allocated_size"] for s in segs)
        use_count = None
        if self._use_count is not None:
            with contextlib.suppress(Exception):
                use_count = int(self._use_count(device, pool_id))
        # A pool with no segment may still exist in the allocator's books (a live graph that allocated
        # nothing); without a use-count reader, segments are the only evidence.
        exists = bool(segs) or bool(use_count)
        return PoolState(pool_id, device, exists, use_count, reserved, allocated, len(segs))

    def segments(self, device: int = 0) -> list[dict[str, Any]]:
        return [{"address": s["address"], "size": s["total_size"], "allocated": s["allocated_size"],
                 "pool_id": tuple(s.get("segment_pool_id", (0, 0))), "stream": s.get("stream")}
                for s in self._segments(device)]

    def pool_ids(self, device: int = 0) -> list[PoolId]:
        ids = {tuple(s.get("segment_pool_id", (0, 0))) for s in self._segments(device)}
        ids.discard((0, 0))
        return sorted(ids)

    def memory_reserved(self, device: int = 0) -> int:
        return torch.cuda.memory_reserved(device)

    def memory_allocated(self, device: int = 0) -> int:
        return torch.cuda.memory_allocated(device)

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
        return d
