"""A private pool under ``expandable_segments:True``, simulated: the rules behind the teardown crash.

Read in PyTorch's allocator (c10/cuda/CUDACachingAllocator.cpp) and measured on the H200 with torch 2.11
(``scripts/probe_expandable.py``; docs/gpu-results):

* a pool part (small: requests up to 1 MiB, 2 MiB pages; large: 20 MiB pages) holds one expandable segment
  per stream: a virtual range whose pages are mapped as needed, lowest first;
* an allocation takes the best-fitting free mapped run (smallest, then lowest address); failing that, it
  maps pages: into the smallest unmapped run (a hole left by an unmap, else the segment's tail), starting
  at the free run just before it, and the pool's ``cudaMalloc_count`` goes up by ONE, however many pages
  were mapped;
* ``empty_cache`` unmaps, in each free run of a pool whose graphs were all released, the whole pages inside
  it, and the count goes down by one per run that lost a page. At 0 the pool is erased, whether or not
  blocks of it are alive; an unmap with the count already at 0 fails the allocator's
  ``cudaMalloc_count > 0`` assert;
* a live block of an erased pool is dangling: freeing it is a use after free. On the H200 that was a
  SIGSEGV, a glibc abort, or (when a new pool took the freed memory) nothing visible; the simulation
  crashes the process with SIGSEGV at the allocator's next call after the free;
* a pool whose count stays above 0 once all its pages are unmapped is never erased: a capture into its id
  then asserts like a stale one, although no segment of it is left.

Counting one up per expansion and one down per unmapped run is why one large temporary freed inside a
capture, then carved up by blocks that outlive the pool's teardown, crashes: one expansion, then runs of
whole pages left free between the live blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
SMALL_PAGE = 2 * MiB
LARGE_PAGE = 20 * MiB
VIRTUAL = 1 << 40  # a segment's virtual range: never the limit here
SMALL_SIZE = 1 * MiB
MIN_BLOCK = 512

COUNT_ASSERT = (
    'block->pool->owner_PrivatePool->cudaMalloc_count > 0 INTERNAL ASSERT FAILED at '
    '"c10/cuda/CUDACachingAllocator.cpp" (simulated by cudagraph_lifecycle.sim), please report a bug to PyTorch.'
)


@dataclass(eq=False)
class ExpandableSegment:
    """One stream's expandable segment of one pool part. ``size`` is what is mapped (the pool's reserved
    bytes); ``blocks`` are its live blocks (objects with ``offset`` and ``size``)."""

    small: bool
    stream: int
    mapped: set[int] = field(default_factory=set)  # page indices
    blocks: list[Any] = field(default_factory=list)

    @property
    def page(self) -> int:
        return SMALL_PAGE if self.small else LARGE_PAGE

    @property
    def size(self) -> int:
        return len(self.mapped) * self.page

    def allocated(self) -> int:
        return sum(b.size for b in self.blocks)

    def runs(self) -> list[tuple[int, int, bool]]:
        """The space no block holds, as maximal runs (start, end, mapped), lowest first."""
        out: list[tuple[int, int, bool]] = []
        cursor = 0
        for b in sorted(self.blocks, key=lambda b: b.offset) + [None]:
            end = VIRTUAL if b is None else b.offset
            if end > cursor:
                out += self._split(cursor, end)
            if b is not None:
                cursor = b.offset + b.size
        return out

    def _split(self, a: int, b: int) -> list[tuple[int, int, bool]]:
        """[a, b) cut where pages change between mapped and unmapped."""
        out: list[tuple[int, int, bool]] = []

        def add(x: int, y: int, on: bool) -> None:
            if x >= y:
                return
            if out and out[-1][2] == on and out[-1][1] == x:
                out[-1] = (out[-1][0], y, on)
            else:
                out.append((x, y, on))

        page, last = self.page, max(self.mapped, default=-1)
        p = a // page
        while p <= last and p * page < b:
            add(max(a, p * page), min(b, (p + 1) * page), p in self.mapped)
            p += 1
        add(max(a, (last + 1) * page), b, False)
        return out

    def free_runs(self) -> list[tuple[int, int]]:
        return [(a, b) for a, b, on in self.runs() if on]

    def unmapped_runs(self) -> list[tuple[int, int]]:
        return [(a, b) for a, b, on in self.runs() if not on]

    def whole_pages(self, a: int, b: int) -> list[int]:
        first, end = -(-a // self.page), b // self.page
        return [p for p in range(first, end) if p in self.mapped]


def _take(run: int, size: int, small: bool) -> int:
    """The block's size in a free run: split off the rest only if enough remains (``should_split``)."""
    remaining = run - size
    return run if (remaining < MIN_BLOCK if small else remaining <= SMALL_SIZE) else size


@dataclass(eq=False)
class ExpandablePool:
    """The expandable segments of one private pool and its ``cudaMalloc_count``."""

    segments: list[ExpandableSegment] = field(default_factory=list)
    count: int = 0

    def allocate(self, size: int, small: bool, stream: int) -> tuple[ExpandableSegment, int, int]:
        """Where a block of ``size`` bytes goes: (segment, offset, the block's size)."""
        segs = [s for s in self.segments if s.small == small and s.stream == stream]
        best = None
        for si, s in enumerate(segs):
            for a, b in s.free_runs():
                if b - a >= size and (best is None or (b - a, si, a) < best[:3]):
                    best = (b - a, si, a, s)
        if best is not None:
            run, _, a, s = best
            return s, a, _take(run, size, small)
        if not segs:
            segs = [ExpandableSegment(small, stream)]
            self.segments.append(segs[0])
        holes = sorted((b - a, si, a, s) for si, s in enumerate(segs) for a, b in s.unmapped_runs())
        for _, _, a, s in holes:
            runs = s.runs()
            start = next((ra for ra, rb, on in runs if on and rb == a), a)  # the free run just before it
            reach = start
            for ra, rb, _ in runs:  # free or unmapped space from `start`, up to the next live block
                if ra == reach:
                    reach = rb
            if reach - start < size:
                continue
            pages = range(start // s.page, -(-(start + size) // s.page))
            s.mapped.update(pages)
            self.count += 1
            run = next(rb - ra for ra, rb, on in s.runs() if on and ra == start)
            return s, start, _take(run, size, small)
        raise AssertionError("an expandable segment's tail is never too small")  # pragma: no cover

    def release(self) -> bool:
        """``empty_cache`` on this pool, all of whose graphs were released: unmap the whole pages of every
        free run (small part first); True when the count reached 0 (the allocator erases the pool then).
        Raises the allocator's assert (as a RuntimeError) on an unmap with the count at 0."""
        for small in (True, False):
            runs = sorted((s.stream, b - a, si, a, b, s) for si, s in enumerate(self.segments) if s.small == small
                          for a, b in s.free_runs())
            for *_, a, b, s in runs:
                pages = s.whole_pages(a, b)
                if not pages:
                    continue
                if self.count <= 0:
                    raise RuntimeError(COUNT_ASSERT)
                s.mapped.difference_update(pages)
                self.count -= 1
        return self.count == 0
