"""A runtime's life from inside: waits, closes and submits that ops and done-callbacks make on their
own runtime, at the in-flight bound, while it closes, and a runtime dropped without close().

Each must finish (or raise a clear error) within seconds: every wait here has a time limit, so that
a hang fails its test instead of stalling the run.
"""

import gc
import threading
import time
import warnings

import numpy as np
import pytest

import streamdag as sd
from internals import submitters_waiting_for_a_slot
from streamdag.backends.inline import InlineBackend

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")

#: where the ops run: a CPU runtime's lanes, or the host lanes beside a (simulated) device
LANES = ["cpu", "host"]


def runtime(where: str, lanes: int, **settings) -> tuple[sd.Runtime, dict]:
    """A runtime whose ops run on ``lanes`` lanes, and the keywords that put an op on one."""
    if where == "cpu":
        return sd.Runtime("cpu", streams=lanes, **settings), {}
    return sd.Runtime("sim", streams=2, host_lanes=lanes, **settings), {"run_on": "host"}


def finishes(fn, seconds: float = 10.0):
    """``fn()``, run in a thread of its own: fails the test if it has not returned within ``seconds``."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # raised again in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} has not returned after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def threads_left(before: set, seconds: float = 10.0) -> list[threading.Thread]:
    """The threads started since ``before`` that are still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


# ----------------------------------------------------------------- synchronize inside an op
@pytest.mark.parametrize("where", LANES)
def test_synchronize_inside_an_op_waits_for_the_ops_it_forked_but_not_for_itself(where):
    rt, on = runtime(where, lanes=3)
    done = []

    def child(i):
        time.sleep(0.02)
        done.append(i)

    def parent():
        for i in range(4):
            rt.submit(child, i, **on)
        rt.synchronize()
        return sorted(done)

    with rt:
        assert rt.submit(parent, **on).result(timeout=10) == [0, 1, 2, 3]


@pytest.mark.parametrize("where", LANES)
def test_synchronize_inside_an_op_leaves_out_the_ops_queued_behind_it_on_its_lane(where):
    rt, on = runtime(where, lanes=1)

    def parent():
        child = rt.submit(lambda: 7, **on)  # one lane: queued behind this op
        rt.synchronize()
        return child.done()

    with rt:
        assert rt.submit(parent, **on).result(timeout=10) is False


@pytest.mark.parametrize("where", LANES)
def test_synchronize_inside_an_op_waits_for_independent_ops_but_not_for_its_dependents(where):
    rt, on = runtime(where, lanes=3)
    a = np.zeros(4)
    submitted = threading.Event()

    def producer():
        assert submitted.wait(10)
        rt.synchronize()
        return independent.done(), dependent.done()

    with rt:
        first = rt.submit(producer, writes=[a], **on)
        dependent = rt.submit(np.add, a, 1, out=a, reads=[a], writes=[a], **on)
        independent = rt.submit(time.sleep, 0.05, **on)
        submitted.set()
        assert first.result(timeout=10) == (True, False)
        dependent.result(timeout=10)
    assert (a == 1).all()


@pytest.mark.parametrize("where", LANES)
def test_ops_on_two_lanes_that_synchronize_at_once_both_return(where):
    rt, on = runtime(where, lanes=2)
    both = threading.Barrier(2)

    def op(i):
        both.wait(timeout=10)
        rt.synchronize()
        return i

    with rt:
        futures = [rt.submit(op, i, **on) for i in range(2)]
        assert [f.result(timeout=10) for f in futures] == [0, 1]


def test_a_synchronizing_op_and_an_op_waiting_for_one_queued_behind_it_do_not_hang():
    """One lane's op synchronizes, so waits for the other lane's op, which waits for an op it queued
    behind the first: a cycle. Whichever comes second sees it: the wait raises, with what to do, or
    the synchronize leaves out the waiting op. Either way both end."""
    rt = sd.Runtime("cpu", streams=2)
    syncing = threading.Event()

    def synchronizing():
        syncing.set()
        rt.synchronize()
        return "synchronized"

    def waiting():
        assert syncing.wait(10)
        behind = rt.submit(lambda: "behind")  # to the other lane, behind `synchronizing`
        time.sleep(0.05)
        try:
            return behind.result()
        except RuntimeError as exc:
            assert "would wait forever" in str(exc)
            return "refused"

    with rt:
        waits = rt.submit(waiting)
        syncs = rt.submit(synchronizing)  # the other lane
        assert waits.result(timeout=10) in ("behind", "refused")
        assert syncs.result(timeout=10) == "synchronized"


