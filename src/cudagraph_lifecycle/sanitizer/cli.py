"""``python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]``: run a program under the sanitizer."""

from __future__ import annotations

import os
import runpy
import sys

from ..errors import BackendUnavailableError, ConfigError
from .env import OFF, install_from_env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]\n"
              "  CUDAGRAPH_SANITIZE=strict makes findings fail the run; CUDAGRAPH_SANITIZE_BACKEND picks the "
              "backend (auto, cuda, sim)", file=sys.stderr)
        return 2 if not argv else 0
    if not os.path.isfile(argv[0]):
        print(f"cudagraph sanitizer: no such program file: {argv[0]}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    value = env.get("CUDAGRAPH_SANITIZE", "").strip()
    if value and value.lower() in OFF:
        print(f"cudagraph sanitizer: CUDAGRAPH_SANITIZE={env['CUDAGRAPH_SANITIZE']!r} turns the sanitizer off, and "
              "this command runs a program under one: unset it (or set it to 1 or strict), or run the program "
              "without the command", file=sys.stderr)
        return 2
    env["CUDAGRAPH_SANITIZE"] = value or "on"
    try:
        san = install_from_env(env)
    except (ConfigError, BackendUnavailableError) as e:
        print(f"cudagraph sanitizer: {e}", file=sys.stderr)
        return 2
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        found = san.findings()
        for f in found:
            engine = f" (made by {f.engine})" if f.engine else ""
            print(f"cudagraph sanitizer: {f.kind}{engine}: {f.message}", file=sys.stderr)
    return 1 if found and san.mode == "strict" else 0
