"""A failed op fails the ops that depend on it (naming its root) and spares the others, keeps nothing
alive that its function made, and leaves the runtime's threads working, whatever user code raises."""

import gc
import traceback
import weakref

import numpy as np
import pytest

import streamdag as sd
from programs import DEVICES
from streamdag.backends.inline import InlineBackend

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def runtime_on(device: str) -> sd.Runtime:
    """A runtime on ``device``; ``"inline"``: a backend that runs each op inside its submit, as CUDA."""
    return sd.Runtime(backend=InlineBackend()) if device == "inline" else sd.Runtime(device, streams=2)


def test_failure_fails_dependents_names_the_root_and_spares_independent_ops(rt):
    a, b, c = np.zeros(4), np.zeros(4), np.zeros(4)

    def boom():
        raise ValueError("bad input")

    fa = rt.submit(boom, writes=[a], name="producer")
    fb = rt.submit(np.add, a, 1, out=b, reads=[a], writes=[b], name="consumer")
    fc = rt.submit(np.add, b, 1, out=b, writes=[b], name="grandchild")
    fi = rt.submit(np.add, c, 1, out=c, writes=[c], name="independent")
    with pytest.raises(sd.ExceptionGroup) as info:
        rt.synchronize()
    assert [type(e) for e in info.value.exceptions] == [ValueError]
    assert isinstance(fa.exception(), ValueError)
    for f in (fb, fc):
        err = f.exception()
        assert isinstance(err, sd.DependencyFailed)
        assert err.root_name == "producer" and isinstance(err.__cause__, ValueError)
        assert "producer" in str(err)
    assert fi.result() is c
    # the runtime stays usable, and the failed buffer is clean again
    assert rt.submit(np.sum, a, reads=[a]).result() == 0.0
    rt.synchronize()


@pytest.mark.parametrize("device", [*DEVICES, "inline"])
def test_a_failed_op_keeps_no_local_of_its_function_alive(device):
    """A failed op's error is kept while its future, or a dependent's, is referenced: what its
    function made before it raised (a large buffer, say), and the variables of the code that
    submitted it (through the frames' callers), must not live on in the traceback's frames."""

    class Scratch:
        pass

    made = []
    a = np.zeros(4)

    def look_up():
        scratch = Scratch()
        made.append(weakref.ref(scratch))
        raise LookupError("no such row")

    def fails():
        try:
            look_up()
        except LookupError as cause:
            raise ValueError("too big") from cause

    def submit_from_a_function():
        submitters_buffer = Scratch()
        made.append(weakref.ref(submitters_buffer))
        return rt.submit(fails, writes=[a])

    rt = runtime_on(device)
    with pytest.raises(sd.ExceptionGroup), rt:  # (leaving it reports the failure)
        failed = submit_from_a_function()
        dependent = rt.submit(np.sum, a, reads=[a])
        assert isinstance(failed.exception(), ValueError)
        assert isinstance(dependent.exception(), sd.DependencyFailed)
        gc.collect()
        assert [m() for m in made] == [None, None], "the failed op's error still holds frames' locals"
        printed = "".join(traceback.format_exception(failed.exception()))
        assert "in fails" in printed and "in look_up" in printed  # it still says where


@pytest.mark.parametrize("device", ["inline", "sim"])
def test_a_failed_op_leaves_the_exception_the_submitting_code_handles_as_it_was(device):
    """An op submitted inside an ``except`` block, whose function then raises there (where ops run
    at submit): its error chains the exception being handled, which is the user's and keeps its
    traceback."""
    a = np.zeros(4)

    def fails():
        raise ValueError("bad")

    rt = runtime_on(device)
    with pytest.raises(sd.ExceptionGroup), rt:
        try:
            raise KeyError("the caller's own")
        except KeyError as handled:
            failed = rt.submit(fails, writes=[a])
            assert isinstance(failed.exception(), ValueError)
            assert handled.__traceback__ is not None and not getattr(handled, "__notes__", None)


@pytest.mark.parametrize("device", [*DEVICES, "inline"])
def test_memory_a_failed_op_wrote_is_not_handed_to_a_new_buffer_until_the_failure_is_reported(device):
    """Ops on memory a failed op wrote fail until synchronize() reports it. That memory must not be
    freed and given to a new buffer meanwhile (allocators hand a freed block to the next buffer of
    its size): the new buffer's ops would fail for an op that never touched it."""
    torch = pytest.importorskip("torch")

    def fails(x):
        raise ValueError("bad")

    rt = runtime_on(device)
    with rt:
        x = torch.zeros(256)
        failed = rt.submit(fails, x, writes=[x])
        assert isinstance(failed.exception(), ValueError)
        freed = weakref.ref(x)
        del x
        fresh = [torch.zeros(256) for _ in range(64)]
        futures = [rt.submit(y.add_, 1, writes=[y]) for y in fresh]
        assert [f.exception() for f in futures] == [None] * 64
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        assert freed() is None, "the failed op's buffer is kept after its failure was reported"


