"""The pool sanitizer: judgments on the ledger (a stale capture stopped before the allocator sees it;
findings about graph pools) and its two program-wide entries (``CUDAGRAPH_SANITIZE``, and
``python -m cudagraph_lifecycle.sanitizer PROGRAM.py``)."""

from .. import observe
from .env import global_sanitizer, install_from_env
from .findings import FINDING_KINDS, Finding
from .pool_sanitizer import PoolSanitizer
from .stale import explain, stale_error

observe.hooks.explain = explain  # a capture into a dead pool is explained the same whether a judge rules or not

__all__ = ["FINDING_KINDS", "Finding", "PoolSanitizer", "global_sanitizer", "install_from_env", "stale_error"]
