"""The wrappers around one backend kind's graph API: each calls the original and tells the ledger what
happened. Built from a :class:`~cudagraph_lifecycle.backends.base.GraphAPI`, so the same code watches
``torch.cuda`` and the simulated allocator.

The capture path is timed (the sanitizer's budget is a few percent of a capture): it checks one dict for
dead pools, builds one flat stack list, and leaves the rest to the ledger.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from ..backends.base import Backend, GraphAPI
from ..errors import TORCH_DEFAULT_STREAM_REFUSAL, first_line
from ..ledger import CAPTURE_STACK_DEPTH as _DEPTH
from ..ledger import DefaultStreamCapture, FailedCapture, GraphEntry, Ledger, Stack, TeardownHazard, raised_at

TAG = "_cudagraph_ledger_entry"  # where a graph carries its ledger entry
# read by pytest (plain Python here, nothing imported): a failure's traceback leaves this module's frames out,
# so a refused capture, or torch's own error under a wrapper, points at the user's line
__tracebackhide__ = True

# A judge decides what a capture into a dead pool does before the allocator sees it (raise, or let it
# through): world -> the judges registered for it, the last one rules.
Judge = Callable[[Any], None]
# What a dead pool holds when a capture comes into it: (backend, key) -> (reserved bytes, pins as dicts).
# Registered by the sanitizer's package (it knows how to name holders); asked in every mode, judges or not.
Explain = Callable[[Backend, tuple], tuple[int, tuple]]


class Hooks:
    """What every wrapper shares: the ledger, the judges and the worlds seen."""

    def __init__(self, ledger: Ledger, judges: dict[Any, list[Judge]]):
        self.ledger = ledger
        self.judges = judges
        self.worlds: set = set()
        self.explain: Explain | None = None
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graphs that take no attribute
        self._gone = self._graph_gone  # one bound method for every entry (captures are timed)

    def _graph_gone(self, g: GraphEntry) -> None:
        """An entry's graph was destroyed (the entry is the weak reference that saw it)."""
        key = None if g.pool_id is None else (g.world, g.device, g.pool_id)
        self.ledger.later(key, self.ledger.graph_destroyed, g)

    def saw(self, be: Backend) -> None:
        """A world seen for the first time: its pools die with it, so forget them then."""
        self.worlds.add(be.world)
        weakref.finalize(be, self.ledger.forget_world, be.world)

    def judge(self, be: Backend, device: int, pool: tuple) -> None:
        """A capture into ``pool``: record and judge it if the pool is dead."""
        led, world = self.ledger, be.world
        e = led.dead.get((world, device, pool))
        if e is not None and led.maybe_erased(e):  # a flush since its release may have erased it: read the books
            led.settle(world)
            e = led.dead.get((world, device, pool))
        if e is None:
            return
        rules = self.judges.get(world)
        where = Stack.here(2)  # only where a pool is dead: off the common path
        # what pins it, read now: with no judge the allocator asserts next, and nothing can be read after
        facts = self.explain(be, e.key) if self.explain is not None and e.device_count <= 0 else (0, ())
        with led.lock:
            attempt = led.stale_attempt(e, where, bool(rules), facts)
        if rules:
            rules[-1](attempt)

    def before_last_reset(self, be: Backend | None, g: GraphEntry) -> None:
        """With expandable segments, resetting a pool's last graph while blocks of it are alive is reported to
        crash the process when those blocks are freed later: record it, and let the judge decide."""
        if be is None or not be.expandable_segments():
            return
        led = self.ledger
        e = led.pools.get((g.world, g.device, g.pool_id))
        if e is None or e.held + e.device_extra != 1:
            return
        blocks = be.live_blocks(g.pool_id, g.device)
        live = sum(b.size for b in blocks) or be.pool_state(g.pool_id, g.device).allocated_bytes
        if not live:
            return
        where = Stack.here(2)
        hazard = TeardownHazard(e.key, led.scope, led.next_seq(), e.owner, live,
                                tuple(b.stack for b in blocks if b.stack)[:8], str(where), led.test,
                                tuple(e.capture_sites()), where.site())
        led.note_hazard(hazard)
        rules = self.judges.get(g.world)
        if rules:
            rules[-1](hazard)

    def default_stream(self, be: Backend, device: int, pool: tuple | None, rules: list[Judge] | None) -> None:
        """A capture begun on its device's default stream. With ``rules`` (the world's judges, read before the
        original), the last one rules before torch runs: it refuses (torch would refuse too, after opening the
        CUDA RNG's capture, which poisons every later eager random op). Without, torch refused it: the process's
        random ops are poisoned."""
        led = self.ledger
        where = Stack.here(2)
        event = DefaultStreamCapture((be.world, device), led.scope, led.next_seq(), led.test, str(where),
                                     where.site(), pool, bool(rules))
        with led.lock:
            led.default_stream.append(event)
        if rules:
            rules[-1](event)
            with led.lock:  # a judge that let it through: torch decides, and its refusal is recorded then
                led.default_stream.remove(event)

    def capture_failed(self, graph: Any, e: BaseException) -> None:
        """A capture whose end raised: recorded (an engine that catches the error and runs eagerly has leaked
        the pool's references and left the RNG's capture open). Never raises: torch's error is what the caller
        must see."""
        try:
            g = self.entry_of(graph)
            if g is None or g.captured:  # (a capture_end with no capture open is no failed capture)
                return
            led = self.ledger
            where = Stack(g.frames)
            cause = e.__cause__ or e.__context__  # what the captured code raised first, where it raised
            # a capture without a pool argument has no pool id until it ends well: None
            event = FailedCapture((g.world, g.device, g.pool_id), g.scope, led.next_seq(), g.test, str(where),
                                  where.site(), first_line(e), raised_at(cause) if cause is not None else "")
            with led.lock:
                led.failed_captures.append(event)
        except Exception:
            pass

    def ended(self, graph: Any) -> None:
        """capture_end returned: the graph holds its pool's references until reset (a capture without a pool
        argument learns its pool only now)."""
        g = self.entry_of(graph)
        if g is not None:
            if g.pool_id is None:
                self.ledger.capture_bound(g, tuple(graph.pool()))
            g.captured = True

    def register(self, g: GraphEntry, old: GraphEntry | None) -> None:
        """Count a capture the capture path only queued (applied at the ledger's next operation, under its lock,
        before the graph's destruction if that came later: the weak reference's event drains the queue first)."""
        if old is not None and old.generation == g.generation:
            self.ledger.replaced(old)
        self.ledger.add_graph(g)

    def untagged(self, graph: Any, g: GraphEntry) -> None:
        """A graph that takes no attribute: its entry kept beside it, and counted at once."""
        self.tag(graph, g)
        with self.ledger.lock:
            self.ledger.add_graph(g)

    def drain(self) -> None:
        with self.ledger.lock:
            self.ledger.drain()

    def entry_of(self, graph: Any) -> GraphEntry | None:
        g = getattr(graph, TAG, None)
        if type(g) is not GraphEntry:  # (a class's __getattr__ may answer anything)
            g = self._entries.get(graph) if self._entries else None
        return g if g is not None and g.generation == self.ledger.generation else None

    def tag(self, graph: Any, g: GraphEntry) -> None:
        """Attach an entry to a graph that takes no attribute (the capture path tags the others inline)."""
        old = self._entries.get(graph)
        self._entries[graph] = g
        if old is not None and old.generation == g.generation:
            self.ledger.replaced(old)


