"""The ``cudagraph`` pytest plugin: options, markers, GPU gating, terminal sections and the JSON report.

Thin by design: settings in ``settings.py``, fixtures in ``fixtures.py`` (engine sequences in
``sequence.py``), workers in ``worker/`` and ``mpi.py``, the report in ``report.py`` and ``terminal.py``,
the lifecycle logic in the ``cudagraph_lifecycle`` library. Loading the plugin imports no torch: a session
whose tests use none of it pays nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import warnings

import pytest

from cudagraph_lifecycle.choices import capture_path_from_env, checked_from_env

from . import report as reporting
from . import settings, terminal
from .fixtures import (  # noqa: F401 - fixtures are registered by import
    _as_written,
    _cudagraph_sanitize,
    cudagraph_backend_name,
    cudagraph_module_worker,
    cudagraph_mpi_ranks,
    cudagraph_session_worker,
    cudagraph_worker,
    engine_sequence,
)
from .gpu import pin_xdist_worker
from .mpi import mpi_unavailable_reason
from .settings import CALL_FAILED, SETTINGS_KEY, STATE_KEY, effective_backend, program_sanitizer_mode
from .worker import close_all_workers, resolve_start_method

MARKERS = ("cudagraph", "gpu", "mpi", "cudagraph_engines")
HEADER = "cudagraph_header"  # an xdist worker's output: its header lines, where its tests used the plugin
FIXTURES = ("engine_sequence", "cudagraph_worker", "cudagraph_module_worker", "cudagraph_session_worker",
            "cudagraph_mpi_ranks", "cudagraph_backend_name")


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def forked_incompatibility(pytest_version: str, forked: bool) -> str | None:
    """pytest-forked cannot run under pytest >= 9.2: every test 'EXITED with status 3' (a NodeId that the
    forked child cannot marshal). Say so once instead of failing every test."""
    if not forked:
        return None
    try:
        major, minor = (int(p) for p in pytest_version.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) >= (9, 2):
        return (
            f"--forked (pytest-forked) does not work with pytest {pytest_version}: every test ends 'EXITED with "
            "status 3'. Drop --forked: pytest-cudagraph's reused workers (engine_sequence, cudagraph_worker) "
            "already isolate CUDA state in child processes; or pin pytest<9.2"
        )
    return None


def _check_report_path(s: dict, probe: bool = True) -> str:
    given = settings.describe_source(s, "report")
    path = os.path.abspath(s["report"])
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        existing = folder
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):  # mkdir -p cannot make a folder where a file is
            raise pytest.UsageError(f"{given}: {existing} is a file, not a folder; choose another path")
        try:  # made with its parents, as --junitxml makes its own
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise pytest.UsageError(f"{given}: the folder {folder} cannot be created ({e.strerror or e}); choose a "
                                    "path under a folder you can write to") from None
    if os.path.isdir(path):
        raise pytest.UsageError(f"{given} is a folder: give a file path such as {path}/cudagraph.json")
    if not os.access(folder, os.W_OK):
        raise pytest.UsageError(f"{given}: the folder {folder} is not writable; choose another path")
    if probe:  # os.access says yes to root everywhere (/proc too): only a file made there tells
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cudagraph-report-")
        except OSError as e:
            raise pytest.UsageError(f"{given}: the folder {folder} is not writable ({e.strerror or e}); choose "
                                    "another path") from None
        os.close(fd)
        os.unlink(tmp)
    return path


def _check_worker_kind(s: dict) -> None:
    """``mpi`` chosen (the default is fork) where MPI is missing: a usage error, since skipping every
    engine_sequence test would let a CI gate pass on no engine at all."""
    if s["worker"] == "mpi" and s["mpi_unavailable"]:
        raise pytest.UsageError(
            f"{settings.describe_source(s, 'worker')}: {s['mpi_unavailable']}, so every engine_sequence test would "
            f"be skipped. Install mpi4py and an MPI runtime, or choose fork: {settings.choose(s, 'worker', 'fork')}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cudagraph(max_pool_bytes=None, max_captures=None, require_replay=False): a test of CUDA graph lifecycles "
        "(the pool sanitizer watches it); the budgets fail it over them",
    )
    config.addinivalue_line(
        "markers", "gpu: needs a usable GPU; skipped without one unless --cudagraph-require-gpu (then the session stops)"
    )
    config.addinivalue_line(
        "markers", "mpi: needs MPI ranks; skipped without mpi4py and an MPI runtime unless --cudagraph-require-mpi"
    )
    config.addinivalue_line(
        "markers",
        "cudagraph_engines(n=3, scope='function', sanitize=None, ranks=None): engine count for engine_sequence, the "
        "scope of the reused worker that holds them (function, module or session), a per-test sanitizer mode, and "
        "MPI ranks",
    )
    try:  # read by the runners and sanitizers in workers: a bad value stops the session here, not a test there
        checked_from_env(os.environ)
        capture_path_from_env(os.environ)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    problem = forked_incompatibility(pytest.__version__, bool(getattr(config.option, "forked", False)))
    if problem:
        raise pytest.UsageError(problem)
    s = settings.resolve(config)
    config.stash[SETTINGS_KEY] = s
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pytest 9 calls config.inicfg deprecated (its keys are still what we need)
        ini_keys = list(getattr(config, "inicfg", None) or ())
    unread = settings.unknown_variables(os.environ) + settings.unknown_ini_keys(ini_keys, settings.ini_file(config))
    for line in unread:
        config.issue_config_time_warning(pytest.PytestConfigWarning(line), stacklevel=2)
    config.stash[STATE_KEY] = reporting.new_state()
    config.stash[STATE_KEY]["rootdir"] = str(config.rootpath)  # the report's paths are absolute: a gate strips it
    workerinput = getattr(config, "workerinput", None)
    if s["report"]:
        s["report"] = _check_report_path(s, probe=workerinput is None)  # (only the controller writes it)
    if s["sanitize"] == "strict" and s["expandable_teardown"] == "report" and workerinput is None:
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"{settings.describe_source(s, 'expandable_teardown')} is overridden by "
            f"{settings.describe_source(s, 'sanitize')}: strict always refuses the reset of a pool's last graph "
            "while blocks of it live; drop one of them"), stacklevel=2)
    if workerinput is not None and s["backend"] != "sim":
        # xdist: one GPU per worker, set before anything in this process touches CUDA.
        s["pinned_device"] = pin_xdist_worker(workerinput["workerid"], int(workerinput.get("workercount", 1)))
    if s["require_gpu"] and s["backend"] == "sim":
        raise pytest.UsageError(f"{settings.describe_source(s, 'require_gpu')} contradicts "
                                f"{settings.describe_source(s, 'backend')}: "
                                "drop one of them")
    if s["require_gpu"] or s["backend"] == "cuda":
        effective_backend(config)
        if not s["gpus"]:
            asked = settings.describe_source(s, "require_gpu" if s["require_gpu"] else "backend")
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hidden = "" if visible is None else f", or CUDA_VISIBLE_DEVICES={visible!r} hiding them"
            raise pytest.UsageError(
                f"{asked}: no usable GPU is visible to this process (a CPU build of torch, no GPU{hidden}). "
                "Run on a GPU runner, or " + "; ".join(
                    ([settings.unset(s, "require_gpu") + " (on a CPU the default backend, auto, runs sim)"]
                     if s["require_gpu"] else [])
                    + (["choose backend sim or auto"] if s["backend"] == "cuda" else []))
            )
    s["mpi_unavailable"] = mpi_unavailable_reason()
    if s["require_mpi"] and s["mpi_unavailable"]:
        raise pytest.UsageError(f"{settings.describe_source(s, 'require_mpi')}: {s['mpi_unavailable']}")
    _check_worker_kind(s)
    try:
        s["start_method_effective"], s["start_reason"] = resolve_start_method(s["start_method"])
    except ValueError as e:
        raise pytest.UsageError(f"{settings.describe_source(s, 'start_method')}: {e}") from None
    # pytest-html's report gets each test's cycles: its hooks are known only where its plugin is loaded, so
    # they live apart and are imported only then (xdist workers too: they make the reports' extras)
    if config.pluginmanager.hasplugin("html") and config.getoption("htmlpath", None):
        from .html_report import HtmlCycles

        config.pluginmanager.register(HtmlCycles(config), "cudagraph-html")


def _uses_plugin(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) is not None for m in MARKERS) or \
        bool(set(getattr(item, "fixturenames", ())) & set(FIXTURES))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    s = config.stash[SETTINGS_KEY]
    s["used"] = any(_uses_plugin(item) for item in items)
    for item in items:
        _warn_markers_without_effect(item)
    if any(item.get_closest_marker("gpu") is not None for item in items):
        if not (effective_backend(config) == "cuda" and s["gpus"]):
            skip = pytest.mark.skip(reason="needs a usable GPU (none visible; --cudagraph-require-gpu would stop "
                                           "instead)")
            for item in items:
                if item.get_closest_marker("gpu") is not None:
                    item.add_marker(skip)
    if s["mpi_unavailable"]:
        skip_mpi = pytest.mark.skip(reason=f"needs MPI: {s['mpi_unavailable']}")
        for item in items:
            if item.get_closest_marker("mpi") is not None:
                item.add_marker(skip_mpi)


def _warn_markers_without_effect(item: pytest.Item) -> None:
    """Markers written on the test itself that do nothing: ``cudagraph_engines`` on a test without
    ``engine_sequence`` (the only reader; a module's or class's marker covers tests of other kinds too), and a
    second ``cudagraph`` or ``cudagraph_engines`` (only the one nearest the function is read)."""
    own = list(getattr(item, "own_markers", ()))
    engines = [m for m in own if m.name == "cudagraph_engines"]
    if engines and "engine_sequence" not in getattr(item, "fixturenames", ()):
        item.warn(pytest.PytestWarning(
            f"{_as_written(engines[0])} on {item.name} does nothing: only the engine_sequence fixture reads it; "
            "take engine_sequence as an argument of the test, or remove the marker"))
    for name in ("cudagraph", "cudagraph_engines"):
        mine = [m for m in own if m.name == name]
        if len(mine) > 1:
            item.warn(pytest.PytestWarning(
                f"{name} is written {len(mine)} times on {item.name}: only {_as_written(mine[0])}, the one nearest "
                f"the function, is read ({', '.join(_as_written(m) for m in mine[1:])} ignored); keep one"))


def pytest_report_collectionfinish(config: pytest.Config, start_path, items) -> list[str]:
    """The plugin's header lines (its settings, and where it was loaded from), shown only where a collected
    test uses it, or a program-wide sanitizer reports under the tests (resolving the backend may import
    torch). An xdist controller collects nothing: it prints its workers' lines in the summary."""
    s = config.stash.get(SETTINGS_KEY, None)
    program = program_sanitizer_mode()  # its findings are reported under the tests: a session that uses it
    if s is None or not (s.get("used") or program):
        return []
    return _header_lines(config, program)


