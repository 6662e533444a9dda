"""The plugin's settings: each reachable by CLI, environment and ini, with one precedence rule:
command line > environment variable > ini file > default."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from cudagraph_lifecycle.backends import BACKEND_NAMES

from .worker import START_METHODS


@dataclass(frozen=True)
class Option:
    name: str  # --cudagraph-<name>
    env: str
    ini: str
    default: Any
    help: str
    kind: str = "str"  # str | bool | int | float | path
    choices: tuple = ()


OPTIONS = [
    Option("backend", "CUDAGRAPH_BACKEND", "cudagraph_backend", "auto",
           "allocator backend in workers: auto (cuda with a usable GPU, else sim), cuda, sim", choices=BACKEND_NAMES),
    Option("require-gpu", "CUDAGRAPH_REQUIRE_GPU", "cudagraph_require_gpu", False,
           "stop the session at start (exit code 4) when no usable GPU is visible: for GPU CI gating", kind="bool"),
    Option("start-method", "CUDAGRAPH_START_METHOD", "cudagraph_start_method", "auto",
           "how reused workers start: auto (fork unless this process initialized CUDA, then spawn), "
           "fork, spawn, forkserver", choices=START_METHODS),
    Option("timeout", "CUDAGRAPH_TIMEOUT", "cudagraph_timeout", 300.0,
           "seconds one call into a worker may take before its process group is killed (0: no limit)",
           kind="float"),
    Option("sanitize", "CUDAGRAPH_SANITIZE_MODE", "cudagraph_sanitize", "on",
           "pool sanitizer in reused workers and cudagraph-marked tests: off, on (stale captures raise "
           "StalePoolError; findings reported), strict (findings fail the test)", choices=("off", "on", "strict")),
    Option("worker", "CUDAGRAPH_WORKER_KIND", "cudagraph_worker", "fork",
           "what holds engine sequences: fork (reused worker processes; spawn where CUDA is initialized) or "
           "mpi (reused mpi4py.futures MPIPoolExecutor ranks)", choices=("fork", "mpi")),
    Option("mpi-ranks", "CUDAGRAPH_MPI_RANKS", "cudagraph_mpi_ranks", 2,
           "MPI ranks per pool when --cudagraph-worker=mpi (a marker's ranks= wins)", kind="int"),
    Option("require-mpi", "CUDAGRAPH_REQUIRE_MPI", "cudagraph_require_mpi", False,
           "stop the session at start (exit code 4) when mpi4py or an MPI runtime is missing", kind="bool"),
    Option("report", "CUDAGRAPH_REPORT", "cudagraph_report", None,
           "write a JSON report of every engine cycle and test outcome to this path", kind="path"),
]


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("cudagraph", "CUDA graph lifecycle (pytest-cudagraph)")
    for o in OPTIONS:
        flag = f"--cudagraph-{o.name}"
        dest = "cudagraph_" + o.name.replace("-", "_")
        text = f"{o.help} [env {o.env}, ini {o.ini}; default {o.default}]"
        if o.kind == "bool":
            group.addoption(flag, action="store_true", default=None, dest=dest, help=text)
        else:
            group.addoption(flag, action="store", default=None, dest=dest, metavar=o.name.upper(), help=text)
        parser.addini(o.ini, o.help, default=None)


# kind -> (cast, lowest accepted value, what it must be, an example)
_NUMBERS = {"int": (int, 1, "an integer", 2), "float": (float, 0, "a number of seconds", 120)}


def _convert(o: Option, raw: Any, source: str) -> Any:
    where = {"cli": f"--cudagraph-{o.name}", "env": o.env, "ini": f"ini {o.ini}"}[source]
    if o.kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise pytest.UsageError(f"{where}={raw!r} is not a boolean: use 1/0, true/false, yes/no, on/off")
    if o.kind in _NUMBERS:
        cast, lowest, what, example = _NUMBERS[o.kind]
        try:
            value = cast(raw)
        except (TypeError, ValueError):
            raise pytest.UsageError(f"{where}={raw!r} is not {what}: e.g. {where}={example}") from None
        if value < lowest:
            raise pytest.UsageError(f"{where}={raw!r} is below {lowest} ({'0 means no limit' if lowest == 0 else 'give a positive number'})")
        return value
    value = str(raw)
    if o.choices and value not in o.choices:
        raise pytest.UsageError(f"{where}={value!r} is not one of: {', '.join(o.choices)}")
    return value


def resolve(config: pytest.Config) -> dict[str, Any]:
    """Each setting with the source it came from."""
    out: dict[str, Any] = {}
    for o in OPTIONS:
        key = o.name.replace("-", "_")
        cli = config.getoption("cudagraph_" + key)
        env = os.environ.get(o.env)
        ini = config.getini(o.ini)
        if cli is not None:
            out[key] = _convert(o, cli, "cli")
        elif env not in (None, ""):
            out[key] = _convert(o, env, "env")
        elif ini not in (None, "", []):
            out[key] = _convert(o, ini, "ini")
        else:
            out[key] = o.default
    return out
