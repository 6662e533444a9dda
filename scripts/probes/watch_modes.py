"""Why checked mode's capture watch is a dispatch mode: what an empty ``TorchDispatchMode`` and an empty
``TorchFunctionMode`` cost a layer, beside the watch itself, and which reads each of them sees.

    python scripts/probes/watch_modes.py [--device cuda|cpu] [--rounds N] [--json PATH]

On CUDA the forward is captured (``torch.cuda.graph``, one pool) and the figure is capture time a layer; on
the CPU it is eager time a layer. On CUDA the runner's sides (default against the watch on each graph) are timed for this model and for the bench's (``bench_runner.launch_bound_model``: three ops a
layer where this one has two), with the ops a forward dispatches, and one watched capture set of the bench's
model is profiled. Coverage: a weight read only inside ``backward()``, only inside a TorchScript module, and by
a ``torch.ops`` call: does the mode see a tensor of that storage among an op's arguments?
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.bench_runner import capture_path  # noqa: E402
from bench.common import emit  # noqa: E402
from bench.models import launch_bound_model  # noqa: E402
from cudagraph_lifecycle.checks.capture_watch import CaptureWatch  # noqa: E402


class EmptyDispatch(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # as the watch does
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class EmptyFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _storages(items, out):
    for t in items:
        if isinstance(t, torch.Tensor):
            out.add(t.untyped_storage()._cdata)
        elif isinstance(t, (list, tuple)):
            _storages(t, out)


class _Seen:
    """A mode that notes the storage of every tensor among an op's arguments."""

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()

    def _call(self, func, args, kwargs):
        _storages(args, self.seen)
        _storages((kwargs or {}).values(), self.seen)
        return func(*args, **(kwargs or {}))


class SeenDispatch(_Seen, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._call(func, args, kwargs)


class SeenFunction(_Seen, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._call(func, args, kwargs)


def timing(device: str, layers: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)]).to(device)
    x = torch.randn(8, 64, device=device)
    known: dict = {}  # what a runner's later graphs find: the set's first watch looked at the weights
    modes = {"plain": None, "empty dispatch mode": EmptyDispatch, "empty function mode": EmptyFunction,
             "capture watch": lambda: CaptureWatch(None),
             "capture watch, a later graph of its set": lambda: CaptureWatch(None, known)}
    cuda = device == "cuda"
    if cuda:
        stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        with torch.no_grad(), torch.cuda.stream(stream):
            model(x)  # warm-up on the capture stream
        torch.cuda.synchronize()

    def once(make) -> float:
        mode = make() if make else contextlib.nullcontext()
        with torch.no_grad():
            g = torch.cuda.CUDAGraph() if cuda else None
            around = torch.cuda.graph(g, pool=pool, stream=stream) if cuda else contextlib.nullcontext()
            t0 = time.perf_counter()
            with around, mode:
                model(x)
            dt = time.perf_counter() - t0
            del g
        return dt / layers * 1e6

    times: dict[str, list[float]] = {k: [] for k in modes}
    for make in modes.values():  # first calls (lazy inits) left out
        once(make)
    for _ in range(rounds):  # interleaved: a drift of the host reaches every side
        for name, make in modes.items():
            times[name].append(once(make))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"us_per_layer": med, "ratio_to_plain": {k: v / med["plain"] for k, v in med.items()}}
    if cuda:
        out["runner"] = runner_sides(model, layers, rounds, (64,), torch.float32)
        bench_fwd = launch_bound_model(device, torch.float16)
        out["runner, the bench's model"] = runner_sides(bench_fwd, 16, rounds, (256,), torch.float16)
        out["profile of a watched capture, the bench's model"] = profile_watched(bench_fwd, (256,), torch.float16)
    return out


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_per_forward(fwd, shape, dtype, device: str) -> int:
    x = torch.randn(8, *shape, device=device, dtype=dtype)
    with torch.no_grad(), CountOps() as mode:
        fwd(x)
    return mode.n


def profile_watched(fwd, shape, dtype, backend: str = "cuda", top: int = 25) -> list[str]:
    """cProfile of one runner capture set with the watch on every graph (after a warm-up set), the watch's
    Python path (a compiled function is one line): where a watched capture's host time goes, function by
    function."""
    from cudagraph_lifecycle import CUDAGraphRunner

    prof = cProfile.Profile()
    for rnd in range(2):
        r = CUDAGraphRunner(fwd, [1, 2, 4, 8], shape, dtype=dtype, backend=backend, checked=["capture"])
        gc.collect()
        with capture_path("python"):
            if rnd:
                prof.enable()
            r.capture()
        prof.disable()
        r.release()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()]


def runner_sides(model, layers: int, rounds: int, shape: tuple, dtype, backend: str = "cuda") -> dict:
    """The same model through ``CUDAGraphRunner`` (4 batch sizes, one capture set), default against the
    capture watch on every graph, in this process: is what the bench's ``capture`` ratio adds over the sides
    above the runner's path, or the process the bench runs in?"""
    from cudagraph_lifecycle import CUDAGraphRunner

    sides = {"runner default": (dict(checked=False), None),
             "runner, capture watch on each graph": (dict(checked=["capture"]), None)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rnd in range(rounds + 1):
        for name, (kw, path) in list(sides.items())[:: 1 if rnd % 2 == 0 else -1]:
            r = CUDAGraphRunner(model, [1, 2, 4, 8], shape, dtype=dtype, backend=backend, **kw)
            gc.collect()
            with capture_path(path):
                r.capture()
            if rnd:  # the first round is a warm-up
                times[name].append(r.stats.capture_ms * 1e3 / (4 * layers))
            r.release()
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["runner default"]
    ops = ops_per_forward(model, shape, dtype, "cuda" if backend == "cuda" else "cpu")
    return {"us_per_layer": med, "ratio_to_default": {k: v / base for k, v in med.items()}, "ops_per_forward": ops,
            "us_per_op_over_default": {k: (v - base) * layers / ops for k, v in med.items() if k != "runner default"}}


def coverage(device: str) -> dict:
    w = torch.randn(16, 16, device=device, requires_grad=True)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    g = torch.zeros(16, 16, device=device)
    gkey = g.untyped_storage()._cdata

    class Scripted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(16, 16, device=device))

        def forward(self, x):
            return x @ self.table

    scripted = torch.jit.script(Scripted())
    skey = scripted.table.untyped_storage()._cdata
    out = {}
    for name, make in (("dispatch", SeenDispatch), ("function", SeenFunction)):
        w.grad = torch.zeros_like(w)  # a gradient buffer made before: backward accumulates into it
        loss = (x @ w).sum()
        mode = make()
        with mode:
            loss.backward()
        seen_grad = w.grad.untyped_storage()._cdata in mode.seen
        mode2 = make()
        with mode2, torch.no_grad():
            torch.ops.aten.add_(g, 1.0)  # an in-place torch.ops call on a buffer made outside
            scripted(x.detach())
        out[name] = {"weight's gradient buffer, inside backward()": seen_grad,
                     "buffer of a torch.ops call": gkey in mode2.seen,
                     "TorchScript module's buffer": skey in mode2.seen}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {"device": a.device, "torch": torch.__version__, "layers": a.layers, "rounds": a.rounds,
           "timing": timing(a.device, a.layers, a.rounds), "sees": coverage(a.device)}
    if a.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    emit(res, a.json)


if __name__ == "__main__":
    main()
