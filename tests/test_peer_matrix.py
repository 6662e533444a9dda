"""The peer-style engine matrix: fourteen engines written the way public engines hold their graph pools
(``peer_engines.py``), three of each in one reused worker, the caller holding (``hold``) or copying out
(``drop``) the last output, with the sanitizer on and off.

Two columns per cell: what plain PyTorch does with these engines (``peer_truth.py``, nothing of ours
watching: where the allocator asserts), and the plugin's verdicts, which must name the same engine
(``stale`` where the allocator asserts, before it does when the sanitizer is on) and judge the rest from
what the process observed. Styles (a)-(h) and (k)-(n) run on ``sim`` in CI; all fourteen run on ``cuda`` in
the GPU check.
"""

import peer_engines
import peer_truth
import pytest

from cudagraph_lifecycle.cycle.record import FAILING
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
    # the cached draft's graphs stay captured in the pool engine 0 minted (its handle, kept): engine 0 leaks
    # them; held, engine 1's draft resets and recaptures there while the output pins it: plain PyTorch asserts
    # (so this cell runs on past the leak, to the stale engine); dropped, the flush erased the pool first
    ("m", "hold"): ["leaked", "stale"], ("m", "drop"): ["leaked"],
    # release() resets nothing, but the graphs die with the engine<->runner cycle at the next gc.collect() (the
    # cycle's settle runs one, as the truth's caller does): fresh pools, only release_incomplete noted
    ("n", "hold"): ["held"] * 3, ("n", "drop"): ["fresh"] * 3,
}
# What pins a leaked engine's pool, per style: (cause, part of the holder's description).
LEAK_PINS = {
    "c": ("autograd_history", "the copy of its output the caller keeps"),
    "m": ("python_reference", "attribute `graphs` of a DraftEngine object"),
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
    """The verdicts up to the first stale engine (where plain PyTorch asserts, and stops). A cell whose
    expected verdicts go on past a failing one runs with check=False, so the sequence goes on too."""
    expected = EXPECTED[(style, mode)]
    go_on = any(v in FAILING for v in expected[:-1])
    try:
        engine_sequence(peer_engines.STYLES[style], 3, output=mode, check=not go_on)
    except EngineCycleError:
        pass  # the records say which engine and why
    verdicts = [r["verdict"] for r in engine_sequence.records]
    return verdicts[:verdicts.index("stale") + 1] if "stale" in verdicts else verdicts


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
    stale = [r for r in records if r["verdict"] == "stale"]
    if stale:
        text = stale[0]["problems"][0]["message"]
        assert ("StalePoolError" in text) == (sanitize == "on")  # off: the allocator's own assert, named
        assert "use_count > 0" in text and "[engine 0]" in text  # the engine whose capture made the pool
    for r in records[:len(EXPECTED[(style, mode)])]:  # the engines the table speaks for
        assert r["pool_ids"], r  # observed, although only (b) tells its pools
        if r["verdict"] == "held":
            assert r["held_bytes"] > 0 and r["leaked_bytes"] == 0
        if r["verdict"] == "leaked":
            # what pins it is named: (c) the autograd graph of the copy the caller keeps, (m) the cached draft
            cause, holder = LEAK_PINS[style]
            if r["leaked_bytes"]:
                pins = next(p["pins"] for p in r["problems"] if p["kind"] == "leaked")
                assert pins[0]["cause"] == cause and holder in pins[0]["holder"], pins
            else:  # the bytes are the held output's: the graphs never reset leak, and who keeps them is named
                text = next(p["message"] for p in r["problems"] if p["kind"] == "graphs_not_reset")
                assert holder in text, text
