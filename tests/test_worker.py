"""The reused worker: state, start methods, closing, Ctrl-C. One row per fault (crashes, hangs, bad
values) is in tests/test_faults_worker.py."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_faults_worker import gone, nap

import pytest_cudagraph.worker as worker_module
import pytest_cudagraph.worker.process as process_module
import pytest_cudagraph.worker.protocol as protocol_module
from pytest_cudagraph.worker import (
    RemoteError,
    ReusedWorker,
    WorkerCrashed,
    WorkerTimeout,
    crash_frames,
    resolve_start_method,
)

STATE = {"n": 0}


def bump():
    STATE["n"] += 1
    return STATE["n"], os.getpid()


def boom():
    raise KeyError("missing thing")


def fake_allocator_assert():
    raise RuntimeError('it->second->use_count > 0 INTERNAL ASSERT FAILED at "CUDACachingAllocator.cpp"')


def capture_on_the_default_stream(sanitize):
    from cudagraph_lifecycle import PoolSanitizer, get_backend

    be = get_backend("sim")
    if sanitize:
        PoolSanitizer(be).start()  # for the rest of this child's life
    be.new_graph().capture_begin()


def swallow_a_default_stream_capture():
    from cudagraph_lifecycle import get_backend, observe

    observe.acquire()  # watched (as in a worker that ran an engine cycle), not judged
    try:
        get_backend("sim").new_graph().capture_begin()
    except RuntimeError:
        pass  # an engine that runs eagerly when its capture fails
    return os.getpid()


def sim_random():
    from cudagraph_lifecycle import get_backend

    return get_backend("sim").randn(2).numel(), os.getpid()


@pytest.fixture
def worker():
    w = ReusedWorker(start_method="fork", timeout=30)
    yield w
    w.close()


def test_state_persists_across_calls(worker):
    a, pid1 = worker.call(bump)
    b, pid2 = worker.call(bump)
    assert (a, b) == (1, 2) and pid1 == pid2 != os.getpid()


class _Cyclic:
    def __init__(self):
        self.me = self  # only a collection frees it, like an engine whose runner holds a bound method


def make_cycle():
    import gc
    import weakref

    global _kept, _ref
    _kept = _Cyclic()
    _ref = weakref.ref(_kept)
    return gc.get_freeze_count()


def drop_cycle():
    import gc

    global _kept
    _kept = None
    gc.collect()
    return _ref() is None


def test_the_startup_heap_is_frozen_and_what_calls_make_is_still_collected(worker):
    # Frozen before the first call: full collections between engines skip the modules' objects...
    assert worker.call(make_cycle) > 0
    # ...but a cycle a call made (an engine a test kept across calls) is still collected once dropped
    assert worker.call(drop_cycle)


def test_remote_exception_carries_the_child_traceback(worker):
    with pytest.raises(RemoteError, match="missing thing") as e:
        worker.call(boom)
    assert e.value.type_name == "KeyError" and "def boom" not in e.value.remote_traceback
    assert "in boom" in e.value.remote_traceback
    # the user's frames only (not the worker's loop), and the message once, in the error's first line
    assert "_child_main" not in e.value.remote_traceback, e.value.remote_traceback
    assert not e.value.remote_traceback.rstrip().endswith("missing thing'")
    assert worker.call(bump)[0] == 1  # the same worker goes on


def test_allocator_assert_marks_the_worker_for_replacement(worker):
    pid = worker.start().pid
    with pytest.raises(RemoteError) as e:
        worker.call(fake_allocator_assert)
    assert e.value.poisons_process
    assert worker.call(bump)[1] != pid


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_capture_on_the_default_stream_replaces_the_worker_unless_the_sanitizer_refused_it(worker, sanitize):
    pid = worker.start().pid
    with pytest.raises(RemoteError, match="must be captured on a non-default stream") as e:
        worker.call(capture_on_the_default_stream, sanitize)
    assert e.value.poisons_process is not sanitize
    assert e.value.type_name == ("DefaultStreamCaptureError" if sanitize else "RuntimeError")
    assert worker.call(sim_random) == (2, pid) if sanitize else worker.call(sim_random)[1] != pid


def test_a_call_that_swallowed_torchs_default_stream_refusal_still_replaces_the_worker(worker):
    pid = worker.call(swallow_a_default_stream_capture)  # returned normally: the ledger saw the refusal
    assert worker.call(sim_random) == (2, worker.pid) and worker.pid != pid


def test_an_ask_that_times_out_replaces_the_child_before_any_later_call():
    """A reply that comes after its ask gave up must not answer the next call."""
    with ReusedWorker(env={"CUDAGRAPH_SANITIZE": "on", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}) as w:
        first = w.call(os.getpid)
        t0 = time.monotonic()
        assert w.ask(time.sleep, 3, wait=0.5) == (False, None)
        assert not w.alive and w.restarts == 1
        assert w.ask(os.getpid) == (False, None)  # no child to ask: none is started for a report
        assert w.call(os.getpid) not in (None, first) and w.call(len, "abc") == 3
        assert time.monotonic() - t0 < 30  # the late reply was not waited for


def test_a_workers_findings_are_returned_once():
    import test_findings

    env = {"CUDAGRAPH_SANITIZE": "on", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}
    with ReusedWorker(env=env) as w:
        assert w.findings() == []  # no child yet: none is started to be asked
        w.call(exec, test_findings.SESSION_TESTS + "\npin_a_pool()\n", {"__name__": "user"})
        (f,) = w.findings()
        assert f["kind"] == "pinned_pool" and f["worker"] and f["pid"] == w.pid
        assert w.findings() == []  # asked again: already returned


def refuse_and_swallow(test):
    from cudagraph_lifecycle import get_backend
    from cudagraph_lifecycle.ledger import ledger

    ledger.test = test
    try:
        get_backend("sim").new_graph().capture_begin()
    except RuntimeError:
        pass  # refused by the worker's sanitizer, caught by the "engine"
    finally:
        ledger.test = None


def test_refused_default_stream_captures_of_two_tests_are_two_findings():
    """Not about a pool (each says (0, 0)): two tests' refusals must not read as one finding."""
    env = {"CUDAGRAPH_SANITIZE": "on", "CUDAGRAPH_SANITIZE_BACKEND": "sim"}
    with ReusedWorker(env=env) as w:
        w.call(refuse_and_swallow, "t.py::a")
        assert [f["tests"] for f in w.findings()] == [["t.py::a"]]
        w.call(refuse_and_swallow, "t.py::b")
        assert [(f["kind"], f["tests"]) for f in w.findings()] == [("default_stream_capture", ["t.py::b"])]


