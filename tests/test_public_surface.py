"""What users' suites and CI gates read is public API: the engine record, the JSON report (validated against
the schema the package ships), and the names of 0.1.0 that were renamed, still answered with a
DeprecationWarning that says what to read instead."""

import json
import warnings

import pytest

from pytest_cudagraph import EngineRecord
from pytest_cudagraph.records import DEPRECATED_KEYS, cycle_fields, schema

jsonschema = pytest.importorskip("jsonschema")

RECORD = {"index": 0, "pid": 7, "rank": None, "backend": "sim", "engine": "t [engine 0]", "verdict": "held",
          "failed": False, "pool_ids": [[0, [0, 1]]], "pool_bytes": 2 << 20, "held_bytes": 4096, "leaked_bytes": 512,
          "problems": []}


@pytest.mark.parametrize("old, now", [("fresh", True), ("bytes_before_release", 2 << 20),
                                      ("bytes_pinned_by_held_output", 4096), ("bytes_after_release", 4608)])
def test_a_key_of_0_1_0_still_answers_and_warns_with_what_to_read(old, now):
    r = EngineRecord(RECORD)
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is deprecated since 0.2.0 and goes in 0.3.0: read "):
        assert r[old] == now
    with pytest.warns(DeprecationWarning):
        assert r.get(old) == now  # also through .get, as a suite's `c.get("fresh")` reads it


def test_fresh_means_what_it_did_in_0_1_0_and_new_keys_warn_nothing():
    """0.1.0's fresh: the cycle's checks passed (a pool holding only the caller's output was fresh then)."""
    with pytest.warns(DeprecationWarning):
        assert [EngineRecord({**RECORD, "verdict": v, "failed": f})["fresh"] for v, f in (
            ("held", False), ("fresh", False), ("reused", False), ("fresh", True), ("leaked", True))] == \
            [True, True, False, False, False]
    r = EngineRecord({**RECORD, "verdict": "fresh"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (r["verdict"], r.verdict, r.held_bytes, r.get("nope", 3)) == ("fresh", "fresh", 4096, 3)
        assert r.graph_bytes is None  # a field of the schema this record does not carry
        assert json.loads(json.dumps(r)) == dict(r)  # the deprecated keys are answered, never stored
    with pytest.raises(KeyError):
        r["nope"]
    with pytest.raises(AttributeError, match="engine record has no field 'nope'"):
        _ = r.nope


def test_every_field_of_a_cycle_record_is_in_the_schema_and_every_old_key_is_not():
    from dataclasses import fields

    from cudagraph_lifecycle.record import CycleRecord

    assert {f.name for f in fields(CycleRecord)} | {"rank"} == set(cycle_fields())
    assert not set(DEPRECATED_KEYS) & set(cycle_fields())
    for name, prop in schema()["$defs"]["cycle"]["properties"].items():
        assert prop.get("description"), name  # the reference docs are made from these


SUITE_OF_0_1_0 = '''
import pytest
from engines_mod import good, leaky

def test_fresh_engines(engine_sequence):
    records = engine_sequence(good, 2)  # the caller holds each output, as 0.1.0's README example did
    assert all(r["fresh"] for r in records)

def test_a_leak(engine_sequence):
    records = engine_sequence(leaky, 1, output="drop", check=False)
    assert not records[0]["fresh"] and records[0]["bytes_after_release"] > 0
'''


def test_a_suite_written_for_0_1_0_runs_with_warnings_and_its_gate_holds(pytester):
    """The README of 0.1.0: records read r["fresh"] (an engine whose pool held only the caller's output was fresh),
    the gate `jq -e '.totals.not_fresh == 0'` (here 1: the leak). They run on 0.2.0, warned; the report
    validates."""
    from test_plugin import ENGINES

    pytester.makepyfile(engines_mod=ENGINES, test_old=SUITE_OF_0_1_0)
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        f"--cudagraph-report={report}", "-W", "default::DeprecationWarning")
    res.assert_outcomes(passed=2)
    res.stdout.fnmatch_lines(["*DeprecationWarning: engine record key 'fresh' is deprecated since 0.2.0*"])
    data = json.loads(report.read_text())
    jsonschema.validate(data, schema())
    assert data["totals"]["not_fresh"] == 1 and data["meta"]["report_format"] == 2
    assert data["warnings"] == ["totals.not_fresh is deprecated since 0.2.0 and goes in 0.3.0: read "
                                "totals.lifecycle_failures to gate on (not_fresh counts the cycles that failed or "
                                "reused a pool id) (CHANGELOG.md)"]


def test_a_failing_sessions_report_validates_too(pytester):
    """Crashed workers, stale engines, findings: every shape the report takes is in the schema."""
    from test_plugin import ENGINES

    pytester.makepyfile(engines_mod=ENGINES, test_bad='''
        import os, torch
        from engines_mod import leaky

        class Kept:  # a pool handle kept on the class: the second engine captures into a dead, pinned pool
            pool = None
            def __init__(self, be):
                self.be = be
            def capture(self):
                Kept.pool = Kept.pool or self.be.graph_pool_handle()
                self.g, self.x = self.be.new_graph(), self.be.empty(4)
                with self.be.graph(self.g, pool=Kept.pool, stream=self.be.capture_stream(0)):
                    self.y = self.x * 2
            def example_input(self):
                return self.x
            def run(self, x):
                self.g.replay()
                return self.y  # a view into the pool: the caller holds it until the next engine captured
            def release(self):
                self.g.reset()

        def naive(be):
            return Kept(be)

        def test_stale(engine_sequence):
            engine_sequence(naive, 2)

        def test_crash(engine_sequence):
            engine_sequence(lambda be: os._exit(3), 1)

        def test_leak(engine_sequence):
            engine_sequence(leaky, 1, output="drop")
    ''')
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider", "--cudagraph-backend=sim",
                                        f"--cudagraph-report={report}")
    res.assert_outcomes(failed=3)
    data = json.loads(report.read_text())
    jsonschema.validate(data, schema())
    verdicts = {t["nodeid"].rsplit("::", 1)[1]: [c["verdict"] for c in t["cycles"]] for t in data["tests"]}
    assert verdicts["test_stale"][-1] == "stale" and verdicts["test_crash"] == ["error"], verdicts
    with pytest.raises(jsonschema.ValidationError):  # the schema says something: a wrong verdict fails it
        data["tests"][0]["cycles"][0]["verdict"] = "fine"
        jsonschema.validate(data, schema())
