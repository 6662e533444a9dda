"""pytest-html's report: each test's engine cycles in its row (verdict, pools, held and leaked bytes, a failed
cycle's first problem and line), and under it a table of them and the test's memory picture (picture.py).

plugin.py imports this module and registers its ``HtmlCycles`` only where pytest-html's ``html`` plugin is
loaded and ``--html`` asks for a report (as pytest-xdist registers its own hooks), so a session without
pytest-html imports nothing of it: its hooks are pytest-html's, unknown to pytest without it.
"""

from __future__ import annotations

import base64
import json
import os
from html import escape
from typing import Any

import pytest
from pytest_html import extras

from . import picture
from .report import CYCLES

SHOWN = pytest.StashKey[str]()  # the cycles a test's report already carries as extras
FAILED_STYLE = "color:#b00020;font-weight:bold"
PROBLEM_STYLE = "color:#b00020;margin-left:1em"


def cycles_of(report: Any) -> list[dict]:
    """The engine cycles a test published (its ``cudagraph_cycles`` property); none for other reports."""
    for name, value in reversed(list(getattr(report, "user_properties", None) or ())):
        if name == CYCLES:
            return json.loads(value)
    return []


def _engine(c: dict) -> str:
    return f"#{c.get('index', '?')}" + (f" rank {c['rank']}" if c.get("rank") is not None else "")


def _pools(c: dict) -> str:
    return ", ".join(f"{p[1][0]}:{p[1][1]}" + (f"@{p[0]}" if p[0] else "") for p in c.get("pool_ids") or []) or "-"


def _problem(c: dict, rootdir: str = "") -> tuple[str, str]:
    """A cycle's first problem as (``kind: its headline``, the line it is about), empty where it has none."""
    p = picture.first_problem(c)
    if p is None:
        return "", ""
    text = str(p.get("message") or "").strip()
    site = (p.get("sites") or [""])[0]
    if rootdir and site.startswith(rootdir + os.sep):  # repository-relative, as an annotation shows it
        site = site[len(rootdir) + 1:]
    return f"{p.get('kind', '?')}: {text.splitlines()[0] if text else ''}", site


def row_cell(cycles: list[dict], rootdir: str = "") -> str:
    """The test's row: a line per cycle, and under a failed one its first problem and line."""
    lines = []
    for c in cycles:
        verdict = c.get("verdict", "?") + (" FAILED" if c.get("failed") else "")
        text = (f"{_engine(c)} {verdict} · pools {_pools(c)} · held {picture.size_label(c.get('held_bytes', 0))}"
                f" · leaked {picture.size_label(c.get('leaked_bytes', 0))}")
        style = f' style="{FAILED_STYLE}"' if c.get("failed") else ""
        lines.append(f"<div{style}>{escape(text)}</div>")
        what, site = _problem(c, rootdir) if c.get("failed") else ("", "")
        if what:
            where = f" (at {site})" if site else ""
            what = what if len(what) <= 160 else what[:159] + "…"  # whole in the table under the row
            lines.append(f'<div style="{PROBLEM_STYLE}">{escape(what + where)}</div>')
    return f'<td class="col-cudagraph">{"".join(lines)}</td>'


def cycles_table(cycles: list[dict], rootdir: str = "") -> str:
    """Every cycle of the test, with its first problem whole (its first line) and where."""
    head = ("engine", "verdict", "pools", "pool bytes", "held", "leaked", "first problem", "at")
    rows = []
    for c in cycles:
        what, site = _problem(c, rootdir)
        cells = (_engine(c), c.get("verdict", "?") + (" FAILED" if c.get("failed") else ""), _pools(c),
                 picture.size_label(c.get("pool_bytes", 0)), picture.size_label(c.get("held_bytes", 0)),
                 picture.size_label(c.get("leaked_bytes", 0)), what, site)
        style = f' style="{FAILED_STYLE}"' if c.get("failed") else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{escape(str(x))}</td>" for x in cells) + "</tr>")
    return ('<table class="cudagraph-cycles"><caption>cudagraph engine cycles</caption><tr>'
            + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")


def _outcome(rep: pytest.TestReport) -> str:
    if hasattr(rep, "wasxfail"):
        return "xfailed" if rep.skipped else "xpassed"
    return rep.outcome


class HtmlCycles:
    """pytest-html's hooks, for one session (its rootdir makes the lines repository-relative)."""

    def __init__(self, config: pytest.Config):
        self.rootdir = str(config.rootpath)

    def pytest_html_results_table_header(self, cells: list) -> None:
        cells.append("<th>cudagraph cycles</th>")

    def pytest_html_results_table_row(self, report: Any, cells: list) -> None:
        cells.append(row_cell(cycles_of(report), self.rootdir))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any):
        """The test's cycles table and picture, on its call's report (or a failed setup's or teardown's, where
        the call did not show them): pytest-html shows a test's extras under its row."""
        outcome = yield
        rep = outcome.get_result()
        published = next((v for n, v in reversed(rep.user_properties) if n == CYCLES), None)
        if published is None or item.stash.get(SHOWN, None) == published or (rep.when != "call" and not rep.failed):
            return
        item.stash[SHOWN] = published
        cycles = json.loads(published)
        found = [extras.html(cycles_table(cycles, self.rootdir))]
        png = picture.png_bytes([{"nodeid": item.nodeid, "outcome": _outcome(rep), "cycles": cycles}], columns=1,
                                summary=False)
        if png:
            found.append(extras.png(base64.b64encode(png).decode("ascii"), name="cudagraph: memory per engine cycle"))
        rep.extras = list(getattr(rep, "extras", None) or []) + found
