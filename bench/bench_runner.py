"""Runner overhead and graph memory, side by side in one run (GPU; also runs on sim for a smoke check).

    python bench/bench_runner.py [--backend cuda|sim] [--json PATH]

Targets (issue 2): runner step <= 1.05x raw copy-in + replay; 8 sizes in one pool <= 1.15x the largest
alone; 0 bytes left after release (vs a naive release that keeps one output).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import StartedOnce, emit, pinned_pools  # noqa: E402
from bench.models import launch_bound_model  # noqa: E402
from cudagraph_lifecycle import CUDAGraphRunner, checks, get_backend  # noqa: E402

MiB = 1 << 20


def timeit(be, fn, iters, reps=7):
    """Median over reps of the mean time per call (us), synchronizing around each rep."""
    for _ in range(20):
        fn()
    be.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        be.synchronize()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(out), out


def bench_step(be, iters):
    dev = be.torch_device(0)
    dtype = torch.float16 if be.name == "cuda" else torch.float32
    fwd = launch_bound_model(dev, dtype)
    x = torch.randn(1, 256, device=dev, dtype=dtype)
    # raw: one graph, static input, copy-in + replay
    static = torch.zeros(1, 256, device=dev, dtype=dtype)
    g = be.new_graph()
    s = be.capture_stream(0)
    with torch.no_grad():
        with be.stream(s):
            for _ in range(3):
                fwd(static)
        be.synchronize()
        with be.stream(s):
            g.capture_begin(pool=be.graph_pool_handle())
            raw_out = fwd(static)
            g.capture_end()

    def raw():
        static.copy_(x)
        g.replay()
        return raw_out

    r = CUDAGraphRunner(fwd, [1], (256,), dtype=dtype, backend=be)
    r.capture()

    def eager():
        with torch.no_grad():
            return fwd(x)

    res = {}
    # interleave the three so drift hits all of them alike
    for name, fn in (("eager", eager), ("raw_copy_replay", raw), ("runner", lambda: r.run(x)),
                     ("raw_copy_replay#2", raw), ("runner#2", lambda: r.run(x))):
        res[name] = timeit(be, fn, iters)[0]
    raw_us = min(res["raw_copy_replay"], res["raw_copy_replay#2"])
    run_us = min(res["runner"], res["runner#2"])
    assert torch.allclose(r.run(x), eager(), atol=1e-2)
    r.release()
    g.reset()
    return {"eager_us": res["eager"], "raw_copy_replay_us": raw_us, "runner_us": run_us,
            "runner_over_raw": run_us / raw_us, "eager_over_runner": res["eager"] / run_us,
            "target_runner_over_raw": 1.05}


def capture_memory(be, sizes, order, shared=True, new_stream_each=False, hidden=2048, ffn=None,
                   dtype=torch.float32, one_output=False, split=False):
    """(bytes of the graphs' pools, growth of reserved memory) for an MLP captured at ``sizes`` in ``order``.
    Without ``ffn``: 4 square layers; with it: 4 transformer-style MLP blocks (hidden -> ffn -> hidden).
    ``one_output``: each later graph copies its output into the first graph's (outputs of all sizes then share
    one buffer, as when outputs are valid only until the next step), so its own output block is freed.
    ``split``: also return the bytes of the pools' small segments."""
    dev = be.torch_device(0)
    torch.manual_seed(0)
    if ffn is None:
        ws = [torch.randn(hidden, hidden, device=dev, dtype=dtype) * hidden**-0.5 for _ in range(4)]

        def fwd(x):
            for w in ws:
                x = torch.relu(x @ w)
            return x
    else:
        ws = [(torch.randn(hidden, ffn, device=dev, dtype=dtype) * hidden**-0.5,
               torch.randn(ffn, hidden, device=dev, dtype=dtype) * ffn**-0.5) for _ in range(4)]

        def fwd(x):
            for up, down in ws:
                x = x + torch.relu(x @ up) @ down
            return x

    static = torch.zeros(max(sizes), hidden, device=dev, dtype=dtype)
    be.synchronize()
    be.empty_cache()
    base = be.memory_reserved(0)
    pools, keep = [], []
    shared_pool = be.graph_pool_handle()
    with torch.no_grad():
        for bs in order:
            s = be.new_stream(0) if new_stream_each else be.capture_stream(0)
            pool = shared_pool if shared else be.graph_pool_handle()
            with be.stream(s):
                fwd(static[:bs])
            be.synchronize()
            g = be.new_graph()
            with be.stream(s):
                g.capture_begin(pool=pool)
                out = fwd(static[:bs])
                if one_output and keep:
                    out = keep[0][1][:bs].copy_(out)
                g.capture_end()
            keep.append((g, out))
            pools.append(pool)
    be.synchronize()
    total = sum(be.pool_state(p).reserved_bytes for p in set(pools))
    small = sum(s["size"] for s in be.segments(0) if s["pool_id"] in set(pools) and s.get("small"))
    growth = be.memory_reserved(0) - base
    del keep, out, g
    ws.clear()  # the weights go too: the next case starts from the same reserved memory
    be.synchronize()
    be.empty_cache()
    return (total, growth, small) if split else (total, growth)


