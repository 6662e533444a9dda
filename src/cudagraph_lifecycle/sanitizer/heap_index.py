"""The referrers of an object while a pins search runs: ``gc.get_referrers`` per object (each scans the whole
heap), or, once a search has scanned often, an index of every object's referrers built in one pass; and the
words a search keeps for holders many tensors share.

A search is per thread (``search_slot.search``, nested calls share it); outside one every lookup scans.
"""

from __future__ import annotations

import gc
import threading
import types
from collections.abc import Callable
from typing import Any

from ..ledger import is_machinery

# a scan of the heap for one object's referrers costs about 1/40 of indexing every referrer once: a search that
# has scanned this often (holders through many distinct closures on a heap of millions of objects) indexes it
_INDEX_AFTER = 32


class Found(list):
    """A list this search made of the program's objects: never a holder, and left out of the heap's index."""


class _Multi(list):
    """An object's referrers in the index where there are several (one is kept bare: most have one)."""


class Search:
    """What one what_pins call keeps (per thread, nested calls share it): the words found for holders many
    tensors share, and the referrers of every object, indexed once the heap has been scanned often. The program
    does not run meanwhile, so the index stays true: its referrers keep what they refer to alive, so no id is
    reused, and what the search makes afterwards is its own."""

    __slots__ = ("memo", "scans", "index")

    def __init__(self) -> None:
        self.memo: dict = {}
        self.scans = 0
        self.index: dict[int, Any] | None = None

    def referrers(self, obj: Any) -> Found:
        if not gc.is_tracked(obj):  # the index has no key for it
            return Found(gc.get_referrers(obj))
        if self.index is None:
            self.scans += 1
            if self.scans <= _INDEX_AFTER:
                return Found(gc.get_referrers(obj))
            self.index = _heap_index()
        found = self.index.get(id(obj))
        return Found(() if found is None else found if type(found) is _Multi else (found,))

    def close(self) -> None:
        """Let go of what the index holds now (a frame kept in it would keep the search's locals alive)."""
        if self.index is not None:
            self.index.clear()
            self.index = None


def _heap_index() -> dict[int, Any]:
    """id of each tracked object -> what ``gc.get_referrers`` would give for it (bare where one), but this
    search's own lists and frames. An object the collector does not track is no key (it is scanned for)."""
    index: dict[int, Any] = {}
    get, tracked, referents = index.get, gc.is_tracked, gc.get_referents
    for o in gc.get_objects():
        if type(o) is Found or type(o) is types.FrameType and is_machinery(o.f_code.co_filename):
            continue  # (the search's frames hold its locals: no holder of the program's)
        for r in referents(o):
            if not tracked(r):
                continue
            k = id(r)
            had = get(k)
            if had is None:
                index[k] = o
            elif type(had) is _Multi:
                if had[-1] is not o:  # an object referring to it twice is one referrer
                    had.append(o)
            elif had is not o:
                index[k] = _Multi((had, o))
    return index


def referrers_of(obj: Any) -> Found:
    """``gc.get_referrers(obj)``, from the search's index where it has one."""
    search = getattr(search_slot, "search", None)
    return Found(gc.get_referrers(obj)) if search is None else search.referrers(obj)


# during what_pins, per thread: its Search
search_slot = threading.local()


def memoised(key: tuple[int, int], words: Callable[[], Any]) -> Any:
    """``words()``, once per key during a search (outside one: every time)."""
    search = getattr(search_slot, "search", None)
    if search is None:
        return words()
    memo = search.memo
    if key not in memo:
        memo[key] = words()
    return memo[key]
