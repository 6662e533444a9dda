"""Probe plugin (``PYTHONPATH=scripts pytest -p probe_session_findings ...`` with CUDAGRAPH_SANITIZE=1): attributes
every capture of a test to it (the ledger's scope) and writes the session-wide sanitizer's findings and each
test's outcome to $OUT/session-findings-<tag>.json at the end."""
from __future__ import annotations

import json
import os

import pytest

_outcomes: dict[str, str] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from cudagraph_lifecycle.ledger import ledger

    with ledger.engine_scope(item.nodeid):
        yield


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = f"failed in {report.when}"
    elif report.when == "call" or (report.skipped and report.nodeid not in _outcomes):
        _outcomes.setdefault(report.nodeid, report.outcome)


def pytest_sessionfinish(session, exitstatus):
    from cudagraph_lifecycle.sanitizer import global_sanitizer

    san = global_sanitizer()
    found = [f.as_dict() for f in san.findings()] if san is not None else None
    tag = os.environ.get("PROBE_TAG", "run")
    with open(os.path.join(os.environ.get("OUT", "."), f"session-findings-{tag}.json"), "w") as f:
        json.dump({"sanitizer": san is not None, "findings": found, "outcomes": _outcomes}, f, indent=1)
    print(f"\nprobe: {len(found or [])} finding(s):")
    for x in found or []:
        print(f"  {x['kind']} pool {x['pool_id']} {x['bytes']} B engine={x['engine']} stacks={len(x['stacks'])}")
