"""Host lanes beside a device: ops submitted with ``run_on="host"``.

A host function that needs unfinished device work runs on a host lane once
that work has finished, and its submit returns at once; a device op that
needs a host-lane op is held until that has finished, and its submit returns
at once too. On the simulated device and on a backend that runs each op
inside its submit (as CUDA does); recorded graphs with host-lane ops are in
``test_host_lane_graphs.py``, the GPU's in ``test_cuda_host_lanes.py``.

Timing: "returns at once" is asserted as under 0.5 s against a wait of 1 s or
more (a GPU sleep or a gate). A full cycle collection, which any allocation
may start, takes 0.1-0.25 s in a process that has imported PyTorch and this
suite; a bound of 0.05 s against a 0.1 s kernel fails when one falls inside
the submit.
"""

import itertools
import threading
import time

import numpy as np
import pytest

import streamdag as sd
from programs import KINDS, closed_runtime_freed_at_once, make
from streamdag.backends.inline import InlineBackend

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def host_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("streamdag-host")]


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_op_waits_on_its_lane_not_in_the_submitter(kind):
    a, b = np.zeros(4), np.zeros(4)
    gate = threading.Event()
    with make(kind) as rt:
        blocker = rt.submit(lambda: (gate.wait(), a.fill(3)), writes=[a], run_on="host")
        started = time.perf_counter()
        # a second host op after the first (its input): queued on the host, not waited for here
        doubled = rt.submit(lambda: b.__setitem__(slice(None), a * 2) or float(b.sum()),
                            reads=[a], writes=[b], run_on="host")
        assert time.perf_counter() - started < 0.5
        assert not doubled.done()
        gate.set()
        assert doubled.result(timeout=10) == 24.0
        assert blocker.exception() is None


@pytest.mark.parametrize("kind", KINDS)
def test_the_runtime_is_quiet_only_once_no_host_lane_or_held_op_can_run(kind):
    """What a recorded graph's capture waits for: while a host-lane op is pending, or a device op
    held behind one, an op could still run beside the caller. Inside a host-lane op, the ops that
    wait for it cannot, so there it is quiet."""
    from internals import quiet

    a, b = np.zeros(4), np.zeros(4)
    gate = threading.Event()
    inside: list[bool] = []
    with make(kind) as rt:
        assert quiet(rt)
        rt.submit(lambda: gate.wait(10), writes=[a], run_on="host")
        rt.submit(lambda: float(a.sum()), reads=[a])  # held behind the host-lane op
        assert not quiet(rt)
        gate.set()
        rt.synchronize()
        assert quiet(rt)
        rt.submit(lambda: inside.append(quiet(rt)), writes=[b], run_on="host")
        rt.submit(lambda: float(b.sum()), reads=[b])  # held behind the op that asks
        rt.synchronize()
    assert inside == [True]


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_op_runs_after_the_device_ops_it_reads(kind):
    x, y = np.zeros(8), np.zeros(8)
    with make(kind) as rt:
        rt.submit(lambda: (time.sleep(0.05), x.fill(2)), writes=[x])
        total = rt.submit(lambda: float(x.sum()), reads=[x], run_on="host")
        rt.submit(lambda: y.fill(1), writes=[y])  # independent: not held up
        assert total.result(timeout=10) == 16.0


