"""Every code block of the documentation runs, so a snippet cannot rot.

The documentation is README.md and docs/**/*.md, but for docs/ARCHITECTURE.md and docs/gpu-results/ (written
and checked elsewhere). In it:

- ``python`` blocks run as scripts. One whose first line is ``# test_<name>.py`` is saved as that test file in a
  copy of ``examples/`` (so it can use ``examples/engines.py``) and run with ``pytest -p cudagraph``; one whose
  first line is ``# <name>.py`` is saved under that name, run, and given to the bash blocks of its page;
- ``bash`` blocks run with ``bash -e`` in a folder holding a copy of ``examples/``, except two kinds of line
  that CI itself runs: install lines (their packages must be what ``.ci/run`` installs) and the test command (it
  must be ``.ci/run``'s, exactly: it is this very suite);
- every other block only shows output or configuration, and says so (``text``, ``ini``, ``toml``, ``json``);
- a block that appears on several pages runs once.

Also: the counts the fault page gives are the tables' row counts, the problem kinds the verdicts page lists are
the record's, the generated reference renders, and the README stays short.
"""

import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md")
    if p.relative_to(ROOT / "docs").parts[0] not in ("ARCHITECTURE.md", "gpu-results"))
CI = (ROOT / ".ci" / "run").read_text()
INSTALLERS = ("pip", "apt-get")
SHOWN_ONLY = ("text", "ini", "toml", "json")  # output or configuration: nothing to run
FENCE = re.compile(r"^(\s*)```(.*)$")


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, info string, body) of each fenced block."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
            out.append((i + 1, m.group(2).strip(), "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return out


BLOCKS = {_name(p): _blocks(p) for p in DOCS}


def _file_name(body: str) -> str | None:
    """``name.py`` where the block's first line is ``# name.py``."""
    m = re.fullmatch(r"# (\w+\.py)", body.splitlines()[0])
    return m.group(1) if m else None


def _unique(lang: str) -> list[pytest.param]:
    """One test per distinct block, named by where it first appears, with the pages it appears on."""
    seen: dict[str, list[str]] = {}
    first: dict[str, str] = {}
    for page, blocks in BLOCKS.items():
        for line, info, body in blocks:
            if info == lang:
                seen.setdefault(body, []).append(page)
                first.setdefault(body, f"{page}:{line}")
    return [pytest.param(body, pages, id=first[body]) for body, pages in seen.items()]


def _page_files(pages: list[str]) -> dict[str, str]:
    """The named python files (``# serve.py``) of these pages, for their bash blocks."""
    return {name: body for page in pages for _, info, body in BLOCKS[page]
            if info == "python" and (name := _file_name(body)) and not name.startswith("test_")}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _copy_examples(folder: Path) -> Path:
    return Path(shutil.copytree(ROOT / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__")))


def _commands(text: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and `&&` chains split."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in line.split("&&")]
    return out


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    return words


def _packages(command: str) -> set[str]:
    words = _words(command)
    if words[:3] == ["python3", "-m", "pip"]:
        words = words[2:]
    return {w for w in words[2:] if not w.startswith("-")} if words and words[0] in INSTALLERS else set()


def _runs_the_suite(command: str) -> bool:
    words = _words(command)
    return (words[:1] == ["pytest"] or words[:3] == ["python3", "-m", "pytest"]) and "tests" in words


def _with_extras(package: str) -> set[str]:
    """What installing ``package`` installs: itself and, for ``X[a,b]``, ``X``, ``X[a]`` and ``X[b]`` (so a page's
    ``.[test]`` is covered by CI's ``.[test,hf]``)."""
    m = re.fullmatch(r"(.+)\[([\w,-]+)\]", package)
    if m is None:
        return {package}
    extras = m.group(2).split(",")
    return {m.group(1)} | {f"{m.group(1)}[{','.join(c)}]" for n in range(1, len(extras) + 1)
                           for c in itertools.combinations(extras, n)}


CI_PACKAGES = set().union(*(_with_extras(p) for c in _commands(CI) for p in _packages(c)))
CI_TEST = next(c for c in _commands(CI) if _runs_the_suite(c))


def _here(command: str) -> str:
    """The command run by this interpreter: `pytest` and `python3` as its first word (after VAR=value)."""
    m = re.match(r"((?:[A-Z_]+=\S*\s+)*)(pytest|python3)(?=\s)", command)
    if m is None:
        return command
    exe = shlex.quote(sys.executable) + (" -m pytest" if m.group(2) == "pytest" else "")
    return m.group(1) + exe + command[m.end():]


def test_every_block_says_what_it_is():
    """A block runs (python, bash) or says it only shows something; a fence inside a list or a note would
    hide its block from these tests."""
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m:
                assert not m.group(1), f"{_name(path)}:{n}: an indented fence"
        for line, info, _ in BLOCKS[_name(path)]:
            assert info in ("python", "bash") + SHOWN_ONLY, f"{_name(path)}:{line}: a block marked {info!r}"
    assert len(_unique("python")) >= 5 and len(_unique("bash")) >= 2


def test_the_readme_is_short_and_shows_the_ci_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is the front page: move the details to docs/"
    bash = [c for _, info, body in BLOCKS["README.md"] if info == "bash" for c in _commands(body)]
    assert CI_TEST in bash, f"the README does not show CI's test command {CI_TEST!r}"


@pytest.mark.parametrize("body, pages", _unique("python"))
def test_python_block_runs(body, pages, tmp_path):
    name = _file_name(body) or "snippet.py"
    if name.startswith("test_"):
        folder = _copy_examples(tmp_path)
        cmd = [sys.executable, "-m", "pytest", "-p", "cudagraph", "-q", "-p", "no:cacheprovider", name]
    else:
        folder = tmp_path
        cmd = [sys.executable, name]
    (folder / name).write_text(body)
    p = subprocess.run(cmd, cwd=folder, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("body, pages", _unique("bash"))
def test_bash_block_runs(body, pages, tmp_path):
    run = []
    for command in _commands(body):
        if _words(command)[0] in INSTALLERS or _packages(command):
            assert _packages(command) <= CI_PACKAGES, f"{command!r}: CI does not install this"
        elif _runs_the_suite(command):
            assert command == CI_TEST, f"{command!r} is not the test command CI runs ({CI_TEST!r})"
        else:
            run.append(_here(command))
    if not run:
        return
    _copy_examples(tmp_path)
    for name, text in _page_files(pages).items():
        (tmp_path / name).write_text(text)
    p = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(run)], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_the_suite_counts_on_the_fault_page_are_the_tables():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_bad_input_plugin as plugin_table
        import test_bad_input_runner as runner_table
        import test_faults_mpi as mpi_table
        import test_faults_worker as worker_table
    finally:
        sys.path.pop(0)
    text = " ".join((ROOT / "docs" / "faults.md").read_text().split())  # a page may wrap its lines anywhere
    assert f"worker faults survived: {len(worker_table.ROWS)} rows" in text
    assert f"MPI rank faults: {len(mpi_table.ROWS)} rows" in text
    runner_rows = len(runner_table.BUILD) + len(runner_table.RUN) + len(runner_table.OTHER)
    plugin_rows = len(plugin_table.OPTIONS) + len(plugin_table.AT_IMPORT) + len(plugin_table.FIXTURE_ARGS) + len(plugin_table.SHAPES)
    assert f"library arguments: {runner_rows} rows" in text
    assert f"bad arguments an engine passes: {plugin_rows} rows" in text


def test_the_problem_kinds_on_the_verdicts_page_are_the_records():
    from cudagraph_lifecycle.record import FAILING, NOTES, STRICT_FAILING

    text = (ROOT / "docs" / "verdicts.md").read_text()
    section = text[text.index("\n## Problems"):].split("\n## ", 2)[1]
    rows = re.findall(r"^\| `(\w+)` \|.*\| (yes|under `strict`|no) \|$", section, re.M)
    assert sorted(k for k, _ in rows) == sorted(FAILING + STRICT_FAILING + NOTES), "a problem kind missing or doubled"
    assert {k for k, fails in rows if fails == "yes"} == set(FAILING)
    assert {k for k, fails in rows if fails == "no"} == set(NOTES)


def test_the_generated_reference_renders():
    """What the MkDocs hook puts in place of each marker; the library's variables are described by hand."""
    from pytest_cudagraph.settings import LIBRARY_VARIABLES, OPTIONS

    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "hooks" / "generate.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    for path in DOCS[1:]:
        assert "<!-- generated:" not in hook.render(path.read_text(), _name(path))
    source = (ROOT / "docs" / "reference.md").read_text()
    reference = hook.render(source)
    # the note for readers of the Markdown file is there, and left out of the site
    assert "Reading this file in the repository?" in source and "Reading this file" not in reference
    assert "repository only" not in reference
    assert all(f"`{o.env}`" in reference and f"`{o.ini}`" in reference for o in OPTIONS)
    assert all(f"`{v}`" in reference for v in LIBRARY_VARIABLES)


def _shown(page: str, lang: str, after: str) -> str:
    """The body of the first ``lang`` block of ``page`` below the text ``after``."""
    text = (ROOT / page).read_text()
    return next(body for line, info, body in BLOCKS[page]
                if info == lang and line > text[:text.index(after)].count("\n"))


def test_the_examples_output_the_pages_show_is_what_the_examples_print(tmp_path):
    """The totals line and table header on the verdicts page and the report's totals on the CI page are a real
    run of the examples (the run they name: on a CPU, with MPI), not a hand-copied sample."""
    pytest.importorskip("mpi4py", reason="the pages show the examples run with MPI (pip install mpi4py)")
    _copy_examples(tmp_path)
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "cudagraph", "-p", "no:cacheprovider", "examples/",
                        f"--cudagraph-report={report}"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    printed = p.stdout.splitlines()
    table = _shown("docs/verdicts.md", "text", "## The terminal table").splitlines()
    assert table[0] in printed, "the table's header changed: show today's on the verdicts page"
    assert table[-1] in printed, "the totals line changed: show today's on the verdicts page"
    shown = json.loads(_shown("docs/ci.md", "json", "`totals` reads:"))
    assert shown == json.loads(report.read_text())["totals"], "show today's totals on the CI page"
