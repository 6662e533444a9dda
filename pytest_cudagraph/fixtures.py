"""Fixtures for engine authors: reused workers in three scopes, MPI ranks, engine sequences, and the
sanitizer that watches ``cudagraph``-marked tests in this process."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from .mpi import MPIRanks
from .report import FINDINGS, SHOWN_FINDINGS, STRICT_FAILURE, shown_key
from .sequence import EngineSequence
from .settings import CALL_FAILED, SETTINGS_KEY, STATE_KEY, describe_source, effective_backend
from .terminal import finding_lines
from .worker import ReusedWorker

SCOPES = ("function", "module", "session")
MARKER_KWARGS = ("n", "scope", "sanitize", "ranks")
BUDGET_KWARGS = ("max_pool_bytes", "max_captures", "require_replay")


def _as_written(marker: pytest.Mark) -> str:
    """A marker as the user wrote it: ``cudagraph_engines(3, sanitise='strict')``."""
    args = [repr(a) for a in marker.args] + [f"{k}={v!r}" for k, v in marker.kwargs.items()]
    return f"{marker.name}({', '.join(args)})"


def _marker_checked(check, node: pytest.Item, name: str):
    """A marker's arguments, checked: a wrong one fails the test with its message alone (no plugin source),
    and where the marker is written (the test, its class, or its module's ``pytestmark``)."""
    from cudagraph_lifecycle.errors import ConfigError

    try:
        return check(node)
    except ConfigError as e:
        message = str(e)
    where = marker_site(node, name)
    pytest.fail(f"ConfigError: {message}" + (f" ({where})" if where else ""), pytrace=False)


def marker_site(node: pytest.Item, name: str) -> str | None:
    """Where the marker ``name`` that ``node`` reads comes from, in words: written on the test function or a
    class (file:line), in a module's ``pytestmark``, or added by code (a hook, ``pytest.param``)."""
    import inspect

    found = next(node.iter_markers_with_node(name), None)
    if found is None:
        return None
    owner, mark = found
    if isinstance(owner, pytest.Module):
        return f"written in the pytestmark of {node.location[0]}"
    obj = getattr(owner, "obj", None)
    kind = "class" if isinstance(owner, pytest.Class) else "test"
    written = getattr(obj, "pytestmark", [])
    if not any(m.name == mark.name and m.args == mark.args and m.kwargs == mark.kwargs
               for m in (written if isinstance(written, list) else [written])):
        return f"added to {kind} {owner.name} (not by a decorator: a hook, pytest.param(marks=...) or a fixture)"
    try:
        path = inspect.getsourcefile(obj) or node.location[0]
        line = inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return None
    try:
        path = os.path.relpath(path, node.config.rootpath)
    except ValueError:  # another drive
        pass
    return f"written on {kind} {owner.name} at {path}:{line}"


def budgets(node: pytest.Item) -> dict[str, Any]:
    """``@pytest.mark.cudagraph(max_pool_bytes=..., max_captures=..., require_replay=True)``, checked."""
    from cudagraph_lifecycle.errors import ConfigError

    marker = node.get_closest_marker("cudagraph")
    if marker is None:
        return {}
    unknown = sorted(set(marker.kwargs) - set(BUDGET_KWARGS))
    if unknown or marker.args:
        raise ConfigError(f"{_as_written(marker)}: takes only {', '.join(BUDGET_KWARGS)} "
                          f"as keywords; unknown: {', '.join(unknown) or 'positional arguments'}")
    out = dict(marker.kwargs)
    if isinstance(out.get("max_pool_bytes"), str):  # a size, as --cudagraph-max-growth takes it: "64MiB"
        from cudagraph_lifecycle.sizes import SIZE_HELP, NegativeSizeError, parse_size

        try:
            out["max_pool_bytes"] = parse_size(out["max_pool_bytes"])
        except NegativeSizeError:
            raise ConfigError(f"cudagraph(max_pool_bytes={out['max_pool_bytes']!r}): negative; give a size "
                              ">= 0, e.g. '64MiB'") from None
        except ValueError:
            raise ConfigError(f"cudagraph(max_pool_bytes={out['max_pool_bytes']!r}): give a size in bytes, "
                              f"{SIZE_HELP}, e.g. '64MiB'") from None
    for key in ("max_pool_bytes", "max_captures"):
        v = out.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"cudagraph({key}={v!r}): give an int >= 0"
                              + (" or a size such as '64MiB'" if key == "max_pool_bytes" else ""))
    if not isinstance(out.get("require_replay", False), bool):
        raise ConfigError(f"cudagraph(require_replay={out['require_replay']!r}): give True or False")
    return out


