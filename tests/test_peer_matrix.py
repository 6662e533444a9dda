"""The peer-style engine matrix: twelve engines written the way public engines hold their graph pools
(``peer_engines.py``), three of each in one reused worker, the caller holding (``hold``) or copying out
(``drop``) the last output, with the sanitizer on and off.

Two columns per cell: what plain PyTorch does with these engines (``peer_truth.py``, nothing of ours
watching: where the allocator asserts), and the plugin's verdicts, which must name the same engine
(``stale`` where the allocator asserts, before it does when the sanitizer is on) and judge the rest from
what the process observed. Styles (a)-(h), (k) and (l) run on ``sim`` in CI; all twelve run on ``cuda`` in
the GPU check.
"""

import peer_engines
import peer_truth
import pytest

from pytest_cudagraph import EngineCycleError

# Verdicts up to the first failing engine (a sequence stops there).
EXPECTED = {
    ("a", "hold"): ["held", "stale"], ("a", "drop"): ["fresh", "reused", "reused"],
    ("b", "hold"): ["held"] * 3, ("b", "drop"): ["fresh"] * 3,
    ("c", "hold"): ["held"] * 3, ("c", "drop"): ["leaked"],
    ("d", "hold"): ["stale"], ("d", "drop"): ["stale"],
    ("e", "hold"): ["held"] * 3, ("e", "drop"): ["fresh"] * 3,
    ("f", "hold"): ["held", "stale"], ("f", "drop"): ["fresh", "reused", "reused"],
    ("g", "hold"): ["held"] * 3, ("g", "drop"): ["fresh"] * 3,
    ("h", "hold"): ["held", "stale"], ("h", "drop"): ["fresh", "reused", "reused"],
    ("i", "hold"): ["held"] * 3, ("i", "drop"): ["fresh"] * 3,
    # cudagraph trees hand out outputs whose storage the trees' pool owns, not the output: a held output pins
    # nothing, so once torch._dynamo.reset() frees the trees the pool is gone (and the held output dangles)
    ("j", "hold"): ["fresh"] * 3, ("j", "drop"): ["fresh"] * 3,
    # the pool engine 0's first capture minted (pool=None) stays in the module global: as (f), a held output
    # pins it and engine 1 asserts; dropped, later engines reuse the id unharmed
    ("k", "hold"): ["held", "stale"], ("k", "drop"): ["fresh", "reused", "reused"],
    # as (a), from a loader thread: the kept handle asserts in that thread, re-raised in the caller after join
    ("l", "hold"): ["held", "stale"], ("l", "drop"): ["fresh", "reused", "reused"],
}
CELLS = sorted(EXPECTED)


def _needs_cuda(style: str, backend: str) -> None:
    if style not in peer_engines.SIM_STYLES and backend != "cuda":
        pytest.skip(f"style ({style}) graphs through torch.cuda directly: GPU only")


def _truth(style: str, mode: str, backend: str) -> list[str]:
    """Runs in a fresh worker: plain PyTorch's outcome per engine (an assert poisons that process)."""
    from cudagraph_lifecycle.backends import isolated_backend
    from cudagraph_lifecycle.sanitizer import global_sanitizer

    san = global_sanitizer()
    if san is not None:
        san.stop()  # nothing of ours may watch: this is PyTorch's own verdict
    return peer_truth.plain_sequence(style, mode, isolated_backend(backend))


def _verdicts(engine_sequence, style: str, mode: str) -> list[str]:
    try:
        engine_sequence(peer_engines.STYLES[style], 3, output=mode)
    except EngineCycleError:
        pass  # the records say which engine and why
    return [r["verdict"] for r in engine_sequence.records]


@pytest.mark.parametrize("style, mode", CELLS)
def test_plain_pytorch_asserts_where_the_table_says_stale(cudagraph_worker, cudagraph_backend_name, style, mode,
                                                          pytestconfig):
    from pytest_cudagraph.settings import effective_backend

    backend = effective_backend(pytestconfig)
    _needs_cuda(style, backend)
    truth = cudagraph_worker.call(_truth, style, mode, backend)
    expected = ["assert" if v == "stale" else "ok" for v in EXPECTED[(style, mode)]]
    if expected[-1] == "ok":
        expected += ["ok"] * (3 - len(expected))  # leaked/reused stop the plugin's sequence, not PyTorch
    assert truth == expected


@pytest.mark.parametrize("sanitize", ["on", "off"])
@pytest.mark.parametrize("style, mode", CELLS)
def test_verdicts(request, pytestconfig, style, mode, sanitize):
    from pytest_cudagraph.settings import effective_backend

    _needs_cuda(style, effective_backend(pytestconfig))
    request.node.add_marker(pytest.mark.cudagraph_engines(3, sanitize=sanitize))
    engine_sequence = request.getfixturevalue("engine_sequence")
    records = engine_sequence.records
    assert _verdicts(engine_sequence, style, mode) == EXPECTED[(style, mode)], [r["problems"] for r in records]
    last = records[-1]
    if last["verdict"] == "stale":
        text = last["problems"][0]["message"]
        assert ("StalePoolError" in text) == (sanitize == "on")  # off: the allocator's own assert, named
        assert "use_count > 0" in text and "[engine 0]" in text  # the engine whose capture made the pool
    for r in records:
        assert r["pool_ids"], r  # observed, although only (b) tells its pools
        if r["verdict"] == "held":
            assert r["held_bytes"] > 0 and r["leaked_bytes"] == 0
        if r["verdict"] == "leaked":
            # what pins it is named: the autograd graph of the copy the caller keeps
            pins = next(p["pins"] for p in r["problems"] if p["kind"] == "leaked")
            assert r["leaked_bytes"] > 0 and pins[0]["cause"] == "autograd_history", r["problems"][0]
            assert "the copy of its output the caller keeps" in pins[0]["holder"]
