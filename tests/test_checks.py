"""The replay-correctness checks on the simulated allocator: each catches its bug and passes a correct engine."""

import os

import pytest
import torch

import cudagraph_lifecycle
from cudagraph_lifecycle import CUDAGraphRunner, PoolSanitizer, checks
from cudagraph_lifecycle.backends.sim import SimBackend
from cudagraph_lifecycle.checks import enabled
from cudagraph_lifecycle.errors import (
    CapturedAddressError,
    ConfigError,
    OverwrittenOutputError,
    ReplayCheckError,
)


def runner(fwd, **kw):
    kw.setdefault("backend", SimBackend())
    return CUDAGraphRunner(fwd, [2, 4], (8,), checked=kw.pop("checked", True), **kw)


def test_an_output_used_after_the_next_replay_raises_naming_both():
    r = runner(lambda x: x * 2)
    first = r.run(torch.ones(3, 8))
    kept = r.run(torch.ones(3, 8)).clone()  # the right way: copy before the next step
    second = r.run(torch.full((3, 8), 3.0))
    with pytest.raises(OverwrittenOutputError) as e:
        first.sum()
    text = str(e.value)
    assert "returned by replay 1 at" in text and "overwritten by the replay at" in text
    assert text.count("test_checks.py") >= 2  # both call sites are this file's lines
    assert os.path.dirname(cudagraph_lifecycle.__file__) not in text  # ... and none of the runner's machinery
    assert torch.equal(second, torch.full((3, 8), 6.0)) and torch.equal(kept, torch.full((3, 8), 2.0))
    del first, second, e  # the error's traceback holds the overwritten output too
    assert r.release().clean


def test_unchecked_runners_return_plain_views():
    r = runner(lambda x: x * 2, checked=False)
    first = r.run(torch.ones(3, 8))
    r.run(torch.full((3, 8), 3.0))
    assert torch.equal(first, torch.full((3, 8), 6.0))  # silently overwritten: what checked mode catches
    del first
    r.release()


def test_rows_that_depend_on_the_padding_are_caught():
    r = runner(lambda x: x - x.mean(dim=0))  # mixes rows across the batch: padding leaks into real rows
    with pytest.raises(ReplayCheckError, match="depend on the padding"):
        r.run(torch.randn(3, 8))
    assert runner(lambda x: x - x.mean(dim=1, keepdim=True)).run(torch.randn(3, 8)).shape == (3, 8)  # per row: fine


def test_the_padding_check_proves_each_pair_first_then_every_nth_replay(monkeypatch):
    from cudagraph_lifecycle import checks

    proved = []
    real = checks.checked_replay
    monkeypatch.setattr(checks, "checked_replay", lambda g, s, b, bs, *a: proved.append((b, bs)) or real(g, s, b, bs, *a))
    r = runner(lambda x: x * 2, checked=["padding"], recheck_every=8)
    for _ in range(20):
        r.run(torch.ones(3, 8))
    r.run(torch.ones(2, 8))
    assert proved == [(3, 4), (3, 4), (3, 4), (2, 2)]  # replays 0, 8, 16 of batch 3; the first of batch 2
    every = runner(lambda x: x * 2, checked=["padding"], recheck_every=1)
    for _ in range(5):
        every.run(torch.ones(3, 8))
    assert len(proved) == 4 + 5
    r.release(), every.release()


def test_rows_the_replay_never_writes_are_caught():
    cache = torch.zeros(4, 8)

    def fwd(x):  # returns a cache the captured ops never write
        return cache[: x.shape[0]]

    with pytest.raises(ReplayCheckError, match=r"wrote nothing to rows \[0, 1, 2\]"):
        runner(fwd).run(torch.ones(3, 8))


