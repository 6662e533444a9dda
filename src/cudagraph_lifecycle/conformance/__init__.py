"""The conformance table: scenarios of the caching allocator's private-pool rules, one expected outcome each.

Every scenario runs the same code on any backend and returns an outcome string; ``sim`` must give the
same string as ``cuda`` on every scenario. On ``cuda`` each scenario runs in a fresh process (the
allocator's assert poisons the process); on ``sim`` each gets a fresh :class:`SimBackend`.

    python -m cudagraph_lifecycle.conformance --backend sim|cuda [--json PATH]

``context`` holds what scenarios share, ``scenarios_*`` the scenarios by subject, ``table`` the table
(name, function, expected outcome, environment), ``runner`` what plays and compares it and the command line.
"""

from __future__ import annotations

from .context import Ctx, N, attempt, classify, mib
from .runner import main, run_isolated, run_one, run_scenario, run_table
from .scenarios_expandable import EXPANDABLE, _carve  # noqa: F401 - _carve: tests build hazards with it
from .table import BY_NAME, SCENARIOS, Scenario

__all__ = [
    "BY_NAME",
    "EXPANDABLE",
    "N",
    "SCENARIOS",
    "Ctx",
    "Scenario",
    "attempt",
    "classify",
    "main",
    "mib",
    "run_isolated",
    "run_one",
    "run_scenario",
    "run_table",
]
