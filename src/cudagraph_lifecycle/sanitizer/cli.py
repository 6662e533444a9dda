"""``python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]`` (or ``-m MODULE [ARGS...]``): run a program
under the sanitizer."""

from __future__ import annotations

import builtins
import functools
import importlib.machinery
import io
import os
import runpy
import sys
import threading
import types
import zipfile
from collections.abc import Callable

from ..choices import checked_from_env
from ..errors import BackendUnavailableError, ConfigError
from .env import OFF, findings_taken, install_from_env, print_findings


def main(argv: list[str] | None = None) -> int | str | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]\n"
              "       python -m cudagraph_lifecycle.sanitizer -m MODULE [ARGS...]\n"
              "  CUDAGRAPH_SANITIZE=strict makes findings fail the run; CUDAGRAPH_SANITIZE_BACKEND picks the "
              "backend (auto, cuda, sim)", file=sys.stderr)
        return 2 if not argv else 0
    module = argv[1] if argv[0] == "-m" and len(argv) > 1 else None
    if module is None and argv[0].startswith("-"):
        what = "-m needs a module name" if argv[0] == "-m" else f"{argv[0]} is not an option of this command"
        print(f"cudagraph sanitizer: {what}: give the program's file (PROGRAM.py [ARGS...]) or a module to run as "
              "`python -m` does (-m MODULE [ARGS...])", file=sys.stderr)
        return 2
    if module is None and not os.path.isfile(argv[0]):
        print(f"cudagraph sanitizer: no such program file: {argv[0]}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    value = env.get("CUDAGRAPH_SANITIZE", "").strip()
    if value and value.lower() in OFF:
        print(f"cudagraph sanitizer: CUDAGRAPH_SANITIZE={env['CUDAGRAPH_SANITIZE']!r} turns the sanitizer off, and "
              "this command runs a program under one: unset it (or set it to 1 or strict), or run the program "
              "without the command", file=sys.stderr)
        return 2
    mode_option = env.get("CUDAGRAPH_SANITIZE_MODE", "").strip()
    if not value and mode_option and mode_option.lower() != "on":  # the plugin's option, not this command's
        print(f"cudagraph sanitizer: CUDAGRAPH_SANITIZE_MODE={env['CUDAGRAPH_SANITIZE_MODE']!r} is the pytest "
              "plugin's option for its engine cycles, and this command does not read it: set CUDAGRAPH_SANITIZE "
              f"instead (e.g. CUDAGRAPH_SANITIZE={mode_option.lower() if mode_option.lower() == 'strict' else 'on'})",
              file=sys.stderr)
        return 2
    env["CUDAGRAPH_SANITIZE"] = value or "on"
    try:
        checked_from_env(env)  # read by every runner the program builds: a bad value stops it here
        san = install_from_env(env)
    except (ConfigError, BackendUnavailableError) as e:
        print(f"cudagraph sanitizer: {e}", file=sys.stderr)
        return 2
    sys.argv = argv[1:] if module else argv  # (runpy sets a module's argv[0] to its file, as `python -m`)
    found: list = []
    findings_taken()  # printed here: an exit report of the package's import would print them again
    run = functools.partial(_execute_module, module) if module else functools.partial(_execute, argv[0])
    status = _run_program(run, lambda: found.extend(print_findings(san)))
    return 1 if found and san.mode == "strict" and status in (0, None) else status


def _run_program(run: Callable[[], int | str | None], at_end: Callable[[], None]) -> int | str | None:
    """Run the program (``run``: as ``python PATH`` or ``python -m MODULE`` does) and return its exit status;
    then, its non-daemon threads done,
    ``at_end`` runs while the program's module is still ``__main__`` (a finding can name a global of it that
    pins a pool). On Ctrl-C ``at_end`` runs too, and the interrupt goes on."""
    try:
        status = run()
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
        if not getattr(sys.flags, "safe_path", False):  # (Python 3.11's -P; 3.10 has none)
            sys.path[0] = os.path.dirname(path)  # where `-m` put the working folder
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)  # not this module's __future__
        exec(code, module.__dict__)
        return 0
    except SystemExit as e:
        return e.code
    except Exception as e:
        return _uncaught(e)


def _execute_module(name: str) -> int | str | None:
    """A module as ``python -m NAME`` runs it: found on ``sys.path``, run as ``__main__``, which it stays
    (runpy's own entry for ``-m``; its errors, such as no module of that name, as Python words them)."""
    main = types.ModuleType("__main__")  # its own namespace, not this command's __main__'s
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        runpy._run_module_as_main(name)
        return 0
    except SystemExit as e:
        return e.code
    except Exception as e:
        return _uncaught(e)


def _uncaught(e: BaseException) -> int:
    """Shown by ``sys.excepthook`` with the program's frames only (not this module's), as Python would."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    return 1
