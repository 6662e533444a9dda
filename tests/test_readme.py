"""Every code block of the README runs, so a snippet cannot rot.

- ``python`` blocks run as scripts; one whose first line is ``# test_<name>.py`` is saved as that test file and
  run with ``pytest -p cudagraph``;
- ``bash`` blocks run with ``bash -e`` in a folder holding a copy of ``examples/``, except two kinds of line
  that CI itself runs: install lines (their packages must be what ``.ci/run`` installs) and the test command
  (it must be ``.ci/run``'s: it is this very suite);
- the counts the README gives for the fault and bad-input tables are the tables' row counts.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
BLOCKS = [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w+)\n(.*?)^```$", README, re.M | re.S)]
INSTALLERS = ("pip", "apt-get")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _commands(text: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and `&&` chains split."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in line.split("&&")]
    return out


def _packages(command: str) -> set[str]:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if words[:3] == ["python3", "-m", "pip"]:
        words = words[2:]
    return {w for w in words[2:] if not w.startswith("-")} if words[0] in INSTALLERS else set()


def _ids(kind: str) -> list[str]:
    return [f"{kind}-{i}" for i, (lang, _) in enumerate(BLOCKS) if lang == kind]


PYTHON = [body for lang, body in BLOCKS if lang == "python"]
BASH = [body for lang, body in BLOCKS if lang == "bash"]


def test_the_readme_has_its_blocks():
    assert len(PYTHON) >= 3 and len(BASH) >= 4


@pytest.mark.parametrize("body", PYTHON, ids=_ids("python"))
def test_python_block_runs(body, tmp_path):
    first = body.splitlines()[0]
    if re.fullmatch(r"# (test_\w+\.py)", first):
        name = first[2:]
        (tmp_path / name).write_text(body)
        cmd = [sys.executable, "-m", "pytest", "-p", "cudagraph", "-q", "-p", "no:cacheprovider", name]
    else:
        (tmp_path / "snippet.py").write_text(body)
        cmd = [sys.executable, "snippet.py"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("body", BASH, ids=_ids("bash"))
def test_bash_block_runs(body, tmp_path):
    ci_packages = set().union(*(_packages(c) for c in _commands(CI)))
    ci_test = next(c for c in _commands(CI) if "pytest" in c)
    run = []
    for command in _commands(body):
        if command.split()[0] in INSTALLERS or _packages(command):
            assert _packages(command) <= ci_packages, f"{command!r}: CI does not install this"
        elif command.startswith("pytest") and "tests" in command.split():  # the suite itself
            assert ci_test.endswith(command), f"{command!r} is not the test command CI runs ({ci_test!r})"
        else:
            run.append(command)
    if not run:
        return
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    script = "set -e\n" + "\n".join(c.replace("pytest ", f"{sys.executable} -m pytest ", 1)
                                    if c.startswith("pytest ") else c.replace("python3 ", f"{sys.executable} ", 1)
                                    for c in run)
    p = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_the_suite_counts_in_the_readme_are_the_tables():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_bad_input_plugin as plugin_table
        import test_bad_input_runner as runner_table
        import test_faults_mpi as mpi_table
        import test_faults_worker as worker_table
    finally:
        sys.path.pop(0)
    text = " ".join(README.split())  # the README wraps its lines anywhere
    assert f"worker faults survived: {len(worker_table.ROWS)} rows" in text
    assert f"MPI rank faults: {len(mpi_table.ROWS)} rows" in text
    runner_rows = len(runner_table.BUILD) + len(runner_table.RUN) + len(runner_table.OTHER)
    plugin_rows = len(plugin_table.OPTIONS) + len(plugin_table.AT_IMPORT) + len(plugin_table.FIXTURE_ARGS) + len(plugin_table.SHAPES)
    assert f"library arguments: {runner_rows} rows" in text
    assert f"bad arguments an engine passes: {plugin_rows} rows" in text
