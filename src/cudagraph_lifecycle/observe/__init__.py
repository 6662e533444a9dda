"""The observation layer: wraps every backend kind's graph API once per process and feeds the ledger.

Reference-counted and idempotent: :func:`acquire` installs the wrappers on the first call, :func:`release`
restores the originals (the very same objects) when the last holder lets go, in whatever order holders come
and go. Installing touches only Python attributes, so it can (and should) happen before CUDA initializes:
the wrappers cost nothing until a graph call. A forked child starts unobserved, with an empty ledger.

Judges: a sanitizer registers one per allocator world (:func:`add_judge`); a capture into a dead pool of
that world, a capture begun on its default stream, and (under expandable segments) a hazardous teardown are
recorded in the ledger, then handed to the judge, which raises before torch would assert or poison the
process. Without a judge the capture goes through (and torch decides).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..backends import graph_apis
from ..ledger import ledger
from . import compiled, wrappers
from .wrappers import Hooks, Judge

_lock = threading.RLock()
_holders = 0
# (owner, name, what to restore: the original, or None where it was inherited; what the wrapper calls)
_saved: list[tuple[Any, str, Any, Any]] = []
# graph class -> (its DirectCapture, the capture_begin and capture_end wrappers it stands for)
_direct: dict[type, tuple[wrappers.DirectCapture, Any, Any]] = {}
_judges: dict[Any, list[Judge]] = {}
hooks = Hooks(ledger, _judges)


def _patch(owner: Any, name: str, make) -> None:
    own = name in vars(owner)  # a class may inherit the method: restore by deleting our override then
    original = getattr(owner, name)
    _saved.append((owner, name, original if own else None, original))
    setattr(owner, name, make(original))


def _capture_begin(api, original, record, path: str):
    python = wrappers.capture_begin(api, hooks, original, record)
    return python if path == "python" else compiled.capture_begin(api, hooks, original, python)


def _install() -> None:
    path = compiled.path()  # (a bad CUDAGRAPH_CAPTURE_PATH raises here, before anything is patched)
    for api in graph_apis():
        cls = api.graph_cls
        record = wrappers.recorder(hooks)
        _patch(cls, "capture_begin", lambda f, a=api, r=record: _capture_begin(a, f, r, path))
        _patch(cls, "capture_end", lambda f, a=api: wrappers.capture_end(a, hooks, f) if path == "python"
               else compiled.capture_end(hooks, f))
        (*_, begin), (*_, end) = _saved[-2:]
        # the compiled wrapper makes the runner's entries too: the same record, without a Python frame a graph
        direct_record = record if path == "python" else vars(cls)["capture_begin"].record
        _direct[cls] = (wrappers.DirectCapture(hooks, begin, end, direct_record), cls.capture_begin,
                        cls.capture_end)
        _patch(cls, "reset", lambda f, a=api: wrappers.reset(a, hooks, f))
        _patch(cls, "replay", lambda f, a=api: wrappers.replay(a, hooks, f))
        for owner, name, parse in api.handles:
            _patch(owner, name, lambda f, p=parse: wrappers.handle(p, hooks, f))
        if api.mempool_cls is not None and api.mempool_parse is not None:
            _patch(api.mempool_cls, "__init__", lambda f, a=api: wrappers.mempool_init(a, hooks, f))
        for hook, host in ((api.device_flush, False), (api.host_flush, True)):
            if hook is not None:
                owner, name, parse = hook
                _patch(owner, name, lambda f, p=parse, h=host: wrappers.flush(p, hooks, f, h) if path == "python"
                       else compiled.flush(p, hooks, f, h))
        for owner, name, parse in api.pool_refs:
            _patch(owner, name, lambda f, p=parse: wrappers.pool_reference(p, hooks, f))


def _uninstall() -> None:
    _direct.clear()
    ledger.flush_watchers.clear()  # the flush wrappers' (no one else registers)
    while _saved:
        owner, name, original, _ = _saved.pop()
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def acquire() -> None:
    """Hold the observation layer (installing it on the first hold)."""
    global _holders
    with _lock:
        if _holders == 0:
            _install()
        _holders += 1


def release() -> None:
    """Let go of one hold; the last one restores the graph API exactly as it was."""
    global _holders
    with _lock:
        if _holders <= 0:
            return
        _holders -= 1
        if _holders == 0:
            _uninstall()


def installed() -> bool:
    return _holders > 0


def direct_capture(graph_cls: type) -> wrappers.DirectCapture | None:
    """The direct capture path for graphs of ``graph_cls`` (see :class:`~.wrappers.DirectCapture`), or None
    where the layer is not installed or something else now stands in front of our capture wrappers (then the
    caller calls the graph's methods as anyone would)."""
    found = _direct.get(graph_cls)
    if found is None:
        for cls in graph_cls.__mro__[1:]:  # a subclass of a watched class
            found = _direct.get(cls)
            if found is not None:
                break
    if found is None:
        return None
    direct, begin, end = found
    return direct if graph_cls.capture_begin is begin and graph_cls.capture_end is end else None


def add_judge(world: Any, judge: Judge) -> None:
    with _lock:  # a new list, never changed: a capture in another thread reads the one it got whole
        _judges[world] = [*_judges.get(world, []), judge]


def remove_judge(world: Any, judge: Judge) -> None:
    with _lock:
        rules = list(_judges.get(world, []))
        if judge not in rules:
            return
        rules.remove(judge)
        if rules:
            _judges[world] = rules
        else:
            _judges.pop(world, None)


def _after_fork_in_child() -> None:
    # The parent's holders and judges are not this process's: start unobserved, as a fresh process does.
    global _holders, _lock
    _lock = threading.RLock()
    _uninstall()
    _holders = 0
    _judges.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
