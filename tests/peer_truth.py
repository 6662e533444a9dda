"""Ground truth for the peer engines: what plain PyTorch (or the bare backend) does, with nothing of ours
observing. A sequence of engines of one style runs in this process, one after another, and each engine's
outcome is recorded: "ok", "assert" (the allocator's dead-pool assert) or "error:<TypeName>".

On ``cuda`` an assert poisons the process: run each sequence in a fresh process. On ``sim`` pass a fresh
``SimBackend()`` per call: each is its own allocator world.
"""

from __future__ import annotations

import gc

from peer_engines import STYLES, reset_module_state

from cudagraph_lifecycle.backends.base import Backend

MODES = ("hold", "drop")


def classify(exc: BaseException) -> str:
    msg = str(exc)
    if "use_count > 0" in msg or "INTERNAL ASSERT" in msg:
        return "assert"
    return f"error:{type(exc).__name__}"


def plain_sequence(style: str, mode: str, backend: Backend, n: int = 3) -> list[str]:
    """Run ``n`` engines of ``style`` one after another; return one outcome per engine, stopping at the first
    failure. ``mode`` "hold": the caller keeps the previous engine's output (a view into its graph's pool)
    until the next engine has captured; "drop": the caller copies each output out and lets the view go."""
    return plain_sequence_bytes(style, mode, backend, n)[0]


def plain_sequence_bytes(style: str, mode: str, backend: Backend, n: int = 3, styles: dict | None = None,
                         reset=reset_module_state) -> tuple[list[str], int]:
    """As :func:`plain_sequence`, and the bytes the graph pools still hold at the end, once the caller let go
    of the output it held (the copies it kept, ``drop``, stay: a copy's autograd history is the caller's):
    what the process lost to these engines, read from the allocator alone. ``styles`` and ``reset``: another
    family of engines (``hf_engines``) and how to forget its process-wide handles."""
    styles = STYLES if styles is None else styles
    if style not in styles:
        raise ValueError(f"unknown style {style!r}: choose one of {', '.join(styles)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    reset()
    outcomes: list[str] = []
    held = None
    kept = []  # the caller's copies ("drop"): a copy of an output with autograd history keeps that history
    for _ in range(n):
        try:
            eng = styles[style](backend)
            if hasattr(eng, "capture"):  # (o) captures as it is built
                eng.capture()
            if held is not None:
                held = None
                gc.collect()
            x = eng.example_input()
            y = eng.run(x)
            if mode == "hold":
                held = y
            else:
                kept.append(y.to("cpu") if y.is_cuda else y.clone())
            del y  # only ``held`` may keep the output
            eng.release()
            del eng
            gc.collect()
        except Exception as exc:  # the sequence ends at the first failure
            outcomes.append(classify(exc))
            break
        backend.synchronize()
        backend.empty_cache()
        backend.host_empty_cache()
        outcomes.append("ok")
    held = None
    gc.collect()
    backend.synchronize()
    backend.empty_cache()
    return outcomes, sum(n for d in range(backend.device_count()) for pool, n in backend.pool_bytes(d).items()
                         if pool != (0, 0))  # (0, 0): the default pool
