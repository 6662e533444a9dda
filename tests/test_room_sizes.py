"""Rooms the next engineer can read (docs/ARCHITECTURE.md): every module of the library and the plugin at most
500 lines, every class at most 300. A room that outgrows them is split by job, not given a larger limit."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE_LINES, CLASS_LINES = 500, 300


def _modules() -> list[Path]:
    return sorted(p for folder in (ROOT / "src" / "cudagraph_lifecycle", ROOT / "pytest_cudagraph")
                  for p in folder.rglob("*.py"))


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    lines = len(text.splitlines())
    out = [f"{path.name}: {lines} lines (at most {MODULE_LINES})"] if lines > MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
            out.append(f"{path.name}: class {node.name} {node.end_lineno - node.lineno + 1} lines "
                       f"(at most {CLASS_LINES})")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_room_is_small_enough_to_read(path):
    assert not _oversized(path)


def test_the_size_test_sees_an_oversized_module_and_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + body + "\n" + "\n" * (MODULE_LINES - CLASS_LINES))
    assert _oversized(big) == [f"big.py: {MODULE_LINES + 1} lines (at most {MODULE_LINES})",
                               f"big.py: class Big {CLASS_LINES + 1} lines (at most {CLASS_LINES})"]
