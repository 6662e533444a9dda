"""The steps of one engine cycle: build, capture, compare with eager, release, settle, judge.

Each step adds typed problems to the cycle's record; the verdict follows from them (``record.py``). What
an engine captured into is read from the ledger (``observe`` watches the graph API), never asked of the
engine: its ``pool_ids()`` is only cross-checked.
"""

from __future__ import annotations

import enum
import gc
import inspect
import numbers
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend
from ..errors import (
    FRESH_POOL_FIX,
    TORCH_DEFAULT_STREAM_REFUSAL,
    TORCH_POOL_ASSERT,
    CapturedAddressError,
    ConfigError,
    DefaultStreamCaptureError,
    ExpandableSegmentsHazardError,
    OverwrittenOutputError,
    ReplayCheckError,
    StalePoolError,
    exception_chain,
    first_line,
    stale_fix,
)
from ..ledger import SITES, Key, Stack, graph_sites, ledger, raised_site, shown_traceback
from ..record import CycleRecord
from ..sanitizer.pins import Pin, beyond_output, describe, graph_holder, mempool_notes, what_pins
from ..sanitizer.stale import pinned_text, side_stream_fix
from ..sizes import size_text
from ..trees import leaves
from .caller import caller_copy
from .engine import Engine

ASSERT_MARKERS = (TORCH_POOL_ASSERT, "INTERNAL ASSERT FAILED")
NO_CUDA_MARKERS = ("Torch not compiled with CUDA enabled", "No CUDA GPUs are available", "Found no NVIDIA driver")
_CHECK_ERRORS = ((ReplayCheckError, "replay_check"), (OverwrittenOutputError, "replay_check"),
                 (CapturedAddressError, "captured_address"), (ExpandableSegmentsHazardError, "expandable_teardown"))


def settle(be: Backend) -> None:
    """What a reused process does between engines: collect garbage (engines often hold reference cycles,
    whose weights come back only at a collection), wait for the device, and flush both allocators' caches."""
    gc.collect()
    be.synchronize()
    be.empty_cache()
    be.host_empty_cache()


def build(factory: Callable[[Backend], Any], be: Backend) -> Engine:
    if not callable(factory):
        raise ConfigError(f"the engine factory must be callable(backend) -> engine, got {factory!r}")
    try:
        inspect.signature(factory).bind(be)
    except TypeError as e:  # told apart from a TypeError inside the factory: it is called as factory(backend)
        name = getattr(factory, "__qualname__", repr(factory))
        raise ConfigError(f"the engine factory {name} cannot be called as factory(backend) ({e}): give it one "
                          "parameter for the backend (e.g. `def make(backend): return MyEngine()`), or wrap it: "
                          "`lambda backend: MyEngine()`") from None
    except ValueError:  # no signature to read (a builtin): the call itself says what is wrong
        pass
    return Engine(factory(be))


_timed = False  # a capture was timed in this process (a forked child starts afresh: see _cold)


def _cold() -> bool:
    """Whether this is the first capture timed in this process: it pays for the process's first kernels,
    allocator segments and lazy imports, so it is not comparable with the engines after it."""
    global _timed
    cold, _timed = not _timed, True
    return cold


os.register_at_fork(after_in_child=lambda: globals().update(_timed=False))


def capture(engine: Engine, rec: CycleRecord) -> None:
    if engine.capture is None:
        return  # captured by the first run
    rec.cold = _cold()
    t0 = time.perf_counter()
    engine.capture()
    rec.capture_ms = (time.perf_counter() - t0) * 1e3


