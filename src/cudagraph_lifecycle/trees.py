"""Nested values (tensors in tuples, lists, dicts, named tuples and dataclasses, as engines return them):
flattened and mapped here rather than through torch's private ``torch.utils._pytree``, which the declared
torch range does not promise."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any


def _is_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


_UNSET = object()


def _fields(x: Any) -> list[tuple[str, Any]]:
    """A dataclass instance's fields that are set (an ``init=False`` field may never be)."""
    return [(f.name, v) for f in dataclasses.fields(x) if (v := getattr(x, f.name, _UNSET)) is not _UNSET]


def leaves(x: Any) -> list[Any]:
    """Every leaf of ``x``, depth first, dict values in insertion order; a container met again (a cycle, a
    dataclass pointing back at its parent) is walked once."""
    out: list[Any] = []
    stack = [x]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        container = isinstance(item, (list, tuple, dict)) or _is_dataclass(item)
        if container:
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif container:  # a generate-style output (logits, hidden states, ...)
            stack.extend(reversed([v for _, v in _fields(item)]))
        else:
            out.append(item)
    return out


def map_leaves(fn: Callable[[Any], Any], x: Any, _done: dict[int, Any] | None = None) -> Any:
    """``x`` with every leaf replaced by ``fn(leaf)``; containers keep their type. A container met twice is
    mapped once (the copy keeps the sharing), and a cycle through a dataclass or a list closes on the copy."""
    dataclass = _is_dataclass(x)
    if not dataclass and not isinstance(x, (list, tuple, dict)):
        return fn(x)  # a leaf (a runner's one tensor, each step): nothing more to do
    done = {} if _done is None else _done
    if id(x) in done:
        return done[id(x)]
    if dataclass:  # first: a dataclass may also be a dict (a generate-style output)
        done[id(x)] = out = copy.copy(x)  # a shallow copy with each field (and item) mapped: no __init__ to satisfy
        for name, v in _fields(x):
            object.__setattr__(out, name, map_leaves(fn, v, done))
        if isinstance(x, dict):
            for k, v in x.items():
                dict.__setitem__(out, k, map_leaves(fn, v, done))
        return out
    if type(x) is list:
        done[id(x)] = out = []
        out.extend(map_leaves(fn, v, done) for v in x)
        return out
    done[id(x)] = x  # a cycle through a tuple or a dict closes on the original there
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        out = type(x)(*(map_leaves(fn, v, done) for v in x))
    elif isinstance(x, (list, tuple)):
        out = type(x)(map_leaves(fn, v, done) for v in x)
    else:
        out = type(x)((k, map_leaves(fn, v, done)) for k, v in x.items())
    done[id(x)] = out
    return out