@pytest.mark.parametrize("kind", KINDS)
def test_a_device_op_after_a_host_op_is_held_and_its_submit_returns_at_once(kind):
    """It runs once the host op has finished; so do the ops after it (device or host), held on it
    in turn, while ops that touch other memory run at once."""
    x, y, z, free = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    gate = threading.Event()
    with make(kind) as rt:
        rt.submit(lambda: (gate.wait(10), x.fill(5)), writes=[x], run_on="host")
        started = time.perf_counter()
        after = rt.submit(lambda: y.__setitem__(slice(None), x + 1) or float(y.sum()), reads=[x], writes=[y])
        chained = rt.submit(np.multiply, y, 2, out=z, reads=[y], writes=[z])
        host_after = rt.submit(lambda: float(z.sum()), reads=[z], run_on="host")
        independent = rt.submit(np.add, free, 1, out=free, writes=[free])
        assert time.perf_counter() - started < 0.5
        assert independent.result(timeout=5) is free and not gate.is_set()
        assert not (after.done() or chained.done() or host_after.done())
        assert rt.statistics().inflight == 4  # the held ops count as in flight
        gate.set()
        assert after.result(timeout=10) == 24.0
        assert chained.result(timeout=10) is z and host_after.result(timeout=10) == 48.0
        rt.synchronize()
        # every host-lane op and held op is forgotten once finished
        assert rt._host_ops == {} and rt._held == {} and rt._held_on == {}


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_chain_held_on_a_host_op_runs_in_order(kind):
    """Each op of the chain holds the next; they are launched in a loop, not by recursion."""
    x = np.zeros(1)
    gate = threading.Event()
    with make(kind, max_inflight=4000) as rt:
        rt.submit(lambda: (gate.wait(10), x.fill(1)), writes=[x], run_on="host")
        for _ in range(3000):
            rt.submit(np.multiply, x, 1.0001, out=x, reads=[x], writes=[x])
        last = rt.submit(lambda: float(x[0]), reads=[x])
        assert not last.done()
        gate.set()
        rt.synchronize()  # waits for held ops too
        assert last.done() and last.result() == pytest.approx(1.0001**3000)


@pytest.mark.parametrize("kind", KINDS)
def test_an_op_after_a_held_host_op_waits_until_that_has_finished_not_launched(kind):
    """A host-lane op held behind a held device op launches onto its lane; the device op after it
    must wait for it to finish. The host op submits (it takes the runtime's lock, from its lane)
    while that device op would wait for it: launched at the host op's launch, under the lock, it
    would hang both."""
    x, y, z, w = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    gate = threading.Event()
    rt = make(kind)
    rt.submit(lambda: (gate.wait(10), x.fill(1)), writes=[x], run_on="host")
    rt.submit(np.add, x, 1, out=y, reads=[x], writes=[y])  # held on the host op

    def host_fn():
        time.sleep(0.05)
        z[:] = y * 2
        rt.submit(np.add, w, 1, out=w, writes=[w])

    rt.submit(host_fn, reads=[y], writes=[z], run_on="host")  # held on the device op
    after = rt.submit(lambda: float(z.sum()), reads=[z])  # held on the host op above
    gate.set()
    assert after.result(timeout=10) == 16.0  # (a hang: TimeoutError; the runtime is left as is)
    rt.synchronize()
    assert w.tolist() == [1.0] * 4
    rt.close()


@pytest.mark.parametrize("kind", KINDS)
def test_held_ops_keep_their_slots_and_the_caller_can_wait_for_them(kind):
    """A held op holds its in-flight slot (the bound holds); ``current_stream_wait()`` with no
    futures covers held ops too."""
    x, y = np.zeros(4), np.zeros(4)
    gate = threading.Event()
    with make(kind, max_inflight=2) as rt:
        rt.submit(lambda: (gate.wait(10), x.fill(2)), writes=[x], run_on="host")
        held = rt.submit(np.multiply, x, 3, out=y, reads=[x], writes=[y])
        with pytest.raises(sd.WouldBlock):
            rt.submit_nowait(np.add, y, 1, out=y, writes=[y])
        threading.Timer(0.1, gate.set).start()
        rt.current_stream_wait()
        assert held.done() and y.tolist() == [6.0] * 4


class _FinishesWhenAsked(InlineBackend):
    """Runs each op inside its submit, but finishes it only when asked (``hurry``), as CUDA's
    completion thread does after a pause: a waiter nobody asks for is never finished."""

    def __init__(self, device: str, streams: int) -> None:
        super().__init__(device, streams)
        self._callbacks: dict[int, object] = {}
        self._tokens = itertools.count(1)
        self.asked_for: list[int | None] = []

    def when_done(self, stream, event, callback):
        token = next(self._tokens)
        self._callbacks[token] = callback
        return token

    def hurry(self, waiter=None, seconds=None, wanted=None) -> None:
        self.asked_for.append(wanted)
        for token in [wanted] if wanted is not None else list(self._callbacks):
            callback = self._callbacks.pop(token, None)
            if callback is not None:
                callback()


