"""Host lanes beside a device: ops submitted with ``run_on="host"``.

A host function that needs unfinished device work runs on a host lane once
that work has finished, and its submit returns at once; a device op that
needs a host-lane op is held until that has finished, and its submit returns
at once too. On the simulated device and on a backend that runs each op
inside its submit (as CUDA does), and on the GPU (marked ``cuda``).

Timing: "returns at once" is asserted as under 0.5 s against a wait of 1 s or
more (a GPU sleep or a gate). A full cycle collection, which any allocation
may start, takes 0.1-0.25 s in a process that has imported PyTorch and this
suite (measured on the GPU host); a bound of 0.05 s against a 0.1 s kernel
failed when one fell inside the submit.
"""

import itertools
import threading
import time

import numpy as np
import pytest

import streamdag as sd
from programs import closed_runtime_freed_at_once
from streamdag.backends.inline import InlineBackend


def make(kind: str, streams: int = 2, max_inflight: int = 256) -> sd.Runtime:
    if kind == "inline":  # each device op runs inside its submit, as on CUDA
        return sd.Runtime(backend=InlineBackend("sim", streams), max_inflight=max_inflight)
    return sd.Runtime(kind, streams=streams, max_inflight=max_inflight)


KINDS = ["sim", "inline"]


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
    yet; once it launches, its finish is asked for at once (before, it waited for the completion
    thread's next pass: 18 ms late on the H100, bench/recorded_host_op.py)."""
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


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorded_graph_holds_host_lane_ops_and_runs_them_where_they_fall(kind):
    """A host-lane op recorded in a graph runs on a host lane in every run, after the device ops it
    reads; the graph's ops after it are held until it has finished, ops of the graph that do not
    follow it run meanwhile, and ``g.run()`` returns at once. Run after run, with new inputs."""
    x, y, z, w, free = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    gates = []

    def on_host():
        assert threading.current_thread().name.startswith("streamdag-host")
        gates[-1].wait(10)
        np.add(y, 1, out=z)
        return float(z.sum())

    with make(kind) as rt:
        with rt.record() as g:
            rt.submit(np.multiply, x, 3, out=y, reads=[x], writes=[y])
            host = rt.submit(on_host, reads=[y], writes=[z], run_on="host", name="on_host")
            rt.submit(np.multiply, z, 2, out=w, reads=[z], writes=[w])
            freed = rt.submit(np.add, free, 1, out=free, writes=[free])  # follows nothing of the host op
        # in parts: the device ops that follow no host-lane op, the host op, the device op after it
        parts = [(graph is not None, ops) for graph, ops in g._parts]
        assert parts == [(True, [0, 3]), (False, [1]), (True, [2])]
        for run in range(3):
            gates.append(threading.Event())
            x.fill(run + 1)
            started = time.perf_counter()
            result = g.run()
            assert time.perf_counter() - started < 0.5 and not result.done()
            deadline = time.monotonic() + 10
            while free[0] < run + 1 and time.monotonic() < deadline:  # not behind the host op
                time.sleep(0.005)
            assert free.tolist() == [run + 1.0] * 4 and not result.done()
            gates[-1].set()
            values = result.result(timeout=10)
            assert values[host] == 4 * (3 * (run + 1) + 1) and values[freed] is free
            assert z.tolist() == [3.0 * (run + 1) + 1] * 4 and w.tolist() == [6.0 * (run + 1) + 2] * 4
        assert "host lanes: 1 op(s) run on the host beside the device ('on_host'" in g.explain()
        rt.synchronize()
        assert rt._host_ops == {} and rt._held == {} and rt._held_on == {}


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_in_parts_is_freed_by_reference_counting(kind):
    """A graph with a host-lane op (its parts graphs of their own), run and dropped, leaves no
    reference cycle: its closed runtime is freed by reference counting, not left to the cycle
    collector, whose pass could come inside someone's CUDA graph capture (freeing a CUDA graph
    there ends that capture)."""
    x, y = np.zeros(4), np.zeros(4)

    def use(rt):
        with rt.record() as g:
            rt.submit(np.add, x, 1, out=x, reads=[x], writes=[x])
            rt.submit(np.add, x, 1, out=y, reads=[x], writes=[y], run_on="host")
            rt.submit(np.add, y, 1, out=x, reads=[y], writes=[x])
        for _ in range(2):
            g.run().result(timeout=10)
        assert g._parts

    assert closed_runtime_freed_at_once(lambda: make(kind), use)
    assert x.tolist() == [6.0] * 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_stage_of_a_graph_in_parts_is_split_by_the_host_lane_ops_its_device_ops_follow(kind):
    """Two host-lane ops side by side, each followed by device ops, then one op after both: the
    device ops after each host op are a part of their own, the op after both another (on CUDA a
    captured part is one op, which waits for every host-lane op that any of its ops follows; see
    the GPU test below); run after run, every value as serial execution gives it."""
    slow_in, quick_in = np.zeros(4), np.zeros(4)
    slow_out, quick_out, both = np.zeros(4), np.zeros(4), np.zeros(4)
    with make(kind, streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: slow_in.fill(1), writes=[slow_in], run_on="host", name="slow")
            rt.submit(lambda: quick_in.fill(2), writes=[quick_in], run_on="host", name="quick")
            rt.submit(np.add, slow_in, 10, out=slow_out, reads=[slow_in], writes=[slow_out])
            rt.submit(np.add, quick_in, 10, out=quick_out, reads=[quick_in], writes=[quick_out])
            rt.submit(np.add, slow_out, quick_out, out=both, reads=[slow_out, quick_out], writes=[both])
        assert [(graph is not None, ops) for graph, ops in g._parts] == [
            (False, [0]), (False, [1]), (True, [2]), (True, [3]), (True, [4])]
        for _ in range(2):
            for a in (slow_in, quick_in, slow_out, quick_out, both):
                a.fill(0)
            g.run().result(timeout=10)
            assert slow_out.tolist() == [11.0] * 4 and quick_out.tolist() == [12.0] * 4
            assert both.tolist() == [23.0] * 4


@pytest.mark.parametrize("seed", range(5))
def test_host_lanes_on_a_runtime_of_several_devices(seed):
    """A host op reads both devices' results where they are (no peer copy for it), after them;
    device ops on either device that read what it writes are held behind it, and a later op on
    one device reading the other's result gets its peer copy as ever."""
    from streamdag.backends.sim import SimArray

    def on(device, values):
        return SimArray(np.asarray(values, dtype=np.float64), device)

    a, b = on("sim:0", [1.0, 2.0]), on("sim:1", [3.0, 4.0])
    total = np.zeros(1)
    out0, out1 = on("sim:0", [0.0, 0.0]), on("sim:1", [0.0, 0.0])
    gate = threading.Event()
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=seed) as rt:
        rt.submit(lambda: np.multiply(a.data, 10, out=a.data), writes=[a])
        rt.submit(lambda: np.multiply(b.data, 10, out=b.data), writes=[b])

        def summed():
            gate.wait(10)
            total[0] = a.data.sum() + b.data.sum()
            return type(a), type(b)

        kinds = rt.submit(summed, reads=[a, b], writes=[total], run_on="host")
        started = time.perf_counter()
        f0 = rt.submit(lambda: np.add(a.data, total[0], out=out0.data), reads=[a, total], writes=[out0])
        f1 = rt.submit(lambda: np.add(b.data, total[0], out=out1.data), reads=[b, total], writes=[out1])
        assert time.perf_counter() - started < 0.5 and not (f0.done() or f1.done())
        gate.set()
        assert kinds.result(timeout=10) == (SimArray, SimArray)
        rt.synchronize()
    assert total.tolist() == [100.0]
    np.testing.assert_array_equal(out0.data, [110.0, 120.0])
    np.testing.assert_array_equal(out1.data, [130.0, 140.0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("failing", ["host", "device"])
def test_a_failure_in_a_recorded_graph_with_host_lane_ops_fails_its_dependents_only(kind, failing):
    """The graph runs in parts (the device ops between host-lane ops, and each host-lane op): a
    failure passes between them as between any ops, the run reports the graph's own root failure
    once, ops that follow nothing failed still run, and the next run works."""
    x, y, z, w, free = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    fail = [True]

    def device_op():
        if failing == "device" and fail[0]:
            raise ValueError("device op failed")
        np.add(x, 1, out=y)

    def host_op():
        if failing == "host" and fail[0]:
            raise ValueError("host op failed")
        np.multiply(y, 2, out=z)

    with make(kind) as rt:
        with rt.record() as g:
            rt.submit(device_op, reads=[x], writes=[y], name="device_op")
            rt.submit(host_op, reads=[y], writes=[z], run_on="host", name="host_op")
            rt.submit(np.add, z, 1, out=w, reads=[z], writes=[w], name="after")
            rt.submit(np.add, free, 1, out=free, writes=[free], name="free")
        with pytest.raises(sd.ExceptionGroup) as caught:
            g.run().result(timeout=10)
        assert [str(e) for e in caught.value.exceptions] == [f"{failing} op failed"]
        assert free.tolist() == [1.0] * 4 and w.tolist() == [0.0] * 4
        with pytest.raises(sd.ExceptionGroup):  # seen: memory a failed op wrote is usable again
            rt.synchronize()
        fail[0] = False
        values = g.run().result(timeout=10)
        assert len(values) == 4 and w.tolist() == [3.0] * 4 and free.tolist() == [2.0] * 4


def run_behind_a_gated_host_op(rt, g, x, value):
    """Run graph ``g`` after a host-lane op that fills ``x`` with ``value`` once a gate opens: the
    run must return at once, not done; then the gate opens and the run finishes."""
    gate = threading.Event()
    rt.submit(lambda: (gate.wait(10), x.fill(value)), writes=[x], run_on="host")
    started = time.perf_counter()
    result = g.run()
    assert time.perf_counter() - started < 0.5 and not result.done()
    gate.set()
    return result.result(timeout=10)


@pytest.mark.parametrize("seed", range(3))
def test_a_graph_over_several_devices_after_a_host_op_is_held_and_returns_at_once(seed):
    """A graph over two devices runs as a host replay, which would wait for a host-lane op it
    follows in the submitting thread; behind one, that run goes op by op, held, and returns at
    once. With nothing to follow, the next run replays as before."""
    from streamdag.backends.sim import SimArray

    def on(device):
        return SimArray(np.zeros(4), device)

    x = np.zeros(4)
    a, b = on("sim:0"), on("sim:1")
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=seed) as rt:
        with rt.record() as g:
            rt.submit(lambda: np.add(a.data, x, out=a.data), reads=[x], writes=[a])
            rt.submit(lambda: np.add(b.data, x * 10, out=b.data), reads=[x], writes=[b])
        for run in range(2):
            run_behind_a_gated_host_op(rt, g, x, run + 1)
        assert g._host_replay is None or not g._host_replay.launched  # both runs went op by op
        g.run().result(timeout=10)  # nothing to follow: the host replay
        assert g._host_replay.launched == 1
    np.testing.assert_array_equal(a.data, [5.0] * 4)  # 1 + 2 + 2
    np.testing.assert_array_equal(b.data, [50.0] * 4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_run_after_a_host_op_is_held_behind_it_and_returns_at_once(kind):
    x, y, z, free = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    with make(kind) as rt:
        with rt.record() as g:
            rt.submit(lambda: y.__setitem__(slice(None), x * 3), reads=[x], writes=[y])
            rt.submit(np.add, y, 1, out=z, reads=[y], writes=[z])
            rt.submit(np.add, free, 1, out=free, writes=[free])  # follows no host op
        for run in range(2):
            run_behind_a_gated_host_op(rt, g, x, 2 + run)
            assert y.tolist() == [6.0 + 3 * run] * 4 and z.tolist() == [7.0 + 3 * run] * 4
        assert free.tolist() == [2.0] * 4


@pytest.mark.parametrize("kind", KINDS)
def test_while_a_host_op_is_pending_device_ops_in_either_form_wait_for_it_only_where_they_follow_it(kind):
    """With a host-lane op pending, a device op that does not touch its memory is submitted as ever
    (the compiled path asks which pending host ops it follows); one that does waits for it, whether
    it declares its buffers in lists or marks them among its arguments (the marks must reach the
    path that waits)."""
    x, y, z = np.zeros(4), np.zeros(4), np.zeros(4)
    gate = threading.Event()
    with make(kind) as rt:
        rt.submit(lambda: (gate.wait(10), x.fill(2)), writes=[x], run_on="host")
        independent = rt.submit(np.add, z, 1, out=z, writes=[z])
        assert independent.result(timeout=5) is z and not gate.is_set()
        threading.Timer(0.2, gate.set).start()
        marked = rt.submit(np.multiply, sd.read(x), 3, out=sd.write(y))
        listed = rt.submit(np.add, x, y, out=z, reads=[x, y], writes=[z])
        assert marked.result(timeout=10) is y and listed.result(timeout=10) is z
        assert y.tolist() == [6.0] * 4 and z.tolist() == [8.0] * 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_run_that_a_submitting_host_op_slips_ahead_of_is_held_behind_it(kind):
    """Another thread submits a host op on the graph's memory just before the run has the runtime's
    lock. The run's ops are held behind it: waiting for it under the lock would hang, since the
    host op submits too, and that takes the lock."""
    x, y, z = np.zeros(4), np.zeros(4), np.zeros(4)
    rt = make(kind)
    with rt.record() as g:
        rt.submit(lambda: y.__setitem__(slice(None), x * 3), reads=[x], writes=[y])
    g.run().result(timeout=10)

    def host_fn():
        x.fill(2)
        rt.submit(np.add, z, 1, out=z, writes=[z])  # from its lane: takes the runtime's lock

    outcome = []
    run = threading.Thread(target=lambda: outcome.append(g.run().result(timeout=30)), daemon=True)
    with rt._lock:  # the run checks now and waits here for the lock, meanwhile ...
        run.start()
        time.sleep(0.2)
        rt.submit(host_fn, writes=[x], run_on="host")  # ... the host op comes first
    run.join(timeout=30)
    assert not run.is_alive(), "the graph run waited for the host op holding the runtime's lock"
    assert outcome and y.tolist() == [6.0] * 4
    rt.synchronize()
    assert z.tolist() == [1.0] * 4
    rt.close()


@pytest.mark.cuda
def test_on_the_gpu_a_host_op_after_a_long_kernel_returns_at_once():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(1 << 20, device="cuda")
        host = torch.empty(1 << 20).pin_memory()
        rt.submit(lambda: (torch.cuda._sleep(2_000_000_000), dev.fill_(3)), writes=[dev])  # ~1 s
        rt.copy(host, dev)
        started = time.perf_counter()
        total = rt.submit(lambda: float(host.sum()), reads=[host], run_on="host")
        # the device op reading what the host op wrote: waits for it, then runs on the GPU
        out = torch.empty(4, device="cuda")
        scratch = np.zeros(4, dtype=np.float32)
        rt.submit(lambda: scratch.fill(host[0].item()), reads=[host], writes=[scratch], run_on="host")
        submitted = time.perf_counter() - started
        assert submitted < 0.5, submitted  # neither submit waited for the kernel (see the module's note)
        assert not total.done()
        assert total.result(timeout=30) == 3.0 * (1 << 20)
        back = rt.submit(lambda: out.copy_(torch.from_numpy(scratch)), reads=[scratch], writes=[out])
        back.result(timeout=30)
        assert out.tolist() == [3.0] * 4


@pytest.mark.cuda
def test_on_the_gpu_a_copy_into_pageable_memory_returns_at_once():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(1 << 22, device="cuda")
        pageable = torch.empty(1 << 22)
        rt.submit(lambda: (torch.cuda._sleep(2_000_000_000), dev.fill_(7)), writes=[dev])
        started = time.perf_counter()
        f = rt.copy(pageable, dev)
        assert time.perf_counter() - started < 0.5
        assert not f.done()
        f.result(timeout=30)
        assert bool((pageable == 7).all())


@pytest.mark.cuda
@pytest.mark.parametrize("callers_stream", ["default", "own"])
def test_on_the_gpu_a_held_op_follows_its_submitters_stream(callers_stream):
    """A held op launches later, from another thread; it still runs after the work its submitter
    enqueued on its current stream before the submit: on the default stream CUDA orders the
    runtime's blocking streams after it, on a stream of the caller's own an event marks it."""
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        made = torch.zeros(1 << 20, device="cuda")
        scale = torch.zeros(1, pin_memory=True)
        out = torch.empty_like(made)
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), scale.fill_(3)), writes=[scale], run_on="host")
        side = torch.cuda.Stream() if callers_stream == "own" else torch.cuda.default_stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # ~1 s: the gate opens long before this ends
            made.fill_(2)  # not declared to the runtime: ordered by the caller's stream alone
            started = time.perf_counter()
            f = rt.submit(lambda: torch.mul(made, scale.item(), out=out), reads=[scale], writes=[out])
            assert time.perf_counter() - started < 0.5
        assert not f.done()
        gate.set()
        assert f.result(timeout=30) is out
        torch.cuda.synchronize()
        assert bool((out == 6).all())


