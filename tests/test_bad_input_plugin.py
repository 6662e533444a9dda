"""Specification: every bad input to the plugin gets a clear answer that names what the user set.

Options (command line, environment, ini key) are usage errors (exit code 4) naming the flag, the variable
or the ini key as the user wrote it; markers, fixture arguments and engines of the wrong shape fail the
test with the argument named. Each row: the input, and the words the message must contain.
"""

import importlib.util
import json
import os
import sys

import pytest

from pytest_cudagraph.mpi import mpi_unavailable_reason

PLAIN_TEST = "def test_x(cudagraph_backend_name): pass"

# (id, command line, environment, ini lines, words)
OPTIONS = [
    ("backend cli", ["--cudagraph-backend=tpu"], {}, "", "--cudagraph-backend='tpu' is not one of: auto, cuda, sim"),
    ("backend env", [], {"CUDAGRAPH_BACKEND": "tpu"}, "", "CUDAGRAPH_BACKEND='tpu' is not one of"),
    ("backend ini", [], {}, "cudagraph_backend = tpu", "ini key cudagraph_backend='tpu' is not one of"),
    ("timeout cli", ["--cudagraph-timeout=soon"], {}, "", "--cudagraph-timeout='soon' is not a number of seconds"),
    ("timeout env", [], {"CUDAGRAPH_TIMEOUT": "soon"}, "", "CUDAGRAPH_TIMEOUT='soon' is not a number"),
    ("timeout ini", [], {}, "cudagraph_timeout = soon", "ini key cudagraph_timeout='soon' is not a number"),
    ("timeout ini, the fix", [], {}, "cudagraph_timeout = soon", "e.g. `cudagraph_timeout = 120` in the [pytest] section"),
    ("timeout negative", [], {"CUDAGRAPH_TIMEOUT": "-3"}, "", "CUDAGRAPH_TIMEOUT='-3' is below 0 (0 means no limit)"),
    ("ranks zero cli", ["--cudagraph-mpi-ranks=0"], {}, "", "--cudagraph-mpi-ranks='0' is below 1"),
    ("ranks ini", [], {}, "cudagraph_mpi_ranks = two", "ini key cudagraph_mpi_ranks='two' is not an integer"),
    ("growth cli", ["--cudagraph-max-growth=lots"], {}, "", "--cudagraph-max-growth='lots' is not a size in bytes"),
    ("growth env", [], {"CUDAGRAPH_MAX_GROWTH": "5 parsecs"}, "", "CUDAGRAPH_MAX_GROWTH='5 parsecs' is not a size"),
    ("growth ini", [], {}, "cudagraph_max_growth = -1", "ini key cudagraph_max_growth='-1' is negative: give a size >= 0"),
    ("growth negative cli", ["--cudagraph-max-growth=-5MiB"], {}, "", "--cudagraph-max-growth='-5MiB' is negative"),
    ("growth ini, the fix", [], {}, "cudagraph_max_growth = -1", "e.g. `cudagraph_max_growth = 64MiB` in the [pytest]"),
    ("growth units", [], {"CUDAGRAPH_MAX_GROWTH": "64MB5"}, "",
     "CUDAGRAPH_MAX_GROWTH='64MB5' is not a size in bytes: give a whole number of bytes, optionally with KiB, MiB or "
     "GiB (KB, MB, GB are powers of 10; 1.5GiB where it comes to whole bytes), e.g. CUDAGRAPH_MAX_GROWTH=64MiB"),
    ("sanitize env", [], {"CUDAGRAPH_SANITIZE_MODE": "loud"}, "", "CUDAGRAPH_SANITIZE_MODE='loud' is not one of: off, on, strict"),
    ("expandable teardown cli", ["--cudagraph-expandable-teardown=ignore"], {}, "",
     "--cudagraph-expandable-teardown='ignore' is not one of: refuse, report"),
    ("expandable teardown ini", [], {}, "cudagraph_expandable_teardown = allow",
     "ini key cudagraph_expandable_teardown='allow' is not one of: refuse, report"),
    ("worker cli", ["--cudagraph-worker=threads"], {}, "", "--cudagraph-worker='threads' is not one of: fork, mpi"),
    ("start method ini", [], {}, "cudagraph_start_method = thread", "ini key cudagraph_start_method='thread' is not one of"),
    ("require-gpu env", [], {"CUDAGRAPH_REQUIRE_GPU": "maybe"}, "", "CUDAGRAPH_REQUIRE_GPU='maybe' is not a boolean"),
    ("checked env", [], {"CUDAGRAPH_CHECKED": "maybe"}, "",
     "CUDAGRAPH_CHECKED='maybe' is not a boolean: set it to 1 (checked mode for every runner that does not choose)"),
    ("capture path env", [], {"CUDAGRAPH_CAPTURE_PATH": "fast"}, "",
     "CUDAGRAPH_CAPTURE_PATH='fast' is not one of auto, compiled, python: set it to 'python' to observe captures"),
    # a missing folder is made (tests/test_report_paths.py); one that cannot be (none can be made in /proc) is not
    ("report folder cli", ["--cudagraph-report=/proc/cudagraph/dir/r.json"], {}, "",
     "--cudagraph-report=/proc/cudagraph/dir/r.json: the folder /proc/cudagraph/dir cannot be created ("),
    ("report folder env", [], {"CUDAGRAPH_REPORT": "/proc/cudagraph/r.json"}, "",
     "CUDAGRAPH_REPORT=/proc/cudagraph/r.json: the folder /proc/cudagraph cannot be created"),
    ("report folder ini", [], {}, "cudagraph_report = /proc/cudagraph/r.json",
     "ini key cudagraph_report=/proc/cudagraph/r.json: the folder /proc/cudagraph cannot be created"),
    ("report is a folder", ["--cudagraph-report=."], {}, "", "is a folder: give a file path"),
    ("report under a file", ["--cudagraph-report=/etc/passwd/out/r.json"], {}, "",
     "--cudagraph-report=/etc/passwd/out/r.json: /etc/passwd is a file, not a folder; choose another path"),
    ("cuda without a GPU cli", ["--cudagraph-backend=cuda"], {}, "",
     "--cudagraph-backend=cuda: no usable GPU is visible to this process"),
    ("cuda without a GPU env", [], {"CUDAGRAPH_BACKEND": "cuda"}, "",
     "CUDAGRAPH_BACKEND=cuda: no usable GPU is visible"),
    ("require gpu", ["--cudagraph-require-gpu"], {}, "", "--cudagraph-require-gpu: no usable GPU is visible"),
    ("require gpu, the fix", ["--cudagraph-require-gpu"], {}, "",
     "Run on a GPU runner, or drop --cudagraph-require-gpu (on a CPU the default backend, auto, runs sim)"),
    ("require gpu ini, the fix", [], {}, "cudagraph_require_gpu = true",
     "Run on a GPU runner, or remove cudagraph_require_gpu from the [pytest] section of tox.ini"),
    ("require gpu, devices hidden", ["--cudagraph-require-gpu"], {"CUDA_VISIBLE_DEVICES": ""}, "",
     "no GPU, or CUDA_VISIBLE_DEVICES='' hiding them). Run on a GPU runner"),
    ("require gpu and sim", ["--cudagraph-require-gpu", "--cudagraph-backend=sim"], {}, "",
     "--cudagraph-require-gpu contradicts --cudagraph-backend=sim"),
    ("require gpu env", [], {"CUDAGRAPH_REQUIRE_GPU": "1"}, "", "CUDAGRAPH_REQUIRE_GPU=1: no usable GPU is visible"),
    ("require gpu ini and sim env", [], {"CUDAGRAPH_BACKEND": "sim"}, "cudagraph_require_gpu = yes",
     "ini key cudagraph_require_gpu=yes contradicts CUDAGRAPH_BACKEND=sim"),
]


