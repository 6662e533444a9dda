"""Whether the replay-correctness checks are on in this process.

On when ``CUDAGRAPH_CHECKED=1`` is set, or while a sanitizer runs in ``strict`` mode (the plugin's
``--cudagraph-sanitize=strict`` turns it on in workers and in ``cudagraph``-marked tests). A runner built with
``checked=True`` or ``False`` decides for itself.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_strict_holders = 0


def enabled() -> bool:
    return _strict_holders > 0 or os.environ.get("CUDAGRAPH_CHECKED", "").strip().lower() in ("1", "true", "on", "yes")


def hold() -> None:
    global _strict_holders
    with _lock:
        _strict_holders += 1


def release() -> None:
    global _strict_holders
    with _lock:
        _strict_holders = max(0, _strict_holders - 1)