def test_synchronize_inside_an_op_that_runs_inside_its_submit_returns():
    """On a device whose ops run inside their submit (as on CUDA), the op's function runs under the
    runtime's lock: synchronize() there leaves out the op itself."""
    with sd.Runtime(backend=InlineBackend("cpu", 2)) as rt:
        def op():
            rt.submit(lambda: None).result(timeout=10)
            rt.synchronize()
            return "synchronized"

        assert finishes(lambda: rt.submit(op).result(timeout=10)) == "synchronized"


@pytest.mark.parametrize("where", LANES)
def test_profile_inside_an_op_times_the_ops_that_finish_before_it_returns(where):
    rt, on = runtime(where, lanes=2)

    def op():
        with rt.profile() as prof:
            rt.submit(time.sleep, 0.01, name="forked", **on).result(timeout=10)
        return [span.name for span in prof.timeline.spans]

    with rt:
        assert rt.submit(op, **on).result(timeout=10) == ["forked"]


def test_a_done_callback_that_waits_for_an_op_queued_behind_it_on_its_lane_is_told_it_is_a_callback():
    """The callback runs on the lane after the op that submitted both: the error names the callback,
    not that op."""
    raised = []

    def parent():
        first, second = rt.submit(lambda: 1), rt.submit(lambda: 2)  # one lane: queued behind this op

        def wait(_f):
            try:
                second.result()
            except RuntimeError as exc:
                raised.append(str(exc))

        first.add_done_callback(wait)

    with sd.Runtime("cpu", streams=1) as rt:
        rt.submit(parent).result(timeout=10)
    assert len(raised) == 1 and "inside a done-callback" in raised[0]


# ----------------------------------------------------------------- close inside an op or a callback
@pytest.mark.parametrize("where", LANES)
def test_close_inside_an_op_returns_and_closes_the_runtime_once_the_op_has_returned(where):
    before = set(threading.enumerate())
    rt, on = runtime(where, lanes=2)
    closed_inside = threading.Event()

    def op():
        rt.close()
        closed_inside.set()
        return rt.submit(lambda: "forked while closing", **on).result(timeout=10)

    future = rt.submit(op, **on)
    assert closed_inside.wait(10)
    with pytest.raises(sd.RuntimeClosed):  # from outside: refused as soon as close() is called
        rt.submit(lambda: None)
    assert future.result(timeout=10) == "forked while closing"
    assert threads_left(before) == []


def test_close_inside_an_op_that_runs_inside_its_submit_returns():
    before = set(threading.enumerate())
    rt = sd.Runtime(backend=InlineBackend("sim", 2), host_lanes=2)
    rt.submit(lambda: 1, run_on="host").result(timeout=10)  # host lanes started

    def op():
        rt.close()
        return "closing"

    assert finishes(lambda: rt.submit(op).result(timeout=10)) == "closing"
    assert threads_left(before) == []
    with pytest.raises(sd.RuntimeClosed):
        rt.submit(lambda: None)


@pytest.mark.parametrize("where", LANES)
def test_close_from_a_done_callback_stops_every_lane(where):
    before = set(threading.enumerate())
    rt, on = runtime(where, lanes=3)
    errors = []

    def close(_f):
        try:
            rt.close()
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    futures = [rt.submit(time.sleep, 0.01, **on) for _ in range(3)]
    futures[0].add_done_callback(close)
    assert [f.result(timeout=10) for f in futures] == [None] * 3
    assert threads_left(before) == [] and errors == []
    with pytest.raises(sd.RuntimeClosed):
        rt.submit(lambda: None)


# ----------------------------------------------------------------- fork and join at the bound
@pytest.mark.parametrize("max_inflight", [1, 2])
@pytest.mark.parametrize("where", LANES)
def test_ops_that_fork_and_join_make_progress_at_the_in_flight_bound(where, max_inflight):
    rt, on = runtime(where, lanes=4, max_inflight=max_inflight)

    def parent(i):
        return rt.submit(lambda: 2 * i, **on).result(timeout=10) + 1

    with rt:
        futures = [rt.submit(parent, i, **on) for i in range(20)]  # each takes a slot: the bound is met
        assert [f.result(timeout=20) for f in futures] == [2 * i + 1 for i in range(20)]


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_host_lane_ops_that_fork_device_ops_and_join_make_progress_at_the_bound(max_inflight):
    with sd.Runtime("sim", streams=2, host_lanes=2, max_inflight=max_inflight) as rt:
        def parent(i):
            return rt.submit(lambda: 2 * i).result(timeout=10)  # on the device, from a host lane

        futures = [rt.submit(parent, i, run_on="host") for i in range(12)]
        assert [f.result(timeout=20) for f in futures] == [2 * i for i in range(12)]


