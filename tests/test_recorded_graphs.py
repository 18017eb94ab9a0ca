"""Recorded graphs (``with rt.record() as g`` ... ``g.run()``) on the CPU lanes and the simulated
device: a run does what the recorded ops would do eagerly, ordered with the eager work around it,
and reports failures as eager ops do."""

import threading

import numpy as np
import pytest

import streamdag as sd

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_recorded_graph_runs_many_times_and_explains_itself(rt):
    x = np.ones((8, 8))
    outs = [np.zeros((8, 8)) for _ in range(4)]
    total = np.zeros((8, 8))
    with rt.record() as g:
        nodes = [
            rt.submit(np.matmul, x, x, out=o, reads=[x], writes=[o], name=f"mm{i}")
            for i, o in enumerate(outs)
        ]
        last = rt.submit(lambda: np.add.reduce(outs, out=total), reads=outs, writes=[total], name="join")
    assert isinstance(nodes[0], sd.OpNode)
    assert total.sum() == 0  # nothing ran while recording
    for k in range(1, 4):
        x[...] = k
        res = g.run().result()
        assert res[last] is total
        assert np.all(total == 4 * 8 * k * k)
    text = g.explain()
    assert "levels" in text and "critical path" in text and "waits" in text and "join" in text
    assert g.schedule.width == 4
    assert "digraph" in g.to_dot()


def test_an_empty_recording_is_a_graph_that_runs_nothing(rt):
    with rt.record() as g:
        pass
    assert list(g.run().result()) == []
    assert g.schedule.width == 0 and "0 ops" in g.explain()


def test_recorded_graph_orders_after_earlier_eager_work(rt):
    a = np.zeros(1000)
    with rt.record() as g:
        rt.submit(np.multiply, a, 2, out=a, writes=[a])
    gate = threading.Event()
    rt.submit(lambda: (gate.wait(5), np.add(a, 1, out=a)), writes=[a])
    run = g.run()
    gate.set()
    run.result()
    after = rt.submit(np.sum, a, reads=[a]).result()
    assert after == 2000.0


def test_recorded_ops_given_one_name_keep_distinct_names(rt):
    a, b, c = np.zeros(4), np.zeros(4), np.ones(4)
    with rt.record() as g:
        rt.copy(a, c)
        rt.copy(b, c)
        rt.submit(np.add, a, b, out=a, reads=[a, b], writes=[a], name="copy")
    assert len(set(g.names)) == 3 and all(n.startswith("copy") for n in g.names)
    g.run().result()
    assert np.array_equal(a, 2 * c)


def test_recorded_node_has_no_result_yet(rt):
    a = np.zeros(1)
    with rt.record():
        node = rt.submit(np.sum, a, reads=[a])
    with pytest.raises(RuntimeError, match=r"g\.run"):
        node.result()


def test_graph_run_reports_root_failures(rt):
    a = np.zeros(1)
    with rt.record() as g:
        rt.submit(lambda: 1 / 0, writes=[a], name="div")
        rt.submit(np.sum, a, reads=[a])
    with pytest.raises(sd.ExceptionGroup) as info:
        g.run().result()
    assert [type(e) for e in info.value.exceptions] == [ZeroDivisionError]
    with pytest.raises(sd.ExceptionGroup):
        rt.synchronize()


def test_a_graph_run_fails_when_an_earlier_failure_stops_its_ops(rt):
    """A graph's ops failing for an op submitted before it: the run's future fails too."""
    a = np.zeros(3)

    def boom():
        raise ValueError("before the graph")

    with rt.record() as g:
        rt.submit(np.add, a, 1, out=a, reads=[a], writes=[a])
    rt.submit(boom, writes=[a])
    with pytest.raises(sd.ExceptionGroup) as info:
        g.run().result(timeout=5)
    assert isinstance(info.value.exceptions[0], sd.DependencyFailed)
    with pytest.raises(sd.ExceptionGroup):
        rt.synchronize()


def test_recording_takes_only_the_submits_of_the_thread_inside_the_block(rt):
    a, b = np.zeros(3), np.zeros(3)
    inside, outside = threading.Event(), threading.Event()
    other = {}

    def submit_elsewhere():
        inside.wait(5)
        other["future"] = rt.submit(np.add, b, 1, out=b, writes=[b])
        outside.set()

    t = threading.Thread(target=submit_elsewhere)
    t.start()
    with rt.record() as g:
        rt.submit(np.add, a, 1, out=a, writes=[a])
        inside.set()
        assert outside.wait(5)
    t.join()
    assert isinstance(other["future"], sd.Future) and (other["future"].result(timeout=5) == 1).all()
    assert len(g.names) == 1
    g.run().result(timeout=5)
    assert (a == 1).all()
