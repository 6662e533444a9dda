"""Specification: every bad input to the library's runner, pool, backends and sanitizer gets a clear error.

Each row: what the user did, the error type, and the words the message must contain (what they set and how
to fix it). A row that stops raising, raises another type or loses its words fails.
"""

import os

import pytest
import torch

from cudagraph_lifecycle import (
    BackendUnavailableError,
    ConfigError,
    CUDAGraphRunner,
    GraphInputError,
    LazyPool,
    PoolSanitizer,
    RetiredPoolError,
    RunnerReleasedError,
    get_backend,
)
from cudagraph_lifecycle.backends.cuda import CudaBackend, _segment_pool, missing_features
from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.cycle.engine import Engine, check_pool_ids
from cudagraph_lifecycle.sanitizer import install_from_env


def runner(**kw):
    args = {"forward": lambda x: x * 2, "batch_sizes": [1, 2, 4], "feature_shape": (8,), "backend": SimBackend()}
    args.update(kw)
    return CUDAGraphRunner(args.pop("forward"), args.pop("batch_sizes"), args.pop("feature_shape"), **args)


def released():
    r = runner()
    r.release()
    return r


def retired_pool_capture():
    pool = LazyPool(SimBackend(), mode="handle")
    pid = pool.acquire(0)
    pool.retire()
    pool.check_capturable(pid, 0)


BUILD = [
    ("empty batch sizes", dict(batch_sizes=[]), ConfigError, ["batch_sizes is empty", "e.g. batch_sizes=[1, 2, 4, 8]"]),
    ("negative batch size", dict(batch_sizes=[1, -2]), ConfigError, ["must be positive", "[-2]"]),
    ("duplicate batch sizes", dict(batch_sizes=[2, 2]), ConfigError, ["duplicates [2]", "list each size once"]),
    ("float batch size", dict(batch_sizes=[1.5]), ConfigError, ["must be ints", "[1.5]"]),
    ("bool batch size", dict(batch_sizes=[True]), ConfigError, ["must be ints"]),
    ("batch sizes not iterable", dict(batch_sizes=4), ConfigError, ["iterable of positive ints", "4"]),
    ("feature shape of strings", dict(feature_shape=("a",)), ConfigError, ["feature_shape must be a tuple of ints"]),
    ("zero feature size", dict(feature_shape=(0,)), ConfigError, ["positive sizes", "(0,)"]),
    ("negative warmup", dict(warmup=-1), ConfigError, ["warmup must be an int >= 0", "-1"]),
    ("dtype as a string", dict(dtype="float16"), ConfigError, ["dtype must be a torch.dtype", "'float16'"]),
    ("forward not callable", dict(forward=3), ConfigError, ["forward must be callable", "int"]),
    ("empty extra keys", dict(extra_keys=[]), ConfigError, ["extra_keys is empty", "leave it None"]),
    ("duplicate extra keys", dict(extra_keys=[{"k": 1}, {"k": 1}]), ConfigError, ["extra_keys has duplicates"]),
    ("unhashable extra key value", dict(extra_keys=[{"mask": [1, 2]}]), ConfigError,
     ["extra_keys[0] mask=[1, 2]", "cannot key a graph", "hashable"]),
    ("device out of range", dict(device=5), ConfigError, ["device index 5", "0..1"]),
    ("unknown backend name", dict(backend="tpu"), ConfigError, ["unknown backend 'tpu'", "auto, cuda, sim"]),
    ("cuda without a GPU", dict(backend="cuda"), BackendUnavailableError, ["backend 'cuda'", "choose backend 'sim'"]),
    ("one check as a string", dict(checked="padding"), ConfigError,
     ["checked='padding'", "a list of checks from ['capture', 'padding', 'outputs']"]),
    ("unknown check", dict(checked=["padding", "nans"]), ConfigError,
     ["checked=['padding', 'nans']", "unknown check(s) ['nans']", "choose from"]),
    ("checked as a number", dict(checked=2), ConfigError, ["checked=2", "give True, False, None or a list"]),
    ("recheck every 0 replays", dict(recheck_every=0), ConfigError, ["recheck_every must be an int >= 1", "got 0"]),
    ("recheck every as a string", dict(recheck_every="16"), ConfigError, ["recheck_every", "got '16'"]),
    ("unknown capture watch", dict(watch="smallest"), ConfigError,
     ["watch must be 'each'", "or 'largest'", "got 'smallest'"]),
]


