"""The optional compiled paths: the capture wrappers' (src/cudagraph_lifecycle/observe/_capture.c) and checked
mode's op watch (src/cudagraph_lifecycle/checks/_watch.c); everything else is in pyproject.toml. Where they
cannot be built (no compiler or no Python headers) the install goes on without them, and the observation layer
and the watch run their Python paths (observe/compiled.py, checks/capture_watch.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cudagraph_lifecycle.observe._capture", ["src/cudagraph_lifecycle/observe/_capture.c"],
                             optional=True),
                   Extension("cudagraph_lifecycle.checks._watch", ["src/cudagraph_lifecycle/checks/_watch.c"],
                             optional=True)])