def recorder(hooks: Hooks) -> Callable[..., GraphEntry]:
    """``record(graph, be, device, pool, frames)``: the ledger entry of a graph whose capture began now (its
    engine scope, test and sequence number are now's), tagged on the graph; counting it into its pool is
    queued. Shared by the capture wrapper and :class:`DirectCapture`; the only place entries are made."""
    led, worlds, register = hooks.ledger, hooks.worlds, hooks.register
    # the ledger's containers are cleared in place (fork, forgotten worlds): bound once, read per capture
    pending, gone, seq = led.pending, hooks._gone, led.seq_counter
    last_world = None  # the world of the previous capture: the set of worlds seen is read only on a change

    def record(graph: Any, be: Backend, device: int, pool: tuple | None, frames: list) -> GraphEntry:
        nonlocal last_world
        world = be.world
        g = GraphEntry(graph, gone)  # fields set here, not in an __init__: one call less per capture
        led.seq = g.seq = g.gid = next(seq)
        g.world, g.pool_id, g.device, g.frames = world, pool, device, frames
        g.scope, g.test, g.generation = led.scope, led.test, led.generation
        g.captured = g.counted = False
        g.alive, g.replays = True, 0
        old = getattr(graph, TAG, None)
        try:
            setattr(graph, TAG, g)  # an attribute, not the graph's __dict__: no dict is made for it
        except (AttributeError, TypeError):
            hooks.untagged(graph, g)
        else:
            # an entry alone: counted at the drain
            pending.append(g if type(old) is not GraphEntry else (register, (g, old)))
            if len(pending) > 256:  # a process that only captures must not grow the queue for ever
                hooks.drain()
        if world is not last_world:
            if world not in worlds:
                hooks.saw(be)
            last_world = world
        return g

    return record


