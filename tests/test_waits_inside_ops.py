"""An op on a lane that submits ops and waits for them. The runtime does not queue the inner op
behind the op that waits for it; where a wait could never end (each lane waiting for an op queued
behind a waiting op), it raises at once, saying what to do, instead of hanging."""

import concurrent.futures
import threading
import time

import numpy as np
import pytest

import streamdag as sd
from internals import lane_waits, submit_to_lane
from streamdag.backends.inline import InlineBackend

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_an_op_that_submits_an_op_and_waits_for_it_does_not_queue_it_behind_itself():
    """Fork and join inside an op: the lanes are equally busy when it submits (it runs on one, a
    sleep on the other) and the round robin points at its own lane, where the inner op would wait
    for it while it waits for the inner op. The inner op goes to the other lane, behind the sleep.
    The compiled submit sends a submit from a lane the Python way, which chooses so."""
    with sd.Runtime("cpu", streams=2) as rt:
        gate = threading.Event()

        def outer():
            gate.wait(10)
            return rt.submit(lambda: 42).result(timeout=5)

        waiting = rt.submit(outer)  # the first lane
        sleeping = rt.submit(time.sleep, 0.5)  # the second
        gate.set()
        assert waiting.result(timeout=10) == 42
        assert sleeping.done()


@pytest.mark.parametrize("kind", ["cpu", "host lane"])
@pytest.mark.parametrize("how", ["result", "wait", "first completed", "as_completed"])
def test_waiting_inside_an_op_for_an_op_queued_behind_it_fails_with_what_to_do(kind, how):
    """With one lane, an op submitted from inside an op is queued behind it: waiting for it there
    (``result()``, or ``concurrent.futures.wait``/``as_completed`` without a timeout) would wait
    forever, so the wait raises at once, saying what to do instead; the op runs once the waiting
    one has returned."""
    host = kind == "host lane"
    with (sd.Runtime("sim", streams=1, host_lanes=1) if host else sd.Runtime("cpu", streams=1)) as rt:
        run_on = "host" if host else None

        def outer():
            inner = rt.submit(lambda: 42, run_on=run_on)
            with pytest.raises(RuntimeError, match="would wait forever") as raised:
                if how == "result":
                    inner.result(timeout=30)
                elif how == "wait":
                    concurrent.futures.wait([inner])
                elif how == "first completed":
                    concurrent.futures.wait([inner], return_when=concurrent.futures.FIRST_COMPLETED)
                else:
                    next(concurrent.futures.as_completed([inner]))
            assert "lane" in str(raised.value) and "done-callback" in str(raised.value)
            assert inner._waiters == []  # no waiter was left installed
            return inner

        started = time.perf_counter()
        inner = rt.submit(outer, run_on=run_on).result(timeout=30)
        assert inner.result(timeout=10) == 42  # it ran once the outer op had returned
        assert time.perf_counter() - started < 10


