"""The memory picture of a run, one a person reads: a panel per test, named with its id, its engine cycles as
bars (the pools' bytes before release, the bytes the caller's output held, the bytes leaked), each cycle's
verdict written over it, a failed cycle shaded red with FAILED and, under the panel, its first problem and the
line it is about. Failing tests come first; the width is fixed (a test's cycles wrap into more panels), the
height grows with the tests up to ``MAX_PANELS``, and a larger run's passing tests are folded into a line at the
foot that says what was left out.

It is the JSON report's ``meta.timeline_png`` (beside the report), each test's picture in pytest-html's report
(``html_report.py``), and ``python -m pytest_cudagraph.picture REPORT.json OUT.png`` draws it from a saved
``--cudagraph-report``. matplotlib is optional and imported only to draw (never pyplot: drawing must not switch
the backend of a process whose tests use matplotlib): without it there is no picture and no error.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

SLOTS = 8  # cycles side by side in one panel; more wrap into the test's next panel
MAX_PANELS = 24  # a run's picture grows no further; what did not fit is named at its foot
MAX_PANELS_PER_TEST = 4  # a test with more cycles shows its failed ones first
COLUMNS = 2
DPI = 100
WIDTH = {1: 6.5, 2: 12.0}  # inches, by columns
LEFT, RIGHT, GAP = 0.6, 0.15, 0.75  # margins and the gap between columns (y labels sit left of each panel)
TITLE_H, AXES_H, TICKS_H, FOOT_H, ROW_GAP = 0.32, 0.78, 0.2, 0.3, 0.14
ROW_H = TITLE_H + AXES_H + TICKS_H + FOOT_H + ROW_GAP
LEGEND_H, FOLD_H = 0.34, 0.22
POOL, HELD, LEAKED = "#4c78a8", "#f2a541", "#d62728"
FAIL_BG, FAIL_TEXT = "#fbdada", "#b00020"
VERDICT_COLOUR = {"fresh": "#1a7f37", "held": "#4c6e8f", "reused": "#b45f06"}
_PATH = re.compile(r"(?<![\w.\-])(?:[A-Za-z]:)?[\\/](?:[^\s:()\[\]'\"\\/]+[\\/])+([^\s:()\[\]'\"\\/]+)")


@dataclass
class Panel:
    """One panel: some of a test's cycles (all of them, or a part of the ``total``)."""

    nodeid: str
    outcome: str
    test_failed: bool  # the test failed for lifecycle reasons (not: its failed cycles were expected)
    cycles: list[dict]
    total: int = 0  # the test's cycles
    note: str = ""  # cycles of the test left out, on its last panel


@dataclass
class Layout:
    panels: list[Panel]
    columns: int
    header: list[str] = field(default_factory=list)  # the run's counts (empty: a single test's picture)
    folded: list[str] = field(default_factory=list)  # what was left out, in words
    failing_folded: bool = False
    one_file: str | None = None  # every panel's test is in it: the header names it, the panels do not
    shared: dict[str, tuple[int, int]] = field(default_factory=dict)  # test -> _shared's

    @property
    def slots(self) -> int:
        """Cycles a panel has room for: as many as the fullest panel has (at least 4), so few cycles get wide bars."""
        return min(SLOTS, max([4] + [len(p.cycles) for p in self.panels]))

    @property
    def row_heights(self) -> list[float]:
        """Each row of panels, in inches: a row with no failed cycle and no note has no foot."""
        rows = [self.panels[i:i + self.columns] for i in range(0, len(self.panels), self.columns)]
        return [ROW_H - (0 if any(_foot_lines(p, 1) for p in row) else FOOT_H) for row in rows]

    @property
    def legend_h(self) -> float:
        return LEGEND_H if self.columns > 1 else LEGEND_H + 0.17  # in two rows

    @property
    def size(self) -> tuple[float, float]:
        """Width and height in inches: the width by the columns alone, the height by the rows."""
        head = 0.07 + 0.21 * len(self.header) + 0.12 if self.header else 0.0
        return WIDTH[self.columns], round(head + self.legend_h + sum(self.row_heights) + len(self.folded) * FOLD_H + 0.1, 2)