def exercise(engine: Engine, rec: CycleRecord, atol: float, reload: Callable[[Any], Any] | None = None) -> Any:
    """Run the example input (capturing first if the engine captures lazily) and compare with eager; with
    ``reload``, reload the engine's weights, run again and compare again: graphs that still read the old
    tensors give the old answer."""
    if engine.example_input is None:
        return None
    x = engine.example_input()
    if engine.capture is None:
        rec.cold = _cold()
    t0 = time.perf_counter()
    y = engine.run(x)
    if engine.capture is None:
        rec.capture_ms = (time.perf_counter() - t0) * 1e3
    if engine.eager is not None:
        err = max_abs_err(y, engine.eager(x))
        rec.replay_max_abs_err = err
        if not err <= atol:  # NaN fails too
            rec.add("replay_mismatch", f"replay differs from eager by {err:.3g} > atol {atol}")
    if reload is None:
        return y
    y = caller_copy(y)  # the next run overwrites the first one's output
    try:
        reload(engine.obj)
    except Exception as e:
        e.cudagraph_step = "reload"  # named as the step it failed in, not as the run around it
        raise
    y = engine.run(x)
    runner = getattr(engine.obj, "runner", None)
    named = runner.check_addresses(raise_=False) if getattr(runner, "checked", False) else []
    for problem in named:
        rec.add("captured_address", f"after reload: {problem}")
    if engine.eager is not None and not named:
        err = max_abs_err(y, engine.eager(x))
        if not err <= atol:
            rec.add("captured_address", f"after reload(engine) the replay differs from eager by {err:.3g} > atol "
                                        f"{atol}: the graphs still read tensors from before the reload (reload in "
                                        "place, param.data.copy_(new), or capture again)")
    return y


def budget(rec: CycleRecord, graph_bytes: dict[str, int] | None, max_pool_bytes: int | None,
           max_captures: int | None, require_replay: bool) -> None:
    """The engine's memory and capture budgets, and whether its graphs ever ran (or it silently ran eager)."""
    rec.replays, _ = ledger.replays_in(rec.engine)
    rec.graph_bytes = graph_bytes
    if max_pool_bytes is not None and rec.pool_bytes > max_pool_bytes:
        rec.add("pool_over_budget", f"its graph pools hold {size_text(rec.pool_bytes)}, over the max_pool_bytes "
                                    f"budget of {size_text(max_pool_bytes)}", rec.pool_bytes)
    if max_captures is not None and rec.graphs > max_captures:
        rec.add("too_many_captures", f"{rec.graphs} captures, over max_captures={max_captures} (recaptures count)")
    if require_replay and not rec.replays:
        rec.add("never_replayed", f"{rec.graphs} graph(s) captured, none replayed: the engine ran eagerly "
                                  "(require_replay=True)" if rec.graphs else
                "no graph was captured or replayed: the engine ran eagerly (require_replay=True)")


_PLAIN = (numbers.Number, str, bytes, enum.Enum, type(None))  # compared by nothing, hiding nothing (numpy scalars too)
OUTPUT_HELD = "the output the caller holds"


def max_abs_err(a: Any, b: Any) -> float:
    la, lb = leaves(a), leaves(b)
    fa = [t for t in la if isinstance(t, torch.Tensor)]
    fb = [t for t in lb if isinstance(t, torch.Tensor)]
    if len(fa) != len(fb):
        def kinds(leaves_: list) -> str:
            return ", ".join(sorted({type(x).__qualname__ for x in leaves_})) or "nothing"

        raise ConfigError(f"run(x) returned {len(fa)} tensor(s) ({kinds(la)}), eager(x) {len(fb)} ({kinds(lb)}): "
                          "they must return the same tensors, in the same structure (a tensor, or tuples, lists, "
                          "dicts, named tuples or dataclasses of them)")
    opaque = next((x for x in la + lb if not isinstance(x, (torch.Tensor, *_PLAIN))), None)
    if not fa and opaque is not None:  # nothing would be compared: say so rather than report a match
        raise ConfigError(f"run(x) and eager(x) returned no tensor the replay-versus-eager comparison can reach "
                          f"(inside a {type(opaque).__qualname__}): return tensors in tuples, lists, dicts, named "
                          "tuples or dataclasses, or leave eager() out")
    try:
        errs = [float((x.detach().float() - y.detach().float()).abs().max()) if x.numel() else 0.0
                for x, y in zip(fa, fb)]
    except RuntimeError as e:  # the harness's subtraction, not the engine's run, failed: say so
        raise ConfigError(f"the replay-versus-eager comparison cannot subtract these outputs ({first_line(e)}): "
                          "leave eager() out for outputs it cannot compare (a nested tensor, a tensor subclass "
                          "without subtraction)") from None
    return max(errs, default=0.0)