@pytest.mark.parametrize("what, kwargs, error, words", BUILD, ids=[r[0] for r in BUILD])
def test_building_a_runner(what, kwargs, error, words):
    with pytest.raises(error) as e:
        runner(**kwargs)
    for w in words:
        assert w in str(e.value), (what, str(e.value))


RUN = [
    ("not a tensor", lambda r: r.run([1.0] * 8), GraphInputError, ["must be a torch.Tensor", "list"]),
    ("wrong feature shape", lambda r: r.run(torch.ones(2, 7)), GraphInputError,
     ["input shape (2, 7)", "feature_shape=(7,)"]),
    ("empty batch", lambda r: r.run(torch.ones(0, 8)), GraphInputError, ["input batch is 0"]),
    ("wrong dtype", lambda r: r.run(torch.ones(2, 8, dtype=torch.float64)), GraphInputError,
     ["torch.float64 != runner dtype torch.float32", "x.to(torch.float32)"]),
    ("unhashable key at run", lambda r: r.run(torch.ones(2, 8), mask=[1]), GraphInputError,
     ["run() keyword mask=[1]", "hashable"]),
    ("after release", lambda r: released().run(torch.ones(2, 8)), RunnerReleasedError,
     ["was released", "Build a new runner"]),
    ("retired pool id", lambda r: retired_pool_capture(), RetiredPoolError, ["was retired", "acquire(device)"]),
]


@pytest.mark.parametrize("what, call, error, words", RUN, ids=[r[0] for r in RUN])
def test_running_a_runner(what, call, error, words):
    with pytest.raises(error) as e:
        call(runner())
    for w in words:
        assert w in str(e.value), (what, str(e.value))


