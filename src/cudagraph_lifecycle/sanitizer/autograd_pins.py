"""What autograd graphs pin: the tensors their nodes saved for backward, walked from the live tensors that
carry a graph, and the saved tensors autograd will no longer hand back (modified in place since)."""

from __future__ import annotations

from typing import Any

import torch

from ..backends import Backend
from .tensor_blocks import blocks_of, shape_of

_AUTOGRAD_NODES = 20000  # autograd nodes walked at most


def tensors_saved_by(node: Any) -> tuple[list[torch.Tensor], int]:
    """The tensors ``node`` saved for backward, and how many it saved that cannot be read back: autograd
    refuses a saved tensor modified in place since (a graph replay, a copy into a static buffer)."""
    out, unreadable = [], 0
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            try:
                v = getattr(node, name)
            except RuntimeError as e:
                unreadable += "modified by an inplace operation" in str(e)
                continue
            except Exception:  # freed by a backward already
                continue
            items = v if isinstance(v, (tuple, list)) else (v,)
            out += [x for x in items if isinstance(x, torch.Tensor)]
    return out, unreadable


def autograd_holder(backend: Backend, tensors: list, blocks: list[tuple], owner: dict, name) -> str | None:
    """Tensors saved for backward by the autograd graphs that live tensors carry: roots that Python names
    first (a root held only from C++ is itself part of such a graph). Returns the first named root whose
    graph saved tensors that cannot be read back, for blocks nothing else explains."""
    seen: set[int] = set()
    visited: list = []  # Python's node objects are made on each access: keep them, or an id is reused
    roots = [(t, name(t)) for t in tensors if getattr(t, "grad_fn", None) is not None]
    blind = None  # the first named root whose graph saved tensors that cannot be read back
    for root, held_as in sorted(roots, key=lambda r: r[1] is None):
        what = f"the autograd graph of a tensor {shape_of(root)}" + (f" held as {held_as}" if held_as else "")
        todo = [root.grad_fn]
        while todo and len(seen) < _AUTOGRAD_NODES:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            visited.append(node)
            saved, unreadable = tensors_saved_by(node)
            for t in saved:
                for i in blocks_of(backend, t, blocks):
                    owner.setdefault(i, ("autograd_history", what))
            if unreadable and blind is None and held_as is not None:
                blind = what
            todo += [f for f, _ in getattr(node, "next_functions", ())]
        if len(owner) == len(blocks) or len(seen) >= _AUTOGRAD_NODES:
            break
    return blind
