import os
import sys

import pytest

# gpu_cases is imported by name inside spawned workers too.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _clean_cudagraph_env(monkeypatch):
    # The plugin's own runs (pytester) must not inherit this session's settings, e.g. CI's REQUIRE_MPI.
    for key in list(os.environ):
        if key.startswith("CUDAGRAPH_") and key != "CUDAGRAPH_CONFORMANCE_BACKEND":
            monkeypatch.delenv(key)
