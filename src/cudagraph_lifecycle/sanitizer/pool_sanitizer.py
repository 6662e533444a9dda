"""PoolSanitizer: judges the graph captures of one allocator world and reports what the ledger shows.

While started it holds the observation layer (so ``torch.cuda.graph``, ``make_graphed_callables``,
``torch.compile(mode="reduce-overhead")`` and hand-written captures are all watched) and registers a judge
for its world: a capture into a *dead* pool raises :class:`StalePoolError` before the real ``capture_begin``
runs, so the process stays usable; so does a capture begun on the default stream
(:class:`DefaultStreamCaptureError`: torch refuses it only after opening the CUDA RNG's capture, which leaves
every later eager random op failing). Dead means, per the measured rules (conformance table): all its graphs
were released and either the device allocator still holds the pool (a live block pins it, or
``empty_cache`` has not run) or the host allocator's ledger still has the id (``_host_emptyCache`` has not
run).

    with PoolSanitizer("cuda") as san:
        ...                       # any CUDA graph code
    san.findings()                # unreleased graphs, pinned pools, pools never retired

Any number of sanitizers may start and stop in any order; the graph API is restored when the last one
stops (and no other holder of the observation layer remains).
"""

from __future__ import annotations

from typing import Any

from .. import observe
from ..backends import Backend, PoolId, get_backend
from ..checks import mode as checked_mode
from ..choices import EXPANDABLE_TEARDOWN, SANITIZE_MODES
from ..errors import ConfigError
from ..ledger import DefaultStreamCapture, StaleAttempt, TeardownHazard, ledger
from .findings import Finding, collect
from .stale import default_stream_error, hazard_error, stale_error

# read by pytest (nothing imported): a failure's traceback leaves this module's frames out, so the error a
# judge raises points at the user's capture
__tracebackhide__ = True


class PoolSanitizer:
    """See the module docstring.

    ``mode``: ``on`` raises :class:`StalePoolError` on a stale capture; ``strict`` also makes :meth:`check`
    raise on findings. Under ``expandable_segments:True`` a reset that would tear down a pool while blocks of
    it live (freeing them afterwards crashed torch 2.11 on the H200) raises
    :class:`ExpandableSegmentsHazardError` and is not done, unless ``expandable_teardown="report"`` (then it
    is a finding only; ``strict`` refuses it always). ``record_history``
    records an allocation stack for every block, so pinned pools are reported with the lines that allocated
    what pins them. ``scope`` limits findings to one engine scope.
    """

    def __init__(self, backend: Backend | str = "auto", mode: str = "on", record_history: bool = False,
                 scope: str | None = None, expandable_teardown: str = "refuse"):
        mode = mode.strip().lower() if isinstance(mode, str) else mode  # as the options take it
        if mode not in SANITIZE_MODES or mode == "off":
            raise ConfigError(f"PoolSanitizer(mode={mode!r}): choose 'on' or 'strict' (use no sanitizer for 'off')")
        if isinstance(expandable_teardown, str):
            expandable_teardown = expandable_teardown.strip().lower()
        if expandable_teardown not in EXPANDABLE_TEARDOWN:
            raise ConfigError(f"PoolSanitizer(expandable_teardown={expandable_teardown!r}): choose 'refuse' (the "
                              "default) or 'report'")
        self.backend = get_backend(backend)
        self.mode = mode
        self.expandable_teardown = expandable_teardown
        self.record_history = record_history
        self.scope = scope
        self.active = False
        self.history_note: str | None = None  # why allocation stacks are off, if they are
        self._since = 0
        self._stale_seen = 0

    def _judge(self, event: StaleAttempt | TeardownHazard | DefaultStreamCapture) -> None:
        if isinstance(event, DefaultStreamCapture):  # torch would raise anyway, and poison random ops first
            raise default_stream_error(event)
        if isinstance(event, TeardownHazard):
            if self.mode == "strict" or self.expandable_teardown == "refuse":
                raise hazard_error(event, self.mode)
            return
        raise stale_error(self.backend, event)

    def start(self) -> PoolSanitizer:
        if self.active:
            return self
        observe.acquire()
        observe.add_judge(self.backend.world, self._judge)
        if self.mode == "strict":
            checked_mode.hold()  # strict also turns on the replay-correctness checks
        if self.record_history:
            self.history_note = self.backend.record_history(True)
        self._since = ledger.seq
        self.active = True
        return self

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        observe.remove_judge(self.backend.world, self._judge)
        if self.mode == "strict":
            checked_mode.release()
        observe.release()

    def __enter__(self) -> PoolSanitizer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def stale_caught(self) -> int:
        """Captures into dead pools of this world seen since this sanitizer started."""
        return len(ledger.stale_since(self._since, self.backend.world))

    def use_count(self, pool_id: PoolId, device: int = 0) -> int | None:
        """The device use count the ledger saw (for builds whose allocator does not expose it)."""
        e = ledger.pool(self.backend.world, device, pool_id)
        return None if e is None else e.device_count

    def ledger(self) -> list[dict[str, Any]]:
        """The ledger's pools of this world captured into since this sanitizer started, as dicts."""
        out = []
        for e in ledger.snapshot(self.backend.world):
            if e.last_seq <= self._since:
                continue
            st = self.backend.pool_state(e.pool_id, e.device)
            out.append({"pool_id": list(e.pool_id), "device": e.device, "use_count": e.device_count,
                        "host_use_count": e.host_count, "captures": e.captures, "bytes": st.reserved_bytes,
                        "dead": e.dead, "engine": e.owner, "engines": list(e.scopes),
                        "minted_at": e.minted_at and str(e.minted_at),
                        "released_at": e.released_at and str(e.released_at)})
        return out

    def findings(self) -> list[Finding]:
        """Unreleased graphs, released pools whose bytes are pinned by live tensors, pools never retired."""
        return collect(self.backend, self._since, self.scope)

    def check(self) -> list[Finding]:
        """Findings; in ``strict`` mode they raise :class:`AssertionError`."""
        found = self.findings()
        if found and self.mode == "strict":
            raise AssertionError("pool sanitizer findings:\n" + "\n".join(f"- {f.kind}: {f.message}" for f in found))
        return found