def _check_budgets(nodeid: str, world: Any, backend: Any, limits: dict[str, Any]) -> list[str]:
    """The budgets of a cudagraph-marked test's own captures, read when its body returns."""
    from cudagraph_lifecycle.ledger import ledger
    from cudagraph_lifecycle.sizes import size_text

    out = []
    captures = ledger.captures_in(nodeid)
    if not captures:
        return out  # its graphs live in workers (engine_sequence judges those per engine)
    pool_bytes = ledger.peak_pool_bytes(world, nodeid, backend.pool_bytes_reader())
    replays, _ = ledger.replays_in(nodeid)
    if limits.get("max_pool_bytes") is not None and pool_bytes > limits["max_pool_bytes"]:
        out.append(f"pool_over_budget: its graph pools held {size_text(pool_bytes)} at their peak, over the "
                   f"max_pool_bytes budget of {size_text(limits['max_pool_bytes'])}")
    if limits.get("max_captures") is not None and captures > limits["max_captures"]:
        out.append(f"too_many_captures: {captures} captures, over max_captures={limits['max_captures']}")
    if limits.get("require_replay") and not replays:
        out.append(f"never_replayed: {captures} graph(s) captured, none replayed (require_replay=True)")
    return out


def _settings(config: pytest.Config) -> dict[str, Any]:
    return config.stash[SETTINGS_KEY]


def _worker_env(s: dict[str, Any], sanitize: str | None = None) -> dict[str, str]:
    mode = sanitize or s["sanitize"]
    if mode == "off":
        return {}
    return {"CUDAGRAPH_SANITIZE": mode, "CUDAGRAPH_SANITIZE_BACKEND": s["backend"],
            "CUDAGRAPH_EXPANDABLE_TEARDOWN": s["expandable_teardown"]}


def _new_worker(config: pytest.Config, name: str, sanitize: str | None = None) -> ReusedWorker:
    s = _settings(config)
    # the worker installs a sanitizer on its process's backend at start
    w = ReusedWorker(start_method=s["start_method"], timeout=s["timeout"] or None, name=name,
                     env=_worker_env(s, sanitize))
    w.timeout_from = describe_source(s, "timeout")
    return w


@pytest.fixture(autouse=True)
def _cudagraph_sanitize(request: pytest.FixtureRequest):
    """In ``cudagraph``-marked tests, watch this process's graph API from the test's first line (before it
    touches CUDA: installing the watch initializes nothing); findings go to the report."""
    s = _settings(request.config)
    if s["sanitize"] == "off" or request.node.get_closest_marker("cudagraph") is None:
        yield
        return
    from cudagraph_lifecycle.backends import get_backend
    from cudagraph_lifecycle.ledger import ledger
    from cudagraph_lifecycle.sanitizer import PoolSanitizer

    nodeid = request.node.nodeid
    limits = _marker_checked(budgets, request.node, "cudagraph")
    backend = get_backend(effective_backend(request.config))
    san = PoolSanitizer(backend, mode=s["sanitize"], scope=nodeid,
                        expandable_teardown=s["expandable_teardown"]).start()
    if limits.get("max_pool_bytes") is not None:
        ledger.watch_pool_bytes(nodeid)  # pools released and flushed during the test count at their peak
    try:
        with ledger.engine_scope(nodeid):
            yield san
        over = _check_budgets(nodeid, backend.world, backend, limits) if limits else []
    finally:
        ledger.unwatch_pool_bytes(nodeid)
        san.stop()
    if over:
        request.node.user_properties.append((STRICT_FAILURE, "1"))
        pytest.fail("cudagraph budget:\n" + "\n".join(f"- {o}" for o in over), pytrace=False)
    # (a program-wide sanitizer in this process may report the same pools: report.py)
    found = [{**f.as_dict(), "pid": os.getpid()} for f in san.findings()]
    if found:
        request.node.user_properties.append((FINDINGS, json.dumps(found)))
    if found and s["sanitize"] == "strict" and not request.node.stash.get(CALL_FAILED, False):
        # (a test that failed already, e.g. on the refusal these findings record, is not failed again; a
        # refusal the test caught may be what it asserts, `pytest.raises(StalePoolError)`: failed under strict)
        _fail_strict(request.node, "pool sanitizer findings", found)


