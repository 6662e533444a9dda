"""The plugin's settings: each reachable by CLI, environment and ini, with one precedence rule:
command line > environment variable > ini file > default. A bad value is a usage error that names what the
user set (the option, the variable or the ini key) and how to fix it.

Importing this module does not import torch: the backend a session runs on is resolved when something
needs it (:func:`effective_backend`).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from cudagraph_lifecycle.choices import BACKEND_NAMES, EXPANDABLE_TEARDOWN, SANITIZE_MODES
from cudagraph_lifecycle.sizes import SIZE_HELP, NegativeSizeError, parse_size

from .gpu import visible_gpu_count
from .worker import START_METHODS

SETTINGS_KEY = pytest.StashKey[dict]()  # the resolved settings of the session
STATE_KEY = pytest.StashKey[dict]()  # what the session recorded: tests, their cycles and findings
CALL_FAILED = pytest.StashKey[bool]()  # on an item: its call phase failed (read at its teardown)


@dataclass(frozen=True)
class Option:
    name: str  # --cudagraph-<name>
    env: str
    ini: str
    default: Any
    help: str
    kind: str = "str"  # str | bool | int | float | bytes | path
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
           "StalePoolError; findings reported), strict (findings, reused pools and pool_ids() mismatches fail "
           "the test)", choices=SANITIZE_MODES),
    Option("expandable-teardown", "CUDAGRAPH_EXPANDABLE_TEARDOWN", "cudagraph_expandable_teardown", "refuse",
           "under expandable_segments:True, a reset that tears down a pool while blocks of it live (freeing them "
           "later crashed torch 2.11): refuse (not done, ExpandableSegmentsHazardError) or report (a finding only; "
           "strict always refuses)", choices=EXPANDABLE_TEARDOWN),
    Option("max-growth", "CUDAGRAPH_MAX_GROWTH", "cudagraph_max_growth", None,
           "fail an engine whose default-pool growth (weights, workspaces, caches it leaves behind) exceeds "
           "this many bytes (KiB, MiB, GiB are powers of 2, KB, MB, GB powers of 10; default: growth is "
           "reported, never a failure)", kind="bytes"),
    Option("worker", "CUDAGRAPH_WORKER_KIND", "cudagraph_worker", "fork",
           "what holds engine sequences: fork (reused worker processes; spawn where CUDA is initialized) or "
           "mpi (reused mpi4py.futures MPIPoolExecutor ranks)", choices=("fork", "mpi")),
    Option("mpi-ranks", "CUDAGRAPH_MPI_RANKS", "cudagraph_mpi_ranks", 2,
           "MPI ranks per pool when --cudagraph-worker=mpi (a marker's ranks= wins)", kind="int"),
    Option("require-mpi", "CUDAGRAPH_REQUIRE_MPI", "cudagraph_require_mpi", False,
           "stop the session at start (exit code 4) when mpi4py or an MPI runtime is missing", kind="bool"),
    Option("report", "CUDAGRAPH_REPORT", "cudagraph_report", None,
           "write a JSON report of every engine cycle and test outcome to this path (its folders made as needed)",
           kind="path"),
]
BY_NAME = {o.name: o for o in OPTIONS}


def shown_default(value: Any) -> str:
    """A default as the help and the reference show it: on/off, none, 300 (not 300.0)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("cudagraph", "CUDA graph lifecycle (pytest-cudagraph)")
    for o in OPTIONS:
        flag = f"--cudagraph-{o.name}"
        dest = "cudagraph_" + o.name.replace("-", "_")
        text = f"{o.help} [env {o.env}, ini {o.ini}; default {shown_default(o.default)}]"
        if o.kind == "bool":  # both forms: a flag can switch off what a variable or the ini switched on
            group.addoption(flag, action="store_true", default=None, dest=dest, help=text)
            group.addoption(f"--no-cudagraph-{o.name}", action="store_false", default=None, dest=dest,
                            help=f"the opposite of {flag} (over {o.env} and {o.ini})")
        else:
            group.addoption(flag, action="store", default=None, dest=dest, metavar=o.name.upper(), help=text)
        parser.addini(o.ini, o.help, default=None)


def where(o: Option, source: str) -> str:
    """How the user set an option, in their words: the flag, the variable, or the ini key."""
    return {"cli": f"--cudagraph-{o.name}", "env": o.env, "ini": f"ini key {o.ini}"}[source]


class IniFile(NamedTuple):
    """Where pytest's settings live for this session: the section, the file's name, and whether it is TOML
    (where a string value needs quotes)."""

    section: str = "[pytest]"
    name: str = "pytest.ini"
    toml: bool = False


