"""Fixtures for engine authors: reused workers in three scopes, and engine sequences with fresh-pool checks."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from cudagraph_lifecycle.cycle import drop_held, dump_memory_snapshot, run_cycle
from cudagraph_lifecycle.errors import ConfigError

from .assertions import EngineCycleError, check_record
from .mpi import MPIRanks, RankError
from .worker import RemoteError, ReusedWorker, WorkerCrashed, WorkerTimeout

SCOPES = ("function", "module", "session")
PROPERTY = "cudagraph_cycles"


def _settings(config: pytest.Config) -> dict[str, Any]:
    from .plugin import SETTINGS_KEY

    return config.stash[SETTINGS_KEY]


def _new_worker(config: pytest.Config, name: str, sanitize: str | None = None) -> ReusedWorker:
    s = _settings(config)
    env = _worker_env(s, sanitize)  # the worker installs a sanitizer on its (one) backend at start
    return ReusedWorker(start_method=s["start_method"], timeout=s["timeout"] or None, name=name, env=env)


@pytest.fixture(autouse=True)
def _cudagraph_sanitize(request: pytest.FixtureRequest):
    """In ``cudagraph``-marked tests, watch this process's graph API; findings go to the report."""
    s = _settings(request.config)
    if s["sanitize"] == "off" or request.node.get_closest_marker("cudagraph") is None:
        yield
        return
    from cudagraph_lifecycle.cycle import process_backend
    from cudagraph_lifecycle.sanitizer import PoolSanitizer

    if s["effective_backend"] == "cuda":
        import torch

        if not torch.cuda.is_initialized():
            yield  # the test keeps CUDA out of this process (its GPU work runs in workers)
            return
    san = PoolSanitizer(process_backend(s["effective_backend"]), mode=s["sanitize"]).start()
    try:
        yield san
    finally:
        san.stop()
    found = san.findings()
    if found:
        request.node.user_properties.append(("cudagraph_findings", json.dumps([f.as_dict() for f in found])))
    if found and s["sanitize"] == "strict":
        pytest.fail("pool sanitizer findings:\n" + "\n".join(f"- {f.kind}: {f.message}" for f in found),
                    pytrace=False)


@pytest.fixture(scope="session")
def cudagraph_backend_name(pytestconfig: pytest.Config) -> str:
    """The backend name workers use (``auto``, ``cuda`` or ``sim``), from --cudagraph-backend."""
    return _settings(pytestconfig)["backend"]


@pytest.fixture
def cudagraph_worker(pytestconfig: pytest.Config):
    """A reused worker for one test: state persists across its calls, and it is gone after the test."""
    w = _new_worker(pytestconfig, "function")
    yield w
    w.close()


@pytest.fixture(scope="module")
def cudagraph_module_worker(pytestconfig: pytest.Config):
    """A reused worker shared by the tests of one module, like a module-scoped MPI pool."""
    w = _new_worker(pytestconfig, "module")
    yield w
    w.close()


@pytest.fixture(scope="session")
def cudagraph_session_worker(pytestconfig: pytest.Config):
    """A reused worker for the whole session (per xdist worker)."""
    w = _new_worker(pytestconfig, "session")
    yield w
    w.close()


def _worker_env(s: dict[str, Any], sanitize: str | None = None) -> dict[str, str]:
    if (sanitize or s["sanitize"]) == "off":
        return {}
    return {"CUDAGRAPH_SANITIZE": sanitize or s["sanitize"], "CUDAGRAPH_SANITIZE_BACKEND": s["backend"]}


def _mpi_ranks(config: pytest.Config, ranks: int | None = None) -> MPIRanks:
    s = _settings(config)
    if s["mpi_unavailable"]:
        pytest.skip(f"needs MPI: {s['mpi_unavailable']}")
    return MPIRanks(ranks or s["mpi_ranks"], timeout=s["timeout"] or None, env=_worker_env(s))


@pytest.fixture(scope="module")
def cudagraph_mpi_ranks(pytestconfig: pytest.Config):
    """Reused MPI ranks for one module (``--cudagraph-mpi-ranks``, default 2): ``ranks.call_all(fn, ...)``
    runs ``fn`` on every rank and returns ``[(rank, pid, value), ...]``. Skipped without MPI."""
    ranks = _mpi_ranks(pytestconfig)
    yield ranks
    ranks.close()


