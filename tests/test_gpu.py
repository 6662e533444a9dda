"""GPU tests (marker ``gpu``): skipped without a GPU, run by scripts/gpu_check.sh on the H200."""

import budget_cases
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


def test_a_failed_first_capture_moves_the_runner_to_a_fresh_pool(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.runner_first_capture_fails_then_next_key)
    assert r == {"ok": True, "captures": 2, "failures": 1, "replays": 1, "pools": 2, "clean": True}, r


def test_lazy_pool_owns_a_mempool(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.lazy_pool_mempool_use_count)
    assert r["mode"] == "mempool" and r["counts"] == [1] and not r["exists_after"]


def test_naive_engine_asserts_on_its_second_instance(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.naive_two_engines)
    assert r["first"] == "held" and r["second"] == "stale" and r["poisoned"]
    assert "the allocator asserted" in r["message"] and "use_count > 0 INTERNAL ASSERT FAILED" in r["message"]


def test_sanitizer_catches_the_seed_bug_and_the_process_goes_on(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.sanitizer_catches_naive_engine)
    assert r["first"] == "held" and r["second"] == "stale" and not r["poisoned"] and r["usable"]
    assert r["caught"].startswith("StalePoolError") and "pool minted at" in r["caught"] and "engines.py" in r["caught"]
    assert "last graph was released at" in r["caught"] and "in release" in r["caught"]


@pytest.mark.parametrize("sanitized", [True, False])
def test_a_stale_capture_the_engine_caught_is_still_stale(cudagraph_worker, sanitized):
    r = cudagraph_worker.call(gpu_cases.naive_engine_that_catches, sanitized)
    if r["poisoned"]:
        cudagraph_worker.restart_before_next_call()
    assert r["first"] == "held" and r["second"] == "stale" and r["poisoned"] is not sanitized, r
    assert "whose error the engine caught" in r["message"] and "engines.py" in r["message"], r
    assert r["refused"] is sanitized, r["errors"]
    # what pinned the pool is read as the capture came, before the allocator ran it: named in every mode
    assert "the pool was pinned: " in r["message"] and "the previous engine's output" in r["message"], r
    if sanitized:  # the refusal names it too; the attempt and the pin are findings with their lines
        assert "held as the previous engine's output, which the caller holds" in r["errors"][0], r["errors"]
        assert [k for k, _ in r["findings"]] == ["stale_capture", "pinned_pool"], r["findings"]
        assert all("engines.py" in sites[0] for _, sites in r["findings"]), r["findings"]
    else:
        assert "use_count > 0" in r["errors"][0], r["errors"]


def test_a_capture_a_host_sync_broke_whose_error_the_engine_caught_is_an_error(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.host_sync_engine_that_catches)
    cudagraph_worker.restart_before_next_call()
    assert r["verdict"] == "error" and r["poisoned"], r
    assert "the engine caught the error and went on without that graph" in r["message"], r
    assert "gpu_cases.py" in r["message"] and "failed when it ended" in r["message"], r
    print(r["message"].splitlines()[0])  # what torch raised, and where the captured code broke, if it did


def test_a_capture_on_the_default_stream_is_refused_before_torch_poisons_random_ops(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.default_stream_capture, True)
    if not r.get("ours"):
        cudagraph_worker.restart_before_next_call()  # torch's refusal went through: that process is poisoned
    assert r["ours"] and "must be captured on a non-default stream" in r["message"], r
    assert r["event"]["refused"] and "begin_without_a_side_stream" in r["event"]["site"], r
    assert r["findings"] == ["default_stream_capture"] and r["random"] == "ok" and r["side_stream_capture"] == "ok", r


def test_unjudged_torch_refuses_a_default_stream_capture_and_random_ops_fail_after(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.default_stream_capture, False)
    cudagraph_worker.restart_before_next_call()  # its random ops are poisoned, whatever the asserts find
    assert not r["ours"] and "must be captured on a non-default stream" in r["message"], r
    assert not r["event"]["refused"] and "begin_without_a_side_stream" in r["event"]["site"], r
    assert "Offset increment outside graph capture" in r["random"], r  # the fact the sanitizer prevents
    print("after a default-stream refusal:", {k: r[k] for k in ("side_stream_capture", "random_after_a_capture")})


def test_sanitizer_no_false_positives_on_correct_code(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.sanitizer_no_false_positives)
    assert r["stale_caught"] == 0, r


