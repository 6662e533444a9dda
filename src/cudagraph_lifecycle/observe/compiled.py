"""The compiled capture path: which capture_begin, capture_end and cache-flush wrappers this process installs,
and how the compiled ones are built around the Python ones.

``_capture`` (an optional C extension, built at install where a compiler is found) runs the wrappers' common
paths; every call off them goes to the Python code (:func:`.wrappers.capture_begin`, ``Hooks.ended``,
:func:`.wrappers.flush`), so both give the ledger the same entries. ``CUDAGRAPH_CAPTURE_PATH`` chooses:
``auto`` (the default) takes the compiled path where it was built, ``python`` never does, ``compiled`` is an
error where it was not built (a benchmark or a CI job that must measure it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

from ..backends.base import GraphAPI
from ..choices import capture_path_from_env, compiled_or_python
from ..ledger import CAPTURE_STACK_DEPTH, GraphEntry
from . import wrappers
from .wrappers import TAG, Hooks, begin_failed

try:
    from . import _capture
except ImportError as e:  # not built (no compiler at install), or built for another Python: the Python path, and why
    _capture = None
    _missing = ("no _capture extension was built at install"
                if importlib.util.find_spec(f"{__package__}._capture") is None else f"{type(e).__name__}: {e}")
else:
    _missing = ""


def path() -> str:
    """``compiled`` or ``python``: the capture path the observation layer installs now."""
    return compiled_or_python(os.environ, None if _capture is not None else _missing, "the compiled capture path")


def describe() -> str:
    """The capture path and, for the Python one, why: for reports and benchmarks."""
    chosen = capture_path_from_env(os.environ)
    if chosen == "python":
        return "python (CUDAGRAPH_CAPTURE_PATH=python)"
    return "compiled" if _capture is not None else f"python (the compiled path was not built: {_missing})"


def capture_begin(api: GraphAPI, hooks: Hooks, original, python) -> Any:
    """The compiled wrapper of ``original`` (``api``'s capture_begin): what ``python``, the Python wrapper of
    the same original, does, handing it every call off the common path."""
    led = hooks.ledger
    w = _capture.CaptureBegin(
        original=original, fallback=python, proc=api.process_cls, backend_of=api.graph_backend,
        current_device=api.current_device, device_of=api.capture_device,
        # the Python wrapper reads the streams only where both readers exist
        stream_of=api.current_stream if api.default_stream is not None else None, default_of=api.default_stream,
        on_default=api.on_default_stream, judges=hooks.judges, dead_ids=led.dead.ids,
        pending_keys=led.pending_keys, ledger=led, seq_counter=led.seq_counter, pending=led.pending,
        entry_cls=GraphEntry, gone=hooks._gone, tag=TAG, worlds=hooks.worlds, saw=hooks.saw,
        untagged=hooks.untagged, register=hooks.register, drain=hooks.drain,
        begin_failed=functools.partial(begin_failed, hooks, api.capture_device), depth=CAPTURE_STACK_DEPTH)
    functools.update_wrapper(w, original)
    return w


def capture_end(hooks: Hooks, original) -> Any:
    """The compiled wrapper of ``original`` (a graph class's capture_end): what :func:`.wrappers.capture_end`
    does, its common path (the graph's own entry, its pool known since capture_begin) compiled."""
    w = _capture.CaptureEnd(original=original, capture_failed=hooks.capture_failed, ended=hooks.ended,
                            entry_cls=GraphEntry, tag=TAG, ledger=hooks.ledger)
    functools.update_wrapper(w, original)
    return w


def flush(parse, hooks: Hooks, original, host: bool) -> Any:
    """A cache flush's compiled gate: straight to ``original`` while disarmed (the common case: nothing waits
    for a flush), else to :func:`.wrappers.flush`'s Python wrapper, which shares the gate."""
    gate = _capture.FlushGate(original=original)
    gate.slow = wrappers.flush(parse, hooks, original, host, gate)
    functools.update_wrapper(gate, original)
    return gate
