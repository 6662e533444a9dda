"""Who holds an object, in words a user can act on: named up from ``gc.get_referrers`` a few levels (a
module global, an object's or a class's attribute, a torch module's buffer, a container, a running or
suspended function's local, a closure), and through a library's closures (torch's ``make_graphed_callables``)
up to the first object the user's code holds. The search's own frames, lists and closures are no holder.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
import weakref
from functools import partial as functools_partial
from typing import Any

import torch

from ..ledger import is_machinery, is_user_file
from .heap_index import Found, memoised, referrers_of

_LIBRARY_NODES = 16  # objects of a library's closures walked through at most, up to what the user holds


def held_where(ref: weakref.ref, depth: int) -> str | None:
    """Who holds the object ``ref`` refers to, in words, or None (gone, or no Python holder). The object is
    held only for the search, and this search's own frames are no holder."""
    obj = ref()
    if obj is None:
        return None
    here = sys._getframe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated module attributes warn when touched
            return holder_of(obj, {id(here), id(here.f_back)}, depth)
    finally:
        del obj


def _module_named(d: dict) -> str | None:
    for name, mod in list(sys.modules.items()):
        if getattr(mod, "__dict__", None) is d:
            return name
    return None


def holder_of(obj: Any, ignore: set[int], depth: int = 3) -> str | None:
    """Who refers to ``obj``, in words: the first referrer that names it (up to ``depth`` levels up); None
    when no Python object does (then C++ holds it: an autograd graph, a library)."""
    refs = referrers_of(obj)
    if gc.get_freeze_count():
        refs += _frozen_holders(obj)
    ignore = ignore | {id(sys._getframe()), id(refs)}  # this call's own list and frame refer to it too
    unnamed = None  # a container that holds it but that nothing names (a running function's local)
    library: list = Found()  # cells of library functions' closures that hold it: walked through last
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
    closure = next((f for f in referrers_of(cell) if isinstance(f, tuple)), None)
    if closure is None:
        return None
    return next((f for f in referrers_of(closure) if isinstance(f, types.FunctionType)), None)


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
        return None if all(isinstance(o, type) for o in referrers_of(ref) if id(o) not in skip) else _USER
    if isinstance(ref, dict):  # a library class's namespace, a library function's or wrapper's __dict__
        for o in referrers_of(ref):
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
    return memoised((id(fn), -depth), lambda: _walk_library(fn, ignore, depth))


def _walk_library(fn: types.FunctionType, ignore: set[int], depth: int) -> str | None:
    todo, seen = Found([fn]), {id(fn)}
    for node in todo:  # grows as it goes
        refs = referrers_of(node)
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
            named = holder_of(node, skip, depth)
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


def _up(obj: Any, ignore: set[int], depth: int) -> str:
    """`` (<who holds obj>)`` one level up, or nothing."""
    if depth <= 1:
        return ""
    def words() -> str:
        up = holder_of(obj, ignore, depth - 1)
        return f" ({up})" if up else ""

    return memoised((id(obj), depth), words)


_MODULE_SLOTS = (("_buffers", "buffer"), ("_parameters", "parameter"), ("_modules", "submodule"))


def _module_slot(d: dict, ignore: set[int]) -> tuple[str, torch.nn.Module] | None:
    """(``buffer``/``parameter``/``submodule``, the module) where ``d`` is a torch module's dict of those."""
    for ref in referrers_of(d):
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
    for ref in referrers_of(d):
        if id(ref) in ignore or isinstance(ref, (dict, list, tuple, types.FrameType)):
            continue
        if issubclass(type(ref), type):
            if vars(ref).get(key) is obj:
                return ref
        elif getattr(ref, "__dict__", None) is d:
            return ref
    return None
