"""Nested values (tensors in tuples, lists, dicts and named tuples): flattened and mapped here rather than
through torch's private ``torch.utils._pytree``, which the declared torch range does not promise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
    return fn(x)
