"""The caller's side of an engine sequence in one process: the output it holds (``hold``) or the copy of
it that it keeps (``drop``), and the record of the engine that produced it.

Holding the last output while the next engine captures is the hazard that turns a kept pool id into the
allocator's assert; a copy keeps nothing of the pool unless it carries autograd history into it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..backends import Backend
from ..ledger import Key
from ..record import CycleRecord
from ..trees import map_leaves

OUTPUT_MODES = ("hold", "drop")


def caller_copy(y: Any) -> Any:
    """What a caller that copies results out keeps: host memory on a GPU, a clone on the CPU. Autograd
    history rides along, as it would in the caller's code."""
    import torch

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to("cpu") if t.device.type != "cpu" else t.clone()

    return map_leaves(copy, y)


@dataclass
class Caller:
    # how a finding names what this object holds (sanitizer/pins.py): the harness's caller, in the user's words
    HOLDER_WORDS = {"held": "the previous engine's output, which the caller holds until the next engine has "
                            "captured (engine_sequence's output=\"hold\")",
                    "kept": "the copy of an output the caller keeps (engine_sequence's output=\"drop\")"}

    held: Any = None  # the last engine's output, a view into its pool (hold)
    held_pools: list[Key] = field(default_factory=list)
    held_record: CycleRecord | None = None
    kept: Any = None  # the last copy (drop)


_callers: dict[Any, Caller] = {}


def caller_of(backend: Backend) -> Caller:
    return _callers.setdefault(backend.world, Caller())


def _forget() -> None:
    _callers.clear()


os.register_at_fork(after_in_child=_forget)