def test_closures_and_lambdas_travel_with_spawn():
    factor = 3
    with ReusedWorker(start_method="spawn", timeout=60) as w:
        assert w.call(lambda x: x * factor, 5) == 15
        assert w.start_method == "spawn"


def _in_main(fn, name):
    """``fn`` as a function a script defines (``__main__``), like a benchmark's own."""
    fn.__module__ = "__main__"
    fn.__qualname__ = fn.__name__ = name
    setattr(sys.modules["__main__"], name, fn)
    return fn


def _returning(value):
    return lambda: value


def _applying():
    return lambda f: f()


def test_a_function_of_main_travels_by_reference_only_to_a_child_that_has_it(monkeypatch):
    main = sys.modules["__main__"]
    for name in ("cudagraph_probe", "cudagraph_apply", "cudagraph_late"):
        monkeypatch.setattr(main, name, None, raising=False)  # removed again at the end
    probe = _in_main(_returning("at the fork"), "cudagraph_probe")
    apply = _in_main(_applying(), "cudagraph_apply")
    with ReusedWorker(start_method="auto", timeout=60) as w:
        assert w.start().start_method == "fork"
        assert b"cloudpickle" not in worker_module.dumps_call(probe, (), {}, w._forked_main)  # by reference
        assert w.call(probe) == "at the fork"
        # bound again after the fork: the child has the old object, so the new one travels by value
        assert w.call(_in_main(_returning("rebound"), "cudagraph_probe")) == "rebound"
        # the child has ``apply`` but not what it is given: the whole call travels by value
        assert w.call(apply, _in_main(_returning("late"), "cudagraph_late")) == "late"
        # a child started after the parent initialized CUDA is spawned: nothing of __main__ goes by reference
        monkeypatch.setattr(process_module, "cuda_initialized", lambda: True)
        w.restart_before_next_call()
        assert w.call(apply, os.getpid) == w.pid and w.start_method == "spawn"