def test_failing_cudagraph_test_dumps_a_memory_snapshot(pytester):
    import json

    pytester.makepyfile(test_a='''
        import pytest, torch
        @pytest.mark.cudagraph
        def test_fails_on_gpu():
            g = torch.cuda.CUDAGraph()
            x = torch.randn(8, device="cuda")
            with torch.cuda.graph(g):
                y = x * 2
            assert False, "planted failure"
    ''')
    report = pytester.path / "r.json"
    res = pytester.runpytest_subprocess("-p", "cudagraph", f"--cudagraph-report={report}")
    res.assert_outcomes(failed=1)
    (t,) = json.loads(report.read_text())["tests"]
    assert t["memory_snapshot"].endswith(".pickle") and (pytester.path / t["memory_snapshot"]).exists()


def test_cublas_workspace_allocated_in_capture_pins_the_pool(cudagraph_worker):
    # measured fact the runner relies on: warm up on the capture stream, or the workspace lands in the pool
    pinned = cudagraph_worker.call(gpu_cases.cublas_workspace_in_capture_pins_the_pool)
    assert pinned > 0


def test_a_program_wide_sanitizer_names_a_workspace_pin_without_a_cycle(cudagraph_worker):
    out = cudagraph_worker.call(gpu_cases.workspace_pin_named_by_a_program_wide_sanitizer)
    assert out["installed"], out
    (pins,) = out["pins"]  # one pinned pool, every block of it a workspace
    assert pins and all(cause == "library_workspace" for cause, _, _ in pins), pins
    assert "cuBLAS workspace" in pins[0][2] and "cuda:0" in pins[0][2], pins


def test_runner_failure_path_with_and_without_ending_the_routing(cudagraph_worker):
    # The fix (the runner ends the allocator's routing after a failed capture, PyTorch #180395) must keep
    # the process alive and the release clean; what happens without it is recorded in the GPU results.
    r = cudagraph_worker.call(gpu_cases.runner_failure_with_and_without_ending_routing)
    print("without ending the routing:", r["left_on"])
    assert r["ended"]["rc"] == 0 and r["ended"]["stdout"] == ["released clean", "survived"], r


def test_runners_built_by_name_share_the_process_capture_stream(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.runners_by_name_share_one_capture_stream)
    assert r["same_stream"] and r["growth_second"] <= 0, r


FIRST_CUDA_USE = """
import pytest, torch
from cudagraph_lifecycle import StalePoolError

def capture(pool):
    g = torch.cuda.CUDAGraph()
    x = torch.ones(64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        y = x * 2
        g.capture_end()
    return g, y

@pytest.mark.cudagraph
def test_stale_handle_first_thing():
    assert not torch.cuda.is_initialized()
    handle = torch.cuda.graph_pool_handle()
    g, kept = capture(handle)
    g.reset()
    with pytest.raises(StalePoolError, match="stale pool"):
        capture(handle)
    torch.ones(4, device="cuda").sum().item()  # the process is not poisoned
"""