def failed(e: BaseException, rec: CycleRecord, be: Backend, since: int, step: str) -> None:
    """An engine step raised: a capture into a dead pool is ``stale`` (named from the ledger), the rest
    ``error``. The allocator's own assert poisons the process, and so does torch's refusal of a capture on the
    default stream."""
    first = first_line(e)
    step = getattr(e, "cudagraph_step", step)
    attempts = ledger.stale_since(since, be.world)
    chain = exception_chain(e)  # an engine may wrap torch's error (or ours) in its own: the reason is inside
    stale = next((x for x in chain if isinstance(x, StalePoolError)), None)
    asserted = stale is None and any(m in str(x) for x in chain for m in ASSERT_MARKERS)
    wrapped = f" (raised as {type(e).__name__}: {first})"
    kind = next((k for cls, k in _CHECK_ERRORS if isinstance(e, cls)), None)
    if kind is not None:
        rec.add(kind, f"{type(e).__name__}: {e}")
        return
    if ledger.failed_captures_since(since, (be.world,)):  # a capture's end raised, and so did the step
        failed_capture(rec, be, since, f"{type(e).__name__} during {step}: {first}")
        return
    refused = not any(isinstance(x, DefaultStreamCaptureError) for x in chain) and \
        any(TORCH_DEFAULT_STREAM_REFUSAL in str(x) for x in chain)
    if refused:
        rec.poisoned = True
        seen = ledger.torch_refusals(since, (be.world,))
        at = f" at {seen[-1].site}" if seen and seen[-1].site else ""
        rec.add("error", f"{type(e).__name__} during {step}{at}: {first} -- {_poisoned_by_refusal(be)}",
                sites=[seen[-1].site] if seen else [])
        return
    if stale is not None or asserted:
        a = attempts[-1] if attempts else None
        if asserted:
            rec.poisoned = True
        if a is not None:
            rec.note_pool(a.key)
        if stale is not None:
            msg = f"StalePoolError: {stale}" + ("" if stale is e else wrapped)
        else:
            torch_said = next(str(x) for x in chain if any(m in str(x) for m in ASSERT_MARKERS))
            said = (torch_said.strip().splitlines() or [""])[0].split(", please report a bug to PyTorch")[0]
            msg = f"the allocator asserted during {step}: {said}"
            msg += "" if torch_said == str(e) else wrapped
            if a is not None:
                msg += (f" -- a capture into pool {a.key[2]} on device {a.key[1]}"
                        f"{f' at {a.site}' if a.site else ''}{_minted_phrase(a.minted_site)}, dead since its "
                        f"last graph was released{f' (made by {a.owner})' if a.owner else ''}"
                        f"{f'; it was pinned: {pinned_text([Pin(**p) for p in a.pins])}' if a.pins else ''}. "
                        f"{stale_fix(a.owner, a.scope)}; "
                        f"{SANITIZER_STOPS_IT}\n" + "".join(a.stacks()))
        # the refusal's facts as data too (what pins the pool, the bytes it holds, where it was captured,
        # minted and released): a gate reads the fields, not the message
        rec.add("stale", msg, getattr(stale, "held_bytes", a.held_bytes if a is not None else 0),
                getattr(stale, "stacks", None) or (a.stacks() if a is not None else []),
                getattr(stale, "pins", None) or (list(a.pins) if a is not None else []),
                sites=[a.site, a.minted_site] if a is not None else [getattr(stale, "site", "")])
        return
    hint = ""
    if be.name == "sim" and any(m in str(e) for m in NO_CUDA_MARKERS):
        hint = (" -- the engine uses CUDA itself, and this run has no GPU (backend sim): mark its test "
                "@pytest.mark.gpu to skip it where there is none, or build it through the backend it is given "
                "(backend.torch_device(0), backend.randn, backend.new_graph)")
    at = raised_site(e)
    rec.add("error", f"{type(e).__name__} during {step}{f' at {at}' if at else ''}: {first}{hint}",
            stacks=[f"--- the engine's traceback ---\n{shown_traceback(e)}"], sites=[at])


