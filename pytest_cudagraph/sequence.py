"""``engine_sequence``: engines built one after another in ONE reused worker (or on every rank of reused
MPI ranks), each judged after its release from what the process observed its graphs capture into."""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from cudagraph_lifecycle.record import ends_process
from cudagraph_lifecycle.sizes import size_text

from .assertions import EngineCycleError, check_record
from .mpi import MPIRanks, RankError
from .records import EngineRecord
from .report import CYCLES, SNAPSHOT
from .settings import describe_source
from .worker import RemoteError, ReusedWorker, WorkerCrashed, WorkerTimeout

OUTPUTS = ("hold", "drop")


def _dump_snapshot(backend: str, path: str) -> str | None:
    """Runs in the worker: the allocator's memory snapshot (PyTorch's memory visualizer opens it)."""
    from cudagraph_lifecycle.backends import get_backend

    return get_backend(backend).dump_snapshot(path)


def _run_cycle(*args: Any, **kwargs: Any) -> list[dict]:
    from cudagraph_lifecycle.cycle import run_cycle

    return run_cycle(*args, **kwargs)


def _check_all(records: list[dict]) -> None:
    """Raise for the first failed record, naming the others that failed by then."""
    __tracebackhide__ = operator.methodcaller("errisinstance", EngineCycleError)
    failed = [r for r in records if r.get("failed")]
    if failed:
        check_record(failed[0], also=failed[1:])


def _finish(backend: str) -> list[dict]:
    from cudagraph_lifecycle.cycle import finish_sequence

    return finish_sequence(backend)


def _user_sites(frames: list[str]) -> list[str]:
    """The innermost frame of the user's code among ``file:line in function`` frames (innermost first): the
    line a gate points at; the innermost frame where none is the user's."""
    from cudagraph_lifecycle.ledger import is_user_file

    user = [f for f in frames if is_user_file(f.rpartition(" in ")[0].rpartition(":")[0] or f)]
    return (user or frames)[:1]