def test_concurrent_futures_waits_inside_an_op_that_can_end_are_left_alone():
    """A wait that ends by itself (a timeout), or for the first of ops of which one can run, or
    for an op on another lane, is not refused."""
    with sd.Runtime("cpu", streams=2) as rt:
        def outer():
            here = submit_to_lane(rt, 0, lambda: "behind", name="behind")  # this op's lane
            elsewhere = submit_to_lane(rt, 1, lambda: "free", name="free")
            done, not_done = concurrent.futures.wait([here], timeout=0.2)
            assert (done, not_done) == (set(), {here})
            done, _ = concurrent.futures.wait([here, elsewhere],
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            assert done == {elsewhere}
            assert concurrent.futures.wait([elsewhere]).done == {elsewhere}
            return here

        here = submit_to_lane(rt, 0, outer, name="outer").result(timeout=30)
        assert here.result(timeout=10) == "behind"


def test_a_device_op_inside_its_submit_waiting_for_a_host_lane_that_waits_to_submit_raises():
    """A device op whose function runs inside its submit (as on CUDA) holds the runtime's lock
    meanwhile. It submits an op to the only host lane and waits for it, while that lane's op is
    submitting too, so waits for the lock: neither could ever go on, so the wait raises, saying
    what to do. Once the device op returns, the lane's submit goes through and both host ops run."""
    rt = sd.Runtime(backend=InlineBackend("sim", 2), host_lanes=1)
    started, go = threading.Event(), threading.Event()

    def on_the_lane():
        started.set()
        go.wait(10)
        return rt.submit(lambda: "submitted", run_on="host")  # (queued behind this op)

    def device_op():
        go.set()  # the lane now waits for the lock, which this op holds
        inner = rt.submit(lambda: "inner", run_on="host", name="inner")
        try:
            return inner.result()
        except RuntimeError as refused:
            return refused, inner

    outcome: list = []
    lane_op = rt.submit(on_the_lane, run_on="host")
    assert started.wait(10)
    waiting = threading.Thread(target=lambda: outcome.append(rt.submit(device_op).result()), daemon=True)
    began = time.perf_counter()
    waiting.start()
    waiting.join(10)
    assert outcome, "the wait inside the device op hung"
    assert time.perf_counter() - began < 2
    refused, inner = outcome[0]
    assert isinstance(refused, RuntimeError) and "would wait forever" in str(refused), refused
    assert "'inner'" in str(refused) and "run_on='host'" in str(refused) and "done-callback" in str(refused)
    assert lane_op.result(timeout=10).result(timeout=10) == "submitted"
    assert inner.result(timeout=10) == "inner"
    rt.close()


def test_a_device_op_inside_its_submit_waiting_through_a_lane_that_waits_on_a_lane_waiting_to_submit_raises():
    """The same wait one lane further: the device op (holding the lock) waits for host lane B's op,
    which waits for an op queued on host lane A behind A's op, which waits for the lock to submit.
    None of them could ever go on, so the device op's wait raises; then every op runs."""
    rt = sd.Runtime(backend=InlineBackend("sim", 2), host_lanes=2)
    lane_a = 2  # (the first host lane, after the device's two streams)
    started, go = threading.Event(), threading.Event()

    def on_lane_a():
        started.set()
        go.wait(10)
        return rt.submit(lambda: "submitted", run_on="host")

    def on_lane_b():  # waits for an op it queues behind lane A's
        return submit_to_lane(rt, lane_a, lambda: "behind a", name="behind a").result()

    a = submit_to_lane(rt, lane_a, on_lane_a, name="a")
    assert started.wait(10)
    b = rt.submit(on_lane_b, run_on="host", name="b")  # onto the free host lane: B
    wait_for_registered_waits(rt, 1)

    def device_op():
        go.set()  # lane A now waits for the lock, which this op holds
        try:
            return b.result()
        except RuntimeError as refused:
            return refused

    outcome: list = []
    waiting = threading.Thread(target=lambda: outcome.append(rt.submit(device_op).result()), daemon=True)
    waiting.start()
    waiting.join(10)
    assert outcome, "the wait inside the device op hung"
    assert isinstance(outcome[0], RuntimeError) and "would wait forever" in str(outcome[0]), outcome[0]
    assert "'b'" in str(outcome[0])
    assert a.result(timeout=10).result(timeout=10) == "submitted"
    assert b.result(timeout=10) == "behind a"
    rt.close()


def test_a_device_op_inside_its_submit_may_wait_for_a_host_lane_op_that_can_run():
    """The same wait with the host lane free (or busy with an op that does not submit) ends."""
    with sd.Runtime(backend=InlineBackend("sim", 2), host_lanes=1) as rt:
        busy = rt.submit(time.sleep, 0.2, run_on="host")
        assert rt.submit(lambda: rt.submit(lambda: 7, run_on="host").result()).result(timeout=10) == 7
        assert busy.done()


def wait_for_registered_waits(rt, count, within=10.0):
    """Until ``count`` lane threads of ``rt`` are inside waits without a timeout (registered)."""
    deadline = time.perf_counter() + within
    while True:
        if sum(wait is not None for wait in lane_waits(rt).values()) >= count:
            return
        assert time.perf_counter() < deadline, f"{count} lane waits were never registered"
        time.sleep(0.001)


def test_a_concurrent_futures_wait_that_closes_a_cycle_of_lanes_raises():
    """Lane 0's op waits (``result()``) for an op queued on lane 1 behind lane 1's op, which then
    waits for all of two ops through ``concurrent.futures.wait``, one of them queued on lane 0:
    the second wait raises, its op fails, and the other finishes."""
    with sd.Runtime("cpu", streams=3) as rt:
        first_waits = threading.Event()
        queued = threading.Barrier(2, timeout=10)

        def outer0():
            inner = submit_to_lane(rt, 1, lambda: 0, name="inner0")
            queued.wait()
            first_waits.set()
            return inner.result()

        def outer1():
            inner = submit_to_lane(rt, 0, lambda: 10, name="inner1")
            free = submit_to_lane(rt, 2, lambda: 20, name="free")
            queued.wait()
            first_waits.wait(10)
            wait_for_registered_waits(rt, 1)  # lane 0 is inside result(), its wait registered
            return sorted(f.result() for f in concurrent.futures.wait([inner, free]).done)

        outers = [submit_to_lane(rt, 0, outer0, name="outer0"),
                  submit_to_lane(rt, 1, outer1, name="outer1")]
        assert outers[1].exception(timeout=30) is not None
        assert "would wait forever" in str(outers[1].exception()) and "'inner1" in str(outers[1].exception())
        assert outers[0].result(timeout=30) == 0
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()


@pytest.mark.parametrize("how", ["wait for all", "first completed", "as_completed"])
def test_a_lane_inside_concurrent_futures_wait_counts_for_a_later_wait_that_closes_a_cycle(how):
    """Lane 0's op waits through ``concurrent.futures`` for an op queued on lane 1 behind lane 1's
    op, which then waits (``result()``) for an op queued on lane 0: that second wait raises, its
    op fails, lane 1 runs the first's op, and the first wait ends. Afterwards no wait is left
    registered."""
    with sd.Runtime("cpu", streams=3) as rt:
        queued = threading.Barrier(2, timeout=10)

        def outer0():
            inner = submit_to_lane(rt, 1, lambda: 0, name="inner0")
            queued.wait()
            if how == "wait for all":
                free = submit_to_lane(rt, 2, lambda: 20, name="free")
                return sorted(f.result() for f in concurrent.futures.wait([inner, free]).done)
            if how == "first completed":
                done, _ = concurrent.futures.wait([inner], return_when=concurrent.futures.FIRST_COMPLETED)
                return [f.result() for f in done]
            return [f.result() for f in concurrent.futures.as_completed([inner])]

        def outer1():
            inner = submit_to_lane(rt, 0, lambda: 10, name="inner1")
            queued.wait()
            wait_for_registered_waits(rt, 1)  # lane 0 is inside its wait
            return inner.result()

        outers = [submit_to_lane(rt, 0, outer0, name="outer0"),
                  submit_to_lane(rt, 1, outer1, name="outer1")]
        error = outers[1].exception(timeout=10)
        assert isinstance(error, RuntimeError) and "wait for each other" in str(error), error
        assert "2 lanes of this runtime's 3" in str(error)
        assert outers[0].result(timeout=10) == ([0, 20] if how == "wait for all" else [0])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        assert not lane_waits(rt)  # every wait taken off again


def test_a_lane_waiting_for_the_first_of_ops_one_of_which_can_run_is_not_counted_as_stuck():
    """Lane 0's op waits for the first of an op queued on lane 1 and one on lane 2 that runs once
    the test lets it; lane 1's op then waits for an op queued on lane 0. That is no deadlock: the
    lane 2 op ends lane 0's wait, and then every op runs."""
    with sd.Runtime("cpu", streams=3) as rt:
        queued = threading.Barrier(2, timeout=10)
        gate = threading.Event()

        def outer0():
            inner = submit_to_lane(rt, 1, lambda: 0, name="inner0")
            gated = submit_to_lane(rt, 2, lambda: gate.wait(10) and 20, name="gated")
            queued.wait()
            done, _ = concurrent.futures.wait([inner, gated], return_when=concurrent.futures.FIRST_COMPLETED)
            return [f.result() for f in done]

        def outer1():
            inner = submit_to_lane(rt, 0, lambda: 10, name="inner1")
            queued.wait()
            wait_for_registered_waits(rt, 1)
            return inner.result()

        outers = [submit_to_lane(rt, 0, outer0, name="outer0"),
                  submit_to_lane(rt, 1, outer1, name="outer1")]
        wait_for_registered_waits(rt, 2)  # both lanes wait, and neither wait was refused
        gate.set()
        assert outers[0].result(timeout=10) == [20]
        assert outers[1].result(timeout=10) == 10
        rt.synchronize()
        assert not lane_waits(rt)


def fork_join_on_every_lane(rt, lanes, run_on, timeout=None):
    """``lanes`` ops that run at once, each submitting an op and waiting for it inside: with as
    many lanes, each submitted op is queued behind another lane's waiting op."""
    together = threading.Barrier(lanes, timeout=10)

    def outer(i):
        together.wait()
        inner = rt.submit(lambda: i * 10, run_on=run_on, name=f"inner{i}")
        together.wait()  # every inner op is queued before anyone waits
        return inner.result(timeout)

    return [rt.submit(outer, i, run_on=run_on, name=f"outer{i}") for i in range(lanes)]


@pytest.mark.parametrize("kind", ["cpu", "host lanes"])
@pytest.mark.parametrize("lanes", [2, 3])
def test_when_every_lane_waits_for_a_lane_op_the_last_wait_raises_and_the_rest_finish(kind, lanes):
    """Fork-join inside ops on every lane at once: each inner op is queued behind another lane's
    outer op, which waits too, so none could ever run. The wait that makes every lane wait raises
    instead, saying what to do; its op fails, its lane goes on, and the other outer ops finish."""
    host = kind == "host lanes"
    with (sd.Runtime("sim", streams=1, host_lanes=lanes) if host else sd.Runtime("cpu", streams=lanes)) as rt:
        outers = fork_join_on_every_lane(rt, lanes, "host" if host else None)
        errors = [f.exception(timeout=30) for f in outers]
        failed = [e for e in errors if e is not None]
        assert len(failed) == 1, errors
        assert isinstance(failed[0], RuntimeError) and "wait for each other" in str(failed[0])
        assert "more lanes" in str(failed[0]) and "done-callback" in str(failed[0])
        assert sorted(f.result() for f, e in zip(outers, errors) if e is None) == [
            i * 10 for i, e in enumerate(errors) if e is None]
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()  # and no op is left pending
        after = rt.submit(lambda: "still works", run_on="host" if host else None)
        assert after.result(timeout=10) == "still works"


def test_a_fork_join_that_leaves_a_lane_free_is_not_taken_for_a_deadlock():
    """Two of three lanes wait for ops they submitted: the third lane runs those."""
    with sd.Runtime("cpu", streams=3) as rt:
        together = threading.Barrier(2, timeout=10)

        def outer(i):
            together.wait()
            inner = rt.submit(lambda: i, name=f"inner{i}")
            together.wait()
            return inner.result()

        assert [f.result(timeout=30) for f in [rt.submit(outer, i) for i in range(2)]] == [0, 1]


def test_two_lanes_waiting_for_each_others_queued_ops_raise_though_a_third_lane_is_free():
    """Lane 0's op waits for an op queued on lane 1 behind lane 1's op, which waits for one queued on
    lane 0: a free third lane cannot run either (a lane runs its own queue). The second wait raises,
    its op fails, and the other finishes. (A count of waiting lanes missed this: with the inner ops
    placed so, the fork-join test on three lanes hung once in CI.)"""
    with sd.Runtime("cpu", streams=3) as rt:
        together = threading.Barrier(2, timeout=10)

        def outer(i):
            together.wait()
            other = 1 - i  # the inner op goes to the other waiting lane, on purpose
            inner = submit_to_lane(rt, other, lambda: i * 10, name=f"inner{i}")
            together.wait()  # both queued before anyone waits
            return inner.result()

        outers = [submit_to_lane(rt, i, outer, i, name=f"outer{i}") for i in range(2)]
        errors = [f.exception(timeout=30) for f in outers]
        failed = [e for e in errors if e is not None]
        assert len(failed) == 1 and "wait for each other" in str(failed[0]), errors
        assert "2 lanes of this runtime's 3" in str(failed[0])
        (done,) = [f for f, e in zip(outers, errors) if e is None]
        assert done.result() in (0, 10)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()


def test_waits_with_a_timeout_are_not_counted_as_stuck():
    """A wait with a timeout ends by itself: with every lane waiting so, one times out (and its
    lane then runs the other's inner op, unless that one timed out as well)."""
    with sd.Runtime("cpu", streams=2) as rt:
        outers = fork_join_on_every_lane(rt, 2, None, timeout=0.5)
        errors = [f.exception(timeout=30) for f in outers]
        assert any(isinstance(e, TimeoutError) for e in errors), errors
        assert all(e is None or isinstance(e, TimeoutError) for e in errors), errors
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()


def _fork_join_behind_a_dependent(rt, lanes_busy_elsewhere):
    """An op writes ``y``, then submits an op and waits for it; meanwhile an op on another lane
    reads ``y`` (so waits for it), queued behind a gated writer of ``x`` that it also reads, and
    ``lanes_busy_elsewhere`` gated ops fill a third lane. The waiting op returns what its wait
    gives, or the RuntimeError that it raises."""
    x, y, z = (np.zeros(4) for _ in range(3))
    gate, opened = threading.Event(), threading.Event()

    def outer():
        gate.wait(10)
        inner = rt.submit(lambda: 42, name="inner")
        opened.set()  # the gated ops may finish once the inner op is placed
        try:
            return inner.result(timeout=5)
        except RuntimeError as refused:  # (the op returns it: its lane and the reader go on)
            return refused

    waiting = rt.submit(outer, writes=[y], name="outer")  # the first lane
    rt.submit(opened.wait, 10, writes=[x], name="writer of x")  # the second
    for _ in range(lanes_busy_elsewhere):  # a third lane, busier than the second
        rt.submit(opened.wait, 10, writes=[z], name="busy")
    reader = rt.submit(lambda: None, reads=[y, x], name="reader")  # after the writer of x
    gate.set()
    return waiting, reader


def test_an_op_submitted_inside_an_op_is_not_queued_behind_ops_that_wait_for_that_op():
    """The least busy other lane holds an op that depends on the submitting op: the inner op
    queued there would run only after the submitting op returns, so it goes to the free lane."""
    with sd.Runtime("cpu", streams=3) as rt:
        waiting, reader = _fork_join_behind_a_dependent(rt, lanes_busy_elsewhere=3)
        assert waiting.result(timeout=30) == 42
        reader.result(timeout=30)


def test_waiting_inside_an_op_for_an_op_only_placeable_behind_its_dependents_raises_at_once():
    """Every other lane holds an op that depends on the submitting op: waiting there for the
    inner op would wait forever, so the wait raises at once, saying what to do."""
    with sd.Runtime("cpu", streams=2) as rt:
        waiting, reader = _fork_join_behind_a_dependent(rt, lanes_busy_elsewhere=0)
        refused = waiting.result(timeout=30)
        assert isinstance(refused, RuntimeError), refused
        assert "would wait forever" in str(refused) and "streams=" in str(refused)
        reader.result(timeout=30)


def _graph_run_behind_a_dependent(rt):
    """As ``_fork_join_behind_a_dependent``, but the op runs a recorded graph of one op and
    waits for the run."""
    x, y = np.zeros(4), np.zeros(4)
    with rt.record() as graph:
        rt.submit(lambda: 42, name="recorded")
    rt.synchronize()
    gate, opened = threading.Event(), threading.Event()

    def outer():
        gate.wait(10)
        run = graph.run()
        opened.set()
        try:
            return run.result(timeout=5)[0]
        except RuntimeError as refused:
            return refused

    waiting = rt.submit(outer, writes=[y], name="outer")
    rt.submit(opened.wait, 10, writes=[x], name="writer of x")
    reader = rt.submit(lambda: None, reads=[y, x], name="reader")
    gate.set()
    return waiting, reader


def test_a_graph_run_inside_an_op_is_not_queued_behind_ops_that_wait_for_that_op():
    with sd.Runtime("cpu", streams=3) as rt:
        waiting, reader = _graph_run_behind_a_dependent(rt)
        assert waiting.result(timeout=30) == 42
        reader.result(timeout=30)


def test_waiting_inside_an_op_for_a_graph_run_only_placeable_behind_its_dependents_raises_at_once():
    with sd.Runtime("cpu", streams=2) as rt:
        waiting, reader = _graph_run_behind_a_dependent(rt)
        refused = waiting.result(timeout=30)
        assert isinstance(refused, RuntimeError), refused
        assert "would wait forever" in str(refused)
        reader.result(timeout=30)


def test_a_wait_for_an_op_behind_a_lane_that_waits_for_a_dependent_of_the_waiting_op_raises():
    """The inner op goes to the second lane, free when it is placed; that lane's op then submits
    an op reading what the outer op writes, queued on the third lane, and waits for it. Waiting
    for the inner op now would wait forever, which only the dependency shows (no lane waits for
    an op queued behind a waiting one): the wait raises."""
    rt = sd.Runtime("cpu", streams=3)
    x, y = np.zeros(4), np.zeros(4)
    gate, placed, other_waits = threading.Event(), threading.Event(), threading.Event()

    def outer():
        gate.wait(10)
        inner = rt.submit(lambda: 42, name="inner")
        placed.set()
        other_waits.wait(10)
        time.sleep(0.2)  # (the other lane's op is inside its wait)
        try:
            return inner.result()
        except RuntimeError as refused:
            return refused

    def other():
        placed.wait(10)
        reader = rt.submit(lambda: None, reads=[y, x], name="reader")  # after the writer of x
        other_waits.set()
        return reader.result()

    waiting = rt.submit(outer, writes=[y], name="outer")  # the first lane
    rt.submit(other, name="other")  # the second
    for _ in range(2):  # the third, busier than the second when the inner op is placed
        rt.submit(placed.wait, 10, writes=[x], name="writer of x")
    gate.set()
    refused = waiting.result(timeout=10)  # (a TimeoutError: hung; the runtime is left open)
    assert isinstance(refused, RuntimeError) and "would wait forever" in str(refused), refused


@pytest.mark.parametrize("call", ["result", "synchronize", "close", "profile"])
def test_a_wait_inside_an_op_on_the_simulated_device_fails_at_once_or_returns_never_hangs(call):
    """One thread runs every stream of the simulated device, so nothing else runs while an op
    waits: a wait for other ops raises with what to do; close() leaves the rest to a thread of its
    own, as on lanes."""
    rt = sd.Runtime("sim", streams=2)

    def inner():
        if call == "result":
            rt.submit(time.sleep, 0).result()
        elif call == "profile":
            with rt.profile():
                pass
        else:
            getattr(rt, call)()

    rt.submit(time.sleep, 0.01)
    f = rt.submit(inner)
    error = f.exception(timeout=10)
    if call in ("close", "profile"):  # (a profile's closing wait is best effort: it keeps no error)
        assert error is None
    else:
        assert isinstance(error, RuntimeError) and "would wait forever" in str(error)
    rt.close()


def test_synchronize_inside_an_op_on_the_simulated_device_raises_though_the_newest_op_is_on_a_host_lane():
    rt = sd.Runtime("sim", streams=2, host_lanes=1)
    gate = threading.Event()

    def inner():
        rt.submit(gate.wait, 10, run_on="host")  # the newest pending op: on a lane, not the simulator
        try:
            rt.synchronize()
        finally:
            gate.set()

    error = rt.submit(inner).exception(timeout=10)
    assert isinstance(error, RuntimeError) and "would wait forever" in str(error)
    rt.close()


def test_synchronize_inside_a_host_lane_op_leaves_out_a_held_op_released_behind_it_meanwhile():
    """On the only host lane, op ``last`` synchronizes while a device op held on an earlier host
    op runs, and a host op held on that device op is released afterwards: it lands on the lane
    behind ``last``, so cannot finish before ``last`` returns. The synchronize leaves it out once
    it lands there, instead of waiting for it for good."""
    rt = sd.Runtime(backend=InlineBackend("sim", 2), host_lanes=1)
    a, b, c = (np.zeros(4) for _ in range(3))
    gate = threading.Event()
    first = rt.submit(gate.wait, 10, writes=[a], run_on="host", name="first")
    slow = rt.submit(lambda: time.sleep(0.3), reads=[a], writes=[b], name="slow device op")  # held on first
    after = rt.submit(lambda: None, reads=[b], writes=[c], run_on="host", name="after")  # held on slow

    def last():
        rt.synchronize()
        return slow.done(), after.done()

    outcome = rt.submit(last, run_on="host", name="last")
    gate.set()
    assert outcome.result(timeout=10) == (True, False)
    after.result(timeout=10)
    assert first.done() and slow.done()
    rt.close()