@pytest.mark.cuda
def test_on_the_gpu_a_copy_of_what_a_host_op_writes_is_held_and_returns_at_once():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        host = torch.zeros(1 << 20, pin_memory=True)
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), host.fill_(4)), writes=[host], run_on="host")
        dev = torch.empty(1 << 20, device="cuda")
        started = time.perf_counter()
        copied = rt.copy(dev, host)
        doubled = rt.submit(torch.mul, dev, 2, reads=[dev])  # after the held copy: held too
        assert time.perf_counter() - started < 0.5 and not copied.done()
        gate.set()
        assert bool((doubled.result(timeout=30) == 8).all())


@pytest.mark.cuda
def test_on_the_gpu_a_graph_run_after_a_host_op_is_held_eager_and_captured():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        host = torch.zeros(1 << 16, pin_memory=True)
        dev = torch.empty(1 << 16, device="cuda")
        out = torch.empty_like(dev)
        with rt.record() as g:
            rt.copy(dev, host)
            rt.submit(torch.mul, dev, 2, out=out, reads=[dev], writes=[out])
        for run in range(3):  # the first run op by op, the later ones replay a CUDA graph
            gate = threading.Event()
            rt.submit(lambda gate=gate, value=run + 1: (gate.wait(10), host.fill_(value)), writes=[host],
                      run_on="host")
            started = time.perf_counter()
            result = g.run()
            assert time.perf_counter() - started < 0.5 or run == 1  # (run 1 captures the graph first)
            assert not result.done()
            gate.set()
            result.result(timeout=30)
            assert bool((out == 2 * (run + 1)).all()), run
        assert g.captured and g.last_run_captured


