"""Functions sent by value to a worker or a rank keep the file their code was written in: errors raised there
are reported at that file's line (cloudpickle 3.1 and later name every such code object `<dynamic-code>`)."""

from __future__ import annotations

import pickle
import pickletools
import types

from pytest_cudagraph import by_value


def _closure():
    k = 3

    def outer(x):
        def inner():
            return x + k

        return inner()

    return outer


def _globals_in(data: bytes) -> set[str]:
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, str):
            strings.append(arg)
        if op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def test_a_closure_keeps_its_file_and_lines_and_runs():
    fn = _closure()
    back = pickle.loads(by_value.dumps(fn))
    assert back(1) == 4
    inner = next(c for c in back.__code__.co_consts if isinstance(c, types.CodeType))
    for code, original in ((back.__code__, fn.__code__), (inner, next(
            c for c in fn.__code__.co_consts if isinstance(c, types.CodeType)))):
        assert code.co_filename == __file__ and code.co_firstlineno == original.co_firstlineno
        assert list(code.co_lines()) == list(original.co_lines())


def test_code_travels_through_marshal_whatever_cloudpickle_does_with_file_names():
    """The guard that holds where the installed cloudpickle (older than 3.1) keeps file names itself."""
    data = by_value.dumps(_closure())
    assert "marshal.loads" in _globals_in(data) and b"<dynamic-code>" not in data


def test_an_error_raised_by_value_names_the_line_that_raised():
    def broken():
        raise ValueError("no weights")

    back = pickle.loads(by_value.dumps(broken))
    try:
        back()
    except ValueError as e:
        tb = e.__traceback__
        while tb.tb_next:
            tb = tb.tb_next
        assert tb.tb_frame.f_code.co_filename == __file__
        assert tb.tb_lineno == broken.__code__.co_firstlineno + 1
    else:
        raise AssertionError("the function sent by value did not raise")


def test_code_that_marshal_refuses_goes_cloudpickle_s_own_way():
    fn = _closure()
    marker = object.__new__(type("Marker", (), {"__reduce__": lambda self: (object, ())}))
    odd = types.FunctionType(fn.__code__.replace(co_consts=fn.__code__.co_consts + (marker,)), fn.__globals__,
                             fn.__name__, None, fn.__closure__)
    back = pickle.loads(by_value.dumps(odd))
    assert back(2) == 5
    assert type(back.__code__.co_consts[-1]) is object  # the refused constant went through pickle