# read when the plugin imports the library, before any option: (id, environment, words)
AT_IMPORT = [
    ("program-wide sanitizer", {"CUDAGRAPH_SANITIZE": "maybe"},
     "CUDAGRAPH_SANITIZE='maybe' is not a sanitizer mode: set it to 1 (or on), strict, or 0 (off)"),
    ("its backend", {"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_SANITIZE_BACKEND": "tpu"},
     "CUDAGRAPH_SANITIZE_BACKEND='tpu': unknown backend 'tpu'"),
    ("its teardown", {"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_EXPANDABLE_TEARDOWN": "ignore"},
     "CUDAGRAPH_EXPANDABLE_TEARDOWN='ignore': set it to refuse"),
]


@pytest.mark.parametrize("what, env, words", AT_IMPORT, ids=[r[0] for r in AT_IMPORT])
def test_variables_read_at_the_librarys_import(pytester, monkeypatch, what, env, words):
    """A usage error (exit code 4, one line), not a traceback out of loading the plugin."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_subprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR, what
    assert f"ERROR: {words}" in res.stderr.str() and "Traceback" not in res.stderr.str(), res.stderr.str()


@pytest.mark.skipif(pytest.version_tuple < (9,), reason="the native [tool.pytest] table is pytest 9's")
def test_native_toml_numbers_and_booleans(pytester):
    """pytest 9's [tool.pytest] table holds native numbers and booleans: taken, and checked like any value."""
    pytester.makepyprojecttoml("[tool.pytest]\ncudagraph_timeout = 30\ncudagraph_require_gpu = false\n"
                               "cudagraph_mpi_ranks = 3\n")
    pytester.makepyfile(test_a="def test_x(pytestconfig):\n"
                               "    from pytest_cudagraph.settings import SETTINGS_KEY\n"
                               "    s = pytestconfig.stash[SETTINGS_KEY]\n"
                               "    assert (s['timeout'], s['require_gpu'], s['mpi_ranks']) == (30, False, 3)\n")
    pytester.runpytest_inprocess("-p", "cudagraph").assert_outcomes(passed=1)
    pytester.makepyprojecttoml("[tool.pytest]\ncudagraph_timeout = -3\n")
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and "ini key cudagraph_timeout=-3 is below 0" in res.stderr.str()
    pytester.makepyprojecttoml("[tool.pytest]\ncudagraph_report = ['a.json']\n")
    res = pytester.runpytest_inprocess("-p", "cudagraph")  # a list where a value goes: pytest's TypeError
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stderr.str()
    assert "ini key cudagraph_report=['a.json'] is not a single value" in res.stderr.str()


