"""``python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]``: run a program under the sanitizer."""

from __future__ import annotations

import builtins
import io
import os
import sys
import types
from collections.abc import Callable

from ..errors import BackendUnavailableError, ConfigError
from .env import OFF, install_from_env, print_findings


def main(argv: list[str] | None = None) -> int | str | None:
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
    found: list = []
    status = _run_program(argv[0], lambda: found.extend(print_findings(san)))
    return 1 if found and san.mode == "strict" and status in (0, None) else status


def _run_program(path: str, at_end: Callable[[], None]) -> int | str | None:
    """Run ``path`` as ``python PATH`` does: as module ``__main__``, its folder first on ``sys.path``, an
    uncaught exception shown by ``sys.excepthook`` with the program's frames only; its exit status.
    ``at_end`` runs after that and before the program's module leaves ``sys.modules``, so a finding can name
    a global of ``__main__`` that pins a pool."""
    path = os.path.abspath(path)  # as Python names a script since 3.9
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    saved_main, saved_first = sys.modules["__main__"], sys.path[0]
    sys.modules["__main__"] = module
    sys.path[0] = os.path.dirname(path)
    try:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec")
        exec(code, module.__dict__)
        return 0
    except SystemExit as e:
        return e.code
    except Exception as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # this module's frames
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    finally:
        at_end()
        sys.modules["__main__"] = saved_main
        sys.path[0] = saved_first
