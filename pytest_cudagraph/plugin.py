"""The ``cudagraph`` pytest plugin: options, markers, GPU gating, terminal summary and JSON report.

Thin by design: fixtures live in ``fixtures.py``, workers in ``worker.py``, the lifecycle logic in the
``cudagraph_lifecycle`` library.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

import pytest

from . import settings
from .fixtures import (  # noqa: F401 - fixtures are registered by import
    PROPERTY,
    _cudagraph_sanitize,
    cudagraph_backend_name,
    cudagraph_module_worker,
    cudagraph_mpi_ranks,
    cudagraph_session_worker,
    cudagraph_worker,
    engine_sequence,
)
from .gpu import pin_xdist_worker, visible_gpu_count
from .mpi import mpi_unavailable_reason
from .worker import close_all_workers, resolve_start_method

SETTINGS_KEY = pytest.StashKey[dict]()
STATE_KEY = pytest.StashKey[dict]()


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


def _check_report_path(path: str) -> str:
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise pytest.UsageError(
            f"--cudagraph-report={path}: the folder {folder} does not exist; create it or choose another path"
        )
    if not os.access(folder, os.W_OK):
        raise pytest.UsageError(f"--cudagraph-report={path}: the folder {folder} is not writable")
    if os.path.isdir(path):
        raise pytest.UsageError(f"--cudagraph-report={path} is a folder: give a file path such as {path}/cudagraph.json")
    return path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cudagraph: a test of CUDA graph lifecycles (uses pytest-cudagraph)")
    config.addinivalue_line(
        "markers", "gpu: needs a usable GPU; skipped without one unless --cudagraph-require-gpu (then the session stops)"
    )
    config.addinivalue_line(
        "markers", "mpi: needs MPI ranks; skipped without mpi4py and an MPI runtime unless --cudagraph-require-mpi"
    )
    config.addinivalue_line(
        "markers",
        "cudagraph_engines(n=3, scope='function', sanitize=None): engine count for engine_sequence, the scope of "
        "the reused worker that holds them (function, module or session), a per-test sanitizer mode, and "
        "ranks=N for --cudagraph-worker=mpi",
    )
    problem = forked_incompatibility(pytest.__version__, bool(getattr(config.option, "forked", False)))
    if problem:
        raise pytest.UsageError(problem)
    s = settings.resolve(config)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and s["backend"] != "sim":
        # xdist: one GPU per worker, set before anything in this process touches CUDA.
        s["pinned_device"] = pin_xdist_worker(workerinput["workerid"], int(workerinput.get("workercount", 1)))
    if s["report"]:
        s["report"] = _check_report_path(s["report"])
    s["gpus"] = visible_gpu_count() if s["backend"] != "sim" else 0
    if s["require_gpu"] and s["gpus"] == 0:
        raise pytest.UsageError(
            "--cudagraph-require-gpu: no usable GPU is visible to this process (torch.version.cuda="
            f"{_torch_cuda()}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). "
            "Run on a GPU runner, or drop the flag to run on the simulated allocator"
        )
    if s["require_gpu"] and s["backend"] == "sim":
        raise pytest.UsageError("--cudagraph-require-gpu contradicts --cudagraph-backend=sim: drop one of them")
    s["effective_backend"] = {"auto": "cuda" if s["gpus"] else "sim"}.get(s["backend"], s["backend"])
    s["mpi_unavailable"] = mpi_unavailable_reason()
    if s["require_mpi"] and s["mpi_unavailable"]:
        raise pytest.UsageError(f"--cudagraph-require-mpi: {s['mpi_unavailable']}")
    try:
        s["start_method_effective"], s["start_reason"] = resolve_start_method(s["start_method"])
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[SETTINGS_KEY] = s
    config.stash[STATE_KEY] = {"tests": {}, "started": time.time()}


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None:
        return []
    return [
        f"cudagraph: backend={s['backend']} (effective {s['effective_backend']}), gpus={s['gpus']}, "
        f"workers start by {s['start_reason']}, timeout={s['timeout']:g}s, engines held by {s['worker']}"
        + (f" ({s['mpi_ranks']} ranks)" if s["worker"] == "mpi" else "")
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    s = config.stash[SETTINGS_KEY]
    no_gpu = not (s["effective_backend"] == "cuda" and s["gpus"])
    skip_gpu = pytest.mark.skip(reason="needs a usable GPU (none visible; --cudagraph-require-gpu would stop instead)")
    skip_mpi = pytest.mark.skip(reason=f"needs MPI: {s['mpi_unavailable']}")
    for item in items:
        if no_gpu and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        if s["mpi_unavailable"] and item.get_closest_marker("mpi") is not None:
            item.add_marker(skip_mpi)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and item.get_closest_marker("cudagraph") is not None:
        _snapshot_in_process(item, rep)
    state = item.config.stash[STATE_KEY]
    _record(state, rep)


def _snapshot_in_process(item: pytest.Item, rep: pytest.TestReport) -> None:
    """A failing cudagraph test that used CUDA in this process: dump the allocator's memory snapshot."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    from cudagraph_lifecycle.cycle import dump_memory_snapshot

    report = item.config.stash[SETTINGS_KEY].get("report")
    folder = os.path.join(os.path.dirname(report), "cudagraph-snapshots") if report else tempfile.gettempdir()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[-120:]
    path = dump_memory_snapshot(os.path.join(folder, f"{name}-{rep.when}.pickle"))
    if path:
        rep.user_properties.append(("cudagraph_snapshot", path))
        rep.sections.append(("cudagraph", f"memory snapshot (open it in PyTorch's memory visualizer): {path}"))