@pytest.mark.parametrize("name, text, words", [
    ("pyproject.toml", "[tool.pytest.ini_options]\ncudagraph_max_growth = 'lots'\n",
     "e.g. `cudagraph_max_growth = \"64MiB\"` in the [tool.pytest.ini_options] section of pyproject.toml"),
    ("pytest.toml", "[pytest]\ncudagraph_max_growth = 'lots'\n",
     "e.g. `cudagraph_max_growth = \"64MiB\"` in the [pytest] section of pytest.toml"),
    ("setup.cfg", "[tool:pytest]\ncudagraph_timeout = soon\n",
     "e.g. `cudagraph_timeout = 120` in the [tool:pytest] section of setup.cfg"),
])
def test_an_ini_example_is_written_for_the_file_the_user_has(pytester, name, text, words):
    if name == "pytest.toml" and pytest.version_tuple < (9,):
        pytest.skip("pytest.toml is read from pytest 9")
    (pytester.path / name).write_text(text)
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and words in res.stderr.str(), res.stderr.str()


@pytest.mark.skipif(pytest.version_tuple < (9,), reason="the native [tool.pytest] table is pytest 9's")
@pytest.mark.parametrize("text, words", [
    ("cudagraph_timeout = true\ncudagraph_mpi_ranks = 2.7\n",  # both at once: one round trip, not two
     ["ini key cudagraph_timeout=true is a boolean, not a number of seconds: e.g. `cudagraph_timeout = 120` in "
      "the [tool.pytest] section of pyproject.toml",
      "ini key cudagraph_mpi_ranks=2.7 is not an integer: e.g. `cudagraph_mpi_ranks = 2` in the [tool.pytest]"]),
    ("cudagraph_mpi_ranks = true\n", ["ini key cudagraph_mpi_ranks=true is a boolean, not an integer"]),
    ("cudagraph_max_growth = 1.0\n", ["ini key cudagraph_max_growth=1.0 is not a size in bytes"]),
    ("cudagraph_require_gpu = 2\n", ["ini key cudagraph_require_gpu=2 is not a boolean: use 1/0, true/false, "
                                     "yes/no, on/off; e.g. `cudagraph_require_gpu = true` in the [tool.pytest]"]),
    ("cudagraph_sanitize = true\n", ["ini key cudagraph_sanitize=true is not a string: write it in quotes; e.g. "
                                     "`cudagraph_sanitize = \"on\"` in the [tool.pytest] section of pyproject.toml"]),
], ids=["bool timeout, float ranks", "bool ranks", "float size", "int bool", "bool choice"])
def test_a_toml_value_of_the_wrong_type_is_refused_not_converted(pytester, text, words):
    """``true`` was a 1 s timeout and 2.7 ranks were 2."""
    pytester.makepyprojecttoml("[tool.pytest]\n" + text)
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str()
    for w in words:
        assert w in res.stderr.str(), res.stderr.str()


