import pytest
import torch

from cudagraph_lifecycle import (
    ConfigError,
    CUDAGraphRunner,
    GraphInputError,
    LazyPool,
    PoolNotReleasedError,
    RetiredPoolError,
    RunnerReleasedError,
)
from cudagraph_lifecycle.backends.sim import SimBackend


def mlp(hidden=32, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(hidden, hidden, generator=g) * hidden**-0.5 for _ in range(layers)]

    def fwd(x, scale=1.0):
        for w in ws:
            x = torch.relu(x @ w) * scale
        return x

    return fwd


def make(be=None, **kw):
    kw.setdefault("batch_sizes", [1, 2, 4, 8])
    return CUDAGraphRunner(mlp(), kw.pop("batch_sizes"), (32,), backend=be or SimBackend(), **kw)


@pytest.mark.parametrize("b", [1, 2, 3, 5, 8])
def test_replay_equals_eager_with_padding(b):
    r = make()
    fwd = mlp()
    for seed in range(3):
        x = torch.randn(b, 32, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(r.run(x), fwd(x), atol=1e-6)
    assert r.stats.replays == 3 and r.stats.fallbacks == {}
    assert r.graph_size_for(b) >= b


def test_captures_largest_first_in_one_pool_on_one_stream():
    be = SimBackend()
    order, streams = [], set()

    def fwd(x):
        order.append(x.shape[0])
        streams.add(be._current_stream.id)
        return x * 2

    r = CUDAGraphRunner(fwd, [2, 8, 4], (4,), backend=be, warmup=1)
    r.capture()
    captured = order[1::2]  # warmup, capture, warmup, capture ...
    assert captured == [8, 4, 2]
    assert len(streams) == 1
    (dev, pid), = r.pool_ids
    assert be.pool_state(pid).use_count == 1 + 3  # the LazyPool's MemPool + 3 graphs


def test_warmup_runs_before_capture():
    calls = []
    r = CUDAGraphRunner(lambda x: calls.append(1) or x + 1, [4], (2,), backend=SimBackend(), warmup=3)
    r.capture()
    assert len(calls) == 4


def test_extra_keys():
    r = make(extra_keys=[{"scale": 1.0}, {"scale": 2.0}])
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    # batch 3 runs padded to 4: BLAS may sum in another order for 4 rows than for 3, and scale 2 triples the
    # magnitude over three layers, so float32's rounding differences reach a few 1e-6
    torch.testing.assert_close(r.run(x, scale=2.0), mlp()(x, scale=2.0), atol=1e-5, rtol=1e-5)
    assert len(r.keys) == 8
    r.run(x, scale=3.0)
    assert r.stats.fallbacks == {"key_not_captured": 1}


def test_fallbacks_by_reason():
    r = make(batch_sizes=[1, 2])
    out = r.run(torch.randn(5, 32))
    assert out.shape == (5, 32)
    assert r.stats.fallbacks == {"batch_over_max": 1}
    d = make(enabled=False)
    d.run(torch.randn(2, 32))
    assert d.stats.fallbacks == {"disabled": 1} and d.stats.captures == 0


def test_capture_failure_is_recorded_and_released():
    be = SimBackend()

    def fwd(x):
        if float(x.sum()) > -1e9:  # a host sync: illegal in capture
            return x * 2

    r = CUDAGraphRunner(fwd, [1, 2], (4,), backend=be)
    x = torch.randn(2, 4)
    assert torch.allclose(r.run(x), x * 2)
    st = r.stats
    assert st.capture_failures == 1 and st.fallbacks == {"capture_failed": 1}
    assert "not permitted when stream is capturing" in st.failures[0]
    rep = r.release()
    assert rep.clean, rep


def test_a_failed_first_capture_moves_the_next_key_to_a_fresh_pool():
    """The first key's first capture raises: its reference is given back and no graph holds the pool, so the
    pool is dead; the next key must not capture into it (the stale-pool assert), with or without a sanitizer."""
    from cudagraph_lifecycle import PoolSanitizer

    for sanitized in (False, True):
        be = SimBackend()

        calls = []

        def fwd(x, mode, calls=calls):
            calls.append(mode)
            if mode == "raise" and len(calls) > 1:  # its warm-up runs, its capture raises
                raise RuntimeError("not capturable")
            return x * 2

        r = CUDAGraphRunner(fwd, [2, 4], (8,), backend=be, warmup=1,
                            extra_keys=[{"mode": "raise"}, {"mode": "plain"}])
        if sanitized:
            with PoolSanitizer(be):
                r.capture()
        else:
            r.capture()
        assert be.poisoned is None
        assert r.stats.capture_failures == 1 and r.stats.captures == 2
        assert sorted(k for k, _ in r.keys) == [2, 4]
        assert len(r.pool_ids) == 2  # the dead id, then the fresh one
        x = torch.randn(3, 8)
        assert torch.allclose(r.run(x, mode="plain"), x * 2)
        assert r.stats.replays == 1
        rep = r.release()
        assert rep.clean, rep


def test_release_frees_the_pool_and_is_idempotent():
    be = SimBackend()
    r = make(be)
    r.run(torch.randn(3, 32))
    (_, pid), = r.pool_ids
    assert be.pool_state(pid).reserved_bytes > 0
    rep = r.release()
    assert rep.clean and not be.pool_state(pid).exists
    assert r.release() is rep
    assert r.outputs_alive() == 0 and r.keys == []
    with pytest.raises(RunnerReleasedError, match="was released"):
        r.run(torch.randn(1, 32))
    with pytest.raises(RunnerReleasedError):
        r.capture()


def test_kept_output_pins_and_strict_release_says_so():
    r = make()
    y = r.run(torch.randn(3, 32))
    with pytest.raises(PoolNotReleasedError, match="still holds 2097152 bytes"):
        r.release(strict=True)
    del y


def test_copy_outputs_do_not_pin():
    r = make(copy_outputs=True)
    y = r.run(torch.randn(3, 32))
    assert r.release(strict=True).clean
    assert y.shape == (3, 32)


def test_context_manager_releases():
    with make() as r:
        r.run(torch.randn(1, 32))
    assert r.released


def test_pool_retired_elsewhere_is_refused():
    be = SimBackend()
    lp = LazyPool(be)
    r = CUDAGraphRunner(mlp(), [1], (32,), pool=lp)
    pid = lp.acquire(0)
    lp.retire()
    lp._pools[0] = (pid, None)  # a stale id smuggled back in
    with pytest.raises(RetiredPoolError, match="retired"):
        r.capture()


def test_shared_pool_is_not_retired_by_the_runner():
    be = SimBackend()
    lp = LazyPool(be)
    r1 = CUDAGraphRunner(mlp(), [1], (32,), pool=lp)
    r2 = CUDAGraphRunner(mlp(), [1], (32,), pool=lp)
    r1.capture()
    r2.capture()
    r1.release()
    assert lp.current(0) is not None
    r2.release()
    lp.retire()


@pytest.mark.parametrize(
    "sizes, match",
    [([], "empty"), ([0, 1], "positive"), ([-2], "positive"), ([1, 1], "duplicates"), ([1.5], "ints"),
     (["2"], "ints"), (3, "iterable")],
)
def test_bad_batch_sizes(sizes, match):
    with pytest.raises(ConfigError, match=match):
        CUDAGraphRunner(mlp(), sizes, (32,), backend=SimBackend())


@pytest.mark.parametrize(
    "kw, match",
    [({"warmup": -1}, "warmup"), ({"dtype": "float"}, "dtype"), ({"extra_keys": []}, "extra_keys"),
     ({"extra_keys": [{"a": 1}, {"a": 1}]}, "duplicates"), ({"device": 7}, "device index")],
)
def test_bad_config(kw, match):
    with pytest.raises(ConfigError, match=match):
        make(**kw)


def test_bad_feature_shape_and_forward():
    with pytest.raises(ConfigError, match="positive"):
        CUDAGraphRunner(mlp(), [1], (0,), backend=SimBackend())
    with pytest.raises(ConfigError, match="callable"):
        CUDAGraphRunner("f", [1], (4,), backend=SimBackend())


@pytest.mark.parametrize(
    "x, match",
    [(torch.randn(0, 32), "batch is 0"), (torch.randn(2, 33), "does not fit"), (torch.randn(2, 32, 1), "does not fit"),
     (torch.randn(2, 32, dtype=torch.float64), "dtype"), ([[1.0]], "torch.Tensor")],
)
def test_bad_inputs(x, match):
    with pytest.raises(GraphInputError, match=match):
        make().run(x)


def test_stats_fields():
    r = make()
    r.run(torch.randn(2, 32))
    d = r.stats.as_dict()
    assert d["captures"] == 4 and d["replays"] == 1 and d["pool_id"] == [0, 1] and d["pool_bytes"] == 2 << 20
