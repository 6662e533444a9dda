"""Overwritten outputs: a replay's outputs are views of the graph's static buffers, so the next replay of the
same graph overwrites them. In checked mode the runner returns them as :class:`CheckedOutput` views; a later
replay marks the earlier ones overwritten, and any use of one then raises :class:`OverwrittenOutputError`
naming where it was returned and which replay overwrote it (cudagraph trees do the same for their outputs)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..errors import OverwrittenOutputError
from ..ledger import Stack


class CheckedOutput(torch.Tensor):
    """A view of a static output that knows which replay returned it. Operations on it give plain tensors."""

    _returned_at: Stack | None = None
    _overwritten_at: Stack | None = None
    _replay: int = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _checked_in(args, kwargs):
            if t._overwritten_at is not None:
                raise OverwrittenOutputError(
                    f"this output of replay {t._replay} was overwritten by a later replay of the same graph; "
                    "copy it (.clone()) before the next step if you keep it\n"
                    f"--- returned by replay {t._replay} at ---\n{t._returned_at}"
                    f"--- overwritten by the replay at ---\n{t._overwritten_at}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _checked_in(args: Any, kwargs: dict) -> list[CheckedOutput]:
    from ..trees import leaves

    return [t for t in leaves((args, kwargs)) if isinstance(t, CheckedOutput)]


class OutputGuard:
    """Per graph key: the outputs handed out by its last replay (weakly), marked overwritten at the next one."""

    def __init__(self) -> None:
        self._handed: dict[Any, list[weakref.ref]] = {}
        self._replays: dict[Any, int] = {}

    def replaying(self, key: Any) -> None:
        """Replay of ``key`` about to run: every output of its earlier replays still alive is overwritten."""
        here = None
        for ref in self._handed.pop(key, []):
            t = ref()
            if t is not None:
                here = here or Stack.here(2)
                t._overwritten_at = here
        self._replays[key] = self._replays.get(key, 0) + 1

    def hand_out(self, key: Any, t: torch.Tensor) -> CheckedOutput:
        out = t.as_subclass(CheckedOutput)
        out._returned_at = Stack.here(2)
        out._replay = self._replays.get(key, 0)
        self._handed.setdefault(key, []).append(weakref.ref(out))
        return out
