"""The layering the architecture promises (docs/ARCHITECTURE.md): the map's floors (every module on it, every
file it names there, each floor importing only from the floors below), no import cycles (benches included), no
two modules importing each other in any way (in a function, under ``if TYPE_CHECKING``), the library never
imports pytest, and the plugin imports torch only when something uses it."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cudagraph_lifecycle": ROOT / "src" / "cudagraph_lifecycle", "pytest_cudagraph": ROOT / "pytest_cudagraph",
            "bench": ROOT / "bench"}  # (the benches too: none may import another that imports it back)


def _module_name(pkg: str, path: Path, packages: dict[str, Path] = PACKAGES) -> str:
    rel = path.relative_to(packages[pkg]).with_suffix("")
    parts = [pkg, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(type_checking: bool = False, packages: dict[str, Path] = PACKAGES) -> dict[str, set[str]]:
    """Every module of the packages -> the modules of the packages it imports (at any depth of the code; under
    ``if TYPE_CHECKING`` only where ``type_checking``)."""
    modules, compiled = {}, set()
    for pkg, folder in packages.items():
        for path in folder.rglob("*.py"):
            modules[_module_name(pkg, path, packages)] = path
        compiled |= {_module_name(pkg, path, packages) for path in folder.rglob("*.c")}  # (importing nothing)
    graph = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        for_checkers = set() if type_checking else {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in for_checkers:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                # `from pkg import sub` depends on the submodule; `from mod import name` on the module
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules or f"{mod}.{a.name}" in compiled else mod
                           for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_cycle_test_sees_a_planted_cycle(monkeypatch):
    graph = _imports()
    graph["cudagraph_lifecycle.errors"] = {"cudagraph_lifecycle.runner"}  # runner imports errors
    monkeypatch.setattr(sys.modules[__name__], "_imports", lambda: graph)
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "cudagraph_lifecycle.errors" in str(e)
    else:
        raise AssertionError("a planted cycle was not found")


def _mutual_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} and {b} import each other"
                  for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))


def test_no_two_modules_import_each_other():
    """Not in a function, not under ``if TYPE_CHECKING`` either: of two modules that need each other, what
    both need goes to one of them (or a module both import), so that the dependency runs one way."""
    assert not _mutual_imports(_imports(type_checking=True))


def test_the_mutual_import_test_sees_a_planted_pair(tmp_path):
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n\n    return b\n")  # in a function
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import f\n")
    (pkg / "c.py").write_text("import planted.a\n")  # one way: no pair
    graph = _imports(type_checking=True, packages={"planted": pkg})
    assert _mutual_imports(graph) == ["planted.a and planted.b import each other"]
    assert _imports(packages={"planted": pkg})["planted.b"] == set()  # the cycle test leaves TYPE_CHECKING out


MAP_EXCEPTIONS = {("cudagraph_lifecycle.sanitizer", "cudagraph_lifecycle.checks.mode")}  # named in the map's text


def _floors() -> tuple[dict[str, int], list[Path]]:
    """The map of docs/ARCHITECTURE.md ("## The floors"): each module prefix -> its floor (0 the top), and
    every path the map names. Floors are separated by a line holding only ``|``; an entry's names are the
    line's first column, its indentation says which folder above it holds them."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## The floors", 1)[1].split("```", 2)[1]
    floor, prefixes, named, folders = 0, {}, [], {}
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        if line.strip() == "|":
            floor += 1
            continue
        if not line.strip() or indent > 8:  # a description's continuation
            continue
        column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names = [w.split()[0] for w in column.split(", ")
                 if re.fullmatch(r"[\w*./]+(?:\.py|\.c|\.json|/)", w.split()[0])]
        for name in names:
            folder = ROOT if indent == 0 else folders[indent - 2]
            path = folder / name.rstrip("/")
            named.append(path)
            if name.endswith("/"):
                folders[indent] = path
            if indent <= 2 and not name.endswith((".c", ".json")) and path.name != "__init__.py":
                rel = path.relative_to(ROOT / "src") if path.is_relative_to(ROOT / "src") else path.relative_to(ROOT)
                prefixes[".".join(rel.with_suffix("").parts) if name.endswith(".py") else ".".join(rel.parts)] = floor
    return prefixes, named


def _floor_of(module: str, prefixes: dict[str, int]) -> int | None:
    found = [(len(p), f) for p, f in prefixes.items() if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


def test_every_module_is_on_the_map_and_every_file_it_names_exists():
    prefixes, named = _floors()
    missing = [str(p.relative_to(ROOT)) for p in named if not list(p.parent.glob(p.name))]
    assert not missing, f"docs/ARCHITECTURE.md names files that are not there: {missing}"
    graph = _imports()
    unplaced = [m for m in graph if not m.startswith("bench") and m != "cudagraph_lifecycle"
                and _floor_of(m, prefixes) is None]
    assert not unplaced, f"modules the map in docs/ARCHITECTURE.md does not show: {unplaced}"
    shown = {p for p in named if p.suffix == ".py"}
    for pkg in ("cudagraph_lifecycle", "pytest_cudagraph"):
        for path in PACKAGES[pkg].rglob("*.py"):  # each file with code by name, not only by its folder
            body = ast.parse(path.read_text()).body
            if path.name in ("__init__.py", "__main__.py") and not any(
                    isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in body):
                continue  # a package's exports or a command's entry point: its folder's line says it
            assert path in shown or any(path.match(str(p)) for p in shown), \
                f"{path.relative_to(ROOT)} is not named on the map in docs/ARCHITECTURE.md"


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    prefixes, _ = _floors()
    floor = {m: _floor_of(m, prefixes) for m in graph if not m.startswith("bench") and m != "cudagraph_lifecycle"}
    return sorted(f"{m} (floor {floor[m]}) imports {d} (floor {floor[d]})"
                  for m in floor for d in graph[m] if d in floor and floor[d] < floor[m]
                  and not any(m.startswith(a) and d == b for a, b in MAP_EXCEPTIONS))


def test_each_floor_imports_only_from_the_floors_below():
    assert not _upward_imports(_imports())


def test_the_floor_test_sees_a_planted_upward_import():
    graph = _imports()
    graph["cudagraph_lifecycle.ledger.pools"] = graph["cudagraph_lifecycle.ledger.pools"] | {"cudagraph_lifecycle.runner"}
    assert _upward_imports(graph) == ["cudagraph_lifecycle.ledger.pools (floor 4) imports cudagraph_lifecycle.runner "
                                      "(floor 1)"]


def test_the_library_never_imports_pytest():
    for path in PACKAGES["cudagraph_lifecycle"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("pytest", "_pytest", "pytest_cudagraph") for n in names), path


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAGRAPH_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=True).stdout.strip()


def test_importing_the_plugin_imports_no_torch():
    assert _python("import sys, pytest_cudagraph.plugin, cudagraph_lifecycle; print('torch' in sys.modules)") \
        == "False"


def test_a_session_that_does_not_use_the_plugin_imports_no_torch(pytester):
    pytester.makepyfile(test_plain='''
        import sys
        def test_one():
            assert "torch" not in sys.modules
    ''')
    pytester.makeconftest('''
        import sys
        def pytest_sessionfinish(session):
            assert "torch" not in sys.modules, "the plugin imported torch"
    ''')
    pytester.runpytest_subprocess("-p", "cudagraph").assert_outcomes(passed=1)