@pytest.mark.skipif(pytest.version_tuple < (9,), reason="the native [tool.pytest] table is pytest 9's")
def test_a_flag_wins_over_a_malformed_ini_value_which_is_then_not_read(pytester):
    pytester.makepyprojecttoml("[tool.pytest]\ncudagraph_timeout = [1, 2]\n")
    pytester.makepyfile(test_a=PLAIN_TEST)
    pytester.runpytest_inprocess("-p", "cudagraph", "--cudagraph-timeout=5").assert_outcomes(passed=1)
    res = pytester.runpytest_inprocess("-p", "cudagraph")  # alone, it is refused, naming the file
    assert res.ret == pytest.ExitCode.USAGE_ERROR and "ini key cudagraph_timeout=[1, 2] is not a single value" \
        in res.stderr.str(), res.stderr.str()


@pytest.mark.parametrize("args, env, words", [
    (["--cudagraph-timeout=nan"], {}, "--cudagraph-timeout='nan' is not a finite number (0 means no limit): e.g. "
                                      "--cudagraph-timeout=120"),
    (["--cudagraph-timeout=inf"], {}, "--cudagraph-timeout='inf' is not a finite number"),
    ([], {"CUDAGRAPH_TIMEOUT": "-inf"}, "CUDAGRAPH_TIMEOUT='-inf' is not a finite number"),
], ids=["nan", "inf", "-inf env"])
def test_a_timeout_that_is_not_a_finite_number(pytester, monkeypatch, args, env, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph", *args)
    assert res.ret == pytest.ExitCode.USAGE_ERROR and words in res.stderr.str(), res.stderr.str()


@pytest.mark.parametrize("name, line, words", [
    ("pytest.ini", 'cudagraph_sanitize = "strict"',
     "ini key cudagraph_sanitize='\"strict\"' is not one of: off, on, strict; pytest.ini takes quotes literally, so "
     "drop them: `cudagraph_sanitize = strict` in the [pytest] section of pytest.ini"),
    ("tox.ini", "cudagraph_timeout = '30'", "tox.ini takes quotes literally, so drop them: `cudagraph_timeout = 30`"),
    ("pytest.ini", 'cudagraph_require_gpu = "yes"', "drop them: `cudagraph_require_gpu = yes` in the [pytest]"),
    ("pytest.ini", 'cudagraph_report = "r.json"', "ini key cudagraph_report='\"r.json\"' is in quotes; pytest.ini "
                                                  "takes quotes literally, so drop them: `cudagraph_report = r.json`"),
    # every kind of key names the file and its section, with the line to write
    ("pytest.ini", "cudagraph_backend = tpu",
     "ini key cudagraph_backend='tpu' is not one of: auto, cuda, sim; e.g. `cudagraph_backend = auto` in the "
     "[pytest] section of pytest.ini"),
    ("setup.cfg", "cudagraph_require_gpu = maybe",
     "ini key cudagraph_require_gpu='maybe' is not a boolean: use 1/0, true/false, yes/no, on/off; e.g. "
     "`cudagraph_require_gpu = true` in the [tool:pytest] section of setup.cfg"),
    ("tox.ini", "cudagraph_expandable_teardown = allow",
     "e.g. `cudagraph_expandable_teardown = refuse` in the [pytest] section of tox.ini"),
], ids=["quoted choice", "quoted number", "quoted bool", "quoted path", "choice", "bool", "choice tox.ini"])
def test_an_ini_error_names_the_file_and_the_line_to_write(pytester, name, line, words):
    section = "[tool:pytest]" if name == "setup.cfg" else "[pytest]"
    (pytester.path / name).write_text(f"{section}\n{line}\n")
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and words in res.stderr.str(), res.stderr.str()


@pytest.mark.parametrize("args, env, ini, words", [
    (["--cudagraph-worker=mpi"], {}, "",
     "--cudagraph-worker=mpi: {reason}, so every engine_sequence test would be skipped. Install mpi4py and an MPI "
     "runtime, or choose fork: --cudagraph-worker=fork"),
    ([], {"CUDAGRAPH_WORKER_KIND": "mpi"}, "", "CUDAGRAPH_WORKER_KIND=mpi: {reason}"),
    ([], {}, "cudagraph_worker = mpi",
     "or choose fork: `cudagraph_worker = fork` in the [pytest] section of tox.ini"),  # (makeini's file)
], ids=["cli", "env", "ini"])
@pytest.mark.parametrize("mpi4py", ["as installed", "hidden"])
def test_mpi_workers_chosen_without_mpi_stop_the_session(pytester, monkeypatch, args, env, ini, words, mpi4py):
    """Not a session of skipped engine sequences that a CI gate passes; the default (fork) still runs them."""
    monkeypatch.setenv("PATH", "/nonexistent")  # no mpiexec
    without = mpi4py == "hidden" or importlib.util.find_spec("mpi4py") is None
    if mpi4py == "hidden":
        monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises, as where it is not installed
    reason = mpi_unavailable_reason()
    assert reason and reason.startswith("mpi4py is not installed (pip install mpi4py" if without
                                        else "no MPI runtime: mpiexec is not on PATH"), reason
    res = _run_with(pytester, monkeypatch, args, env, ini)
    words = words.format(reason=reason)
    assert res.ret == pytest.ExitCode.USAGE_ERROR and words in res.stderr.str(), res.stderr.str()
    monkeypatch.delenv("CUDAGRAPH_WORKER_KIND", raising=False)
    (pytester.path / "tox.ini").unlink(missing_ok=True)
    pytester.runpytest_inprocess("-p", "cudagraph").assert_outcomes(passed=1)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a /proc, where no file can be made")
def test_a_report_folder_where_no_file_can_be_made(pytester):
    """/proc passes os.access for root: the check makes a file, so the session stops at its start, not at its
    end with a traceback."""
    pytester.makepyfile(test_a=PLAIN_TEST)
    res = pytester.runpytest_inprocess("-p", "cudagraph", "--cudagraph-report=/proc/r.json")
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str()
    assert "--cudagraph-report=/proc/r.json: the folder /proc is not writable" in res.stderr.str(), res.stderr.str()
    assert "choose another path" in res.stderr.str()


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "no terminal"])
def test_a_report_that_cannot_be_written_at_the_end_is_one_line(pytester, terminal):
    """A file put where its folder was during the session (a removed folder is made again): one line naming the
    option, exit code 4 for a passing session."""
    (pytester.path / "out").mkdir()
    pytester.makepyfile(test_a="import shutil\ndef test_x():\n    shutil.rmtree('out')\n    open('out', 'w').close()\n")
    res = pytester.runpytest_subprocess("-p", "cudagraph", "--cudagraph-report=out/r.json",
                                        *([] if terminal else ["-p", "no:terminal"]))
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    out = res.stdout.str() + res.stderr.str()
    assert "Traceback" not in out and "cudagraph report: " not in out, out
    words = "ERROR: cudagraph report not written: --cudagraph-report=out/r.json: a file is where its folder goes"
    assert words in (res.stdout.str() if terminal else res.stderr.str()), out


