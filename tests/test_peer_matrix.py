"""The peer-style engine matrix: sixteen engines, fourteen written the way public engines hold their graph
pools, one graphed at build the way a user first meets make_graphed_callables (o), and this library's runner
(p) (``peer_engines.py``), three of each in one reused worker, the caller holding (``hold``) or copying out
(``drop``) the last output.

Per cell: what plain PyTorch does with these engines (``peer_truth.py``, nothing of ours watching: where the
allocator asserts, and what the graph pools still hold at the end), and the plugin's verdicts in each
sanitizer mode (off, on, strict), each in a fresh worker. The verdicts must name the same engine (``stale``
where the allocator asserts, before it does when the sanitizer is on), give every engine the same verdict,
bytes, problems and pins in every mode, and add up to the bytes plain PyTorch lost. Styles (a)-(h), (k)-(n)
and (p) run on ``sim`` in CI; all sixteen run on ``cuda`` in the GPU check.
"""

import peer_engines
import peer_truth
import pytest

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
    # make_graphed_callables warms up on a side stream and captures on torch.cuda.graph's own stream: in a
    # fresh worker those are the process's first matmuls there, so cuBLAS's workspace for that stream is made
    # inside the capture, in engine 0's pool, for good (plain PyTorch loses the same bytes); later engines
    # reuse that workspace
    ("i", "hold"): ["leaked"], ("i", "drop"): ["leaked"],
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
    # graphed at build, the first captures of a fresh worker on make_graphed_callables' stream: the backward
    # graphs' matmuls run on autograd's thread, whose cuBLAS handle makes its workspace for that stream inside
    # the capture, in the pool, where it stays for good (the process's cache holds it)
    ("o", "hold"): ["leaked"], ("o", "drop"): ["leaked"],
    # the library's runner: a fresh pool per engine, retired at release (strict turns its checked mode on)
    ("p", "hold"): ["held"] * 3, ("p", "drop"): ["fresh"] * 3,
}
# What pins a leaked engine's pool, per style: (cause, part of the holder's description).
LEAK_PINS = {
    "c": ("autograd_history", "the copy of its output the caller keeps"),
    "m": ("python_reference", "attribute `graphs` of a DraftEngine object"),
    "i": ("library_workspace", "cuBLAS workspace"),
    "o": ("library_workspace", "cuBLAS workspace"),
}
# ... where the output was held: the same (the workspace lies beyond the held output, named without freeing
# it, while the next engine's graphs live too)
LEAK_PINS_HELD: dict[str, tuple[str, str]] = {}
CELLS = sorted(EXPECTED)


def _needs_cuda(style: str, backend: str) -> None:
    if style not in peer_engines.SIM_STYLES and backend != "cuda":
        pytest.skip(f"style ({style}) graphs through torch.cuda directly: GPU only")


def _truth(style: str, mode: str, backend: str, with_bytes: bool = False) -> list[str] | tuple[list[str], int]:
    """Runs in a fresh worker: plain PyTorch's outcome per engine (an assert poisons that process), and with
    ``with_bytes`` what the graph pools still hold at the end."""
    from cudagraph_lifecycle.backends import isolated_backend
    from cudagraph_lifecycle.sanitizer import global_sanitizer

    san = global_sanitizer()
    if san is not None:
        san.stop()  # nothing of ours may watch: this is PyTorch's own verdict
    found = peer_truth.plain_sequence_bytes(style, mode, isolated_backend(backend))
    return found if with_bytes else found[0]


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


MODES = ("off", "on", "strict")


def _sequence_in(request: pytest.FixtureRequest, mode: str):
    """An engine_sequence in a fresh worker of its own, under sanitizer mode ``mode`` (as the marker
    ``cudagraph_engines(sanitize=mode)`` gives one test): the same engines, watched three ways, in one test."""
    from pytest_cudagraph.fixtures import _close_reporting, _new_worker, _settings
    from pytest_cudagraph.sequence import EngineSequence

    worker = _new_worker(request.config, "function", mode)
    request.addfinalizer(lambda: _close_reporting(worker, request.config))
    return EngineSequence(request, 3, worker, {**_settings(request.config), "budgets": {}, "sanitize": mode})


