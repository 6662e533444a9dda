"""``CUDAGRAPH_SANITIZE=1|on|strict``: one sanitizer for the whole program, installed at import."""

from __future__ import annotations

import atexit
import os
import sys
from typing import TextIO

from ..backends import get_backend
from ..choices import EXPANDABLE_TEARDOWN, SANITIZE_ENV_OFF
from ..errors import BackendUnavailableError, ConfigError
from .pool_sanitizer import PoolSanitizer

_global: PoolSanitizer | None = None
_exit_report = False  # whether the package's import asked for a report at the process's exit
_taken = False  # a reporter (the pytest plugin) took the findings: nothing is printed at exit
OFF = SANITIZE_ENV_OFF
_ON = ("1", "on", "true", "yes")


def install_from_env(environ: dict[str, str] | None = None, *, report_at_exit: bool = False) -> PoolSanitizer | None:
    """Install a process-wide sanitizer when ``CUDAGRAPH_SANITIZE`` is ``1``/``on``/``strict``, on the
    process's backend of kind ``CUDAGRAPH_SANITIZE_BACKEND`` (default ``auto``); under expandable segments
    it refuses a hazardous teardown unless ``CUDAGRAPH_EXPANDABLE_TEARDOWN=report``. With
    ``report_at_exit`` (the package's import) its findings are printed when the process exits, and under
    ``strict`` they make the exit status 1, unless a reporter took them (:func:`findings_taken`)."""
    global _global, _exit_report
    env = os.environ if environ is None else environ
    value = env.get("CUDAGRAPH_SANITIZE", "").strip().lower()
    if value in OFF:
        return None
    if value not in _ON and value != "strict":
        raise ConfigError(
            f"CUDAGRAPH_SANITIZE={env.get('CUDAGRAPH_SANITIZE')!r} is not a sanitizer mode: "
            "set it to 1 (or on), strict, or 0 (off)")
    mode = "strict" if value == "strict" else "on"
    teardown = env.get("CUDAGRAPH_EXPANDABLE_TEARDOWN", "").strip().lower() or "refuse"
    if teardown not in EXPANDABLE_TEARDOWN:
        raise ConfigError(
            f"CUDAGRAPH_EXPANDABLE_TEARDOWN={env.get('CUDAGRAPH_EXPANDABLE_TEARDOWN')!r}: set it to refuse (the "
            "default: a pool torn down with live blocks under expandable segments is not reset) or report")
    kind = env.get("CUDAGRAPH_SANITIZE_BACKEND", "auto").strip().lower() or "auto"
    try:
        backend = get_backend(kind)
    except ConfigError as e:
        raise ConfigError(f"CUDAGRAPH_SANITIZE_BACKEND={kind!r}: {e}") from None
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"CUDAGRAPH_SANITIZE_BACKEND={kind!r}: {e}") from None
    if _global is None or not _global.active:
        _global = PoolSanitizer(backend, mode=mode, expandable_teardown=teardown).start()
    if report_at_exit and not _exit_report:
        _exit_report = True
        atexit.register(_report_at_exit)
    return _global


def global_sanitizer() -> PoolSanitizer | None:
    return _global if _global is not None and _global.active else None


def findings_taken() -> None:
    """A reporter (the pytest plugin, under its tests) took the program-wide sanitizer's findings: the
    process's exit prints nothing."""
    global _taken
    _taken = True


# where an MPI launcher (Open MPI, MPICH/Hydra, PMIx) puts the process's rank
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def _who() -> str:
    rank = next((os.environ[v] for v in _RANK_VARIABLES if os.environ.get(v)), None)
    return "cudagraph sanitizer" if rank is None else f"cudagraph sanitizer (rank {rank})"


def print_findings(san: PoolSanitizer, file: TextIO | None = None) -> list:
    """One line per finding, as the sanitizer command and the exit report print them (an MPI rank's lines
    say which rank: the ranks share one terminal); the findings."""
    found = san.findings()
    who = _who()
    for f in found:
        engine = f" (made by {f.engine})" if f.engine else ""
        print(f"{who}: {f.kind}{engine}: {f.message}", file=file or sys.stderr)
    return found


def _report_at_exit() -> None:
    # A forked child forgot the parent's sanitizer; the plugin reads its workers' (fixtures.py, engine records).
    san = global_sanitizer()
    if san is None or _taken or os.environ.get("CUDAGRAPH_IN_WORKER"):
        return
    found = print_findings(san)
    if found and san.mode == "strict":
        print(f"{_who()}: CUDAGRAPH_SANITIZE=strict and {len(found)} finding(s): exit status 1",
              file=sys.stderr)
        if os.environ.get("PYTEST_XDIST_WORKER"):  # its status does not reach the run's
            print(f"{_who()}: pytest-xdist worker {os.environ['PYTEST_XDIST_WORKER']}: its exit status does not "
                  "fail the run; load the plugin (-p cudagraph) for that", file=sys.stderr)
        try:
            _flush_open_files()
        finally:  # whatever the flush met (warnings turned into errors): the status is 1
            # Python's exit status cannot be changed from an exit handler; handlers registered before this
            # one (before the package's import) do not run, as with a C sanitizer's exit code.
            os._exit(1)


def _flush_open_files() -> None:
    """What the interpreter's shutdown would have written: files the program left open (os._exit skips the
    shutdown that flushes them), stdout and stderr last."""
    import gc
    import io

    files = (io.BufferedIOBase, io.TextIOBase)
    for f in gc.get_objects():
        # type(), not isinstance(): an object's own __class__ may run code (torch's deprecated names warn)
        if issubclass(type(f), files) and f is not sys.stdout and f is not sys.stderr:
            try:
                if not f.closed and f.writable():
                    f.flush()
            except Exception:  # a broken pipe, a detached buffer: nothing more to save there
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _forget_after_fork() -> None:
    # A forked child starts unobserved (the observation layer and its judges reset at fork): the parent's
    # sanitizer watches nothing here, and must not stop the child's install_from_env from installing one.
    global _global
    _global = None


os.register_at_fork(after_in_child=_forget_after_fork)
