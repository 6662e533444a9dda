"""What `pip install .` ships: every package of the source tree (a subpackage missing from pyproject.toml
installs fine in editable mode and breaks a real install, such as the GPU check's)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_found_by_pyproject():
    from setuptools import find_packages

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    listed = {p for where in conf["where"] for p in find_packages(str(ROOT / where), include=conf["include"])}
    found = {".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src").rglob("__init__.py")
             if "egg-info" not in str(p)}
    found |= {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pytest_cudagraph").rglob("__init__.py")}
    assert found == listed


def test_the_version_is_one():
    """pytest_cudagraph.__version__, the package's metadata and pyproject.toml say the same version."""
    from importlib import metadata

    import pytest_cudagraph

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert pytest_cudagraph.__version__ == version == metadata.version("pytest-cudagraph")
    assert f"## [{version}]" in (ROOT / "CHANGELOG.md").read_text()  # every release has its entry


def test_the_report_schema_ships_with_the_package():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.schema.json" in conf["pytest_cudagraph"] and (ROOT / "pytest_cudagraph" / "report.schema.json").exists()
