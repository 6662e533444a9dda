"""What the session records about each test (outcome, engine cycles, sanitizer findings), the totals, and
the JSON report with its memory picture (picture.py).

The totals agree with pytest's exit code: ``lifecycle_failures`` counts the tests that FAILED (not xfailed,
not passed) with a failed engine cycle or a strict sanitizer finding, and one more for the session when a
program-wide ``CUDAGRAPH_SANITIZE=strict`` failed it on its findings, so a CI gate on
``.totals.lifecycle_failures == 0`` fails exactly when pytest fails for lifecycle reasons.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from importlib import metadata
from typing import Any

import pytest

from .records import passed_as_0_1_0
from .settings import program_sanitizer_mode
from .worker import finding_key

CYCLES = "cudagraph_cycles"  # user property: the test's engine cycles, as JSON
FINDINGS = "cudagraph_findings"  # user property: the in-process sanitizer's findings
STRICT_FAILURE = "cudagraph_strict_failure"  # user property: strict findings failed the test
SHOWN_FINDINGS = "cudagraph_findings_in_error"  # user property: the findings a strict error showed whole (keys)
SNAPSHOT = "cudagraph_snapshot"  # user property: a memory snapshot's path
SESSION_FINDINGS = "cudagraph_session_findings"  # an xdist worker's output: its session-wide sanitizer's findings
# goes up when a field of the JSON report changes its meaning or goes away (new fields leave it); such a
# change goes through a deprecation first (``warnings`` in the report, report.schema.json)
REPORT_FORMAT = 2
# deprecated totals: name -> (what to read instead, how to count it from the cycles)
DEPRECATED_TOTALS = {
    # 0.1.0's "not fresh": cycles whose checks did not pass (a held output's pool was fresh then)
    "not_fresh": ("totals.lifecycle_failures to gate on (not_fresh counts the cycles that failed or reused a "
                  "pool id)",
                  lambda cycles: sum(1 for c in cycles if not passed_as_0_1_0(c))),
}
CAPTURE_PATH = "cudagraph_capture_path"  # an xdist worker's output: how it observed captures
VERDICTS = ("fresh", "held", "leaked", "stale", "reused", "error")


def shown_key(f: dict) -> str:
    """A finding's key as the test's properties carry it (which findings its error showed)."""
    return json.dumps(finding_key(f))


def new_state() -> dict[str, Any]:
    return {"tests": {}, "started": time.time(), "session_findings": []}


def add_session_findings(state: dict, found: list[dict]) -> None:
    """A program-wide sanitizer's findings at the session's end (a pytest process's, or a shared worker's),
    less those a test already reported (the test's own sanitizer saw the same pool in the same process: pool
    ids are unique only within one, so a finding names its process by pid, and a worker's also by the
    worker's child, pids being reused)."""
    seen = {finding_key(f) for _, f in findings(state, session=False)}
    state["session_findings"] += [f for f in found if finding_key(f) not in seen]


def findings(state: dict, session: bool = True) -> list[tuple[str, dict]]:
    """Every sanitizer finding as (the test it belongs to, the finding): a test's own, its engine cycles',
    and (``session``) the program-wide sanitizer's, each under the first test that captured into its pool."""
    out = [(t["nodeid"], f) for t in state["tests"].values() for f in t.get("sanitizer") or []]
    out += [(nodeid, f) for nodeid, c in rows(state) for f in c.get("sanitizer") or []]
    if session:
        out += [((f.get("tests") or ["(outside any test)"])[0], f) for f in state.get("session_findings", [])]
    return out


def record(state: dict, rep: pytest.TestReport) -> None:
    """Fold one phase's report (setup, call, teardown; here or from an xdist worker) into the test's entry."""
    entry = state["tests"].setdefault(rep.nodeid, {"nodeid": rep.nodeid, "outcome": "passed", "duration": 0.0,
                                                   "cycles": [], "sanitizer": []})
    entry["duration"] += rep.duration
    if rep.failed:  # a call that failed stays "failed" when its teardown errors too; every failing phase is kept
        # xdist reports a worker that died running the test with the phase "???": a failure, as pytest counts it
        phase = "crash" if rep.when not in ("setup", "call", "teardown") else rep.when
        entry["outcome"] = "error" if phase in ("setup", "teardown") and entry["outcome"] != "failed" else "failed"
        entry.setdefault("failed_phases", []).append(phase)
        if phase == "crash":
            entry["crash"] = str(rep.longrepr).strip().splitlines()[0] if rep.longrepr else "the worker died"
    elif rep.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "xfailed" if hasattr(rep, "wasxfail") else "skipped"
        reason = rep.wasxfail if hasattr(rep, "wasxfail") else \
            rep.longrepr[2] if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3 else str(rep.longrepr)
        entry["reason"] = str(reason).removeprefix("Skipped: ")
    elif rep.when == "call" and hasattr(rep, "wasxfail"):
        entry["outcome"] = "xpassed"
    for name, value in rep.user_properties:
        if name == CYCLES:
            entry["cycles"] = json.loads(value)
        elif name == FINDINGS:  # the test's own sanitizer's, its worker's: every phase's report has them all
            entry["sanitizer"] = [f for n, v in rep.user_properties if n == FINDINGS for f in json.loads(v)]
        elif name == SNAPSHOT:
            entry["memory_snapshot"] = value
        elif name == STRICT_FAILURE:
            entry["strict_failure"] = True
        elif name == SHOWN_FINDINGS:  # every phase's report has them all
            entry["findings_in_error"] = sorted({k for n, v in rep.user_properties if n == SHOWN_FINDINGS
                                                 for k in json.loads(v)})


def rows(state: dict) -> list[tuple[str, dict]]:
    return [(t["nodeid"], c) for t in state["tests"].values() for c in t["cycles"]]


def strict_session_findings(state: dict, shared_workers: bool = False) -> int:
    """The findings a strict sanitizer fails the session on, but those of a test that was expected to fail or
    was skipped: under ``CUDAGRAPH_SANITIZE=strict`` every one; under ``--cudagraph-sanitize=strict``
    (``shared_workers``) a module or session worker's, found when it closed, after its tests ended (a test's
    own were failing it already)."""
    outcome = {nodeid: t["outcome"] for nodeid, t in state["tests"].items()}
    found = [(nodeid, f) for nodeid, f in findings(state)
             if not shared_workers or (f.get("worker") and f in state.get("session_findings", ()))]
    return sum(1 for nodeid, _ in found if outcome.get(nodeid) not in ("xfailed", "skipped"))


OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def lifecycle_failure(t: dict) -> bool:
    """Whether test entry ``t`` FAILED for lifecycle reasons: a failed engine cycle or a strict finding (an
    xfailed or passed test's failed cycles were expected, or caught)."""
    return t["outcome"] in ("failed", "error") and (any(c.get("failed") for c in t["cycles"])
                                                    or bool(t.get("strict_failure")))


def totals(state: dict) -> dict[str, Any]:
    cycles = rows(state)
    out = {"tests": len(state["tests"]), "cycles": len(cycles)}
    for v in VERDICTS:
        out[v] = sum(1 for _, c in cycles if c.get("verdict") == v)
    out["failed_cycles"] = sum(1 for _, c in cycles if c.get("failed"))
    out["sanitizer_findings"] = len(findings(state))
    # tests by outcome: a gate tells a session that ran nothing (all skipped) from a clean one
    out["outcomes"] = {o: sum(1 for t in state["tests"].values() if t["outcome"] == o) for o in OUTCOMES}
    out["lifecycle_failures"] = sum(1 for t in state["tests"].values() if lifecycle_failure(t))
    out["strict_session_findings"] = state.get("strict_findings", 0)
    out["lifecycle_failures"] += out["strict_session_findings"] > 0
    for name, (_, count) in DEPRECATED_TOTALS.items():
        out[name] = count([c for _, c in cycles])
    return out


def deprecation_warnings() -> list[str]:
    """The report's ``warnings``: each deprecated field it still carries, what to read instead, when it goes."""
    from .records import REMOVED_IN

    return [f"totals.{name} is deprecated since 0.2.0 and goes in {REMOVED_IN}: read {instead} (CHANGELOG.md)"
            for name, (instead, _) in DEPRECATED_TOTALS.items()]


def lifecycle_line(t: dict[str, int]) -> str:
    """The table's last words on failures: the tests, and apart from them a session a strict sanitizer failed
    (``lifecycle_failures`` counts that session as one more, which is not a test)."""
    session = t["strict_session_findings"]
    tests = t["lifecycle_failures"] - (session > 0)
    return f"{tests} test(s) failed for lifecycle reasons" + (
        f", and the session failed on {session} strict sanitizer finding(s)" if session else "")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def capture_path() -> str | None:
    """How this process observes captures (compiled, or Python and why); None where the library was never
    used here (read only then: its import brings torch's)."""
    compiled = sys.modules.get("cudagraph_lifecycle.observe.compiled")
    return None if compiled is None else compiled.describe()


def session_capture_path(state: dict) -> str | None:
    """This process's, or (an xdist controller runs no test) what its workers said, each way once."""
    here = capture_path()
    if here is not None:
        return here
    paths = sorted(state.get("capture_paths") or ())
    return "; ".join(paths) if paths else None


def write(path: str, s: dict, state: dict, exitstatus: int) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # gone since the start: made again, as --junitxml makes its folder at the end
        try:
            os.makedirs(folder, exist_ok=True)
        except FileExistsError:  # "File exists" would not say that a file took the folder's place
            raise NotADirectoryError(errno.ENOTDIR, "a file is where its folder goes", folder) from None
    report = {
        "meta": {
            "report_format": REPORT_FORMAT,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rootdir": state.get("rootdir"),
            "torch": _version("torch"),
            "backend": s["backend"],
            "effective_backend": s.get("effective_backend"),
            "gpus": s.get("gpus"),
            "start_method": s.get("start_method_effective"),
            "sanitize": s["sanitize"],
            "program_sanitize": program_sanitizer_mode(),  # CUDAGRAPH_SANITIZE's sanitizer, where installed
            "capture_path": session_capture_path(state),
            # what the workers do: strict refuses whatever was set (set: as the user set it)
            "expandable_teardown": "refuse" if s["sanitize"] == "strict" else s["expandable_teardown"],
            "expandable_teardown_set": s["expandable_teardown"],
            "max_growth": s["max_growth"],
            "worker": s["worker"],
            "mpi_ranks": s["mpi_ranks"],
            "timeout": s["timeout"],
            "plugin_version": _version("pytest-cudagraph"),
            "exitstatus": int(exitstatus),
        },
        "tests": [{**{k: v for k, v in t.items() if k != "findings_in_error"}, "lifecycle_failure": lifecycle_failure(t)}
                  for t in state["tests"].values()],
        "sanitizer": state.get("session_findings", []),
        "totals": totals(state),
        "warnings": deprecation_warnings(),
    }
    png = timeline_png(report["tests"], path)
    if png:
        report["meta"]["timeline_png"] = png
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):  # a full disk: no half-written file left beside the report
            os.unlink(tmp)
        raise


def timeline_png(tests: list[dict], report_path: str) -> str | None:
    """The memory picture of the run (picture.py), beside the JSON report, where matplotlib is installed and an
    engine cycle ran: its path, ``meta.timeline_png``."""
    from .picture import render

    path = os.path.splitext(report_path)[0] + ".png"
    return path if render(tests, path) else None