def echo(x):
    return x


def test_messages_of_every_size_travel_intact(worker):
    # around the size where header and payload stop going in one write, and past the pipe's buffer
    for n in [0, 1, *range(16300, 16420, 9), 100_000, 3_000_000]:
        data = os.urandom(n)
        assert worker.call(echo, data) == data


def test_the_pipe_keeps_connections_framing():
    import multiprocessing.connection
    import socket
    import struct

    a, b = socket.socketpair()
    ours = protocol_module._Reader(b.fileno())
    theirs = multiprocessing.connection.Connection(os.dup(a.fileno()))
    try:
        # several messages in one write, the long form of the size header (Connection's for > 2 GiB)
        a.sendall(b"\0\0\0\3abc" + b"\xff\xff\xff\xff" + (2).to_bytes(8, "big") + b"de" + b"\0\0\0\0")
        assert [ours.recv(), ours.recv(), ours.recv()] == [b"abc", b"de", b""]
        big = os.urandom(1_000_000)  # larger than the socket's buffer: written while read
        sender = threading.Thread(target=theirs.send_bytes, args=(big,))
        sender.start()
        assert ours.recv() == big
        sender.join()
        for n in (5, 20_000):
            protocol_module._send_message(b.fileno(), b"x" * n)
            assert theirs.recv_bytes() == b"x" * n
        # a read that times out keeps what had come: the next recv() goes on from there
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
        for n in (100, 100_000):
            data = os.urandom(n)
            message = len(data).to_bytes(4, "big") + data
            a.sendall(message[:60])
            with pytest.raises(BlockingIOError):
                ours.recv()
            a.sendall(message[60:])
            assert ours.recv() == data
        theirs.close()
        a.close()
        with pytest.raises(EOFError):
            ours.recv()
    finally:
        a.close()
        b.close()


def die_leaving_a_forked_grandchild():
    if os.fork() == 0:  # holds the worker's end of the pipe, as a fork without exec does: no EOF
        time.sleep(30)
        os._exit(0)
    os._exit(3)


def test_a_child_dead_while_its_pipe_is_held_elsewhere_is_reported(worker):
    t0 = time.monotonic()
    with pytest.raises(WorkerCrashed, match="exited with code 3"):
        worker.call(die_leaving_a_forked_grandchild)
    assert time.monotonic() - t0 < 5


