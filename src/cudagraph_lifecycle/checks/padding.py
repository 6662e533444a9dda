"""Poisoned padding and no-write detection, for a replay in checked mode.

Two replays. The first runs with the padded rows of the static input poisoned; the second with the normal
padding, every static output filled with a sentinel first (NaN, or the dtype's lowest value for integers).
Floating inputs are poisoned with NaN. Integer and bool inputs are token ids, positions, indices and masks:
whatever reads them may index with them (an embedding, a gather, a KV-cache slot), and an out-of-range value
is a device-side assert that kills the process on CUDA. So their padding rows get values the real rows hold
(the real rows in reverse order, repeated): values the engine accepts, yet not the normal padding.
A row of the real batch that still holds the sentinel in every element after the second was never written by
the graph (an op on another stream, an output the captured ops do not produce). Real rows that differ between
the two depend on the padding (an op that mixes rows: a norm over the batch, a sort, a missing mask), which
running the real batch eagerly would not show.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ReplayCheckError, first_line
from ..trees import leaves
from .capture_watch import storage_key


def sentinel(dtype: torch.dtype) -> float | int | None:
    """What an output row the replay never wrote keeps: NaN, the lowest integer, or None (bool: no value
    tells an unwritten row from a written one)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return torch.iinfo(dtype).min


def poison_text(dtype: torch.dtype) -> str:
    """How the padding rows of an input of this dtype are poisoned, in words (for messages and the docs)."""
    if dtype.is_floating_point or dtype.is_complex:
        return "NaN"
    return ("values of the real rows, in reverse order (an out-of-range integer would crash whatever indexes "
            "with it, such as an embedding)")


def poison_padding(static_in: torch.Tensor, b: int, bs: int) -> None:
    """Poison rows ``b..bs-1`` of ``static_in`` (see the module): NaN for floating inputs; for integer and
    bool inputs, the real rows in reverse order, repeated, so every value is one the engine already reads."""
    if static_in.dtype.is_floating_point or static_in.dtype.is_complex:
        static_in[b:bs].fill_(float("nan"))
        return
    rows = torch.arange(bs - b, device=static_in.device) % b
    static_in[b:bs].copy_(static_in[:b].flip(0).index_select(0, rows))


TURN_OFF = ("run without this check: CUDAGraphRunner(checked=['capture', 'outputs']) keeps the others, "
            "checked=False turns all off (under --cudagraph-sanitize=strict, which turns checked mode on, "
            "build the runner with an explicit checked=)")


def _ours(e: RuntimeError, static_in: torch.Tensor, what: str) -> None:
    """A device-side assert during the checked replays: say it was this check's replay, on stderr first (on
    CUDA the process is lost, and a worker's crash report quotes what it printed last), then as the error."""
    import sys

    text = (f"{what}: the padding check's replays hit a device-side assert (the padding rows of the "
            f"{static_in.dtype} input were poisoned with {poison_text(static_in.dtype)}, and every output filled "
            f"with a sentinel). This is cudagraph-lifecycle's check, not the engine's own run: {TURN_OFF}")
    print(f"cudagraph-lifecycle: {text}", file=sys.stderr, flush=True)
    raise ReplayCheckError(f"{text} ({first_line(e)})") from e


# A device storage larger than this (a real KV cache: gigabytes) is copied to host memory: a copy beside it on
# the device could fail for want of memory, crashing a correct engine, or leave the default pool grown by its size.
ON_DEVICE_COPY_BYTES = 64 << 20


def _save(writes: list | None) -> list[tuple[Any, Any]]:
    """(storage, a copy of it) for each storage in ``writes`` still alive."""
    saved = []
    for weak in writes or ():
        storage = torch.UntypedStorage._new_with_weak_ptr(weak.cdata) if not weak.expired() else None
        if storage is not None:
            big = storage.device.type != "cpu" and storage.nbytes() > ON_DEVICE_COPY_BYTES
            saved.append((storage, storage.cpu() if big else storage.clone()))
    return saved