def judged(record: dict) -> dict:
    """What a verdict consists of, for comparing one engine across sanitizer modes: the verdict, the bytes,
    the problems' kinds and what pins the pools. The sanitizer's own notes (kind ``sanitizer``) and whether
    the cycle fails are left out: those are what the modes are for."""
    problems = [p for p in record["problems"] if p["kind"] != "sanitizer"]
    return {"verdict": record["verdict"], "pool_bytes": record.get("pool_bytes", 0),
            "held_bytes": record.get("held_bytes", 0), "leaked_bytes": record.get("leaked_bytes", 0),
            "growth_bytes": record.get("growth_bytes", 0), "kinds": sorted({p["kind"] for p in problems}),
            "pins": sorted((pin["cause"], pin["bytes"]) for p in problems for pin in p["pins"])}


def until_stale(records: list[dict]) -> list[dict]:
    """The engines up to the first stale one: off, the allocator's assert poisons the worker there and a new
    one takes the next engine; on, the refusal keeps the process. What follows is another process's story."""
    verdicts = [r["verdict"] for r in records]
    return records[:verdicts.index("stale") + 1] if "stale" in verdicts else records


@pytest.mark.parametrize("style, mode", CELLS)
def test_one_verdict_whatever_watches(request, pytestconfig, style, mode):
    """Every cell in the three sanitizer modes, each in a fresh worker: the table's verdicts in every mode,
    and per engine the same verdict, bytes, problems and pins (the observer changes nothing it judges);
    strict may only fail more cycles."""
    from pytest_cudagraph.settings import effective_backend

    _needs_cuda(style, effective_backend(pytestconfig))
    runs = {}
    for sanitize in MODES:
        engine_sequence = _sequence_in(request, sanitize)
        # every engine, failed or not (strict fails more of them, and must not stop sooner)
        every = engine_sequence(peer_engines.STYLES[style], 3, output=mode, check=False)
        records = until_stale(every)
        expected = EXPECTED[(style, mode)]
        assert [r["verdict"] for r in records][:len(expected)] == expected, \
            (sanitize, [r["problems"] for r in records])
        runs[sanitize] = records
        _check_cell(style, mode, sanitize, every)
    off = [judged(r) for r in runs["off"]]
    for sanitize in ("on", "strict"):
        assert [judged(r) for r in runs[sanitize]] == off, sanitize
    for a, b in zip(runs["off"], runs["on"]):
        assert a["failed"] == b["failed"], (a["index"], a["problems"], b["problems"])
    for a, b in zip(runs["on"], runs["strict"]):
        assert b["failed"] or not a["failed"], (a["index"], b["problems"])
    truth, left = request.getfixturevalue("cudagraph_worker").call(_truth, style, mode,
                                                                   effective_backend(pytestconfig), True)
    shared = any("reused" in j["kinds"] for j in off)  # one pool in two engines' records: counted twice there
    if "assert" not in truth and not shared:  # what the process lost, read from plain PyTorch's allocator alone
        assert sum(r["leaked_bytes"] for r in runs["off"]) == left, (truth, left, off)


def _check_cell(style: str, mode: str, sanitize: str, records: list[dict]) -> None:
    stale = [r for r in records if r["verdict"] == "stale"]
    for a, b in zip(records, records[1:]):  # a stale capture ends its worker in every mode, refused or not
        ended = a["verdict"] == "stale" or a.get("poisoned")
        assert (a["pid"] != b["pid"]) == bool(ended), (sanitize, a["index"], a["pid"], b["pid"])
    if stale:
        text = stale[0]["problems"][0]["message"]
        assert ("StalePoolError" in text) == (sanitize != "off")  # off: the allocator's own assert, named
        assert "use_count > 0" in text and "[engine 0]" in text  # the engine whose capture made the pool
    for r in records[:len(EXPECTED[(style, mode)])]:  # the engines the table speaks for
        assert r["pool_ids"], r  # observed, although only (b) tells its pools
        if r["verdict"] == "held":
            assert r["held_bytes"] > 0 and r["leaked_bytes"] == 0
        if r["verdict"] == "leaked":
            # what pins it is named: (c) the autograd graph of the copy the caller keeps, (m) the cached draft
            cause, holder = (LEAK_PINS_HELD if mode == "hold" else {}).get(style, LEAK_PINS[style])
            if r["leaked_bytes"]:
                pins = next(p["pins"] for p in r["problems"] if p["kind"] == "leaked")
                assert pins[0]["cause"] == cause and holder in pins[0]["holder"], pins
            else:  # the bytes are the held output's: the graphs never reset leak, and who keeps them is named
                text = next(p["message"] for p in r["problems"] if p["kind"] == "graphs_not_reset")
                assert holder in text, text