def memory_case(be, sizes, **model):
    desc = sorted(sizes, reverse=True)
    largest, _ = capture_memory(be, [max(sizes)], [max(sizes)], **model)
    shared, shared_growth = capture_memory(be, sizes, desc, **model)
    _, stream_growth = capture_memory(be, sizes, desc, new_stream_each=True, **model)
    res = {
        "sizes": sizes,
        **{k: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v for k, v in model.items()},
        "largest_alone_mib": largest / MiB,
        "shared_largest_first_mib": shared / MiB,
        "shared_smallest_first_mib": capture_memory(be, sizes, sorted(sizes), **model)[0] / MiB,
        "separate_pools_mib": capture_memory(be, sizes, desc, shared=False, **model)[0] / MiB,
        "shared_one_output_buffer_mib": capture_memory(be, sizes, desc, one_output=True, **model)[0] / MiB,
        "one_stream_reserved_growth_mib": shared_growth / MiB,
        "new_stream_each_reserved_growth_mib": stream_growth / MiB,
    }
    res["shared_over_largest"] = res["shared_largest_first_mib"] / res["largest_alone_mib"]
    res["target_shared_over_largest"] = 1.10
    # The floor of any packing: blocks of up to 1 MiB live only in small segments, larger ones only in large
    # segments, so a shared pool needs at least the most large bytes and the most small bytes any one graph
    # needs alone.
    alone = [capture_memory(be, [bs], [bs], split=True, **model) for bs in sizes]
    floor = max(t - s for t, _, s in alone) + max(s for _, _, s in alone)
    res["small_segments_alone_mib"] = {bs: s / MiB for bs, (_, _, s) in zip(sizes, alone)}
    res["packing_floor_mib"] = floor / MiB
    res["shared_over_floor"] = res["shared_largest_first_mib"] / res["packing_floor_mib"]
    return res