def test_first_cuda_use_in_a_marked_test_is_watched(pytester):
    # The test's first line initializes CUDA: the sanitizer must already be watching (installed at set-up).
    pytester.makepyfile(test_first=FIRST_CUDA_USE)
    pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_budgets_of_a_cudagraph_marked_test_on_cuda(pytester):
    # the same budgets as on sim (tests/test_budgets_reload_hazard.py), read from what CUDA's allocator holds
    pytester.makepyfile(test_budgets=budget_cases.CUDA_CAPTURE + budget_cases.MARKED_TESTS)
    budget_cases.check(pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider"))


def test_checked_runner_catches_overwritten_outputs_padding_addresses_and_the_broken_op(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.checked_runner_catches_its_bugs)
    assert r["correct"] and r["clean"] and r["broken_clean"], r
    assert "overwritten by a later replay" in r["overwritten"], r
    assert r["address"].startswith("- weight: captured at 0x"), r
    assert "depend on the padding" in r["padding"], r
    assert "the op that broke the capture: aten._local_scalar_dense" in r["broken"] and "in syncs" in r["broken"], r
    # one storage both graphs read (looked at once for the set), named by its first op and by both graphs
    assert len(r["freed"]) == 1 and r["freed"][0].startswith("a 256-byte storage read by aten.mul"), r
    assert "freed since the capture" in r["freed"][0] and "read by graph 4, graph 2" in r["freed"][0], r


def test_checked_mode_leaves_a_large_cache_as_unchecked_and_copies_it_to_host(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.checked_runner_keeps_a_large_cache)
    print("large cache, checked:", r)
    assert r["same_outputs"] and r["same_cache"] and r["same_pos"], r
    assert r["growth"] < r["cache_bytes"], r


def test_expandable_segments_teardown_crashes_plain_pytorch_and_is_refused_by_on(cudagraph_worker):
    r = cudagraph_worker.call(gpu_cases.expandable_segments_teardown_in_fresh_processes)
    print("expandable segments:", r)
    # plain PyTorch: the flush erased the pool under the kept blocks; freeing them crashed (SIGSEGV or a glibc
    # abort on the H200, in the probe of 2026-12-04: git history of docs/gpu-results/)
    assert r["plain"]["rc"] != 0 and r["plain"]["stdout"][0] == "reset", r
    for mode in ("on", "strict"):  # refused, then the blocks first and the graph last: survives
        assert r[mode]["rc"] == 0 and r[mode]["stdout"][0].startswith("refused: reset of the last graph"), r
        assert r[mode]["stdout"][-2:] == ["findings: ['expandable_teardown']", "survived"], r
    assert r["report"]["rc"] != 0 and r["report"]["stdout"][:2] == ["reset", "findings: ['expandable_teardown']"], r


def test_a_worker_crashing_after_a_reported_teardown_says_so():
    from pytest_cudagraph.worker import ReusedWorker, WorkerCrashed

    env = {"CUDAGRAPH_SANITIZE": "on", "CUDAGRAPH_SANITIZE_BACKEND": "cuda", "CUDAGRAPH_EXPANDABLE_TEARDOWN": "report",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with ReusedWorker(env=env, name="gpu-hazard") as w:
        with pytest.raises(WorkerCrashed) as e:
            w.call(gpu_cases.crash_after_a_reported_teardown)
    print(str(e.value)[:2000])
    (h,) = e.value.hazards
    assert h["live_bytes"] == 10 * (2 << 20) and "gpu_cases.py" in h["reset_site"], h
    assert "the sanitizer recorded before the crash" in str(e.value)


def test_what_pins_the_first_make_graphed_callables_is_named(engine_sequence):
    """In a fresh worker: the first training-style make_graphed_callables leaves cuBLAS workspaces of its
    captures in its pool (the H200 probe of 2026-12-04, git history of docs/gpu-results/): leaked, and the
    record names them without freeing them (the pool stays as plain PyTorch keeps it); the next engine's
    captures use those workspaces, so its own pool is fresh."""
    records = engine_sequence(gpu_cases.graphed_with_backward, 2, output="drop", check=False)
    first = records[0]
    (leaked,) = [p for p in first["problems"] if p["kind"] == "leaked"]  # also release_incomplete: gc frees them
    print("first engine:", first["verdict"], first["leaked_bytes"], leaked["pins"])
    assert first["verdict"] == "leaked" and first["leaked_bytes"] >= 32 << 20, first
    (pin,) = leaked["pins"]
    assert pin["cause"] == "library_workspace" and pin["bytes"] >= 32 << 20 and "backward" in pin["fix"], pin
    assert [r["verdict"] for r in records[1:]] == ["fresh"], records


def test_graphed_callables_memoised_in_a_global_are_named_by_that_global(engine_sequence):
    """make_graphed_callables keeps its graphs and static outputs in closures of its own; the engine memoised
    what it returned in a module global: the message names that global, not torch's closure."""
    (rec,) = engine_sequence(gpu_cases.memoised_graphed, 1, output="drop", check=False)
    text = " ".join(p["message"] for p in rec["problems"])
    print(rec["verdict"], text[:1500])
    assert rec["verdict"] == "leaked", rec
    assert "that torch.cuda.graphs.make_graphed_callables made, held as key `(8, 64)` of a dict (global " \
           "`GRAPHED_CACHE` of module gpu_cases)" in text, text


def test_warming_forward_and_backward_on_the_capture_stream_avoids_it(engine_sequence):
    records = engine_sequence(gpu_cases.graphed_with_backward_warmed, 2, output="drop")
    assert [r["verdict"] for r in records] == ["fresh", "fresh"], records
