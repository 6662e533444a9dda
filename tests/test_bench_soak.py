"""The soak bench's verdict: no bytes left, and no trend of the cycle against the reference timed beside it."""

import itertools
import os
import sys

_path = list(sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_soak import summarize  # noqa: E402

sys.path[:] = _path  # the bench puts examples/ on the path for its worker: not for the tests beside this one


def _rows(cycle, reference, left=lambda i: 0):
    return [{"index": i, "verdict": "fresh", "failed": False, "pool_bytes_after_release": left(i),
             "reserved_after": 0, "growth_bytes": 0, "cycle_ms": cycle(i), "reference_ms": reference(i)}
            for i in range(200)]


def _noisy(base):
    wobble = itertools.cycle([0.96, 1.0, 1.04, 0.98, 1.02])
    return lambda i: base(i) * next(wobble)


def test_a_flat_soak_passes():
    sm = summarize(_rows(_noisy(lambda i: 9.0), lambda i: 1.0))
    assert sm["pass"] and sm["no_trend"] and sm["max_pool_bytes_after_release"] == 0


def test_a_host_that_slows_partway_slows_the_reference_too_and_passes():
    slower = lambda i: 1.4 if i >= 120 else 1.0  # noqa: E731 - the step of GPU run 25, on both sides
    sm = summarize(_rows(_noisy(lambda i: 9.0 * slower(i)), lambda i: 1.0 * slower(i)))
    assert sm["cycle_ms_last20_median"] > sm["cycle_ms_first20_spread"][1]  # the raw times alone would fail
    assert sm["pass"], sm


def test_a_cycle_that_grows_alone_fails():
    sm = summarize(_rows(_noisy(lambda i: 9.0 + 0.02 * i), lambda i: 1.0))
    assert not sm["no_trend"] and not sm["pass"]


def test_bytes_left_in_a_pool_fail():
    sm = summarize(_rows(_noisy(lambda i: 9.0), lambda i: 1.0, left=lambda i: 2 << 20 if i == 150 else 0))
    assert sm["no_trend"] and not sm["pass"] and sm["max_pool_bytes_after_release"] == 2 << 20