@contextlib.contextmanager
def capture_path(path):
    """CUDAGRAPH_CAPTURE_PATH set to ``path`` (None: as it was) while a runner captures: its op watch's path."""
    before = os.environ.get("CUDAGRAPH_CAPTURE_PATH")
    if path is not None:
        os.environ["CUDAGRAPH_CAPTURE_PATH"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDAGRAPH_CAPTURE_PATH", None)
        else:
            os.environ["CUDAGRAPH_CAPTURE_PATH"] = before


def bench_checks(be, iters, rounds=8):
    """What checked mode costs, side by side with the default runner, for all checks at once and for each
    alone: one step (batch 3 on the batch-4 graph), one capture set of 4 graphs, and one check_addresses().

    A capture set takes 2-7 ms, so one sample moves with the host: ``rounds`` rounds, every configuration
    once a round, the order reversed every other round (the first runner of a round captures slower,
    measured: 3.0-3.5 vs 2.0 ms); each ratio is the median over the rounds of a configuration against the
    default of the same round."""
    dev = be.torch_device(0)
    dtype = torch.float16 if be.name == "cuda" else torch.float32
    fwd = launch_bound_model(dev, dtype)
    x = torch.randn(3, 256, device=dev, dtype=dtype)
    configs = {"default": dict(checked=False), "checked": dict(checked=True),
               **{c: dict(checked=[c]) for c in checks.CHECKS},
               "capture_largest": dict(checked=["capture"], watch="largest")}  # one watched capture of the four
    step: dict[str, list[float]] = {name: [] for name in configs}
    capture: dict[str, list[float]] = {name: [] for name in configs}
    addresses: list[float] = []
    for rnd in range(rounds):
        for name, kw in list(configs.items())[:: 1 if rnd % 2 == 0 else -1]:
            r = CUDAGraphRunner(fwd, [1, 2, 4, 8], (256,), dtype=dtype, backend=be, **kw)
            gc.collect()  # a collection inside a 2 ms capture would be the whole difference
            r.capture()
            step[name].append(timeit(be, lambda r=r: r.run(x), iters)[0])
            capture[name].append(r.stats.capture_ms)
            if name == "capture":
                t0 = time.perf_counter()
                for _ in range(20):
                    r.check_addresses()
                addresses.append((time.perf_counter() - t0) / 20 * 1e6)
            r.release()
    med = statistics.median
    out: dict = {"rounds": rounds, "check_addresses_us": med(addresses)}
    for name in configs:
        out[f"step_us_{name}"], out[f"capture_ms_{name}"] = med(step[name]), med(capture[name])
        if name != "default":
            out[f"step_ratio_{name}"] = med(a / b for a, b in zip(step[name], step["default"]))
            out[f"capture_ratio_{name}"] = med(a / b for a, b in zip(capture[name], capture["default"]))
            ratios = [a / b for a, b in zip(capture[name], capture["default"])]
            out[f"capture_ratio_{name}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    out["step_ratio"], out["capture_ratio"] = out["step_ratio_checked"], out["capture_ratio_checked"]
    return out


def bench_memory(be):
    """Two models: a small square MLP (its blocks straddle the allocator's 1 MiB small/large split, so the
    fixed 2 MiB small segments weigh in), and a decode-sized one (Llama-8B-like MLP blocks in bf16)."""
    if be.name != "cuda":  # the simulated allocator keeps real CPU tensors: keep it small
        return {"small": memory_case(be, [1, 2, 4, 8, 16, 32, 64, 128], hidden=1024)}
    return {
        "small": memory_case(be, [1, 2, 4, 8, 16, 32, 64, 128], hidden=4096),
        "decode": memory_case(be, [2, 4, 8, 16, 32, 64, 128, 256], hidden=4096, ffn=14336, dtype=torch.bfloat16),
    }


def bench_release(be):
    dev = be.torch_device(0)
    fwd = lambda x: torch.relu(x @ w)  # noqa: E731
    w = torch.randn(1024, 1024, device=dev)
    r = CUDAGraphRunner(fwd, [1, 2, 4, 8, 16, 32, 64, 128], (1024,), backend=be)
    r.run(torch.randn(3, 1024, device=dev))
    clean = r.release()
    # naive: reset every graph of a shared handle but keep one output, as a caller would
    h = be.graph_pool_handle()
    s = be.capture_stream(0)
    graphs = []
    static = torch.zeros(128, 1024, device=dev)
    with torch.no_grad():
        for bs in [128, 64, 32, 16, 8, 4, 2, 1]:
            g = be.new_graph()
            with be.stream(s):
                g.capture_begin(pool=h)
                out = fwd(static[:bs])
                g.capture_end()
            graphs.append((g, out))
    kept = graphs[0][1]
    for g, _ in graphs:
        g.reset()
    del graphs, g, _, out
    be.synchronize()
    be.empty_cache()
    naive_left = be.pool_state(h).reserved_bytes
    del kept
    return {"runner_bytes_after_release": clean.pinned_bytes, "naive_bytes_after_release": naive_left,
            "target_runner_bytes_after_release": 0}


def median_ci95(n: int) -> tuple[int, int]:
    """The ranks (in n sorted values) of the distribution-free 95 % interval of their median:
    n/2 -+ 1.96 sqrt(n)/2."""
    half = 0.98 * n**0.5
    return max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 0.999))


