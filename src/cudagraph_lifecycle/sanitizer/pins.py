"""What pins a released pool: the owner of each live block, where the process can know it.

Asked only once a pool was found pinned (a leaked verdict, a ``pinned_pool`` finding), never on the capture
path. In order:

* ``python_reference``: a tensor whose storage lies in the block, and who holds it (a module global, an
  object's attribute, a list, a local variable);
* ``autograd_history``: a tensor saved for backward by an autograd graph that a live tensor still carries
  (a copy of an output captured with autograd on);
* ``library_workspace``: a block that clearing the libraries' workspace caches frees (cuBLAS keeps one
  workspace per stream; the first matmul on a stream inside a capture puts it in the graph's pool). Tried
  only while no graph of the device is alive, since a live graph may replay into that workspace;
* ``autograd_history``, inferred: a kept tensor's autograd graph saved tensors that autograd will no longer
  hand back (modified in place since): what nothing else explains is put down to it;
* ``unknown``: nothing above reaches it (a C++ extension's cache, a library workspace while graphs live).
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial as functools_partial
from typing import Any

import torch

from ..backends import Backend
from ..ledger import Key, is_machinery, is_user_file, ledger
from ..sizes import size_text

_AUTOGRAD_NODES = 20000  # autograd nodes walked at most
_TENSOR_DEPTH = 5  # holders named up from a pinned tensor (a buffer, its module, a dict, an engine, a global)
_LIBRARY_NODES = 16  # objects of a library's closures walked through at most, up to what the user holds

FIXES = {
    "python_reference": "drop that reference (or keep a .clone() made under torch.no_grad()) before the release",
    "autograd_history": "capture (and run) under torch.no_grad() or torch.inference_mode(), or keep only "
                        ".detach()ed copies of outputs (grad mode is per thread: a capture in another thread, "
                        "such as an executor's, needs its own no_grad)",
    "library_workspace": "cuBLAS keeps a workspace per thread's handle and stream (32 MiB on the H200), made by "
                         "the first matmul there; one made inside a capture stays in its pool for good. Warm up "
                         "forward AND backward on the capture stream before the first capture (torch.cuda.graph "
                         "without stream= uses torch.cuda.graph.default_capture_stream; make_graphed_callables warms "
                         "up on a stream of its own, and backward runs on autograd's thread), or call "
                         "torch._C._cuda_clearCublasWorkspaces() after the release once no graph is alive",
    "unknown": "nothing the garbage collector sees reaches it: a local variable of a function still running "
               "(the collector does not see those), a C++ cache or extension, or a library workspace while graphs "
               "are alive; record allocation stacks (PoolSanitizer(record_history=True)) to see where it was "
               "allocated",
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
              clear_workspaces: bool = True, only: list[tuple[int, int]] | None = None,
              infer: bool = True) -> list[Pin]:
    """The holders of the live blocks of the pools ``keys`` (world, device, pool id), largest first. ``known``
    names objects the caller knows (id -> words, e.g. the copy of an output a caller keeps). Without
    ``clear_workspaces`` nothing of the allocator is touched (no library workspace is cleared to find one).
    ``only``: the spans of the blocks to explain (the rest are left out). Without ``infer``, what nothing
    names is ``unknown``, not put down to an autograd graph that saved tensors autograd no longer hands back."""
    blocks = [(*b.span, b.size, k[1]) for k in keys for b in backend.live_blocks(k[2], k[1]) if b.span]
    if only is not None:
        wanted = set(only)
        blocks = [b for b in blocks if (b[0], b[1]) in wanted]
    if not blocks:
        return []
    owner: dict[int, tuple[str, str]] = {}  # block index -> (cause, holder)
    tensor = torch.Tensor
    tensors = _Found(o for o in gc.get_objects() if issubclass(type(o), tensor))  # type(): no __class__ lookups
    ignore = {id(tensors), id(sys._getframe())}
    known = known or {}

    def name(t: Any) -> str | None:  # up to what the user can drop: a global, an engine's attribute
        return known.get(id(t)) or _holder(t, ignore, _TENSOR_DEPTH)

    outer = getattr(_names, "search", None)
    if outer is None:  # the outermost search of this thread: the objects stay alive meanwhile, ids are stable
        _names.search = _Search()
    try:
        blind = _name_owners(backend, tensors, blocks, owner, name)
    finally:
        if outer is None:
            _names.search.close()
            _names.search = None
    del tensors
    if len(owner) < len(blocks) and clear_workspaces:
        _workspaces(backend, keys, blocks, owner)
    if blind is not None and infer:  # what is left is most likely what tensors that graph saved hold
        for i in range(len(blocks)):
            owner.setdefault(i, ("autograd_history", f"{blind} (inferred: tensors it saved were overwritten in "
                                                     "place since, so autograd will not hand them back to compare)"))
    grouped: dict[tuple[str, str], int] = {}
    for i, (_, _, size, _) in enumerate(blocks):
        cause, holder = owner.get(i, ("unknown", "a holder the garbage collector does not see"))
        grouped[(cause, holder)] = grouped.get((cause, holder), 0) + size
    pins = [Pin(cause, n, holder, FIXES[cause]) for (cause, holder), n in grouped.items()]
    return sorted(pins, key=lambda p: -p.bytes)


def _name_owners(backend: Backend, tensors: list, blocks: list[tuple], owner: dict, name) -> str | None:
    """The Python holders of the blocks' tensors, then the autograd graphs' (``_autograd``'s return)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes warn when touched
        for t in tensors:
            hit = [i for i in _blocks_of(backend, t, blocks) if i not in owner]
            held_as = name(t) if hit else None  # a tensor no Python object names is held from C++ (autograd)
            for i in hit:
                if held_as is not None:
                    owner[i] = ("python_reference", f"a tensor {_shape(t)} held as {held_as}")
        return _autograd(backend, tensors, blocks, owner, name) if len(owner) < len(blocks) else None


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
                covered.update(_blocks_of(backend, obj, blocks))
                nodes.append(obj.grad_fn)
            # what cannot refer to anything (ints of a token list, strings) is not walked
            todo += [o for o in gc.get_referents(obj) if gc.is_tracked(o) or isinstance(o, tensor)]
            continue
        node = nodes.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        kept.append(node)
        todo += _saved(node)[0] + gc.get_referents(node)  # a custom Function's ctx attributes too
        nodes += [f for f, _ in getattr(node, "next_functions", ())]
    return [(lo, hi) for i, (lo, hi, _, _) in enumerate(blocks) if i not in covered]


def _held_as(ref: weakref.ref, depth: int) -> str | None:
    """Who holds the object ``ref`` refers to, in words, or None (gone, or no Python holder). The object is
    held only for the search, and this search's own frames are no holder."""
    obj = ref()
    if obj is None:
        return None
    here = sys._getframe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated module attributes warn when touched
            return _holder(obj, {id(here), id(here.f_back)}, depth)
    finally:
        del obj


def graph_holder(entries: list) -> str | None:
    """Who holds the first of these graphs (ledger entries, weak references) that Python can name: a graph
    never reset after its engine's release is kept by someone, and that someone is the fix. None where no
    Python object names any (a C++ holder, or all of them gone)."""
    # up to where the engine keeps it
    return next((named for entry in entries if (named := _held_as(entry, 5)) is not None), None)


def mempool_notes(keys: list[Key]) -> dict[Key, str]:
    """For each pool whose MemPool object is alive (the pool lives with it: its segments stay reserved, even
    with every block free): who holds that object, and the fix."""
    out = {}
    for k in keys:
        ref = ledger.mempools.get(k)
        if ref is None or ref() is None:
            continue
        holder = _held_as(ref, 4) or \
            "a holder the garbage collector does not see (a local variable of a function still running, or C++)"
        out[k] = (f"pool {k[2]}'s MemPool object is alive, held as {holder}: while it lives the pool keeps its "
                  "segments reserved; drop it at release (or give each engine a MemPool of its own)")
    return out


def _blocks_of(backend: Backend, t: torch.Tensor, blocks: list[tuple]) -> list[int]:
    span = backend.storage_span(t)
    if span is None:
        return []
    lo, hi = span
    return [i for i, (blo, bhi, _, _) in enumerate(blocks) if lo < bhi and blo < max(hi, lo + 1)]


def _shape(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _module_named(d: dict) -> str | None:
    for name, mod in list(sys.modules.items()):
        if getattr(mod, "__dict__", None) is d:
            return name
    return None


def _holder(obj: Any, ignore: set[int], depth: int = 3) -> str | None:
    """Who refers to ``obj``, in words: the first referrer that names it (up to ``depth`` levels up); None
    when no Python object does (then C++ holds it: an autograd graph, a library)."""
    refs = _referrers(obj)
    if gc.get_freeze_count():
        refs += _frozen_holders(obj)
    ignore = ignore | {id(sys._getframe()), id(refs)}  # this call's own list and frame refer to it too
    unnamed = None  # a container that holds it but that nothing names (a running function's local)
    library: list = _Found()  # cells of library functions' closures that hold it: walked through last
    for ref in refs:
        if id(ref) in ignore:
            continue
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), "?")
            module = _module_named(ref)
            if module is not None:
                return f"global `{key}` of module {module}"
            owner = _dict_owner(ref, ignore | {id(ref)}, key, obj)
            if isinstance(owner, type):
                return _class_attribute(owner, key)
            if owner is not None:
                return _attribute(owner, key, ignore | {id(ref)}, depth)
            held = _module_slot(ref, ignore | {id(ref)})
            if held is not None:  # a torch module's buffer, parameter or submodule: one level, not three
                kind, mod = held
                return f"{kind} `{key}` of a {type(mod).__qualname__} object" + _up(mod, ignore | {id(ref)}, depth)
            what, up = f"key `{key}` of a dict", _up(ref, ignore, depth)
        elif isinstance(ref, (list, tuple, set)):
            what, up = f"an item of a {type(ref).__name__}", _up(ref, ignore, depth)
        elif isinstance(ref, types.FrameType):
            if is_machinery(ref.f_code.co_filename):
                continue  # this search's own frames (and the harness's) are no holder
            # not by name: reading a running frame's f_locals (before Python 3.13) stores a snapshot of its
            # locals on the frame, which would keep them alive after the function drops them
            return f"a local variable of {ref.f_code.co_name} ({ref.f_code.co_filename}:{ref.f_lineno})"
        elif isinstance(ref, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
            frame = getattr(ref, "gi_frame", None) or getattr(ref, "cr_frame", None) or getattr(ref, "ag_frame", None)
            if frame is None:
                continue
            kind = {types.GeneratorType: "generator", types.CoroutineType: "coroutine"}.get(type(ref), "async generator")
            # its locals, as of the line where it is suspended; the fix is whoever keeps it unfinished
            what, up = (f"a local variable of the suspended {kind} {frame.f_code.co_name} "
                        f"({frame.f_code.co_filename}:{frame.f_lineno})"), _up(ref, ignore, depth)
        elif isinstance(ref, types.CellType):
            owner = _cell_owner(ref)
            if owner is None or is_machinery(owner.__code__.co_filename):
                continue  # a cell of a function now running (its frame), or of this search's own closures
            if not is_user_file(owner.__code__.co_filename):  # torch's closures are not what the user can drop:
                library.append(ref)  # a holder of the user's comes first (a module torch wrapped refers back)
                continue
            # and who keeps the function (a cache of callables, an attribute): what the user drops
            what = f"a closure variable of {owner.__qualname__} ({owner.__code__.co_filename})"
            up = _up(owner, ignore | {id(ref)}, depth)
        elif issubclass(type(ref), type):  # a class attribute, found among frozen holders (_frozen_holders)
            key = next((k for k, v in vars(ref).items() if v is obj), None)
            if key is None:
                continue  # a subclass (its base), or its mro
            return _class_attribute(ref, key)
        else:  # an object keeping it as an attribute without a __dict__ of its own yet (inline values)
            attrs = getattr(ref, "__dict__", None)
            key = next((k for k, v in attrs.items() if v is obj), None) if isinstance(attrs, dict) else None
            if key is None:
                continue
            return _attribute(ref, key, ignore, depth)
        if up or depth <= 1:
            return what + up
        unnamed = unnamed or what
    for cell in library:  # up its closures to what the user holds (cells kept, not functions: no referrer)
        owner = _cell_owner(cell)
        found = _through_library(owner, ignore, depth) if owner is not None else None
        if found is not None:
            return found
    if library and unnamed is None:
        owner = _cell_owner(library[0])
        if owner is None:
            return None
        back = _attribute_holding(obj, owner)
        if back is not None:  # (a module whose forward torch replaced with a closure that refers to the module)
            return (f"nothing but a reference cycle: a closure variable of {owner.__qualname__} "
                    f"({owner.__code__.co_filename}), the function it holds as attribute `{back}`; no other Python "
                    "object holds either, so the next garbage collection (gc.collect()) frees both")
        return f"a closure variable of {owner.__qualname__} ({owner.__code__.co_filename})"
    return unnamed


def _attribute_holding(obj: Any, fn: types.FunctionType) -> str | None:
    """The attribute of ``obj`` that holds ``fn`` (itself, or a method bound to it), or None."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return None
    return next((k for k, v in attrs.items() if v is fn or getattr(v, "__func__", None) is fn), None)


def _cell_owner(cell: types.CellType) -> types.FunctionType | None:
    """The function whose closure holds ``cell`` (None for a cell only a running frame holds)."""
    closure = next((f for f in _referrers(cell) if isinstance(f, tuple)), None)
    if closure is None:
        return None
    return next((f for f in _referrers(closure) if isinstance(f, types.FunctionType)), None)


def _is_library(obj: Any) -> bool:
    """Whether ``obj`` (a function, a class, a method wrapper) is defined outside the user's code."""
    if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        return not is_user_file(obj.__code__.co_filename)
    if isinstance(obj, type):
        if obj.__module__ == "__main__":  # a script, a notebook or a REPL (no __file__ there): the user's
            return False
        f = getattr(sys.modules.get(obj.__module__), "__file__", None)
        return f is None or not is_user_file(f)
    return False


_USER = object()  # a referrer that is no part of a library's closures: a holder of the user's


def _library_parent(ref: Any, node: Any, skip: set[int]) -> Any:
    """What ``ref`` (a referrer of ``node``) belongs to when it is part of a library's closures (a cell of a
    library function, a library class's namespace, a method wrapper): the next object up; None where it leads
    nowhere (a class's mro); ``_USER`` where it is the user's. ``skip``: the search's own containers."""
    if isinstance(ref, types.CellType):
        fn = _cell_owner(ref)
        if fn is None or is_machinery(fn.__code__.co_filename):  # (this search's own closures lead nowhere)
            return None
        return fn if _is_library(fn) else _USER
    if isinstance(ref, (staticmethod, classmethod, types.MethodType, functools_partial)):
        return ref
    if isinstance(ref, tuple):  # a class's bases or mro leads nowhere; any other tuple is a container
        return None if all(isinstance(o, type) for o in _referrers(ref) if id(o) not in skip) else _USER
    if isinstance(ref, dict):  # a library class's namespace, a library function's or wrapper's __dict__
        for o in _referrers(ref):
            if isinstance(o, type) and any(v is node for v in vars(o).values()) \
                    or getattr(o, "__dict__", None) is ref:
                return o if _is_library(o) or isinstance(o, (staticmethod, classmethod)) else _USER
        return _USER
    if isinstance(ref, type):
        return ref if _is_library(ref) else _USER
    return _USER


def _through_library(fn: types.FunctionType, ignore: set[int], depth: int) -> str | None:
    """A library function (torch's ``make_graphed_callables``) keeps the object in its closure: walk up its
    closures, classes and method wrappers to the first object the user's code holds, and name that holder.
    None where the walk reaches none. Once per function in a search (its tensors share it)."""
    return _memoised((id(fn), -depth), lambda: _walk_library(fn, ignore, depth))


def _walk_library(fn: types.FunctionType, ignore: set[int], depth: int) -> str | None:
    todo, seen = _Found([fn]), {id(fn)}
    for node in todo:  # grows as it goes
        refs = _referrers(node)
        skip = ignore | {id(refs), id(sys._getframe()), id(todo)}
        held = False
        for ref in refs:
            if id(ref) in skip or isinstance(ref, types.FrameType) and is_machinery(ref.f_code.co_filename):
                continue
            parent = _library_parent(ref, node, skip)
            if parent is _USER:
                held = True
                continue
            skip.add(id(ref))
            if parent is not None and id(parent) not in seen and len(seen) < _LIBRARY_NODES:
                seen.add(id(parent))
                todo.append(parent)
        del refs  # alive, it would be a referrer of the next node
        if held:
            named = _holder(node, skip, depth)
            if named is not None:
                made_by = fn.__qualname__.partition(".<locals>")[0]
                what = getattr(node, "__qualname__", type(node).__qualname__).rpartition(".")[2]
                return f"a closure variable inside the `{what}` that {fn.__module__}.{made_by} made, held as {named}"
    return None


def _attribute(owner: Any, key: str, ignore: set[int], depth: int) -> str:
    """``attribute `key` of a <Class> object (<who holds it>)``, or the words the class gives for what it
    holds there (``HOLDER_WORDS``: a harness's own objects, named in the user's terms)."""
    words = getattr(type(owner), "HOLDER_WORDS", None)
    if isinstance(words, dict) and isinstance(words.get(key), str):
        return words[key]
    if isinstance(owner, types.FunctionType):  # a function's own attribute (a cache kept on it)
        return f"attribute `{key}` of function {owner.__qualname__} ({owner.__module__})"
    return f"attribute `{key}` of a {type(owner).__qualname__} object" + _up(owner, ignore, depth)


def _class_attribute(cls: type, key: str) -> str:
    return f"class attribute `{key}` of {cls.__qualname__} (module {cls.__module__})"


def _frozen_holders(obj: Any) -> list:
    """Holders ``gc.get_referrers`` does not see: containers ``gc.freeze()`` moved out of the collector's
    generations (a reused worker freezes what it started with, its modules among them). Looked for where a
    program keeps things: module globals, containers that are module globals, and attributes of the classes
    a module defines."""
    out: list = []
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if type(d) is not dict:
            continue
        for v in list(d.values()):
            if v is obj:
                out.append(d)
            elif issubclass(type(v), type) and v.__dict__.get("__module__") == getattr(mod, "__name__", None):
                if any(x is obj for x in list(vars(v).values())):
                    out.append(v)  # a class attribute (the class's namespace is frozen with it)
            elif type(v) in (list, tuple):
                if any(x is obj for x in v):
                    out.append(v)
            elif type(v) is dict and any(x is obj for x in v.values()):
                out.append(v)
    return out


# a scan of the heap for one object's referrers costs about 1/40 of indexing every referrer once: a search that
# has scanned this often (holders through many distinct closures on a heap of millions of objects) indexes it
_INDEX_AFTER = 32


class _Found(list):
    """A list this search made of the program's objects: never a holder, and left out of the heap's index."""


class _Multi(list):
    """An object's referrers in the index where there are several (one is kept bare: most have one)."""


class _Search:
    """What one what_pins call keeps (per thread, nested calls share it): the words found for holders many
    tensors share, and the referrers of every object, indexed once the heap has been scanned often. The program
    does not run meanwhile, so the index stays true: its referrers keep what they refer to alive, so no id is
    reused, and what the search makes afterwards is its own."""

    __slots__ = ("memo", "scans", "index")

    def __init__(self) -> None:
        self.memo: dict = {}
        self.scans = 0
        self.index: dict[int, Any] | None = None

    def referrers(self, obj: Any) -> _Found:
        if not gc.is_tracked(obj):  # the index has no key for it
            return _Found(gc.get_referrers(obj))
        if self.index is None:
            self.scans += 1
            if self.scans <= _INDEX_AFTER:
                return _Found(gc.get_referrers(obj))
            self.index = _heap_index()
        found = self.index.get(id(obj))
        return _Found(() if found is None else found if type(found) is _Multi else (found,))

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
        if type(o) is _Found or type(o) is types.FrameType and is_machinery(o.f_code.co_filename):
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


def _referrers(obj: Any) -> _Found:
    """``gc.get_referrers(obj)``, from the search's index where it has one."""
    search = getattr(_names, "search", None)
    return _Found(gc.get_referrers(obj)) if search is None else search.referrers(obj)


# during what_pins, per thread: its _Search
_names = threading.local()


def _memoised(key: tuple[int, int], words: Callable[[], Any]) -> Any:
    """``words()``, once per key during a search (outside one: every time)."""
    search = getattr(_names, "search", None)
    if search is None:
        return words()
    memo = search.memo
    if key not in memo:
        memo[key] = words()
    return memo[key]


def _up(obj: Any, ignore: set[int], depth: int) -> str:
    """`` (<who holds obj>)`` one level up, or nothing."""
    if depth <= 1:
        return ""
    def words() -> str:
        up = _holder(obj, ignore, depth - 1)
        return f" ({up})" if up else ""

    return _memoised((id(obj), depth), words)


_MODULE_SLOTS = (("_buffers", "buffer"), ("_parameters", "parameter"), ("_modules", "submodule"))


def _module_slot(d: dict, ignore: set[int]) -> tuple[str, torch.nn.Module] | None:
    """(``buffer``/``parameter``/``submodule``, the module) where ``d`` is a torch module's dict of those."""
    for ref in _referrers(d):
        if id(ref) in ignore or type(ref) is not dict:
            continue
        kind = next((k for attr, k in _MODULE_SLOTS if ref.get(attr) is d), None)
        if kind is not None:
            mod = _dict_owner(ref, ignore | {id(ref)}, "", _USER)  # (no class namespace holds _USER)
            if isinstance(mod, torch.nn.Module):
                return kind, mod
    return None


def _dict_owner(d: dict, ignore: set[int], key: Any, obj: Any) -> Any:
    """The object whose ``__dict__`` ``d`` is, or the class whose namespace it is (a class shows it as a
    mappingproxy, so it is told by holding ``obj`` under ``key``), or None. One pass over the referrers."""
    for ref in _referrers(d):
        if id(ref) in ignore or isinstance(ref, (dict, list, tuple, types.FrameType)):
            continue
        if issubclass(type(ref), type):
            if vars(ref).get(key) is obj:
                return ref
        elif getattr(ref, "__dict__", None) is d:
            return ref
    return None


def _saved(node: Any) -> tuple[list[torch.Tensor], int]:
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


def _autograd(backend: Backend, tensors: list, blocks: list[tuple], owner: dict, name) -> str | None:
    """Tensors saved for backward by the autograd graphs that live tensors carry: roots that Python names
    first (a root held only from C++ is itself part of such a graph). Returns the first named root whose
    graph saved tensors that cannot be read back, for blocks nothing else explains."""
    seen: set[int] = set()
    visited: list = []  # Python's node objects are made on each access: keep them, or an id is reused
    roots = [(t, name(t)) for t in tensors if getattr(t, "grad_fn", None) is not None]
    blind = None  # the first named root whose graph saved tensors that cannot be read back
    for root, held_as in sorted(roots, key=lambda r: r[1] is None):
        what = f"the autograd graph of a tensor {_shape(root)}" + (f" held as {held_as}" if held_as else "")
        todo = [root.grad_fn]
        while todo and len(seen) < _AUTOGRAD_NODES:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            visited.append(node)
            saved, unreadable = _saved(node)
            for t in saved:
                for i in _blocks_of(backend, t, blocks):
                    owner.setdefault(i, ("autograd_history", what))
            if unreadable and blind is None and held_as is not None:
                blind = what
            todo += [f for f, _ in getattr(node, "next_functions", ())]
        if len(owner) == len(blocks) or len(seen) >= _AUTOGRAD_NODES:
            break
    return blind


def _workspaces(backend: Backend, keys: list[Key], blocks: list[tuple], owner: dict) -> None:
    """Clear the libraries' workspace caches, where no graph of the device is alive, and see what went."""
    devices = {d for _, _, _, d in blocks}
    live = {g.device for g in ledger.live_graphs(backend.world)}
    if devices & live or not backend.clear_library_workspaces():
        return
    left = {(b.address, b.size) for k in keys for b in backend.live_blocks(k[2], k[1])}
    for i, (lo, _, size, _) in enumerate(blocks):
        if i not in owner and (lo, size) not in left:
            owner[i] = ("library_workspace", "a cuBLAS workspace created inside a capture (the caches were "
                                             "cleared to find it: freed now, and made again outside any capture)")
