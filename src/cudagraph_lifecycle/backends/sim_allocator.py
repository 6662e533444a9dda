"""The simulated caching allocator's books: size classes, blocks and segments, private pools and their use
counts, the host allocator's ledger of graph pools, and what ``empty_cache`` erases.

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
  host reference. A capture into an id whose host pool is at 0 asserts like the device one.

A block is a storage born inside a capture (or made by the backend's factories, in the default pool), known
by a weak reference that tells when it dies. Blocks are placed in segments with the allocator's size
classes, so "bytes of pool P" means what it means on CUDA. Under expandable segments a private pool follows
``sim_expandable.py``. Who asserts is the caller's to say: an incref that would assert changes nothing and
returns False, so the backend can poison its world before it raises.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from dataclasses import dataclass, field

import torch

try:  # a block's life is read from a weak reference to its storage
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - older or stripped torch builds (the backend refuses to start)
    StorageWeakRef = None

from .base import Block, MiB, PoolId, PoolState
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


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    if nbytes <= SMALL_SIZE:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


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


class SimAllocator:
    """The pools of one simulated allocator world, on every device, and the host allocator's ledger."""

    def __init__(self, expandable: bool, record_stacks: bool = False):
        self.lock = threading.RLock()
        self.pools: dict[tuple[int, PoolId], _Pool] = {}
        self.freeable: set[tuple[int, PoolId]] = set()
        self.host_pools: dict[PoolId, int] = {}  # the host allocator's ledger: id -> use_count
        self.expandable = expandable  # private pools only; the default pool keeps the plain segments
        self.record_stacks = record_stacks
        self.dangling: list[_Block] = []  # live blocks of pools erased under them (expandable segments)

    # use counts
    def incref(self, pool_id: PoolId, device: int) -> bool:
        """One more device reference to the pool, which is created with one if new. False, and nothing
        changed, where the allocator asserts: the pool exists at use_count 0."""
        with self.lock:
            key = (device, pool_id)
            pool = self.pools.get(key)
            if pool is None:
                self.pools[key] = _Pool(pool_id, device, exp=ExpandablePool() if self.expandable else None)
                return True
            if pool.use_count <= 0:
                return False
            pool.use_count += 1
            return True

    def decref(self, pool_id: PoolId, device: int) -> None:
        with self.lock:
            key = (device, pool_id)
            pool = self.pools[key]
            pool.use_count -= 1
            assert pool.use_count >= 0, "use_count went negative"
            if pool.use_count == 0:
                self.freeable.add(key)

    def incref_host(self, pool_id: PoolId) -> bool:
        """The host ledger's incref; False, and nothing changed, where it asserts (the id is at 0)."""
        with self.lock:
            count = self.host_pools.get(pool_id)
            if count is None:
                self.host_pools[pool_id] = 1
                return True
            if count <= 0:
                return False
            self.host_pools[pool_id] = count + 1
            return True

    def decref_host(self, pool_id: PoolId) -> None:
        with self.lock:
            self.host_pools[pool_id] -= 1

    def use_count(self, pool_id: PoolId, device: int) -> int:
        with self.lock:
            pool = self.pools.get((device, pool_id))
            return 0 if pool is None else pool.use_count

    def would_assert(self, pool_id: PoolId, device: int) -> bool:
        with self.lock:
            pool = self.pools.get((device, pool_id))
            return (pool is not None and pool.use_count <= 0) or self.host_pools.get(pool_id, 1) <= 0

    # placement (each path calls its _place directly: a recorded stack drops a fixed number of frames)
    def allocate(self, key: tuple[int, PoolId], t: torch.Tensor, stream: int) -> None:
        """A storage born in a capture: a block of the capturing graph's pool ``key`` (device, pool id)."""
        with self.lock:
            pool = self.pools[key]
            if pool.exp is not None:
                self._place_expandable(pool, t, stream)
            else:
                self._place(pool, t)

    def allocate_default(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """A tensor made by the backend's factories: a block of the device's default pool."""
        with self.lock:
            key = (device, DEFAULT_POOL)
            pool = self.pools.get(key)
            if pool is None:
                pool = self.pools[key] = _Pool(DEFAULT_POOL, device, use_count=0)
            self._place(pool, t)
        return t

    def _place_expandable(self, pool: _Pool, t: torch.Tensor, stream: int) -> None:
        self._collect()
        size = round_size(t.untyped_storage().nbytes())
        seg, offset, size = pool.exp.allocate(size, size <= SMALL_SIZE, stream)
        stack = traceback.format_stack(limit=13)[:-4] if self.record_stacks else None
        seg.blocks.append(_Block(offset, size, StorageWeakRef(t.untyped_storage()), storage_key(t), stack))

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
        seg.blocks.append(_Block(off, size, StorageWeakRef(t.untyped_storage()), storage_key(t), stack))

    def collect(self) -> None:
        with self.lock:
            self._collect()

    def _collect(self) -> None:
        """Return the blocks whose storage died to their segments' free space (the caller holds the lock)."""
        for pool in self.pools.values():
            for seg in pool.segments:
                if seg.blocks:
                    seg.blocks = [b for b in seg.blocks if b.alive()]
        if self.dangling and not all(b.alive() for b in self.dangling):
            # a block of a pool the allocator erased was freed: a use after free (sim_expandable.py)
            os.kill(os.getpid(), signal.SIGSEGV)

    # flushes
    def empty_cache(self) -> None:
        """Release the free segments of freeable pools, erase those left with none; trim the default pools."""
        with self.lock:
            self._collect()
            for key in sorted(self.freeable):
                pool = self.pools[key]
                if pool.exp is not None:
                    if pool.exp.release():  # may raise the allocator's cudaMalloc_count assert
                        self.dangling += [b for seg in pool.segments for b in seg.blocks]
                        del self.pools[key]
                        self.freeable.discard(key)
                    continue
                pool.segments = [s for s in pool.segments if s.blocks]
                if not pool.segments:
                    del self.pools[key]
                    self.freeable.discard(key)
            for (_, pid), pool in self.pools.items():
                if pid == DEFAULT_POOL:
                    pool.segments = [s for s in pool.segments if s.blocks]

    def host_empty_cache(self) -> None:
        """Erase host pools at use_count 0 (captures hold no host block)."""
        with self.lock:
            for pid in [p for p, n in self.host_pools.items() if n == 0]:
                del self.host_pools[pid]

    # books
    def pool_state(self, pool_id: PoolId, device: int) -> PoolState:
        with self.lock:
            self._collect()
            pool = self.pools.get((device, pool_id))
            if pool is None:
                return PoolState(pool_id, device, False, 0, 0, 0, 0)
            held = pool.mapped()
            # as CUDA shows it: a pool with no segment and no reference reads as gone (under expandable
            # segments the allocator may still keep it: sim_expandable.py)
            return PoolState(pool.pool_id, device, bool(held) or pool.use_count > 0, pool.use_count,
                             pool.reserved(), pool.allocated(), len(held))

    def pool_ids(self, device: int) -> list[PoolId]:
        with self.lock:
            return sorted(p.pool_id for (d, pid), p in self.pools.items()
                          if d == device and p.mapped() and pid != DEFAULT_POOL)

    def segments(self, device: int) -> list[dict]:
        with self.lock:
            self._collect()
            return [{"address": id(seg), "size": seg.size, "allocated": seg.allocated(), "pool_id": p.pool_id,
                     "stream": 0, "small": seg.small} for (d, _), p in self.pools.items() if d == device
                    for seg in p.mapped()]

    def memory_reserved(self, device: int) -> int:
        with self.lock:
            self._collect()
            return sum(p.reserved() for (d, _), p in self.pools.items() if d == device)

    def memory_allocated(self, device: int) -> int:
        with self.lock:
            self._collect()
            return sum(p.allocated() for (d, _), p in self.pools.items() if d == device)

    def live_blocks(self, pool_id: PoolId, device: int) -> list[Block]:
        with self.lock:
            self._collect()
            pool = self.pools.get((device, pool_id))
            if pool is None:
                return []
            return [Block(b.size, "".join(b.stack or []), b.key, 1) for s in pool.segments for b in s.blocks]
