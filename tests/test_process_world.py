"""One allocator world per process and kind: get_backend returns the same object, a forked child its own,
and everything built by name (runners, pools, sanitizers) shares it."""

import multiprocessing as mp
import os

import pytest
import torch

from cudagraph_lifecycle import CUDAGraphRunner, LazyPool, get_backend
from cudagraph_lifecycle.backends import BackendUnavailableError, isolated_backend
from cudagraph_lifecycle.backends.sim import SimBackend


def test_get_backend_returns_the_process_object_for_each_kind():
    assert get_backend("sim") is get_backend("sim")
    assert get_backend("auto") is get_backend("auto") is get_backend("sim")  # no GPU here
    with pytest.raises(BackendUnavailableError, match="backend 'cuda'"):
        get_backend("cuda")


def test_explicit_sim_backends_are_isolated_worlds():
    a, b = SimBackend(), SimBackend()
    assert a.world != b.world != get_backend("sim").world
    assert isolated_backend("sim") is not isolated_backend("sim")


def _child_world(q):
    q.put((id(get_backend("sim")), get_backend("sim").world, os.getpid()))


def test_a_forked_child_gets_its_own_world():
    parent = get_backend("sim")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_world, args=(q,))
    p.start()
    child_id, child_world, child_pid = q.get(timeout=60)
    p.join(30)
    assert child_pid != os.getpid()
    assert child_world != parent.world  # a fresh simulated allocator, not a copy of the parent's books
    assert get_backend("sim") is parent


def test_runners_built_by_name_share_one_capture_stream_and_world():
    r1 = CUDAGraphRunner(lambda x: x * 2, [1, 2], (4,), backend="sim")
    r2 = CUDAGraphRunner(lambda x: x + 1, [1, 2], (4,), backend="sim")
    assert r1.backend is r2.backend is get_backend("sim")
    r1.run(torch.ones(2, 4))
    r2.run(torch.ones(2, 4))
    assert r1._stream is r2._stream is get_backend("sim").capture_stream(0)
    assert r1.release().clean and r2.release().clean
    assert LazyPool("sim").backend is get_backend("sim")