def test_statistics_count_failures(rt):
    a = np.zeros(1)
    rt.submit(lambda: 1 / 0, writes=[a])
    rt.submit(np.sum, a, reads=[a])
    with pytest.raises(sd.ExceptionGroup):
        rt.synchronize()
    s = rt.statistics()
    assert (s.submitted, s.completed, s.failed) == (2, 0, 2)


def test_a_failed_reader_does_not_fail_the_next_writer_of_its_input():
    """The rule a reused buffer relies on (stream_map's ring, double buffering): a failure passes
    to ops that use what the failed op wrote (reads, or writes that may read), not to an op that
    overwrites what it only read."""
    buf, out, other = np.zeros(4), np.zeros(4), np.zeros(4)

    def fail(_a, _b):
        raise KeyError("x")

    with sd.Runtime("sim", streams=2, seed=3) as rt:
        failed = rt.submit(fail, buf, out, reads=[buf], writes=[out])
        refill = rt.submit(np.copyto, buf, 5.0, writes=[buf])  # overwrites what the failed op read
        reader = rt.submit(np.sum, out, reads=[out])  # reads what it was to write
        rewrite = rt.submit(np.copyto, out, 1.0, writes=[out])  # may read it first (in place)
        unrelated = rt.submit(np.copyto, other, 2.0, writes=[other])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
    assert isinstance(failed.exception(), KeyError)
    assert refill.exception() is None and np.all(buf == 5.0)
    assert isinstance(reader.exception(), sd.DependencyFailed)
    assert isinstance(rewrite.exception(), sd.DependencyFailed)
    assert unrelated.exception() is None


def test_an_interrupt_inside_an_op_reaches_the_caller_and_leaves_nothing_pending():
    """Ctrl-C while an op's host code runs (on CUDA it runs in the submitting thread)."""
    a = np.zeros(3)

    def interrupted():
        raise KeyboardInterrupt

    with sd.Runtime(backend=InlineBackend()) as rt:
        with pytest.raises(KeyboardInterrupt):
            rt.submit(interrupted, writes=[a])
        dependent = rt.submit(np.add, a, 1, out=a, writes=[a])
        assert isinstance(dependent.exception(timeout=5), sd.DependencyFailed)
        rt.synchronize()  # returns: the interrupted op is finished, and not raised a second time
        assert rt.statistics().inflight == 0
        assert (rt.submit(np.add, a, 1, out=a, writes=[a]).result(timeout=5) == 1).all()


def test_system_exit_in_an_op_or_a_done_callback_leaves_the_runtimes_threads_working(rt, caplog):
    """User code run in the runtime's own threads (an op on a CPU lane, a done-callback) that
    raises what is no ``Exception``: the thread would die of it, and every later op it runs or
    finishes would hang. The op fails with it, and nothing is lost or left pending."""
    a, b = np.zeros(3), np.zeros(3)

    def exits():
        raise SystemExit(3)

    exited = rt.submit(exits, writes=[a], name="exits")
    dependent = rt.submit(np.add, a, 1, out=a, writes=[a])
    with pytest.raises(SystemExit):
        exited.result(timeout=5)
    assert isinstance(dependent.exception(timeout=5), sd.DependencyFailed)
    with pytest.raises(BaseExceptionGroup) as raised:  # noqa: F821 - builtin since 3.11
        rt.synchronize()  # nobody else was told: the op ran in a thread of the runtime's own
    assert [type(e) for e in raised.value.exceptions] == [SystemExit]

    called = []

    def callback_exits(_f):
        called.append(1)
        raise SystemExit(4)

    for _ in range(3):  # every lane's thread finishes some of these
        rt.submit(np.add, b, 1, out=b, writes=[b]).add_done_callback(callback_exits)
    later = [rt.submit(np.add, b, 1, out=b, writes=[b]) for _ in range(2 * rt.num_streams)]
    assert [f.result(timeout=5) is b for f in later] == [True] * len(later)
    rt.synchronize()  # a callback's exception is logged, as concurrent.futures does, not raised
    assert called == [1, 1, 1] and (b == 3 + len(later)).all()
    assert rt.statistics().inflight == 0
    assert sum(bool(r.exc_info) and r.exc_info[0] is SystemExit for r in caplog.records) == 4  # all logged


def test_a_submit_from_inside_an_op_that_touches_its_memory_fails_clearly():
    a, b = np.zeros(3), np.zeros(3)
    inner = {}

    def outer():
        inner["conflicting"] = rt.submit(np.add, a, 1, out=a, writes=[a])
        inner["independent"] = rt.submit(np.add, b, 1, out=b, writes=[b])
        a.fill(5)

    with sd.Runtime(backend=InlineBackend()) as rt:
        rt.submit(outer, writes=[a]).result(timeout=5)
        with pytest.raises(RuntimeError, match="submitted from inside op 'outer"):
            inner["conflicting"].result(timeout=5)
        assert (inner["independent"].result(timeout=5) == 1).all()
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
    assert (a == 5).all()