def test_the_op_that_broke_a_capture_is_named_and_the_pool_left_clean():
    be = SimBackend()

    def fwd(x):
        if x.sum().item() > -1:  # a host sync: illegal while capturing
            return x * 2
        return x

    for checked in (True, False):
        r = runner(fwd, backend=be, checked=checked)
        y = r.run(torch.ones(3, 8))  # falls back to eager, with the reason
        assert torch.equal(y, torch.full((3, 8), 2.0)) and r.stats.fallbacks == {"capture_failed": 1}
        failure = r.stats.failures[0]
        assert "the op that broke the capture:" in failure and "test_checks.py" in failure and "in fwd" in failure
        if checked:
            assert "_local_scalar_dense" in failure
        del y
        report = r.release()
        assert report.clean and report.reserved_after == 0


def test_weights_moved_after_capture_are_named():
    lin = torch.nn.Linear(8, 8)
    r = runner(lambda x: lin(x), names=lin)
    with torch.no_grad():
        r.run(torch.ones(3, 8))
    assert r.check_addresses() == []
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 8))  # an in-place reload: the graph reads the new weights
    assert r.check_addresses() == []
    lin.weight.data = torch.randn(8, 8)  # a reload into new memory: the graph still reads the old
    with pytest.raises(CapturedAddressError) as e:
        r.check_addresses()
    assert "weight: captured at 0x" in str(e.value) and "now at 0x" in str(e.value) and "graph 4" in str(e.value)
    assert [p.split(":")[0] for p in r.check_addresses(raise_=False)] == ["weight"]
    r.release()


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_intermediates_a_copying_to_makes_are_born_not_reads_freed_since_the_capture(grad_off):
    """Under torch.inference_mode ``to``, ``reshape`` and ``linear`` reach the watch whole, and ``to`` and
    ``reshape`` say they return an alias though they copied: their intermediates were taken as storages read
    from outside, and check_addresses reported each as freed since the capture (a false failure in a
    correct engine, which the plugin's strict cycle reports). A weight reloaded into new memory is still
    named."""
    lin = torch.nn.Linear(8, 8)

    def step(x):
        h = x.to(torch.float64).reshape(-1, 2, 4).transpose(1, 2).reshape(-1, 8)  # copies, each said to alias
        return lin(h.to(torch.float32))

    with grad_off():
        r = runner(step, names=lin)
        y = r.run(torch.ones(3, 8))
        assert torch.allclose(y, lin(torch.ones(3, 8)), atol=1e-6)
    assert r.check_addresses() == []
    lin.weight.data = torch.randn(8, 8)
    assert [p.split(":")[0] for p in r.check_addresses(raise_=False)] == ["weight"]
    r.release()


def test_watch_largest_watches_the_largest_capture_of_each_key_only():
    """watch="largest": the shared weights are still known (every batch reads them), a tensor only a smaller
    batch's code path reads is not; watch="each" knows both."""
    lin = torch.nn.Linear(8, 8)
    names = {"weight": lin.weight, "small_bias": torch.ones(8)}

    def fwd(x):
        y = lin(x)
        return y + names["small_bias"] if x.shape[0] == 2 else y  # only batch 2 reads it

    moved = {}
    for watch in ("each", "largest"):
        names["small_bias"] = torch.ones(8)
        r = runner(fwd, names=names, watch=watch)
        with torch.no_grad():
            r.run(torch.ones(1, 8))
        assert r.check_addresses() == []
        names["small_bias"] = torch.zeros(8)  # reloads into new memory: the graphs still read the old
        old_weight, lin.weight.data = lin.weight.data, torch.randn(8, 8)
        moved[watch] = sorted(p.split(":")[0] for p in r.check_addresses(raise_=False))
        lin.weight.data = old_weight
        r.release()
    assert moved == {"each": ["small_bias", "weight"], "largest": ["weight"]}