def capture_begin(api: GraphAPI, hooks: Hooks, original, record: Callable[..., GraphEntry]):
    backend_of, device_of, current_device, proc = api.graph_backend, api.capture_device, api.current_device, \
        api.process_cls
    on_default, judges = api.on_default_stream, hooks.judges
    # CUDA's current and default stream as C functions: no Python frame on the timed path
    stream_of, default_of, defaults = api.current_stream, api.default_stream, {}
    led = hooks.ledger
    pending_keys, dead, dead_ids = led.pending_keys, led.dead, led.dead.ids
    getframe, more, depth = sys._getframe, range(_DEPTH - 1), _DEPTH

    # Everything here runs right after the model's warm-up has evicted the host's caches: on the H200 each
    # object touched costs microseconds (measured: bench/bench_wrapper_cost.py). So the capture path judges
    # (only where a dead pool has this id or an event is queued), takes the stack and tags the graph; counting
    # it into its pool is queued for the ledger's next operation (a reset, a flush, a query), where a runner's
    # graphs are counted together, warm. A destruction before then drains the queue before it applies.
    @functools.wraps(original)
    def wrapper(graph, pool=None, *args, **kwargs):  # no **kwargs dict built for the common call
        be = (proc._process if proc is not None else None) or backend_of(graph)
        if be is None:
            return original(graph, pool, *args, **kwargs)
        given = pool  # the original gets the caller's object untouched
        device = None
        if pool is not None:
            if type(pool) is not tuple:
                pool = tuple(pool)
            if pool == (0, 0):
                pool = None
            elif (dead_ids and pool in dead_ids) or pending_keys:  # a dead pool has this id (some device or world)
                device = current_device() if current_device is not None else device_of(graph)
                key = (be.world, device, pool)
                # a graph destroyed during a ledger operation may have made the pool dead: apply what concerns it
                if pending_keys and key in pending_keys:
                    with led.lock:
                        led.drain()
                if key in dead:
                    hooks.judge(be, device, pool)
        # where a judge rules, a capture on the default stream is refused before torch poisons random ops
        rules = judges.get(be.world) if judges else None
        if rules:
            if device is None:
                device = current_device() if current_device is not None else device_of(graph)
            if stream_of is not None:
                default = defaults.get(device)
                if default is None:
                    default = defaults[device] = default_of(device)[0]
                if stream_of(device)[0] == default:
                    hooks.default_stream(be, device, pool, rules)
            elif on_default is not None and on_default(graph):
                hooks.default_stream(be, device, pool, rules)
        try:
            original(graph, given, *args, **kwargs)
        except Exception as e:
            begin_failed(hooks, device_of, graph, be, pool, e)
            raise
        if device is None:  # read after the original, which leaves what it reads warm
            device = current_device() if current_device is not None else device_of(graph)
        f = getframe(1)  # the stack as Stack keeps it, built inline into one list of its final size
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
        record(graph, be, device, pool, frames)

    return wrapper