def test_signals_handled_during_a_call_do_not_disturb_it(worker):
    handled = []
    old = signal.signal(signal.SIGALRM, lambda *_: handled.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    try:
        assert worker.call(nap, 0.7) is None and worker.call(echo, b"x" * 100_000) == b"x" * 100_000
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(handled) > 5


def test_close_leaves_no_process():
    w = ReusedWorker(start_method="fork")
    pid = w.start().pid
    w.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_worker_dropped_without_close_ends_its_child_at_once():
    import gc

    w = ReusedWorker(start_method="fork")
    made = sys._getframe().f_lineno - 1
    pid = w.call(os.getpid)
    with pytest.warns(ResourceWarning, match="dropped without close") as caught:
        del w
        gc.collect()
    assert gone(pid)
    # the warning points at the line that made the worker, not at our finalizer
    (warning,) = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert (warning.filename, warning.lineno) == (__file__, made), (warning.filename, warning.lineno)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the finalizer's raised warning
def test_a_dropped_worker_ends_its_child_even_when_warnings_are_errors():
    import gc
    import warnings

    w = ReusedWorker(start_method="fork")
    pid = w.call(os.getpid)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del w
        gc.collect()  # the warning raises inside the finalizer (reported as ignored), after the child is ended
    assert gone(pid)


def _collect_garbage():
    import gc

    gc.collect()


def test_a_forked_process_collecting_an_inherited_worker_leaves_the_parents_child_alone():
    import gc
    import multiprocessing as mp

    class Holder:
        pass

    w = ReusedWorker(start_method="fork")
    pid = w.call(os.getpid)
    gc.disable()  # the worker becomes garbage in a cycle, collected first by the forked process
    try:
        h = Holder()
        h.me, h.w = h, w
        del w, h
        p = mp.get_context("fork").Process(target=_collect_garbage)
        p.start()
        p.join(30)
        assert p.exitcode == 0 and not gone(pid, 0.5), "the forked process ended the parent's worker child"
    finally:
        gc.enable()
        with pytest.warns(ResourceWarning):
            gc.collect()
    assert gone(pid)


def _fork_daemon() -> int:
    pid = os.fork()
    if pid == 0:  # a daemon without an exec: its own session, and no tag in its /proc environ
        os.setsid()
        time.sleep(60)
        os._exit(0)
    return pid


@pytest.mark.parametrize("end", ["close", "timeout"])
def test_a_daemon_forked_without_exec_is_ended_with_the_worker(end):
    w = ReusedWorker(start_method="fork", timeout=30 if end == "close" else 2)
    try:
        daemon = w.call(_fork_daemon)
        if end == "timeout":
            with pytest.raises(WorkerTimeout):
                w.call(time.sleep, 30)
            assert gone(daemon), "the daemon outlived the worker killed for its timeout"
    finally:
        w.close()
    assert gone(daemon), "the daemon outlived close()"


def test_start_method_rules(monkeypatch):
    assert resolve_start_method("auto")[0] == "fork"
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    method, why = resolve_start_method("auto")
    assert method == "spawn" and "initialized CUDA" in why
    with pytest.raises(ValueError, match="Cannot re-initialize CUDA in forked subprocess"):
        resolve_start_method("fork")
    with pytest.raises(ValueError, match="unknown start method"):
        resolve_start_method("thread")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_start_method_serves_calls(method):
    with ReusedWorker(start_method=method, timeout=60) as w:
        assert w.call(bump) == (1, w.pid) and w.call(bump)[0] == 2 and w.start_method == method


def test_a_restart_after_the_parent_initialized_cuda_spawns(monkeypatch):
    with ReusedWorker(timeout=60) as w:
        assert w.start_method == "fork"
        w.call(bump)
        monkeypatch.setattr(process_module, "cuda_initialized", lambda: True)  # as if a test used the GPU here
        w.restart_before_next_call()
        assert w.call(bump)[0] == 1  # a new child
        assert w.start_method == "spawn" and "initialized CUDA" in w.reason


def test_fork_asked_for_is_refused_at_a_restart_after_cuda_init(monkeypatch):
    with ReusedWorker(start_method="fork", timeout=60, name="engines") as w:
        w.call(bump)
        monkeypatch.setattr(process_module, "cuda_initialized", lambda: True)
        w.restart_before_next_call()
        refused = ("worker engines cannot start: start method 'fork' was asked for, but this process already "
                   "initialized CUDA.*Use 'spawn' or 'auto'")
        with pytest.raises(ValueError, match=refused):
            w.call(bump)
        assert w.pid is None  # nothing was forked


def test_a_failed_start_leaves_a_worker_that_closes_and_starts_again(monkeypatch):
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    w = ReusedWorker(start_method="fork", timeout=60)
    with monkeypatch.context() as m:
        m.setattr(os, "fork", no_fork)
        with pytest.raises(BlockingIOError):
            w.call(bump)
    w.close()
    assert w.call(bump)[0] == 1
    w.close()


def test_close_does_not_wait_for_a_call_in_another_thread():
    w = ReusedWorker(start_method="fork", timeout=60)
    pid = w.start().pid
    errors = []

    def call():
        try:
            w.call(nap, 30)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)  # the call is running
    t0 = time.monotonic()
    w.close()
    took = time.monotonic() - t0
    t.join(10)
    assert took < 5 and not t.is_alive(), f"close() waited {took:.1f}s for the call"
    assert isinstance(errors[0], WorkerCrashed) and gone(pid)


