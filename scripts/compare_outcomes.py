"""Two runs of one test file compared test by test: did a tool loaded into the second (the sanitizer) change
any test's outcome from the first (plain PyTorch)? Reads pytest's JUnit XML of each run.

    python scripts/compare_outcomes.py plain.xml sanitized.xml [--json out.json]

Exit status: 0 when both ran tests and every test has the same outcome in both, 1 otherwise (a test that
differs, or a run that collected nothing or left no XML). The versions' own failures (a test written for a
newer torch) fail alike in both runs and are not differences.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """Test id -> (outcome, first line of its message) for every testcase in a JUnit XML file."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error"}.get(child.tag, "skipped")
                if child.tag == "skipped" and (child.get("type") or "").endswith("xfail"):
                    outcome = "xfailed"
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        found[name] = (outcome, message)
    return found


def compare(plain: dict, tool: dict) -> list[dict]:
    """Every test whose outcome differs, or that only one run has."""
    return [{"test": name, "plain": plain.get(name, ("absent", ""))[0], "with_tool": tool.get(name, ("absent", ""))[0],
             "message": (tool.get(name) or plain.get(name))[1]}
            for name in sorted(set(plain) | set(tool)) if plain.get(name, ("absent",))[0] != tool.get(name, ("absent",))[0]]


def counts(found: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for outcome, _ in found.values():
        out[outcome] = out.get(outcome, 0) + 1
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plain", help="JUnit XML of the run without the tool")
    ap.add_argument("with_tool", help="JUnit XML of the run with the tool")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)
    runs = {}
    for side in ("plain", "with_tool"):
        try:
            runs[side] = outcomes(getattr(args, side))
        except (OSError, ET.ParseError) as e:
            print(f"compare_outcomes: cannot read the {side} run's XML: {e}", file=sys.stderr)
            return 1
    differ = compare(runs["plain"], runs["with_tool"])
    result = {"plain": counts(runs["plain"]), "with_tool": counts(runs["with_tool"]), "differ": differ,
              "tests": {name: {"plain": runs["plain"].get(name, ("absent", ""))[0],
                               "with_tool": runs["with_tool"].get(name, ("absent", ""))[0]}
                        for name in sorted(set(runs["plain"]) | set(runs["with_tool"]))}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"plain: {result['plain']}; with the tool: {result['with_tool']}; {len(differ)} test(s) differ")
    for d in differ:
        print(f"- {d['test']}: {d['plain']} plain, {d['with_tool']} with the tool ({d['message']})")
    empty = [side for side, found in runs.items() if not found]
    if empty:
        print(f"compare_outcomes: no test ran in {', '.join(empty)}", file=sys.stderr)
    return 1 if differ or empty else 0


if __name__ == "__main__":
    sys.exit(main())