def _run_with(pytester, monkeypatch, args, env, ini):
    """A plain test under these flags, variables and ini lines."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_a=PLAIN_TEST)
    return pytester.runpytest_inprocess("-p", "cudagraph", *args)


@pytest.mark.parametrize("what, args, env, ini, words", OPTIONS, ids=[r[0] for r in OPTIONS])
def test_options(pytester, monkeypatch, what, args, env, ini, words):
    res = _run_with(pytester, monkeypatch, args, env, ini)
    assert res.ret == pytest.ExitCode.USAGE_ERROR, what
    assert words in res.stderr.str(), res.stderr.str()


# (id, marker line or "", the test body, words in the failure)
FIXTURE_ARGS = [
    ("marker n", "@pytest.mark.cudagraph_engines(n=0)", "engine_sequence(good)", "cudagraph_engines(n=0)"),
    ("marker scope", "@pytest.mark.cudagraph_engines(scope='class')", "engine_sequence(good)",
     "cudagraph_engines(scope='class'): choose one of function, module, session"),
    ("marker sanitize", "@pytest.mark.cudagraph_engines(sanitize='loud')", "engine_sequence(good)",
     "cudagraph_engines(sanitize='loud'): choose off, on or strict"),
    ("marker unknown keyword", "@pytest.mark.cudagraph_engines(3, sanitise='strict')", "engine_sequence(good)",
     "cudagraph_engines(3, sanitise='strict'): takes n (positional or keyword) and scope, sanitize, ranks; "
     "unknown: sanitise"),
    ("budget size", "@pytest.mark.cudagraph(max_pool_bytes='lots')", "engine_sequence(good)",
     "cudagraph(max_pool_bytes='lots'): give a size in bytes, a whole number of bytes, optionally with KiB, MiB or "
     "GiB"),
    ("budget size negative", "@pytest.mark.cudagraph(max_pool_bytes='-5MiB')", "engine_sequence(good)",
     "cudagraph(max_pool_bytes='-5MiB'): negative; give a size >= 0"),
    ("marker ranks", "@pytest.mark.cudagraph_engines(ranks=0)", "engine_sequence(good)",
     "cudagraph_engines(ranks=0): give a positive int"),
    ("sequence n", "", "engine_sequence(good, 0)", "engine_sequence(n=0): give n >= 1"),
    ("sequence n type", "", "engine_sequence(good, '2')", "engine_sequence(n='2'): give n >= 1 engines, an int"),
    ("sequence atol", "", "engine_sequence(good, 1, atol='small')", "engine_sequence(atol='small'): give the largest"),
    ("sequence reload", "", "engine_sequence(good, 1, reload='swap')", "engine_sequence(reload='swap'): give a callable"),
    ("sequence check", "", "engine_sequence(good, 1, check='no')", "engine_sequence(check='no'): give True"),
    ("sequence atol infinite", "", "engine_sequence(good, 1, atol=float('inf'))",
     "engine_sequence(atol=inf): give the largest absolute difference allowed between replay and eager, a finite"),
    ("sequence output", "", "engine_sequence(good, 1, output='keep')", "engine_sequence(output='keep'): choose 'hold'"),
    ("sequence factory", "", "engine_sequence(5)", "needs a factory callable(backend) -> engine, got 5"),
]

ENGINES = '''
class Good:
    def __init__(self, backend): self.x = None
    def run(self, x): return x
    def release(self): pass

def good(backend): return Good(backend)
def no_release(backend): return object()

class PlainIds(Good):
    def pool_ids(self): return [(0, 1)]

def plain_ids(backend): return PlainIds(backend)

class RunnerAndIds(PlainIds):  # what the engine says wins over what its runner holds
    runner = type("Runner", (), {"pool_ids": []})()

def runner_and_ids(backend): return RunnerAndIds(backend)

class BadDevice(Good):  # a torch.device where the backend takes a device index
    def __init__(self, backend): self.w = backend.randn(4, device=backend.torch_device(0))

def bad_device(backend): return BadDevice(backend)

class BadDeviceAtRun(Good):
    def __init__(self, backend): self.backend = backend
    def example_input(self): return self.backend.randn(2, 4)
    def run(self, x): return x + self.backend.randn(*x.shape, device=self.backend.torch_device(0))

def bad_device_at_run(backend): return BadDeviceAtRun(backend)
'''


def _engines_line(text: str) -> int:
    return next(i for i, line in enumerate(ENGINES.lstrip("\n").splitlines(), 1) if text in line)  # as written


@pytest.mark.parametrize("what, marker, body, words", FIXTURE_ARGS, ids=[r[0] for r in FIXTURE_ARGS])
def test_fixture_and_marker_arguments(pytester, what, marker, body, words):
    pytester.makepyfile(engines_mod=ENGINES)
    pytester.makepyfile(test_a=f'''
import pytest
from engines_mod import good

{marker}
def test_x(engine_sequence):
    {body}
''')
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.TESTS_FAILED, what
    assert words in res.stdout.str(), res.stdout.str()
    out = res.stdout.str()
    # the message alone: not the plugin's source around it, nor its own message a second time, chained
    assert "raise ConfigError" not in out and "During handling" not in out, out
    assert "def __call__" not in out, out
    if marker:  # where the bad marker is written: the decorator's line
        line = next(i for i, text in enumerate((pytester.path / "test_a.py").read_text().splitlines(), 1)
                    if text.startswith("@pytest.mark"))
        assert f"(written on test test_x at test_a.py:{line})" in out, out


MARKED_CLASS = """import pytest
from engines_mod import good

