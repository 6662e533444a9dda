"""One engine cycle in a reused process: build, capture, compare with eager, release, settle, judge; and
the end of a sequence. Pure library code: the pytest plugin runs it inside its reused workers.

The engine protocol is in ``engine.py``, the verdicts in ``record.py``, the steps in ``steps.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .. import observe
from ..backends import Backend, get_backend
from ..errors import ConfigError
from ..ledger import ledger, raised_site
from ..record import FAILING, STRICT_FAILING, VERDICTS, CycleRecord, Problem, ends_process
from ..sanitizer.findings import PREVENTED_KINDS, collect
from ..sanitizer.pins import graph_holder
from ..sizes import size_text
from .caller import OUTPUT_MODES, caller_copy, caller_of
from .engine import PROTOCOL, Engine, check_pool_ids
from .held import check_held, final_held
from .steps import (
    budget,
    build,
    capture,
    caught_stale,
    exercise,
    failed,
    failed_capture,
    judge,
    refused_on_default_stream,
    settle,
)

_observing = False


def _observe_for_life() -> None:
    """Engine verdicts read the ledger: hold the observation layer for the rest of the process."""
    global _observing
    if not _observing:
        observe.acquire()
        _observing = True


def _forget_observing() -> None:
    global _observing
    _observing = False


os.register_at_fork(after_in_child=_forget_observing)


def _judge_held(be: Backend, caller: Any, label: str, done: list) -> None:
    previous = check_held(be, caller, set(ledger.pools_of_scope(be.world, label)))
    if previous is not None:
        done.append(previous)


def stream_workspace_hint(be: Backend) -> str:
    """Why an engine's growth may be a library workspace: each stream it makes gets one of its own."""
    size = be.workspace_bytes(0)
    if not be.has_library_workspaces or not size:
        return ""
    return (f"; an engine that makes its own stream leaves cuBLAS's workspace for that stream ({size_text(size)} on "
            "this device, measured) until torch's pool of streams comes round to it again: make one stream for "
            "every engine, or call torch._C._cuda_clearCublasWorkspaces() after release once no graph is alive")


def ends_here(rec: CycleRecord) -> bool:
    return ends_process(rec.poisoned, rec.verdict)


def _last_records(be: Backend, caller: Any, rec: CycleRecord, done: list, since: int) -> list[dict[str, Any]]:
    """This cycle ends its process (``ends_here``): the worker goes before the caller drops the previous
    engine's output, so that engine's ``held`` is made final now from what this cycle saw (``final_held``)."""
    previous = final_held(be, caller, rec, since)
    return [r.as_dict() for r in done + ([previous] if previous is not None else [])] + [rec.as_dict()]


def _located(e: ConfigError, step: str, label: str) -> ConfigError:
    """``e`` with the line of the engine's code that raised it, where that is the engine's (a call into the
    backend with a bad argument); the engine's own shape is checked in our code, which has no such line."""
    site = raised_site(e)
    if not site:
        return e
    located = ConfigError(f"{e} (raised at {site}, {step} {label})")
    located.__traceback__ = e.__traceback__
    return located