def _shared(outs: list[torch.Tensor], static_in: torch.Tensor) -> list[bool]:
    """Per output: does it share the input's storage (read by the graph, so no sentinel goes there)."""
    try:
        ptr = static_in.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without storage: assume shared, poison nothing
        return [True] * len(outs)
    shared = []
    for t in outs:
        try:
            shared.append(t.untyped_storage().data_ptr() == ptr)
        except (RuntimeError, NotImplementedError):
            shared.append(True)
    return shared


def _unwritten(t: torch.Tensor, b: int) -> torch.Tensor | None:
    """Per real row, on the device: does it hold the sentinel in every element (None: no sentinel here)."""
    s = sentinel(t.dtype)
    if s is None or t.dim() == 0:
        return None
    rows = t[:b].reshape(b, -1)
    hit = torch.isnan(rows) if isinstance(s, float) else rows == s
    return hit.all(dim=1)


def checked_replay(graph: Any, static_in: torch.Tensor, b: int, bs: int, outputs: Any, pad_value: float,
                   what: str, writes: list | None = None, state: frozenset | None = None) -> None:
    """Replay ``graph`` for a batch of ``b`` real rows of ``bs``, checking what it writes (see the module).
    The graph is left holding the outputs of the real batch padded with ``pad_value``. Every verdict is
    computed on the device and read back at once: one host sync per checked step, not one per output.
    ``writes``: weak references to the storages from outside the graph that it writes in place (a KV cache,
    a step counter; the op watch's record), put back after the extra, poisoned replay so that the engine's
    state moves once a step, as unchecked (None: not watched, nothing put back). ``state``: those storages'
    keys; an output that is a view of one (a KV cache handed back) gets no sentinel: the graph reads it, and
    filling it would erase what the replay does not write (an output of storage from outside that the graph
    never writes still gets one, and is caught as unwritten)."""
    outs = [t for t in leaves(outputs) if isinstance(t, torch.Tensor)]
    if b < bs:  # first the padding poisoned, to compare with the normal run below
        saved = _save(writes)
        poison_padding(static_in, b, bs)
        graph.replay()
        poisoned = [t[:b].clone() for t in outs]
        for storage, copy in saved:
            storage.copy_(copy)
    else:
        poisoned = None
    if b < bs:
        static_in[b:bs].fill_(pad_value)
    shared = _shared(outs, static_in)
    if state:
        shared = [sh or storage_key(t) in state for t, sh in zip(outs, shared)]
    for t, sh in zip(outs, shared):
        s = sentinel(t.dtype)
        # an output that is a view of state (the input, a KV cache) is read by the graph: no sentinel there
        if s is not None and not sh:
            t.fill_(s)
    graph.replay()
    unwritten = [None if sh else _unwritten(t, b) for t, sh in zip(outs, shared)]
    same = [torch.isclose(a, t[:b]).all() if a.dtype.is_floating_point else (a == t[:b]).all()
            for a, t in zip(poisoned or [], outs)]
    flags = [u for u in unwritten if u is not None] + [x.reshape(1) for x in same]
    try:
        read = torch.cat(flags).tolist() if flags else []  # the one host sync: a device-side error surfaces here
    except RuntimeError as e:
        if "device-side assert" not in str(e):
            raise
        _ours(e, static_in, what)
    at = 0
    for i, u in enumerate(unwritten):
        if u is None:
            continue
        rows = [r for r, hit in enumerate(read[at:at + b]) if hit]
        at += b
        if rows:
            raise ReplayCheckError(
                f"{what}: the replay wrote nothing to rows {rows} of output #{i} (they still hold the sentinel "
                "put there before it): the graph recorded no write to them (an op on another stream, or an output "
                "that is not produced by the captured ops)")
    for i, ok in enumerate(read[at:]):
        if not ok:
            raise ReplayCheckError(
                f"{what}: rows 0..{b - 1} of output #{i} changed when only the padding rows {b}..{bs - 1} of the "
                "input changed: the real rows depend on the padding (an op that mixes rows across the batch)")
