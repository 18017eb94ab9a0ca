"""Failures on CUDA: a failed op (out of memory included) fails its dependents only and frees what
it made; a sticky CUDA error marks the device lost, and nothing hangs. Marked ``cuda``: skipped
without a GPU."""

import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda


def test_exception_fails_only_dependents_on_cuda():
    a = torch.zeros(8, device="cuda")
    b = torch.zeros(8, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        fa = rt.submit(lambda: 1 / 0, writes=[a], name="bad")
        fd = rt.submit(torch.add, a, 1, reads=[a])
        fi = rt.submit(b.add_, 1, writes=[b])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        assert isinstance(fa.exception(), ZeroDivisionError)
        assert isinstance(fd.exception(), sd.DependencyFailed)
        assert torch.equal(fi.result(), torch.ones(8, device="cuda"))


def test_an_unnamed_op_that_fails_is_named_after_its_function_in_its_dependents_error():
    a = torch.zeros(8, device="cuda")

    def broken():
        raise ValueError("broken on purpose")

    with sd.Runtime("cuda", streams=2) as rt:
        fa = rt.submit(broken, writes=[a])
        fd = rt.submit(torch.add, a, 1, reads=[a])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        err = fd.exception()
        assert isinstance(err, sd.DependencyFailed)
        assert fa.op_name.startswith("broken#") and repr(fa.op_name) in str(err)
        assert fd.op_name.startswith("add#") and fd.op_name != fa.op_name


def test_out_of_memory_fails_only_that_op_and_its_dependents():
    a = torch.zeros(8, device="cuda")
    b = torch.zeros(8, device="cuda")
    too_big = torch.cuda.get_device_properties(0).total_memory * 4  # bytes no GPU has

    def allocate_too_much(out):
        out.add_(torch.empty(too_big // 4, device="cuda").sum())

    with sd.Runtime("cuda", streams=2) as rt:
        oom = rt.submit(allocate_too_much, a, writes=[a], name="oom")
        dependent = rt.submit(torch.add, a, 1, reads=[a])
        independent = rt.submit(b.add_, 1, writes=[b])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        assert isinstance(oom.exception(), torch.cuda.OutOfMemoryError)
        assert isinstance(dependent.exception(), sd.DependencyFailed)
        assert torch.equal(independent.result(), torch.ones(8, device="cuda"))
        # not a lost device: later ops on the same buffers run
        later = rt.submit(torch.add, a, 2, reads=[a])
        assert torch.equal(later.result(), torch.full((8,), 2.0, device="cuda"))


def test_an_op_that_runs_out_of_memory_frees_what_it_had_made_while_its_future_is_held(path):
    """The usual OOM: a function makes one large buffer, then fails to make the next. Its error is
    kept as long as its future (or a dependent's) is referenced; the buffer it made must be freed, or
    the memory stays taken and the user's retry with a smaller batch runs out too."""
    a = torch.zeros(8, device="cuda")
    big = 256 << 20
    too_big = torch.cuda.get_device_properties(0).total_memory * 4

    def make_then_fail(out):
        scratch = torch.empty(big // 4, device="cuda")
        out.add_(scratch[:8] * 0 + torch.empty(too_big // 4, device="cuda").sum())

    rt = sd.Runtime("cuda", streams=2)  # on ``path``: the compiled hot path, or its Python reference
    with pytest.raises(sd.ExceptionGroup), rt:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        failed = rt.submit(make_then_fail, a, writes=[a])
        dependent = rt.submit(torch.add, a, 1, reads=[a])
        assert isinstance(failed.exception(), torch.cuda.OutOfMemoryError)
        assert isinstance(dependent.exception(), sd.DependencyFailed)
        assert torch.cuda.memory_allocated() - before < big, "the failed op's frames hold its buffer"


DEVICE_LOST = textwrap.dedent(
    """
    import torch, streamdag as sd
    a = torch.zeros(4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        bad = rt.submit(lambda: a[torch.tensor([10], device="cuda")].sum().item(), reads=[a])
        print("bad:", type(bad.exception(timeout=60)).__name__)
        later = rt.submit(torch.add, a, 1, reads=[a])
        print("later:", type(later.exception(timeout=60)).__name__)
        try:
            rt.synchronize()
        except sd.ExceptionGroup as group:
            print("group:", sorted({type(e).__name__ for e in group.exceptions}))
    print("finished", flush=True)
    import os
    os._exit(0)  # a process whose CUDA context is broken may not exit cleanly
    """
)


DEVICE_LOST_WHILE_WAITING = textwrap.dedent(
    """
    import os, torch, streamdag as sd
    a = torch.zeros(4, device="cuda")
    index = torch.tensor([10], device="cuda")
    rt = sd.Runtime("cuda", streams=2)
    # the op returns at once; its kernel asserts on the device later, while the caller waits on it
    bad = rt.submit(lambda: a[index].sum(), reads=[a, index])
    print("bad:", type(bad.exception(timeout=60)).__name__)
    later = rt.submit(torch.add, a, 1, reads=[a])
    print("later:", type(later.exception(timeout=60)).__name__)
    print("finished", flush=True)
    os._exit(0)  # a process whose CUDA context is broken may not exit cleanly
    """
)


def test_a_sticky_error_seen_by_a_waiter_marks_the_device_lost():
    """The thread waiting on an op sees its event fail (in the torch extension's spin wait, or a
    query): the op and every later one fail with DeviceLost, and nothing hangs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", DEVICE_LOST_WHILE_WAITING], env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout
    assert "finished" in out, proc.stdout + proc.stderr[-3000:]
    assert "bad: DeviceLost" in out and "later: DeviceLost" in out, out


def test_a_cuda_error_that_is_not_sticky_fails_its_op_only():
    """A CUDA error that leaves the context usable (here an invalid device ordinal) fails its op
    and its dependents, as a Python exception does; it does not mark the device lost. PyTorch's
    advice after every CUDA error mentions "device-side assertions", which made every CUDA error
    count as sticky."""
    bad_index = torch.cuda.device_count() + 3
    x = torch.ones(4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        bad = rt.submit(torch.cuda.set_device, bad_index)
        error = bad.exception(timeout=60)
        assert error is not None and not isinstance(error, sd.DeviceLost), error
        assert "device-side assert" in str(error)  # the advice that must not count
        assert rt.backend.lost is None
        assert torch.equal(rt.submit(torch.add, x, 1, reads=[x]).result(), x + 1)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()  # which reports the failed op


def test_sticky_error_marks_the_device_lost_and_nothing_hangs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", DEVICE_LOST], env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout
    assert "finished" in out, proc.stdout + proc.stderr[-3000:]
    assert "later: DeviceLost" in out


def test_a_done_callback_raising_system_exit_leaves_the_completion_thread_working(caplog):
    """The completion thread runs done-callbacks; one that raises what is no ``Exception`` must
    not end it, or every later op of the device that nobody helps finish would never finish."""
    a = torch.zeros(8, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        called = threading.Event()

        def exits(_f):
            called.set()
            raise SystemExit(4)

        # a host op holds ``a`` until the callback is added: added to a finished future, the
        # callback would run here, in the test's thread, not on the completion thread
        gate = threading.Event()
        try:
            rt.submit(gate.wait, 10, writes=[a], run_on="host")
            first = rt.submit(lambda: (torch.cuda._sleep(20_000_000), a.add_(1)), writes=[a])
            first.add_done_callback(exits)
            assert not first.done()
        finally:
            gate.set()
        assert called.wait(10)
        slow = rt.submit(lambda: (torch.cuda._sleep(50_000_000), a.add_(1)), writes=[a])
        done, _ = concurrent.futures.wait([slow], timeout=10)  # only the completion thread finishes it
        assert slow in done and slow.exception() is None
    assert a.tolist() == [2.0] * 8
    assert any(r.exc_info and r.exc_info[0] is SystemExit for r in caplog.records)