@pytest.mark.cuda
def test_on_the_gpu_a_pageable_copy_of_what_a_host_op_writes_is_staged_on_a_lane_and_returns_at_once():
    import torch

    from streamdag.runtime.transfers import CHUNK_BYTES

    n = CHUNK_BYTES // 4 * 2 + 100  # three chunks of float32
    expected = torch.arange(n, dtype=torch.float32)
    with sd.Runtime("cuda", streams=2) as rt:
        src = torch.zeros(n)  # pageable
        dev = torch.empty(n, device="cuda")
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), src.copy_(expected)), writes=[src], run_on="host")
        started = time.perf_counter()
        copied = rt.copy(dev, src)
        doubled = rt.submit(torch.mul, dev, 2, reads=[dev])
        assert time.perf_counter() - started < 0.5 and not copied.done()
        gate.set()
        assert copied.result(timeout=30) is dev
        assert torch.equal(doubled.result(timeout=30).cpu(), expected * 2)
        rt.synchronize()
        assert all(not ring.lock.locked() for ring in rt._rings.values()) and rt._rings


@pytest.mark.cuda
def test_on_the_gpu_large_pageable_copies_go_through_the_ring_exactly_and_return_at_once():
    """Copies of more chunks than the ring has buffers, both ways, with a ragged end: each buffer is
    refilled only once its DMA is done, and unstaged only once it has arrived. Both submits return
    while a host op that writes the source is held up."""
    import torch

    from streamdag.runtime import transfers

    n = transfers.CHUNK_BYTES // 4 * (transfers.RING_DEPTH + 2) + 777
    expected = torch.randn(n)
    with sd.Runtime("cuda", streams=2) as rt:
        src, back = torch.zeros(n), torch.full((n,), -1.0)  # pageable
        dev = torch.zeros(n, device="cuda")
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), src.copy_(expected)), writes=[src], run_on="host")
        started = time.perf_counter()
        copied_in = rt.copy(dev, src)
        doubled = rt.submit(dev.mul_, 2, writes=[dev])
        copied_out = rt.copy(back, dev)
        assert time.perf_counter() - started < 0.5 and not copied_in.done() and not copied_out.done()
        gate.set()
        assert copied_out.result(timeout=30) is back
        assert copied_in.result(timeout=30) is dev and doubled.done()
        assert torch.equal(back, expected * 2)