@pytest.mark.cudagraph_engines(n=-1)
class TestEngines:
    def test_x(self, engine_sequence):
        engine_sequence(good)
"""
MARKED_MODULE = """import pytest
from engines_mod import good

pytestmark = pytest.mark.cudagraph_engines(n=-1)

def test_x(engine_sequence):
    engine_sequence(good)
"""


ADDED_BY_A_HOOK = """
import pytest

def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.cudagraph_engines(n=-1))
"""


@pytest.mark.parametrize("text, words", [
    (MARKED_CLASS, "(written on class TestEngines at test_a.py:4)"),
    (MARKED_MODULE, "(written in the pytestmark of test_a.py)"),
    (MARKED_MODULE.replace("pytestmark = pytest.mark.cudagraph_engines(n=-1)", ""),
     "(added to test test_x (not by a decorator: a hook, pytest.param(marks=...) or a fixture))"),
], ids=["class", "module", "hook"])
def test_a_bad_marker_names_the_class_or_module_it_is_written_on(pytester, text, words):
    pytester.makepyfile(engines_mod=ENGINES)
    if "pytestmark" not in text and "class" not in text:
        pytester.makeconftest(ADDED_BY_A_HOOK)
    pytester.makepyfile(test_a=text)
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    out = res.stdout.str()
    assert "cudagraph_engines(n=-1): give a positive int" in out and words in out, out


# (factory in ENGINES, words in the failure)
SHAPES = [
    ("no_release", ["the factory returned object, which has no run(x) (or __call__) and no release()"]),
    ("plain_ids", ["PlainIds.pool_ids() returned [(0, 1)]", "(device, pool_id) pairs"]),
    ("runner_and_ids", ["RunnerAndIds.pool_ids() returned [(0, 1)]"]),
    # a bad argument the engine's own code passes to the backend: the line of the engine that passed it
    ("bad_device", ["device index device(type='cpu') is not valid on backend 'sim'",
                    f"engines_mod.py:{_engines_line('self.w = backend.randn')} in __init__, building "
                    "test_a.py::test_x [engine 0])"]),
    ("bad_device_at_run", [f"engines_mod.py:{_engines_line('def run(self, x): return x + self.backend')} in run, "
                           "running test_a.py::test_x [engine 0])"]),
]


@pytest.mark.parametrize("factory, words", SHAPES, ids=[r[0] for r in SHAPES])
def test_engines_of_the_wrong_shape(pytester, factory, words):
    pytester.makepyfile(engines_mod=ENGINES)
    pytester.makepyfile(test_a=f'''
from engines_mod import {factory}

def test_x(engine_sequence):
    engine_sequence({factory}, 1)
''')
    res = pytester.runpytest_subprocess("-p", "cudagraph")
    res.assert_outcomes(failed=1)
    for w in words:
        assert w in res.stdout.str(), res.stdout.str()
    res.stdout.fnmatch_lines(["FAILED test_a.py::test_x - cudagraph_lifecycle.errors.ConfigError: *"])
    if not factory.startswith("bad_device"):  # the engine's shape is checked in our code: no line of the engine's
        assert "(raised at " not in res.stdout.str()


def test_the_json_report_needs_no_terminal(pytester):
    pytester.makepyfile(engines_mod=ENGINES)
    pytester.makepyfile(test_a="from engines_mod import good\ndef test_x(engine_sequence):\n    engine_sequence(good, 1)\n")
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:terminal", f"--cudagraph-report={report}")
    assert res.ret == 0
    data = json.loads(report.read_text())
    assert data["totals"]["cycles"] == 1 and data["tests"][0]["outcome"] == "passed"


def test_a_bad_value_a_higher_source_overrides_is_not_read(pytester, monkeypatch):
    """Only the values in effect are checked: a bad ini key under a good variable, and a bad variable under a
    good flag, are not read (command line > environment > ini); the same bad values alone are errors."""
    pytester.makeini("[pytest]\ncudagraph_timeout = soon\n")
    pytester.makepyfile(test_a="def test_x(pytestconfig):\n"
                               "    from pytest_cudagraph.settings import SETTINGS_KEY\n"
                               "    assert pytestconfig.stash[SETTINGS_KEY]['timeout'] == 5\n")
    monkeypatch.setenv("CUDAGRAPH_TIMEOUT", "5")
    pytester.runpytest_inprocess("-p", "cudagraph").assert_outcomes(passed=1)
    monkeypatch.setenv("CUDAGRAPH_TIMEOUT", "abc")
    pytester.runpytest_inprocess("-p", "cudagraph", "--cudagraph-timeout=5").assert_outcomes(passed=1)
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and "CUDAGRAPH_TIMEOUT='abc'" in res.stderr.str(), res.stderr.str()
    monkeypatch.delenv("CUDAGRAPH_TIMEOUT")
    res = pytester.runpytest_inprocess("-p", "cudagraph")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and "ini key cudagraph_timeout='soon'" in res.stderr.str(), \
        res.stderr.str()