PYTEST_INI = IniFile()


def setting(o: Option, source: str, value: Any, ini: IniFile = PYTEST_INI) -> str:
    """How to write ``value`` where the user set the option: ``--cudagraph-x=v``, ``VAR=v``, or the line of
    the ini file the user has, in its section."""
    text = ("true" if value else "false") if isinstance(value, bool) else value  # TOML's spelling, taken by all
    if source != "ini":
        return f"{where(o, source)}={text}"
    text = f'"{value}"' if ini.toml and isinstance(value, str) else text
    return f"`{o.ini} = {text}` in the {ini.section} section of {ini.name}"


def ini_file(config: pytest.Config) -> IniFile:
    """``[pytest]`` of pytest.ini, tox.ini or pytest 9's pytest.toml; ``[tool:pytest]`` of setup.cfg;
    ``[tool.pytest.ini_options]`` (or pytest 9's ``[tool.pytest]``) of pyproject.toml."""
    path = config.inipath
    if path is None:
        return IniFile()
    if path.name == "setup.cfg":
        return IniFile("[tool:pytest]", path.name)
    if path.suffix != ".toml":
        return IniFile("[pytest]", path.name)
    if path.name != "pyproject.toml":  # pytest.toml, .pytest.toml
        return IniFile("[pytest]", path.name, True)
    try:
        import tomllib

        tool = tomllib.loads(path.read_text()).get("tool", {}).get("pytest", {})
    except (ImportError, OSError, ValueError):
        tool = {}
    native = bool(tool) and "ini_options" not in tool
    return IniFile("[tool.pytest]" if native else "[tool.pytest.ini_options]", path.name, True)


def unset(s: dict[str, Any], key: str) -> str:
    """How to take back what the user set, in their words: drop the flag, unset the variable, remove the key."""
    o = BY_NAME[key.replace("_", "-")]
    source = s["sources"].get(key, "default")
    ini = s.get("ini_file", PYTEST_INI)
    return {"cli": f"drop --cudagraph-{o.name}", "env": f"unset {o.env}",
            "ini": f"remove {o.ini} from the {ini.section} section of {ini.name}"}.get(
        source, f"leave --cudagraph-{o.name} at its default")


def choose(s: dict[str, Any], key: str, value: Any) -> str:
    """How to choose ``value`` where the user set the option: ``--cudagraph-x=v``, ``VAR=v`` or the ini line."""
    o = BY_NAME[key.replace("_", "-")]
    source = s["sources"].get(key, "default")
    return setting(o, "cli" if source == "default" else source, value, s.get("ini_file", PYTEST_INI))


# kind -> (cast, lowest accepted value, what it must be, an example)
_NUMBERS = {"int": (int, 1, "an integer", 2), "float": (float, 0, "a number of seconds", 120)}
_EXAMPLES = {"bool": True, "bytes": "64MiB", "path": "reports/cudagraph.json"}


def _quoted(raw: Any, source: str, ini: IniFile) -> str | None:
    """The value inside quotes written in a ``.ini``/``.cfg`` file, which keeps them as part of the value."""
    if source == "ini" and not ini.toml and isinstance(raw, str):
        text = raw.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
            return text[1:-1].strip()
    return None


def _shown(raw: Any, source: str, ini: IniFile) -> str:
    """The value as the user wrote it: a TOML boolean as ``true``, anything else as Python shows it."""
    if isinstance(raw, bool) and source == "ini" and ini.toml:
        return "true" if raw else "false"
    return repr(raw)


def _bad(o: Option, raw: Any, source: str, ini: IniFile, problem: str, example: Any = None,
         sep: str = ": ") -> pytest.UsageError:
    """``<what the user set>=<value> <problem>``, then how to write it where it was set (for an ini key: the
    line and the file's section)."""
    inner = _quoted(raw, source, ini)
    if inner is not None:  # the likeliest cause: quotes, which only TOML strips
        sep, fix = "; ", f"{ini.name} takes quotes literally, so drop them: {setting(o, source, inner, ini)}"
    else:
        fix = f"e.g. {setting(o, source, _EXAMPLES.get(o.kind, o.default) if example is None else example, ini)}"
    return pytest.UsageError(f"{where(o, source)}={_shown(raw, source, ini)} {problem}{sep}{fix}")