@pytest.mark.cuda
def test_on_the_gpu_a_burst_of_large_pageable_copies_one_way_queues_on_one_lane():
    """Copies through one staging ring queue on the lane of its newest pending copy, so a copy the
    other way takes another lane and runs meanwhile, instead of a second lane waiting there for the
    ring while the copy the other way waits for a lane."""
    import torch

    from streamdag.runtime import transfers

    n = transfers.CHUNK_BYTES // 4 * 4  # a few ms each
    with sd.Runtime("cuda", streams=2, host_lanes=2) as rt:
        srcs = [torch.randn(n) for _ in range(3)]
        devs = [torch.empty(n, device="cuda") for _ in range(3)]
        out_dev, back = torch.randn(n, device="cuda"), torch.empty(n)
        torch.cuda.synchronize()
        with rt.profile() as prof:
            ins = [rt.copy(d, s) for d, s in zip(devs, srcs)]
            out = rt.copy(back, out_dev)
            for f in [*ins, out]:
                f.result(timeout=60)
        spans = {s.seq: s for s in prof.timeline.spans}
        h2d = sorted((s for s in spans.values() if s.name == "copy_h2d"), key=lambda s: s.seq)
        (d2h,) = [s for s in spans.values() if s.name == "copy_d2h"]
        assert len(h2d) == 3 and len({s.stream for s in h2d}) == 1, h2d
        assert d2h.stream != h2d[0].stream and d2h.start < h2d[-1].start, (d2h, h2d)
    assert all(torch.equal(d.cpu(), s) for d, s in zip(devs, srcs)) and torch.equal(back, out_dev.cpu())


