"""CUDAGraphRunner: one object owning every CUDA graph of one engine.

The runner holds the whole lifecycle in one place, so no graph, buffer, output or pool id can outlive it:
keys, warmup, capture (largest batch first, one pool, one stream), padding, replay, eager fallback, and a
release that resets every graph, drops every buffer and retires the pool, then checks the allocator's books.
This module builds, captures and releases; which graph serves a batch and its replay are ``runner_keys``'s
(``KeyedReplay``); its counters, the release's report and the address check are ``runner_stats``'s.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from . import checks, observe
from .backends import Backend, PoolId, get_backend
from .errors import ConfigError, PoolNotReleasedError, RunnerReleasedError
from .ledger import capture_frames
from .pool import LazyPool
from .runner_keys import (
    ExtraKey,
    KeyedReplay,
    _unsliceable,
    validate_batch_sizes,
    validate_extra_keys,
    validate_feature_shape,
)
from .runner_stats import FALLBACK_REASONS, ReleaseReport, RunnerReports, RunnerStats

__all__ = ["FALLBACK_REASONS", "CUDAGraphRunner", "ExtraKey", "ReleaseReport", "RunnerStats", "validate_batch_sizes"]


def _drop_frames(exc: BaseException | None) -> None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__context__ or exc.__cause__


def _check_options(warmup: Any, recheck_every: Any, watch: Any, dtype: Any) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(recheck_every, bool) or not isinstance(recheck_every, int) or recheck_every < 1:
        raise ConfigError(f"recheck_every must be an int >= 1 (1 checks every replay), got {recheck_every!r}")
    if watch not in ("each", "largest"):
        raise ConfigError(f"watch must be 'each' (every capture watched op by op) or 'largest' (the largest batch "
                          f"of each extra key), got {watch!r}")
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")


def _watch(r: CUDAGraphRunner, bs: int) -> checks.WriteWatch | None:
    """The watch of one capture: the op watch where the ``capture`` check watches this batch; else, where the
    padding or outputs check runs, the write-only watch (the padding check's extra replay must not move a KV
    cache, and an output that is a view of one is state, not the graph's buffer); else none."""
    if "capture" in r.checks and (r.watch == "each" or bs == r.batch_sizes[-1]):
        return r._watched[2](r.backend.invalidation_probe(), r._watched[0])
    return checks.WriteWatch() if r._poison or r._guard is not None else None


class CUDAGraphRunner(KeyedReplay, RunnerReports):
    """Captures ``forward(x, **extra)`` once per key and replays it.

    Args:
        forward: the engine's step. Takes a batch ``x`` of shape ``(b, *feature_shape)`` and the extra key
            fields as keyword arguments; returns a tensor or a pytree of tensors whose first dim is the batch.
        batch_sizes: the batch sizes to capture. A batch ``b`` runs the smallest captured size ``>= b``,
            padded with ``pad_value``; its output is sliced back to ``b``.
        feature_shape, dtype: the static input buffer is ``(max(batch_sizes), *feature_shape)``.
        extra_keys: the values of extra key fields (e.g. ``[{"draft_len": 1}, {"draft_len": 2}]``);
            one graph is captured per batch size and extra key.
        warmup: eager runs per graph before its capture (lazy initialisation must not happen in capture).
        pool: a :class:`LazyPool` to capture into; by default the runner owns one and retires it at release.
        copy_outputs: return copies instead of views of the static outputs. Views are faster, but a view
            the caller keeps pins the pool's segment after release.
        enabled: False runs everything eagerly (counted as fallback ``disabled``).
        checked: replay-correctness checks (``cudagraph_lifecycle.checks``): each capture watched op by op
            (what it reads, the op that broke it), each replay with poisoned padding and outputs (rows never
            written, rows that depend on the padding), outputs that raise once a later replay overwrote them,
            and :meth:`check_addresses`. None: on when ``CUDAGRAPH_CHECKED=1`` or a strict sanitizer runs.
            A list of names from ``checks.CHECKS`` runs only those: ``"capture"`` (the op watch, which
            :meth:`check_addresses` needs), ``"padding"``, ``"outputs"``.
        names: what to call the tensors the graphs read, for :meth:`check_addresses`: a module (its parameters
            and buffers) or a mapping of name -> tensor, read again at each check.
        recheck_every: the ``padding`` check proves each (graph, real batch) pair at its first replay, then at
            every ``recheck_every``-th replay of that pair (each proof costs a second replay and a host sync);
            1 checks every replay.
        watch: which captures the ``capture`` check watches op by op: ``"each"``, or ``"largest"``, the largest
            batch of each extra key (the op watch adds about half of what capturing each op costs, most of it
            the dispatch mode itself: watching one graph of a key's set costs a fraction of that). With
            ``"largest"``, :meth:`check_addresses` knows what the largest graphs read (the weights and static
            buffers every batch size shares, but not a tensor only a smaller batch's code path reads), and a
            failed smaller capture names where its error surfaced rather than the op that broke it.

    Capture runs under ``torch.no_grad()``: autograd history on a captured output would keep the capture's
    saved activations, and with them the pool, alive after release (docs/ARCHITECTURE.md, measured facts).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        batch_sizes: Iterable[int],
        feature_shape: Iterable[int],
        *,
        dtype: torch.dtype = torch.float32,
        backend: Backend | str = "auto",
        device: int = 0,
        extra_keys: Iterable[Mapping[str, Any]] | None = None,
        warmup: int = 2,
        pool: LazyPool | None = None,
        pad_value: float = 0.0,
        copy_outputs: bool = False,
        enabled: bool = True,
        name: str = "engine",
        checked: bool | Iterable[str] | None = None,
        names: Any = None,
        recheck_every: int = 16,
        watch: str = "each",
    ):
        if not callable(forward):
            raise ConfigError(f"forward must be callable, got {type(forward).__name__}")
        self.forward = forward
        self.batch_sizes = validate_batch_sizes(batch_sizes)
        self.feature_shape = validate_feature_shape(feature_shape)
        _check_options(warmup, recheck_every, watch, dtype)
        self.extra_keys = validate_extra_keys(extra_keys)
        self.backend = pool.backend if pool is not None else get_backend(backend)
        self.device = self.backend.check_device(device)
        self.dtype = dtype
        self.warmup = warmup
        self.pad_value = pad_value
        self.copy_outputs = copy_outputs
        self.enabled = enabled
        self.name = name
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else LazyPool(self.backend, name=f"{name}.pool")
        self._graphs: dict[tuple[int, ExtraKey], tuple[Any, Any]] = {}
        self._failed: dict[ExtraKey, str] = {}
        self._static_in: torch.Tensor | None = None
        self._stream = None
        self._captured = False
        self._released = False
        self._release_report: ReleaseReport | None = None
        self._pool_ids: list[tuple[int, PoolId]] = []
        self._frames: list = []  # the stack of the current capture() call, as the ledger keeps stacks
        self._stats = RunnerStats()
        self._fallbacks: Counter[str] = Counter()
        self.checks = checks.selected(checked)
        self.checked = bool(self.checks)
        self._names = names
        self._guard = checks.OutputGuard() if "outputs" in self.checks else None
        self._poison = "padding" in self.checks
        self.recheck_every = recheck_every
        self.watch = watch
        self._replays_of: Counter[tuple] = Counter()  # (graph key, real batch) -> replays, for recheck_every
        self._addresses = checks.AddressBook()
        self._effects: dict[tuple, tuple[list, frozenset]] = {}  # graph key -> (state it writes, their keys)
        # during capture() with the op watch: (the set's known reads, the names of the tensors it may read, the
        # watch's class: compiled or Python, as CUDAGRAPH_CAPTURE_PATH says)
        self._watched: tuple[dict, dict, type] | None = None

    # lifecycle
    def _check_live(self) -> None:
        if self._released:
            raise RunnerReleasedError(
                f"runner {self.name!r} was released: its graphs, buffers and pool are gone. "
                "Build a new runner (and so a fresh pool) for the next engine"
            )

    def capture(self) -> None:
        """Warm up and capture every (batch size, extra key), largest batch first, into one fresh pool.

        All or nothing: if it stops part-way (an interrupt, a pool check that refuses), the graphs it
        captured are reset and the runner is as before, so the next ``capture()`` or ``run()`` starts again.
        """
        self._check_live()
        if self._captured or not self.enabled:
            return
        try:
            dev = self.backend.torch_device(self.device)
            self._static_in = torch.zeros((self.batch_sizes[-1], *self.feature_shape), dtype=self.dtype, device=dev)
            self._stream = self.backend.capture_stream(self.device)
            self._frames = capture_frames()  # where this capture was asked for: one stack for all its graphs
            self._watched = (({}, checks.named_tensors(self._names), checks.CaptureWatch)
                             if "capture" in self.checks else None)
            pool_id, dead = self._take_pool(), False
            for bs in reversed(self.batch_sizes):
                for ekey in self.extra_keys:
                    if ekey in self._failed:
                        continue
                    if dead:  # capturing into it again would be the stale-pool assert: a fresh id
                        pool_id, dead = self._fresh_pool(), False
                    # a failed capture gave its reference back: with no graph of ours left, the pool is dead
                    dead = self._capture_one(bs, ekey, pool_id) is False and not self._graphs
        except BaseException:
            self._abandon_capture()
            raise
        finally:
            self._watched = None  # the set's known reads hold their storages until here
        self._captured = True

    def _take_pool(self) -> PoolId:
        pool_id = self.pool.acquire(self.device)
        self.pool.check_capturable(pool_id, self.device)
        if (self.device, pool_id) not in self._pool_ids:
            self._pool_ids.append((self.device, pool_id))
        self._stats.pool_id = pool_id
        return pool_id

    def _fresh_pool(self) -> PoolId:
        """Retire the pool's dead id and take a new one; flush the caches so the allocator erases the old."""
        self.pool.retire()
        self.backend.synchronize(self.device)
        self.backend.empty_cache()
        self.backend.host_empty_cache()
        return self._take_pool()

    def _abandon_capture(self) -> None:
        while self._graphs:  # one by one: a loop variable bound to an output would pin its segment
            self._graphs.popitem()[1][0].reset()
        self._failed.clear()
        self._static_in = None
        # The pool's graphs are all reset now: until both allocators erase it, capturing into it again is
        # the stale-pool assert. Nothing of it is alive any more, so flushing the caches erases it.
        self.backend.synchronize(self.device)
        self.backend.empty_cache()
        self.backend.host_empty_cache()

    def _capture_one(self, bs: int, ekey: ExtraKey, pool_id: PoolId) -> bool | None:
        """Capture one graph: True when captured; False when its capture failed, None when its eager warm-up
        did (both recorded, and the key's graphs reset; only a failed capture touched the pool)."""
        be = self.backend
        x = self._static_in[:bs]
        kwargs = dict(ekey)
        graph = be.new_graph()
        uses_before = self.pool.use_count(self.device)
        err: BaseException | None = None
        err_where: str | None = None
        out = None
        with torch.no_grad():
            try:
                with be.stream(self._stream):
                    for _ in range(self.warmup):
                        self.forward(x, **kwargs)
                be.synchronize(self.device)
            except Exception as e:  # eager failure: the key cannot run at all, record it
                err = e
            eager_failed = err is not None
            if err is None:
                watch = _watch(self, bs)
                reserved = be.memory_reserved(self.device)
                t0 = time.perf_counter()
                direct = observe.direct_capture(type(graph))
                with be.stream(self._stream):
                    if direct is None:
                        graph.capture_begin(pool=pool_id)
                    else:  # what the sanitizer's wrappers do, without their frames and a stack walk per graph
                        if direct.pending_keys or (direct.dead_ids and pool_id in direct.dead_ids):
                            direct.judge(be, self.device, pool_id)
                        direct.begin(graph, pool_id)
                        entry = direct.record(graph, be, self.device, pool_id, self._frames)
                    try:
                        if watch is None:
                            out = self.forward(x, **kwargs)
                        else:
                            with watch:
                                out = self.forward(x, **kwargs)
                    except BaseException as e:  # an interrupt too: the capture must be ended either way
                        err = e
                    try:
                        if direct is None:
                            graph.capture_end()
                        else:
                            direct.end(graph)
                            entry.captured = True
                    except Exception as e:
                        if direct is not None:  # what the capture_end wrapper records: the RNG is left poisoned
                            direct.hooks.capture_failed(graph, e)
                        err = err or e
                self._stats.capture_ms += (time.perf_counter() - t0) * 1e3
                label = f"{bs} {dict(ekey)}" if ekey else str(bs)
                self._stats.graph_bytes[label] = be.memory_reserved(self.device) - reserved
                if err is not None:
                    err_where = (getattr(watch, "offender", None)
                                 or (checks.user_frame(err.__traceback__) if err.__traceback__ else None))
                elif watch is not None:
                    if isinstance(watch, checks.CaptureWatch):
                        self._addresses.add(f"graph {label}", watch.reads, self._watched[1])
                    self._effects[(bs, ekey)] = (list(watch.writes.values()), frozenset(watch.writes))
        if err is None:
            err = _unsliceable(out, bs)
        if err is not None:
            # torch 2.11, when capture_end fails: the allocator's record of the capture stays open
            # (PyTorch #180395; measured), and the graph keeps its pool reference through reset() and
            # destruction (measured: MemPool use_count 2). Close the record, give back what is still held.
            be.end_capture_routing(pool_id, self.device)
            graph.reset()
            del graph
            uses_after = self.pool.use_count(self.device)
            if uses_before is not None and uses_after is not None and uses_after > uses_before:
                be.release_pool_reference(pool_id, self.device)
            out = None
            if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit: cleaned up, now let it through
                raise err
            msg = f"batch {bs}{f' {dict(ekey)}' if ekey else ''}: {type(err).__name__}: {err}"
            if err_where:
                msg += f" -- the op that broke the capture: {err_where}"
            # The traceback's frames hold the capture's temporaries, which would pin the pool: drop them.
            _drop_frames(err)
            del err
            self._failed[ekey] = msg
            self._stats.capture_failures += 1
            self._stats.failures.append(msg)
            for key in [k for k in self._graphs if k[1] == ekey]:  # a key is all-or-nothing
                self._graphs.pop(key)[0].reset()
            return None if eager_failed else False
        self._graphs[(bs, ekey)] = (graph, out)
        self._stats.captures += 1
        return True


    def release(self, strict: bool = False) -> ReleaseReport:
        """Reset every graph, drop buffers and outputs, retire the pool, then read the allocator's books.

        Idempotent. With ``strict``, raise :class:`PoolNotReleasedError` if a segment of the pool is left
        (an output view the caller still holds pins its segment: drop it or copy it out first).
        """
        if self._release_report is None:
            be = self.backend
            reserved_before = be.memory_reserved(self.device)
            # Pop entries one by one: a loop variable bound to an output would pin its segment.
            while self._graphs:
                self._graphs.popitem()[1][0].reset()
            self._static_in = None
            self._stream = None
            self._effects.clear()
            self._released = True
            be.synchronize(self.device)
            if self._owns_pool:
                self.pool.retire()
            be.empty_cache()
            be.host_empty_cache()  # the host allocator keeps its own ledger of the pool's id
            states = tuple(be.pool_state(pid, dev) for dev, pid in self._pool_ids)
            self._release_report = ReleaseReport(states, reserved_before, be.memory_reserved(self.device))
        report = self._release_report
        if strict and not report.clean:
            raise PoolNotReleasedError(
                f"runner {self.name!r} released, but its pool still holds {report.pinned_bytes} bytes: "
                "a tensor from the pool is still alive (an output view the caller kept, or a clone with "
                "autograd history). Drop it, or build the runner with copy_outputs=True"
            )
        return report

    def __enter__(self) -> CUDAGraphRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
