"""What cannot travel by reference (closures, lambdas, what ``__main__`` defines) pickled by value, keeping
where its code was written.

cloudpickle 3.1 and later send every code object with its file name replaced by ``<dynamic-code>``, so an
error raised in a factory defined inside a test would be reported at ``<dynamic-code>:18``. The code objects
travel here through marshal instead (the worker runs the same interpreter), which keeps every field; any
that marshal refuses (a code object built with foreign constants) go cloudpickle's own way.
"""

from __future__ import annotations

import io
import marshal
import pickle
import types
from collections import ChainMap
from typing import Any

_PICKLER: Any = None
_THEIR_CODE_REDUCE: Any = None


def _code_reduce(code: types.CodeType) -> tuple:
    try:
        return marshal.loads, (marshal.dumps(code),)
    except ValueError:
        return _THEIR_CODE_REDUCE(code)


def _pickler() -> Any:
    """cloudpickle's Pickler with code objects sent through marshal, made at first use: a session that starts
    no worker never imports cloudpickle."""
    global _PICKLER, _THEIR_CODE_REDUCE
    if _PICKLER is None:
        import cloudpickle

        _THEIR_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]

        class Pickler(cloudpickle.Pickler):
            dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)

        _PICKLER = Pickler
    return _PICKLER


def dumps(obj: Any) -> bytes:
    """``obj`` pickled by value where it must be (cloudpickle's rules); ``pickle.loads`` loads it."""
    buf = io.BytesIO()
    _pickler()(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
