"""Recorded graphs with host-lane ops (``run_on="host"``), and graphs and ops over several devices
beside host lanes: each op runs where it falls, a device op after a host-lane op is held until that
has finished, and a graph run held behind one returns at once. On the simulated device(s) and on a
backend that runs each op inside its submit (as CUDA does)."""

import threading
import time

import numpy as np
import pytest

import streamdag as sd
from programs import KINDS, closed_runtime_freed_at_once, make

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


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
