"""Whether the replay-correctness checks are on in this process.

On when ``CUDAGRAPH_CHECKED=1`` is set, or while a sanitizer runs in ``strict`` mode (the plugin's
``--cudagraph-sanitize=strict`` turns it on in workers and in ``cudagraph``-marked tests). A runner built with
``checked=True`` or ``False`` decides for itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from ..choices import checked_from_env
from ..errors import ConfigError

# The checks a runner can run, each alone or together: "capture" watches each capture op by op (what it reads,
# for check_addresses(), and the op that broke it); "padding" replays with poisoned padding and outputs;
# "outputs" makes a returned output raise once a later replay overwrote it.
CHECKS = ("capture", "padding", "outputs")

_lock = threading.Lock()
_strict_holders = 0


def enabled() -> bool:
    from_env = checked_from_env(os.environ)  # read first: a bad value is an error even while strict holds it
    return _strict_holders > 0 or from_env


def hold() -> None:
    global _strict_holders
    with _lock:
        _strict_holders += 1


def release() -> None:
    global _strict_holders
    with _lock:
        _strict_holders = max(0, _strict_holders - 1)


def selected(checked: bool | Iterable[str] | None, what: str = "checked") -> frozenset[str]:
    """The checks ``checked`` turns on: True all, False none, None all when :func:`enabled`, or the names."""
    if checked is None:
        checked = enabled()
    if isinstance(checked, bool):
        return frozenset(CHECKS) if checked else frozenset()
    if isinstance(checked, str) or not isinstance(checked, Iterable):
        raise ConfigError(f"{what}={checked!r}: give True, False, None or a list of checks from {list(CHECKS)}")
    names = list(checked)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ConfigError(f"{what}={names!r}: unknown check(s) {unknown}; choose from {list(CHECKS)}")
    return frozenset(names)