def bench_sanitizer(be, rounds=200, step_rounds=10):
    """Capture time of a runner (8 batch sizes) and replay time, with and without the pool sanitizer.

    Paired rounds in ABBA order, a full collection before each capture (so a gen-2 GC lands in neither
    side by chance). One round's ratio spreads over +-10 % on the H200's host, so the overhead is the
    median of 200 per-round ratios, with its distribution-free 95 % interval and the interquartile range.
    The sanitizer's own time inside its wrappers is summed as well.
    """
    from bench import bench_wrapper_cost as wrapper_cost
    from cudagraph_lifecycle import PoolSanitizer

    dev = be.torch_device(0)
    dtype = torch.float16 if be.name == "cuda" else torch.float32
    fwd = launch_bound_model(dev, dtype)
    x = torch.randn(3, 256, device=dev, dtype=dtype)

    def runner():
        return CUDAGraphRunner(fwd, [1, 2, 4, 8, 16, 32, 64, 128], (256,), dtype=dtype, backend=be, warmup=1)

    def capture_ms():
        r = runner()
        gc.collect()
        r.capture()
        r.release()
        return r.stats.capture_ms

    def step_us():
        r = runner()
        r.capture()
        us = timeit(be, lambda: r.run(x), 200 if be.name == "cuda" else 10, reps=3)[0]
        r.release()
        return us

    def capture_only():
        r = runner()
        r.capture()
        r.release()

    def sanitized(fn):
        with PoolSanitizer(be):
            return fn()

    def paired(fn, n):
        plain, watched = [], []
        for i in range(n):  # ABBA: neither side always runs first
            if i % 2 == 0:
                plain.append(fn())
                watched.append(sanitized(fn))
            else:
                watched.append(sanitized(fn))
                plain.append(fn())
        return plain, watched

    capture_ms(), step_us(), sanitized(capture_ms)  # warm: lazy init and kernel selection out of the numbers
    plain, watched = paired(capture_ms, rounds)
    # the sanitizer's own time per graph on the runner's path, timed from outside (bench_wrapper_cost)
    cost = wrapper_cost.measure(be, capture_only, 20 if be.name == "cuda" else 5, wrapper_cost.targets(be.name),
                                direct=True)
    wrapper_us = cost.pop("wrapper_us_per_capture")
    plain_step, watched_step = paired(step_us, step_rounds)
    p, w = statistics.median(plain), statistics.median(watched)
    ps, ws = statistics.median(plain_step), statistics.median(watched_step)
    ratios = sorted(b / a for a, b in zip(plain, watched))
    q = len(ratios) // 4
    lo, hi = median_ci95(len(ratios))
    return {"profile_top": sanitized_profile(be, capture_only), "rounds": rounds,
            "capture_ms": p, "capture_ms_sanitized": w,
            "capture_overhead": statistics.median(ratios) - 1, "target_capture_overhead": 0.02,
            "capture_overhead_ci95": [ratios[lo] - 1, ratios[hi] - 1],
            "capture_overhead_iqr": [ratios[q] - 1, ratios[-q - 1] - 1],
            "capture_overhead_of_medians": w / p - 1,
            "wrapper_us_per_capture": wrapper_us, "wrapper_share_of_capture": wrapper_us * 8e-3 / p,
            "wrapper_us_by_call": {k: round(v["wrapper_us_mean"], 2) for k, v in cost.items()},
            "step_us": ps, "step_us_sanitized": ws, "step_ratio": ws / ps,
            "capture_spread_ms": [min(plain), max(plain)], "capture_spread_sanitized_ms": [min(watched), max(watched)]}


