import os
import threading

import pytest
import torch

from cudagraph_lifecycle import ConfigError, LazyPool, RetiredPoolError
from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.ledger import ledger


def test_nothing_is_minted_at_construction():
    be = SimBackend()
    lp = LazyPool(be)
    assert lp.current(0) is None and lp.records == [] and lp.devices() == []
    assert be.graph_pool_handle() == (0, 1)  # no id was taken by the constructor


def test_acquire_is_stable_until_retire_then_fresh():
    be = SimBackend()
    lp = LazyPool(be)
    a = lp.acquire(0)
    assert lp.acquire(0) == a and lp.generation == 0
    assert lp.retire() == [a]
    assert lp.current(0) is None and lp.generation == 1
    b = lp.acquire(0)
    assert b != a and ledger.was_minted(be.world, b) and ledger.is_retired(be.world, 0, a)
    with pytest.raises(RetiredPoolError, match="was retired"):
        lp.check_capturable(a)
    lp.check_capturable(b)


def test_per_device_pools():
    be = SimBackend(devices=2)
    lp = LazyPool(be)
    p0, p1 = lp.acquire(0), lp.acquire(1)
    assert p0 != p1 and lp.devices() == [0, 1]
    assert sorted(lp.retire()) == sorted([p0, p1])


def test_mempool_mode_owns_a_reference_until_retire():
    be = SimBackend()
    lp = LazyPool(be, mode="mempool")
    pid = lp.acquire(0)
    assert lp.use_count(0) == 1 and be.pool_state(pid).use_count == 1
    lp.retire()
    assert be.pool_state(pid).use_count == 0


def test_handle_mode_creates_no_pool_until_capture():
    be = SimBackend()
    lp = LazyPool(be, mode="handle")
    pid = lp.acquire(0)
    assert not be.pool_state(pid).exists


def test_retire_is_idempotent():
    lp = LazyPool(SimBackend())
    lp.acquire(0)
    lp.retire()
    assert lp.retire() == [] and lp.generation == 1


def test_thread_safe_acquire():
    lp = LazyPool(SimBackend())
    got = []
    threads = [threading.Thread(target=lambda: got.append(lp.acquire(0))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(lp.records) == 1


def test_forked_child_starts_with_no_pool():
    lp = LazyPool(SimBackend())
    lp.acquire(0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if lp.current(0) is None else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    assert lp.current(0) is not None  # the parent keeps its pool


def test_bad_mode():
    with pytest.raises(ConfigError, match="unknown pool mode"):
        LazyPool(SimBackend(), mode="shared")


def test_records_keep_the_minting_stack():
    lp = LazyPool(SimBackend())
    lp.acquire(0)
    assert "test_records_keep_the_minting_stack" in lp.records[0].minted_at


def test_bad_device():
    with pytest.raises(ConfigError, match="device index 3"):
        LazyPool(SimBackend(devices=2)).acquire(3)


def test_unknown_backend_name():
    with pytest.raises(ConfigError, match="unknown backend 'gpu'"):
        LazyPool("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error():
    from cudagraph_lifecycle import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="no usable GPU"):
        LazyPool("cuda")
