"""The pool sanitizer: watches the CUDA graph API of any code and catches a stale pool before the allocator.

While active it wraps ``graph_pool_handle``, ``CUDAGraph.capture_begin/capture_end/reset`` (and graph
destruction), ``MemPool``, ``empty_cache`` and the host allocator's ``_host_emptyCache`` — so
``torch.cuda.graph``, ``make_graphed_callables`` and ``torch.compile(mode="reduce-overhead")`` are watched
too — and keeps a ledger per pool: where it was minted, which graphs captured into it, its device and host
use counts, where its last graph was released, and the bytes it still holds.

A capture into a *dead* pool raises :class:`StalePoolError` before the real ``capture_begin`` runs, so the
process stays usable. Dead means, per the measured rules (conformance table): all its graphs were released
and either the device allocator still holds the pool (a live block pins it, or ``empty_cache`` has not run)
or the host allocator's ledger still has the id (``torch._C._host_emptyCache`` has not run).

    with PoolSanitizer("cuda") as san:
        ...                       # any CUDA graph code
    san.findings()                # unreleased graphs, pinned pools, pools never retired

``CUDAGRAPH_SANITIZE=1`` (or ``strict``) in the environment installs one for the whole program when
``cudagraph_lifecycle`` is imported; ``python -m cudagraph_lifecycle.sanitizer prog.py`` runs a program
under it.
"""

from __future__ import annotations

import functools
import itertools
import os
import runpy
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any

from .backends import Backend, PoolId, get_backend
from .errors import ConfigError, StalePoolError

SANITIZE_MODES = ("off", "on", "strict")


_TAG = "_cudagraph_sanitizer_gid"


def _line_of(code, lasti: int) -> int:
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


_DEPTH = 12  # frames kept per stack


class _Stack:
    """A call stack taken cheaply, formatted when shown: code objects and instruction offsets only, flat
    (code, offset, code, offset, ...): no line number decoded, no source read, no frame kept alive, one
    object. Captures are timed, and the capture path builds this list inline."""

    __slots__ = ("_frames", "_text")

    def __init__(self, frames: list | None = None):
        if frames is None:
            frames = []
            f = sys._getframe(2)
            while f is not None and len(frames) < 2 * _DEPTH:
                frames.append(f.f_code)
                frames.append(f.f_lasti)
                f = f.f_back
        self._frames = frames
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            fr = self._frames
            keep = [
                traceback.FrameSummary(code.co_filename, _line_of(code, lasti), code.co_name)
                for code, lasti in reversed(list(zip(fr[0::2], fr[1::2])))
                if "cudagraph_lifecycle/sanitizer" not in code.co_filename
            ][-_DEPTH:]
            self._text = "".join(traceback.format_list(keep))
        return self._text

    def __contains__(self, item: str) -> bool:
        return item in str(self)


def _stack(skip: int = 2) -> _Stack:
    return _Stack()


@dataclass(slots=True)
class PoolEntry:
    pool_id: PoolId
    device: int
    minted_at: _Stack | str | None = None
    held: int = 0  # references held by captured graphs: the host allocator counts only these
    device_extra: int = 0  # MemPool objects alive, minus references given back by hand (device only)
    device_alive: bool = False  # the device allocator has books for it
    host_alive: bool = False  # the host allocator's ledger has the id
    captures: int = 0
    graphs: dict[int, GraphEntry] = field(default_factory=dict)  # its graphs still alive, by ledger id
    released_at: _Stack | str | None = None

    @property
    def device_count(self) -> int:
        return self.held + self.device_extra

    @property
    def host_count(self) -> int:
        return self.held

    @property
    def dead(self) -> bool:
        return (self.device_count == 0 and self.device_alive) or (self.host_count == 0 and self.host_alive)