@pytest.mark.cuda
def test_on_the_gpu_pageable_copies_from_many_threads_share_the_rings_exactly():
    """Threads round-trip their own data through one runtime at once, large copies (the rings, one
    copy at a time each) and small ones (the pool) mixed: every byte comes back."""
    import torch

    from streamdag.runtime import transfers

    sizes = [transfers.CHUNK_BYTES // 4 * 2 + 5, 1000, transfers.LANE_STAGING_BYTES // 4 + 1, 77]
    failures: list[BaseException] = []
    with sd.Runtime("cuda", streams=2) as rt:
        def round_trips(seed: int) -> None:
            try:
                g = torch.Generator().manual_seed(seed)
                for k in range(6):
                    x = torch.randn(sizes[(seed + k) % len(sizes)], generator=g)
                    dev = rt.to_device(x).result(timeout=60)
                    back = torch.empty_like(x)
                    assert rt.copy(back, dev).result(timeout=60) is back
                    assert torch.equal(back, x), (seed, k)
            except BaseException as exc:  # (re-raised in the test's thread)
                failures.append(exc)

        threads = [threading.Thread(target=round_trips, args=(seed,)) for seed in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not failures, failures[0]


@pytest.mark.cuda
def test_on_the_gpu_a_large_pageable_copy_of_a_strided_view_is_refused_at_submit():
    import torch

    with sd.Runtime("cuda") as rt:
        src = torch.zeros(1024, 1024)
        with pytest.raises(ValueError, match="contiguous"):
            rt.copy(torch.empty(1024, 512, device="cuda"), src[:, ::2])


@pytest.mark.cuda
def test_on_the_gpu_a_recorded_graph_with_a_host_op_replays_its_device_parts_and_returns_at_once():
    """A graph holding a host-lane op runs in parts: the device ops before it and those after it
    are CUDA graphs of their own from the second run (which captures them), the host op runs on a
    lane after the kernel it reads, the part after it is held; ``g.run()`` returns while the GPU
    still sleeps; ``explain()`` says how it runs."""
    import torch

    x = torch.ones(1024, device="cuda")
    d, e = torch.empty_like(x), torch.empty_like(x)
    h = torch.zeros(1024, pin_memory=True)
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: (torch.cuda._sleep(2_000_000_000), torch.mul(x, 2, out=d)), reads=[x],
                      writes=[d])
            rt.submit(lambda: h.copy_(d.cpu() + 1), reads=[d], writes=[h], run_on="host")
            rt.submit(lambda: e.copy_(h, non_blocking=True), reads=[h], writes=[e])
        for run in range(4):
            x.fill_(run + 1)  # on the caller's stream: the graph's first op follows it
            started = time.perf_counter()
            result = g.run()
            if run != 1:  # (the second run captures, after a synchronize)
                assert time.perf_counter() - started < 0.5 and not result.done()
            result.result(timeout=30)
            assert g.last_run_captured == (run >= 1)
            assert bool((e == 2 * (run + 1) + 1).all())
        assert "host lane" in g.explain()


@pytest.mark.cuda
def test_on_the_gpu_parts_that_cannot_be_captured_warn_once_for_their_graph():
    """Each device part of a graph with a host-lane op copies from pageable memory, which a CUDA
    graph cannot hold: both parts run eagerly, the graph warns once (not once per part), and
    ``explain()`` counts them."""
    import warnings

    import torch

    x = torch.zeros(1024, device="cuda")
    y = torch.zeros_like(x)
    first_in, second_in = torch.ones(1024), torch.full((1024,), 2.0)  # pageable
    h = torch.zeros(1024, pin_memory=True)
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: x.copy_(first_in), reads=[first_in], writes=[x])
            rt.submit(lambda: h.copy_(x.cpu()), reads=[x], writes=[h], run_on="host")
            rt.submit(lambda: y.copy_(second_in).add_(h.to("cuda")), reads=[second_in, h], writes=[y])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                g.run().result(timeout=30)
        fallbacks = [str(w.message) for w in caught if "without a CUDA graph" in str(w.message)]
        assert len(fallbacks) == 1 and "a part of this graph's device ops" in fallbacks[0], fallbacks
        assert "device parts run eagerly: 2 of 2" in g.explain()
        assert bool((y == 3).all())


