"""cuBLAS's per-stream workspaces, as each backend knows them: measured on CUDA, modeled on ``sim``.

cuBLAS (and cuBLASLt) keep one workspace per thread's handle and stream, made by the first matmul there through
the caching allocator and kept for the process's life: one made inside a capture lies in that graph's pool,
where it keeps the pool from being erased after every graph of it is reset (measured on the H100 and H200:
docs/ARCHITECTURE.md). A verdict names such a block (``sanitizer/pins.py``) from what these classes know of it,
and never frees it to find out: the pool stays dead, as it does in the user's process.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ..sizes import size_text
from .base import Block, PoolId
from .sim_allocator import storage_key

if TYPE_CHECKING:
    from .sim_graph import SimStream

# cuBLAS's per-stream workspace on Hopper with torch 2.11 (CUBLAS_WORKSPACE_CONFIG's default :4096:8), as the
# simulated allocator models it; cuBLASLt's 1 MiB beside it is not modeled
WORKSPACE_BYTES = 32 << 20


class MeasuredWorkspaces:
    """CUDA: the sizes of the blocks the first matmuls on the library's own new capture stream leave alive in
    the default pool are the workspaces' sizes on that device (no size is assumed for any GPU or setting); a
    live block of a released pool that no tensor holds, of one of those sizes, is a workspace."""

    has_library_workspaces = True

    def _measure_workspaces(self, device: int, stream: Any, sync: bool = True) -> None:
        """Once a device, from two reads of the books around the first warm-up of ``stream``, before the first
        baseline: nothing of an engine's is there yet."""
        sizes = self.__dict__.setdefault("_workspace_sizes", {})
        if device in sizes:
            return
        before = {b.address for b in self.live_blocks((0, 0), device)}
        self._warm(device, [stream], sync=sync)
        sizes[device] = frozenset(b.size for b in self.live_blocks((0, 0), device) if b.address not in before)

    def _known_sizes(self, device: int) -> frozenset | None:
        """The workspaces' sizes on ``device``, measured now if no cycle's prewarm did (a program-wide
        sanitizer naming a pin): on the library's own new stream, so no pool of the caller's changes, and not
        while this thread captures (nor with a device sync, which another thread's capture forbids)."""
        sizes = self.__dict__.get("_workspace_sizes", {})
        if device not in sizes:
            # a stream no matmul ran on: the library's, unless a runner captured there already
            fresh = device not in self.__dict__.get("_capture_streams", {})
            try:
                if torch.cuda.is_current_stream_capturing():
                    return None
                self._measure_workspaces(device, self.capture_stream(device) if fresh else self.new_stream(device),
                                         sync=False)
            except RuntimeError:  # naming a pin must never fail what it explains
                return None
        return self.__dict__.get("_workspace_sizes", {}).get(device)

    def workspace_bytes(self, device: int = 0) -> int | None:
        sizes = self.__dict__.get("_workspace_sizes", {}).get(device)
        return sum(sizes) if sizes else None

    def library_workspace(self, block: Block, device: int = 0) -> str | None:
        sizes = self._known_sizes(device)
        if not sizes or block.size not in sizes:
            return None
        # one wording for every such block, so that a pin groups them (cuBLAS's and cuBLASLt's, per stream)
        made = " and ".join(size_text(n) for n in sorted(sizes, reverse=True))
        return (f"a cuBLAS workspace made inside a capture (a block no tensor holds, of a size the first matmuls "
                f"on a new stream made on cuda:{device}, {torch.cuda.get_device_name(device)}, in this process: "
                f"{made})")


class ModeledWorkspaces:
    """``sim``: one workspace of ``WORKSPACE_BYTES`` per thread and stream, made by the first cuBLAS op there
    (``sim_graph.BLAS_OPS``): inside a capture in its pool, else in the default pool."""

    has_library_workspaces = True

    def _has_workspace(self, stream: SimStream) -> bool:
        return (threading.get_ident(), stream.device, stream.id) in self._workspaces

    def library_workspace_for(self, device: int, stream: int, into: tuple[int, PoolId] | None) -> None:
        """The first cuBLAS op of this thread on ``stream`` makes its workspace: in the pool ``into`` (device,
        pool id) when the op runs in a capture, else in the default pool. It lives as long as the world."""
        key = (threading.get_ident(), device, stream)
        if key in self._workspaces:
            return
        t = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)  # never touched: no host memory behind it
        if into is None:
            self._alloc.allocate_default(t, device)
        else:
            self._alloc.allocate(into, t, stream)
        self._workspaces[key] = (t.untyped_storage(), storage_key(t))  # the storage alone, as C++ holds it

    def workspace_bytes(self, device: int = 0) -> int | None:
        return WORKSPACE_BYTES

    def library_workspace(self, block: Block, device: int = 0) -> str | None:
        for (_, dev, stream), (_, address) in self._workspaces.items():
            if dev == device and block.address == address:
                return (f"the simulated cuBLAS workspace of stream {stream} on sim device {device} "
                        f"({WORKSPACE_BYTES >> 20} MiB)")
        return None

    def prewarm(self, device: int = 0, backward: bool = False, torch_capture_stream: bool = False) -> None:
        streams = [self._default_streams[device], self.capture_stream(device)]
        if torch_capture_stream:
            streams.append(self.torch_capture_stream(device))
        for stream in streams:
            self.library_workspace_for(device, stream.id, None)

    def torch_capture_stream(self, device: int = 0) -> SimStream:
        """``torch.cuda.graph``'s own capture stream: what ``graph()`` captures on when given no stream."""
        if device not in self._torch_capture_streams:
            self._torch_capture_streams[device] = self.new_stream(device)
        return self._torch_capture_streams[device]