@pytest.fixture(scope="session")
def cudagraph_backend_name(pytestconfig: pytest.Config) -> str:
    """The backend name workers use (``auto``, ``cuda`` or ``sim``), from --cudagraph-backend."""
    return _settings(pytestconfig)["backend"]


def _fail_strict(node: pytest.Item, title: str, found: list[dict]) -> None:
    """Fail the test on its findings (``strict``), each shown whole; the session's section then names them
    in one line each."""
    node.user_properties += [(STRICT_FAILURE, "1"), (SHOWN_FINDINGS, json.dumps([shown_key(f) for f in found]))]
    pytest.fail(f"{title}:\n" + "\n".join("- " + "\n  ".join(finding_lines(f, node.nodeid, named=False)) for f in found), pytrace=False)


def _close_reporting(w: ReusedWorker | MPIRanks, config: pytest.Config, node: pytest.Item | None = None,
                     mode: str | None = None) -> None:
    """Close a worker (or MPI ranks) after reading what its sanitizer found in the calls made to it: a test's
    own worker's findings are the test's (under strict they fail it); a shared one's go to the session's, each
    under the test that captured into its pool."""
    try:
        found = w.findings()
    finally:
        w.close()
    if not found:
        return
    if node is None:
        config.stash[STATE_KEY].setdefault("worker_findings", []).extend(found)
        return
    node.user_properties.append((FINDINGS, json.dumps(found)))
    if (mode or _settings(config)["sanitize"]) == "strict":
        _fail_strict(node, "pool sanitizer findings in the test's worker", found)


@pytest.fixture
def cudagraph_worker(request: pytest.FixtureRequest, pytestconfig: pytest.Config):
    """A reused worker for one test: state persists across its calls, and it is gone after the test."""
    w = _new_worker(pytestconfig, "function")
    yield w
    _close_reporting(w, pytestconfig, request.node)


@pytest.fixture(scope="module")
def cudagraph_module_worker(pytestconfig: pytest.Config):
    """A reused worker shared by the tests of one module, like a module-scoped MPI pool."""
    w = _new_worker(pytestconfig, "module")
    yield w
    _close_reporting(w, pytestconfig)


@pytest.fixture(scope="session")
def cudagraph_session_worker(pytestconfig: pytest.Config):
    """A reused worker for the whole session (per xdist worker)."""
    w = _new_worker(pytestconfig, "session")
    yield w
    _close_reporting(w, pytestconfig)


def _mpi_ranks(config: pytest.Config, ranks: int | None = None, sanitize: str | None = None) -> MPIRanks:
    s = _settings(config)
    if s["mpi_unavailable"]:
        pytest.skip(f"needs MPI: {s['mpi_unavailable']}")
    ranks = MPIRanks(ranks or s["mpi_ranks"], timeout=s["timeout"] or None, env=_worker_env(s, sanitize))
    ranks.controller.timeout_from = describe_source(s, "timeout")
    return ranks


