"""Poisoned padding and no-write detection, for a replay in checked mode.

Two replays. The first runs with the padded rows of the static input poisoned (NaN, or the dtype's lowest
value for integers); the second with the normal padding, every static output filled with that sentinel first.
A row of the real batch that still holds the sentinel in every element after the second was never written by
the graph (an op on another stream, an output the captured ops do not produce). Real rows that differ between
the two depend on the padding (an op that mixes rows: a norm over the batch, a sort, a missing mask), which
running the real batch eagerly would not show.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ReplayCheckError
from ..trees import leaves


def sentinel(dtype: torch.dtype) -> float | int | None:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return torch.iinfo(dtype).min


def _unwritten(t: torch.Tensor, b: int) -> torch.Tensor | None:
    """Per real row, on the device: does it hold the sentinel in every element (None: no sentinel here)."""
    s = sentinel(t.dtype)
    if s is None or t.dim() == 0:
        return None
    rows = t[:b].reshape(b, -1)
    hit = torch.isnan(rows) if isinstance(s, float) else rows == s
    return hit.all(dim=1)


def checked_replay(graph: Any, static_in: torch.Tensor, b: int, bs: int, outputs: Any, pad_value: float,
                   what: str) -> None:
    """Replay ``graph`` for a batch of ``b`` real rows of ``bs``, checking what it writes (see the module).
    The graph is left holding the outputs of the real batch padded with ``pad_value``. Every verdict is
    computed on the device and read back at once: one host sync per checked step, not one per output."""
    outs = [t for t in leaves(outputs) if isinstance(t, torch.Tensor)]
    poison = sentinel(static_in.dtype)
    if b < bs and poison is not None:  # first the padding poisoned, to compare with the normal run below
        static_in[b:bs].fill_(poison)
        graph.replay()
        poisoned = [t[:b].clone() for t in outs]
    else:
        poisoned = None
    if b < bs:
        static_in[b:bs].fill_(pad_value)
    for t in outs:
        s = sentinel(t.dtype)
        if s is not None:
            t.fill_(s)
    graph.replay()
    unwritten = [_unwritten(t, b) for t in outs]
    same = [torch.isclose(a, t[:b]).all() if a.dtype.is_floating_point else (a == t[:b]).all()
            for a, t in zip(poisoned or [], outs)]
    flags = [u for u in unwritten if u is not None] + [x.reshape(1) for x in same]
    read = torch.cat(flags).tolist() if flags else []
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