@pytest.mark.cuda
def test_on_the_gpu_a_captured_part_waits_only_for_the_host_lane_ops_its_ops_follow():
    """Two host-lane ops side by side, each followed by a device op: replayed as CUDA graphs, the
    part after the quick one runs while the other is still held up (one part for both would be
    one op that waits for both)."""
    import torch

    slow_in, quick_in = torch.zeros(1024, pin_memory=True), torch.zeros(1024, pin_memory=True)
    slow_out, quick_out, both = (torch.zeros(1024, device="cuda") for _ in range(3))
    gate = threading.Event()
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: (gate.wait(30), slow_in.fill_(1)), writes=[slow_in], run_on="host", name="slow")
            rt.submit(lambda: quick_in.fill_(2), writes=[quick_in], run_on="host", name="quick")
            rt.submit(lambda: torch.add(slow_in.to("cuda", non_blocking=True), 10, out=slow_out),
                      reads=[slow_in], writes=[slow_out])
            rt.submit(lambda: torch.add(quick_in.to("cuda", non_blocking=True), 10, out=quick_out),
                      reads=[quick_in], writes=[quick_out])
            rt.submit(torch.add, slow_out, quick_out, out=both, reads=[slow_out, quick_out], writes=[both])
        for run in range(3):  # eager, captured, replayed
            gate.clear()
            quick_out.zero_()  # on the caller's stream: before the graph's ops
            result = g.run()
            deadline = time.monotonic() + 10
            while float(quick_out[0]) != 12.0 and time.monotonic() < deadline:  # the GPU's work, read
                time.sleep(0.001)
            assert float(quick_out[0]) == 12.0 and not result.done(), run
            gate.set()
            result.result(timeout=30)
            assert bool((both == 23).all())
        assert g.last_run_captured


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(6))
def test_on_the_gpu_random_programs_of_device_and_host_lane_ops_equal_serial(seed):
    """Random programs over device buffers and host buffers: device ops that read host memory and
    host-lane ops that read device memory (after the kernels writing it) and write host memory,
    which later device ops read (held until they have finished), some recorded as a graph and run
    twice. The buffers must end as the same program run serially on the CPU leaves them."""
    import random

    import torch

    rng = random.Random(seed)
    n = 64

    def program(length):
        ops = []
        for _ in range(length):
            host = rng.random() < 0.35
            ops.append({"host": host, "dev": rng.randrange(3), "src": rng.randrange(2),
                        "out": rng.randrange(2) if host else rng.randrange(3),
                        "k": rng.randrange(1, 50), "lo": rng.randrange(n // 2),
                        "hi": rng.randrange(n // 2, n) + 1})
        return ops

    def run(op, dev, hosts, device):
        lo, hi = op["lo"], op["hi"]
        if op["host"]:  # host code: reads a device buffer where it is, writes a host buffer
            seen = dev[op["dev"]][lo:hi].cpu().numpy()
            out = hosts[op["out"]][lo:hi]
            out[:] = (out * 7 + seen + hosts[op["src"]][lo:hi] + op["k"]) % 1000003
        else:  # device code: reads a host buffer (copied in) and a device buffer
            src = torch.as_tensor(hosts[op["src"]][lo:hi], device=device)
            out = dev[op["out"]][lo:hi]
            extra = dev[op["dev"]][lo:hi].sum() % 1009 + op["k"]
            out.mul_(3).add_(src).add_(extra).remainder_(1000003)

    def make(device):
        dev = [torch.arange(n, dtype=torch.int64, device=device) * (i + 2) for i in range(3)]
        hosts = [np.arange(n, dtype=np.int64) * (i + 5) for i in range(2)]
        return dev, hosts

    def submit(rt, op, dev, hosts):
        lo, hi = op["lo"], op["hi"]
        reads = [dev[op["dev"]][lo:hi], hosts[op["src"]][lo:hi]]
        if op["host"]:
            return rt.submit(run, op, dev, hosts, "cuda", reads=reads, writes=[hosts[op["out"]][lo:hi]],
                             run_on="host")
        return rt.submit(run, op, dev, hosts, "cuda", reads=reads, writes=[dev[op["out"]][lo:hi]])

    eager, graph_ops, after = program(30), program(8), program(10)
    want_dev, want_hosts = make("cpu")
    for op in eager + graph_ops + graph_ops + after:
        run(op, want_dev, want_hosts, "cpu")
    dev, hosts = make("cuda")
    with sd.Runtime("cuda", streams=3, max_inflight=16) as rt:
        with rt.record() as g:
            for op in graph_ops:
                submit(rt, op, dev, hosts)
        for op in eager:
            submit(rt, op, dev, hosts)
        runs = [g.run(), g.run()]
        for op in after:
            submit(rt, op, dev, hosts)
        rt.synchronize()
        for r in runs:
            r.result(timeout=30)
    for got, want in zip(dev, want_dev):
        assert torch.equal(got.cpu(), want)
    for got, want in zip(hosts, want_hosts):
        np.testing.assert_array_equal(got, want)