def test_an_op_that_forks_inside_its_submit_makes_progress_at_the_bound():
    """As on CUDA, the op runs inside its submit, holding the only slot: its own submit must not
    wait for that slot."""
    with sd.Runtime(backend=InlineBackend("cpu", 2), max_inflight=1) as rt:
        def parent(i):
            return rt.submit(lambda: 2 * i).result(timeout=10)

        results = finishes(lambda: [rt.submit(parent, i).result(timeout=10) for i in range(5)])
        assert results == [0, 2, 4, 6, 8]


# ----------------------------------------------------------------- close racing submitters
def test_close_refuses_the_submitters_waiting_at_the_bound_at_once():
    before = set(threading.enumerate())
    rt = sd.Runtime("cpu", streams=1, max_inflight=1)
    gate = threading.Event()
    rt.submit(gate.wait, 10)  # holds the only slot until the gate opens
    outcomes = []

    def submit():
        try:
            outcomes.append(rt.submit(lambda: "ran"))
        except sd.RuntimeClosed as exc:
            outcomes.append(exc)

    submitters = [threading.Thread(target=submit, daemon=True) for _ in range(4)]
    for t in submitters:
        t.start()
    deadline = time.monotonic() + 10
    while submitters_waiting_for_a_slot(rt) < 4 and time.monotonic() < deadline:  # all four wait for a slot
        time.sleep(0.005)
    closer = threading.Thread(target=rt.close, daemon=True)
    closer.start()
    for t in submitters:  # woken and refused while the gate op still runs
        t.join(5)
    assert not any(t.is_alive() for t in submitters), "a submitter still waits for a slot"
    assert len(outcomes) == 4 and all(isinstance(o, sd.RuntimeClosed) for o in outcomes)
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and threads_left(before) == []


def close_racing_submitters(threads: int, submits: int) -> list:
    """Close a runtime of one lane and one slot while ``threads`` threads each submit ``submits``
    ops (until refused); the futures they got."""
    rt = sd.Runtime("cpu", streams=1, max_inflight=1)
    rt.submit(time.sleep, 0.005)
    futures = []

    def submit():
        for _ in range(submits):
            try:
                futures.append(rt.submit(lambda: "ran"))
            except sd.RuntimeClosed:
                return

    submitters = [threading.Thread(target=submit, daemon=True) for _ in range(threads)]
    for t in submitters:
        t.start()
    time.sleep(0.003)
    finishes(rt.close)
    for t in submitters:
        t.join(5)
    assert not any(t.is_alive() for t in submitters), "a submitter is stuck"
    return futures


def test_every_submit_racing_close_completes_or_is_refused():
    """Whatever the order, a submit that returns a future gets it completed, never stranded on a
    stopped lane; the others raise RuntimeClosed."""
    for _ in range(20):
        before = set(threading.enumerate())
        futures = close_racing_submitters(threads=4, submits=3)
        assert [f.result(timeout=5) for f in futures] == ["ran"] * len(futures)
        assert threads_left(before) == []


def test_ops_submitted_while_the_runtime_closes_are_waited_for():
    """close() waits for what the pending ops and their done-callbacks submit meanwhile: forks run."""
    rt = sd.Runtime("cpu", streams=2)
    gate = threading.Event()
    late = []

    def parent():
        assert gate.wait(10)
        child = rt.submit(lambda: "child")
        child.add_done_callback(lambda _f: late.append(rt.submit(lambda: "from a callback")))
        return child.result(timeout=10)

    future = rt.submit(parent)
    closer = threading.Thread(target=rt.close, daemon=True)
    closer.start()
    time.sleep(0.05)
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert future.result(timeout=0) == "child" and late[0].result(timeout=0) == "from a callback"


# ----------------------------------------------------------------- dropped without close()
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_runtimes_dropped_without_close_stop_their_threads_and_warn(device):
    before = set(threading.enumerate())
    with pytest.warns(ResourceWarning, match="dropped without close"):
        for _ in range(25):
            rt = sd.Runtime(device, streams=4)
            rt.submit(lambda: 1).result(timeout=10)
            if device == "sim":
                rt.submit(lambda: 2, run_on="host").result(timeout=10)  # its host lanes started too
            del rt
        gc.collect()
    assert threads_left(before) == []


def test_a_closed_runtime_dropped_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        rt = sd.Runtime("cpu", streams=2)
        rt.submit(lambda: 1).result(timeout=10)
        rt.close()
        del rt
        gc.collect()


def test_close_drops_the_failures_not_yet_raised_and_a_closed_runtime_refuses_a_profile():
    a = np.zeros(4)
    rt = sd.Runtime("cpu", streams=2)
    rt.submit(lambda x: 1 / 0, a, writes=[a])
    rt.close()
    rt.synchronize()  # (nothing pending, the failure dropped by close)
    assert rt.statistics().failed == 1
    with pytest.raises(sd.RuntimeClosed), rt.profile():
        pass