def test_a_held_op_waited_on_before_it_launched_is_asked_for_as_it_launches():
    """``result()`` on a held op waits before the op has launched, when there is nothing to hurry
    yet; once it launches, its finish is asked for at once (else it waits for the completion
    thread's next pass: 18 ms late, bench/recorded_host_op.py)."""
    backend = _FinishesWhenAsked("sim", 2)
    x = np.zeros(4)
    gate = threading.Event()
    with sd.Runtime(backend=backend) as rt:
        rt.submit(lambda: (gate.wait(10), x.fill(2)), writes=[x], run_on="host")
        held = rt.submit(np.multiply, x, 3, out=x, reads=[x], writes=[x])
        got = []
        waiter = threading.Thread(target=lambda: got.append(held.result(timeout=10)))
        waiter.start()
        while not held._watched:  # it waits on the future's condition now
            time.sleep(0.001)
        assert held._hurry is None and not got
        gate.set()
        waiter.join(timeout=20)
        assert len(got) == 1 and x.tolist() == [6.0] * 4
        assert held._done_token in backend.asked_for


@pytest.mark.parametrize("kind", KINDS)
def test_failures_pass_between_host_lanes_and_the_device(kind):
    x, y, z, free = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    ran = []

    def boom():
        raise ValueError("host op failed")

    def device_boom():
        raise KeyError("device op failed")

    with make(kind) as rt:
        bad_host = rt.submit(boom, writes=[x], run_on="host", name="bad_host")
        after_host = rt.submit(lambda: ran.append("after_host"), reads=[x], writes=[y], name="after_host")
        bad_device = rt.submit(device_boom, writes=[z], name="bad_device")
        after_device = rt.submit(lambda: ran.append("after_device"), reads=[z], run_on="host",
                                 name="after_device")
        independent = rt.submit(lambda: free.fill(1) or "ok", writes=[free], run_on="host")
        assert independent.result(timeout=10) == "ok"
        assert isinstance(bad_host.exception(timeout=10), ValueError)
        assert isinstance(bad_device.exception(timeout=10), KeyError)
        for f, root in ((after_host, "bad_host"), (after_device, "bad_device")):
            err = f.exception(timeout=10)
            assert isinstance(err, sd.DependencyFailed) and err.root_name == root
        assert ran == []
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()


@pytest.mark.parametrize("kind", KINDS)
def test_an_op_submitted_from_a_host_op_that_needs_it_fails_with_what_to_do(kind):
    x, y = np.zeros(4), np.zeros(4)
    with make(kind, max_inflight=2) as rt:
        def outer():
            x.fill(1)
            inner = rt.submit(lambda: y.fill(2), writes=[y])  # its own memory: fine, on the device
            inner.result(timeout=10)
            rt.submit(lambda: x.sum(), reads=[x])  # would wait for this very op

        f = rt.submit(outer, writes=[x], run_on="host", name="outer")
        err = f.exception(timeout=10)
        assert isinstance(err, RuntimeError)
        assert "host op 'outer'" in str(err) and "submit the op from another thread" in str(err)
        assert y.tolist() == [2.0] * 4
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        # the refused submit gave its in-flight slot back: both slots are free again
        gate = threading.Event()
        try:
            held = [rt.submit_nowait(gate.wait, run_on="host") for _ in range(2)]
        finally:
            gate.set()
        assert [f.result(timeout=10) for f in held] == [True, True]


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_op_that_submits_a_host_op_and_waits_for_it_does_not_queue_it_behind_itself(kind):
    """The lanes are equally busy when the outer op submits (it runs on one, a sleep on the other),
    and the round robin points at the outer op's lane: queued there, the inner op would wait for
    the outer one, which waits for it. It goes to the other lane, behind the sleep."""
    with make(kind) as rt:
        gate = threading.Event()

        def outer():
            gate.wait(10)
            return rt.submit(lambda: 42, run_on="host").result(timeout=5)

        waiting = rt.submit(outer, run_on="host")  # the first lane
        sleeping = rt.submit(time.sleep, 0.5, run_on="host")  # the second
        gate.set()
        assert waiting.result(timeout=10) == 42
        assert sleeping.done()


