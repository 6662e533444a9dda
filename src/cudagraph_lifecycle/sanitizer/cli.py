"""``python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]``: run a program under the sanitizer."""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import sys
import threading
import types
import zipfile
from collections.abc import Callable

from ..errors import BackendUnavailableError, ConfigError
from .env import OFF, findings_taken, install_from_env, print_findings


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
    findings_taken()  # printed here: an exit report of the package's import would print them again
    status = _run_program(argv[0], lambda: found.extend(print_findings(san)))
    return 1 if found and san.mode == "strict" and status in (0, None) else status


def _run_program(path: str, at_end: Callable[[], None]) -> int | str | None:
    """Run ``path`` as ``python PATH`` does and return its exit status; then, its non-daemon threads done,
    ``at_end`` runs while the program's module is still ``__main__`` (a finding can name a global of it that
    pins a pool). On Ctrl-C ``at_end`` runs too, and the interrupt goes on."""
    try:
        status = _execute(path)
        for t in threading.enumerate():  # as the interpreter waits before it exits
            if t is not threading.main_thread() and not t.daemon:
                t.join()
    finally:
        at_end()
    return status


def _execute(path: str) -> int | str | None:
    """A script as module ``__main__`` (its folder first on ``sys.path`` unless ``-P``), a zip application
    through ``runpy``; an uncaught exception shown by ``sys.excepthook`` with the program's frames only."""
    try:
        if zipfile.is_zipfile(path):
            runpy.run_path(path, run_name="__main__")
            return 0
        path = os.path.abspath(path)  # as Python names a script since 3.9
        module = types.ModuleType("__main__")
        module.__file__ = path
        module.__builtins__ = builtins
        module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        sys.modules["__main__"] = module
        if not sys.flags.safe_path:
            sys.path[0] = os.path.dirname(path)  # where `-m` put the working folder
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)  # not this module's __future__
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
