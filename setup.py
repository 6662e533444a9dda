"""The optional compiled path of the capture wrappers (src/cudagraph_lifecycle/observe/_capture.c); everything
else is in pyproject.toml. Where it cannot be built (no compiler or no Python headers) the install goes on
without it, and the observation layer runs its Python path (observe/compiled.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cudagraph_lifecycle.observe._capture", ["src/cudagraph_lifecycle/observe/_capture.c"],
                             optional=True)])
