"""What `pip install .` ships: every package of the source tree (a subpackage missing from pyproject.toml
installs fine in editable mode and breaks a real install, such as the GPU check's), and the metadata an index
shows (classifiers, license, URLs), read from the installed project. The built sdist and wheels themselves are
checked by .ci/package."""

import os
import re
import runpy
import sys
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


def _metadata():
    from importlib import metadata

    return metadata.metadata("pytest-cudagraph")


def _urls() -> dict[str, str]:
    return dict(u.split(", ", 1) for u in _metadata().get_all("Project-URL") or ())


def test_the_installed_metadata_is_pyprojects():
    """An install older than pyproject.toml fails here first: reinstall (pip install -e ".[test]")."""
    md, project = _metadata(), tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert md.get_all("Classifier") == project["classifiers"]
    assert _urls() == project["urls"]
    assert md["License-Expression"] == project["license"]


def test_the_classified_pythons_are_the_tested_ones():
    """Exactly the versions a run tests: tox.ini's envlist (CI's) and the GPU check's (scripts/gpu_check.sh
    fetches wheels for it), each allowed by requires-python; in CI, the Python running this is one of them."""
    from packaging.specifiers import SpecifierSet

    md = _metadata()
    classifiers = md.get_all("Classifier")
    classified = {c.rsplit(" :: ", 1)[1] for c in classifiers
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    tested = {f"3.{minor}" for minor in re.findall(r"\bpy3(\d+)", (ROOT / "tox.ini").read_text())}
    tested |= set(re.findall(r"--python-version (3\.\d+)", (ROOT / "scripts" / "gpu_check.sh").read_text()))
    assert classified == tested, f"classified {sorted(classified)}, tested {sorted(tested)}"
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert all(f"{v}.0" in SpecifierSet(md["Requires-Python"]) for v in classified)
    if os.environ.get("CI"):
        assert f"{sys.version_info[0]}.{sys.version_info[1]}" in classified, "CI runs a Python not classified"


def test_the_license_is_apache_2_in_full():
    md = _metadata()
    assert md["License-Expression"] == "Apache-2.0" and "LICENSE" in md.get_all("License-File")
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    # PEP 639: the expression replaces the license classifier (setuptools refuses both)
    assert not [c for c in md.get_all("Classifier") if c.startswith("License ::")]


def test_the_urls_name_the_changelogs_repository():
    """Homepage, Documentation, Changelog and Issues, all under the repository CHANGELOG.md's links name: the
    host is chosen once, in both."""
    urls = _urls()
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls)
    base = re.search(r"^\[Unreleased\]: (https://\S+?)/compare/", (ROOT / "CHANGELOG.md").read_text(), re.M)[1]
    assert all(u == base or u.startswith(base + "/") for u in urls.values()), f"not under {base}: {urls}"


def test_the_classifiers_are_ones_pypi_accepts():
    trove = pytest.importorskip("trove_classifiers", reason="the test extra has it: pip install -e \".[test]\"")
    assert set(_metadata().get_all("Classifier")) <= trove.classifiers


@pytest.mark.parametrize("value, optional", [(None, True), ("auto", True), ("1", False), ("0", None)])
def test_the_build_switch(monkeypatch, value, optional):
    """CUDAGRAPH_BUILD_EXTENSION: unset or auto, the extension where it builds; 1, required; 0, none."""
    import setuptools

    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    if value is None:
        monkeypatch.delenv("CUDAGRAPH_BUILD_EXTENSION", raising=False)
    else:
        monkeypatch.setenv("CUDAGRAPH_BUILD_EXTENSION", value)
    runpy.run_path(str(ROOT / "setup.py"))
    assert [e.optional for e in got["ext_modules"]] == ([] if optional is None else [optional])


def test_a_bad_build_switch_is_refused(monkeypatch):
    monkeypatch.setenv("CUDAGRAPH_BUILD_EXTENSION", "yes")
    with pytest.raises(SystemExit, match="CUDAGRAPH_BUILD_EXTENSION='yes': use 0"):
        runpy.run_path(str(ROOT / "setup.py"))