def size_label(n: int) -> str:
    """Bytes for a label: 0, 512 B, 2 MiB, 1.5 MiB, 34 MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B" if n else "0"


def first_problem(c: dict) -> dict | None:
    """The problem a cycle's error leads with: a failing one first (as ``assertions.check_record`` orders them)."""
    from cudagraph_lifecycle.record import failing_kinds  # plain Python: no torch

    failing = failing_kinds(bool(c.get("strict")))
    problems = sorted(c.get("problems") or [], key=lambda p: p.get("kind") not in failing)
    return problems[0] if problems else None


def headline(p: dict) -> str:
    """A problem's first line, with only the file names of the paths in it (the site says where)."""
    text = str(p.get("message") or "").strip()
    return _PATH.sub(r"\1", text.splitlines()[0] if text else str(p.get("kind", "")))


def short_site(site: str) -> str:
    return _PATH.sub(r"\1", site)


def short_name(nodeid: str, width: int, file: bool = True, shared: tuple[int, int] = (0, 0)) -> str:
    """A test id in ``width`` characters: its file's name (not its folders; none unless ``file``) and the test's
    name. Where it must be cut, what it shares with other tests (``shared``: characters at its start and its
    end) goes first, then its file's name, so what tells it apart stays; else it is cut in its middle (its start
    says what the test is, its end holds the parameters)."""
    path, sep, test = nodeid.partition("::")
    if not sep:
        path, test = "", nodeid
    head = path.replace("\\", "/").rsplit("/", 1)[-1] + sep if file else ""
    if len(head + test) <= width:
        return head + test
    lo, hi = min(shared[0], len(test)), max(0, len(test) - shared[1])  # what differs: test[lo:hi]
    if lo >= hi:  # it differs from one neighbour at its start and from another at its end: keep both places
        lo, hi = max(0, hi - 1), min(len(test), lo + 1)
    while lo > 0 and test[lo - 1].isalnum():  # whole words ("[on]", not "n]"), with the mark before them
        lo -= 1
    lo = max(0, lo - 1)
    while hi < len(test) and test[hi].isalnum():
        hi += 1
    pre, mid, post = test[:lo], test[lo:hi], test[hi:]
    for h in (head, ""):
        rest = width - len(h) - len(mid)
        if (pre or post) and rest >= min(len(pre), 8) + min(len(post), 8):
            a = min(len(pre), max(rest // 2, rest - len(post)))
            b = min(len(post), rest - a)
            return (h + (pre if len(pre) <= a else pre[:a - 1] + "…") + mid
                    + (post if len(post) <= b else "…" + post[len(post) - b + 1:]))
    room = width - len(head) - 1
    if room < 12:
        return "…" + (head + test)[-(width - 1):]
    keep = room * 2 // 5
    return head + test[:keep] + "…" + test[len(test) - (room - keep):]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _failed(t: dict) -> bool:
    return any(c.get("failed") for c in t.get("cycles") or [])


def _test_failed(t: dict) -> bool:
    if "lifecycle_failure" in t:
        return bool(t["lifecycle_failure"])
    return t.get("outcome") in ("failed", "error") and (_failed(t) or bool(t.get("strict_failure")))


def _rank(t: dict) -> int:
    """Which tests a reader looks for first: failed for lifecycle reasons, with failed cycles (expected or
    caught), failed otherwise, clean."""
    return 0 if _test_failed(t) else 1 if _failed(t) else 2 if t.get("outcome") in ("failed", "error") else 3


def _panels(t: dict) -> list[Panel]:
    cycles = list(t.get("cycles") or [])
    cap = SLOTS * MAX_PANELS_PER_TEST
    note = ""
    if len(cycles) > cap:  # the failed ones first, then the rest in order; drawn in order
        keep = sorted(sorted(range(len(cycles)), key=lambda i: not cycles[i].get("failed"))[:cap])
        kept = set(keep)
        left = [c for i, c in enumerate(cycles) if i not in kept]
        bad = sum(1 for c in left if c.get("failed"))
        note = f"{len(left)} more cycles not drawn, " + (f"{bad} of them failed" if bad else "none failed")
        cycles = [cycles[i] for i in keep]
    out = [Panel(t["nodeid"], t.get("outcome", "?"), _test_failed(t), cycles[i:i + SLOTS], len(t["cycles"]))
           for i in range(0, len(cycles), SLOTS)]
    out[-1].note = note
    return out


def _shared(nodeids: list[str]) -> dict[str, tuple[int, int]]:
    """Each test -> how many characters its name shares at its start with another test's, and at its end: what
    a cut may take (the name's neighbours in sorted order share the most)."""
    names = {n: n.partition("::")[2] or n for n in nodeids}
    out = {n: [0, 0] for n in names}
    for side, key in ((0, lambda n: names[n]), (1, lambda n: names[n][::-1])):
        ordered = sorted(names, key=key)
        for a, b in zip(ordered, ordered[1:]):
            common = len(os.path.commonprefix([key(a), key(b)]))
            out[a][side], out[b][side] = max(out[a][side], common), max(out[b][side], common)
    return {n: (start, end) for n, (start, end) in out.items()}


def _counts(cycles: list[dict]) -> str:
    """Cycles by verdict, the most first (ties in the verdicts' order)."""
    from cudagraph_lifecycle.record import VERDICTS  # plain Python: no torch

    by: dict[str, int] = {}
    for c in cycles:
        by[c.get("verdict", "?")] = by.get(c.get("verdict", "?"), 0) + 1
    order = {v: i for i, v in enumerate(VERDICTS)}
    return ", ".join(f"{n} {v}" for v, n in sorted(by.items(), key=lambda kv: (-kv[1], order.get(kv[0], 99))))


def layout(tests: list[dict], columns: int = COLUMNS, max_panels: int = MAX_PANELS, summary: bool = True) -> Layout:
    """Which tests get panels, in which order, and what is folded: everything where it fits; else the tests
    that failed or have failed cycles (failing first) up to ``max_panels``, the clean ones folded."""
    drawn = [t for t in tests if t.get("cycles")]
    order = sorted(range(len(drawn)), key=lambda i: (_rank(drawn[i]), i))
    panels = {i: _panels(drawn[i]) for i in order}
    fits = sum(len(p) for p in panels.values()) <= max_panels
    plan = Layout([], columns)
    left_clean, left_failing = [], []
    for i in order:
        t = drawn[i]
        if (fits or _rank(t) < 3) and len(plan.panels) + len(panels[i]) <= max_panels:
            plan.panels += panels[i]
        else:
            (left_clean if _rank(t) == 3 else left_failing).append(t)
    plan.shared = _shared([t["nodeid"] for t in drawn])
    if left_failing:
        names = ", ".join(short_name(t["nodeid"], 48, True, plan.shared[t["nodeid"]]) for t in left_failing[:3])
        plan.folded.append(f"and {len(left_failing)} more test(s) with failed cycles, not drawn (the JSON report has "
                           f"every cycle): {names}" + (", …" if len(left_failing) > 3 else ""))
        plan.failing_folded = True
    if left_clean:
        cycles = [c for t in left_clean for c in t["cycles"]]
        plan.folded.append(f"and {len(left_clean)} more test(s) not drawn, none with a failed cycle: "
                           f"{len(cycles)} cycles, {_counts(cycles)}")
    if summary:
        files = {p.nodeid.partition("::")[0] for p in plan.panels if "::" in p.nodeid}
        plan.one_file = files.pop() if len(files) == 1 and all("::" in p.nodeid for p in plan.panels) else None
        every = [c for t in tests for c in t.get("cycles") or []]
        bad = [t for t in drawn if _failed(t)]
        failed = sum(1 for c in every if c.get("failed"))
        lifecycle = sum(1 for t in tests if _test_failed(t))
        plan.header = [
            f"cudagraph lifecycle: {len(tests)} tests, {len(every)} engine cycles ({_counts(every)})",
            f"{failed} failed cycle(s) in {len(bad)} test(s); {lifecycle} test(s) failed for lifecycle reasons"
            + (" (the others expected or caught their failed cycles)" if bad and lifecycle < len(bad) else "")]
        notes = ([f"{len(tests) - len(drawn)} test(s) ran no engine"] if len(drawn) < len(tests) else []) + (
            [f"every panel is a test of {plan.one_file}"] if plan.one_file else [])
        if notes:
            plan.header.append("; ".join(notes))
    return plan


def _matplotlib() -> tuple[Any, Any] | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def render(tests: list[dict], out: Any, columns: int = COLUMNS, max_panels: int = MAX_PANELS,
           summary: bool = True) -> Layout | None:
    """Draw ``tests`` (the JSON report's ``tests``) as a PNG into ``out`` (a path or a binary file); the
    layout drawn, or None where nothing was (no engine cycles, or no matplotlib)."""
    plan = layout(tests, columns, max_panels, summary)
    mpl = _matplotlib() if plan.panels else None
    if mpl is None:
        return None
    figure_cls, canvas_cls = mpl
    fig = figure_cls(figsize=plan.size, dpi=DPI)
    canvas_cls(fig)
    _draw(fig, plan)
    fig.savefig(out, dpi=DPI, format="png")
    return plan


def png_bytes(tests: list[dict], **kwargs: Any) -> bytes | None:
    buf = io.BytesIO()
    return buf.getvalue() if render(tests, buf, **kwargs) else None


def _draw(fig: Any, plan: Layout) -> None:
    from matplotlib.patches import Patch

    width, height = plan.size
    renderer = fig.canvas.get_renderer()
    room = (width - LEFT - RIGHT) * DPI
    top = height - 0.12  # inches from the bottom, going down
    for k, line in enumerate(plan.header):  # the counts; the failures' line red where any failed
        red = k == 1 and not line.startswith("0 failed")
        text = fig.text(LEFT / width, top / height, line, va="top", fontsize=11 if k == 0 else 9,
                        weight="bold" if k == 0 else "normal",
                        color=FAIL_TEXT if red else "black" if k < 2 else "#555555")
        _fit(text, lambda n, line=line: _cut(line, n), len(line), room, renderer)
        top -= 0.28 if k == 0 else 0.21
    top -= 0.12 if plan.header else 0
    handles = [Patch(color=POOL), Patch(color=HELD), Patch(color=LEAKED), Patch(color=FAIL_BG)]
    labels = ["graph pool bytes before release", "held by the caller's output", "leaked (still pinned)",
              "a failed cycle"]
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(LEFT / width - 0.01, top / height),
               ncol=2 * plan.columns, frameon=False, fontsize=8, handlelength=1.2, columnspacing=1.2, borderaxespad=0)
    top -= plan.legend_h
    col_w = (width - LEFT - RIGHT - GAP * (plan.columns - 1)) / plan.columns
    for row, row_h in enumerate(plan.row_heights):
        for col, panel in enumerate(plan.panels[row * plan.columns:(row + 1) * plan.columns]):
            x = LEFT + col * (col_w + GAP)
            y = top - TITLE_H - AXES_H  # the axes' bottom
            ax = fig.add_axes((x / width, y / height, col_w / width, AXES_H / height))
            _panel(ax, panel, plan, col_w * DPI, renderer)
            for k, (line, red) in enumerate(_foot_lines(panel, col_w * 72 / (7 * 0.56))):
                fig.text(x / width, (y - TICKS_H - k * 0.14) / height, line, fontsize=7, va="top",
                         color=FAIL_TEXT if red else "#333333")
        top -= row_h
    for line in plan.folded:
        text = fig.text(LEFT / width, top / height, line, fontsize=9, va="top", style="italic",
                        color=FAIL_TEXT if plan.failing_folded and "failed cycles, not drawn" in line else "#444444")
        _fit(text, lambda n, line=line: _cut(line, n), len(line), room, renderer)
        top -= FOLD_H


def _fit(text: Any, make: Any, chars: int, room_px: float, renderer: Any) -> None:
    """Shorten ``text`` (``make(chars)`` gives it in at most ``chars`` characters) until it fits ``room_px``."""
    while chars > 8 and text.get_window_extent(renderer).width > room_px:
        chars -= 2
        text.set_text(make(chars))


def _panel(ax: Any, panel: Panel, plan: Layout, width_px: float, renderer: Any) -> None:
    from matplotlib.transforms import blended_transform_factory

    tops = [max(c.get("pool_bytes", 0), c.get("held_bytes", 0), c.get("leaked_bytes", 0)) for c in panel.cycles]
    top = max(tops + [1])
    over = blended_transform_factory(ax.transData, ax.transAxes)
    for s, c in enumerate(panel.cycles):
        failed = bool(c.get("failed"))
        if failed:
            ax.axvspan(s - 0.48, s + 0.48, color=FAIL_BG, zorder=0, lw=0)
        ax.bar([s - 0.26, s, s + 0.26], [c.get("pool_bytes", 0), c.get("held_bytes", 0), c.get("leaked_bytes", 0)],
               width=0.24, color=[POOL, HELD, LEAKED], zorder=2)
        verdict = c.get("verdict", "?")
        ax.text(s, 0.96, verdict, transform=over, ha="center", va="top", fontsize=8,
                weight="bold" if failed else "normal", color=FAIL_TEXT if failed else VERDICT_COLOUR.get(verdict, "#333"))
        if failed:
            ax.text(s, 0.76, "FAILED", transform=over, ha="center", va="top", fontsize=7, weight="bold", color=FAIL_TEXT)
    ax.set_xlim(-0.5, plan.slots - 0.5)
    ax.set_ylim(0, top / 0.6)  # the top 40 % holds the verdicts
    ax.set_yticks([0, top], ["0", size_label(top)] if top > 1 else ["0", ""], fontsize=7)
    ax.set_xticks(range(len(panel.cycles)),
                  [f"#{c.get('index', '?')}" + (f" r{c['rank']}" if c.get("rank") is not None else "")
                   for c in panel.cycles], fontsize=7)
    ax.tick_params(length=2, pad=2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    red = FAIL_TEXT if panel.test_failed else None
    if red:
        for side in ("left", "bottom"):
            ax.spines[side].set_color(red)
            ax.spines[side].set_linewidth(1.6)
    status = {"failed": "TEST FAILED", "error": "TEST ERROR"}.get(panel.outcome, panel.outcome)
    if panel.total > len(panel.cycles):
        first, last = panel.cycles[0].get("index", "?"), panel.cycles[-1].get("index", "?")
        status = f"#{first}–#{last} of {panel.total} cycles · {status}"
    right = ax.set_title(status, loc="right", fontsize=8, pad=4, weight="bold" if red else "normal",
                         color=red or "#555555")
    room = width_px - right.get_window_extent(renderer).width - 12
    def name(n: int) -> str:
        return short_name(panel.nodeid, n, not plan.one_file, plan.shared.get(panel.nodeid, (0, 0)))

    left = ax.set_title(name(400), loc="left", fontsize=8.5, weight="bold", pad=4, color=red or "black")
    _fit(left, name, len(left.get_text()), room, renderer)


def _foot_lines(panel: Panel, chars: float) -> list[tuple[str, bool]]:
    """Under a panel: its first failed cycle's first problem and the line it is about (else a note), and
    whether each line is the failure's."""
    chars = int(chars)
    failed = [c for c in panel.cycles if c.get("failed")]
    if not failed:
        return [(_cut(panel.note, chars), False)] if panel.note else []
    c, p = failed[0], first_problem(failed[0])
    what = f"#{c.get('index', '?')} {p.get('kind', '?')}: {headline(p)}" if p else f"#{c.get('index', '?')} failed"
    site = short_site((p.get("sites") or [""])[0]) if p else ""
    more = f"{len(failed) - 1} more failed cycle(s) in this panel" if len(failed) > 1 else ""
    rest = "; ".join(s for s in (f"at {site}" if site else "", more, panel.note) if s)
    return [(_cut(what, chars), True)] + ([(_cut(rest, chars), False)] if rest else [])


def from_report(report_path: str, out: str, max_panels: int = MAX_PANELS) -> Layout | None:
    """The picture of a saved ``--cudagraph-report`` (its ``tests``)."""
    with open(report_path) as f:
        data = json.load(f)
    tests = data.get("tests") if isinstance(data, dict) else None
    if not isinstance(tests, list):
        raise ValueError(f"{report_path} is not a --cudagraph-report file: it has no list of tests")
    return render(tests, out, max_panels=max_panels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_cudagraph.picture",
                                     description="Draw the memory picture of a --cudagraph-report JSON file.")
    parser.add_argument("report", help="the JSON report (--cudagraph-report)")
    parser.add_argument("png", help="the PNG to write")
    parser.add_argument("--max-panels", type=int, default=MAX_PANELS,
                        help=f"panels at most; passing tests beyond are folded (default {MAX_PANELS})")
    args = parser.parse_args(argv)
    if _matplotlib() is None:
        print("the picture needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        plan = from_report(args.report, args.png, max(1, args.max_panels))
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 2
    if plan is None:
        print(f"{args.report} has no engine cycles: nothing to draw", file=sys.stderr)
        return 1
    w, h = plan.size
    print(f"{args.png}: {round(w * DPI)} x {round(h * DPI)} px, {len(plan.panels)} panel(s)"
          + "".join(f"; {line}" for line in plan.folded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