def run_cycle(
    factory: Callable[[Backend], Any],
    backend: str | Backend = "auto",
    index: int = 0,
    atol: float = 1e-4,
    output: str = "hold",
    test: str | None = None,
    strict: bool = False,
    max_growth: int | None = None,
    reload: Callable[[Any], Any] | None = None,
    max_pool_bytes: int | None = None,
    max_captures: int | None = None,
    require_replay: bool = False,
    max_growth_set_by: str = "max_growth",
) -> list[dict[str, Any]]:
    """Build one engine with ``factory(backend)``, exercise it, release it, and judge its graph pools.

    ``output="hold"`` plays a caller that keeps the engine's last output (a view into its pool) until the
    next engine has captured (after its ``capture()``, or after its runs where it captures lazily, at its first
    run): the hazard that turns a kept pool id into the allocator's assert. ``"drop"``
    plays a caller that copies the output out and drops the view. Returns the records this call completed,
    as dicts: the previous engine's (hold: judged now that its output was dropped) and this one's.

    ``reload(engine)`` runs between two runs of the example input (a weight sync, a LoRA swap): graphs that
    still read the old tensors fail as ``captured_address``. ``max_pool_bytes``, ``max_captures`` and
    ``require_replay`` are the engine's budgets (over budget, too many captures, graphs never replayed).
    ``max_growth_set_by`` names where ``max_growth`` was set, for the message (the plugin passes its option).
    """
    if output not in OUTPUT_MODES:
        raise ConfigError(f"output={output!r}: choose one of {', '.join(OUTPUT_MODES)}")
    be = get_backend(backend)
    _observe_for_life()
    caller = caller_of(be)
    be.prewarm(0)  # library workspaces are per stream and process: create them before the baseline
    label = f"{test or 'engine sequence'} [engine {index}]"
    rec = CycleRecord(index=index, pid=os.getpid(), backend=be.name, engine=label, strict=strict)
    done: list[CycleRecord] = []
    settle(be)
    default_before, kept_before = be.default_pool_reserved(0), be.default_pool_allocated(0)
    since = ledger.seq
    engine = y = declared = None
    released_left: list = []  # graphs of this engine still captured right after its release()
    released_holder = None  # who held them then
    with ledger.engine_scope(label):
        try:
            engine = build(factory, be)
            capture(engine, rec)
        except ConfigError as e:
            raise _located(e, "capturing" if engine is not None else "building", label) from None
        except Exception as e:
            failed(e, rec, be, since, "capture" if engine is not None else "build")
        refused_on_default_stream(rec, be, since)
        caught_stale(rec, be, since)
        failed_capture(rec, be, since)
        if ends_here(rec):
            return _last_records(be, caller, rec, done, since)
        # The caller holds the previous output until this engine has captured: after capture(), or for an
        # engine that captures at its first run (lazily, per batch size), after its runs.
        lazy = engine is not None and not rec.failed and not ledger.captures_in(label)
        if not lazy:
            _judge_held(be, caller, label, done)
        if engine is not None and not rec.failed:
            try:
                y = exercise(engine, rec, atol, reload)
                declared = engine.declared_pools()
            except ConfigError as e:
                raise _located(e, "running", label) from None
            except Exception as e:
                failed(e, rec, be, since, "run")
            refused_on_default_stream(rec, be, since)
            caught_stale(rec, be, since)
            failed_capture(rec, be, since)
            if lazy and not ends_here(rec):
                _judge_held(be, caller, label, done)
            rec.pool_bytes = sum(be.pool_state(k[2], k[1]).reserved_bytes
                                 for k in ledger.pools_of_scope(be.world, label))
        if engine is not None and not ends_here(rec):
            try:
                engine.release()
            except Exception as e:
                failed(e, rec, be, since, "release")
            released_left = [g for g in ledger.live_graphs(be.world) if g.scope == label]
            if released_left:  # who holds them now, before the engine goes (then nobody can tell)
                released_holder = graph_holder(released_left)
    if ends_here(rec):
        return _last_records(be, caller, rec, done, since)
    kept = y if output == "hold" else (None if y is None else caller_copy(y))
    runner = getattr(getattr(engine, "obj", None), "runner", None)
    graph_bytes = dict(runner.stats.graph_bytes) if hasattr(runner, "stats") else None
    del engine, y, runner
    settle(be)
    pools = judge(be, rec, kept, output == "hold", declared, released_left, released_holder)
    budget(rec, graph_bytes, max_pool_bytes, max_captures, require_replay)
    delta = be.default_pool_reserved(0) - default_before
    # growth is what the engine left behind; the default pool can also shrink over an engine, when memory held
    # from before it goes (library workspaces that torch._dynamo.reset() drops, an earlier engine's caches)
    rec.growth_bytes, rec.freed_earlier_bytes = max(0, delta), max(0, -delta)
    # what it kept in live blocks: a steady leak into segments that have room shows here, not in reserved bytes
    rec.kept_bytes = max(0, be.default_pool_allocated(0) - kept_before)
    if max_growth is not None and max(rec.growth_bytes, rec.kept_bytes) > max_growth:
        rec.add("growth_over_budget", f"the default pool grew by {size_text(rec.growth_bytes)} of segments and "
                                      f"{size_text(rec.kept_bytes)} of live blocks over this engine, above the "
                                      f"budget of {size_text(max_growth)} set by {max_growth_set_by}"
                                      + stream_workspace_hint(be),
                max(rec.growth_bytes, rec.kept_bytes))
    # what the observation saw beyond the verdict, read from the ledger in every sanitizer mode alike (a capture
    # refused on the default stream whose error the engine caught, so it ran eagerly; a teardown under
    # expandable segments only reported; a pool a reference keeps after its graphs went)
    raised = any(p.message.startswith("DefaultStreamCaptureError") for p in rec.problems)  # (in it already)
    refused = any(p.kind == "expandable_teardown" for p in rec.problems)
    found = collect(be, since, label, ("pool_never_retired",) + (() if raised else ("default_stream_capture",))
                    + (() if refused else ("expandable_teardown",)))
    rec.sanitizer = [f.as_dict() for f in found]
    for f in found:
        if f.kind in PREVENTED_KINDS:  # the engine never captured, and without the sanitizer it poisons
            rec.add("error", f"{f.kind}, whose error the engine caught (it ran without that graph): "
                             f"{f.message}", f.bytes)
        else:
            rec.add("sanitizer", f"{f.kind}: {f.message}", f.bytes)
    if output == "hold":
        caller.held, caller.held_pools, caller.held_record = kept, pools, rec
    else:
        caller.kept = kept
    done.append(rec)
    return [r.as_dict() for r in done]


def finish_sequence(backend: str | Backend = "auto") -> list[dict[str, Any]]:
    """End of a sequence: drop what the caller held or kept, and judge the last held engine's pools."""
    be = get_backend(backend)
    caller = caller_of(be)
    caller.kept = None
    rec = check_held(be, caller, set())
    return [] if rec is None else [rec.as_dict()]


__all__ = [
    "FAILING",
    "OUTPUT_MODES",
    "PROTOCOL",
    "STRICT_FAILING",
    "VERDICTS",
    "CycleRecord",
    "Engine",
    "Problem",
    "check_pool_ids",
    "finish_sequence",
    "run_cycle",
    "settle",
]