def _convert(o: Option, raw: Any, source: str, ini: IniFile = PYTEST_INI) -> Any:
    # a TOML number or boolean where another type goes is refused, not cast (true would be a 1 s timeout)
    typed = source == "ini" and not isinstance(raw, str)
    if o.kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if not typed or isinstance(raw, int):
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
        raise _bad(o, raw, source, ini, "is not a boolean: use 1/0, true/false, yes/no, on/off", sep="; ")
    if o.kind == "bytes":
        try:
            if isinstance(raw, (bool, float)):
                raise ValueError(raw)
            return parse_size(raw)
        except NegativeSizeError:
            raise _bad(o, raw, source, ini, "is negative: give a size >= 0", sep=", ") from None
        except ValueError:
            raise _bad(o, raw, source, ini, f"is not a size in bytes: give {SIZE_HELP}", sep=", ") from None
    if o.kind in _NUMBERS:
        cast, lowest, what, example = _NUMBERS[o.kind]
        if isinstance(raw, bool) or (cast is int and isinstance(raw, float)):  # TOML's true, 2.7
            raise _bad(o, raw, source, ini, f"is {'a boolean, ' if isinstance(raw, bool) else ''}not {what}", example)
        try:
            value = cast(raw)
        except (TypeError, ValueError):
            raise _bad(o, raw, source, ini, f"is not {what}", example) from None
        if not math.isfinite(value):  # float("nan") and float("inf") parse, and nan passes every comparison
            raise _bad(o, raw, source, ini, "is not a finite number (0 means no limit)", example)
        if value < lowest:
            raise _bad(o, raw, source, ini,
                       f"is below {lowest} ({'0 means no limit' if lowest == 0 else 'give a positive number'})",
                       example)
        return value
    if typed:  # a path or a choice is a TOML string
        raise _bad(o, raw, source, ini, "is not a string: write it in quotes", sep="; ")
    value = str(raw)
    if o.choices:
        if value.strip().lower() in o.choices:  # ON, Sim: as CUDAGRAPH_SANITIZE=STRICT is taken
            return value.strip().lower()
        raise _bad(o, raw, source, ini, f"is not one of: {', '.join(o.choices)}", sep="; ")
    if _quoted(raw, source, ini) is not None:  # a file named "r.json", quotes and all, is never meant
        raise _bad(o, raw, source, ini, "is in quotes")
    return value


# the variables the library reads (the program-wide sanitizer, checked mode) and those the plugin sets for its
# own workers: with the options' variables, every CUDAGRAPH_* name that means something
LIBRARY_VARIABLES = {"CUDAGRAPH_SANITIZE": "the program-wide sanitizer",
                     "CUDAGRAPH_SANITIZE_BACKEND": "the program-wide sanitizer's backend",
                     "CUDAGRAPH_EXPANDABLE_TEARDOWN": "the library's expandable-segments teardown rule",
                     "CUDAGRAPH_CHECKED": "the runner's checked mode",
                     "CUDAGRAPH_CAPTURE_PATH": "the observation layer's capture path"}
INTERNAL_VARIABLES = ("CUDAGRAPH_HAZARD_FILE", "CUDAGRAPH_IN_WORKER", "CUDAGRAPH_WORKER_TAG",
                      "CUDAGRAPH_CONFORMANCE_BACKEND",  # (this project's conformance tests')
                      "CUDAGRAPH_BUILD_EXTENSION")  # (setup.py's, at build: left exported, it is no misspelling)


def _near_names(name: str, meaning: dict[str, str], prefix: str, what: str) -> str:
    """What follows a name that nothing reads: the nearest names that are read, each with what it sets
    (compared without the prefix all of them share), or every name that is read."""
    import difflib

    suffixes = {k[len(prefix):]: k for k in meaning}
    near = [suffixes[n] for n in difflib.get_close_matches(name[len(prefix):], list(suffixes), n=2, cutoff=0.6)]
    if near:
        return ": did you mean " + " or ".join(f"{n} ({meaning[n]})" for n in near) + "?"
    return f" (the {what} it reads: {', '.join(sorted(meaning))})"


def unknown_variables(environ: Any) -> list[str]:
    """A line for each ``CUDAGRAPH_*`` variable set that nothing reads (a misspelling: ``CUDAGRAPH_SANITISE``,
    ``CUDAGRAPH_WORKER``), with the nearest name that is read."""
    # what each name sets, so that a near miss is told apart from its neighbour: CUDAGRAPH_SANITIZE (the
    # program-wide sanitizer) is not CUDAGRAPH_SANITIZE_MODE (the plugin's --cudagraph-sanitize)
    meaning = {o.env: f"--cudagraph-{o.name}" for o in OPTIONS}
    meaning.update(LIBRARY_VARIABLES)
    return [f"{name} is set but nothing of pytest-cudagraph reads it"
            + _near_names(name, meaning, "CUDAGRAPH_", "variables")
            for name in sorted(k for k in environ if k.startswith("CUDAGRAPH_"))
            if name not in meaning and name not in INTERNAL_VARIABLES]


