"""One engine cycle in a reused process: build, capture, replay checked against eager, release, and
the fresh-pool check. Pure library code: the pytest plugin runs it inside its reused workers.

An *engine* is any object with ``capture()``, ``run(x)`` and ``release()``; optional ``eager(x)`` (the
reference for the replay check), ``example_input()``, and either ``runner`` (a CUDAGraphRunner) or
``pool_ids()`` (a list of ``(device, pool_id)``) so the check knows which pools to read.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .backends import Backend, get_backend
from .errors import ConfigError

_backends: dict[str, Backend] = {}
_seen_pools: dict[Any, set] = {}  # pool ids this process has used, per allocator world
_held: dict[Any, tuple[Any, list]] = {}  # the last engine's output a caller still holds, per world
_pid = os.getpid()


def process_backend(name: str) -> Backend:
    """The one backend of this process for ``name``: engines built in sequence share its allocator."""
    global _pid
    if os.getpid() != _pid:  # a forked child has none of its parent's allocator
        _pid = os.getpid()
        _backends.clear()
        _seen_pools.clear()
        _held.clear()
    if name not in _backends:
        be = get_backend(name)
        _backends[name] = be
        _backends[be.name] = be
    return _backends[name]


@dataclass
class CycleRecord:
    index: int
    pid: int
    backend: str
    pool_ids: list[list] = field(default_factory=list)
    graphs: int = 0
    capture_ms: float = 0.0
    replay_max_abs_err: float | None = None
    bytes_before_release: int = 0
    bytes_after_release: int = 0
    bytes_pinned_by_held_output: int = 0
    previous_pool_freed: bool | None = None
    reserved_baseline: int = 0
    reserved_after: int = 0
    fresh: bool = False
    problems: list[str] = field(default_factory=list)
    sanitizer: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _engine_pools(engine: Any) -> list[tuple[int, tuple]]:
    runner = getattr(engine, "runner", None)
    if runner is not None and hasattr(runner, "pool_ids"):
        return [(d, tuple(p)) for d, p in runner.pool_ids]
    fn = getattr(engine, "pool_ids", None)
    if callable(fn):
        return [(d, tuple(p)) for d, p in fn()]
    return []


def _graph_count(engine: Any) -> int:
    runner = getattr(engine, "runner", None)
    if runner is not None:
        return len(runner.keys)
    n = getattr(engine, "num_graphs", None)
    return int(n() if callable(n) else n or 0)


def _max_err(a: Any, b: Any) -> float:
    fa = [t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)]
    fb = [t for t in tree_flatten(b)[0] if isinstance(t, torch.Tensor)]
    if len(fa) != len(fb):
        raise ConfigError(f"replay returned {len(fa)} tensors, eager {len(fb)}")
    return max((float((x.float() - y.float()).abs().max()) for x, y in zip(fa, fb)), default=0.0)


def _pool_bytes(be: Backend, pools) -> int:
    return sum(be.pool_state(p, d).reserved_bytes for d, p in pools)


def _use_count(be: Backend, pool_id, device: int) -> int | None:
    """The allocator's use count where the build exposes it, else the sanitizer's ledger (if one watches)."""
    uses = be.pool_state(pool_id, device).use_count
    if uses is None:
        from .sanitizer import global_sanitizer

        san = global_sanitizer()
        if san is not None and san.backend.world == be.world:
            uses = san.use_count(pool_id, device)
    return uses


def _settle(be: Backend) -> None:
    be.synchronize()
    be.empty_cache()


def run_cycle(
    factory: Callable[[Backend], Any],
    backend: str = "auto",
    index: int = 0,
    atol: float = 1e-4,
    hold_output: bool = True,
) -> CycleRecord:
    """Build one engine with ``factory(backend)``, exercise it, release it, and check the pools.

    With ``hold_output`` the cycle plays a caller that keeps the engine's last output (a view into the
    pool) until the *next* engine has captured: the hazard that turns a kept pool id into the allocator's
    assert. The check separates bytes pinned by that held output (expected, reported) from bytes the
    engine leaked (a problem): the previous pool must be empty once the held output is dropped.
    """
    be = process_backend(backend)
    world = be.world
    if world not in _seen_pools:
        be.prewarm(0)  # library workspaces are per process: create them before the first baseline
    seen = _seen_pools.setdefault(world, set())
    prev_out, prev_pools = _held.pop(world, (None, []))
    _settle(be)
    rec = CycleRecord(index=index, pid=os.getpid(), backend=be.name)
    dev = 0
    rec.reserved_baseline = be.memory_reserved(dev) - _pool_bytes(be, prev_pools)
    baseline_segments = {sg["address"] for sg in be.segments(dev)}
    engine = factory(be)
    for name in ("capture", "run", "release"):
        if not callable(getattr(engine, name, None)):
            raise ConfigError(
                f"the factory returned {type(engine).__name__}, which has no {name}(): an engine needs "
                "capture(), run(x) and release() (see cudagraph_lifecycle.cycle)"
            )
    t0 = time.perf_counter()
    engine.capture()  # the previous engine's output is still held here, as a caller would hold it
    rec.capture_ms = (time.perf_counter() - t0) * 1e3
    del prev_out
    if prev_pools:
        _settle(be)
        left = _pool_bytes(be, prev_pools)
        rec.previous_pool_freed = left == 0
        if left:
            rec.problems.append(f"the previous engine's pools {[p for _, p in prev_pools]} still hold {left} bytes")
    x = engine.example_input() if hasattr(engine, "example_input") else None
    y = None
    if x is not None:
        y = engine.run(x)
        if hasattr(engine, "eager"):
            rec.replay_max_abs_err = _max_err(y, engine.eager(x))
            if rec.replay_max_abs_err > atol:
                rec.problems.append(f"replay differs from eager by {rec.replay_max_abs_err:.3g} > atol {atol}")
    pools = _engine_pools(engine)
    rec.pool_ids = [[d, list(p)] for d, p in pools]
    rec.graphs = _graph_count(engine)
    for d, p in pools:
        if (d, p) in seen:
            rec.problems.append(f"pool {p} on device {d} was already used by an earlier engine in this process")
        seen.add((d, p))
    rec.bytes_before_release = _pool_bytes(be, pools)
    engine.release()
    for d, p in pools:  # read before the engine is dropped: destruction would reset its graphs anyway
        uses = _use_count(be, p, d)
        if uses:
            rec.problems.append(
                f"release() left pool {p} with use_count {uses}: its graphs are reset only when the engine is "
                "garbage-collected (a graph was not reset in release())"
            )
    del engine, x
    # Engines often hold reference cycles (a runner keeping a bound method of its engine): their weights
    # come back only at a garbage collection. Measured on the H200: one 256 KiB weight, kept by such a
    # cycle, left a 2 MiB segment above the baseline.
    gc.collect()
    if not hold_output:
        y = None
    _settle(be)
    for d, p in pools:
        rec.bytes_after_release += be.pool_state(p, d).reserved_bytes
        uses = _use_count(be, p, d)
        if uses:
            rec.problems.append(f"pool {p} still has use_count {uses} after release (a graph was not reset)")
    if y is not None:
        rec.bytes_pinned_by_held_output = rec.bytes_after_release
        _held[world] = (y, pools)
    elif rec.bytes_after_release:
        rec.problems.append(
            f"pools {[p for _, p in pools]} still hold {rec.bytes_after_release} bytes after release: "
            "the engine keeps a tensor from its pool alive"
        )
    from .sanitizer import global_sanitizer

    san = global_sanitizer()
    if san is not None and san.backend is be:
        mine = {(d, p) for d, p in pools}
        found = [f for f in san.findings() if (f.device, f.pool_id) in mine and not (
            f.kind == "pinned_pool" and y is not None)]  # the held output pins on purpose
        rec.sanitizer = [f.as_dict() for f in found]
        if san.mode == "strict":
            rec.problems += [f"sanitizer {f.kind}: {f.message}" for f in found]
    rec.reserved_after = be.memory_reserved(dev) - rec.bytes_pinned_by_held_output
    if rec.reserved_after > rec.reserved_baseline:
        mine = {p for _, p in pools}
        grown = [sg for sg in be.segments(dev) if sg["address"] not in baseline_segments and sg["pool_id"] not in mine]
        detail = ", ".join(f"{sg['size']} bytes ({sg['allocated']} in use) in pool {sg['pool_id']} on stream "
                           f"{sg['stream']}" for sg in grown[:4])
        rec.problems.append(
            f"reserved memory {rec.reserved_after} bytes is above the pre-engine baseline {rec.reserved_baseline}"
            + (f"; new segments: {detail}" if detail else "")
        )
    if not pools:
        rec.problems.append("the engine exposes no pool (give it a `runner` or a `pool_ids()` method)")
    rec.fresh = not rec.problems
    return rec


def drop_held(backend: str = "auto") -> int:
    """End of a sequence: drop the held output and return the bytes its pools still hold (0 when clean)."""
    be = process_backend(backend)
    held = _held.pop(be.world, (None, []))
    pools = held[1]
    del held  # the output goes now: nothing here may keep it
    _settle(be)
    return _pool_bytes(be, pools)


def dump_memory_snapshot(path: str) -> str | None:
    """Write ``torch.cuda.memory._dump_snapshot`` (PyTorch's memory visualizer opens it); None off CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
    return path