def test_host_lanes_start_with_their_first_op_and_stop_with_the_runtime():
    before = len(host_threads())
    rt = sd.Runtime("sim", streams=2)
    assert len(host_threads()) == before  # nothing started for a runtime that never uses them
    rt.submit(lambda: None, run_on="host").result(timeout=10)
    assert len(host_threads()) == before + 1
    rt.close()
    assert len(host_threads()) == before


def test_a_profile_shows_host_lane_ops_after_the_device_ops_they_wait_for():
    a, b = np.zeros(4), np.zeros(4)
    with make("sim") as rt:
        with rt.profile() as prof:
            rt.submit(lambda: (time.sleep(0.01), a.fill(1)), writes=[a], name="device_op")
            rt.submit(lambda: b.__setitem__(slice(None), a + 1), reads=[a], writes=[b], run_on="host",
                      name="host_op")
        spans = {s.name: s for s in prof.timeline.spans}
    assert spans["host_op"].device == "host" and spans["device_op"].device == "sim"
    assert spans["host_op"].start >= spans["device_op"].end


def test_host_lanes_run_host_ops_side_by_side():
    gate = threading.Barrier(3, timeout=10)  # three host ops that can only finish together
    with sd.Runtime("sim", streams=2, host_lanes=3) as rt:
        fs = [rt.submit(gate.wait, run_on="host") for _ in range(3)]
        assert sorted(f.result(timeout=20) for f in fs) == [0, 1, 2]
    with pytest.raises(ValueError, match="host_lanes must be at least 1"):
        sd.Runtime("sim", host_lanes=0)


@pytest.mark.parametrize("used", [True, False])
def test_a_closed_runtime_with_host_lanes_is_freed_without_the_cycle_collector(used):
    x = np.zeros(4)

    def use(rt):
        for _ in range(5):
            if used:
                rt.submit(np.add, x, 1, out=x, reads=[x], writes=[x], run_on="host")
            rt.submit(np.add, x, 1, out=x, reads=[x], writes=[x])
        rt.synchronize()

    assert closed_runtime_freed_at_once(lambda: make("sim"), use)
    assert x.tolist() == [10.0 if used else 5.0] * 4


def test_run_on_host_on_a_cpu_runtime_runs_on_its_lanes():
    x = np.zeros(4)
    with sd.Runtime("cpu", streams=2) as rt:
        assert rt.submit(lambda: x.fill(1) or x.sum(), writes=[x], run_on="host").result(timeout=10) == 4.0


def test_a_staged_copy_follows_the_pending_copy_on_its_lane_unless_the_caller_runs_that_lane():
    """Copies one way queue on one lane, in order; never behind the op that submits them."""
    from internals import host_lane_for, host_lane_here, host_lanes

    with sd.Runtime("sim", host_lanes=3) as rt:
        lanes = host_lanes(rt)
        assert len(lanes) == 3 and host_lane_here(rt) == -1
        assert host_lane_for(rt, lanes[2]) == lanes[2]
        assert host_lane_for(rt, None) in lanes

        def on_a_lane():
            return host_lane_here(rt), [host_lane_for(rt, lane) for lane in lanes]

        here, chosen = rt.submit(on_a_lane, run_on="host").result(timeout=10)
        assert here in lanes
        others = [lane for lane in lanes if lane != here]
        assert chosen[lanes.index(here)] in others  # not the caller's own lane: the least busy other
        assert [c for lane, c in zip(lanes, chosen) if lane != here] == others