def bench_flush_path(be, rounds=200, pinned=8, graphs=8, body="one op"):
    """Captures through ``torch.cuda.graph`` (``backend.graph``), which flushes the cache at each one, while
    ``pinned`` pools released by earlier engines are pinned by outputs kept alive: dead pools the sanitizer
    judges every capture against, and whose erasure by a flush it must be able to tell. Plain vs
    sanitized, paired (each side first in turn); the median of the per-round ratios. Another side wraps the same
    four calls (both flushes, capture_begin, capture_end) in functions that only call through: what any Python
    observer of them costs in this flow. ``body``: what each graph captures, one op (the target's small graph) or
    the runner bench's 16 layers (a decode step's size: the same fixed cost a capture against more work).

    The sanitizer is started once for all rounds, as a process runs it (``bench.common.StartedOnce`` puts its
    wrappers back for its own rounds only): the figure against the target. Beside it in the same rounds, a
    sanitizer started for each round (the start's own cost, paid once by a process, then weighs on 8 captures)
    with its capture path compiled and in Python. One round's ratio spreads over +-8 % on an H100's host, so
    the median of many rounds, with its 95 % interval; the objects made before the rounds are frozen
    (``gc.freeze``) so that the collection before each side, which keeps a collection out of the timing, takes
    little time (as in a reused worker)."""
    from cudagraph_lifecycle import PoolSanitizer

    dev = be.torch_device(0)
    x = torch.ones(64, 256, device=dev)
    if body == "one op":
        def captured():
            (x + 1).relu_()
    else:
        fwd = launch_bound_model(dev, torch.float16 if be.name == "cuda" else torch.float32)
        xm = torch.ones(8, 256, device=dev, dtype=torch.float16 if be.name == "cuda" else torch.float32)

        def captured():
            fwd(xm)
    stream = be.new_stream()
    with be.stream(stream):  # eager warm-up on the capture stream: cuBLAS makes its handle outside a capture
        captured()
    be.synchronize()
    kept = pinned_pools(be, stream, x, pinned)
    once = StartedOnce(be)  # before the freeze: a worker freezes what it started with, its sanitizer among them

    gc.collect()
    gc.freeze()

    def capture_ms():
        gc.collect()
        pool, gs = be.graph_pool_handle(), []
        t0 = time.perf_counter()
        for _ in range(graphs):
            g = be.new_graph()
            with be.graph(g, pool=pool, stream=stream):
                captured()
            gs.append(g)
        dt = (time.perf_counter() - t0) * 1e3
        for g in gs:
            g.reset()
        return dt

    def per_round():
        with PoolSanitizer(be):
            return capture_ms()

    from bench import bench_wrapper_cost as wrapper_cost

    tgts = wrapper_cost.targets(be.name)

    def bare():  # the floor: the same four calls wrapped by functions that only call through
        saved = wrapper_cost.patch_bare(tgts)
        try:
            return capture_ms()
        finally:
            wrapper_cost.unpatch(saved)

    from cudagraph_lifecycle.observe import compiled

    def per_round_python():  # the sanitizer with its capture path in Python (installed anew for each round)
        before = os.environ.get("CUDAGRAPH_CAPTURE_PATH")
        os.environ["CUDAGRAPH_CAPTURE_PATH"] = "python"
        try:
            return per_round()
        finally:
            if before is None:
                del os.environ["CUDAGRAPH_CAPTURE_PATH"]
            else:
                os.environ["CUDAGRAPH_CAPTURE_PATH"] = before

    def sanitized():
        return once.run(capture_ms)

    def sanitized_per_round():
        return once.aside(per_round)

    def sanitized_python():
        return once.aside(per_round_python)

    sides = (capture_ms, sanitized, sanitized_per_round, bare) + (
        (sanitized_python,) if compiled.path() == "compiled" else ())
    try:
        for side in sides:
            side()
        times: dict = {side: [] for side in sides}
        for i in range(rounds):  # each side first, second, ... in turn
            k = i % len(sides)
            for side in sides[k:] + sides[:k]:
                times[side].append(side())
    finally:
        gc.unfreeze()
        once.stop()
    del kept

    lo, hi = median_ci95(rounds)

    def overhead(side, ci: bool = False) -> tuple:
        ratios = sorted(b / a for a, b in zip(times[capture_ms], times[side]))
        got = statistics.median(ratios) - 1, [ratios[len(ratios) // 4] - 1, ratios[-len(ratios) // 4 - 1] - 1]
        return got + ([ratios[lo] - 1, ratios[hi] - 1],) if ci else got

    out = {"pinned_pools": pinned, "graphs": graphs, "rounds": rounds, "body": body,
           "capture_path": compiled.path(), "capture_ms": statistics.median(times[capture_ms]),
           "capture_ms_sanitized": statistics.median(times[sanitized]), "target_overhead": 0.05}
    out["overhead"], out["overhead_iqr"], out["overhead_ci95"] = overhead(sanitized, ci=True)
    out["us_per_capture"] = statistics.median((b - a) / graphs * 1e3 for a, b in zip(times[capture_ms], times[sanitized]))
    out["overhead_per_round"], out["overhead_per_round_iqr"] = overhead(sanitized_per_round)
    out["overhead_of_bare_wrappers"], out["overhead_of_bare_wrappers_iqr"] = overhead(bare)
    if sanitized_python in times:  # per round with the Python capture path: against per round compiled
        out["overhead_python_path"], out["overhead_python_path_iqr"] = overhead(sanitized_python)
    return out


def sanitized_profile(be, capture, top=15):
    """Where a sanitized capture's host time goes (cProfile, own time): for the next overhead cut."""
    import cProfile
    import pstats

    from cudagraph_lifecycle import PoolSanitizer

    prof = cProfile.Profile()
    san = PoolSanitizer(be).start()
    try:
        prof.enable()
        capture()
        prof.disable()
    finally:
        san.stop()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # by own time
    return [f"{fn.rsplit('/', 2)[-1] if '/' in fn else fn}:{line}({name}) calls={cc} own_us={tt * 1e6:.0f}"
            for (fn, line, name), (cc, nc, tt, ct, callers) in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json")
    parts = ("step", "memory", "release", "checks", "sanitizer", "flush")
    ap.add_argument("--only", choices=parts, action="append", help="run only these parts (repeatable)")
    a = ap.parse_args()
    be = get_backend(a.backend)
    iters = a.iters if be.name == "cuda" else 50
    run = {
        "step": lambda: bench_step(be, iters),
        "memory": lambda: bench_memory(be),
        "release": lambda: bench_release(be),
        "checks": lambda: bench_checks(be, iters // 4),
        "sanitizer": lambda: bench_sanitizer(be) if be.name == "cuda" else bench_sanitizer(be, 20, step_rounds=2),
        "flush": lambda: [bench_flush_path(be, pinned=n, body=body) if be.name == "cuda"
                          else bench_flush_path(be, 6, pinned=n, body=body)
                          for n, body in ((0, "one op"), (8, "one op"), (0, "16 layers"))],
    }
    out = {"meta": be.describe() | {"date": time.strftime("%Y-%m-%d %H:%M:%S")}, "seconds": {}}
    for part in a.only or parts:
        t0 = time.perf_counter()
        out[part] = run[part]()
        out["seconds"][part] = round(time.perf_counter() - t0, 1)  # what a GPU check's deadline spends where
    emit(out, a.json)


if __name__ == "__main__":
    main()
