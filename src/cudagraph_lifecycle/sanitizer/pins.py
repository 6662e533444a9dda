"""What pins a released pool: the owner of each live block, where the process can know it.

Asked only once a pool was found pinned (a leaked verdict, a ``pinned_pool`` finding), never on the capture
path. In order:

* ``python_reference``: a tensor whose storage lies in the block, and who holds it (a module global, an
  object's attribute, a list, a local variable);
* ``autograd_history``: a tensor saved for backward by an autograd graph that a live tensor still carries
  (a copy of an output captured with autograd on);
* ``library_workspace``: a block the backend knows for a library's workspace (cuBLAS keeps one per stream;
  the first matmul on a stream inside a capture puts it in the graph's pool): on CUDA a block no tensor holds
  of the exact size this process's first matmuls on a new stream made, on ``sim`` the modeled workspace
  itself. Read, never freed: clearing the caches to see what goes would erase the pool that the user's
  process keeps dead, and the next verdict would be made on a process we healed;
* ``autograd_history``, inferred: a kept tensor's autograd graph saved tensors that autograd will no longer
  hand back (modified in place since): what nothing else explains is put down to it;
* ``unknown``: nothing above reaches it (a C++ extension's cache, a local variable of a running function).

Holders are named by ``holders`` (the referrers from ``heap_index``); autograd graphs are walked by
``autograd_pins``.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..backends import Backend
from ..ledger import Key, ledger
from ..sizes import size_text
from .autograd_pins import autograd_holder, tensors_saved_by
from .heap_index import Found, Search, search_slot
from .holders import held_where, holder_of
from .tensor_blocks import blocks_of, shape_of

_TENSOR_DEPTH = 5  # holders named up from a pinned tensor (a buffer, its module, a dict, an engine, a global)

FIXES = {
    "python_reference": "drop that reference (or keep a .clone() made under torch.no_grad()) before the release",
    "autograd_history": "capture (and run) under torch.no_grad() or torch.inference_mode(), or keep only "
                        ".detach()ed copies of outputs (grad mode is per thread: a capture in another thread, "
                        "such as an executor's, needs its own no_grad)",
    "library_workspace": "cuBLAS keeps a workspace per thread's handle and stream, made by the first matmul "
                         "there; one made inside a capture stays in its pool for good. Warm up "
                         "forward AND backward on the capture stream before the first capture (torch.cuda.graph "
                         "without stream= uses torch.cuda.graph.default_capture_stream; make_graphed_callables warms "
                         "up on a stream of its own, and backward runs on autograd's thread), or call "
                         "torch._C._cuda_clearCublasWorkspaces() after the release once no graph is alive",
    "unknown": "nothing the garbage collector sees reaches it: a local variable of a function still running "
               "(the collector does not see those), or a C++ cache or extension; record allocation stacks "
               "(PoolSanitizer(record_history=True)) to see where it was allocated",
}


@dataclass(frozen=True)
class Pin:
    cause: str  # python_reference | autograd_history | library_workspace | unknown
    bytes: int
    holder: str
    fix: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(pins: list[Pin]) -> str:
    """Who pins how many bytes, the holders of one cause together, and that cause's fix once."""
    causes: dict[str, list[Pin]] = {}
    for p in pins:
        causes.setdefault(p.cause, []).append(p)
    return "; ".join(", ".join(f"{size_text(p.bytes)} pinned by {p.holder}" for p in same)
                     + f" ({cause}): {same[0].fix}" for cause, same in causes.items())


def what_pins(backend: Backend, keys: list[Key], known: dict[int, str] | None = None,
              only: list[tuple[int, int]] | None = None, infer: bool = True) -> list[Pin]:
    """The holders of the live blocks of the pools ``keys`` (world, device, pool id), largest first. ``known``
    names objects the caller knows (id -> words, e.g. the copy of an output a caller keeps). Nothing of the
    process is changed to find out (no cache cleared, nothing freed). ``only``: the spans of the blocks to
    explain (the rest are left out). Without ``infer``, what nothing names is ``unknown``, not put down to an
    autograd graph that saved tensors autograd no longer hands back."""
    found = [(b, k[1]) for k in keys for b in backend.live_blocks(k[2], k[1]) if b.span]
    if only is not None:
        wanted = set(only)
        found = [(b, d) for b, d in found if b.span in wanted]
    blocks = [(*b.span, b.size, d) for b, d in found]
    if not blocks:
        return []
    owner: dict[int, tuple[str, str]] = {}  # block index -> (cause, holder)
    tensor = torch.Tensor
    tensors = Found(o for o in gc.get_objects() if issubclass(type(o), tensor))  # type(): no __class__ lookups
    ignore = {id(tensors), id(sys._getframe())}
    known = known or {}

    def name(t: Any) -> str | None:  # up to what the user can drop: a global, an engine's attribute
        return known.get(id(t)) or holder_of(t, ignore, _TENSOR_DEPTH)

    outer = getattr(search_slot, "search", None)
    if outer is None:  # the outermost search of this thread: the objects stay alive meanwhile, ids are stable
        search_slot.search = Search()
    try:
        blind = _name_owners(backend, tensors, blocks, owner, name)
    finally:
        if outer is None:
            search_slot.search.close()
            search_slot.search = None
    del tensors
    unseen = "a holder the garbage collector does not see"
    if len(owner) < len(blocks) and backend.has_library_workspaces:
        for i, (b, device) in enumerate(found):
            if i not in owner:
                words = backend.library_workspace(b, device)
                if words is not None:
                    owner[i] = ("library_workspace", words)
    if blind is not None and infer:  # what is left is most likely what tensors that graph saved hold
        for i in range(len(blocks)):
            owner.setdefault(i, ("autograd_history", f"{blind} (inferred: tensors it saved were overwritten in "
                                                     "place since, so autograd will not hand them back to compare)"))
    grouped: dict[tuple[str, str], int] = {}
    for i, (_, _, size, _) in enumerate(blocks):
        cause, holder = owner.get(i, ("unknown", unseen))
        grouped[(cause, holder)] = grouped.get((cause, holder), 0) + size
    pins = [Pin(cause, n, holder, FIXES[cause]) for (cause, holder), n in grouped.items()]
    return sorted(pins, key=lambda p: -p.bytes)