def begin_failed(hooks: Hooks, device_of, graph: Any, be: Backend, pool: tuple | None, e: BaseException) -> None:
    """capture_begin raised. Torch's refusal of the default stream, not judged first, has poisoned the
    process's random ops: recorded. Never raises (torch's error is what the caller must see)."""
    if TORCH_DEFAULT_STREAM_REFUSAL in str(e):
        try:
            hooks.default_stream(be, device_of(graph), pool, None)
        except Exception:
            pass


class DirectCapture:
    """The capture path for code that makes its own captures and knows where they go (the runner): the
    originals under the observation layer's capture wrappers, and what those wrappers do, split so the caller
    takes the stack once for all its graphs and judges only where a pool is dead or an event is queued:

        if d.pending_keys or (d.dead_ids and pool in d.dead_ids): d.judge(be, device, pool)
        d.begin(graph, pool); g = d.record(graph, be, device, pool, frames)
        ... the capture ...
        d.end(graph); g.captured = True  # (only once the original capture_end returned; if it raised:
        #                                 d.hooks.capture_failed(graph, error))

    The ledger receives exactly what the wrappers would give it. Valid while both wrappers are the graph
    class's methods (:func:`cudagraph_lifecycle.observe.direct_capture` checks). There is no default-stream
    check: the caller captures on a side stream of its own (the runner's capture stream). ``pool`` is a tuple,
    as the dead pools' ids are: only a pool whose id a dead pool carries (on some device or world) is judged,
    as the capture wrapper does (released pools stay dead until a query settles them)."""

    def __init__(self, hooks: Hooks, begin, end, record: Callable[..., GraphEntry]):
        self.begin, self.end, self.record = begin, end, record
        self.hooks = hooks
        led = hooks.ledger  # its containers are cleared in place, never rebound
        self.dead_ids, self.pending_keys = led.dead.ids, led.pending_keys

    def judge(self, be: Backend, device: int, pool: tuple) -> None:
        """What the capture wrapper does before the original: apply queued events about the pool, judge it."""
        led, key = self.hooks.ledger, (be.world, device, tuple(pool))
        led.drain_before_capture(key)
        if key in led.dead:
            self.hooks.judge(be, device, key[2])


def capture_end(api: GraphAPI, hooks: Hooks, original):
    @functools.wraps(original)
    def wrapper(graph, *args, **kwargs):
        try:
            original(graph, *args, **kwargs)  # on failure the graph keeps its references through reset
        except Exception as e:
            hooks.capture_failed(graph, e)
            raise
        hooks.ended(graph)

    return wrapper


def reset(api: GraphAPI, hooks: Hooks, original):
    led = hooks.ledger

    @functools.wraps(original)
    def wrapper(graph, *args, **kwargs):
        if led.pending:  # its capture may still be queued: count it first
            with led.lock:
                led.drain()
        g = hooks.entry_of(graph)
        if g is not None and g.captured and g.counted:
            hooks.before_last_reset(api.graph_backend(graph), g)
        out = original(graph, *args, **kwargs)
        if g is not None and g.captured:
            led.released(g, Stack.here())
        return out

    return wrapper


def replay(api: GraphAPI, hooks: Hooks, original):
    """Counts replays (a graph never replayed means its engine silently ran eagerly): one attribute lookup."""

    @functools.wraps(original)
    def wrapper(graph, *args, **kwargs):
        g = getattr(graph, TAG, None)
        if type(g) is GraphEntry:
            g.replays += 1
        return original(graph, *args, **kwargs)

    return wrapper


def handle(parse, hooks: Hooks, original):
    led = hooks.ledger

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        be, pool = parse(args, kwargs, result)
        if be is not None:
            led.note_minted(be.world, tuple(pool), Stack.here())
        return result

    return wrapper


