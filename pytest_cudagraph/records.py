"""The engine record: what ``engine_sequence`` returns per engine cycle, what the JSON report's ``cycles``
hold and what a gate reads. Its fields are described once, in ``report.schema.json`` (``$defs.cycle``), which
the reference documentation is generated from and the tests validate real reports against.

A record is a ``dict`` (it travels as JSON between processes and into reports) that also reads its fields as
attributes (``r.verdict``), and still answers the keys of 0.1.0 that were renamed, with a
``DeprecationWarning`` that says what to read instead, until they go in 0.3.0.
"""

from __future__ import annotations

import json
import warnings
from functools import cache
from importlib import resources
from typing import Any

REMOVED_IN = "0.3.0"


def passed_as_0_1_0(r: dict) -> bool:
    """What 0.1.0 called ``fresh``: the cycle's checks passed. An engine whose pool held only the caller's output
    was fresh then (``held`` now); a pool id used again was not (``reused`` now)."""
    return not r.get("failed") and r.get("verdict") in ("fresh", "held")


def _after_release(r: dict) -> int:
    return r.get("held_bytes", 0) + r.get("leaked_bytes", 0)


# 0.1.0's key -> (what it is now, in words; how to compute it from this record)
DEPRECATED_KEYS = {
    "fresh": ('not r["failed"] and r["verdict"] in ("fresh", "held")', passed_as_0_1_0),
    "bytes_before_release": ('r["pool_bytes"]', lambda r: r.get("pool_bytes", 0)),
    "bytes_pinned_by_held_output": ('r["held_bytes"]', lambda r: r.get("held_bytes", 0)),
    "bytes_after_release": ('r["held_bytes"] + r["leaked_bytes"]', _after_release),
}


def deprecation_text(old: str, new: str) -> str:
    return (f"engine record key {old!r} is deprecated since 0.2.0 and goes in {REMOVED_IN}: read {new} "
            "(CHANGELOG.md, 0.2.0)")


class EngineRecord(dict):
    """One engine cycle's record (see the fields in ``report.schema.json``, or the reference docs)."""

    __slots__ = ()

    def __missing__(self, key: str) -> Any:
        old = DEPRECATED_KEYS.get(key)
        if old is None:
            raise KeyError(key)
        warnings.warn(deprecation_text(key, old[0]), DeprecationWarning, stacklevel=3)
        return old[1](self)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self or key not in DEPRECATED_KEYS:
            return super().get(key, default)
        return self.__missing__(key)

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name in cycle_fields():
            return None  # a field this record does not carry (a crashed worker's record has fewer)
        raise AttributeError(f"engine record has no field {name!r}; its fields: {', '.join(sorted(self))}")


@cache
def schema() -> dict[str, Any]:
    """The JSON report's schema, shipped in this package."""
    return json.loads(resources.files(__package__).joinpath("report.schema.json").read_text())


@cache
def cycle_fields() -> frozenset[str]:
    return frozenset(schema()["$defs"]["cycle"]["properties"])
