"""The engine protocol: what a factory must return for an engine cycle, and what is optional.

| member | needed | if absent |
|---|---|---|
| ``run(x)``, or the engine itself callable | yes | usage error |
| ``release()`` (or ``close()``, or ``shutdown()``) | yes | usage error |
| ``capture()`` | no | graphs are captured by the first ``run`` (``make_graphed_callables``, ``torch.compile``) |
| ``example_input()`` | no | nothing is run: only ``capture()`` is exercised |
| ``eager(x)`` | no | no replay-versus-eager comparison |
| ``pool_ids()`` | no | pools come from observation alone; when present it is cross-checked |

``pool_ids()`` returns ``[(device, pool_id), ...]``: ``device`` an int, ``pool_id`` the pair of ints that
``torch.cuda.graph_pool_handle()`` or ``MemPool.id`` gives. An engine with a ``runner``
(:class:`~cudagraph_lifecycle.CUDAGraphRunner`) and no ``pool_ids()`` of its own declares the runner's pools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backends import PoolId
from ..errors import ConfigError

RELEASE_NAMES = ("release", "close", "shutdown")
PROTOCOL = "an engine needs run(x) (or to be callable) and release() (or close()/shutdown())"


def _method(obj: Any, name: str) -> Callable | None:
    fn = getattr(obj, name, None)
    return fn if callable(fn) else None


class Engine:
    """An engine object seen through the protocol; a wrong shape is a :class:`ConfigError` naming the
    missing piece."""

    # how a finding names what this wrapper holds (sanitizer/pins.py): in the user's words
    HOLDER_WORDS = {"obj": "the engine the factory built"}

    def __init__(self, obj: Any):
        kind = type(obj).__name__
        run = _method(obj, "run")
        if run is None and callable(obj) and not isinstance(obj, type):
            run = obj
        release = next((m for m in (_method(obj, n) for n in RELEASE_NAMES) if m is not None), None)
        missing = ([] if run is not None else ["run(x) (or __call__)"]) + \
            ([] if release is not None else ["release() (or close()/shutdown())"])
        if missing:
            raise ConfigError(
                f"the factory returned {kind}, which has no {' and no '.join(missing)}: {PROTOCOL}. "
                "Optional: capture(), example_input(), eager(x), pool_ids() (see cudagraph_lifecycle.cycle.engine)"
            )
        self.obj = obj
        self.name = kind
        self.run = run
        self.release = release
        self.capture = _method(obj, "capture")
        self.example_input = _method(obj, "example_input")
        self.eager = _method(obj, "eager")

    def declared_pools(self) -> list[tuple[int, PoolId]] | None:
        """The pools the engine says it owns: its own ``pool_ids()`` where it has one (what it says wins over
        what its runner holds), else its runner's; None if it says nothing."""
        fn = _method(self.obj, "pool_ids")
        if fn is not None:
            return check_pool_ids(fn(), f"{self.name}.pool_ids()")
        runner = getattr(self.obj, "runner", None)
        if runner is not None and hasattr(runner, "pool_ids"):
            return check_pool_ids(runner.pool_ids, f"{self.name}.runner.pool_ids")
        return None


def check_pool_ids(value: Any, what: str) -> list[tuple[int, PoolId]]:
    """``[(device, (a, b)), ...]`` with ints, else a ConfigError showing what came back."""
    try:
        items = list(value)
    except TypeError:
        items = None
    out = []
    for item in items or []:
        try:
            device, pool = item
            pool = tuple(pool)
        except (TypeError, ValueError):
            break
        if not (_is_int(device) and len(pool) == 2 and all(_is_int(p) for p in pool)):
            break
        out.append((int(device), (int(pool[0]), int(pool[1]))))
    if items is None or len(out) != len(items):
        raise ConfigError(
            f"{what} returned {value!r}: it must return a list of (device, pool_id) pairs, the device an int and "
            "the pool id the pair of ints that torch.cuda.graph_pool_handle() or MemPool.id gives, e.g. "
            "[(0, (0, 1))]; or drop pool_ids(): pools are observed"
        )
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