@dataclass(slots=True, eq=False)
class GraphEntry:
    gid: int
    pool_id: PoolId | None  # None until capture_end for a capture without a pool argument
    device: int
    frames: list  # where it was captured, as _Stack keeps it
    owner: Any  # the sanitizer that made it: a graph may carry an earlier sanitizer's tag
    captured: bool = False  # capture_end succeeded: reset() gives the references back
    alive: bool = True
    ref: Any = None  # weakref to the graph, whose callback sees its destruction

    @property
    def captured_at(self) -> _Stack:
        return _Stack(self.frames)


@dataclass(frozen=True)
class Finding:
    kind: str  # unreleased_graph | pinned_pool | pool_never_retired
    pool_id: PoolId
    device: int
    bytes: int
    message: str
    stacks: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "pool_id": list(self.pool_id), "device": self.device, "bytes": self.bytes,
                "message": self.message, "stacks": list(self.stacks)}


class _Target:
    """Where one backend's graph API lives, so the same wrappers serve cuda and sim."""

    def __init__(self, be: Backend):
        self.be = be
        if be.name == "cuda":
            import torch

            self.graph_cls = torch.cuda.CUDAGraph
            self.handle_owners = [torch.cuda, torch.cuda.graphs]
            self.mempool_cls = getattr(torch.cuda, "MemPool", None)
            self.empty_owner, self.empty_name = torch.cuda, "empty_cache"
            self.host_owner, self.host_name = torch._C, "_host_emptyCache"
            self.release_owner, self.release_name = torch._C, "_cuda_releasePool"
        else:
            from .backends import sim

            self.graph_cls = sim.SimGraph
            self.handle_owners = [sim.SimBackend]
            self.mempool_cls = sim.SimMemPool
            self.empty_owner, self.empty_name = sim.SimBackend, "empty_cache"
            self.host_owner, self.host_name = sim.SimBackend, "host_empty_cache"
            self.release_owner, self.release_name = sim.SimBackend, "release_pool_reference"

    def owns(self, obj: Any) -> bool:
        """Sim classes are shared by every SimBackend: watch only this backend's objects."""
        if self.be.name == "cuda":
            return True
        be = obj if hasattr(obj, "_pools") else getattr(obj, "_backend", None)
        return be is self.be

    def device_of_capture(self) -> int:
        if self.be.name == "cuda":
            import torch

            return torch._C._cuda_getDevice()  # the capture is underway: CUDA is initialized
        return self.be._current_stream.device


