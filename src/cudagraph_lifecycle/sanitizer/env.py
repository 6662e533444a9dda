"""``CUDAGRAPH_SANITIZE=1|on|strict``: one sanitizer for the whole program, installed at import."""

from __future__ import annotations

import os

from ..backends import get_backend
from ..choices import EXPANDABLE_TEARDOWN
from ..errors import BackendUnavailableError, ConfigError
from .pool_sanitizer import PoolSanitizer

_global: PoolSanitizer | None = None
OFF = ("", "0", "off", "false", "no")  # (the package's import repeats these: it must not import this module)
_ON = ("1", "on", "true", "yes")


def install_from_env(environ: dict[str, str] | None = None) -> PoolSanitizer | None:
    """Install a process-wide sanitizer when ``CUDAGRAPH_SANITIZE`` is ``1``/``on``/``strict``, on the
    process's backend of kind ``CUDAGRAPH_SANITIZE_BACKEND`` (default ``auto``); under expandable segments
    it refuses a hazardous teardown unless ``CUDAGRAPH_EXPANDABLE_TEARDOWN=report``."""
    global _global
    env = os.environ if environ is None else environ
    value = env.get("CUDAGRAPH_SANITIZE", "").strip().lower()
    if value in OFF:
        return None
    if value not in _ON and value != "strict":
        raise ConfigError(
            f"CUDAGRAPH_SANITIZE={env.get('CUDAGRAPH_SANITIZE')!r} is not a sanitizer mode: "
            "set it to 1 (or on), strict, or 0 (off)")
    mode = "strict" if value == "strict" else "on"
    teardown = env.get("CUDAGRAPH_EXPANDABLE_TEARDOWN", "").strip().lower() or "refuse"
    if teardown not in EXPANDABLE_TEARDOWN:
        raise ConfigError(
            f"CUDAGRAPH_EXPANDABLE_TEARDOWN={env.get('CUDAGRAPH_EXPANDABLE_TEARDOWN')!r}: set it to refuse (the "
            "default: a pool torn down with live blocks under expandable segments is not reset) or report")
    kind = env.get("CUDAGRAPH_SANITIZE_BACKEND", "auto").strip() or "auto"
    try:
        backend = get_backend(kind)
    except ConfigError as e:
        raise ConfigError(f"CUDAGRAPH_SANITIZE_BACKEND={kind!r}: {e}") from None
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"CUDAGRAPH_SANITIZE_BACKEND={kind!r}: {e}") from None
    if _global is None or not _global.active:
        _global = PoolSanitizer(backend, mode=mode, expandable_teardown=teardown).start()
    return _global


def global_sanitizer() -> PoolSanitizer | None:
    return _global if _global is not None and _global.active else None


def _forget_after_fork() -> None:
    # A forked child starts unobserved (the observation layer and its judges reset at fork): the parent's
    # sanitizer watches nothing here, and must not stop the child's install_from_env from installing one.
    global _global
    _global = None


os.register_at_fork(after_in_child=_forget_after_fork)