class EngineSequence:
    """``engine_sequence(factory, n)``: n engines one after another in ONE reused worker.

    Each engine is built by ``factory(backend)`` in the worker, captured, replayed against eager, released,
    and checked for a fresh pool; the records go to the terminal summary and the JSON report. A failed
    check, a crash or the allocator's assert raises :class:`EngineCycleError` naming the engine.
    """

    def __init__(self, request: pytest.FixtureRequest, default_n: int, worker: ReusedWorker | MPIRanks,
                 backend: str):
        self._request = request
        self._default_n = default_n
        self.worker = worker  # a ReusedWorker, or MPIRanks (every call runs on every rank)
        self.backend = backend
        self.records: list[dict] = []

    def _call(self, fn, *args) -> list[tuple[int | None, int | None, Any]]:
        if isinstance(self.worker, MPIRanks):
            return self.worker.call_all(fn, *args)
        return [(None, self.worker.pid, self.worker.call(fn, *args))]

    def _snapshot(self, error: Exception | None) -> None:
        """On CUDA, dump the worker's memory snapshot for PyTorch's memory visualizer; path in the report."""
        if isinstance(error, (WorkerCrashed, WorkerTimeout)) or (
                isinstance(error, RemoteError) and error.poisons_process):
            return  # that process is gone or unusable
        folder = _settings(self._request.config).get("report")
        folder = os.path.join(os.path.dirname(folder), "cudagraph-snapshots") if folder else tempfile.gettempdir()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", self._request.node.nodeid)[-120:]
        if isinstance(self.worker, MPIRanks):
            return  # one snapshot per rank would need a path per rank; the records name the rank instead
        try:
            path = self.worker.call(dump_memory_snapshot, os.path.join(folder, f"{name}.pickle"))
        except Exception:
            return
        if path:
            self._request.node.user_properties.append(("cudagraph_snapshot", path))

    def _publish(self) -> None:
        props = self._request.node.user_properties
        props[:] = [p for p in props if p[0] != PROPERTY]
        props.append((PROPERTY, json.dumps(self.records)))

    def __call__(
        self, factory: Callable[[Any], Any], n: int | None = None, *, check: bool = True, hold_output: bool = True,
        atol: float = 1e-4,
    ) -> list[dict]:
        n = self._default_n if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ConfigError(f"engine_sequence needs n >= 1 engines, got {n!r}")
        if not callable(factory):
            raise ConfigError(f"engine_sequence needs a factory callable(backend) -> engine, got {factory!r}")
        start = len(self.records)
        try:
            for i in range(start, start + n):
                try:
                    results = self._call(run_cycle, factory, self.backend, i, atol, hold_output)
                except (RemoteError, RankError, WorkerCrashed, WorkerTimeout) as e:
                    kind = type(e).__name__
                    first = str(e).strip().splitlines()[0] if str(e).strip() else kind
                    self.records.append({
                        "index": i, "pid": getattr(self.worker, "pid", None), "rank": None, "backend": self.backend,
                        "pool_ids": [], "fresh": False, "problems": [f"{kind}: {first}"],
                    })
                    self._snapshot(e)
                    self._publish()
                    raise EngineCycleError(f"engine {i} of the sequence failed in the reused worker: {e}") from None
                recs = []
                for rank, _pid, rec in results:
                    rec = rec.as_dict()
                    rec["rank"] = rank
                    recs.append(rec)
                self.records.extend(recs)
                self._publish()
                for rec in recs:
                    if check and not rec.get("fresh"):
                        self._snapshot(None)
                        check_record(rec)
            left = [v for _, _, v in self._call(drop_held, self.backend)]
            if check and any(left):
                raise EngineCycleError(f"the last engine's pools still hold {left} bytes once its output was dropped")
        finally:
            self._publish()
        return self.records[start:]


@pytest.fixture
def engine_sequence(request: pytest.FixtureRequest, pytestconfig: pytest.Config) -> EngineSequence:
    """Run engines in sequence in one reused worker; see :class:`EngineSequence`.

    ``@pytest.mark.cudagraph_engines(n, scope="function"|"module"|"session")`` sets the default engine count
    and which worker holds them (a module or session worker keeps state across tests).
    """
    marker = request.node.get_closest_marker("cudagraph_engines")
    n, scope, sanitize, ranks = 3, "function", None, None
    if marker is not None:
        if marker.args:
            n = marker.args[0]
        n = marker.kwargs.get("n", n)
        scope = marker.kwargs.get("scope", scope)
        sanitize = marker.kwargs.get("sanitize")
        ranks = marker.kwargs.get("ranks")
    s = _settings(pytestconfig)
    if s["worker"] == "mpi" or ranks is not None:
        if scope == "module" and ranks is None:
            holder = request.getfixturevalue("cudagraph_mpi_ranks")
        else:
            holder = _mpi_ranks(pytestconfig, ranks)
            request.addfinalizer(holder.close)
        return EngineSequence(request, n, holder, s["backend"])
    if sanitize not in (None, "off", "on", "strict"):
        raise ConfigError(f"cudagraph_engines(sanitize={sanitize!r}): choose off, on or strict")
    if sanitize is not None:
        if scope != "function":
            raise ConfigError("cudagraph_engines(sanitize=...) needs scope='function': shared workers keep theirs")
        worker = _new_worker(pytestconfig, "function", sanitize)
        request.addfinalizer(worker.close)
        return EngineSequence(request, n, worker, _settings(pytestconfig)["backend"])
    if scope not in SCOPES:
        raise ConfigError(f"cudagraph_engines(scope={scope!r}): choose one of {', '.join(SCOPES)}")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ConfigError(f"cudagraph_engines(n={n!r}): give a positive int number of engines")
    name = {"function": "cudagraph_worker", "module": "cudagraph_module_worker",
            "session": "cudagraph_session_worker"}[scope]
    worker = request.getfixturevalue(name)
    return EngineSequence(request, n, worker, _settings(pytestconfig)["backend"])