def _record(state: dict, rep: pytest.TestReport) -> None:
    entry = state["tests"].setdefault(rep.nodeid, {"nodeid": rep.nodeid, "outcome": "passed", "duration": 0.0,
                                                   "cycles": []})
    entry["duration"] += rep.duration
    if rep.failed:
        entry["outcome"] = "failed" if rep.when == "call" else "error"
    elif rep.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "xfailed" if hasattr(rep, "wasxfail") else "skipped"
    elif rep.when == "call" and hasattr(rep, "wasxfail"):
        entry["outcome"] = "xpassed"
    for name, value in rep.user_properties:
        if name == PROPERTY:
            entry["cycles"] = json.loads(value)
        elif name == "cudagraph_findings":
            entry["sanitizer"] = json.loads(value)
        elif name == "cudagraph_snapshot":
            entry["memory_snapshot"] = value


class _XdistReports:
    """Collects reports that xdist workers send to the controller (cycles travel in user_properties)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(report, "node", None) is not None:  # a report from an xdist worker
            _record(self.config.stash[STATE_KEY], report)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if config.pluginmanager.hasplugin("dsession"):  # xdist controller: no tests run here
        config.pluginmanager.register(_XdistReports(config), "cudagraph-xdist-reports")


def pytest_unconfigure(config: pytest.Config) -> None:
    close_all_workers()  # also after crashes and Ctrl-C: no worker process outlives the session


def _who(c: dict) -> str:
    pid = str(c.get("pid") or "-")
    return pid if c.get("rank") is None else f"{pid}/r{c['rank']}"


def _rows(state: dict) -> list[tuple[str, dict]]:
    return [(t["nodeid"], c) for t in state["tests"].values() for c in t["cycles"]]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    state = config.stash.get(STATE_KEY, None)
    s = config.stash.get(SETTINGS_KEY, None)
    if state is None or s is None:
        return
    rows = _rows(state)
    if rows:
        tr = terminalreporter
        tr.section("cudagraph lifecycle")
        tr.write_line(f"{'test':<48} {'#':>2} {'pid/rank':>9} {'pool':>9} {'graphs':>6} {'capture ms':>10} "
                      f"{'pool bytes':>11} {'held':>9} {'leaked':>7} fresh")
        for nodeid, c in rows:
            pool = ",".join(f"{p[1][0]}:{p[1][1]}" for p in c.get("pool_ids") or []) or "-"
            name = nodeid if len(nodeid) <= 48 else "…" + nodeid[-47:]
            tr.write_line(
                f"{name:<48} {c['index']:>2} {_who(c):>9} {pool:>9} {c.get('graphs', 0):>6} "
                f"{c.get('capture_ms', 0.0):>10.1f} {c.get('bytes_before_release', 0):>11} "
                f"{c.get('bytes_pinned_by_held_output', 0):>9} "
                f"{c.get('bytes_after_release', 0) - c.get('bytes_pinned_by_held_output', 0):>7} "
                f"{'yes' if c.get('fresh') else 'NO'}"
            )
            for p in c.get("problems") or []:
                tr.write_line(f"{'':<52}! {p}")
        fresh = sum(1 for _, c in rows if c.get("fresh"))
        tr.write_line(f"{len(rows)} engine cycles, {fresh} fresh, {len(rows) - fresh} not fresh; "
                      f"backend {s['effective_backend']}")
    _write_findings(terminalreporter, state, rows)
    if s.get("report"):
        _write_report(config, s, state, exitstatus)
        terminalreporter.write_line(f"cudagraph report: {s['report']}")


def _write_findings(tr, state: dict, rows: list[tuple[str, dict]]) -> None:
    """The sanitizer's findings, in the test process and in the workers' engine cycles (``on`` mode reports
    them here and in the JSON; ``strict`` also fails the test)."""
    found = [(t["nodeid"], f) for t in state["tests"].values() for f in t.get("sanitizer") or []]
    found += [(nodeid, f) for nodeid, c in rows for f in c.get("sanitizer") or []]
    if not found:
        return
    tr.section("cudagraph sanitizer")
    for nodeid, f in found:
        tr.write_line(f"{nodeid}: {f['kind']}: pool {tuple(f['pool_id'])} on device {f['device']}, "
                      f"{f['bytes']} bytes: {f['message']}")
        for stack in f.get("stacks") or []:
            lines = stack.rstrip().splitlines()
            for line in lines[-4:]:  # the innermost frames; the JSON keeps the whole stack
                tr.write_line(f"    {line}")
    tr.write_line(f"{len(found)} sanitizer finding(s)")


def _write_report(config: pytest.Config, s: dict, state: dict, exitstatus: int) -> None:
    import torch

    rows = _rows(state)
    report = {
        "meta": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "backend": s["backend"],
            "effective_backend": s["effective_backend"],
            "gpus": s["gpus"],
            "start_method": s["start_method_effective"],
            "exitstatus": int(exitstatus),
        },
        "tests": list(state["tests"].values()),
        "totals": {
            "tests": len(state["tests"]),
            "cycles": len(rows),
            "fresh": sum(1 for _, c in rows if c.get("fresh")),
            "not_fresh": sum(1 for _, c in rows if not c.get("fresh")),
        },
    }
    png = _timeline_png(rows, s["report"])
    if png:
        report["meta"]["timeline_png"] = png
    tmp = s["report"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, s["report"])


def _timeline_png(rows: list[tuple[str, dict]], report_path: str) -> str | None:
    """Pool bytes across engine cycles, next to the JSON report, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not rows:
        return None
    xs = list(range(len(rows)))
    before = [c.get("bytes_before_release", 0) / 2**20 for _, c in rows]
    held = [c.get("bytes_pinned_by_held_output", 0) / 2**20 for _, c in rows]
    leaked = [(c.get("bytes_after_release", 0) - c.get("bytes_pinned_by_held_output", 0)) / 2**20 for _, c in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.4), 3.5))
    ax.plot(xs, before, "o-", label="pool bytes before release")
    ax.plot(xs, held, "s--", label="pinned by the held output")
    ax.plot(xs, leaked, "x-", color="red", label="leaked after release")
    for x, (_, c) in zip(xs, rows):
        if not c.get("fresh"):
            ax.axvline(x, color="red", alpha=0.2)
    ax.set_xlabel("engine cycle (in test order)")
    ax.set_ylabel("MiB")
    ax.set_title("cudagraph lifecycle: pool memory per engine cycle")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.splitext(report_path)[0] + ".png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
