"""Every documented way to start the sanitizer watches the process's one simulated allocator: a stale
capture on ``sim`` is stopped by StalePoolError through each entry point."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cudagraph_lifecycle import CUDAGraphRunner, LazyPool, PoolSanitizer, StalePoolError, get_backend

# User code as it is written: the backend by name, a capture helper, a handle kept after release, the last
# output still held (a global of the main module).
PROGRAM = textwrap.dedent('''
    import sys
    import torch
    from cudagraph_lifecycle import get_backend

    def capture(be, pool):
        g = be.new_graph()
        x = torch.ones(16)
        with be.stream(be.capture_stream(0)):
            g.capture_begin(pool=pool)
            y = x * 2
            g.capture_end()
        return g, y

    be = get_backend("sim")
    handle = be.graph_pool_handle()
    g, kept = capture(be, handle)
''')
# a stale capture: into a dead pool, which the output above pins
STALE = PROGRAM + "g.reset()\ncapture(be, handle)\n"


def test_pool_sanitizer_by_name_watches_code_that_gets_its_backend_by_name():
    with PoolSanitizer("sim") as san, pytest.raises(StalePoolError, match="stale pool"):
        exec(compile(STALE, "user_code.py", "exec"), {})
    assert san.stale_caught == 1 and get_backend("sim").poisoned is None


def _run(args, env_extra, tmp_path):
    script = tmp_path / "user_code.py"
    script.write_text(STALE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, *args, str(script)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)


def test_environment_variable_installs_one_for_the_whole_program(tmp_path):
    p = _run([], {"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}, tmp_path)
    assert p.returncode == 1 and "StalePoolError: capture into stale pool" in p.stderr, p.stderr[-2000:]


# A finding that raises nothing: a released pool pinned by a global of the program's main module.
PINNED = PROGRAM + textwrap.dedent('''
    if "--clean" in sys.argv:
        del kept
    if "--write" in sys.argv:
        results = open("results.txt", "w")  # left open: the interpreter's shutdown flushes it
        results.write("the results\\n")
    g.reset()
    print("served")
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[-1]))
''')
PINNED_LINE = "cudagraph sanitizer: pinned_pool: pool (0, 1) (captured at {}:10 in capture)"
WHAT_PINS = "pinned by a tensor (16,) float32 held as global `kept` of module __main__"
STRICT_EXIT = "cudagraph sanitizer: CUDAGRAPH_SANITIZE=strict and 1 finding(s): exit status 1"


def _run_pinned(args, mode, tmp_path, *program_args, env_extra=None):
    script = tmp_path / "user_code.py"
    script.write_text(PINNED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDAGRAPH_", "OMPI_", "PMI", "PYTEST_XDIST_"))}
    env.update({"CUDAGRAPH_SANITIZE": mode, "CUDAGRAPH_SANITIZE_BACKEND": "sim", **(env_extra or {})})
    return subprocess.run([sys.executable, *args, "user_code.py", *program_args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("mode, rc", [("1", 0), ("strict", 1)])
def test_the_variable_alone_prints_the_findings_at_exit(tmp_path, mode, rc):
    p = _run_pinned([], mode, tmp_path)
    assert p.returncode == rc and p.stdout == "served\n", p.stderr[-2000:]
    assert p.stderr.startswith(PINNED_LINE.format(tmp_path / "user_code.py")) and WHAT_PINS in p.stderr, p.stderr
    assert (STRICT_EXIT in p.stderr) == bool(rc)


def test_strict_at_exit_fails_the_run_with_warnings_as_errors(tmp_path):
    """The exit report touches no object's attributes: torch's deprecated names warn when touched."""
    p = _run_pinned([], "strict", tmp_path, env_extra={"PYTHONWARNINGS": "error"})
    assert p.returncode == 1 and p.stderr.rstrip().endswith(STRICT_EXIT), p.stderr[-2000:]


def test_strict_at_exit_still_writes_the_files_a_program_left_open(tmp_path):
    p = _run_pinned([], "strict", tmp_path, "--write")
    assert p.returncode == 1 and STRICT_EXIT in p.stderr, p.stderr[-2000:]
    assert (tmp_path / "results.txt").read_text() == "the results\n"


@pytest.mark.parametrize("command", [False, True], ids=["variable", "command"])
def test_an_mpi_ranks_findings_say_which_rank(tmp_path, command):
    p = _run_pinned(["-m", COMMAND] if command else [], "strict", tmp_path, env_extra={"OMPI_COMM_WORLD_RANK": "3"})
    assert p.returncode == 1 and p.stderr.startswith("cudagraph sanitizer (rank 3): pinned_pool: "), p.stderr


@pytest.mark.parametrize("command", [False, True], ids=["variable", "command"])
def test_a_program_without_findings_prints_nothing_and_keeps_its_status(tmp_path, command):
    args = ["-m", COMMAND] if command else []
    assert _run_pinned(args, "strict", tmp_path, "--clean").stderr == ""
    p = _run_pinned(args, "strict", tmp_path, "--clean", "--exit", "3")
    assert (p.returncode, p.stderr) == (3, "")


@pytest.mark.parametrize("status, rc", [("0", 1), ("3", 3)])
def test_the_command_fails_a_strict_program_that_exits_cleanly(tmp_path, status, rc):
    """``sys.exit(main())`` ends most programs: a clean exit with findings fails under strict; the program's
    own failure keeps its status."""
    p = _run_pinned(["-m", COMMAND], "strict", tmp_path, "--exit", status)
    assert p.returncode == rc and p.stderr.startswith(PINNED_LINE.format(tmp_path / "user_code.py")), p.stderr[-2000:]
    assert WHAT_PINS in p.stderr  # the program's module is still __main__ when its findings are read


def test_the_command_runs_a_program_from_its_folder(tmp_path):
    """The program's folder comes first on sys.path (its sibling modules import), from any working folder."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("ANSWER = 42\n")
    (app / "serve.py").write_text("import sys\nfrom helper import ANSWER\nprint(__name__, ANSWER, sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env["CUDAGRAPH_SANITIZE_BACKEND"] = "sim"
    p = subprocess.run([sys.executable, "-m", COMMAND, "app/serve.py", "--port", "1"], capture_output=True,
                       text=True, env=env, timeout=120, cwd=tmp_path)
    assert (p.returncode, p.stdout) == (0, "__main__ 42 ['--port', '1']\n"), p.stderr[-2000:]


FAILING_PROGRAMS = {
    "raises": "def serve():\n    raise ValueError('boom')\n\nserve()\n",
    "syntax error": "x = (\n",
    "exits with a message": "import sys\nsys.exit('bad config')\n",
    "exits with 4": "raise SystemExit(4)\n",
}


PROGRAMS = {
    **FAILING_PROGRAMS,
    "annotations": "def f(x: int) -> int: ...\nprint(f.__annotations__)\n",
    "a non-daemon thread": "import threading, time\n\ndef late():\n    time.sleep(0.3)\n    print('thread done')\n\n"
                           "threading.Thread(target=late).start()\nprint('main done')\n",
    "module attributes": "print(__name__, __spec__, type(__loader__).__name__, __file__ == __import__('os').path"
                         ".abspath(__file__))\n",
}


def _plain_and_command(tmp_path, program: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env["CUDAGRAPH_SANITIZE_BACKEND"] = "sim"
    return [subprocess.run([sys.executable, *args, program], capture_output=True, text=True, env=env, timeout=120,
                           cwd=tmp_path) for args in ([], ["-m", COMMAND])]


@pytest.mark.parametrize("body", PROGRAMS.values(), ids=PROGRAMS)
def test_the_command_runs_a_program_as_python_does(tmp_path, body):
    """Same status, output and stderr (a traceback shows the program's frames only) as ``python PROGRAM.py``."""
    (tmp_path / "serve.py").write_text(body)
    plain, ours = _plain_and_command(tmp_path, "serve.py")
    assert (ours.returncode, ours.stdout, ours.stderr) == (plain.returncode, plain.stdout, plain.stderr)


def test_the_command_runs_a_zip_application(tmp_path):
    import zipapp

    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("import sys\nprint('hello from', sys.argv[0].endswith('app.pyz'))\n")
    zipapp.create_archive(tmp_path / "app", tmp_path / "app.pyz")
    plain, ours = _plain_and_command(tmp_path, "app.pyz")
    assert (ours.returncode, ours.stdout, ours.stderr) == (plain.returncode, plain.stdout, plain.stderr) == (
        0, "hello from True\n", "")


IN_A_THREAD = textwrap.dedent('''
    import threading
    import time
    import torch
    from cudagraph_lifecycle import get_backend

    def serve():
        global kept
        time.sleep(0.3)  # still running when the main module's code has ended
        be = get_backend("sim")
        g = be.new_graph()
        with be.stream(be.capture_stream(0)):
            g.capture_begin(pool=be.graph_pool_handle())
            kept = torch.ones(16) * 2
            g.capture_end()
        g.reset()

    threading.Thread(target=serve).start()
''')


def test_the_command_reads_findings_after_the_programs_threads(tmp_path):
    (tmp_path / "serve.py").write_text(IN_A_THREAD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env.update({"CUDAGRAPH_SANITIZE": "strict", "CUDAGRAPH_SANITIZE_BACKEND": "sim"})
    p = subprocess.run([sys.executable, "-m", COMMAND, "serve.py"], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and "pinned_pool" in p.stderr and ":13 in serve)" in p.stderr, p.stderr[-2000:]


def test_the_command_runs_a_module_as_python_m_does(tmp_path):
    """`-m MODULE`: found on sys.path from the working folder, run as __main__ with its file as argv[0], its
    findings read while it is still __main__."""
    (tmp_path / "servemod.py").write_text(PINNED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDAGRAPH_", "OMPI_", "PMI", "PYTEST_XDIST_"))}
    env.update({"CUDAGRAPH_SANITIZE": "strict", "CUDAGRAPH_SANITIZE_BACKEND": "sim"})
    p = subprocess.run([sys.executable, "-m", COMMAND, "-m", "servemod", "--exit", "0"], capture_output=True,
                       text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == "served\n", p.stderr[-2000:]  # strict: the clean exit fails
    assert p.stderr.startswith(PINNED_LINE.format(tmp_path / "servemod.py")) and WHAT_PINS in p.stderr, p.stderr
    (tmp_path / "bare.py").write_text("print(sorted(k for k in globals() if not k.startswith('__')))\n")
    bare = subprocess.run([sys.executable, "-m", COMMAND, "-m", "bare"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert bare.stdout == "[]\n", bare.stdout + bare.stderr  # its own namespace, as under `python -m`
    missing = subprocess.run([sys.executable, "-m", COMMAND, "-m", "nosuchmod"], capture_output=True, text=True,
                             env=env, timeout=120, cwd=tmp_path)
    assert missing.returncode == 1 and "No module named nosuchmod" in missing.stderr, missing.stderr


@pytest.mark.parametrize("args, words", [(["-c", "pass"], "-c is not an option of this command"),
                                         (["-m"], "-m needs a module name")])
def test_the_command_names_what_it_does_not_take(args, words):
    p = subprocess.run([sys.executable, "-m", COMMAND, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"cudagraph sanitizer: {words}: give the program's file" in p.stderr, p.stderr


def test_module_entry_runs_a_program_under_it(tmp_path):
    p = _run(["-m", "cudagraph_lifecycle.sanitizer"], {"CUDAGRAPH_SANITIZE_BACKEND": "sim"}, tmp_path)
    assert p.returncode == 1 and "StalePoolError: capture into stale pool" in p.stderr, p.stderr[-2000:]
    assert "user_code.py" in p.stderr  # the mint and release sites are the user's lines


COMMAND = "cudagraph_lifecycle.sanitizer"
# how Python's own option parser reads a command line: is it our command?
COMMAND_LINES = [
    (["-m", COMMAND], True), (["-m" + COMMAND], True), (["-X", "dev", "-m", COMMAND], True),
    (["-Xdev", "-m", COMMAND], True), (["-W", "ignore", "-m", COMMAND], True), (["-Im", COMMAND], True),
    (["-u", "-E", "-m", COMMAND], True), (["-m", COMMAND + ".__main__"], True),
    (["-m", "userpkg"], False), (["serve.py", "-m", COMMAND], False), (["-", "-m", COMMAND], False),
    (["-c", "pass", "-m", COMMAND], False), (["-X", "-m", "-m", COMMAND], True), ([], False),
]


@pytest.mark.parametrize("args, ours", COMMAND_LINES, ids=[" ".join(a) or "(none)" for a, _ in COMMAND_LINES])
def test_the_sanitizer_command_is_told_from_its_command_line(args, ours):
    from cudagraph_lifecycle import _run_as_sanitizer_command

    assert _run_as_sanitizer_command(["python", *args]) is ours


@pytest.mark.parametrize("args", [["-mcudagraph_lifecycle.sanitizer"], ["-X", "dev", "-m", COMMAND],
                                  ["-W", "ignore", "-m", COMMAND], ["-m", COMMAND + ".__main__"]],
                         ids=["joined", "-X dev", "-W ignore", "__main__"])
def test_module_entry_written_other_ways_reports_a_bad_setting_as_a_message(tmp_path, args):
    p = _run(args, {"CUDAGRAPH_SANITIZE": "loud"}, tmp_path)  # the package's import must leave it to the command
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "CUDAGRAPH_SANITIZE='loud' is not a sanitizer mode" in p.stderr


BAD_SETTINGS = [
    ({"CUDAGRAPH_SANITIZE": "0"}, ["CUDAGRAPH_SANITIZE='0' turns the sanitizer off", "unset it"]),
    ({"CUDAGRAPH_SANITIZE": "off"}, ["CUDAGRAPH_SANITIZE='off' turns the sanitizer off"]),
    ({"CUDAGRAPH_SANITIZE": "loud"}, ["CUDAGRAPH_SANITIZE='loud' is not a sanitizer mode", "1 (or on), strict"]),
    ({"CUDAGRAPH_SANITIZE_BACKEND": "gpu"}, ["CUDAGRAPH_SANITIZE_BACKEND='gpu'", "auto, cuda, sim"]),
    ({"CUDAGRAPH_EXPANDABLE_TEARDOWN": "ignore"}, ["CUDAGRAPH_EXPANDABLE_TEARDOWN='ignore'", "refuse"]),
    ({"CUDAGRAPH_CHECKED": "maybe"}, ["CUDAGRAPH_CHECKED='maybe' is not a boolean"]),
]


@pytest.mark.parametrize("env, words", BAD_SETTINGS, ids=[next(iter(e.items()))[1] for e, _ in BAD_SETTINGS])
def test_module_entry_refuses_a_bad_setting_with_a_message_not_a_traceback(tmp_path, env, words):
    p = _run(["-m", "cudagraph_lifecycle.sanitizer"], {"CUDAGRAPH_SANITIZE_BACKEND": "sim", **env}, tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.startswith("cudagraph sanitizer: ") and all(w in p.stderr for w in words), p.stderr


def test_the_plugins_variable_given_to_the_command_is_refused_with_the_variable_to_set(tmp_path):
    """CUDAGRAPH_SANITIZE_MODE is the plugin's option: given alone (strict meant for this run), the command
    stops before the program and names the variable it reads; set to on it changes nothing and is let be."""
    p = _run(["-m", "cudagraph_lifecycle.sanitizer"],
             {"CUDAGRAPH_SANITIZE_MODE": "strict", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}, tmp_path)
    assert p.returncode == 2 and "CUDAGRAPH_SANITIZE_MODE='strict' is the pytest plugin's option" in p.stderr
    assert "set CUDAGRAPH_SANITIZE instead (e.g. CUDAGRAPH_SANITIZE=strict)" in p.stderr and "Traceback" not in p.stderr
    p = _run(["-m", "cudagraph_lifecycle.sanitizer"],
             {"CUDAGRAPH_SANITIZE_MODE": "on", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}, tmp_path)
    assert "StalePoolError" in p.stderr and "CUDAGRAPH_SANITIZE_MODE" not in p.stderr  # ran, judged


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for cuda where there is none")
def test_a_backend_that_is_not_here_is_named_by_its_variable(tmp_path):
    p = _run(["-m", "cudagraph_lifecycle.sanitizer"], {"CUDAGRAPH_SANITIZE_BACKEND": "cuda"}, tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "CUDAGRAPH_SANITIZE_BACKEND='cuda': backend 'cuda' was asked for" in p.stderr, p.stderr
    p = _run([], {"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_SANITIZE_BACKEND": "cuda"}, tmp_path)  # at import
    assert p.returncode == 1 and "BackendUnavailableError: CUDAGRAPH_SANITIZE_BACKEND='cuda'" in p.stderr


def test_the_variable_installs_one_in_a_program_run_as_a_module(tmp_path):
    """``python -m`` of the user's own package: only our command installs its sanitizer itself."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import cudagraph_lifecycle\n")
    (pkg / "__main__.py").write_text(STALE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env.update({"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_SANITIZE_BACKEND": "sim"})
    p = subprocess.run([sys.executable, "-m", "userpkg"], capture_output=True, text=True, env=env, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 1 and "StalePoolError: capture into stale pool" in p.stderr, p.stderr[-2000:]


def test_a_cudagraph_marked_test(pytester):
    pytester.makepyfile(test_user=f'''
        import pytest
        from cudagraph_lifecycle import StalePoolError

        @pytest.mark.cudagraph
        def test_stale():
            with pytest.raises(StalePoolError):
                exec(compile({STALE!r}, "user_code.py", "exec"), {{}})
    ''')
    pytester.runpytest_subprocess("-p", "cudagraph").assert_outcomes(passed=1)


def test_a_runner_built_with_backend_sim():
    pool = LazyPool("sim", mode="handle")  # shared, never retired by the runners: the first one's id stays
    with PoolSanitizer("sim"):
        r1 = CUDAGraphRunner(lambda x: x * 2, [2], (4,), backend="sim", pool=pool)
        kept = r1.run(torch.ones(2, 4))  # a view into the pool, held past release
        r1.release()
        r2 = CUDAGraphRunner(lambda x: x * 3, [2], (4,), backend="sim", pool=pool)
        with pytest.raises(StalePoolError):
            r2.capture()
        del kept