def test_the_watches_of_one_capture_set_look_at_a_storage_once():
    """A weight every graph of a set reads is looked at (weak reference, address, size) by the first watch only;
    the set holds it meanwhile, so its key cannot come to name another storage."""
    w = torch.ones(8, 8)
    known: dict = {}
    watches = [checks.CaptureWatch(None, known) for _ in range(2)]
    for watch in watches:
        with watch:
            torch.ones(2, 8) @ w  # the left operand is born in the capture, the weight is read
    key = w.untyped_storage()._cdata
    assert list(watches[0].reads) == list(watches[1].reads) == [key]
    assert watches[0].reads[key] is watches[1].reads[key]
    assert watches[0].reads[key].op == "aten.mm" and watches[0].reads[key].address == w.data_ptr()
    assert known[key][1]._cdata == key


def _watched_work(weights: list, out: torch.Tensor, held: list) -> None:
    """Ops of every argument shape a watch walks: tensors, lists of them, a tensor in kwargs (out=), a view of a
    weight, tuples of outputs; every result is held, so no storage key is reused within one watch."""
    x = torch.ones(4, 8)
    held.append(x)
    for w in weights:
        held.append(x @ w.t())  # a view of the weight, then the weight's storage read through it
        x = torch.relu(held[-1])
        held.append(x)
    held.append(torch.cat([x, weights[0]]))
    held.extend(torch.chunk(x, 2))
    held.append(torch.add(x, weights[1][:4], out=out))
    held.append(x.max(dim=0))


def test_the_watch_records_reads_births_and_the_offender():
    """Which storage, which op first read it, address and size; the births; the offender, for an op that raised
    and for a backend whose capture turned invalid, on a set's first and later graph."""
    torch.manual_seed(0)
    weights, out = [torch.randn(8, 8) for _ in range(3)], torch.empty(4, 8)
    known: dict = {}
    held: list = []
    first, later = checks.CaptureWatch(None, known), checks.CaptureWatch(None, known)
    for watch in (first, later):
        with torch.no_grad(), watch:
            _watched_work(weights, out, held)
    reads = [[(k, r.op, r.address, r.nbytes) for k, r in w.reads.items()] for w in (first, later)]
    assert reads[0] and reads[0] == reads[1] and len(first.born) >= 10, reads
    raised = checks.CaptureWatch(None)
    with pytest.raises(RuntimeError, match="invalid for input"), raised:
        torch.ops.aten.view(torch.ones(8) + 1, [3, 7])
    turned = checks.CaptureWatch(iter([False, False, True, True]).__next__, {})  # invalid from the third op on
    with turned:
        x = torch.ones(2) + 1
        x = x * 2  # the third op
        x - 1
    assert raised.offender.startswith("aten.view at ") and "test_checks.py" in raised.offender
    assert turned.offender.startswith("aten.mul.Tensor at ") and turned.offender.endswith(
        "(the capture was invalid after it)")


def test_a_strict_sanitizer_turns_the_checks_on():
    assert not enabled()
    with PoolSanitizer("sim", mode="strict"):
        assert enabled() and CUDAGraphRunner(lambda x: x, [1], (2,), backend="sim").checked
    assert not enabled() and not CUDAGraphRunner(lambda x: x, [1], (2,), backend="sim").checked


def test_each_check_runs_alone():
    def mixes_rows(x):
        return x - x.mean(dim=0)

    only_outputs = runner(lambda x: x * 2, checked=["outputs"])
    first = only_outputs.run(torch.ones(3, 8))
    only_outputs.run(torch.ones(3, 8))
    with pytest.raises(OverwrittenOutputError):
        first.sum()
    assert only_outputs.checks == {"outputs"}
    with pytest.raises(ConfigError, match="needs checked=True or a checked list with 'capture'"):
        only_outputs.check_addresses()
    del first
    only_outputs.release()

    assert runner(mixes_rows, checked=["outputs", "capture"]).run(torch.randn(3, 8)).shape == (3, 8)  # no poison
    with pytest.raises(ReplayCheckError, match="depend on the padding"):
        runner(mixes_rows, checked=["padding"]).run(torch.randn(3, 8))

    w = torch.ones(8)
    only_capture = runner(lambda x: x * w, checked=["capture"], names={"w": w})
    out = only_capture.run(torch.ones(3, 8))
    only_capture.run(torch.ones(3, 8))
    assert torch.equal(out, torch.ones(3, 8))  # a plain view: the output guard is off
    w.data = torch.full((8,), 2.0)  # a new storage: the graph still reads the old one
    with pytest.raises(CapturedAddressError, match="w: captured at 0x"):
        only_capture.check_addresses()
    del out
    only_capture.release()