def _name_owners(backend: Backend, tensors: list, blocks: list[tuple], owner: dict, name) -> str | None:
    """The Python holders of the blocks' tensors, then the autograd graphs' (``autograd_holder``'s return)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes warn when touched
        for t in tensors:
            hit = [i for i in blocks_of(backend, t, blocks) if i not in owner]
            held_as = name(t) if hit else None  # a tensor no Python object names is held from C++ (autograd)
            for i in hit:
                if held_as is not None:
                    owner[i] = ("python_reference", f"a tensor {shape_of(t)} held as {held_as}")
        return autograd_holder(backend, tensors, blocks, owner, name) if len(owner) < len(blocks) else None


_REACH = 200_000  # objects walked from a held output at most; beyond that nothing is judged at once
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType,
           types.FrameType)  # not followed from an output: they reach the whole program


def beyond_output(backend: Backend, keys: list[Key], output: Any) -> list[tuple[int, int]]:
    """The spans of the live blocks of the pools ``keys`` that lie outside everything the caller's ``output``
    keeps alive: its tensors, what it refers to, its autograd graphs' saved tensors and context attributes
    (a saved tensor autograd will not hand back is not seen: what pins such a block is asked next). Empty
    where the backend cannot list blocks or the output reaches too much to tell."""
    blocks = [(*b.span, b.size, k[1]) for k in keys for b in backend.live_blocks(k[2], k[1]) if b.span]
    if not blocks:
        return []
    covered: set[int] = set()
    seen: set[int] = set()
    seen_nodes: set[int] = set()  # apart: a tensor refers to its node too, as a plain object
    kept: list = []  # autograd node objects are made on each access: keep them, or an id is reused
    todo, nodes = [output], []
    tensor = torch.Tensor
    while (todo or nodes) and len(covered) < len(blocks):
        if len(seen) + len(seen_nodes) > _REACH:
            return []
        if todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, _OPAQUE):
                continue
            seen.add(id(obj))
            if isinstance(obj, tensor):
                covered.update(blocks_of(backend, obj, blocks))
                nodes.append(obj.grad_fn)
            # what cannot refer to anything (ints of a token list, strings) is not walked
            todo += [o for o in gc.get_referents(obj) if gc.is_tracked(o) or isinstance(o, tensor)]
            continue
        node = nodes.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        kept.append(node)
        todo += tensors_saved_by(node)[0] + gc.get_referents(node)  # a custom Function's ctx attributes too
        nodes += [f for f, _ in getattr(node, "next_functions", ())]
    return [(lo, hi) for i, (lo, hi, _, _) in enumerate(blocks) if i not in covered]


def graph_holder(entries: list) -> str | None:
    """Who holds the first of these graphs (ledger entries, weak references) that Python can name: a graph
    never reset after its engine's release is kept by someone, and that someone is the fix. None where no
    Python object names any (a C++ holder, or all of them gone)."""
    # up to where the engine keeps it
    return next((named for entry in entries if (named := held_where(entry, 5)) is not None), None)


def mempool_notes(keys: list[Key]) -> dict[Key, str]:
    """For each pool whose MemPool object is alive (the pool lives with it: its segments stay reserved, even
    with every block free): who holds that object, and the fix."""
    out = {}
    for k in keys:
        ref = ledger.mempools.get(k)
        if ref is None or ref() is None:
            continue
        holder = held_where(ref, 4) or \
            "a holder the garbage collector does not see (a local variable of a function still running, or C++)"
        out[k] = (f"pool {k[2]}'s MemPool object is alive, held as {holder}: while it lives the pool keeps its "
                  "segments reserved; drop it at release (or give each engine a MemPool of its own)")
    return out