def unknown_ini_keys(keys: Any, ini: IniFile) -> list[str]:
    """A line for each ``cudagraph*`` ini key that no option reads (pytest says only that it is unknown), with
    the nearest key that is read and the option it sets."""
    meaning = {o.ini: f"--cudagraph-{o.name}" for o in OPTIONS}
    return [f"ini key {key} in the {ini.section} section of {ini.name} is not one pytest-cudagraph reads"
            + _near_names(key, meaning, "cudagraph_", "keys")
            for key in sorted(k for k in keys if k.startswith("cudagraph") and k not in meaning)]


def resolve(config: pytest.Config) -> dict[str, Any]:
    """Each setting's value, and in ``sources`` where it came from (cli, env, ini or default)."""
    ini = ini_file(config)
    out: dict[str, Any] = {"sources": {}, "raw": {}, "ini_file": ini}
    errors = []  # every bad value at once: a CI round trip per typo is slow
    for o in OPTIONS:
        key = o.name.replace("-", "_")
        out[key] = o.default
        out["sources"][key] = "default"
        try:
            source, raw = _first_set(config, o, ini)
            if source != "default":
                out[key] = _convert(o, raw, source, ini)
                out["sources"][key] = source
                out["raw"][key] = raw  # as the user wrote it, for messages
        except pytest.UsageError as e:
            errors.append(str(e))
    if errors:
        raise pytest.UsageError("\n".join(errors))
    return out


def _first_set(config: pytest.Config, o: Option, ini: IniFile) -> tuple[str, Any]:
    """Where the option is set first (cli, env, ini) and its raw value, or ("default", None). Read in that
    order and no further: a flag wins over a malformed ini value, which is then never read."""
    raw = config.getoption("cudagraph_" + o.name.replace("-", "_"))
    if raw not in (None, "", []):
        return "cli", raw
    raw = os.environ.get(o.env)
    if raw not in (None, ""):
        return "env", raw
    raw = _ini(config, o.ini, ini)
    if raw not in (None, "", []):
        return "ini", raw
    return "default", None


def _ini(config: pytest.Config, name: str, ini: IniFile = PYTEST_INI) -> Any:
    """An ini key's value; in pytest 9's native ``[tool.pytest]`` TOML table a number or a boolean too (pytest
    refuses those for keys registered as strings; the conversion checks them as any other value)."""
    try:
        return config.getini(name)
    except (TypeError, pytest.UsageError):  # (pytest 9.2 words its TypeError as a usage error)
        raw = getattr(getattr(config, "_inicfg", {}).get(name), "value", None)
        if isinstance(raw, (bool, int, float)):
            return raw
        raise pytest.UsageError(f"ini key {name}={raw!r} is not a single value: give a string, a number or a boolean "
                                f"(in the {ini.section} section of {ini.name})") from None


def describe_source(s: dict[str, Any], key: str) -> str:
    """The words for how a setting was chosen, for error messages: e.g. ``--cudagraph-backend=cuda``."""
    o = BY_NAME[key.replace("_", "-")]
    source = s["sources"].get(key, "default")
    if source == "default":
        return f"the default --cudagraph-{o.name}={o.default}"
    if o.kind == "bool" and source == "cli":
        return where(o, source)
    return f"{where(o, source)}={s.get('raw', {}).get(key, s[key])}"


def program_sanitizer_mode() -> str | None:
    """The program-wide sanitizer's mode (``CUDAGRAPH_SANITIZE``), where one is installed; its variable's
    name is one word from the plugin's own option (CUDAGRAPH_SANITIZE_MODE), so the header shows both."""
    env = sys.modules.get("cudagraph_lifecycle.sanitizer.env")
    san = env.global_sanitizer() if env is not None else None
    return None if san is None else san.mode


def effective_backend(config: pytest.Config) -> str:
    """``cuda`` or ``sim``: what ``auto`` means on this machine. Counts GPUs (without a CUDA context) on
    first use only, so sessions that never use the plugin never import torch."""
    s = config.stash[SETTINGS_KEY]
    if "effective_backend" not in s:
        if s["backend"] == "sim":
            s["gpus"] = 0
        else:
            s["gpus"] = visible_gpu_count()
        s["effective_backend"] = s["backend"] if s["backend"] != "auto" else ("cuda" if s["gpus"] else "sim")
    return s["effective_backend"]