def _header_lines(config: pytest.Config, program: str | None) -> list[str]:
    s = config.stash[SETTINGS_KEY]
    backend = effective_backend(config)
    return [
        f"cudagraph: backend={s['backend']} (effective {backend}), gpus={s['gpus']}, "
        f"workers start by {s['start_reason']}, timeout={s['timeout']:g}s, sanitize={s['sanitize']}"
        + (f" (and program-wide CUDAGRAPH_SANITIZE={os.environ.get('CUDAGRAPH_SANITIZE') or program})"
           if program else "")
        # the worker kind, not the start method above: "fork" is reused worker processes, however started
        + (f", engines held by MPI ranks (worker=mpi, {s['mpi_ranks']} ranks)" if s["worker"] == "mpi"
           else f", engines held by reused workers (worker={s['worker']})"),
        # which copy runs: a system-wide pytest may load another checkout's editable install
        f"cudagraph: plugin from {os.path.dirname(os.path.abspath(__file__))}",
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Every capture made while a test runs (setup, call, teardown) is attributed to it in the ledger, so a
    sanitizer finding names its test. Imports no torch: the ledger is plain Python."""
    from cudagraph_lifecycle.ledger import ledger

    ledger.test = item.nodeid
    try:
        yield
    finally:
        ledger.test = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.stash[CALL_FAILED] = rep.failed
    if rep.failed and item.get_closest_marker("cudagraph") is not None:
        _snapshot_in_process(item, rep)
    state = item.config.stash[STATE_KEY]
    note = None
    if rep.failed and call.excinfo is not None:
        note = terminal.poison_note(call.excinfo.value, state.get("refusals", []))
        if note and note.startswith(terminal.REFUSAL_NOTE):  # named in the notes of the tests it poisons
            state.setdefault("refusals", []).append(f"{item.nodeid} at {terminal.refusal_site(call.excinfo)}")
    if note:
        if hasattr(rep.longrepr, "addsection"):  # shown under the failure whatever --show-capture says
            rep.longrepr.addsection("cudagraph", note)
        else:
            rep.sections.append(("cudagraph", note))
    reporting.record(state, rep)


def _snapshot_in_process(item: pytest.Item, rep: pytest.TestReport) -> None:
    """A failing cudagraph test that used the GPU in this process: dump the allocator's memory snapshot."""
    if "torch" not in sys.modules:
        return
    from cudagraph_lifecycle.backends import get_backend

    s = item.config.stash[SETTINGS_KEY]
    folder = os.path.join(os.path.dirname(s["report"]), "cudagraph-snapshots") if s["report"] else tempfile.gettempdir()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[-120:]
    path = get_backend(effective_backend(item.config)).dump_snapshot(os.path.join(folder, f"{name}-{rep.when}.pickle"))
    if path:
        rep.user_properties.append((reporting.SNAPSHOT, path))
        rep.sections.append(("cudagraph", f"memory snapshot (open it in PyTorch's memory visualizer): {path}"))


class _XdistReports:
    """Collects reports that xdist workers send to the controller (cycles travel in user_properties; the
    session-wide sanitizer's findings in the worker's output when it ends)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(report, "node", None) is not None:  # a report from an xdist worker
            reporting.record(self.config.stash[STATE_KEY], report)

    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", {})
        state = self.config.stash[STATE_KEY]
        found = output.get(reporting.SESSION_FINDINGS)
        if found:
            reporting.add_session_findings(state, json.loads(found))
        worker = getattr(node, "workerinput", {}).get("workerid", "?")
        if output.get(reporting.CAPTURE_PATH):
            state.setdefault("capture_paths", set()).add(output[reporting.CAPTURE_PATH])
        for line in json.loads(output.get(HEADER, "[]")):
            state.setdefault("headers", {}).setdefault(line, []).append(worker)


def _xdist_header(tr, state: dict) -> None:
    """The header lines the workers sent, once each; a line not every worker shares names its workers."""
    headers = state.get("headers") or {}
    workers = {w for ids in headers.values() for w in ids}
    for line, ids in headers.items():
        tr.write_line(line if set(ids) == workers else f"{line} ({', '.join(sorted(ids))})")


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if config.pluginmanager.hasplugin("dsession"):  # xdist controller: no tests run here
        config.pluginmanager.register(_XdistReports(config), "cudagraph-xdist-reports")


def _session_findings() -> list[dict]:
    """What a program-wide sanitizer (``CUDAGRAPH_SANITIZE=1 pytest ...``) found over the session; none
    without one (and no torch import: it is installed only where torch is)."""
    env = sys.modules.get("cudagraph_lifecycle.sanitizer.env")
    if env is None:
        return []
    env.findings_taken()  # reported here, under their tests: the process's exit prints nothing
    san = env.global_sanitizer()
    return [{**f.as_dict(), "pid": os.getpid()} for f in san.findings()] if san is not None else []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session-wide sanitizer's findings (an xdist worker hands them to the controller), then the JSON
    report, written here (not from the terminal summary, which ``-p no:terminal`` removes)."""
    config = session.config
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None:
        return
    state = config.stash[STATE_KEY]
    found = _session_findings() + state.pop("worker_findings", [])  # (shared workers' are in by now)
    if hasattr(config, "workerinput"):
        if found:
            config.workeroutput[reporting.SESSION_FINDINGS] = json.dumps(found)
        program = program_sanitizer_mode()
        if s.get("used") or program:
            config.workeroutput[HEADER] = json.dumps(_header_lines(config, program))
        path = reporting.capture_path()
        if path is not None:
            config.workeroutput[reporting.CAPTURE_PATH] = path
        return
    reporting.add_session_findings(state, found)
    strict_by = "CUDAGRAPH_SANITIZE=strict" if _program_wide_strict() else \
        "--cudagraph-sanitize=strict" if s["sanitize"] == "strict" else None
    if strict_by:
        state["strict_by"] = strict_by
        state["strict_findings"] = n = reporting.strict_session_findings(state, strict_by.startswith("--"))
        if n and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = exitstatus = pytest.ExitCode.TESTS_FAILED
    if s["report"]:
        if reporting.rows(state) or state.get("session_findings"):
            effective_backend(config)  # an xdist controller ran no test: what its workers resolved, read alike
        try:
            reporting.write(s["report"], s, state, exitstatus)
        except OSError as e:  # a file took its folder's place, or the disk filled up: one line, no traceback
            state["report_error"] = line = (f"cudagraph report not written: {settings.describe_source(s, 'report')}: "
                                            f"{e.strerror or e} ({e.filename or s['report']})")
            if session.exitstatus == pytest.ExitCode.OK:  # as the same path refused at the start would
                session.exitstatus = pytest.ExitCode.USAGE_ERROR
            if not config.pluginmanager.has_plugin("terminalreporter"):
                sys.stderr.write(f"ERROR: {line}\n")


def _program_wide_strict() -> bool:
    """``CUDAGRAPH_SANITIZE=strict pytest ...``: every sanitizer finding of the session fails it, but an xfailed
    or skipped test's (the plugin's own ``--cudagraph-sanitize`` mode is about its engine cycles and
    cudagraph-marked tests)."""
    return os.environ.get("CUDAGRAPH_SANITIZE", "").strip().lower() == "strict"


def pytest_unconfigure(config: pytest.Config) -> None:
    close_all_workers()  # also after crashes and Ctrl-C: no worker process outlives the session


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    state = config.stash.get(STATE_KEY, None)
    s = config.stash.get(SETTINGS_KEY, None)
    if state is None or s is None:
        return
    if reporting.rows(state):
        effective_backend(config)  # (an xdist controller has not resolved it: its workers ran the tests)
    _xdist_header(terminalreporter, state)
    terminal.lifecycle_section(terminalreporter, state, s.get("effective_backend"))
    terminal.findings_section(terminalreporter, state)
    if state.get("report_error"):
        terminalreporter.write_line(f"ERROR: {state['report_error']}", red=True, bold=True)
    elif s["report"]:
        terminalreporter.write_line(f"cudagraph report: {s['report']}")