SANITIZER_STOPS_IT = ("a PoolSanitizer (in the pytest plugin: --cudagraph-sanitize=on or strict) refuses such a "
                      "capture before the allocator asserts, and the process stays usable")


def _poisoned_by_refusal(be: Backend) -> str:
    return ("torch refused a capture on the default stream after opening the CUDA RNG's capture, so every later "
            "eager random op of this process fails. With a sanitizer (--cudagraph-sanitize=on or strict, "
            "CUDAGRAPH_SANITIZE=1, or a PoolSanitizer) the capture is refused before torch begins it. "
            f"{side_stream_fix(be.world)}")


def refused_on_default_stream(rec: CycleRecord, be: Backend, since: int) -> None:
    """torch refused a capture on the default stream during this cycle, and the engine went on (it caught the
    error, ran eagerly): the process's random ops are poisoned all the same, as the ledger saw."""
    if rec.poisoned:
        return
    seen = ledger.torch_refusals(since, (be.world,))
    if seen:
        rec.poisoned = True
        rec.add("error", f"a capture on the default stream at {seen[-1].site or '(unknown)'}, whose error the engine "
                f"caught: {_poisoned_by_refusal(be)}", sites=[seen[-1].site])


FAILED_CAPTURE = "failed when it ended"  # words of the problem below: it is added once a cycle


def failed_capture(rec: CycleRecord, be: Backend, since: int, raised: str | None = None) -> None:
    """A capture of this cycle whose end raised (``raised``: the step's error, where the engine let it out;
    None: the engine caught it and went on, eagerly). torch keeps that pool's references for good and leaves
    the RNG's capture open: the process is poisoned, the worker replaced, whatever else the cycle saw."""
    seen = ledger.failed_captures_since(since, (be.world,))
    if not seen:
        return
    f = seen[-1]
    rec.poisoned = True
    if f.key[2] is not None:
        rec.note_pool(f.key)
    if any(p.kind == "error" and FAILED_CAPTURE in p.message for p in rec.problems):
        return
    how = f"{raised}: " if raised else "the engine caught the error and went on without that graph (eagerly): "
    said = "" if raised and f.error in raised else f" ({f.error})"
    pool = f" into pool {f.key[2]}" if f.key[2] is not None else ""
    rec.add("error", f"{how}a capture{pool} began at {f.site or '(unknown)'} and {FAILED_CAPTURE}{said}"
                     f"{f'; inside it {f.broken_at}' if f.broken_at else ''}. torch gives back none of a failed "
                     "capture's pool references (the pool stays reserved for the process's life) and leaves the "
                     "CUDA RNG's capture open (eager random ops fail until a later capture ends): the worker is "
                     "replaced. Move what broke the capture out of the captured code: a host sync (.item(), "
                     ".cpu(), .tolist(), a print of a tensor, a branch on a tensor's value) or an op that cannot "
                     "be captured; where no line of the captured code did it, another thread may have: a "
                     "synchronize or empty_cache while this capture ran (entering torch.cuda.graph does both)." + (f"\n--- the capture began at ---\n{f.at}" if f.at else ""),
            sites=[f.site, f.broken_at.split(": ", 1)[0]])


def caught_stale(rec: CycleRecord, be: Backend, since: int) -> None:
    """A capture into a dead pool during this cycle whose error the engine caught (it went on without that
    graph, eagerly): stale all the same. Where no sanitizer refused it, the allocator asserted: poisoned."""
    if any(p.kind == "stale" for p in rec.problems):
        return
    seen = ledger.stale_since(since, be.world)
    if not seen:
        return
    a = seen[-1]
    rec.note_pool(a.key)
    if not a.refused:
        rec.poisoned = True
    what = ("the sanitizer refused it (StalePoolError)" if a.refused else
            "the allocator asserted ('use_count > 0 INTERNAL ASSERT FAILED') and the process is poisoned")
    # what kept the dead pool, read as the capture came (in every mode: the allocator's assert is explained
    # as the sanitizer's refusal is)
    pins, held = [Pin(**p) for p in a.pins], a.held_bytes
    if pins:
        what += f"; the pool was pinned: {pinned_text(pins)}"
    if a.refused:
        what += "".join(f"; {note}" for note in mempool_notes([a.key]).values())
    rec.add("stale", f"a capture into stale pool {a.key[2]} on device {a.key[1]} at {a.site or '(unknown)'}"
                     f"{_minted_phrase(a.minted_site)}, whose "
                     f"error the engine caught (it went on without its graphs): {what}."
                     f"{f' The pool was made by {a.owner}.' if a.owner else ''} {stale_fix(a.owner, a.scope)}.\n"
                     + "".join(a.stacks()), held, a.stacks(), [p.as_dict() for p in pins],
            sites=[a.site, a.minted_site])