@pytest.fixture(scope="module")
def cudagraph_mpi_ranks(pytestconfig: pytest.Config):
    """Reused MPI ranks for one module (``--cudagraph-mpi-ranks``, default 2): ``ranks.call_all(fn, ...)``
    runs ``fn`` on every rank and returns ``[(rank, pid, value), ...]``. Skipped without MPI."""
    ranks = _mpi_ranks(pytestconfig)
    yield ranks
    _close_reporting(ranks, pytestconfig)


def engines_marker(node: pytest.Item) -> tuple[int, str, str | None, int | None]:
    """``@pytest.mark.cudagraph_engines(n=3, scope="function", sanitize=None, ranks=None)``, checked: an
    unknown keyword or a bad value is an error naming it."""
    from cudagraph_lifecycle.errors import ConfigError

    marker = node.get_closest_marker("cudagraph_engines")
    if marker is None:
        return 3, "function", None, None
    unknown = sorted(set(marker.kwargs) - set(MARKER_KWARGS))
    if unknown or len(marker.args) > 1:
        raise ConfigError(f"{_as_written(marker)}: takes n (positional or keyword) "
                          f"and {', '.join(MARKER_KWARGS[1:])}; unknown: {', '.join(unknown) or 'extra positional'}")
    n = marker.kwargs.get("n", marker.args[0] if marker.args else 3)
    scope = marker.kwargs.get("scope", "function")
    sanitize = marker.kwargs.get("sanitize")
    if isinstance(sanitize, str) and sanitize.strip().lower() in ("off", "on", "strict"):
        sanitize = sanitize.strip().lower()  # as the options take it
    if isinstance(scope, str) and scope.strip().lower() in SCOPES:
        scope = scope.strip().lower()
    ranks = marker.kwargs.get("ranks")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ConfigError(f"cudagraph_engines(n={n!r}): give a positive int number of engines")
    if scope not in SCOPES:
        raise ConfigError(f"cudagraph_engines(scope={scope!r}): choose one of {', '.join(SCOPES)}")
    if sanitize not in (None, "off", "on", "strict"):
        raise ConfigError(f"cudagraph_engines(sanitize={sanitize!r}): choose off, on or strict")
    if sanitize is not None and scope != "function":
        raise ConfigError("cudagraph_engines(sanitize=...) needs scope='function': shared workers keep theirs")
    if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        raise ConfigError(f"cudagraph_engines(ranks={ranks!r}): give a positive int number of MPI ranks")
    return n, scope, sanitize, ranks


@pytest.fixture
def engine_sequence(request: pytest.FixtureRequest, pytestconfig: pytest.Config) -> EngineSequence:
    """Run engines in sequence in one reused worker; see :class:`EngineSequence`.

    ``@pytest.mark.cudagraph_engines(n, scope="function"|"module"|"session", sanitize=None, ranks=None)``
    sets the default engine count, which worker holds them (a module or session worker keeps state across
    tests), a per-test sanitizer mode, and MPI ranks.
    """
    n, scope, sanitize, ranks = _marker_checked(engines_marker, request.node, "cudagraph_engines")
    s = {**_settings(pytestconfig), "budgets": _marker_checked(budgets, request.node, "cudagraph")}
    if s["worker"] == "mpi" or ranks is not None:
        if scope == "module" and ranks is None:
            holder = request.getfixturevalue("cudagraph_mpi_ranks")
        else:
            holder = _mpi_ranks(pytestconfig, ranks, sanitize)
            request.addfinalizer(lambda: _close_reporting(holder, pytestconfig, request.node, sanitize))
        return EngineSequence(request, n, holder, {**s, "sanitize": sanitize} if sanitize else s)
    if sanitize is not None:
        worker = _new_worker(pytestconfig, "function", sanitize)
        request.addfinalizer(lambda: _close_reporting(worker, pytestconfig, request.node, sanitize))
        return EngineSequence(request, n, worker, {**s, "sanitize": sanitize})
    name = {"function": "cudagraph_worker", "module": "cudagraph_module_worker",
            "session": "cudagraph_session_worker"}[scope]
    return EngineSequence(request, n, request.getfixturevalue(name), s)
