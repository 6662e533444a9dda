import os
import signal
import threading

import pytest

from pytest_cudagraph.worker import (
    RemoteError,
    ReusedWorker,
    UnpicklableCallableError,
    WorkerCrashed,
    WorkerTimeout,
    resolve_start_method,
)

STATE = {"n": 0}


def bump():
    STATE["n"] += 1
    return STATE["n"], os.getpid()


def boom():
    raise KeyError("missing thing")


def die_by_signal():
    os.kill(os.getpid(), signal.SIGSEGV)


def exit_hard():
    import sys

    print("about to exit", file=sys.stderr, flush=True)
    os._exit(7)


def sleep(s):
    import time

    time.sleep(s)


def fake_allocator_assert():
    raise RuntimeError('it->second->use_count > 0 INTERNAL ASSERT FAILED at "CUDACachingAllocator.cpp"')


@pytest.fixture
def worker():
    w = ReusedWorker(start_method="fork", timeout=30)
    yield w
    w.close()


def test_state_persists_across_calls(worker):
    a, pid1 = worker.call(bump)
    b, pid2 = worker.call(bump)
    assert (a, b) == (1, 2) and pid1 == pid2 != os.getpid()


def test_remote_exception_carries_the_child_traceback(worker):
    with pytest.raises(RemoteError, match="missing thing") as e:
        worker.call(boom)
    assert e.value.type_name == "KeyError" and "def boom" not in e.value.remote_traceback
    assert "in boom" in e.value.remote_traceback
    assert worker.call(bump)[0] == 1  # the same worker goes on


def test_signal_crash_is_reported_and_worker_replaced(worker):
    worker.call(bump)
    with pytest.raises(WorkerCrashed, match="killed by signal SIGSEGV"):
        worker.call(die_by_signal)
    n, _ = worker.call(bump)
    assert n == 1 and worker.restarts == 1  # a new process, fresh state


def test_exit_code_and_stderr_tail(worker):
    with pytest.raises(WorkerCrashed, match="exited with code 7") as e:
        worker.call(exit_hard)
    assert "about to exit" in str(e.value)


def test_abort(worker):
    with pytest.raises(WorkerCrashed, match="SIGABRT"):
        worker.call(os.abort)


def test_timeout_kills_the_process_group(worker):
    worker.timeout = 1
    pid = worker.start().pid
    with pytest.raises(WorkerTimeout, match="past the timeout of 1s"):
        worker.call(sleep, 30)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    worker.timeout = 30
    assert worker.call(bump)[0] == 1


def test_allocator_assert_marks_the_worker_for_replacement(worker):
    pid = worker.start().pid
    with pytest.raises(RemoteError) as e:
        worker.call(fake_allocator_assert)
    assert e.value.poisons_process
    assert worker.call(bump)[1] != pid


def test_closures_and_lambdas_travel_with_spawn():
    factor = 3
    with ReusedWorker(start_method="spawn", timeout=60) as w:
        assert w.call(lambda x: x * factor, 5) == 15
        assert w.start_method == "spawn"


def test_unpicklable_callable_is_a_clear_error(worker):
    lock = threading.Lock()
    with pytest.raises(UnpicklableCallableError, match="closure over an object that cannot be pickled"):
        worker.call(lambda: lock)


def test_unpicklable_result(worker):
    with pytest.raises(RemoteError, match="cannot be pickled"):
        worker.call(threading.Lock)


def test_close_leaves_no_process():
    w = ReusedWorker(start_method="fork")
    pid = w.start().pid
    w.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


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


def test_timeout_report_has_the_hung_stack():
    with ReusedWorker(start_method="fork", timeout=1) as w:
        with pytest.raises(WorkerTimeout, match="in sleep"):
            w.call(sleep, 30)


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
