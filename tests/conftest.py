import os
import sys

import pytest

# pytester's in-process runs unload the modules a run imported, and a C extension (torch's, numpy's) cannot
# be loaded twice in one process: load them before any run, whichever test files are selected
import torch  # noqa: F401

try:
    import matplotlib  # noqa: F401  (and numpy under it: the timeline test's)
except ImportError:
    pass

# gpu_cases is imported by name inside spawned workers too.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _clean_cudagraph_env(monkeypatch):
    # The plugin's own runs (pytester) must not inherit this session's settings, e.g. CI's REQUIRE_MPI.
    for key in list(os.environ):
        if key.startswith("CUDAGRAPH_") and key != "CUDAGRAPH_CONFORMANCE_BACKEND":
            monkeypatch.delenv(key)
    # pytest prints a failure's whole message in its short summary when CI or BUILD_NUMBER is set, so a
    # test that counts a finding's lines would see one more copy on CI than on a developer's machine.
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
