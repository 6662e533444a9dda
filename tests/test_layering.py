"""The layering the architecture promises (docs/ARCHITECTURE.md): no import cycles (benches included), the
library never imports pytest, and the plugin imports torch only when something uses it."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cudagraph_lifecycle": ROOT / "src" / "cudagraph_lifecycle", "pytest_cudagraph": ROOT / "pytest_cudagraph",
            "bench": ROOT / "bench"}  # (the benches too: none may import another that imports it back)


def _module_name(pkg: str, path: Path) -> str:
    rel = path.relative_to(PACKAGES[pkg]).with_suffix("")
    parts = [pkg, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of both packages -> the modules of both packages it imports (at any depth of the code,
    except under ``if TYPE_CHECKING``)."""
    modules, compiled = {}, set()
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            modules[_module_name(pkg, path)] = path
        compiled |= {_module_name(pkg, path) for path in folder.rglob("*.c")}  # extension modules import nothing
    graph = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        type_checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in type_checking:
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
