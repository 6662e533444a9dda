"""GPU tests (marker ``gpu``): skipped without a GPU, run by scripts/gpu_check.sh on the H200."""

import gpu_cases
import pytest

pytestmark = pytest.mark.gpu


def test_runner_replay_equals_eager_and_release_frees_the_pool(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.runner_replay_and_release)
    assert r["captures"] == 5 and max(r["errs"]) < 1e-5
    assert r["held"] > 0 and r["clean"] and not r["in_snapshot"]


def test_capture_failure_falls_back_and_release_still_frees(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.runner_capture_failure)
    assert r["fallback_ok"] and r["fallbacks"] == {"capture_failed": 1}
    assert "capturing" in r["failures"][0]
    assert r["clean"], r["pools"]


def test_lazy_pool_owns_a_mempool(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.lazy_pool_mempool_use_count)
    assert r["mode"] == "mempool" and r["counts"] == [1] and not r["exists_after"]


def test_naive_engine_asserts_on_its_second_instance(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.naive_two_engines)
    assert r["first_fresh"]
    assert "use_count > 0 INTERNAL ASSERT FAILED" in r["second"]
