"""The optional compiled path of the capture wrappers (src/cudagraph_lifecycle/observe/_capture.c); everything
else is in pyproject.toml. Where it cannot be built (no compiler or no Python headers) the install goes on
without it, and the observation layer runs its Python path (observe/compiled.py).

CUDAGRAPH_BUILD_EXTENSION chooses at build time: `auto` (or unset) builds it where it can, `1` requires it (the
build fails without a compiler: for a wheel that must have it), `0` never builds it (a py3-none-any wheel)."""

import os

from setuptools import Extension, setup

SWITCH = "CUDAGRAPH_BUILD_EXTENSION"
OPTIONAL = {"auto": True, "": True, "1": False, "0": None}  # the Extension's optional=; None: not built

choice = os.environ.get(SWITCH, "auto").strip().lower()
if choice not in OPTIONAL:
    raise SystemExit(f"{SWITCH}={os.environ[SWITCH]!r}: use 0 (no extension), 1 (required) or auto (the default)")
# The C source ships in the sdist either way (MANIFEST.in), so an sdist built with 0 still builds it.
setup(ext_modules=[] if OPTIONAL[choice] is None else [
    Extension("cudagraph_lifecycle.observe._capture", ["src/cudagraph_lifecycle/observe/_capture.c"],
              optional=OPTIONAL[choice])])
