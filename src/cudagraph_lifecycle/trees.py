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


def leaves(x: Any) -> list[Any]:
    """Every leaf of ``x``, depth first, dict values in insertion order."""
    out: list[Any] = []
    stack = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif _is_dataclass(item):  # a generate-style output (logits, hidden states, ...)
            stack.extend(reversed([getattr(item, f.name) for f in dataclasses.fields(item)]))
        else:
            out.append(item)
    return out


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with every leaf replaced by ``fn(leaf)``; containers keep their type."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(map_leaves(fn, v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(map_leaves(fn, v) for v in x)
    if isinstance(x, dict):
        return type(x)((k, map_leaves(fn, v)) for k, v in x.items())
    if _is_dataclass(x):  # a shallow copy with each field mapped (frozen ones too): no __init__ to satisfy
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(out, f.name, map_leaves(fn, getattr(x, f.name)))
        return out
    return fn(x)