def test_crash_frames_are_the_crashing_threads_innermost():
    frames = "".join(f'  File "/w/engine.py", line {i} in f{i}\n' for i in range(12))
    stderr = (
        "Current thread 0x01 (most recent call first):\n"  # an earlier dump (a timeout's SIGUSR1)
        '  File "/w/old.py", line 1 in earlier\n'
        "Fatal Python error: Segmentation fault\n\n"
        "Thread 0x02 (most recent call first):\n"  # another thread prints first
        '  File "/w/loader.py", line 5 in other_thread\n\n'
        f"Current thread 0x01 (most recent call first):\n{frames}\n"
        "Extension modules: torch (total: 1)\n"
    )
    assert crash_frames(stderr) == [f"  /w/engine.py:{i} in f{i}" for i in range(10)]
    assert crash_frames(stderr.replace("Fatal Python error", "Python error")) == []  # no crash, no frames


def _survivors(marker: str) -> list[int]:
    """Running processes whose command line holds ``marker`` (a forked worker keeps pytest's command line)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read() and not gone(int(entry), within=0):
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def test_no_grandchild_outlives_the_session(pytester):
    pytester.makepyfile(test_a='''
        import subprocess
        def start_sleeper():
            return subprocess.Popen(["sleep", "60"]).pid
        def test_sleeper(cudagraph_worker):
            open("sleeper.pid", "w").write(str(cudagraph_worker.call(start_sleeper)))
    ''')
    pytester.runpytest_subprocess("-p", "cudagraph", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    pid = int((pytester.path / "sleeper.pid").read_text())
    assert gone(pid), f"`sleep 60` (pid {pid}), started in the test's worker, outlived the session"


CTRL_C_SESSION = '''
import os, time, pytest

@pytest.fixture
def engine(cudagraph_worker):
    yield cudagraph_worker
    cudagraph_worker.call(os.getpid)  # teardown talks to the worker, as an engine fixture's release does

def test_interrupted(engine):
    open("worker.pid", "w").write(str(engine.call(os.getpid)))
    engine.call(time.sleep, 60)
'''


def test_ctrl_c_during_a_worker_call_ends_the_session(pytester):
    test_file = pytester.makepyfile(test_a=CTRL_C_SESSION)
    pidfile = pytester.path / "worker.pid"
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "cudagraph", "-p", "no:cacheprovider",
                                str(test_file)], cwd=pytester.path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the worker is in time.sleep(60)
        os.killpg(session.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground process group
        out, _ = session.communicate(timeout=15)  # also waits for every holder of its output to close it
    except subprocess.TimeoutExpired:
        os.killpg(session.pid, signal.SIGKILL)
        out, _ = session.communicate()
        pytest.fail(f"the session did not end within 15 s of Ctrl-C:\n{out}")
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in out, out
    assert gone(int(pidfile.read_text())), "the worker outlived the session"
    assert not _survivors(str(test_file)), "a worker started by the session outlived it"


SLOW_START = '''
import os, signal, sys, time
time.sleep(float(os.environ.get("SLOW_START", "0")))  # the spawned child runs this too: a slow start
if __name__ == "__main__":
    from pytest_cudagraph.worker import ReusedWorker
    signal.signal(signal.SIGINT, lambda *_: print("pytest got SIGINT", flush=True))
    os.environ["SLOW_START"] = "2"
    with ReusedWorker(start_method="spawn", timeout=60) as w:
        print("started", flush=True)
        print("served", w.call(os.getpid) == w.pid, flush=True)
'''


def test_ctrl_c_while_a_worker_starts_is_not_the_workers(tmp_path):
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "started\n"
        time.sleep(0.5)  # the child is still starting, in the parent's process group
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "pytest got SIGINT" in out and "served True" in out, out


def test_bad_timeout():
    with pytest.raises(ValueError, match="timeout"):
        ReusedWorker(timeout=0)


def big_cpu_op():
    import torch

    return float((torch.ones(512, 512) * 2).sum())


def test_fork_after_parallel_cpu_ops_does_not_hang():
    import torch

    torch.set_num_threads(2)
    (torch.ones(1024, 1024) * 3).sum()  # the parent's OpenMP pool is now up
    with ReusedWorker(start_method="fork", timeout=30) as w:
        assert w.call(big_cpu_op) == 512 * 512 * 2


def abort_after_long_stack():
    import sys

    print("terminate called after throwing an instance of 'c10::Error'", file=sys.stderr)
    print("  what():  captures_underway.empty() INTERNAL ASSERT FAILED", file=sys.stderr)
    for i in range(60):
        print(f"  frame {i}", file=sys.stderr)
    sys.stderr.flush()
    os.abort()


def test_crash_report_keeps_the_cause_above_a_long_stack(worker):
    with pytest.raises(WorkerCrashed) as e:
        worker.call(abort_after_long_stack)
    msg = str(e.value)
    assert "cause lines" in msg and "what():  captures_underway.empty() INTERNAL ASSERT FAILED" in msg


def test_a_shown_traceback_keeps_our_frames_only_where_the_error_is_ours():
    """Our frames are left out of a user's error, but kept for an error our own code raised that is none of
    the errors it means to raise (a bug of ours: where it happened matters)."""
    from cudagraph_lifecycle.choices import checked_from_env
    from cudagraph_lifecycle.errors import ConfigError
    from cudagraph_lifecycle.ledger import shown_traceback
    from cudagraph_lifecycle.sizes import parse_size

    with pytest.raises(ConfigError) as e:
        checked_from_env({"CUDAGRAPH_CHECKED": "maybe"})
    shown = shown_traceback(e.value)
    assert "test_worker.py" in shown and "choices.py" not in shown, shown
    with pytest.raises(ValueError) as e:
        parse_size("lots")
    shown = shown_traceback(e.value)
    assert "in parse_size" in shown and "sizes.py" in shown, shown


def test_forking_a_process_with_threads_is_warned_once_with_what_to_do(monkeypatch):
    """Python 3.12 warns at every fork of a process running threads: the session gets one warning that names
    the option that avoids the fork; any other warning raised by the start passes on unchanged."""
    import warnings

    monkeypatch.setattr(process_module, "_THREADS_WARNED", False)
    fork_warning = "This process (pid=1) is multi-threaded, use of fork() may lead to deadlocks in the child."
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        warnings.warn(fork_warning, DeprecationWarning, stacklevel=1)
        warnings.warn("another", UserWarning, stacklevel=1)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        process_module._warn_forked_with_threads(said)
        process_module._warn_forked_with_threads(said[:1])  # a second fork: nothing more
    texts = [(w.category, str(w.message)) for w in shown]
    assert texts[1] == (UserWarning, "another") and len(texts) == 2, texts
    assert texts[0][0] is RuntimeWarning and "--cudagraph-start-method=spawn" in texts[0][1], texts
    assert "Python's: MainThread" in texts[0][1], texts
    monkeypatch.setattr(process_module, "_THREADS_WARNED", False)
    with warnings.catch_warnings():  # warnings made errors (filterwarnings = error): nothing escapes
        warnings.simplefilter("error")
        process_module._warn_forked_with_threads(said)