def _pool_sites(pools: list[Key]) -> list[str]:
    """Where the user's code captured into these pools (file:line in function), at most SITES of them."""
    sites: list[str] = []
    for k in pools:
        e = ledger.pools.get(k)
        sites += [s for s in (e.capture_sites() if e is not None else []) if s not in sites]
    return sites[:SITES]


def _captured_at(pools: list[Key]) -> str:
    """`` (captured at file:line in function, ...)``: where the user's code captured into these pools."""
    sites = _pool_sites(pools)
    return f" (captured at {', '.join(sites)})" if sites else ""


def _minted_site(key: Key) -> str:
    e = ledger.pools.get(key)
    m = e.minted_at if e is not None else None
    return m.site() if isinstance(m, Stack) else ""


def _minted_phrase(site: str) -> str:
    return f", its id minted at {site}" if site else ""


def _minted_at(key: Key) -> str:
    return _minted_phrase(_minted_site(key))


def _stacks(be: Backend, pools: list[Key]) -> list[str]:
    return [b.stack for k in pools for b in be.live_blocks(k[2], k[1]) if b.stack][:8]


def judge(be: Backend, rec: CycleRecord, output: Any, hold: bool, declared: list | None,
          released_left: list = (), released_holder: str | None = None) -> list[Key]:
    """After release and settle: the engine's graphs (never reset, or left captured by ``release()``:
    ``released_left``, the ledger's entries of that moment, held then as ``released_holder``), its pools from the ledger, their bytes, reuse, the
    cross-check. Returns the pools (the caller's next check reads them)."""
    label = rec.engine
    keys = ledger.pools_of_scope(be.world, label)
    for k in keys:
        rec.note_pool(k)
    rec.graphs = ledger.captures_in(label)
    not_reset = [g for g in ledger.live_graphs(be.world) if g.scope == label]
    if not_reset:
        held_by = graph_holder(not_reset)
        sites = graph_sites(not_reset)
        rec.add("graphs_not_reset",
                f"{len(not_reset)} graph(s) captured by this engine"
                + (f" (at {', '.join(sites)})" if sites else "") + " were still not reset when release() and the "
                "settle had ended: "
                + (f"one is held as {held_by}; reset them in release() or drop that reference" if held_by else
                   "something still holds them after release (a module global, a cache of graphs, or a reset "
                   "left to a thread or a callback, which the next engine's captures need not wait for)"),
                0, [str(not_reset[0].captured_at)], sites=sites)
    elif released_left:  # still captured right after release(), gone since (collected with the engine)
        sites = graph_sites(released_left)
        rec.add("release_incomplete",
                f"release() left {len(released_left)} graph(s) captured"
                + (f" (at {', '.join(sites)})" if sites else "")
                + (f", held then as {released_holder}" if released_holder else "")
                + ": reset them in release(); until they are reset (or collected), whoever holds them keeps "
                "their pools", sites=sites)
    left = {k: be.pool_state(k[2], k[1]).reserved_bytes for k in keys}
    # a pool whose MemPool object someone still holds stays whatever the caller drops (and the next engine may
    # capture into it, so it would never be judged again): leaked now, held output or not
    by_mempool = mempool_notes([k for k, b in left.items() if b]) if hold else {}
    if by_mempool:
        kept = sum(left.pop(k) for k in by_mempool)
        rec.leaked_bytes += kept
        rec.add("leaked", f"after release its pools {[k[2] for k in by_mempool]}{_captured_at(list(by_mempool))} "
                          f"still hold {size_text(kept)}: "
                + "; ".join(by_mempool.values()), kept, _stacks(be, list(by_mempool)),
                sites=_pool_sites(list(by_mempool)))
    total = sum(left.values())
    pinned = [k for k, b in left.items() if b]
    held_output = total and hold and output is not None
    # blocks the held output does not keep alive, and a holder named for them (the user's, or a library's
    # workspace): pinned whatever the caller does, and the next engine may replace that holder (or capture
    # into the pool and be stale, ending the worker) before the output is dropped
    stray = beyond_output(be, pinned, output) if held_output else []
    others = [p for p in what_pins(be, pinned, {id(t): OUTPUT_HELD for t in leaves(output)},
                                   only=stray, infer=False)
              if p.cause in ("python_reference", "autograd_history", "library_workspace")
              and OUTPUT_HELD not in p.holder] if stray else []
    if held_output and not others:
        rec.held_bytes = total  # judged again once the caller drops it (check_held)
    elif held_output:  # leaked: what those holders pin; held: the rest, the output's (checked again later)
        rec.leaked_bytes = min(total, sum(p.bytes for p in others))
        rec.held_bytes = total - rec.leaked_bytes
        why = "; ".join([describe(others)] + list(mempool_notes(pinned).values()))
        rec.add("leaked", f"after release its pools {[k[2] for k in pinned]}{_captured_at(pinned)} still hold "
                          f"{size_text(total)}, and not only for the output the caller holds: " + why,
                rec.leaked_bytes, _stacks(be, list(keys)), [p.as_dict() for p in others], _pool_sites(pinned))
    elif total:
        rec.leaked_bytes = total
        known = {id(t): "the copy of its output the caller keeps" for t in leaves(output)}
        pins = what_pins(be, pinned, known)
        why = "; ".join(([describe(pins)] if pins else []) + list(mempool_notes(pinned).values())) or \
            _leak_hint(output)
        rec.add("leaked", f"after release its pools {[k[2] for k in pinned]}{_captured_at(pinned)} still hold "
                          f"{size_text(total)} that no "
                          "output the caller holds pins: " + why,
                total, _stacks(be, list(keys)), [p.as_dict() for p in pins], _pool_sites(pinned))
    for k in keys:
        earlier = [s for s in ledger.scopes_of(*k) if s != label]
        if earlier:
            rec.add("reused", f"captured into pool {k[2]} on device {k[1]}{_captured_at([k])}{_minted_at(k)}, which "
                              f"{earlier[0]} captured into and released: a kept pool handle (latent here, since the "
                              "pool was erased in between: it asserts once something pins that pool, or where no "
                              "cache flush runs between the release and the next capture, as with a raw "
                              f"capture_begin; torch.cuda.graph flushes first). {FRESH_POOL_FIX}", sites=_pool_sites([k]) + [_minted_site(k)])
    if declared is not None:
        rec.declared_pool_ids = [[d, list(p)] for d, p in declared]
        seen = {(k[1], k[2]) for k in keys}
        said = set(declared)
        if said - seen:
            rec.add("pool_ids_mismatch", f"pool_ids() names {sorted(said - seen)}, which it did not capture into")
        if seen - said:
            hidden = [k for k in keys if (k[1], k[2]) in seen - said]
            rec.add("pool_ids_mismatch", f"pool_ids() hides {sorted(seen - said)}, which it captured into"
                                         f"{_captured_at(hidden)}", sites=_pool_sites(hidden))
    rec.settle_verdict()
    return keys


def _leak_hint(output: Any) -> str:
    """Where no live block could be listed (a backend without books of blocks)."""
    flat = [t for t in leaves(output) if isinstance(t, torch.Tensor)]
    if any(t.grad_fn is not None for t in flat):
        return ("its output carries autograd history, so a copy of it keeps the capture's saved activations "
                "alive: capture (and run) under torch.no_grad() or torch.inference_mode()")
    return "a tensor allocated in its captures outlives the engine"
