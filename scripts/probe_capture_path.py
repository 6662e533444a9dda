"""Probe: what each part of the sanitizer's capture_begin wrapper costs in the torch.cuda.graph flow, by
measuring variants of that wrapper side by side (the same rounds as bench_wrapper_cost's segment profile).
Every variant is a working wrapper on the sanitizer's own ledger (the flushes and capture_end stay the
sanitizer's); each takes out or moves one part:

- ``sanitizer``: the wrapper as installed;
- ``no_device_read``: the device taken as 0 (what a one-GPU process could do);
- ``inline_record``: the recorder's body inlined into the wrapper (one Python call less);
- ``context_cell``: scope, test and generation read from one closure tuple, not three ledger attributes, and no
  ``ledger.seq`` write (what a ledger context object would give);
- ``lean``: all of the above, and no read of a previous entry on the graph;
- ``weak_reference_alone``: no sanitizer; a wrapper that sets one weak reference (the floor);
- ``py_minimal`` and ``compiled`` (with ``--compiled``): the common path's work alone (the process backend,
  the default-stream judgment, the original, the stack, a weak reference with a callback and a record tagged
  on the graph and queued, not counted in the ledger), in Python and compiled from
  ``scripts/probe_compiled_wrapper.c`` with the machine's C compiler: what compiling the path would save.

    python3 scripts/probe_capture_path.py [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import weakref

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.bench_wrapper_cost import segment_round  # noqa: E402
from bench.common import emit  # noqa: E402
from cudagraph_lifecycle import PoolSanitizer, get_backend, observe  # noqa: E402
from cudagraph_lifecycle.backends import graph_apis  # noqa: E402
from cudagraph_lifecycle.ledger import CAPTURE_STACK_DEPTH, GraphEntry  # noqa: E402
from cudagraph_lifecycle.observe.wrappers import TAG  # noqa: E402


def variant(original, proc, current_device, device0=False, inline=False, ctx_cell=False, no_old=False):
    hooks = observe.hooks
    led = hooks.ledger
    pending, gone, seq, register = led.pending, hooks._gone, led.seq_counter, hooks.register
    pending_keys, dead, dead_ids = led.pending_keys, led.dead, led.dead.ids
    getframe, more, depth = sys._getframe, range(CAPTURE_STACK_DEPTH - 1), CAPTURE_STACK_DEPTH
    ctx = (led.scope, led.test, led.generation)
    record = observe._direct[next(iter(observe._direct))][0].record

    def wrapper(graph, pool=None, *args, **kwargs):
        be = proc._process
        given = pool
        device = None
        if pool is not None:
            if type(pool) is not tuple:
                pool = tuple(pool)
            if pool == (0, 0):
                pool = None
            elif (dead_ids and pool in dead_ids) or pending_keys:
                device = 0 if device0 else current_device()
                key = (be.world, device, pool)
                if pending_keys and key in pending_keys:
                    with led.lock:
                        led.drain()
                if key in dead:
                    hooks.judge(*key)
        original(graph, given, *args, **kwargs)
        if device is None:
            device = 0 if device0 else current_device()
        f = getframe(1)
        frames = [f.f_code, f.f_lasti] * depth
        i = 2
        for _ in more:
            f = f.f_back
            if f is None:
                del frames[i:]
                break
            frames[i] = f.f_code
            frames[i + 1] = f.f_lasti
            i += 2
        if not inline:
            record(graph, be, device, pool, frames)
            return
        g = GraphEntry(graph, gone)
        if ctx_cell:
            g.seq = g.gid = next(seq)
            g.scope, g.test, g.generation = ctx
        else:
            led.seq = g.seq = g.gid = next(seq)
            g.scope, g.test, g.generation = led.scope, led.test, led.generation
        g.world, g.pool_id, g.device, g.frames = be.world, pool, device, frames
        g.captured = g.counted = False
        g.alive, g.replays = True, 0
        old = None if no_old else getattr(graph, TAG, None)
        setattr(graph, TAG, g)
        pending.append(g if type(old) is not GraphEntry else (register, (g, old)))
        if len(pending) > 256:
            with led.lock:
                led.drain()

    return wrapper


def compiled_module():
    """scripts/probe_compiled_wrapper.c built with the machine's C compiler into a temporary folder, imported."""
    import importlib.util
    import subprocess
    import sysconfig
    import tempfile

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_compiled_wrapper.c")
    out = os.path.join(tempfile.mkdtemp(), "probe_compiled_wrapper" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = os.environ.get("CC", "cc")
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-O2", f"-I{sysconfig.get_paths()['include']}", src, "-o", out],
                       check=True)
    except (OSError, subprocess.CalledProcessError) as e:  # no compiler or no headers: the other sides still run
        print(f"probe_capture_path: the compiled side is left out: {e}", file=sys.stderr)
        return None
    spec = importlib.util.spec_from_file_location("probe_compiled_wrapper", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def minimal(original, proc, api, queue, compiled=None):
    """The common path's work alone, in Python, or the same compiled (``compiled``: the built module)."""
    hooks = observe.hooks
    led = hooks.ledger
    judges, ctx = hooks.judges, (led.scope, led.test, led.generation)
    current_device = api.current_device or (lambda: 0)
    stream_of = api.current_stream or (lambda d: (0,))
    default_of = api.default_stream or (lambda d: (1,))

    def gone(_ref):
        pass

    if compiled is not None:
        return compiled.make(original, proc, judges, current_device, stream_of, default_of, "_probe_entry", gone,
                             queue, ctx, CAPTURE_STACK_DEPTH)
    getframe, depth, defaults, ref = sys._getframe, CAPTURE_STACK_DEPTH, {}, weakref.ref

    def wrapper(graph, pool=None, *args, **kwargs):
        be = proc._process
        world = be.world
        device = None
        rules = judges.get(world)
        if rules:
            device = current_device()
            default = defaults.get(device)
            if default is None:
                default = defaults[device] = default_of(device)[0]
            if stream_of(device)[0] == default:
                raise RuntimeError("probe: capture on the default stream")
        original(graph, pool, *args, **kwargs)
        if device is None:
            device = current_device()
        frames = []
        f = getframe(1)
        for _ in range(depth):
            if f is None:
                break
            frames += (f.f_code, f.f_lasti)
            f = f.f_back
        entry = (ref(graph, gone), world, pool, device, frames, ctx)
        graph._probe_entry = entry
        queue.append(entry)

    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--graphs", type=int, default=8)
    ap.add_argument("--sides", help="comma-separated sides to run (default: all; plain always runs)")
    ap.add_argument("--compiled", action="store_true", help="add the py_minimal and compiled sides (needs cc)")
    ap.add_argument("--json")
    a = ap.parse_args()
    be = get_backend(a.backend)
    dev = be.torch_device(0)
    x = torch.ones(64, 256, device=dev)
    stream = be.new_stream()
    cls = torch.cuda.CUDAGraph if be.name == "cuda" else type(be.new_graph())
    api_proc = type(be) if hasattr(type(be), "_process") else None
    reader = getattr(torch._C, "_cuda_getDevice", None) if be.name == "cuda" else (lambda: 0)

    def one_round():
        return segment_round(be, stream, x, a.graphs)

    def sanitized(**flags):
        with PoolSanitizer(be):
            ours = cls.capture_begin
            if flags:
                proc = api_proc
                if proc is None or proc._process is not be:
                    class _P:  # the sim's backend is the process one only through get_backend
                        _process = be
                    proc = _P
                cls.capture_begin = variant(ours.__wrapped__, proc, reader, **flags)
            try:
                return one_round()
            finally:
                cls.capture_begin = ours

    def weak_reference_alone():
        original = cls.capture_begin

        def gone(_ref):
            pass

        def observed(graph, *args, **kwargs):
            original(graph, *args, **kwargs)
            graph._probe_observed = weakref.ref(graph, gone)

        cls.capture_begin = observed
        try:
            return one_round()
        finally:
            cls.capture_begin = original

    api = next(x for x in graph_apis() if x.kind == be.name)
    built = compiled_module() if a.compiled else None

    def lean_side(compiled=None):
        with PoolSanitizer(be):
            ours = cls.capture_begin
            proc = api_proc
            if proc is None or proc._process is not be:
                class _P:  # the sim's backend is the process one only through get_backend
                    _process = be
                proc = _P
            queue: list = []
            cls.capture_begin = minimal(ours.__wrapped__, proc, api, queue, compiled)
            try:
                out = one_round()
            finally:
                cls.capture_begin = ours
            assert len(queue) == a.graphs and all(len(e[4]) == 2 * CAPTURE_STACK_DEPTH for e in queue), queue
            queue.clear()
            return out

    sides = {"plain": one_round, "weak_reference_alone": weak_reference_alone, "sanitizer": sanitized,
             "no_device_read": lambda: sanitized(device0=True),
             "inline_record": lambda: sanitized(inline=True),
             "context_cell": lambda: sanitized(inline=True, ctx_cell=True),
             "lean": lambda: sanitized(device0=True, inline=True, ctx_cell=True, no_old=True)}
    if built is not None:
        sides.update(py_minimal=lean_side, compiled=lambda: lean_side(built))
    if a.sides:
        keep = {"plain", *a.sides.split(",")}
        if a.compiled and built is None:  # not built here: those sides are left out, the others run
            keep -= {"py_minimal", "compiled"}
        unknown = keep - set(sides)
        if unknown:
            ap.error(f"--sides: unknown {sorted(unknown)}; choose from {sorted(sides)}")
        sides = {k: v for k, v in sides.items() if k in keep}
    seen: dict = {name: [] for name in sides}
    order = list(sides)
    for name in order:
        sides[name]()
    for i in range(a.rounds):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            seen[name].append(sides[name]())
    out: dict = {"backend": be.name, "torch": torch.__version__, "python": sys.version.split()[0],
                 "graphs": a.graphs, "rounds": a.rounds, "compiled_built": built is not None}
    base = seen["plain"]
    totals = {name: [sum(sum(s) for s in r) for r in rr] for name, rr in seen.items()}
    for name, rr in seen.items():
        row = {"round_us": statistics.median(totals[name]) / 1e3}
        if name != "plain":
            ratios = sorted(b / p for p, b in zip(totals["plain"], totals[name]))
            row["overhead"] = statistics.median(ratios) - 1
            for k, part in enumerate(("enter", "op", "exit")):
                diffs = [statistics.fmean(s[k] for s in r) - statistics.fmean(s[k] for s in p) for r, p in zip(rr, base)]
                row[f"extra_{part}_us"] = statistics.median(diffs) / 1e3
        out[name] = row
    emit(out, a.json)


if __name__ == "__main__":
    main()