def _runner_under(**env):
    """A runner built with ``env`` set (its checks chosen by CUDAGRAPH_CHECKED)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return runner()
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


OTHER = [
    ("CUDAGRAPH_CHECKED not a boolean", lambda: _runner_under(CUDAGRAPH_CHECKED="maybe"), ConfigError,
     ["CUDAGRAPH_CHECKED='maybe' is not a boolean", "set it to 1", "or 0, or unset it"]),
    ("pool mode unknown", lambda: LazyPool(SimBackend(), mode="shared"), ConfigError,
     ["unknown pool mode 'shared'", "auto, mempool, handle"]),
    ("sim devices zero", lambda: SimBackend(devices=0), ConfigError, ["SimBackend(devices=0)", "positive int"]),
    ("sanitizer mode unknown", lambda: PoolSanitizer("sim", mode="loud"), ConfigError,
     ["PoolSanitizer(mode='loud')", "'on' or 'strict'"]),
    ("CUDAGRAPH_SANITIZE unknown", lambda: install_from_env({"CUDAGRAPH_SANITIZE": "maybe"}), ConfigError,
     ["CUDAGRAPH_SANITIZE='maybe'", "1 (or on), strict, or 0"]),
    ("CUDAGRAPH_SANITIZE_BACKEND unknown",
     lambda: install_from_env({"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_SANITIZE_BACKEND": "tpu"}), ConfigError,
     ["CUDAGRAPH_SANITIZE_BACKEND='tpu'", "auto, cuda, sim"]),
    ("expandable_teardown unknown", lambda: PoolSanitizer("sim", expandable_teardown="allow"), ConfigError,
     ["PoolSanitizer(expandable_teardown='allow')", "'refuse' (the default) or 'report'"]),
    ("CUDAGRAPH_EXPANDABLE_TEARDOWN unknown",
     lambda: install_from_env({"CUDAGRAPH_SANITIZE": "1", "CUDAGRAPH_EXPANDABLE_TEARDOWN": "ignore"}), ConfigError,
     ["CUDAGRAPH_EXPANDABLE_TEARDOWN='ignore'", "refuse (the default", "or report"]),
    ("engine without run or release", lambda: Engine(object()), ConfigError,
     ["no run(x) (or __call__) and no release()", "Optional: capture()"]),
    ("engine without release", lambda: Engine(lambda x: x), ConfigError, ["has no release()"]),
    ("pool_ids() of plain ids", lambda: check_pool_ids([(0, 1)], "Engine.pool_ids()"), ConfigError,
     ["Engine.pool_ids() returned [(0, 1)]", "(device, pool_id) pairs", "[(0, (0, 1))]"]),
    ("pool_ids() not a list", lambda: check_pool_ids(5, "Engine.pool_ids()"), ConfigError, ["returned 5"]),
    ("snapshot without pool ids", lambda: _segment_pool({"device": 0, "total_size": 2 << 20}),
     BackendUnavailableError, ["no 'segment_pool_id'", "cannot be read", "torch >= 2.11"]),
]


def test_private_torch_apis_are_feature_detected(monkeypatch):
    """A build without the private allocator functions: each names what is off, and the calls do nothing."""
    names = ("_cuda_getPoolUseCount", "_host_emptyCache", "_cuda_endAllocateToPool", "_cuda_releasePool")
    for name in names:
        monkeypatch.delattr(torch._C, name, raising=False)
    missing = missing_features()
    assert set(missing) == set(names)
    assert "the host allocator's flush" in missing["_host_emptyCache"]
    be = CudaBackend()
    be.host_empty_cache()
    be.release_pool_reference((0, 1))
    assert be.end_capture_routing((0, 1)) is False


@pytest.mark.parametrize("what, call, error, words", OTHER, ids=[r[0] for r in OTHER])
def test_other_library_inputs(what, call, error, words):
    with pytest.raises(error) as e:
        call()
    for w in words:
        assert w in str(e.value), (what, str(e.value))


def test_a_capture_stopped_part_way_leaves_the_runner_able_to_capture_again():
    calls = []

    def fwd(x):
        calls.append(x.shape[0])
        if len(calls) == 3:  # the second graph's warmup: as if the user pressed Ctrl-C
            raise KeyboardInterrupt
        return x * 2

    r = runner(forward=fwd, warmup=1)
    with pytest.raises(KeyboardInterrupt):
        r.capture()
    assert r.keys == [] and r.outputs_alive() == 0  # rolled back: no graph, no output
    y = r.run(torch.ones(3, 8))  # captures again (was: a bare KeyError)
    assert torch.equal(y, torch.full((3, 8), 2.0)) and r.stats.fallbacks == {}
    del y  # a view into the pool: it would pin it
    assert r.release().clean


def test_an_interrupt_inside_a_capture_ends_the_capture():
    be = SimBackend()
    armed = [False]

    def fwd(x):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return x + 1

    r = runner(forward=fwd, backend=be, warmup=0)
    armed[0] = True
    with pytest.raises(KeyboardInterrupt):
        r.capture()
    assert be.poisoned is None and r.run(torch.ones(2, 8)).sum().item() == 32  # the stream is not left capturing
    assert r.release().clean


def test_an_output_without_a_batch_dim_falls_back_with_the_reason():
    r = runner(forward=lambda x: (x * 2).sum())
    y = r.run(torch.ones(3, 8))
    assert y.item() == 48 and r.stats.fallbacks == {"capture_failed": 1}
    assert "every output needs the batch as its first dim" in r.stats.failures[0]
    assert r.release().clean


def test_get_backend_by_name_is_not_a_private_world():
    assert get_backend("sim") is get_backend("sim")
