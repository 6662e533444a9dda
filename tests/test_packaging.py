"""What `pip install .` ships: every package of the source tree (a subpackage missing from pyproject.toml
installs fine in editable mode and breaks a real install, such as the GPU check's)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src").rglob("__init__.py")
             if "egg-info" not in str(p)}
    found |= {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pytest_cudagraph").rglob("__init__.py")}
    assert found == listed