class _Counter:
    """An engine with state written in place each step, as a static KV cache's position counter is."""

    def __init__(self):
        self.steps = torch.zeros(1)

    def __call__(self, x):
        self.steps.add_(1)
        return x * self.steps


@pytest.mark.parametrize("kw", [{"checked": ["padding"]}, {"checked": True, "watch": "largest"}],
                         ids=["padding-alone", "watch-largest"])
def test_the_padding_checks_extra_replay_moves_no_state_without_the_op_watch(kw):
    """The padding check's poisoned replay writes the engine's state too; where the op watch does not watch a
    graph, a write-only watch at its capture still names that state, and the check puts it back."""
    plain, checked = _Counter(), _Counter()
    r0 = runner(plain, checked=False)
    r1 = runner(checked, **kw)
    for _ in range(4):
        x = torch.randn(1, 8)  # batch 1 runs in the graph of 2 (not the largest): the padding check replays it twice
        assert torch.equal(r1.run(x), r0.run(x))
    assert checked.steps.item() == plain.steps.item()
    r0.release(), r1.release()


class _SlicedCache:
    """A batch-major static cache and per-row lengths written through slices of them (``cache[:n]``,
    ``lengths[:n]``), one position a step, as hand-written decode steps do; ``returned`` hands the cache's
    slice back as an output too."""

    def __init__(self, returned: bool):
        self.cache, self.pos, self.returned = torch.zeros(4, 64), torch.zeros(1, dtype=torch.long), returned
        self.lengths = torch.zeros(4)

    def __call__(self, x):
        n = x.shape[0]
        self.cache[:n].index_copy_(1, self.pos, x.sum(1, keepdim=True))
        self.pos.add_(1)
        self.lengths[:n].add_(1)
        y = x * 2 + self.cache[:n].sum(1, keepdim=True) + self.lengths[:n, None]
        return (y, self.cache[:n]) if self.returned else y


@pytest.mark.parametrize("checked", [True, ["padding"]], ids=["all", "padding-alone"])
@pytest.mark.parametrize("returned", [False, True], ids=["state-only", "state-returned"])
def test_a_cache_written_through_a_view_and_returned_is_state_the_check_leaves_as_it_was(checked, returned):
    """The padding check's put-back finds state written through a view (a slice's storage is the cache's, not
    one born in the capture), and an output that is a view of that state gets no sentinel: filling the cache
    with NaN before the replay would erase every position the replay does not write."""
    plain, engine = _SlicedCache(returned), _SlicedCache(returned)
    r0, r1 = runner(plain, checked=False), runner(engine, checked=checked)
    for _ in range(4):
        x = torch.randn(3, 8)
        for a, b in zip(*(torch.utils._pytree.tree_leaves(r.run(x)) for r in (r1, r0))):
            assert torch.equal(a, b)
    assert torch.equal(engine.cache, plain.cache) and torch.equal(engine.pos, plain.pos)
    assert torch.equal(engine.lengths, plain.lengths)
    r0.release(), r1.release()


def test_a_view_of_state_handed_back_is_not_guarded_as_an_overwritten_output():
    """A cache view kept across steps changes as it would eagerly (the cache is written in place each step):
    only the graph's own output buffers raise once a later replay overwrote them."""
    engine = _SlicedCache(returned=True)
    r = runner(engine, checked=["outputs"])
    y1, cache1 = r.run(torch.randn(3, 8))
    r.run(torch.randn(3, 8))
    assert torch.equal(cache1 + 0, engine.cache[:3])  # used after the next step: the live cache, no error
    with pytest.raises(OverwrittenOutputError):
        y1.sum()
    del y1, cache1
    r.release()