def mempool_init(api: GraphAPI, hooks: Hooks, original):
    led = hooks.ledger

    @functools.wraps(original)
    def wrapper(mp, *args, **kwargs):
        original(mp, *args, **kwargs)
        be, device, pool = api.mempool_parse(mp)
        if be is None:
            return
        where = Stack.here()
        led.note_minted(be.world, pool, where)
        led.pool_reference(be.world, device, pool, +1, where)
        with led.lock:
            led.mempools[(be.world, device, pool)] = weakref.ref(mp)
        weakref.finalize(mp, led.later, (be.world, device, pool), led.pool_reference, be.world, device, pool, -1,
                         "(the MemPool object was destroyed)\n")

    return wrapper


class FlushGate:
    """``armed``: a flush may have something to record. The ledger arms every gate (``arm``) whenever
    something comes to wait for a flush; a flush that finds nothing disarms its own. The compiled path's gate
    (``_capture.FlushGate``) is the installed flush itself, passing straight to the original while disarmed."""

    __slots__ = ("armed",)

    def __init__(self) -> None:
        self.armed = True

    def arm(self) -> None:
        self.armed = True


def flush(parse, hooks: Hooks, original, host: bool, gate: Any = None):
    """A cache flush: afterwards the pools that allocator erased may be created afresh under their ids."""
    led = hooks.ledger
    readers: dict = {}  # world -> how to read its books later: one per world, not one per flush
    # torch.cuda.graph flushes both caches before every capture: most flushes find nothing to record (no
    # released pool waits for one, no event is queued) and pass straight through, reading one flag: the
    # ledger's books are not touched (after a capture each object touched costs the H200's host ~1 us)
    unflushed, host_dead, pending_keys, peak = led.unflushed, led.host_dead, led.pending_keys, led.peak_bytes
    gate = FlushGate() if gate is None else gate
    led.flush_watchers.append(gate.arm)

    def waits() -> bool:
        return bool(pending_keys or (host_dead if host else unflushed or peak))

    def disarm_unless_waiting() -> bool:
        gate.armed = False  # then read again: what arms it may have come in between
        if waits():
            gate.armed = True
            return False
        return True

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not gate.armed:
            return original(*args, **kwargs)
        if not waits() and disarm_unless_waiting():
            return original(*args, **kwargs)
        be = parse(args, kwargs)
        if be is not None and not host and led.peak_bytes:  # a budget's test: read its pools before they go
            led.before_flush(be.world, be.pool_bytes_reader())
        out = original(*args, **kwargs)
        if be is not None:
            if host:
                led.host_flushed(be.world)
            elif not be.expandable_segments():
                reader = readers.get(be.world)
                if reader is None or reader.args[0]() is not be:  # a forked child's backend is a new object
                    if len(readers) > 64:  # isolated sim worlds come and go
                        readers.clear()
                    reader = readers[be.world] = functools.partial(_reader_of, weakref.ref(be))
                led.device_flushed(be.world, reader)
            # under expandable segments a released pool with no segment left may still be in the allocator's
            # books (its count of expansions not yet unmapped): it stays dead (sim_expandable.py)
        # torch.cuda.graph flushes before each capture: the next flush, with nothing left to record, must
        # pass through the gate, not come here to find that out
        if not waits():
            disarm_unless_waiting()
        return out

    return wrapper


def _reader_of(ref: weakref.ref) -> Callable[[int, tuple], int] | None:
    be = ref()
    return None if be is None else be.pool_bytes_reader()


def pool_reference(parse, hooks: Hooks, original):
    """A reference taken or given back outside a graph (cudagraph trees' warm-up allocations, a failed
    capture's reference given back by hand). Taking one into a dead pool asserts like a capture."""
    led = hooks.ledger

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        parsed = parse(args, kwargs)
        if parsed is None:
            return original(*args, **kwargs)
        be, device, pool, delta = parsed
        if delta > 0:
            if led.pending:
                led.drain_before_capture((be.world, device, pool))
            if led.dead:
                hooks.judge(be, device, pool)
        out = original(*args, **kwargs)
        led.pool_reference(be.world, device, pool, delta, Stack.here())
        return out

    return wrapper