class PoolSanitizer:
    """Watches graph captures on one backend; see the module docstring.

    ``mode``: ``on`` raises :class:`StalePoolError` on a stale capture; ``strict`` also makes
    :meth:`check` raise on findings. ``record_history`` turns on CUDA memory history so pinned blocks are
    reported with their allocation stacks (sim: the simulated allocator records them).
    """

    _active_lock = threading.Lock()

    def __init__(self, backend: Backend | str = "auto", mode: str = "on", record_history: bool = False):
        if mode not in SANITIZE_MODES or mode == "off":
            raise ConfigError(f"sanitizer mode {mode!r}: choose 'on' or 'strict' (use no sanitizer for 'off')")
        self.backend = get_backend(backend)
        self.mode = mode
        self.record_history = record_history
        self._t = _Target(self.backend)
        self._lock = threading.RLock()
        self._pools: dict[tuple[int, PoolId], PoolEntry] = {}
        self._minted: dict[PoolId, _Stack] = {}
        self._dead: dict[tuple[int, PoolId], PoolEntry] = {}  # kept current, so a capture checks one dict
        self._graphs: dict[int, GraphEntry] = {}
        self._gids = itertools.count(1)
        self._entry_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graphs that take no attribute
        self._refs: dict[int, GraphEntry] = {}  # id(weakref) -> the entry of the graph it watches
        self._saved: list[tuple[Any, str, Any]] = []
        self.stale_caught = 0
        self.overhead_s = 0.0  # time spent in the capture wrappers themselves (bench/ reports it)
        self.active = False

    # install / uninstall ------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make) -> None:
        own = name in vars(owner)  # a class may inherit the method: restore by deleting our override then
        original = getattr(owner, name)
        self._saved.append((owner, name, original if own else None))
        setattr(owner, name, make(original))

    def start(self) -> PoolSanitizer:
        if self.active:
            return self
        t = self._t
        if self.backend.name == "sim" and self.record_history:
            self.backend.record_stacks = True
        if self.backend.name == "cuda" and self.record_history:
            import torch

            torch.cuda.memory._record_memory_history(max_entries=100000)
        for owner in t.handle_owners:
            if "graph_pool_handle" in vars(owner):
                self._patch(owner, "graph_pool_handle", self._wrap_handle)
        self._patch(t.graph_cls, "capture_begin", self._wrap_begin)
        self._patch(t.graph_cls, "capture_end", self._wrap_end)
        self._patch(t.graph_cls, "reset", self._wrap_reset)
        if t.mempool_cls is not None:
            self._patch(t.mempool_cls, "__init__", self._wrap_mempool_init)
        self._patch(t.empty_owner, t.empty_name, lambda f: self._wrap_flush(f, self._device_erased))
        if hasattr(t.host_owner, t.host_name):
            self._patch(t.host_owner, t.host_name, lambda f: self._wrap_flush(f, self._host_erased))
        if hasattr(t.release_owner, t.release_name):
            self._patch(t.release_owner, t.release_name, self._wrap_release_pool)
        self.active = True
        return self

    def stop(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.active = False

    def __enter__(self) -> PoolSanitizer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ledger -------------------------------------------------------------------------------------------
    # Every mutation goes through _restate, so _dead always lists exactly the dead pools: the capture path
    # then checks one dict, and does the rest of its bookkeeping inline (capture time has a 5 % budget, and
    # each extra call or object costs about a microsecond there, measured in bench/).
    def _entry(self, pool_id: PoolId, device: int) -> PoolEntry:
        key = (device, tuple(pool_id))
        e = self._pools.get(key)
        if e is None:
            e = self._pools[key] = PoolEntry(tuple(pool_id), device, minted_at=self._minted.get(tuple(pool_id)))
        return e

    def _restate(self, e: PoolEntry) -> None:
        if e.dead:
            self._dead[(e.device, e.pool_id)] = e
        else:
            self._dead.pop((e.device, e.pool_id), None)

    def _hold(self, g: GraphEntry) -> None:
        e = self._entry(g.pool_id, g.device)
        e.device_alive = e.host_alive = True
        e.held += 1
        e.captures += 1
        e.graphs[g.gid] = g
        self._restate(e)

    def _release(self, g: GraphEntry) -> None:
        e = self._entry(g.pool_id, g.device)
        e.held -= 1
        if e.device_count == 0 or e.host_count == 0:
            e.released_at = _stack(3)
        self._restate(e)

    def _ref_gone(self, ref: Any) -> None:
        g = self._refs.pop(id(ref), None)
        if g is not None:
            self._graph_gone(g)

    def _graph_gone(self, g: GraphEntry) -> None:
        with self._lock:
            if g.alive:
                g.alive = False
                if g.captured:
                    self._release(g)
                    g.captured = False
            # a destroyed graph leaves nothing to report: forget it, so a long-lived sanitizer
            # (CUDAGRAPH_SANITIZE=1 on a server that reloads models) does not grow with every capture
            self._graphs.pop(g.gid, None)
            if g.pool_id is not None:
                e = self._pools.get((g.device, g.pool_id))
                if e is not None:
                    e.graphs.pop(g.gid, None)

    def _entry_of_graph(self, graph: Any) -> GraphEntry | None:
        d = getattr(graph, "__dict__", None)
        g = d.get(_TAG) if d is not None else self._entry_of.get(graph)
        return g if g is not None and g.owner is self else None

    def _check_stale(self, pool_id: PoolId, device: int) -> None:
        e = self._pools.get((device, tuple(pool_id)))
        if e is None or not e.dead:
            return
        self.stale_caught += 1
        why = []
        if e.device_count == 0 and e.device_alive:
            st = self.backend.pool_state(pool_id, device)
            why.append(
                f"the device allocator still holds it ({st.reserved_bytes} bytes in {st.segments} segment(s)"
                + (": a live tensor from its captures pins it)" if st.reserved_bytes else "; empty_cache has not run)")
            )
        if e.host_count == 0 and e.host_alive:
            why.append("the host allocator's ledger still has the id (torch._C._host_emptyCache has not run)")
        raise StalePoolError(
            f"capture into stale pool {tuple(pool_id)} on device {device}: all its graphs were released, but "
            + " and ".join(why)
            + ". The real capture_begin would fail with 'use_count > 0 INTERNAL ASSERT FAILED' and poison the "
            "process. Mint a fresh pool per engine (cudagraph_lifecycle.LazyPool) instead of keeping this id.\n"
            f"--- pool minted at ---\n{e.minted_at or '(not seen: minted before the sanitizer started)'}"
            f"--- its last graph was released at ---\n{e.released_at or '(not seen)'}"
        )

    # wrappers -----------------------------------------------------------------------------------------
    def _wrap_handle(self, original):
        san = self

        @functools.wraps(original)
        def graph_pool_handle(*args, **kwargs):
            pid = tuple(original(*args, **kwargs))
            if san.backend.name == "cuda" or (args and san._t.owns(args[0])):
                with san._lock:
                    san._minted[pid] = _stack(2)
            return pid

        return graph_pool_handle

    def _wrap_begin(self, original):
        san = self
        be = self.backend
        sim = be.name == "sim"
        if sim:
            def device_now():
                return be._current_stream.device
        else:
            import torch

            device_now = torch._C._cuda_getDevice  # the capture is underway: CUDA is initialized
        clock, lock, pools, dead, graphs, gids = time.perf_counter, self._lock, self._pools, self._dead, \
            self._graphs, self._gids
        getframe, depth2 = sys._getframe, 2 * _DEPTH

        @functools.wraps(original)
        def capture_begin(graph, pool=None, *args, **kwargs):  # no **kwargs dict for the common call
            if sim and graph._backend is not be:  # sim classes are shared by every SimBackend
                return original(graph, pool, *args, **kwargs)
            t0 = clock()
            given = pool  # the original gets the caller's object untouched
            if pool is not None:
                pool = tuple(pool)
                if pool == (0, 0):
                    pool = None
            device = device_now()
            if dead and pool is not None and (device, pool) in dead:
                with lock:
                    san._check_stale(pool, device)
            t1 = clock()
            original(graph, given, *args, **kwargs)
            t2 = clock()
            frames = []  # _Stack's list, built here: one object, no call
            f = getframe(1)
            while f is not None and len(frames) < depth2:
                frames.append(f.f_code)
                frames.append(f.f_lasti)
                f = f.f_back
            with lock:
                g = GraphEntry(next(gids), pool, device, frames, san)
                graphs[g.gid] = g
                if pool is not None:  # the capture holds its references from now on, even if it fails
                    e = pools.get((device, pool))
                    if e is None or not (e.device_alive and e.host_alive):
                        san._hold(g)
                    else:  # a pool that is alive and takes another graph cannot be dead
                        e.held += 1
                        e.captures += 1
                        e.graphs[g.gid] = g
                d = getattr(graph, "__dict__", None)
                if d is not None:
                    old = d.get(_TAG)
                    d[_TAG] = g
                else:
                    old = san._entry_of.get(graph)
                    san._entry_of[graph] = g
                if old is not None and old.owner is san:
                    old.alive = False
                r = g.ref = weakref.ref(graph, san._ref_gone)
                san._refs[id(r)] = g
                san.overhead_s += t1 - t0 + clock() - t2

        return capture_begin

    def _wrap_end(self, original):
        san = self
        clock = time.perf_counter

        @functools.wraps(original)
        def capture_end(graph, *args, **kwargs):
            original(graph, *args, **kwargs)  # on failure the graph keeps its references through reset
            t0 = clock()
            g = san._entry_of_graph(graph)
            if g is not None:
                if g.pool_id is None:  # a graph-minted pool: its id is readable only now
                    with san._lock:
                        g.pool_id = tuple(graph.pool())
                        san._hold(g)
                g.captured = True  # one store: needs no lock
                san.overhead_s += clock() - t0

        return capture_end

    def _wrap_reset(self, original):
        san = self

        @functools.wraps(original)
        def reset(graph, *args, **kwargs):
            out = original(graph, *args, **kwargs)
            g = san._entry_of_graph(graph)
            if g is not None:
                with san._lock:
                    if g.captured:
                        g.captured = False
                        san._release(g)
            return out

        return reset

    def _wrap_mempool_init(self, original):
        san = self

        @functools.wraps(original)
        def __init__(mp, *args, **kwargs):
            original(mp, *args, **kwargs)
            if san.backend.name == "sim" and getattr(mp, "_backend", None) is not san.backend:
                return
            device = getattr(mp, "device", None)
            if device is None:
                device = san._t.device_of_capture()
            pid = tuple(mp.id)
            with san._lock:
                san._minted[pid] = _stack(2)
                e = san._entry(pid, device)
                e.minted_at = san._minted[pid]
                e.device_alive = True
                e.device_extra += 1
                san._restate(e)
            weakref.finalize(mp, san._mempool_gone, pid, device)

        return __init__

    def _mempool_gone(self, pid: PoolId, device: int) -> None:
        with self._lock:
            e = self._entry(pid, device)
            e.device_extra -= 1
            if e.device_count == 0:
                e.released_at = "(the MemPool object was destroyed)\n"
            self._restate(e)

    def _wrap_flush(self, original, forget):
        """A cache flush (device ``empty_cache`` or the host's): afterwards ``forget(e)`` says, per pool, whether
        that allocator erased it, so its id may be created afresh."""
        san = self

        @functools.wraps(original)
        def flush(*args, **kwargs):
            out = original(*args, **kwargs)
            if san.backend.name == "sim" and not (args and args[0] is san.backend):
                return out
            with san._lock:
                for e in san._pools.values():
                    if forget(e):
                        san._restate(e)
            return out

        return flush

    def _device_erased(self, e: PoolEntry) -> bool:
        if e.device_count == 0 and e.device_alive and self.backend.pool_state(e.pool_id, e.device).reserved_bytes == 0:
            e.device_alive = False
            return True
        return False

    @staticmethod
    def _host_erased(e: PoolEntry) -> bool:
        if e.host_count == 0 and e.host_alive:
            e.host_alive = False
            return True
        return False

    def _wrap_release_pool(self, original):
        san = self

        @functools.wraps(original)
        def release_pool(*args, **kwargs):
            out = original(*args, **kwargs)
            if san.backend.name == "cuda":
                device, pid = args[0], tuple(args[1])
            elif args and args[0] is san.backend:
                pid, device = tuple(args[1]), (args[2] if len(args) > 2 else kwargs.get("device", 0))
            else:
                return out
            with san._lock:  # a reference given back by hand (a failed capture's, see CUDAGraphRunner)
                e = san._entry(pid, device)
                e.device_extra -= 1
                if e.device_count == 0:
                    e.released_at = _stack(2)
                san._restate(e)
            return out

        return release_pool

    # findings -----------------------------------------------------------------------------------------
    def use_count(self, pool_id: PoolId, device: int = 0) -> int | None:
        """The device use count the ledger saw (for builds whose allocator does not expose it)."""
        with self._lock:
            e = self._pools.get((device, tuple(pool_id)))
            return None if e is None else e.device_count

    def ledger(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for e in self._pools.values():
                st = self.backend.pool_state(e.pool_id, e.device)
                out.append({"pool_id": list(e.pool_id), "device": e.device, "use_count": e.device_count,
                            "host_use_count": e.host_count, "captures": e.captures, "bytes": st.reserved_bytes,
                            "dead": e.dead, "minted_at": e.minted_at and str(e.minted_at),
                            "released_at": e.released_at and str(e.released_at)})
            return out

    def _pinning_stacks(self, e: PoolEntry) -> tuple[str, ...]:
        be = self.backend
        if be.name == "sim":
            return tuple("".join(s) for s in be.block_stacks(e.pool_id, e.device) if s)
        if not self.record_history:
            return ()
        import torch

        stacks = []
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", (0, 0))) != e.pool_id:
                continue
            for blk in seg.get("blocks", []):
                if blk.get("state") == "active_allocated" and blk.get("frames"):
                    stacks.append("".join(f"  {f['filename']}:{f['line']} in {f['name']}\n" for f in blk["frames"][:12]))
        return tuple(stacks)

    def findings(self) -> list[Finding]:
        """Unreleased graphs, released pools whose bytes are pinned by live tensors, pools never retired."""
        out: list[Finding] = []
        with self._lock:
            for g in self._graphs.values():
                if g.alive and g.captured:
                    out.append(Finding("unreleased_graph", g.pool_id, g.device, 0,
                                       f"a graph captured into pool {g.pool_id} was never reset", (str(g.captured_at),)))
            for e in self._pools.values():
                st = self.backend.pool_state(e.pool_id, e.device)
                live_graphs = any(g.alive and g.captured for g in e.graphs.values())
                if e.device_count == 0 and st.allocated_bytes:  # free segments alone go at empty_cache
                    out.append(Finding(
                        "pinned_pool", e.pool_id, e.device, st.reserved_bytes,
                        f"pool {e.pool_id} was released but {st.reserved_bytes} bytes stay reserved: a tensor "
                        "allocated in its captures is still alive (an output kept, or a clone with autograd history)",
                        self._pinning_stacks(e)))
                elif e.device_count > 0 and not live_graphs and e.captures:
                    out.append(Finding(
                        "pool_never_retired", e.pool_id, e.device, st.reserved_bytes,
                        f"pool {e.pool_id} has no live graph but {e.device_count} reference(s): a MemPool still "
                        "alive, or a failed capture that kept its reference", (str(e.minted_at or ""),)))
        return out

    def check(self) -> list[Finding]:
        """Findings; in ``strict`` mode they raise :class:`AssertionError`."""
        found = self.findings()
        if found and self.mode == "strict":
            raise AssertionError("pool sanitizer findings:\n" + "\n".join(f"- {f.kind}: {f.message}" for f in found))
        return found


_global: PoolSanitizer | None = None


def install_from_env(environ: dict[str, str] | None = None) -> PoolSanitizer | None:
    """Install a process-wide sanitizer when ``CUDAGRAPH_SANITIZE`` is ``1``/``on``/``strict``."""
    global _global
    env = os.environ if environ is None else environ
    value = env.get("CUDAGRAPH_SANITIZE", "").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    mode = "strict" if value == "strict" else "on"
    if _global is None or not _global.active:
        from .cycle import process_backend  # the process's one backend: engines and sanitizer share it

        _global = PoolSanitizer(process_backend(env.get("CUDAGRAPH_SANITIZE_BACKEND", "auto")), mode=mode).start()
    return _global


def global_sanitizer() -> PoolSanitizer | None:
    return _global


def main(argv: list[str] | None = None) -> int:
    """``python -m cudagraph_lifecycle.sanitizer prog.py [args]``: run a program under the sanitizer."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m cudagraph_lifecycle.sanitizer PROGRAM.py [ARGS...]", file=sys.stderr)
        return 2
    san = install_from_env({"CUDAGRAPH_SANITIZE": os.environ.get("CUDAGRAPH_SANITIZE", "on") or "on"})
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        for f in san.findings():
            print(f"cudagraph sanitizer: {f.kind}: {f.message}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