class EngineSequence:
    """``engine_sequence(factory, n, output="hold")``: n engines one after another in one reused worker.

    Each engine is built by ``factory(backend)`` in the worker, captured, run and compared with eager,
    released, and judged (``fresh``, ``held``, ``leaked``, ``stale``, ``reused``; see docs/verdicts.md). The
    caller holds each engine's output (``output="hold"``) until the next engine has captured, or copies it out
    (``"drop"``). The records go to the terminal summary, the JSON report and the JUnit properties; a failed
    cycle, a crash or the allocator's assert raises :class:`EngineCycleError` naming the engine (unless
    ``check=False``). ``reload(engine)`` runs in the worker between two runs of each engine (a weight sync, a
    LoRA swap): graphs that still read the tensors from before it fail as ``captured_address``. The budgets
    of ``@pytest.mark.cudagraph(max_pool_bytes=..., max_captures=..., require_replay=True)`` apply per engine.
    """

    def __init__(self, request: pytest.FixtureRequest, default_n: int, worker: ReusedWorker | MPIRanks,
                 settings: dict[str, Any]):
        self._request = request
        self._default_n = default_n
        self.worker = worker  # a ReusedWorker, or MPIRanks (every call runs on every rank)
        self.backend = settings["backend"]
        self._settings = settings
        self.records: list[dict] = []

    def _call(self, fn, *args, **kwargs) -> list[tuple[int | None, int | None, Any]]:
        if isinstance(self.worker, MPIRanks):
            return self.worker.call_all(fn, *args, **kwargs)
        return [(None, self.worker.pid, self.worker.call(fn, *args, **kwargs))]

    def _snapshot(self) -> None:
        """On CUDA, dump the worker's memory snapshot; its path goes into the report."""
        if isinstance(self.worker, MPIRanks):
            return  # one snapshot per rank would need a path per rank; the records name the rank instead
        folder = self._settings.get("report")
        folder = os.path.join(os.path.dirname(folder), "cudagraph-snapshots") if folder else tempfile.gettempdir()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", self._request.node.nodeid)[-120:]
        try:
            path = self.worker.call(_dump_snapshot, self.backend, os.path.join(folder, f"{name}.pickle"))
        except Exception:
            return
        if path:
            self._request.node.user_properties.append((SNAPSHOT, path))

    def _publish(self) -> None:
        props = self._request.node.user_properties
        props[:] = [p for p in props if p[0] != CYCLES]
        props.append((CYCLES, json.dumps(self.records)))

    def _merge(self, rank: int | None, recs: list[dict]) -> list[dict]:
        """Add or replace records (a later call may complete an earlier engine's verdict)."""
        out = []
        for rec in recs:
            rec = EngineRecord(rec, rank=rank)
            for i, old in enumerate(self.records):
                if old["index"] == rec["index"] and old.get("rank") == rank:
                    self.records[i] = rec
                    break
            else:
                self.records.append(rec)
            out.append(rec)
        return out

    def _crash_record(self, i: int, e: Exception) -> dict:
        kind = type(e).__name__
        first = str(e).strip().splitlines()[0] if str(e).strip() else kind
        stale = "use_count > 0" in str(e) or "StalePoolError" in str(e)
        # the same fields as a cycle's problems (a gate reads them alike)
        frames = list(getattr(e, "frames", None) or [])  # where a crashed or hung worker was, innermost first
        problems = [{"kind": "stale" if stale else "error", "message": f"{kind}: {first}", "bytes": 0,
                     "stacks": ["\n".join(frames)] if frames else [], "pins": [], "sites": _user_sites(frames)}]
        for h in getattr(e, "hazards", []):  # what the sanitizer saw coming, written before the crash
            problems.append({"kind": "expandable_teardown", "bytes": h["live_bytes"], "stacks": [], "pins": [],
                             "sites": [h["reset_site"]] if h.get("reset_site") else [],
                             "message": f"before the crash, the last graph of pool {tuple(h['pool_id'])} was reset "
                                        f"at {h.get('reset_site') or '(unknown)'} while {size_text(h['live_bytes'])} of it "
                                        "were alive, under expandable_segments:True"})
        pid = getattr(e, "pid", None) or getattr(self.worker, "pid", None)  # a crashed child's, or the live one's
        return EngineRecord({"index": i, "pid": pid, "rank": None, "backend": self.backend,
                "engine": f"{self._request.node.nodeid} [engine {i}]", "verdict": "stale" if stale else "error",
                "failed": True, "pool_ids": [], "problems": problems})

    def __call__(self, factory: Callable[[Any], Any], n: int | None = None, *, check: bool = True,
                 output: str = "hold", atol: float = 1e-4, reload: Callable[[Any], Any] | None = None) -> list[dict]:
        from cudagraph_lifecycle.errors import ConfigError

        # an engine's failure or a bad argument points at the test's call; a bug of ours keeps its frames
        __tracebackhide__ = operator.methodcaller("errisinstance", (EngineCycleError, ConfigError))

        n = self._default_n if n is None else n
        try:
            count = operator.index(n) if not isinstance(n, bool) else None  # an int, numpy's included
        except TypeError:
            count = None
        if count is None or count <= 0:
            raise ConfigError(f"engine_sequence(n={n!r}): give n >= 1 engines, an int")
        n = count
        if not callable(factory):
            raise ConfigError(f"engine_sequence needs a factory callable(backend) -> engine, got {factory!r}")
        output = output.strip().lower() if isinstance(output, str) else output
        if not isinstance(check, bool):
            raise ConfigError(f"engine_sequence(check={check!r}): give True (raise on a failed cycle, the default) "
                              "or False (return the records)")
        if output not in OUTPUTS:
            raise ConfigError(f"engine_sequence(output={output!r}): choose 'hold' (the caller keeps the last "
                              "output, a view into the pool) or 'drop' (the caller copies it out)")
        if isinstance(atol, bool) or not isinstance(atol, numbers.Real) or not 0 <= atol < math.inf:
            raise ConfigError(f"engine_sequence(atol={atol!r}): give the largest absolute difference allowed "
                              "between replay and eager, a finite number >= 0 (default 1e-4)")
        if reload is not None and not callable(reload):
            raise ConfigError(f"engine_sequence(reload={reload!r}): give a callable(engine) that loads new weights "
                              "into the engine between replays, or leave it out")
        s = self._settings
        growth_set_by = describe_source(s, "max_growth")  # the budget's message names what the user set
        start = len(self.records)
        first = max((r["index"] for r in self.records), default=-1) + 1
        mine: list[dict] = []
        try:
            for i in range(first, first + n):
                try:
                    results = self._call(_run_cycle, factory, self.backend, i, atol, output,
                                         self._request.node.nodeid, s["sanitize"] == "strict", s["max_growth"],
                                         reload, max_growth_set_by=growth_set_by, **s.get("budgets", {}))
                except RemoteError as e:
                    if e.type_name == "ConfigError":  # the engine or its factory is the wrong shape
                        raise ConfigError(e.remote_message) from None
                    raise self._fail(i, e) from None
                except (RankError, WorkerCrashed, WorkerTimeout) as e:
                    raise self._fail(i, e) from None
                for rank, _pid, recs in results:
                    mine += self._merge(rank, recs)
                self._publish()
                for rec in [r for r in self.records[start:] if r["index"] == i]:
                    if ends_process(rec.get("poisoned"), rec.get("verdict")):  # the next engine: a fresh one
                        self.worker.restart_before_next_call()
                if check and any(r.get("failed") for r in self.records[start:] if r["index"] == i):
                    self._snapshot()
                    self._finish()
                    # (the previous engine's late verdict may have come with this one: every failure so far)
                    _check_all(self.records[start:])
            self._finish()
            if check:  # (held outputs are judged a cycle late: several may have failed by now)
                _check_all(self.records[start:])
            self._warn_if_nothing_captured(factory, self.records[start:])
        finally:
            self._publish()
        return self.records[start:]

    def _warn_if_nothing_captured(self, factory: Any, records: list[dict]) -> None:
        """A cycle that captured no graph is fresh by default: its verdict then says nothing about graph pools,
        and a test meant to check an engine's graphs passes having checked none."""
        empty = sorted({r["index"] for r in records if r.get("verdict") == "fresh" and not r.get("graphs")})
        if empty:
            name = getattr(factory, "__qualname__", type(factory).__qualname__)
            self._request.node.warn(pytest.PytestWarning(
                f"engine_sequence({name}): engine{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} captured "
                "no CUDA graph, so its fresh verdict says nothing about graph pools: check that capture() or "
                "run(x) captures (the marker cudagraph(require_replay=True) fails such a cycle)"))

    def _finish(self) -> None:
        try:
            for rank, _pid, recs in self._call(_finish, self.backend):
                self._merge(rank, recs)
        except (RemoteError, RankError, WorkerCrashed, WorkerTimeout):
            pass  # the engine's own failure is what the test reports

    def _fail(self, i: int, e: Exception) -> EngineCycleError:
        if isinstance(e, (WorkerCrashed, WorkerTimeout)):  # the worker went before the previous output was dropped
            for rec in self.records:
                if rec["index"] == i - 1 and rec.get("verdict") == "held":
                    rec["problems"].append({
                        "kind": "held_unconfirmed", "bytes": 0, "stacks": [], "pins": [], "sites": [],
                        "message": f"engine {i}'s worker {'crashed' if isinstance(e, WorkerCrashed) else 'timed out'} "
                                   "before the caller dropped this engine's output, so whether its pools empty "
                                   "once the output goes was never checked: the verdict rests on what pinned "
                                   "them at its release"})
        self.records.append(self._crash_record(i, e))
        if not isinstance(e, (WorkerCrashed, WorkerTimeout)):
            self._snapshot()
        self._publish()
        return EngineCycleError(f"engine {i} of the sequence failed in the reused worker: {e}")
